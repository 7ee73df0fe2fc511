"""Offline generation from the command line: JSONL jobs (JSONL in, JSONL out, crash-safe and exactly
once per id), and the configured prompts (`generate_prompts`). In Python, use `jaxcb.LLM`.

Input: one JSON object a line, with `id`, and `prompt` (text or token ids) or `messages`
(a chat), plus optional sampling fields (max_tokens, temperature, top_p, top_k, min_p,
repetition/presence/frequency_penalty, seed, stop, stop_token_ids, ignore_eos, min_tokens) and
constraints (structured_outputs, response_format, logit_bias, allowed_token_ids, bad_words).
Output: one line per id with `id`, `text`, `token_ids`, `finish_reason`, `usage` -- or `id`
and `error` for a record that failed validation (the job goes on).

Crash safety: each result is appended and flushed as it finishes. A rerun of the same
command first cuts a torn last line (a write interrupted by a crash), then skips every id
already written; so after any number of crashes (SIGKILL included) each id appears exactly
once. Duplicate ids in the input are refused before any work starts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from tqdm import tqdm

from jaxcb.config import Config
from jaxcb.engine import LLM
from jaxcb.errors import EngineOverloadedError, InvalidRequestError, UserError
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams
from jaxcb.request_fields import check_fields, reject_non_finite
from jaxcb.structured.spec import from_response_format, from_structured_outputs
from jaxcb.tokenizer import chat_prompt_ids

log = logging.getLogger(__name__)
SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
)
CONSTRAINT_FIELDS = ("structured_outputs", "response_format", "logit_bias", "allowed_token_ids", "bad_words")
RECORD_FIELDS = frozenset({"id", "prompt", "messages", "cache_salt", *SAMPLING_FIELDS, *CONSTRAINT_FIELDS})
MESSAGE_FIELDS = frozenset({"role", "content", "name"})
FSYNC_EVERY = 64


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
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line, parse_constant=reject_non_finite)
            except (json.JSONDecodeError, InvalidRequestError) as e:
                records.append(JobRecord(n, None, None, f"line {n} is not valid JSON: {e}"))
                continue
            except RecursionError:
                records.append(JobRecord(n, None, None, f"line {n} nests JSON too deeply to be a record"))
                continue
            if not isinstance(data, dict) or not isinstance(data.get("id"), (str, int)):
                records.append(JobRecord(n, None, None, f"line {n} has no string or integer 'id'"))
                continue
            records.append(JobRecord(n, str(data["id"]), data))
    ids = [r.id for r in records if r.id is not None]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise UserError(f"input={path} has duplicate ids {dupes[:10]}; every id must be unique")
    return records


def repair_and_read_output(path: str) -> set[str]:
    """Ids already written; a torn last line (no newline: the write was cut short) is removed first."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("output=%s: removing a torn last line of %d bytes", path, len(data) - end)
            f.truncate(end)
            data = data[:end]
    done = set()
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"output={path} line {n} is not a result record ({e}); move the file away or fix it") from None
    return done


def _request(llm: LLM, data: dict) -> tuple[Any, SamplingParams, Optional[str]]:
    """A record's prompt, sampling parameters and cache_salt (its tenant's), or InvalidRequestError."""
    data = check_fields(data, RECORD_FIELDS)
    if "messages" in data:
        if not isinstance(data["messages"], list) or not data["messages"]:
            raise InvalidRequestError("messages must be a non-empty list of {role, content}")
        messages = [check_fields(m, MESSAGE_FIELDS, f"messages.{i}.") if isinstance(m, dict) else m
                    for i, m in enumerate(data["messages"])]
        prompt: Any = chat_prompt_ids(llm.tokenizer, messages)
    elif "prompt" in data:
        prompt = data["prompt"]
        if not isinstance(prompt, (str, list)) or not prompt:
            raise InvalidRequestError("prompt must be a non-empty string or list of token ids")
    else:
        raise InvalidRequestError("the record has neither 'prompt' nor 'messages'")
    kwargs = {k: data[k] for k in SAMPLING_FIELDS if k in data}
    kwargs.update(_constraints(data))
    try:
        return prompt, SamplingParams(**kwargs), data.get("cache_salt")
    except TypeError as e:
        raise InvalidRequestError(str(e)) from None


