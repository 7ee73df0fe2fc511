"""Runs /v1/batches: the job runner (jobs.py) over the server's own EngineClient -- the engine in this
process, or the Ray replicas -- never a second engine.

Life of a batch:

1. `POST /v1/batches`: its input file's lines (checked when uploaded, batches.py) must all be for
   its endpoint; the batch is saved `in_progress` and started.
2. Its lines are served concurrently, at most 2 x max_num_seqs lines of all batches at a time, as
   background work (the scheduler admits it after every waiting interactive request and preempts
   it first). Each line goes through the HTTP endpoint's own steps (completions.py): a body the
   endpoint would refuse gets the same refusal as an error line (completions.py's steps, or
   responses_serving.py's for /v1/responses). Each result is appended and
   flushed to `<batch>.results.jsonl` as it finishes, at most once per `custom_id`
   (jobs.ExactlyOnceWriter); `request_counts` follow.
3. When every line has its result: `finalizing`, the results split into the output file (lines
   answered 200) and the error file (the rest), then `completed` (or `expired`, if the 24 h window
   ran out first: lines not started by then are answered `batch_expired`).

Crash safety: a server killed at any point and restarted on the same `server.batch_dir` resumes
every unfinished batch from its results file: a torn last line is cut, a line with a result is
never run again, and finalizing writes the same two files whenever it is repeated. A server that
stops cleanly aborts the lines in flight and resumes them the same way.
Cancel: lines in flight are aborted; lines without a result are answered `batch_cancelled`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from jaxcb.errors import InvalidRequestError
from jaxcb.jobs import ExactlyOnceWriter, repair_and_read_output, serve_planned
from jaxcb.server.async_engine import EngineDeadError
from jaxcb.server.batches import Batch, BatchCreate, BatchLine, BatchStore, batch_usage, read_batch_lines
from jaxcb.server.completions import compile_grammar, plan_body, request_deadlines, response_body
from jaxcb.server.files import FileStore
from jaxcb.server.protocol import APIError
from jaxcb.server.request_log import log_received
from jaxcb.server.responses_output import ResponseWriter
from jaxcb.server.responses_serving import RESPONSES, compile_response_grammar, plan_responses_body, store_response
from jaxcb.server.tracing import RequestTrace

if TYPE_CHECKING:
    from jaxcb.server.app import ServerState

log = logging.getLogger(__name__)
LINES_IN_FLIGHT_PER_SEQ = 2  # enough queued that every step is full, few enough that admission control never fills


def _answered(line_id: str, custom_id: str, status_code: int, body: dict) -> dict[str, Any]:
    """A result line as OpenAI writes it: the endpoint's response (or its error response) and its status."""
    return {"id": f"batch_req_{line_id}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": f"req_{line_id}", "body": body}, "error": None}


