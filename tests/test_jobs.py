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