def _constraints(data: dict) -> dict[str, Any]:
    """SamplingParams' constraint fields from a record (the server's names and forms)."""
    out: dict[str, Any] = {}
    if "structured_outputs" in data and "response_format" in data:
        raise InvalidRequestError("structured_outputs and response_format both constrain the output; give one")
    if data.get("structured_outputs") is not None:
        out["structured_outputs"] = from_structured_outputs(data["structured_outputs"])
    if data.get("response_format") is not None:
        out["structured_outputs"] = from_response_format(data["response_format"])
    bias = data.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(str(k).lstrip("-").isdigit() and isinstance(v, (int, float))
                                                 for k, v in bias.items()):
            raise InvalidRequestError("logit_bias must map token ids to numbers, e.g. {\"42\": -100}")
        out["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
    ids = data.get("allowed_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("allowed_token_ids must be a list of token ids")
        out["allowed_token_ids"] = ids
    words = data.get("bad_words")
    if words is not None:
        if not isinstance(words, list):
            raise InvalidRequestError("bad_words must be a list of strings")
        out["bad_words"] = words
    return out


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


class JobOutput:
    """The one writer of a job's output file: counts results and writes each id at most once.

    Every backend hands its results here as they finish. A result for an id already written
    (on an earlier run, or by a replica whose batch was also retried elsewhere) is dropped,
    which is what keeps the output exactly once per id whatever the backend retries."""

    def __init__(self, path: str, report: JobReport, done_ids: set[str], total: int):
        self.report = report
        self.written_ids = set(done_ids)
        self._writer = _Writer(path)
        self._bar = tqdm(total=total, desc="job", unit="rec")
        self._start = time.perf_counter()

    def write(self, result: dict) -> bool:
        """Append one result record; False (nothing written) if its id is already in the output."""
        record_id = result.get("id")
        if record_id is not None:
            if record_id in self.written_ids:
                return False
            self.written_ids.add(record_id)
        self._writer.write(result)
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
        self._writer.close()


def generate_results(llm: LLM, records: list[JobRecord], max_in_flight: int) -> Iterator[dict]:
    """Result records of `records` in the order they finish: one engine, continuously batched.

    A record that cannot be read or fails validation yields an `error` record at once and the
    rest go on; at most `max_in_flight` requests are queued in the engine at a time."""
    engine = llm.engine
    queue = deque(records)
    in_flight: dict[str, str] = {}  # engine request id -> record id
    while queue or in_flight:
        while queue and len(in_flight) < max_in_flight:
            rec = queue.popleft()
            if rec.id is None or rec.error:  # unreadable line: report it, keyed by its line
                yield {"id": rec.id, "line": rec.line, "error": rec.error}
                continue
            try:
                prompt, params, cache_salt = _request(llm, rec.data)
                in_flight[engine.add_request(prompt, params, final_only=True, cache_salt=cache_salt)] = rec.id
            except (InvalidRequestError, EngineOverloadedError) as e:
                yield {"id": rec.id, "error": str(e)}
        for out in engine.step():  # final outputs only
            c = out.outputs[0]
            yield {
                "id": in_flight.pop(out.request_id), "text": c.text, "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(c.token_ids)},
            }


def max_in_flight(cfg: Config) -> int:
    """Requests one engine keeps queued during a job: enough that every step can be full."""
    return 4 * cfg.scheduler.max_num_seqs


def run_job(cfg: Config, input_path: str, output_path: str) -> JobReport:
    """Run the records of `input_path` not yet in `output_path`, on cfg.job.backend; append their results."""
    records = read_input(input_path)
    done = repair_and_read_output(output_path)
    pending = [r for r in records if r.id is None or r.id not in done]
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
        for result in generate_results(llm, pending, max_in_flight(cfg)):
            output.write(result)
    finally:
        output.close()
    return report


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
