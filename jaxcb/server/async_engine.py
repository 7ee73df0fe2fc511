"""The engine loop in its own thread, and the asyncio face the HTTP handlers use.

The event loop never waits on the device: handlers put commands (add, abort) on a
thread-safe queue and await a future; the engine thread applies the commands between
steps, runs `Engine.step()`, and hands each output to its request's asyncio queue with
`call_soon_threadsafe`. If the loop dies, every open stream gets the error and `/health`
turns 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from jaxcb.engine import Engine
from jaxcb.prompts import PromptType
from jaxcb.errors import EngineDeadError  # noqa: F401  (the server's modules import it from here)
from jaxcb.engine_stats import EngineStats
from jaxcb.output import OutputKind
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    last_read: float = field(default_factory=time.monotonic)
    tokens_read: int = 0  # generated tokens in the last output the reader took
    tokens_sent: int = 0  # generated tokens in the last output put in the queue


class StreamAbortedError(RuntimeError):
    """The server aborted the request (its reader stalled, or the server is shutting down)."""


class RequestStream:
    """The outputs of one request. Iterate it; `close()` aborts the request unless it finished."""

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream):
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self.finished = False
        self.aborted = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._stream.outputs.get()
        self._stream.last_read = time.monotonic()
        if isinstance(out, RequestOutput):
            self._stream.tokens_read = _num_tokens(out)
        if isinstance(out, BaseException):
            self.finished = self.aborted = True
            raise out
        self.finished = out.finished
        return out

    def close(self) -> None:
        self.engine._streams.pop(self.request_id, None)
        if not self.finished:
            self.finished = self.aborted = True
            self.engine._abort_from_any_thread(self.request_id, "client")


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        on_step: Optional[Callable[[EngineStats, list[RequestOutput], float], None]] = None,
        on_abort: Optional[Callable[[str, str], None]] = None,
        *,
        stream_buffer_tokens: int = 1024,
        stream_stall_timeout_s: float = 30.0,
    ):
        self.engine = engine
        self.on_step = on_step  # metrics hook, called in the engine thread after every step
        self.on_abort = on_abort  # (request id, reason) of every abort, called in the engine thread
        self.stream_buffer_tokens = stream_buffer_tokens  # generated tokens waiting for one reader, at most
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="jaxcb-engine", daemon=True)
        self._stopping = threading.Event()
        self.error: Optional[BaseException] = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # --- the asyncio side ----------------------------------------------------------------------

    async def _call(self, fn: Callable, *args):
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running ({self.error!r})")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((fn, args, loop, future))
        return await future

    async def run_in_engine_thread(self, fn: Callable, *args):
        """fn(*args) on the engine's thread, between two steps (the engine is not thread-safe)."""
        return await self._call(fn, *args)

    async def add(
        self, prompt: PromptType, params: SamplingParams, *, request_id: Optional[str] = None, priority: int = 0,
        deadlines: Optional[dict[str, float]] = None, cache_salt: Optional[str] = None, background: bool = False,
        lora: Optional[str] = None,
    ) -> "RequestStream":
        """Queue a request; raises the engine's refusal (InvalidRequestError, EngineOverloadedError) here.
        `deadlines`: Engine.add_request's timeout_s / queue_timeout_s; `cache_salt`: its tenant's;
        `background`: batch work, which yields to every other request."""
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        try:
            await self._call(self._add, prompt, params, request_id, priority, deadlines or {}, cache_salt, background,
                             lora)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return RequestStream(self, request_id, stream)

    async def generate(
        self, prompt: PromptType, params: SamplingParams, *, request_id: Optional[str] = None, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they change (deltas: `outputs.join_deltas` rebuilds the whole);
        leaving early aborts it."""
        stream = await self.add(prompt, params, request_id=request_id, priority=priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> bool:
        return await self._call(self.engine.abort, request_id)

    def _add(self, prompt, params, request_id, priority, deadlines, cache_salt, background, lora=None):
        # Deltas: what a stream sends is what is new, and a step's cost does not grow with the stream.
        return self.engine.add_request(prompt, params, request_id=request_id, priority=priority,
                                       output_kind=OutputKind.DELTA, cache_salt=cache_salt, background=background,
                                       lora=lora, **deadlines)

    def _abort_from_any_thread(self, request_id: str, reason: str) -> None:
        self._commands.put((self._abort, (request_id, reason), None, None))

    def _abort(self, request_id: str, reason: str) -> bool:
        """In the engine thread: abort, count it, and tell a reader that is still there."""
        aborted = self.engine.abort(request_id)
        if aborted and self.on_abort is not None:
            self.on_abort(request_id, reason)
        stream = self._streams.pop(request_id, None)
        if aborted and stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, StreamAbortedError(f"request aborted: {reason}"))
        return aborted

    def abort_all(self, reason: str) -> None:
        for request_id in list(self._streams):
            self._abort_from_any_thread(request_id, reason)

    def _check_slow_readers(self) -> None:
        """A reader that lets outputs pile up (or stops reading) must not hold its blocks forever."""
        now = time.monotonic()
        for request_id, stream in list(self._streams.items()):
            backlog = stream.tokens_sent - stream.tokens_read if stream.outputs.qsize() else 0
            stalled = backlog > 0 and now - stream.last_read > self.stream_stall_timeout_s
            if backlog > self.stream_buffer_tokens or stalled:
                log.warning("aborting %s: its reader %s", request_id, "stalled" if stalled else "fell too far behind")
                self._abort(request_id, "slow_reader")

    # --- the engine thread ---------------------------------------------------------------------

    def _apply_commands(self, block: bool) -> None:
        while True:
            try:
                item = self._commands.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                continue
            self._check_slow_readers()
            fn, args, loop, future = item
            try:
                result, error = fn(*args), None
            except Exception as e:  # a refused request: the caller gets the exception
                result, error = None, e
            if future is not None:
                loop.call_soon_threadsafe(_settle, future, result, error)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if not self.engine.has_unfinished_requests():
                    continue
                start = time.perf_counter()
                outputs, stats = self.engine.step_with_stats()
                if self.on_step is not None:
                    self.on_step(stats, outputs, time.perf_counter() - start)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.tokens_sent = _num_tokens(out)
                        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                self._check_slow_readers()
        except BaseException as e:  # the loop is dead: tell every waiting request
            log.exception("engine loop failed")
            self.error = e
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, EngineDeadError(f"engine loop failed: {e!r}"))


def _num_tokens(out: RequestOutput) -> int:
    return sum(c.num_generated for c in out.outputs)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
