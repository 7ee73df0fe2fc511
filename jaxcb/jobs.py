"""Offline generation from the command line: JSONL jobs (JSONL in, JSONL out, crash-safe and exactly
once per id), and the configured prompts (`generate_prompts`). In Python, use `jaxcb.LLM`.

Input: one JSON object a line, with `id` and either the fields of a /v1/completions body
(`prompt`: text, token ids, or a list of them) or those of a /v1/chat/completions body
(`messages`, tools included); `model` may be left out. A record is read by the same code as an
HTTP body (`server/requests.py`), so it is served or refused exactly as the HTTP API would.
Output: one line per id with `id`, `text`, `token_ids`, `finish_reason`, `usage` (plus
`logprobs`, `prompt_logprobs`, `tool_calls` when asked for or made); with several completions
(`n` > 1 or several prompts) the completions go in `choices`, as a completions response has
them. A record that cannot be served gets `id`, `error` and `field` (the job goes on).

Crash safety: each result is appended and flushed as it finishes. A rerun of the same
command first cuts a torn last line (a write interrupted by a crash), then skips every id
already written; so after any number of crashes (SIGKILL included) each id appears exactly
once. Duplicate ids in the input are refused before any work starts.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Optional, Union

from tqdm import tqdm

from jaxcb.beam_search import EngineBeamSearches, beam_searches
from jaxcb.config import Config
from jaxcb.engine import LLM
from jaxcb.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, UserError
from jaxcb.outputs import RequestOutput, join_deltas
from jaxcb.request_fields import loads_request
from jaxcb.sampling_params import SamplingParams
from jaxcb.server import openai_format as fmt
from jaxcb.server.chat import assistant_message
from jaxcb.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request, served_model_name
from jaxcb.server.beam_streams import start_planned_beam_search
from jaxcb.server.requests import PlannedRequest, plan_chat_completion, plan_completion
from jaxcb.server.reasoning import get_reasoning_parser
from jaxcb.server.tool_parsers import get_tool_parser
from jaxcb.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from jaxcb.tokenizer import Tokenizer, tools_chat_template

if TYPE_CHECKING:
    from jaxcb.server.engine_client import EngineClient

log = logging.getLogger(__name__)
FSYNC_EVERY = 64
_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass
class JobRecord:
    line: int
    id: Optional[str]
    data: Optional[dict]
    error: Optional[str] = None


@dataclass
class JobReport:
    num_input: int
    num_skipped: int  # already in the output
    num_done: int = 0
    num_errors: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def read_input(path: str) -> list[JobRecord]:
    if not os.path.isfile(path):
        raise UserError(f"input={path} does not exist; give a JSONL file of {{'id': ..., 'prompt': ...}} records")
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is that line's error, not the job's end
        content = f.read().removeprefix(codecs.BOM_UTF8)  # an editor's byte order mark is not part of line 1
    records = []
    # The line ends text mode reads; never U+2028 or NEL, which JSON strings may hold as they are.
    for n, raw in enumerate(_LINE_END.split(content), 1):
        if not raw.strip():
            continue
        try:
            data = loads_request(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            records.append(JobRecord(n, None, None, f"line {n} is not UTF-8 text: {e}"))
            continue
        except InvalidRequestError as e:
            records.append(JobRecord(n, None, None, f"line {n} is not a record: {e}"))
            continue
        if not isinstance(data, dict):
            records.append(JobRecord(n, None, None, f"line {n} is not a record: not a JSON object"))
            continue
        # bool is an int to Python, but `true` is no id: it would be written as "True"
        if not isinstance(data.get("id"), (str, int)) or isinstance(data["id"], bool):
            records.append(JobRecord(n, None, None, f"line {n} has no string or integer 'id'"))
            continue
        records.append(JobRecord(n, str(data["id"]), data))
    ids = [r.id for r in records if r.id is not None]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise UserError(f"input={path} has duplicate ids {dupes[:10]}; every id must be unique")
    return records


def done_key(record: JobRecord) -> Union[str, tuple[int, str]]:
    """What marks `record` as done in the output: its id; for a line that is not a record (no id), its line
    number and error, so that a rerun reports it again only if the line changed."""
    return record.id if record.id is not None else (record.line, record.error)


def repair_and_read_output(path: str, key: str = "id") -> set[Union[str, tuple[int, str]]]:
    """The `key` of every record already written (`done_key` for a line error); a torn last line (no
    newline: the write was cut short) is removed first."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("output=%s: removing a torn last line of %d bytes", path, len(data) - end)
            f.truncate(end)
            data = data[:end]
    done: set[Union[str, tuple[int, str]]] = set()
    # Only "\n" ends a record: json.dumps(ensure_ascii=False) writes U+2028 or NEL in a text as they are,
    # and str.splitlines would cut the record there.
    for n, line in enumerate(data.split(b"\n")[:-1], 1):
        try:
            record = json.loads(line.decode("utf-8"))
            value = record[key]
            done.add(str(value) if value is not None else (record["line"], record["error"]))
        except (ValueError, KeyError, TypeError) as e:  # ValueError: not JSON, or not UTF-8
            raise UserError(f"output={path} line {n} is not a result record ({e}); move the file away or fix it") from None
    return done


