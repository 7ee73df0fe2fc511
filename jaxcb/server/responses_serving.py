"""/v1/responses as the steps that the HTTP handler and the batch runner share, as completions.py is
for chat and completions: a body checked and planned (`plan_responses_body`), its grammar compiled
off the engine's thread, and a whole response kept in the response store as `store` asks. One path,
so that a batch line is served, or refused, exactly as the same body POSTed would be. And background
responses (`background: true`): answered at once, run as a task whose progress the store shows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from jaxcb.errors import InvalidRequestError
from jaxcb.server.completions import check_model, compile_grammar
from jaxcb.server.requests import PlannedRequest
from jaxcb.server.responses import ResponsePlan, ResponsesRequest, parse_responses_request, plan_response, responses_field
from jaxcb.server.responses_output import ResponseWriter, reply_messages

if TYPE_CHECKING:
    from jaxcb.server.app import ServerState

RESPONSES = "/v1/responses"
log = logging.getLogger(__name__)


@dataclass
class PlannedResponse:
    """A Responses body as the engine will serve it: the parsed body and its plan."""

    req: ResponsesRequest
    plan: ResponsePlan

    @property
    def planned(self) -> PlannedRequest:
        return self.plan.planned


def plan_responses_body(state: "ServerState", body: Any) -> PlannedResponse:
    """`body` (decoded JSON), checked and planned; InvalidRequestError / APIError naming the Responses field."""
    srv = state.cfg.server
    req = parse_responses_request(body)
    check_model(state, req.model)
    plan = plan_response(req, state.responses, state.client.tokenizer, state.tool_parser(), state.client.max_model_len,
                         srv.tool_prompt_fallback, state.reasoning_parser, srv.structured_outputs_in_reasoning,
                         state.client.sampling_defaults)
    return PlannedResponse(req, plan)


async def compile_response_grammar(state: "ServerState", planned: PlannedResponse) -> None:
    """compile_grammar, a refusal named by the Responses field it came from (text.format, not response_format)."""
    try:
        await compile_grammar(state, planned.planned)
    except InvalidRequestError as e:
        raise responses_field(e) from None


def store_response(state: "ServerState", planned: PlannedResponse, response: dict[str, Any]) -> None:
    """Keep `response` for previous_response_id and GET when its body asked (`store`); its `store` field then
    says whether it was kept (not with server.responses_store_size=0)."""
    response["store"] = planned.req.store and state.responses.put(
        response, planned.plan.history + reply_messages(response["output"]))


class EventLog:
    """A background response's events, as its run writes them (SSE text; event i has sequence_number i): read
    from any point by the POST that asked to stream it and by GET /v1/responses/{id}?stream=true, while it runs
    and after it has ended."""

    def __init__(self):
        self.events: list[str] = []
        self.ended = False
        self._changed = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read(self, starting_after: int = -1) -> AsyncIterator[str]:
        """Its events after sequence number `starting_after`, then each as it comes, until the run has ended."""
        i = starting_after + 1
        while True:
            changed = self._changed
            if i < len(self.events):
                yield self.events[i]
                i += 1
            elif self.ended:
                return
            else:
                await changed.wait()


def start_in_background(state: "ServerState", planned: PlannedResponse, writer: ResponseWriter, streams: list,
                        trace=None) -> EventLog:
    """A background response, its request queued (`streams`): stored "queued" at once (the POST answers it, or
    streams its log), then run by a task that writes its events to the returned log, marks it "in_progress" at
    its first token and stores it whole when it ends ("failed" with its error if it fails, "cancelled" if
    cancelled: POST /v1/responses/{id}/cancel, or a DELETE). The store never drops it while it runs; `trace`
    (tracing on): its span, recorded when the run ends."""
    state.responses.put(writer.response("queued", []), None)
    for response_id in [i for i in state.background_events if not state.responses.contains(i)]:
        del state.background_events[response_id]  # (their responses dropped from the store since)
    events = EventLog()
    if planned.req.stream:  # only these can be streamed again (OpenAI's rule): the others' events are not kept
        state.background_events[writer.id] = events
    if trace is not None:
        trace.deferred = True
    task = asyncio.get_running_loop().create_task(
        _run_in_background(state, planned, writer, streams, events, trace), name=writer.id)
    state.background_responses[writer.id] = task

    def ended(_) -> None:
        state.background_responses.pop(writer.id, None)
        if not events.ended:  # cancelled before its first step: its body never ran, nor its `finally`
            from jaxcb.server.streaming import close_streams

            close_streams(streams)
            events.end()
            if state.responses.contains(writer.id):
                state.responses.put(writer.response("cancelled", []), None)

    task.add_done_callback(ended)
    return events


class _FirstOutput:
    """A stream that calls `first()` at its first output."""

    def __init__(self, stream, first: Callable[[], None]):
        self._stream, self._first = stream, first

    def __aiter__(self):
        return self

    async def __anext__(self):
        out = await self._stream.__anext__()
        if self._first is not None:
            self._first, first = None, self._first
            first()
        return out

    def close(self) -> None:
        self._stream.close()


async def _run_in_background(state: "ServerState", planned: PlannedResponse, writer: ResponseWriter,
                             streams: list, events: EventLog, trace=None) -> None:
    from jaxcb.server.async_engine import StreamAbortedError
    from jaxcb.server.protocol import APIError
    from jaxcb.server.streaming import _QueueTimedOut, close_streams, queue_timeout_error

    def stand(status: str, **fields: Any) -> None:  # the stored response as it now stands (if still stored)
        if state.responses.contains(writer.id):
            state.responses.put(writer.response(status, []) | fields, None)

    def finished(response: dict[str, Any]) -> None:  # before the stream's last event, as in the foreground
        if state.responses.contains(writer.id):  # (not when deleted meanwhile)
            store_response(state, planned, response)

    state.num_in_flight += 1  # a graceful shutdown gives it server.shutdown_timeout_s, as any request in flight
    watched = [_FirstOutput(streams[0], lambda: stand("in_progress")), *streams[1:]]
    try:
        async for event in writer.events(watched, finished):
            events.append(event)
    except asyncio.CancelledError:
        stand("cancelled")
        raise
    except _QueueTimedOut:
        error = queue_timeout_error(state)
        stand("failed", error={"code": "queue_timeout", "message": error.message})
        events.append(writer.error_event(error))
    except StreamAbortedError as e:  # the server aborted it (stopping, say): a 503's reason, as in the foreground
        stand("failed", error={"code": "server_error", "message": str(e)})
        events.append(writer.error_event(APIError(503, str(e), type="server_error")))
    except Exception as e:  # the engine died, or a bug: the response says it failed
        log.warning("background response %s failed: %r", writer.id, e)
        stand("failed", error={"code": "server_error", "message": f"{type(e).__name__}: {e}"})
        events.append(writer.error_event(APIError(500, f"{type(e).__name__}: {e}", type="server_error")))
    finally:
        events.end()
        state.num_in_flight -= 1
        close_streams(streams)
        if trace is not None and trace.outputs and state.tracer is not None:
            state.tracer.record(trace, state.model_name, time.time_ns())


async def cancel_in_background(state: "ServerState", response_id: str) -> bool:
    """Cancel the background response's run (its request aborted, its status "cancelled"); False: none runs."""
    task = state.background_responses.get(response_id)
    if task is None or task.done():  # (one that has just ended is not cancelled)
        return False
    task.cancel()
    await asyncio.wait({task})
    return True
