"""Summarise a benchmark sweep: a CSV, two PNG plots with the knee marked, and the recommended setting.

    python scripts/bench.py -m bench.mode=serving bench.request_rate=20 \\
        scheduler.max_num_seqs=8,16,32,64,128 scheduler.max_num_batched_tokens=256,512,1024
    python scripts/report.py outputs/multirun/<date>/<time>

Reads every run directory of the sweep (its .hydra/overrides.yaml and bench.json). The plots
show throughput against p99 TTFT and against mean TPOT, one curve per token budget. The
recommended setting is the run with the highest goodput (requests/s meeting the SLO).
Runs that failed (no bench.json) are listed, not dropped.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

FIELDS = ["run", "max_num_seqs", "max_num_batched_tokens", "status", "output_tokens_per_s", "requests_per_s",
          "goodput_requests_per_s", "ttft_p99_ms", "tpot_mean_ms", "overrides"]


def load_runs(sweep_dir: str) -> list[dict]:
    runs = []
    for name in sorted(os.listdir(sweep_dir), key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else n)):
        run_dir = os.path.join(sweep_dir, name)
        overrides_path = os.path.join(run_dir, ".hydra", "overrides.yaml")
        if not os.path.isfile(overrides_path):
            continue
        with open(overrides_path) as f:
            overrides = yaml.safe_load(f) or []
        params = dict(o.split("=", 1) for o in overrides if "=" in o)
        row = {"run": name, "overrides": " ".join(overrides),
               "max_num_seqs": params.get("scheduler.max_num_seqs", ""),
               "max_num_batched_tokens": params.get("scheduler.max_num_batched_tokens", "")}
        result_path = os.path.join(run_dir, "bench.json")
        if not os.path.isfile(result_path):
            runs.append(dict(row, status="failed (no bench.json)"))
            continue
        with open(result_path) as f:
            result = json.load(f)
        serving = next(iter(result.get("serving", {}).values()), None)
        if serving is None:
            runs.append(dict(row, status="failed (not a bench.mode=serving run)"))
            continue
        runs.append(dict(
            row, status="ok",
            output_tokens_per_s=round(serving["output_tokens_per_s"], 1),
            requests_per_s=round(serving["requests_per_s"], 3),
            goodput_requests_per_s=round(serving["goodput_requests_per_s"], 3),
            ttft_p99_ms=round(1e3 * serving["ttft_s"]["p99"], 2),
            tpot_mean_ms=round(1e3 * serving["tpot_s"]["mean"], 3),
        ))
    return runs


def plot(runs: list[dict], best: dict, x_key: str, x_label: str, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    budgets = sorted({r["max_num_batched_tokens"] for r in runs}, key=lambda v: int(v) if str(v).isdigit() else 0)
    for budget in budgets:
        pts = sorted((r[x_key], r["output_tokens_per_s"], r["max_num_seqs"]) for r in runs if r["max_num_batched_tokens"] == budget)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"token budget {budget}")
        for x, y, seqs in pts:
            ax.annotate(f"{seqs}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.scatter([best[x_key]], [best["output_tokens_per_s"]], s=220, facecolors="none", edgecolors="red", linewidths=2,
               label=f"knee: max_num_seqs={best['max_num_seqs']}, budget={best['max_num_batched_tokens']}")
    ax.set_xlabel(x_label)
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs latency (labels: max_num_seqs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir")
    args = parser.parse_args()
    if not os.path.isdir(args.sweep_dir):
        sys.exit(f"error: {args.sweep_dir} is not a directory; give the sweep's output directory")
    runs = load_runs(args.sweep_dir)
    if not runs:
        sys.exit(f"error: no runs found under {args.sweep_dir} (expected <n>/.hydra/overrides.yaml)")
    csv_path = os.path.join(args.sweep_dir, "sweep.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows([{k: r.get(k, "") for k in FIELDS} for r in runs])
    ok = [r for r in runs if r["status"] == "ok"]
    for r in runs:
        if r["status"] != "ok":
            print(f"run {r['run']} ({r['overrides']}): {r['status']}")
    if not ok:
        sys.exit("error: every run of the sweep failed")
    best = max(ok, key=lambda r: (r["goodput_requests_per_s"], r["output_tokens_per_s"]))
    plot(ok, best, "ttft_p99_ms", "p99 TTFT (ms)", os.path.join(args.sweep_dir, "throughput_vs_ttft.png"))
    plot(ok, best, "tpot_mean_ms", "mean TPOT (ms)", os.path.join(args.sweep_dir, "throughput_vs_tpot.png"))
    print(f"wrote {csv_path} and two plots ({len(ok)} runs ok, {len(runs) - len(ok)} failed)")
    if best["goodput_requests_per_s"] == 0:  # nothing to recommend by the SLO: say so, and fall back
        print("no run met the SLO (goodput 0 everywhere): loosen bench.slo.ttft_ms / bench.slo.tpot_ms or lower "
              "bench.request_rate; the run with the highest throughput is marked instead")
    print(f"recommended: scheduler.max_num_seqs={best['max_num_seqs']} "
          f"scheduler.max_num_batched_tokens={best['max_num_batched_tokens']} "
          f"(goodput {best['goodput_requests_per_s']} req/s, {best['output_tokens_per_s']} out tok/s, "
          f"p99 TTFT {best['ttft_p99_ms']} ms, mean TPOT {best['tpot_mean_ms']} ms)")


if __name__ == "__main__":
    main()