class CompletionRecord(CompletionRequest):
    id: Union[str, int]
    model: Optional[str] = None


class ChatRecord(ChatCompletionRequest):
    id: Union[str, int]
    model: Optional[str] = None


@dataclass(frozen=True)
class JobContext:
    """What reading a record needs of the engine that serves it."""

    cfg: Config
    tokenizer: Tokenizer
    max_model_len: int
    sampling_defaults: SamplingDefaults = NO_DEFAULTS  # the model's, for the fields a record leaves out

    @classmethod
    def of(cls, llm: LLM) -> "JobContext":
        return cls(llm.engine.cfg, llm.tokenizer, llm.engine.max_model_len, llm.engine.sampling_defaults)


def plan_record(ctx: JobContext, data: dict) -> tuple[Union[CompletionRecord, ChatRecord], PlannedRequest]:
    """A record as engine requests, through the HTTP API's own path; InvalidRequestError naming the field."""
    if "messages" in data:
        req = parse_request(ChatRecord, data)
    elif "prompt" in data:
        req = parse_request(CompletionRecord, data)
    else:
        raise InvalidRequestError("the record has neither 'prompt' nor 'messages'", "prompt")
    cfg = ctx.cfg
    if isinstance(req, ChatRecord):
        template = ctx.tokenizer.chat_template
        parser = get_tool_parser(cfg.server.tool_call_parser, tools_chat_template(ctx.tokenizer))
        # Reasoning as the chat endpoint reads it: reasoning_content apart, grammars after </think>.
        planned = plan_chat_completion(req, ctx.tokenizer, parser, ctx.max_model_len, cfg.server.tool_prompt_fallback,
                                       get_reasoning_parser(cfg.server.reasoning_parser, template),
                                       cfg.server.structured_outputs_in_reasoning, ctx.sampling_defaults)
    else:
        planned = plan_completion(req, ctx.sampling_defaults, tokenizer=ctx.tokenizer)
    if req.model is not None and req.model != served_model_name(cfg) and not cfg.lora.enabled:
        # (with LoRA, Engine.add_request checks the name: the base's or a loaded adapter's)
        raise InvalidRequestError(f"model {req.model!r} is not the model of this job ({served_model_name(cfg)!r}); "
                                  "drop model or give that name", "model")
    if req.request_id is not None:
        raise InvalidRequestError("request_id: a job's result is named by the record's id (there is no response id "
                                  "to set); drop request_id", "request_id")
    if req.stream or req.stream_options is not None:
        raise InvalidRequestError("stream: a job writes each result whole; drop stream and stream_options",
                                  "stream" if req.stream else "stream_options")
    return req, planned


@dataclass
class _PendingRecord:
    id: str
    req: Union[CompletionRecord, ChatRecord]
    planned: PlannedRequest
    outputs: list[Optional[RequestOutput]]  # one per prompt, as they finish

    @property
    def done(self) -> bool:
        return all(o is not None for o in self.outputs)


