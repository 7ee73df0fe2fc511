"""JSONL generation jobs: errors per record, exactly once per id across crashes, torn lines repaired."""

import json
import os
import signal
import subprocess
import sys
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ("scheduler.max_num_batched_tokens=32", "scheduler.max_num_seqs=4", "engine.max_model_len=128",
         "engine.token_buckets=[16]")


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def job(tmp_path, inp, out, *extra, wait=True):
    cmd = [sys.executable, os.path.join(REPO, "scripts", "generate.py"), f"input={inp}", f"output={out}", *SMALL, *extra,
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def read_results(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_malformed_records_become_error_records_and_the_rest_run(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [
        {"id": "a", "prompt": "Hello", "max_tokens": 5, "temperature": 0},
        "{not json",
        {"prompt": "no id"},
        {"id": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        {"id": "c", "prompt": "x", "temperature": -1},
        {"id": "d", "prompt": "x", "colour": "blue"},
        {"id": "e", "prompt": [1] * 200},
        {"id": 7, "prompt": [72, 105], "max_tokens": 2},
    ])
    proc = job(tmp_path, inp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_results(out)
    by_id = {r["id"]: r for r in results if r["id"] is not None}
    assert by_id["a"]["finish_reason"] == "length" and len(by_id["a"]["token_ids"]) == 5
    assert by_id["a"]["usage"] == {"prompt_tokens": 6, "completion_tokens": 5}
    assert by_id["b"]["usage"]["completion_tokens"] == 3 and by_id["7"]["usage"]["completion_tokens"] == 2
    assert "temperature" in by_id["c"]["error"] and "colour" in by_id["d"]["error"]
    assert "max_model_len" in by_id["e"]["error"]
    line_errors = [r for r in results if r["id"] is None]
    assert sorted(r["line"] for r in line_errors) == [2, 3]
    assert len(results) == 8


def test_a_job_killed_mid_way_resumes_with_every_id_exactly_once(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"r{i}" for i in range(40)]
    write_jsonl(inp, [{"id": i, "prompt": f"prompt {i}", "max_tokens": 40, "ignore_eos": True} for i in ids])
    proc = job(tmp_path, inp, out, wait=False)
    deadline = time.monotonic() + 300
    while not (out.exists() and len(out.read_text().splitlines()) >= 5):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written_before = len(read_results(out))
    assert 5 <= written_before < 40
    with open(out, "a") as f:
        f.write('{"id": "r39", "text": "torn wri')  # as if a write was cut short by the crash
    proc = job(tmp_path, inp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{written_before} already done" in proc.stdout
    results = read_results(out)
    assert sorted(r["id"] for r in results) == sorted(ids)  # exactly once each
    assert all(len(r["token_ids"]) == 40 for r in results)
    proc = job(tmp_path, inp, out)  # a third run has nothing left to do
    assert "40 already done, 0 generated" in proc.stdout and len(read_results(out)) == 40


def test_duplicate_ids_are_refused_before_any_work(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b"}, {"id": "x", "prompt": "c"}])
    proc = job(tmp_path, inp, out)
    assert proc.returncode == 2 and "duplicate ids ['x']" in proc.stderr
    assert not out.exists()


def test_input_without_output_is_a_config_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "generate.py"), f"input={tmp_path}/in.jsonl",
         f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "give both" in proc.stderr


def test_a_record_the_engine_fails_on_is_its_own_error_record_and_the_job_goes_on(monkeypatch):
    # A 4,301-digit logit_bias key raised ValueError out of the job, which then wrote nothing at all.
    from types import SimpleNamespace

    from engine_factory import shared_engine
    from jaxcb import jobs

    engine = shared_engine()
    plan_record = jobs.plan_record

    def failing_on_poison(ctx, data):
        if data.get("prompt") == "poison":
            raise RuntimeError("a bug this record meets")
        return plan_record(ctx, data)

    monkeypatch.setattr(jobs, "plan_record", failing_on_poison)
    records = [jobs.JobRecord(1, "ok", {"id": "ok", "prompt": "Hello", "max_tokens": 2, "temperature": 0}),
               jobs.JobRecord(2, "bad", {"id": "bad", "prompt": "poison"}),
               jobs.JobRecord(3, "big", {"id": "big", "prompt": "x", "logit_bias": {"1" * 4301: 1}})]
    llm = SimpleNamespace(engine=engine, tokenizer=engine.tokenizer)
    results = {r["id"]: r for r in jobs.generate_results(llm, records, max_in_flight=4)}
    assert results["ok"]["finish_reason"] == "length"
    assert "RuntimeError: a bug this record meets" in results["bad"]["error"]
    assert results["big"]["field"] == "logit_bias"
    assert not engine.has_unfinished_requests()


def test_a_rerun_writes_each_unreadable_line_once_and_still_runs_an_id_named_None(tmp_path):
    # Line errors (id null) were written again on every rerun, and read back as the id "None", so a record with
    # that id was skipped as done without ever running.
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, ["{not json", "[1, 2]", {"id": True, "prompt": "x"},
                      {"id": "None", "prompt": "x", "max_tokens": 1}])
    proc = job(tmp_path, inp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line_1] = [r for r in read_results(out) if r["id"] is None and r["line"] == 1]
    out.write_text(json.dumps(line_1) + "\n")  # as if killed with only line 1 reported
    proc = job(tmp_path, inp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = job(tmp_path, inp, out)
    assert "4 records: 4 already done, 0 generated, 0 errors" in proc.stdout, proc.stdout[-2000:]
    results = read_results(out)
    assert sorted(r["line"] for r in results if r["id"] is None) == [1, 2, 3]
    [named_none] = [r for r in results if r["id"] is not None]
    assert named_none["id"] == "None" and named_none["usage"]["completion_tokens"] == 1 and len(results) == 4


def test_a_bom_bytes_not_utf8_and_line_separators_in_ids_are_read_per_line_and_resume(tmp_path):
    # A line that was not UTF-8 ended the job with a traceback; a BOM made line 1 an error; an id holding U+2028
    # or NEL (written raw) split its result line on the rerun's read, which then refused the whole output.
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    records = [{"id": "a", "prompt": "x", "max_tokens": 1}, {"id": "b\u2028", "prompt": "x", "max_tokens": 1},
               {"id": "c\x85", "prompt": "x", "max_tokens": 1}]
    inp.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
                    + b'{"id": "d", "prompt": "\xff"}\n')
    proc = job(tmp_path, inp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_line = {r.get("line"): r for r in read_results_raw(out)}
    assert "not UTF-8" in by_line[4]["error"]
    proc = job(tmp_path, inp, out)
    assert proc.returncode == 0 and "4 already done, 0 generated, 0 errors" in proc.stdout, proc.stderr[-3000:]
    results = read_results_raw(out)
    assert len(results) == 4 and sorted(r["id"] for r in results if "text" in r) == ["a", "b\u2028", "c\x85"]


def read_results_raw(path):
    return [json.loads(line) for line in path.read_bytes().decode().split("\n")[:-1]]


def test_an_output_that_is_the_input_or_cannot_be_written_is_refused_before_any_work(tmp_path):
    # output=input read the records as results (nothing ran) and cut the input's last line as torn.
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps({"id": "b", "prompt": "y"}))
    before = inp.read_text()
    proc = job(tmp_path, inp, inp)
    assert proc.returncode == 2 and "is the input file" in proc.stderr and inp.read_text() == before
    proc = job(tmp_path, inp, tmp_path)  # a folder
    assert proc.returncode == 2 and "cannot be written" in proc.stderr and "Traceback" not in proc.stderr


def test_a_full_waiting_queue_makes_records_wait_not_fail(monkeypatch):
    # Under scheduler.max_waiting_requests, every record past the limit was written as a final error
    # ("retry after 1 s"), which a rerun then skipped as done.
    from types import SimpleNamespace

    from engine_factory import shared_engine
    from jaxcb import jobs

    engine = shared_engine()
    monkeypatch.setattr(engine, "max_waiting_requests", (1, "scheduler.max_waiting_requests=1"))
    records = [jobs.JobRecord(i, f"r{i}", {"id": f"r{i}", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
               for i in range(6)]  # (sampled: an EOS drawn would end one "stop")
    records.append(jobs.JobRecord(7, "n2", {"id": "n2", "prompt": "Hello", "max_tokens": 2, "n": 2}))
    llm = SimpleNamespace(engine=engine, tokenizer=engine.tokenizer)
    results = {r["id"]: r for r in jobs.generate_results(llm, records, max_in_flight=4)}
    assert all(results[f"r{i}"]["finish_reason"] == "length" for i in range(6))
    assert "requests are waiting" in results["n2"]["error"]  # never fits a queue of 1: its own error, not a hang
    assert not engine.has_unfinished_requests()


def test_job_results_carry_the_fields_that_shape_them_as_the_http_response_does():
    """return_tokens_as_token_ids, include_stop_str_in_output, truncate_prompt_tokens and add_special_tokens
    through a job record: the result line as /v1/completions would answer it."""
    from types import SimpleNamespace

    from engine_factory import shared_engine
    from jaxcb import jobs

    engine = shared_engine()
    llm = SimpleNamespace(engine=engine, tokenizer=engine.tokenizer)
    base = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = next(jobs.generate_results(llm, [jobs.JobRecord(1, "w", {"id": "w", **base})], 1))["text"]
    stop = whole[2:4]
    records = {"ids": {"logprobs": 1, "return_tokens_as_token_ids": True},
               "stop": {"stop": [stop], "include_stop_str_in_output": True},
               "cut": {"truncate_prompt_tokens": 2, "echo": True, "max_tokens": 1},
               "raw": {"add_special_tokens": False, "echo": True, "max_tokens": 1},
               "tids": {"return_token_ids": True, "max_tokens": 1}}
    chat = {"id": "chat", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}],
            "echo": True, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2}
    lines = [jobs.JobRecord(i, name, {"id": name, **base, **extra}) for i, (name, extra) in enumerate(records.items())]
    lines.append(jobs.JobRecord(len(lines), "chat", chat))
    results = {r["id"]: r for r in jobs.generate_results(llm, lines, max_in_flight=4)}
    assert all(t.startswith("token_id:") for t in results["ids"]["logprobs"]["tokens"])
    assert results["stop"]["text"] == whole[:whole.index(stop) + len(stop)]
    assert results["cut"]["usage"]["prompt_tokens"] == 2 and results["cut"]["text"].startswith("o")  # <bos> + "o"
    assert results["raw"]["usage"]["prompt_tokens"] == 5 and results["raw"]["text"].startswith("Hello")
    assert results["tids"]["prompt_token_ids"] == engine.tokenizer.encode("Hello")
    assert len(results["tids"]["token_ids"]) == 1
    assert results["chat"]["text"].startswith("Once") and len(results["chat"]["token_ids"]) == 2
    assert not engine.has_unfinished_requests()


def test_an_openai_batch_file_runs_offline_as_vllms_run_batch_runs_it(tmp_path, monkeypatch):
    """generate.py input=batch.jsonl: each line answered as /v1/batches answers it (the same body POSTed: the
    same greedy text), every result line in OpenAI's batch output format in one file, exactly once per
    custom_id across reruns; a file a /v1/files upload would refuse stops the job naming its line."""
    import pytest

    from engine_factory import BASE, generate_first_completions, shared_engine
    from jaxcb import jobs
    from jaxcb.batch_job import is_batch_file, run_batch_file
    from jaxcb.config import compose_config
    from jaxcb.errors import UserError
    from jaxcb.sampling_params import SamplingParams

    def line(custom_id, url, **body):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "tiny", **body}}

    lines = [line("plain", "/v1/completions", prompt="hello", max_tokens=5, temperature=0, ignore_eos=True),
             line("chat", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=3),
             line("bad", "/v1/completions", prompt="x", temperature=-1),
             line("resp", "/v1/responses", input="x", max_output_tokens=3)]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    stale = tmp_path / "batches" / "batches"  # the server's batch store, with a file it could not read: not read
    stale.mkdir(parents=True)
    (stale / "batch_old.json").write_text('{"an_old_field": 1}')
    cfg, engine = compose_config(BASE + (f"server.batch_dir={tmp_path / 'batches'}",)), shared_engine()
    (tmp_path / "records.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    (tmp_path / "cr.jsonl").write_text("{not json\r" + json.dumps(lines[0]) + "\r")  # CR endings, a bad line first
    long_first = line("long", "/v1/completions", prompt="x" * 1_500_000)  # a line past 1 MiB, and a U+2028 in one
    (tmp_path / "long.jsonl").write_text(json.dumps(long_first) + "\n")
    (tmp_path / "u2028.jsonl").write_text(json.dumps(line("u", "/v1/completions", prompt="a\u2028b"),
                                                     ensure_ascii=False) + "\n")
    for batch_file in (path, tmp_path / "cr.jsonl", tmp_path / "long.jsonl", tmp_path / "u2028.jsonl"):
        assert is_batch_file(str(batch_file), 2 << 20), batch_file
    assert not is_batch_file(str(tmp_path / "records.jsonl"), 2 << 20)
    (tmp_path / "stray.jsonl").write_text('{"id": "a", "prompt": "x", "custom_id": "c"}\n')  # a record, a stray key
    assert not is_batch_file(str(tmp_path / "stray.jsonl"), 2 << 20)
    report = run_batch_file(cfg, str(path), str(out), engine=engine)
    assert (report.num_input, report.num_done, report.num_errors) == (4, 3, 1)
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert results.keys() == {"plain", "chat", "bad", "resp"}
    assert all(r["id"].startswith("batch_req_") and r["error"] is None for r in results.values())
    assert results["bad"]["response"]["status_code"] == 400
    assert results["bad"]["response"]["body"]["error"]["param"] == "temperature"
    assert results["resp"]["response"]["body"]["object"] == "response"
    [greedy] = generate_first_completions(engine, ["hello"], SamplingParams(temperature=0, max_tokens=5,
                                                                           ignore_eos=True))
    assert results["plain"]["response"]["body"]["choices"][0]["text"] == greedy.text
    with open(out, "a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "plain", "resp')  # a crash mid-line
    again = run_batch_file(cfg, str(path), str(out), engine=engine)
    assert (again.num_skipped, again.num_done) == (4, 0)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()].count("plain") == 1
    # run_job takes either kind of file; a batch file that could never run stops at once, naming its line
    called = []
    monkeypatch.setattr("jaxcb.batch_job.run_batch_file", lambda *a: called.append(a) or "report")
    assert jobs.run_job(cfg, str(path), str(tmp_path / "o2.jsonl")) == "report" and len(called) == 1
    monkeypatch.undo()
    path.write_text(json.dumps(lines[0]) + "\n" + json.dumps({**lines[1], "url": "/v1/embeddings"}) + "\n")
    with pytest.raises(UserError, match=r"line 2: url '/v1/embeddings' is not an endpoint batches serve"):
        run_batch_file(cfg, str(path), str(tmp_path / "o3.jsonl"), engine=engine)
    with pytest.raises(UserError, match="job.backend=local"):
        run_batch_file(compose_config(BASE + ("job.backend=ray",)), str(path), str(out), engine=engine)
    assert not engine.has_unfinished_requests()
