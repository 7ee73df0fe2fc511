"""One markdown table from the comparison's results: jaxcb's run directories and the peers' JSON lines.

    python benchmarks/compare/summarize.py compare-work/runs/*

Each argument is a jaxcb run directory of `scripts/bench.py` (its bench.json and
.hydra/overrides.yaml, which name the checkpoint and the workload file) or a file whose last
JSON line is the output of bench_vllm.py or bench_hf.py. Rows are grouped by workload; each
peer row gives jaxcb's output tokens/s over its own, on the same workload (a range when jaxcb
ran more than once: run the engines in turns, jaxcb before and after, to bracket the drift).
"""

from __future__ import annotations

import json
import os
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


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rows = [read_jaxcb_run(p) if os.path.isdir(p) else read_peer_result(p) for p in sys.argv[1:]]
    print("| workload | model | engine | mode | requests | out tokens | seconds | out tok/s | jaxcb / this |")
    print("|---|---|---|---|---|---|---|---|---|")
    for workload in sorted({r["workload"] for r in rows}):
        group = [r for r in rows if r["workload"] == workload]
        jaxcb = [r["output_tokens_per_s"] for r in group if r["engine"] == "jaxcb"]
        for r in sorted(group, key=lambda r: r["engine"] != "jaxcb"):
            ratios = sorted(j / r["output_tokens_per_s"] for j in jaxcb) if r["engine"] != "jaxcb" else []
            ratio = "-".join(f"{x:.2f}" for x in sorted({ratios[0], ratios[-1]})) + "x" if ratios else ""
            print(f"| {os.path.basename(workload)} | {os.path.basename(r['model'].rstrip('/'))} | {r['engine']} | "
                  f"{r['mode']} | {r['num_requests']} | {r['output_tokens']:,} | {r['seconds']:.1f} | "
                  f"**{r['output_tokens_per_s']:,.0f}** | {ratio} |")


if __name__ == "__main__":
    main()
