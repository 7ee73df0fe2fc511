"""scripts/report.py recommends a setting only when it beats the others by more than the run-to-run noise.

Sweeps are built by hand (a run directory is `.hydra/overrides.yaml` and `bench.json`), so these
run in seconds, without the engine.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_report():
    spec = importlib.util.spec_from_file_location("report_for_test", os.path.join(REPO, "scripts", "report.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


report = load_report()


def write_run(sweep, num, overrides, out_tok_s, goodput, ttft_p99_s=0.5, tpot_s=0.01):
    run = sweep / str(num)
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    stats = lambda v: {"mean": v, "p50": v, "p95": v, "p99": v}  # noqa: E731
    serving = {"output_tokens_per_s": out_tok_s, "requests_per_s": goodput + 1.0, "goodput_requests_per_s": goodput,
               "ttft_s": stats(ttft_p99_s), "tpot_s": stats(tpot_s)}
    (run / "bench.json").write_text(json.dumps({"serving": {"fcfs": serving}}))


def make_sweep(sweep, points):
    """points: (max_num_seqs, out tok/s, goodput) per run, at one budget and one request rate."""
    for num, (seqs, tput, good) in enumerate(points):
        write_run(sweep, num, ["bench.mode=serving", "bench.request_rate=200", f"scheduler.max_num_seqs={seqs}",
                               "scheduler.max_num_batched_tokens=512"], tput, good)


def run_report(*sweeps):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "report.py"), *map(str, sweeps)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_differences_within_the_noise_give_no_recommendation(tmp_path):
    # 16 and 64 differ by 0.6%, and two runs of 64 differ by 1.6%: the sweep cannot tell them apart.
    make_sweep(tmp_path, [(16, 6205, 60.0), (64, 6241, 60.4), (64, 6142, 59.5)])
    out = run_report(tmp_path)
    assert "recommended:" not in out
    assert "no recommendation: 2 settings are within the run-to-run noise (+-1.5%)" in out
    assert "run-to-run noise +-1.6% in throughput, +-1.5% in goodput" in out


def test_a_clear_difference_beyond_the_noise_is_recommended(tmp_path):
    make_sweep(tmp_path, [(4, 2300, 5.0), (16, 5200, 40.0), (64, 5900, 52.0), (64, 5850, 51.0)])
    out = run_report(tmp_path)
    assert "recommended: scheduler.max_num_seqs=64 (51.50 req/s goodput" in out
    for name in ("throughput_vs_ttft.png", "throughput_vs_tpot.png", "sweep.csv", "sweep.md"):
        assert (tmp_path / name).stat().st_size > 0


def test_without_a_repeat_the_noise_is_unknown_and_nothing_is_recommended(tmp_path):
    make_sweep(tmp_path, [(4, 2300, 5.0), (16, 5200, 40.0), (64, 5900, 52.0)])
    out = run_report(tmp_path)
    assert "recommended:" not in out
    assert "no setting was run twice, so the run-to-run noise is unknown" in out


def test_a_repeat_from_another_sweep_directory_counts(tmp_path):
    make_sweep(tmp_path / "grid", [(4, 2300, 5.0), (64, 5900, 52.0)])
    make_sweep(tmp_path / "again", [(64, 5850, 51.0)])
    out = run_report(tmp_path / "grid", tmp_path / "again")
    assert "recommended: scheduler.max_num_seqs=64" in out


def test_noise_is_the_largest_relative_spread_between_repeats():
    runs = [dict(params={"s": "a"}, output_tokens_per_s=t, goodput_requests_per_s=g, requests_per_s=1.0,
                 ttft_p99_ms=1.0, tpot_mean_ms=1.0) for t, g in ((100.0, 10.0), (110.0, 10.0))]
    runs += [dict(runs[0], params={"s": "b"})]
    settings = report.group_settings(runs)
    assert report.run_to_run_noise(settings, "output_tokens_per_s") == pytest.approx(10 / 105)
    assert report.run_to_run_noise(settings, "goodput_requests_per_s") == 0.0
    assert report.run_to_run_noise(settings[1:], "output_tokens_per_s") is None  # "b" ran once


def test_each_load_gets_its_own_verdict_and_the_rate_is_never_recommended(tmp_path):
    num = 0
    for rate, seqs, tput, good in [(50, 16, 3000, 48.0), (50, 64, 3010, 48.2), (50, 64, 2990, 47.9),
                                   (200, 16, 5200, 20.0), (200, 64, 5900, 45.0), (200, 64, 5880, 44.0)]:
        write_run(tmp_path, num, ["bench.mode=serving", f"bench.request_rate={rate}", f"scheduler.max_num_seqs={seqs}"],
                  tput, good)
        num += 1
    out = run_report(tmp_path)
    assert "bench.request_rate=50: no recommendation: 2 settings are within the run-to-run noise" in out
    assert "bench.request_rate=200: recommended: scheduler.max_num_seqs=64 " in out


def test_knee_is_the_smallest_max_num_seqs_within_the_noise_of_the_best(tmp_path):
    make_sweep(tmp_path, [(4, 2300, 5.0), (16, 5850, 40.0), (64, 5900, 52.0), (64, 5800, 51.0), (128, 5890, 50.0)])
    out = run_report(tmp_path)
    assert "knee at scheduler.max_num_seqs=16 " in out


def test_when_no_run_meets_the_slo_settings_are_ranked_by_throughput(tmp_path):
    make_sweep(tmp_path, [(4, 2300, 0.0), (64, 5900, 0.0), (64, 5850, 0.0)])
    out = run_report(tmp_path)
    assert "no run met the SLO" in out
    assert "recommended: scheduler.max_num_seqs=64 (5,875 out tok/s" in out
