"""/v1/responses as the steps that the HTTP handler and the batch runner share, as completions.py is
for chat and completions: a body checked and planned (`plan_responses_body`), its grammar compiled
off the engine's thread, and a whole response kept in the response store as `store` asks. One path,
so that a batch line is served, or refused, exactly as the same body POSTed would be. And background
responses (`background: true`): answered at once, run as a task whose progress the store shows. No jax.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


def start_in_background(state: "ServerState", planned: PlannedResponse, writer: ResponseWriter, streams: list,
                        trace=None) -> dict[str, Any]:
    """A background response, its request queued (`streams`): stored "queued" and returned at once, then run
    by a task that marks it "in_progress" at its first token and stores it whole when it ends ("failed" with
    its error if it fails, "cancelled" if cancelled: POST /v1/responses/{id}/cancel, or a DELETE). The store
    never drops it while it runs; `trace` (tracing on): its span, recorded when the run ends."""
    queued = writer.response("queued", [])
    state.responses.put(queued, None)
    if trace is not None:
        trace.deferred = True
    task = asyncio.get_running_loop().create_task(_run_in_background(state, planned, writer, streams, trace),
                                                  name=writer.id)
    state.background_responses[writer.id] = task
    task.add_done_callback(lambda _: state.background_responses.pop(writer.id, None))
    return dict(queued)


async def _run_in_background(state: "ServerState", planned: PlannedResponse, writer: ResponseWriter,
                             streams: list, trace=None) -> None:
    from jaxcb.outputs import join_deltas
    from jaxcb.server.streaming import _QueueTimedOut, close_streams, queue_timeout_error, served_outputs

    def stand(status: str, **fields: Any) -> None:  # the stored response as it now stands (if still stored)
        if state.responses.contains(writer.id):
            state.responses.put(writer.response(status, []) | fields, None)

    outputs = []
    state.num_in_flight += 1  # a graceful shutdown gives it server.shutdown_timeout_s, as any request in flight
    try:
        async for _, out in served_outputs(streams):
            if not outputs:
                stand("in_progress")
            outputs.append(out)
        response = writer.whole(join_deltas(outputs))
        if state.responses.contains(writer.id):  # (not when deleted meanwhile)
            store_response(state, planned, response)
    except asyncio.CancelledError:
        stand("cancelled")
        raise
    except _QueueTimedOut:
        error = queue_timeout_error(state)
        stand("failed", error={"code": "queue_timeout", "message": error.message})
    except Exception as e:  # the engine died, the server is stopping, or a bug: the response says it failed
        log.warning("background response %s failed: %r", writer.id, e)
        stand("failed", error={"code": "server_error", "message": f"{type(e).__name__}: {e}"})
    finally:
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
