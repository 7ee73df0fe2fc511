"""Responses from the engine's streams: whole (a request's deltas joined once at the end) or
as Server-Sent Events in OpenAI's chunk formats. A client that disconnects -- streaming or
not -- has its request aborted at once (its streams are closed, which aborts in the engine).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxcb.outputs import CompletionOutput, RequestOutput, join_deltas
from jaxcb.server import openai_format as fmt
from jaxcb.server.async_engine import RequestStream, StreamAbortedError
from jaxcb.server.chat import reasoning_tokens
from jaxcb.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from jaxcb.server.app import ServerState

DISCONNECT_POLL_S = 0.05
QUEUE_TIMEOUT = "queue_timeout"  # RequestStatus.FINISHED_QUEUE_TIMEOUT's finish reason


def queue_timeout_error(state: "ServerState") -> APIError:
    """A request that waited past server.max_queue_time_s with nothing generated: 503, retry later."""
    limit = state.cfg.server.max_queue_time_s or 1.0
    return APIError(
        503, f"the request waited more than server.max_queue_time_s={limit:g} s without starting; retry later",
        type="server_error", code="503", headers={"Retry-After": str(max(1, math.ceil(limit)))},
    )


def _timed_out_in_queue(out: RequestOutput) -> bool:
    return any(c.finish_reason == QUEUE_TIMEOUT for c in out.outputs)


class _QueueTimedOut(Exception):
    """A streamed request ended past its queue deadline: the stream ends with a 503 error event."""


async def served_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`merged` outputs; a request past its queue deadline ends the stream (sse_response's 503 event)."""
    async for i, out in merged(streams):
        if _timed_out_in_queue(out):
            raise _QueueTimedOut()
        yield i, out


def close_streams(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


def usage_of(finals: list[RequestOutput]) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, prompt tokens found in the prefix cache) of a request's outputs."""
    return (sum(len(o.prompt_token_ids) for o in finals), sum(c.num_generated for o in finals for c in o.outputs),
            sum(o.num_cached_tokens for o in finals))


async def final_output(stream: RequestStream) -> RequestOutput:
    """The whole output of a request, from its deltas."""
    return join_deltas([out async for out in stream])