def result_record(tok: Tokenizer, rec: _PendingRecord) -> dict[str, Any]:
    """A finished record's result line: as the completions (or chat) response would carry it."""
    req, chat = rec.req, rec.planned.chat
    choices = []
    for p_idx, out in enumerate(rec.outputs):
        for c in out.outputs:
            skip = rec.planned.params.skip_special_tokens
            shown = fmt.echo_output(tok, out, c, skip).followed_by(c) if chat is None and req.echo else c
            choice: dict[str, Any] = {"index": p_idx * req.n + c.index, "text": shown.text,
                                      "token_ids": c.token_ids, "finish_reason": fmt.finish_reason(c)}
            if chat is not None:
                message, choice["finish_reason"] = assistant_message(chat, c.text, fmt.finish_reason(c))
                choice["text"] = chat.echo + (message["content"] or "") if chat.echo else message["content"]
                for key in ("tool_calls", "reasoning_content"):
                    if key in message:
                        choice[key] = message[key]
                if req.logprobs:
                    choice["logprobs"] = fmt.chat_logprobs(tok, c, 0, req.top_logprobs or 0,
                                                           req.return_tokens_as_token_ids)
            elif req.logprobs is not None:
                choice["logprobs"] = fmt.completion_logprobs(tok, shown, 0, 0, skip, req.return_tokens_as_token_ids)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = fmt.prompt_logprobs(tok, out)
            if req.return_token_ids:  # (a result always has its token_ids)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choices.append(choice)
    usage = {"prompt_tokens": sum(len(o.prompt_token_ids) for o in rec.outputs),
             "completion_tokens": sum(len(c.token_ids) for o in rec.outputs for c in o.outputs)}
    if len(choices) == 1:
        del choices[0]["index"]
        return {"id": rec.id, **choices[0], "usage": usage}
    return {"id": rec.id, "choices": choices, "usage": usage}


def _failed_record(record_id: Optional[str], error: Exception) -> dict[str, Any]:
    """The result of a record the engine failed on (a bug it met, not a refusal of the record)."""
    return {"id": record_id, "error": f"the engine failed on this record ({type(error).__name__}: {error}); the job "
                                      "went on without it"}


def _error_record(record_id: Optional[str], error: Exception) -> dict[str, Any]:
    record = {"id": record_id, "error": str(error)}
    if getattr(error, "field", None) is not None:
        record["field"] = error.field
    return record


class _Writer:
    def __init__(self, path: str):
        self.f = open(path, "a", encoding="utf-8")
        self.count = 0

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.f.flush()  # in the OS once written: a killed process loses nothing it reported
        self.count += 1
        if self.count % FSYNC_EVERY == 0:
            os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


class ExactlyOnceWriter:
    """Appends records to a JSONL file, each `key` at most once, those already in the file included.

    A record whose key is already written (on an earlier run, or by a replica whose batch was
    also retried elsewhere) is dropped: that is what keeps an output exactly once per id whatever
    the backend retries. Used by jobs (`JobOutput`, key `id`) and by /v1/batches (`custom_id`)."""

    def __init__(self, path: str, done_ids: set[str], key: str = "id"):
        self.key = key
        self.written_ids = set(done_ids)
        self._writer = _Writer(path)

    def write(self, record: dict) -> bool:
        """Append one record; False (nothing written) if its key is already in the output."""
        record_id = record.get(self.key)
        if record_id is not None:
            if record_id in self.written_ids:
                return False
            self.written_ids.add(record_id)
        self._writer.write(record)
        return True

    def close(self) -> None:
        self._writer.close()


class JobOutput:
    """The one writer of a job's output file: counts results and writes each id at most once."""

    def __init__(self, path: str, report: JobReport, done_ids: set[str], total: int):
        self.report = report
        self._out = ExactlyOnceWriter(path, done_ids)
        self._bar = tqdm(total=total, desc="job", unit="rec")
        self._start = time.perf_counter()

    @property
    def written_ids(self) -> set[str]:
        return self._out.written_ids

    def write(self, result: dict) -> bool:
        """Append one result record; False (nothing written) if its id is already in the output."""
        if not self._out.write(result):
            return False
        if "error" in result:
            self.report.num_errors += 1
        else:
            self.report.num_done += 1
            self.report.output_tokens += result["usage"]["completion_tokens"]
        self._bar.update(1)
        elapsed = max(1e-9, time.perf_counter() - self._start)
        self._bar.set_postfix(tok_s=f"{self.report.output_tokens / elapsed:.0f}")
        return True

    def close(self) -> None:
        self.report.seconds = time.perf_counter() - self._start
        self._bar.close()
        self._out.close()


