"""JSONL jobs on 2 Ray replicas: the same records as one engine, exactly once, even when a replica is killed."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine_factory import BASE
from jaxcb.config import compose_config
from jaxcb.jobs import run_job
from ray_cluster import actor_pids, start_local_cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = ("job.backend=ray", "job.num_replicas=2", "ray.cpus_per_replica=0.5", "job.batch_size=8")
NUM_RECORDS = 100


@pytest.fixture(scope="module")
def ray_cluster():
    ray = start_local_cluster()
    yield ray
    ray.shutdown()


def write_job(path):
    with open(path, "w") as f:
        for i in range(NUM_RECORDS):
            record = {"id": f"r{i}", "prompt": f"prompt number {i}: " + "abc" * (i % 7), "max_tokens": 8 + i % 17,
                      "temperature": 0, "ignore_eos": i % 3 == 0}
            f.write(json.dumps(record) + "\n")


def results_by_id(path):
    with open(path) as f:
        records = [json.loads(line) for line in f]
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records), "an id was written twice"
    return by_id


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("job") / "in.jsonl"
    write_job(path)
    return path


@pytest.fixture(scope="module")
def reference(job_input, tmp_path_factory):
    """The single-engine (local backend) results of the same job."""
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    report = run_job(compose_config(BASE), str(job_input), str(out))
    assert report.num_done == NUM_RECORDS
    return results_by_id(out)


def test_a_job_on_two_replicas_equals_one_engine(ray_cluster, job_input, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    report = run_job(compose_config(BASE + RAY), str(job_input), str(out))
    assert (report.num_done, report.num_errors) == (NUM_RECORDS, 0)
    assert results_by_id(out) == reference


def test_a_killed_replica_is_replaced_and_its_batches_retried_exactly_once(ray_cluster, job_input, reference, tmp_path,
                                                                          caplog):
    caplog.set_level(logging.WARNING, logger="jaxcb.distributed.ray_jobs")
    out = tmp_path / "out.jsonl"
    cfg = compose_config(BASE + RAY + ("job.batch_size=4", "job.batches_per_replica=1"))
    failure = []
    job = threading.Thread(target=lambda: _run_catching(failure, cfg, job_input, out))
    job.start()
    deadline = time.monotonic() + 240
    while not (out.exists() and len(out.read_text().splitlines()) >= 8):
        assert job.is_alive() and time.monotonic() < deadline, failure
        time.sleep(0.02)
    [victim, _] = sorted(actor_pids("JobReplica"))
    os.kill(victim, signal.SIGKILL)
    written_at_kill = len(out.read_text().splitlines())
    job.join(240)
    assert not job.is_alive() and not failure, failure
    assert written_at_kill < NUM_RECORDS, "the kill came after the job had finished"
    assert results_by_id(out) == reference  # all 100, each once, each as one engine makes it
    assert "goes back in the queue" in caplog.text and "restarted (1 of" in caplog.text


def test_a_killed_driver_resumes_on_rerun_with_every_id_exactly_once(ray_cluster, job_input, reference, tmp_path):
    """The whole job process dies (SIGKILL, its local Ray cluster with it); the same command finishes the job."""
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "generate.py"), f"input={job_input}", f"output={out}", *BASE,
           *RAY, "job.batch_size=2", "job.batches_per_replica=1", "ray.num_cpus=2", f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    # Its output goes to a file: a pipe would be held open by whatever of its Ray cluster outlives it.
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and len(out.read_text().splitlines()) >= 6):
            if driver.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        progressed = out.exists() and len(out.read_text().splitlines()) >= 6
    finally:
        try:  # the driver, and what its cluster leaves behind (Ray's agents), go
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        driver.wait()
        log.close()
    # Read after the kill: a driver whose Ray start hangs under load fails the test instead of hanging it.
    assert progressed, f"exit code {driver.returncode}: " + (tmp_path / "driver.log").read_text()[-3000:]
    written_before = len(results_by_id(out))
    assert written_before < NUM_RECORDS
    with open(out, "a") as f:
        f.write('{"id": "r99", "text": "torn wri')  # as if a write was cut short by the crash
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{written_before} already done" in rerun.stdout
    assert results_by_id(out) == reference


def _run_catching(failure, cfg, job_input, out):
    try:
        run_job(cfg, str(job_input), str(out))
    except BaseException as e:  # noqa: BLE001 -- reported by the test thread
        failure.append(repr(e))


def test_replicas_import_the_drivers_jaxcb(ray_cluster):
    import jaxcb
    from jaxcb.distributed.ray_cluster import worker_runtime_env

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def jaxcb_file():
        import jaxcb

        return jaxcb.__file__

    assert ray.get(jaxcb_file.options(runtime_env=worker_runtime_env()).remote()) == jaxcb.__file__
