"""One markdown table from the comparison's results: jaxcb's run directories and the peers' JSON lines.

    python benchmarks/compare/summarize.py compare-work/runs/*

Each argument is a jaxcb run directory of `scripts/bench.py` (its bench.json and
.hydra/overrides.yaml, which name the checkpoint and the workload file) or a file whose last
JSON line is the output of bench_vllm.py or bench_hf.py (output dumps, `*.outputs.jsonl`, are
skipped: compare_outputs.py reads those). Rows are grouped by workload; each peer row gives
jaxcb's output tokens/s over its own, on the same workload: when run.sh ran rounds (REPEAT, runs
named ...-rN), against jaxcb's run of the same round; otherwise the range over jaxcb's runs
(run the engines in turns, jaxcb before and after, to bracket the drift).
"""

from __future__ import annotations

import json
import os
import re
import sys

import yaml


def read_jaxcb_run(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "bench.json")) as f:
        result = json.load(f)
    with open(os.path.join(run_dir, ".hydra", "overrides.yaml")) as f:
        overrides = dict(o.split("=", 1) for o in yaml.safe_load(f) or [] if "=" in o)
    if "runs" not in result or overrides.get("bench.workload") != "file":
        sys.exit(f"error: {run_dir} is not an offline scripts/bench.py run on bench.workload=file")
    run = next(iter(result["runs"].values()))
    return {"engine": "jaxcb", "mode": f"continuous ({run['policy']})", "model": overrides.get("model.checkpoint", ""),
            "workload": overrides["bench.file"], "num_requests": run["num_requests"],
            "output_tokens": run["output_tokens"], "seconds": round(run["seconds"], 3),
            "output_tokens_per_s": round(run["output_tokens_per_s"], 1)}


def read_peer_result(path: str) -> dict:
    with open(path) as f:
        lines = [line for line in f if line.startswith("{")]
    if not lines:
        sys.exit(f"error: {path} has no JSON result line (did the run fail? its log is the file itself)")
    return json.loads(lines[-1])


def round_of(path: str) -> str | None:
    """run.sh's round number from a run's name (`...-r2`, `...-r2.log`), if it has one."""
    match = re.search(r"-r(\d+)$", os.path.basename(path.rstrip("/")).removesuffix(".log"))
    return match.group(1) if match else None


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    paths = [p for p in sys.argv[1:] if not p.endswith(".outputs.jsonl")]
    rows = [dict(read_jaxcb_run(p) if os.path.isdir(p) else read_peer_result(p), round=round_of(p)) for p in paths]
    print("| workload | model | engine | mode | requests | out tokens | seconds | out tok/s | jaxcb / this |")
    print("|---|---|---|---|---|---|---|---|---|")
    for workload in sorted({r["workload"] for r in rows}):
        group = [r for r in rows if r["workload"] == workload]
        jaxcb = [r for r in group if r["engine"] == "jaxcb"]
        for r in sorted(group, key=lambda r: (r["engine"] != "jaxcb", r["engine"], r["round"] or "")):
            same_round = [j for j in jaxcb if r["round"] is not None and j["round"] == r["round"]]
            ratios = sorted(j["output_tokens_per_s"] / r["output_tokens_per_s"] for j in same_round or jaxcb)
            ratio = "-".join(f"{x:.2f}" for x in sorted({ratios[0], ratios[-1]})) + "x" \
                if ratios and r["engine"] != "jaxcb" else ""
            engine = r["engine"] + (f" (round {r['round']})" if r["round"] else "")
            print(f"| {os.path.basename(workload)} | {os.path.basename(r['model'].rstrip('/'))} | {engine} | "
                  f"{r['mode']} | {r['num_requests']} | {r['output_tokens']:,} | {r['seconds']:.1f} | "
                  f"**{r['output_tokens_per_s']:,.0f}** | {ratio} |")


if __name__ == "__main__":
    main()