def generate_results(llm: LLM, records: list[JobRecord], max_in_flight: int) -> Iterator[dict]:
    """Result records of `records` in the order they finish: one engine, continuously batched.

    A record that cannot be read or fails validation yields an `error` record at once and the
    rest go on; at most `max_in_flight` engine requests are queued at a time."""
    engine, ctx = llm.engine, JobContext.of(llm)
    queue = deque(records)
    in_flight: dict[str, tuple[_PendingRecord, int]] = {}  # engine request id -> (its record, prompt index)
    searching: list[tuple[_PendingRecord, EngineBeamSearches]] = []  # records with use_beam_search, their rounds
    while queue or in_flight or searching:
        while queue and len(in_flight) + sum(s.num_in_flight for _, s in searching) < max_in_flight:
            rec = queue.popleft()
            if rec.id is None or rec.error:  # unreadable line: report it, keyed by its line
                yield {"id": rec.id, "line": rec.line, "error": rec.error}
                continue
            added: list[str] = []
            planned: Optional[PlannedRequest] = None
            try:
                req, planned = plan_record(ctx, rec.data)
                pending = _PendingRecord(rec.id, req, planned, [None] * len(planned.prompts))
                if planned.beam is not None:
                    searches = beam_searches(planned.prompts, planned.beam, ctx.tokenizer, ctx.max_model_len,
                                             engine.limits.max_n, planned.params.truncate_prompt_tokens)
                    driver = EngineBeamSearches(engine, searches, priority=planned.priority,
                                                cache_salt=planned.cache_salt, lora=planned.model,
                                                timeout_s=planned.timeout)
                    driver.start()
                    searching.append((pending, driver))
                    continue
                for i, prompt in enumerate(planned.prompts):
                    rid = engine.add_request(prompt, planned.params, priority=planned.priority, final_only=True,
                                             cache_salt=planned.cache_salt, timeout_s=planned.timeout,
                                             lora=planned.model)
                    added.append(rid)
                    in_flight[rid] = (pending, i)
            except (InvalidRequestError, EngineOverloadedError) as e:
                for rid in added:  # a record is served whole or not at all
                    engine.abort(rid)
                    in_flight.pop(rid, None)
                if isinstance(e, EngineOverloadedError) and (in_flight or searching):
                    # scheduler.max_waiting_* is full for now: the record waits for room (as over an EngineClient);
                    # only one that could not fit an idle queue is its own error
                    queue.appendleft(rec)
                    break
                if planned is not None and isinstance(e, InvalidRequestError):
                    e = planned.refusal(e)  # the record's own name for the field (chat's top_logprobs)
                yield _error_record(rec.id, e)
            except Exception as e:  # a failure of this record alone is its result: the job goes on
                for rid in added:
                    engine.abort(rid)
                    in_flight.pop(rid, None)
                log.exception("job record %s failed", rec.id)
                yield _failed_record(rec.id, e)
        for out in engine.step():  # final outputs only
            entry = in_flight.pop(out.request_id, None)
            if entry is None:  # a round of a beam search, or a request aborted above after its record was refused
                for k, (pending, driver) in enumerate(searching):
                    try:
                        if not driver.take(out):
                            continue
                    except Exception as e:  # (its next round refused: a failure of this record alone)
                        driver.abort()
                        del searching[k]
                        log.exception("job record %s failed", pending.id)
                        yield _failed_record(pending.id, e)
                        break
                    if driver.done:
                        pending.outputs = driver.results()
                        del searching[k]
                        yield result_record(ctx.tokenizer, pending)
                    break
                continue
            pending, i = entry
            pending.outputs[i] = out
            if pending.done:
                yield result_record(ctx.tokenizer, pending)
        for pending, driver in list(searching):  # rounds the engine said to retry later, and searches past their time
            driver.flush()
            if driver.done:
                pending.outputs = driver.results()
                searching.remove((pending, driver))
                yield result_record(ctx.tokenizer, pending)


async def serve_planned(client: "EngineClient", planned: PlannedRequest, *, deadlines: Optional[dict[str, float]] = None,
                        background: bool = False) -> list[RequestOutput]:
    """The final output of each of `planned`'s prompts, served over `client`. A refusal that says "retry
    later" (the server's admission control) is waited out, not returned: offline work waits for room.
    The prompts are queued whole or not at all. `background`: work that yields to interactive requests
    (Engine.add_request)."""
    while True:
        streams = []
        try:
            if planned.beam is not None:
                streams = await start_planned_beam_search(client, planned, deadlines, background)
                break
            for prompt in planned.prompts:
                streams.append(await client.add(prompt, planned.params, priority=planned.priority, deadlines=deadlines,
                                                cache_salt=planned.cache_salt, background=background,
                                                lora=planned.model))
            break
        except EngineOverloadedError as e:
            for stream in streams:
                stream.close()
            await asyncio.sleep(min(e.retry_after_s, 1.0))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
    return list(await asyncio.gather(*(_final_output(s) for s in streams)))