def _unanswered(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A result line for a request that never ran (batch_expired, batch_cancelled)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def succeeded(result: dict) -> bool:
    return result["response"] is not None and result["response"]["status_code"] == 200


class BatchRunner:
    """Every batch of this server: created, run, resumed, cancelled, finalized. Files live in `folder`/files,
    batches in `folder`/batches."""

    def __init__(self, state: "ServerState", folder: str):
        self.state = state
        self.files = FileStore(os.path.join(folder, "files"))
        self.store = BatchStore(os.path.join(folder, "batches"))
        self._tasks: dict[str, asyncio.Task] = {}
        self._room: Optional[asyncio.Semaphore] = None  # lines of all batches in flight; made on the serving loop

    # --- lifecycle (the app's lifespan) ---------------------------------------------------------

    def start(self) -> None:
        """Resume every unfinished batch (from before a crash or a restart)."""
        self._room = asyncio.Semaphore(LINES_IN_FLIGHT_PER_SEQ * self.state.client.max_num_seqs)
        for batch in self.store.batches.values():
            if not batch.is_finished:
                log.info("resuming %s (%s)", batch.id, batch.status)
                self._launch(batch)

    async def stop(self) -> None:
        """Abort the lines in flight; their batches resume when the server starts again."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- the API --------------------------------------------------------------------------------

    def create(self, req: BatchCreate) -> Batch:
        file = self.files.get(req.input_file_id, "input_file_id")
        if file["purpose"] != "batch":
            raise APIError(400, f"file {req.input_file_id} has purpose {file['purpose']!r}; a batch's input is a "
                                "file uploaded with purpose 'batch'", param="input_file_id")
        lines = self._lines(req.input_file_id, taken=False)
        for line in lines:
            if line.url != req.endpoint:
                raise APIError(400, f"line {line.line} of {req.input_file_id} is for {line.url}, not the batch's "
                                    f"endpoint {req.endpoint}; every line must use the batch's endpoint",
                               param="endpoint")
        batch = Batch.new(req, len(lines))
        self.store.save(batch)
        self._launch(batch)
        return batch

    def cancel(self, batch_id: str) -> Batch:
        batch = self.store.get(batch_id)
        if batch.status in ("cancelling", "cancelled"):
            return batch
        if batch.is_finished or batch.status == "finalizing":
            raise APIError(409, f"batch {batch_id} is {batch.status}: only a batch in progress can be cancelled",
                           param="batch_id", type="invalid_request_error")
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        self.store.save(batch)
        task = self._tasks.get(batch.id)
        if task is not None and not task.done():  # (a task just ended may not have left _tasks yet)
            task.cancel()  # its lines in flight are aborted; the task then answers the rest and finalizes
        else:  # stopped (the engine failed): it would stay cancelling until a restart; it finalizes now
            self._launch(batch)
        return batch

    def uses_file(self, file_id: str) -> bool:
        """Whether an unfinished batch reads `file_id` (which must then not be deleted)."""
        return any(b.input_file_id == file_id and not b.is_finished for b in self.store.batches.values())

    # --- running one batch ----------------------------------------------------------------------

    def _lines(self, file_id: str, taken: bool = True) -> list[BatchLine]:
        """`taken`: the lines of a batch created, read as they were when it was (batches.read_batch_lines)."""
        content = self.files.read(file_id, "input_file_id")
        try:
            return read_batch_lines(content, self.state.cfg.server.max_request_bytes, taken)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="input_file_id") from None

    def _launch(self, batch: Batch) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch), name=batch.id)
        self._tasks[batch.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch.id, None))

    async def _run(self, batch: Batch) -> None:
        try:
            if batch.status == "in_progress":
                await self._serve_lines(batch)
        except asyncio.CancelledError:
            if batch.status != "cancelling":
                raise  # the server is stopping: the batch resumes when it starts again
            asyncio.current_task().uncancel()
        except Exception:  # the engine is gone: the batch stays in progress and resumes on restart
            log.exception("batch %s stopped; it resumes when the server restarts", batch.id)
            return
        self._finalize(batch)

    async def _serve_lines(self, batch: Batch) -> None:
        path = self.store.results_path(batch)
        done = repair_and_read_output(path, key="custom_id")
        self._recount(batch)
        pending = iter([line for line in self._lines(batch.input_file_id) if line.custom_id not in done])
        out = ExactlyOnceWriter(path, done, key="custom_id")

        async def serve(line: BatchLine) -> dict[str, Any]:
            async with self._room:
                return await self._serve_line(batch, line)

        def written(result: dict[str, Any]) -> None:
            if out.write(result):
                batch.request_counts["completed" if succeeded(result) else "failed"] += 1
                batch.usage = _add_usage(batch.usage, batch_usage([result]))

        try:
            await answer_lines(pending, serve, written, LINES_IN_FLIGHT_PER_SEQ * self.state.client.max_num_seqs)
        finally:
            out.close()

    async def _serve_line(self, batch: Batch, line: BatchLine) -> dict[str, Any]:
        """One line's result: the endpoint's response, or the error response it would give."""
        if time.time() > batch.expires_at:
            return _unanswered(line.custom_id, "batch_expired", "the batch's completion_window (24h) ended "
                                                                "before this request started")
        return await serve_batch_line(self.state, line, f"batch {batch.id}")

    def _recount(self, batch: Batch) -> list[dict]:
        """Its results so far (the results file, repaired), with request_counts set from them."""
        path = self.store.results_path(batch)
        repair_and_read_output(path, key="custom_id")
        results = []
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                results = [json.loads(line) for line in f]
        num_ok = sum(1 for r in results if succeeded(r))
        batch.request_counts.update(completed=num_ok, failed=len(results) - num_ok)
        batch.usage = batch_usage(results)
        return results

    def _finalize(self, batch: Batch) -> None:
        """Answer every line still unanswered (a cancelled batch's), then write its output and error files
        and its final status. Repeatable: a batch finalized again writes the same files."""
        if batch.status == "cancelling":
            path = self.store.results_path(batch)
            out = ExactlyOnceWriter(path, repair_and_read_output(path, key="custom_id"), key="custom_id")
            for line in self._lines(batch.input_file_id):
                out.write(_unanswered(line.custom_id, "batch_cancelled", "the batch was cancelled before this "
                                                                         "request finished"))
            out.close()
        else:
            batch.status, batch.finalizing_at = "finalizing", batch.finalizing_at or int(time.time())
            self.store.save(batch)
        results = self._recount(batch)
        answered = [r for r in results if succeeded(r)]
        failed = [r for r in results if not succeeded(r)]
        batch.output_file_id = self._write_results(batch, "output", answered)
        batch.error_file_id = self._write_results(batch, "error", failed)
        now = int(time.time())
        if batch.status == "cancelling":
            batch.status, batch.cancelled_at = "cancelled", now
        elif any(r["error"] is not None and r["error"]["code"] == "batch_expired" for r in failed):
            batch.status, batch.expired_at = "expired", now
        else:
            batch.status, batch.completed_at = "completed", now
        self.store.save(batch)
        log.info("%s %s: %s", batch.id, batch.status, batch.request_counts)

    def _write_results(self, batch: Batch, kind: str, results: list[dict]) -> Optional[str]:
        if not results:
            return None
        content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results).encode("utf-8")
        return self.files.create(content, f"{batch.id}_{kind}.jsonl", "batch_output", batch.planned_file_id(kind))["id"]


async def answer_lines(lines, serve: Callable[[BatchLine], Awaitable[dict[str, Any]]],
                       written: Callable[[dict[str, Any]], None], workers: int) -> None:
    """`written(await serve(line))` for every line of the iterator `lines`, `workers` lines at a time (a
    server's batch, an offline batch file)."""
    async def worker() -> None:
        for line in lines:  # shared by the workers: each line is taken by one
            written(await serve(line))

    async with asyncio.TaskGroup() as group:
        for _ in range(workers):
            group.create_task(worker())


async def serve_batch_line(state: "ServerState", line: BatchLine, where: str) -> dict[str, Any]:
    """One batch line's result line: its endpoint's response, or the error response it would give, as the same
    body POSTed gets it (`where` names the batch in logs). A line's own failure is its answer (a 500); a dead
    engine is raised (the batch stops, to resume when the engine is back)."""
    line_id, planned, start_ns = uuid.uuid4().hex, None, time.time_ns()
    try:
        if line.url == RESPONSES:
            body = plan_responses_body(state, line.body)
            planned = body.planned
            _refuse_stream(body.req)
            if body.req.background:
                raise InvalidRequestError("background: a batch line's response is written to the batch's "
                                          "output when it finishes; drop background", "background")
            await compile_response_grammar(state, body)
        else:
            body = plan_body(state, line.url, line.body)
            planned = body.planned
            _refuse_stream(body.req)
            await compile_grammar(state, planned)
        deadlines = request_deadlines(state, planned.timeout, queued=False)
        if line.url == RESPONSES:
            writer = ResponseWriter(body.req, planned.chat, body.req.model, state.client.tokenizer)
            rid = writer.id
        else:
            rid, _ = body.response_id()
        log_received(state, rid, f"{line.url} ({where}, line {line.custom_id!r})", planned)
        finals = await serve_planned(state.client, planned, deadlines=deadlines, background=True)
        if line.url == RESPONSES:
            response = writer.whole(finals[0])
            store_response(state, body, response)
        else:
            response = response_body(state, rid, body, finals)
        if state.tracer is not None:  # a line is a request too: one span, in a trace of its own
            trace = RequestTrace({}, start_ns, rid, planned.params, dict(enumerate(finals)))
            state.tracer.record(trace, state.model_name, time.time_ns())
        return _answered(line_id, line.custom_id, 200, response)
    except InvalidRequestError as e:
        e = planned.refusal(e) if planned is not None else e
        return _answered(line_id, line.custom_id, 400, APIError(400, str(e), param=e.field).body())
    except APIError as e:
        return _answered(line_id, line.custom_id, e.status, e.body())
    except EngineDeadError:
        raise  # the batch stops and resumes when the server starts again
    except Exception as e:  # a failure of this line alone is its answer: it never holds the batch back for good
        log.exception("%s: line %s failed", where, line.custom_id)
        return _answered(line_id, line.custom_id, 500, APIError(
            500, f"the server failed on this line ({type(e).__name__}); the batch went on without it",
            type="server_error").body())


def _add_usage(a: Optional[dict], b: dict) -> dict:
    """Two BatchUsage objects summed field by field (their details too)."""
    if a is None:
        return b
    return {k: _add_usage(a[k], v) if isinstance(v, dict) else a[k] + v for k, v in b.items()}


def _refuse_stream(req: Any) -> None:
    """A batch line's response is written whole: streaming is refused, as a JSONL job refuses it."""
    if req.stream or getattr(req, "stream_options", None) is not None:
        field = "stream" if req.stream else "stream_options"
        raise InvalidRequestError(f"{field}: a batch writes each response whole; drop {field}", field)
