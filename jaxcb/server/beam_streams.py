"""Beam search over an EngineClient (the server, its batches, JSONL jobs over a server): each prompt's search
(`jaxcb.beam_search.BeamSearch`) runs its rounds as requests of the client, and the handlers read it as
one more request stream whose one output is its result. The first round is queued before the caller
answers (its refusal is the request's); later rounds wait out admission control. No jax.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Optional

from jaxcb.beam_search import BeamSearch, beam_searches, width_refusal
from jaxcb.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from jaxcb.outputs import RequestOutput
from jaxcb.server.async_engine import StreamAbortedError
from jaxcb.server.streaming import close_streams, final_output, read_exception
from jaxcb.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxcb.server.engine_client import EngineClient, OutputStream
    from jaxcb.server.requests import PlannedRequest


# Queues one round's request for `prompt_ids` with at most `timeout_s` left of the request's own deadline
# (None: none), with the caller's priority, salt and adapter (and, on the first round only, its queue
# deadline: `first`); returns its stream.
AddRound = Callable[[list[int], Optional[float], bool], Awaitable["OutputStream"]]


async def start_beam_searches(searches: list[BeamSearch], add_round: AddRound, tokenizer: Tokenizer,
                              timeout_s: Optional[float] = None) -> list["BeamSearchStream"]:
    """Queue every search's first round: the engine's refusal of it is raised here, with nothing left queued.
    Then each search goes on by itself, its stream's one output its result. A later round waits out the
    engine's "retry later" (admission control) rather than fail half-way, and has no queue deadline (the
    request has started); `timeout_s` bounds the whole search (past it, the search ends with what it has,
    its live beams' finish_reason "timeout"), and a later round the engine refuses (its adapter unloaded
    meanwhile) ends it with "abort"."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first: list[list] = []
    try:
        for search in searches:
            first.append([])
            for prompt in search.round_prompts():
                first[-1].append(await add_round(prompt, timeout_s, True))
    except BaseException as e:
        for streams in first:
            close_streams(streams)
        if isinstance(e, InvalidRequestError):
            raise width_refusal(e, searches[0].params) from None
        raise
    return [BeamSearchStream(asyncio.ensure_future(_searched(search, streams, add_round, tokenizer, deadline)),
                             streams)
            for search, streams in zip(searches, first)]


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else deadline - time.monotonic()


async def _searched(search: BeamSearch, streams: list, add_round: AddRound, tokenizer: Tokenizer,
                    deadline: Optional[float]) -> RequestOutput:
    request_id = None
    while True:
        try:
            finals = await asyncio.gather(*(final_output(s) for s in streams))
        finally:
            close_streams(streams)
        request_id = request_id or finals[0].request_id
        search.advance(finals)
        streams = []
        try:
            for prompt in [] if search.done else search.round_prompts():
                while (left := _left(deadline)) is None or left > 0:
                    try:
                        streams.append(await add_round(prompt, left, False))
                        break
                    except EngineOverloadedError as e:
                        await asyncio.sleep(min(e.retry_after_s, 1.0, *([] if left is None else [left])))
                else:
                    search.cut_short = "timeout"
                    break
        except InvalidRequestError:  # (the first round was taken: the request itself was not at fault)
            search.cut_short = "abort"
        except EngineDeadError as e:  # mid-search: as a request in flight meets it (a stream's 503 error event)
            close_streams(streams)
            raise StreamAbortedError(str(e)) from None
        except BaseException:
            close_streams(streams)
            raise
        if search.done:
            close_streams(streams)
            return search.result(request_id, tokenizer)


class BeamSearchStream:
    """A beam-searched prompt as the server's handlers read a request (an async iterator of outputs): one
    output, the whole result, when its search ends; closing it cancels the search (its round in flight is
    aborted, the first round's too if the search had not started)."""

    def __init__(self, task: "asyncio.Future[RequestOutput]", first_round: list):
        self.task, self._first_round, self._given = task, first_round, False
        task.add_done_callback(read_exception)  # a search whose reader left: its error is not reported as never read

    def __aiter__(self) -> "BeamSearchStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._given:
            raise StopAsyncIteration
        out = await asyncio.shield(self.task)
        self._given = True
        out.delta = True  # its only output: all of it is new
        return out

    def close(self) -> None:
        self.task.cancel()
        close_streams(self._first_round)  # (closing a closed stream does nothing)


async def start_planned_beam_search(client: "EngineClient", planned: "PlannedRequest",
                                    deadlines: Optional[dict[str, float]] = None, background: bool = False) -> list:
    """`planned`'s prompts beam-searched over `client` (planned.beam set): their first round queued (the engine's
    refusal raised here, nothing left queued), one stream each whose one output is the prompt's result.
    `deadlines` as Engine.add_request takes them: timeout_s bounds the whole search, queue_timeout_s its first
    round."""
    beam = planned.beam
    deadlines = dict(deadlines or {})
    timeout_s = deadlines.pop("timeout_s", None)
    searches = beam_searches(planned.prompts, beam, client.tokenizer, client.max_model_len, client.max_n,
                             planned.params.truncate_prompt_tokens)

    async def add_round(prompt_ids: list[int], left_s: Optional[float], first: bool):
        # queue_timeout_s: a request that has not started; a later round belongs to one that has
        rounds_deadlines = (deadlines if first else {}) | ({} if left_s is None else {"timeout_s": left_s})
        return await client.add(prompt_ids, beam.round_params, priority=planned.priority, deadlines=rounds_deadlines,
                                cache_salt=planned.cache_salt, background=background, lora=planned.model)

    return await start_beam_searches(searches, add_round, client.tokenizer, timeout_s)
