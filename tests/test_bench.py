"""scripts/bench.py runs end to end on a small workload, and its workload arithmetic is right."""

import json
import os
import subprocess
import sys

import pytest

from jaxcb.benchmark import WorkItem, ideal_static_ratio, make_workload, with_fresh_prompts
from jaxcb.config import BenchConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ideal_static_ratio_counts_batch_max_times_batch_size():
    items = [WorkItem([1], n) for n in (1, 3, 2, 2)]
    # batches of 2: max(1,3)*2 + max(2,2)*2 = 10 slot-steps for 8 tokens
    assert ideal_static_ratio(items, 2) == 10 / 8


def test_lognormal_workload_is_seeded_and_respects_limits():
    b = BenchConfig(num_requests=300, scale=1.0)
    a, again = make_workload(b, 259, 512), make_workload(b, 259, 512)
    assert a == again
    assert all(1 <= len(w.prompt_token_ids) <= 256 and len(w.prompt_token_ids) + w.output_len <= 512 for w in a)
    mean_in = sum(len(w.prompt_token_ids) for w in a) / len(a)
    assert 100 < mean_in < 220  # ShareGPT-like (before clipping: 200)


@pytest.mark.parametrize(
    "task, runs",
    [("policies", {"fcfs", "static"}), ("async", {"async", "sync"}), ("overhead", None), ("flops", None)],
)
def test_bench_runs_and_writes_json(tmp_path, task, runs):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench.py"), f"bench.task={task}", "bench.num_requests=12",
         "scheduler.max_num_batched_tokens=64", "scheduler.max_num_seqs=8", "engine.max_model_len=256",
         "engine.token_buckets=[16]", f"hydra.run.dir={tmp_path}", *(["bench.repeats=3"] if task in ("flops", "policies") else [])],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    if task == "overhead":
        o = result["overhead"]
        assert 0 < o["step_replay_s"] and o["num_steps"] > 0
        assert sum(b["steps"] for b in o["per_bucket"].values()) == o["num_steps"]
        assert sum(b["total_s"] for b in o["per_bucket"].values()) == pytest.approx(o["step_replay_s"])
        host_s = o["engine_s"] - o["step_replay_s"]
        assert o["host_us_per_step"] == pytest.approx(1e6 * host_s / o["num_steps"])
        assert o["host_us_per_output_token"] == pytest.approx(1e6 * host_s / o["num_output_tokens"])
        return
    if task == "flops":
        f = result["flops"]
        assert f["linear_flops"] > 0 and f["attention_flops"] > 0 and len(f["matmul_ceiling_flops_per_s"]) == 2
        assert 0 < f["model_over_ceiling"] == pytest.approx(
            f["model_flops_per_s"] / next(iter(f["matmul_ceiling_flops_per_s"].values()))
        )
        assert next(iter(f["matmul_ceiling_flops_per_s"].values())) == max(f["ceiling_before_and_after_flops_per_s"])
        # Three runs, each between two ceiling readings (one run's after is the next one's before), the median
        # run's figures on top; fresh prompts of the same lengths do the same work each time.
        runs = f["runs"]
        assert len(runs) == 3 and len({r["linear_flops"] for r in runs}) == 1
        assert all(a["ceiling_before_and_after_flops_per_s"][1] == b["ceiling_before_and_after_flops_per_s"][0]
                   for a, b in zip(runs, runs[1:]))
        assert f["model_over_ceiling"] == sorted(r["model_over_ceiling"] for r in runs)[1]
        for r in runs:
            sustained = r["model_flops_per_s"] / r["sustained_matmul_flops_per_s"]
            assert r["model_over_sustained_matmul"] == pytest.approx(sustained)
        assert "model / ceiling of the 3 runs:" in proc.stdout
        return
    assert set(result["runs"]) == runs
    assert all(r["num_recompiles"] == 0 for r in result["runs"].values())
    if task == "policies":
        assert result["ideal_ratio"] >= 1
        # Three pairs, the order swapped from one to the next, each on its own prompts (none cached from the
        # pair before: every pair takes as many steps as the first); the median pair is the one reported.
        pairs = result["pairs"]
        assert [p["order"] for p in pairs] == [["fcfs", "static"], ["static", "fcfs"], ["fcfs", "static"]]
        assert all(len({p["runs"][policy]["num_steps"] for p in pairs}) == 1 for policy in runs)
        ratios = [p["fcfs_over_static"] for p in pairs]
        assert result["fcfs_over_static"] == sorted(ratios)[1]
        assert result["runs"] == pairs[ratios.index(sorted(ratios)[1])]["runs"]
        assert "the median of 3 pairs" in proc.stdout