async def generate_results_over(client: "EngineClient", cfg: Config, records: list[JobRecord],
                                max_in_flight: int) -> AsyncIterator[dict]:
    """`generate_results` over an EngineClient (a serving engine, in this process or on Ray replicas):
    the same records give the same result lines. A refusal that says "retry later" (the server's
    admission control) is retried, not written: a job waits for room."""
    ctx = JobContext(cfg, client.tokenizer, client.max_model_len, client.sampling_defaults)
    room = asyncio.Semaphore(max_in_flight)

    async def run(rec: JobRecord) -> dict:
        if rec.id is None or rec.error:
            return {"id": rec.id, "line": rec.line, "error": rec.error}
        planned = None
        try:
            req, planned = plan_record(ctx, rec.data)
            if client.grammars is not None and planned.params.structured_outputs is not None:
                await asyncio.to_thread(client.grammars.compile, planned.params.structured_outputs)
            deadlines = {"timeout_s": float(planned.timeout)} if planned.timeout is not None else None
            async with room:
                outputs = await serve_planned(client, planned, deadlines=deadlines)
        except InvalidRequestError as e:
            return _error_record(rec.id, planned.refusal(e) if planned is not None else e)
        except EngineDeadError:
            raise
        except Exception as e:  # a failure of this record alone is its result: the job goes on
            log.exception("job record %s failed", rec.id)
            return _failed_record(rec.id, e)
        return result_record(ctx.tokenizer, _PendingRecord(rec.id, req, planned, outputs))

    for done in asyncio.as_completed([asyncio.ensure_future(run(r)) for r in records]):
        yield await done


async def _final_output(stream) -> RequestOutput:
    try:
        return join_deltas([out async for out in stream])
    finally:
        stream.close()


def max_in_flight(llm: LLM) -> int:
    """Requests one engine keeps queued during a job: enough that every step can be full."""
    return 4 * llm.engine.scheduler_config.max_num_seqs


def run_job(cfg: Config, input_path: str, output_path: str) -> JobReport:
    """Run the records of `input_path` not yet in `output_path`, on cfg.job.backend; append their results. An
    OpenAI batch file (lines with custom_id, url and body) runs as jaxcb.batch_job runs it."""
    if not os.path.isfile(input_path):
        read_input(input_path)  # its sentence
    from jaxcb.batch_job import is_batch_file, run_batch_file

    if is_batch_file(input_path, cfg.server.max_request_bytes):
        return run_batch_file(cfg, input_path, output_path)
    records = read_input(input_path)
    check_output(input_path, output_path)
    done = repair_and_read_output(output_path)
    pending = [r for r in records if done_key(r) not in done]
    report = JobReport(num_input=len(records), num_skipped=len(records) - len(pending))
    if not pending:
        return report

    def open_output() -> JobOutput:  # once the engines are up: the clock times generation, not start-up
        return JobOutput(output_path, report, done, len(pending))

    if cfg.job.backend == "ray":
        from jaxcb.distributed.ray_jobs import run_on_ray_replicas

        run_on_ray_replicas(cfg, pending, open_output)
        return report
    llm = LLM(cfg, progress=False)
    output = open_output()
    try:
        for result in generate_results(llm, pending, max_in_flight(llm)):
            output.write(result)
    finally:
        output.close()
    return report


def check_output(input_path: str, output_path: str) -> None:
    """Refuse, before any work, an output that would lose records: the input itself (its records would
    read as results and its last line could be cut as torn) or a path that cannot be written."""
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise UserError(f"output={output_path} is the input file; give another path for the results")
    try:
        with open(output_path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise UserError(f"output={output_path} cannot be written ({e.strerror}); give a file in a folder that "
                        "exists and can be written") from None


@dataclass
class GenerationReport:
    outputs: list[RequestOutput]
    seconds: float

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs for c in o.outputs)


def generate_prompts(cfg: Config, prompts: list[str]) -> GenerationReport:
    """The configured prompts (`generate.prompts`) through `LLM.generate`: scripts/generate.py without input=."""
    g = cfg.generate
    try:
        params = SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, seed=g.seed)
        llm = LLM(cfg)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
    except InvalidRequestError as e:
        raise UserError(str(e)) from e
    return GenerationReport(outputs, time.perf_counter() - start)
