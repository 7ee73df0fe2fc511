"""OpenAI's Batch API: what a batch input file and a `POST /v1/batches` body must hold, and the batch
object as it is kept on disk (`BatchStore`, under `server.batch_dir`/batches). Running a batch is
batch_runner.py's.

A batch file is JSONL of `{"custom_id", "method": "POST", "url", "body"}`: each line is checked when
the file is uploaded (a line that could never be run is a 400 naming its line), its body when it runs,
by the code that checks the same body POSTed to `url` (completions.py, responses_serving.py). Fail closed: every field of
a line and of a create body is honoured or refused by name. No jax.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from jaxcb.errors import InvalidRequestError
from jaxcb.request_fields import loads_request
from jaxcb.server.completions import CHAT_COMPLETIONS, COMPLETIONS
from jaxcb.server.files import sortable_id, write_json_atomically
from jaxcb.server.protocol import APIError
from jaxcb.server.responses_serving import RESPONSES

ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, RESPONSES)
COMPLETION_WINDOW = "24h"  # the one window OpenAI offers; a batch unfinished by then expires
COMPLETION_WINDOW_S = 24 * 3600
LINE_FIELDS = ("custom_id", "method", "url", "body")
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
# OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
REFUSED_CREATE_FIELDS = {
    "output_expires_after": "output_expires_after is not supported: a batch's files are kept until deleted",
}


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based, in the input file
    custom_id: str
    url: str
    body: dict[str, Any]


def read_batch_lines(content: bytes, max_line_bytes: int, taken: bool = False) -> list[BatchLine]:
    """The lines of a batch input file; InvalidRequestError (param `file`) naming the first bad line.
    `taken`: the file of a batch already created, read as it was taken: a limit lowered since
    (server.max_request_bytes) or a check added since (a key given twice) must not strand it in progress."""
    try:
        text = content.decode("utf-8-sig")  # an editor's byte order mark is not part of the first line
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"file: a batch file must be UTF-8 JSONL ({e})", "file") from None
    lines, seen = [], set()
    # The line ends text mode reads: str.splitlines would also cut at U+2028 or NEL, which JSON strings hold as they are.
    for n, raw in enumerate(re.split(r"\r\n|\r|\n", text), 1):
        if not raw.strip():
            continue
        where = f"file line {n}"
        if not taken and len(raw.encode("utf-8")) > max_line_bytes:
            raise InvalidRequestError(f"{where} is longer than server.max_request_bytes={max_line_bytes}, the "
                                      "largest request body this server takes", "file")
        try:
            data = loads_request(raw, repeated_keys=taken)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{where} is not a JSON object a batch takes ({e})", "file") from None
        if not isinstance(data, dict):
            raise InvalidRequestError(f"{where} is not a JSON object", "file")
        for key in data:
            if key not in LINE_FIELDS:
                raise InvalidRequestError(f"{where}: {key} is not a field of a batch line; remove it (known: "
                                          f"{', '.join(LINE_FIELDS)})", "file")
        for key in LINE_FIELDS:
            if key not in data:
                raise InvalidRequestError(f"{where} has no {key}; every line is {{{', '.join(LINE_FIELDS)}}}", "file")
        custom_id, method, url, body = (data[k] for k in LINE_FIELDS)
        if not isinstance(custom_id, str) or not custom_id:
            raise InvalidRequestError(f"{where}: custom_id must be a non-empty string", "file")
        if custom_id in seen:
            raise InvalidRequestError(f"{where}: custom_id {custom_id!r} is used by an earlier line; every "
                                      "custom_id must be unique (each is answered exactly once)", "file")
        seen.add(custom_id)
        if method != "POST":
            raise InvalidRequestError(f"{where}: method {method!r} must be 'POST'", "file")
        if url not in ENDPOINTS:
            raise InvalidRequestError(f"{where}: url {url!r} is not an endpoint batches serve; use one of "
                                      f"{', '.join(ENDPOINTS)}", "file")
        if not isinstance(body, dict):
            raise InvalidRequestError(f"{where}: body must be a JSON object (the request body for {url})", "file")
        lines.append(BatchLine(n, custom_id, url, body))
    if not lines:
        raise InvalidRequestError("file: a batch file needs at least one line", "file")
    return lines


@dataclass
class BatchCreate:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Optional[dict[str, str]] = None


def parse_batch_create(body: Any) -> BatchCreate:
    """A `POST /v1/batches` body; InvalidRequestError naming the field at fault."""
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    known = {f.name for f in fields(BatchCreate)}
    for key in body:
        if key in REFUSED_CREATE_FIELDS:
            raise InvalidRequestError(REFUSED_CREATE_FIELDS[key], key)
        if key not in known:
            raise InvalidRequestError(f"{key} is not a field jaxcb knows; remove it (known: {', '.join(sorted(known))})",
                                      key)
    for key in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(key), str):
            raise InvalidRequestError(f"{key} is required, as a string", key)
    req = BatchCreate(**body)
    if req.endpoint not in ENDPOINTS:
        raise InvalidRequestError(f"endpoint {req.endpoint!r} is not served by batches; use one of "
                                  f"{', '.join(ENDPOINTS)}", "endpoint")
    if req.completion_window != COMPLETION_WINDOW:
        raise InvalidRequestError(f"completion_window {req.completion_window!r} is not offered; use "
                                  f"{COMPLETION_WINDOW!r}", "completion_window")
    _check_metadata(req.metadata)
    return req


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs",
                                  "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise InvalidRequestError(f"metadata.{key}: keys are strings of at most {MAX_METADATA_KEY} characters "
                                      f"and values strings of at most {MAX_METADATA_VALUE}", f"metadata.{key}")


@dataclass
class Batch:
    """OpenAI's batch object, as `GET /v1/batches/{id}` returns it and as it is kept on disk."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    # jaxcb checks a batch's file when it is uploaded and the batch when it is created (a bad line or field is a 400
    # naming it), so a batch is never seen "validating" and never "failed" by validation: `errors` stays null.
    status: str = "in_progress"
    in_progress_at: Optional[int] = None
    finalizing_at: Optional[int] = None
    completed_at: Optional[int] = None
    failed_at: Optional[int] = None
    expired_at: Optional[int] = None
    cancelling_at: Optional[int] = None
    cancelled_at: Optional[int] = None
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    errors: Optional[dict] = None
    request_counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    metadata: Optional[dict[str, str]] = None
    usage: Optional[dict[str, Any]] = None  # OpenAI's BatchUsage: the tokens of the lines answered so far

    @classmethod
    def new(cls, req: BatchCreate, num_lines: int) -> "Batch":
        now = int(time.time())
        return cls(sortable_id("batch_"), req.endpoint, req.input_file_id, req.completion_window, now,
                   now + COMPLETION_WINDOW_S, in_progress_at=now, metadata=req.metadata,
                   request_counts={"total": num_lines, "completed": 0, "failed": 0})

    @property
    def is_finished(self) -> bool:
        return self.status not in UNFINISHED

    def planned_file_id(self, kind: str) -> str:
        """The id its output ("output") or error ("error") file gets: known in advance, so that a batch
        finalized twice (a crash in between) writes the same files."""
        return f"file-{self.id.removeprefix('batch_')}-{kind}"

    def object(self) -> dict[str, Any]:
        return {"object": "batch", **asdict(self)}


def batch_usage(results: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's BatchUsage over result lines: the usage of every response body, summed (lines that got an error
    response or never ran used no tokens)."""
    prompt = cached = completion = reasoning = 0
    for r in results:
        body = (r.get("response") or {}).get("body") or {}
        u = body.get("usage") if isinstance(body, dict) else None
        if not u:
            continue
        if "input_tokens" in u:  # a Responses body's usage
            prompt += u["input_tokens"]
            completion += u["output_tokens"]
            cached += (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
            reasoning += (u.get("output_tokens_details") or {}).get("reasoning_tokens", 0)
            continue
        prompt += u["prompt_tokens"]
        completion += u["completion_tokens"]
        cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        reasoning += (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


class BatchStore:
    """Batch objects by id, each a JSON file in `folder` (made by the first batch), with its results file beside it."""

    def __init__(self, folder: str):
        self.folder = folder
        self.batches: dict[str, Batch] = {}
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if name.endswith(".json"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    batch = Batch(**json.load(f))
                self.batches[batch.id] = batch

    def save(self, batch: Batch) -> None:
        self.batches[batch.id] = batch
        os.makedirs(self.folder, exist_ok=True)
        write_json_atomically(os.path.join(self.folder, batch.id + ".json"), asdict(batch))

    def results_path(self, batch: Batch) -> str:
        """Its lines' results as they finish, in the job runner's crash-safe, exactly-once file."""
        return os.path.join(self.folder, batch.id + ".results.jsonl")

    def get(self, batch_id: str) -> Batch:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id", type="not_found_error")
        return batch

    def newest_first(self) -> list[Batch]:
        return sorted(self.batches.values(), key=lambda b: b.id, reverse=True)  # ids sort by creation
