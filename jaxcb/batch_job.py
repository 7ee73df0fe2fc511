"""An OpenAI batch input file run offline (`scripts/generate.py input=batch.jsonl output=out.jsonl`), as vLLM's
`run_batch` runs one: lines of `{"custom_id", "method": "POST", "url", "body"}` for /v1/chat/completions,
/v1/completions or /v1/responses, each answered by the steps the server's /v1/batches runs (the same body
POSTed gets the same answer), its result line in OpenAI's batch output format, errors included, in one file.

The file is checked whole before anything runs, by the rules of a /v1/files upload (a line that could
never run stops the job, naming it). Crash-safe as every job: each result is appended and flushed as it
finishes, at most once per custom_id; a rerun skips the custom_ids already in the output. Beside
`jobs.py`, whose records are `{"id", "prompt" | "messages", ...}`; `run_job` takes either kind of file.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import re
import time
from jaxcb.config import Config
from jaxcb.errors import InvalidRequestError, UserError


def is_batch_file(path: str, max_line_bytes: int, lines_read: int = 20) -> bool:
    """Whether `path` holds OpenAI batch lines (objects with a custom_id) rather than job records: the first of
    its first `lines_read` lines that is a JSON object says (lines of up to `max_line_bytes`,
    server.max_request_bytes, split as a batch upload splits them)."""
    with open(path, "rb") as f:
        head = f.read(lines_read * (max_line_bytes + 2)).removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="replace")
    for raw in [line for line in re.split(r"\r\n|\r|\n", head) if line.strip()][:lines_read]:
        try:
            first = json.loads(raw)
        except ValueError:
            continue  # (its reader names that line)
        if isinstance(first, dict):  # a batch line's keys, and none of a job record's
            return "custom_id" in first and ("url" in first or "body" in first) and \
                not {"id", "prompt", "messages"} & first.keys()
    return False


def run_batch_file(cfg: Config, input_path: str, output_path: str, engine=None):
    """Answer every line of the batch file `input_path` not yet in `output_path`; append the result lines.
    `engine`: one already built (tests), else one is built from cfg. Returns the job's report."""
    from jaxcb.jobs import JobReport, check_output, repair_and_read_output
    from jaxcb.server.batches import read_batch_lines

    if cfg.job.backend == "ray" or cfg.server.backend == "ray":
        raise UserError("input= is an OpenAI batch file: it runs on one engine in this process (job.backend=local); "
                        "for Ray replicas, serve it with scripts/serve.py server.backend=ray and POST /v1/batches")
    with open(input_path, "rb") as f:
        content = f.read()
    try:
        lines = read_batch_lines(content, cfg.server.max_request_bytes)
    except InvalidRequestError as e:
        raise UserError(f"input={input_path} is not a batch file that can run: {e}") from None
    check_output(input_path, output_path)
    done = repair_and_read_output(output_path, key="custom_id")
    pending = [line for line in lines if line.custom_id not in done]
    report = JobReport(num_input=len(lines), num_skipped=len(lines) - len(pending))
    if pending:
        from jaxcb.errors import EngineDeadError

        try:
            asyncio.run(_serve(cfg, pending, output_path, done, report, engine))
        except* EngineDeadError as group:
            raise UserError(f"the engine failed ({group.exceptions[0]}); the lines answered so far are in "
                            f"output={output_path}: rerun to answer the rest") from None
    return report


async def _serve(cfg: Config, lines: list, output_path: str, done: set, report, engine) -> None:
    from tqdm import tqdm

    from jaxcb.engine import Engine
    from jaxcb.jobs import ExactlyOnceWriter
    from jaxcb.server.app import ServerState
    from jaxcb.server.batch_runner import LINES_IN_FLIGHT_PER_SEQ, answer_lines, serve_batch_line, succeeded
    from jaxcb.server.batches import batch_usage

    # The server's state without its HTTP app: its engine in this process, without admission control (offline
    # work waits for room), nothing of /v1/batches' own store touched.
    state = ServerState(cfg, engine if engine is not None else Engine(cfg, progress=False), batches=False)
    state.client.start()
    out = ExactlyOnceWriter(output_path, done, key="custom_id")
    bar = tqdm(total=len(lines), desc="batch", unit="line")
    start = time.perf_counter()
    where = f"batch file {os.path.basename(output_path)}"

    def written(result: dict) -> None:
        if not out.write(result):
            return
        if succeeded(result):
            report.num_done += 1
            report.output_tokens += batch_usage([result])["output_tokens"]
        else:
            report.num_errors += 1
        bar.update(1)

    try:
        await answer_lines(iter(lines), lambda line: serve_batch_line(state, line, where), written,
                           LINES_IN_FLIGHT_PER_SEQ * state.client.max_num_seqs)
    finally:
        report.seconds = time.perf_counter() - start
        bar.close()
        out.close()
        state.client.stop()
        if state.tracer is not None:
            state.tracer.shutdown()  # its spans flushed