async def collect_final_outputs(state: "ServerState", request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Final outputs of every stream; a client that disconnects meanwhile aborts them all."""
    state.num_in_flight += 1
    task = asyncio.ensure_future(asyncio.gather(*(final_output(s) for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                finals = task.result()
                if any(_timed_out_in_queue(out) for out in finals):
                    raise queue_timeout_error(state)
                return finals
            if await request.is_disconnected():
                task.cancel()
                # the streams, aborted below, may end the gather with their error rather than a cancel: read it
                task.add_done_callback(read_exception)
                raise APIError(499, "client disconnected")
    except StreamAbortedError as e:
        raise APIError(503, str(e), type="server_error") from None
    finally:
        state.num_in_flight -= 1
        close_streams(streams)


def sse_response(state: "ServerState", streams: list[RequestStream], events: AsyncIterator[str],
                 error_event: Callable[[APIError], str] = lambda e: fmt.sse(e.body()),
                 done: str = fmt.SSE_DONE, headers: Optional[dict[str, str]] = None) -> StreamingResponse:
    """`events` as a stream; an error on the way ends it with `error_event` (then `done` after a queue
    timeout): the chat and completions chunk streams by default, the Responses API's its own."""
    async def body():
        state.num_in_flight += 1
        try:
            async for event in events:
                yield event
        except StreamAbortedError as e:
            yield error_event(APIError(503, str(e), type="server_error"))
        except _QueueTimedOut:
            yield error_event(queue_timeout_error(state))  # the stream's final event, then `done`
            yield done
        finally:  # also on disconnect: Starlette cancels this generator
            state.num_in_flight -= 1
            close_streams(streams)

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


# Tasks cancelled by a consumer that is gone (a client that disconnected): held until they have run their
# cancellation, since the event loop keeps only weak references and would destroy them still pending.
_ENDING: set[asyncio.Task] = set()


def _kept(task: asyncio.Task) -> asyncio.Task:
    _ENDING.add(task)
    task.add_done_callback(_ENDING.discard)
    return task


def read_exception(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # read, so that asyncio does not report it as never retrieved


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index.

    The hand-over queue holds one item: when the HTTP write waits on a client that does not
    read, the pumps stop taking outputs too, so the backlog (and the stall) shows in the
    request's own stream, where the engine thread looks for slow readers."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [_kept(asyncio.ensure_future(pump(i, s))) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _continuous_usage(req) -> Optional[dict[tuple[int, int], int]]:
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage is its choice's prompt and the tokens it
    generated so far. The counts by (prompt, choice) where asked for, else None."""
    return {} if req.stream_options is not None and req.stream_options.continuous_usage_stats else None


async def completion_events(state, rid, req: CompletionRequest, streams, include_usage) -> AsyncIterator[str]:
    created, tok = int(time.time()), state.client.tokenizer
    sent_text: dict[tuple[int, int], int] = {}  # characters sent so far: the legacy logprobs' text offsets
    sent_done: set[tuple[int, int]] = set()
    finals: dict[int, RequestOutput] = {}
    generated = _continuous_usage(req)
    async for p_idx, out in served_outputs(streams):  # deltas: each output holds only what is new
        for c in out.outputs:
            key = (p_idx, c.index)
            if key in sent_done:
                continue
            if generated is not None:
                generated[key] = generated.get(key, 0) + len(c.token_ids)
            done = fmt.finish_reason(c)
            if done:
                sent_done.add(key)
            if not c.text and not done and ((req.logprobs is None and not req.return_token_ids) or not c.token_ids):
                continue  # nothing to send yet (the text of a character not yet whole)
            first = key not in sent_text
            new_ids = list(c.token_ids)
            if first and req.echo:  # the prompt leads the choice's first chunk
                c = fmt.echo_output(tok, out, c, req.skip_special_tokens).followed_by(c)
            t0 = sent_text.get(key, 0)
            logprobs = (fmt.completion_logprobs(tok, c, 0, t0, req.skip_special_tokens, req.return_tokens_as_token_ids)
                        if req.logprobs is not None else None)
            sent_text[key] = t0 + len(c.text)
            choice = {"index": p_idx * req.n + c.index, "text": c.text, "logprobs": logprobs, "finish_reason": done}
            if first and req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = fmt.prompt_logprobs(tok, out)
            if req.return_token_ids:  # as vLLM streams them: the prompt's with a choice's first chunk, then deltas
                choice["token_ids"] = new_ids
                if first:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
            so_far = None if generated is None else fmt.usage(len(out.prompt_token_ids), generated[key])
            yield fmt.sse(fmt.completion_chunk(rid, req.model, created, [choice], so_far))
        if out.finished:
            finals[p_idx] = out
    if include_usage:
        yield fmt.sse(fmt.completion_chunk(rid, req.model, created, [], fmt.usage(*usage_of(list(finals.values())))))
    yield fmt.SSE_DONE


def _tool_call_delta(d) -> dict:
    """OpenAI's delta.tool_calls[] entry: id, type and name on a call's first piece, then argument fragments."""
    function = {"arguments": d.arguments}
    entry = {"index": d.index, "function": function}
    if d.id is not None:
        entry.update(id=d.id, type="function")
        function["name"] = d.name
    return entry


def _chat_delta(plan, streamers: dict, index: int, text: str, done: Optional[str]) -> tuple[dict, bool]:
    """(the delta of one choice, whether it carries tool calls): what the choice's reply streamer lets out
    (reasoning as `reasoning_content`, content, tool calls). `done`: the choice's finish reason once it has one."""
    if plan is None:
        return ({"content": text} if text else {}), False
    reasoning, content, calls = streamers.setdefault(index, plan.streamer()).feed(text, done)
    delta: dict = {"reasoning_content": reasoning} if reasoning else {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [_tool_call_delta(d) for d in calls]
    return delta, bool(calls)


async def chat_events(state, rid, req: ChatCompletionRequest, streams, include_usage, top_n,
                      plan=None) -> AsyncIterator[str]:
    created, tok = int(time.time()), state.client.tokenizer
    sent_done: set[int] = set()
    held: dict[int, CompletionOutput] = {}  # tokens whose text is not out yet: their logprobs go with it
    streamers: dict = {}  # choice -> its reply streamer (chat.ReplyStreamer)
    called: set[int] = set()  # choices that made tool calls: they finish with "tool_calls"
    sent_prompt: set[int] = set()  # choices whose prompt_logprobs went out (with their first chunk)
    final = None
    replies: dict[int, tuple[list[int], list[str]]] = {}  # choice -> its token ids and text so far (usage's reasoning)
    generated = _continuous_usage(req)
    num_prompt = len(plan.prompt_ids) if plan is not None else 0
    for i in range(req.n):  # the role comes first, as OpenAI sends it
        choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        chunk = fmt.chat_chunk(rid, req.model, created, [choice],
                               None if generated is None or plan is None else fmt.usage(num_prompt, 0))
        if req.return_token_ids and i == 0 and plan is not None:  # vLLM's: the prompt's ids in the first chunk
            chunk["prompt_token_ids"] = list(plan.prompt_ids)
        yield fmt.sse(chunk)
        if plan is not None and plan.echo:  # then the text echoed, as vLLM streams it
            echoed = {"index": i, "delta": {"content": plan.echo}, "logprobs": None, "finish_reason": None}
            yield fmt.sse(fmt.chat_chunk(rid, req.model, created, [echoed],
                                         None if generated is None else fmt.usage(num_prompt, 0)))
    async for _, out in served_outputs(streams):  # deltas: each output holds only what is new
        for c in out.outputs:
            if c.index in sent_done:
                continue
            if generated is not None:
                generated[0, c.index] = generated.get((0, c.index), 0) + len(c.token_ids)
            if include_usage and plan is not None and plan.reasoning is not None:  # kept only where usage counts them
                ids, texts = replies.setdefault(c.index, ([], []))
                ids.extend(c.token_ids)
                texts.append(c.text)
            if c.index in held:
                c = held.pop(c.index).followed_by(c)
            done = fmt.finish_reason(c)
            if done:
                sent_done.add(c.index)
            if not c.text and not done:
                held[c.index] = c
                continue
            delta, calls = _chat_delta(plan, streamers, c.index, c.text, done)
            if calls:
                called.add(c.index)
            logprobs = fmt.chat_logprobs(tok, c, 0, top_n, req.return_tokens_as_token_ids) if req.logprobs else None
            if not delta and not done and logprobs is None and not req.return_token_ids:
                continue  # held back by the tool-call streamer
            finish = "tool_calls" if done == "stop" and c.index in called else done
            choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            if req.prompt_logprobs is not None and c.index not in sent_prompt:
                sent_prompt.add(c.index)
                choice["prompt_logprobs"] = fmt.prompt_logprobs(tok, out)
            so_far = None if generated is None else fmt.usage(len(out.prompt_token_ids), generated[0, c.index])
            yield fmt.sse(fmt.chat_chunk(rid, req.model, created, [choice], so_far))
        if out.finished:
            final = out
    if include_usage and final is not None:
        thought = None
        if plan is not None and plan.reasoning is not None:
            thought = sum(reasoning_tokens(plan, tok, ids, "".join(texts)) for ids, texts in replies.values())
        yield fmt.sse(fmt.chat_chunk(rid, req.model, created, [],
                                     fmt.usage(*usage_of([final]), reasoning_tokens=thought)))
    yield fmt.SSE_DONE