def test_fresh_prompts_keep_every_requests_lengths_and_share_no_first_block():
    a = make_workload(BenchConfig(num_requests=50, scale=1.0), 259, 512)
    other = with_fresh_prompts(a, 259, seed=1)
    lengths = lambda items: [(len(w.prompt_token_ids), w.output_len) for w in items]  # noqa: E731
    assert lengths(a) == lengths(other)
    assert all(x.prompt_token_ids[:16] != y.prompt_token_ids[:16] for x, y in zip(a, other))
    assert all(0 <= t < 259 for w in other for t in w.prompt_token_ids)


def test_exp_output_workload_has_512_token_prompts_and_capped_outputs():
    items = make_workload(BenchConfig(workload="exp-output", output_cap=32, num_requests=100), 259, 2048)
    assert all(len(w.prompt_token_ids) == 512 and 1 <= w.output_len <= 32 for w in items)
    assert len({w.output_len for w in items}) > 5


def test_file_workload_reads_the_peers_format(tmp_path):
    path = tmp_path / "wl.jsonl"
    path.write_text('{"_meta": {"n": 2}}\n{"id": 0, "prompt_token_ids": [1, 2, 3], "output_len": 7}\n'
                    '{"id": 1, "prompt_token_ids": [4], "output_len": 2}\n')
    items = make_workload(BenchConfig(workload="file", file=str(path)), 259, 2048)
    assert items == [WorkItem([1, 2, 3], 7), WorkItem([4], 2)]


def test_serving_bench_over_http_streams_from_a_real_server(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "bench.mode=serving", "bench.backend=http",
         "bench.num_requests=10", "bench.request_rate=50", "scheduler.max_num_batched_tokens=64",
         "scheduler.max_num_seqs=8", "engine.max_model_len=256", "engine.token_buckets=[16]", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "bench.json").read_text())["serving"]["http"]
    assert r["num_errors"] == 0 and r["num_requests"] == 10
    assert r["output_tokens_per_s"] > 0 and 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] <= r["e2e_s"]["p99"]
    assert r["tpot_s"]["mean"] > 0 and r["itl_s"]["p50"] > 0


def test_http_backend_is_refused_outside_serving_mode():
    from jaxcb.config import ConfigError, compose_config

    with pytest.raises(ConfigError, match="bench.backend=http measures one server in serving mode"):
        compose_config(["bench.backend=http"])


FAULTS_OF_A_REALLOCATION = """
import resource, sys
from benchmarks.freed_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
import numpy as np
np.ones(64 << 20, np.uint8)  # touched, then freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(64 << 20, np.uint8)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_the_kernel_benchmark_keeps_freed_memory_so_a_call_does_not_fault_in_its_buffers_again():
    """bench_kernels.py's chains free 33-262 MB outputs every call: by default glibc unmaps them and
    the next call faults them in again, which the kernel tables then measured as kernel time."""
    def run(mode):
        proc = subprocess.run([sys.executable, "-c", FAULTS_OF_A_REALLOCATION, mode], cwd=REPO, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
        assert proc.returncode == 0, proc.stderr
        kept, faults = proc.stdout.split()
        return kept, int(faults)

    kept, faults = run("keep")
    assert kept == "True" and faults < 16  # the freed 64 MiB is reused as it is
    assert run("default")[1] >= 16  # the default allocator maps it afresh (>= 16 faults even on 2 MiB pages)
