"""A 2x2 Hydra sweep of the serving benchmark, summarised by scripts/report.py (its verdicts: test_report_noise.py)."""

import csv
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sweep_over_a_2x2_grid_gives_a_csv_a_table_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "-m", "bench.mode=serving", "bench.request_rate=50",
         "bench.num_requests=10", "engine.max_model_len=256", "scheduler.max_num_seqs=4,8",
         "scheduler.max_num_batched_tokens=32,64", "engine.token_buckets=[16]", f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((sweep / "0" / "bench.json").read_text())
    serving = result["serving"]["fcfs"]
    assert set(serving["ttft_s"]) == {"mean", "p50", "p95", "p99"} and serving["goodput_requests_per_s"] >= 0
    os.remove(sweep / "3" / "bench.json")  # a run that failed must be reported, not dropped
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "report.py"), str(sweep)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "run 3 (" in proc.stdout and "failed" in proc.stdout
    # No configuration ran twice: the noise is unknown, and nothing is recommended.
    assert "no recommendation: no setting was run twice" in proc.stdout and "recommended:" not in proc.stdout
    rows = list(csv.DictReader(open(sweep / "sweep.csv")))
    assert len(rows) == 4 and sorted(r["status"] for r in rows)[-1].startswith("ok")
    assert len((sweep / "sweep.md").read_text().splitlines()) == 2 + 3  # header, rule, the 3 runs that finished
    for name in ("throughput_vs_ttft.png", "throughput_vs_tpot.png"):
        assert (sweep / name).stat().st_size > 5000
