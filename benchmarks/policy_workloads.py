"""Continuous (fcfs) against request-level (static) batching on the five workloads of docs/benchmarks.md.

    python benchmarks/policy_workloads.py                     # this checkout
    python benchmarks/policy_workloads.py --tree /tmp/base    # another one (a git worktree)
    python benchmarks/policy_workloads.py -- model=small      # extra Hydra overrides for every run

The workloads: `lognormal` (the default lengths), then `exp-output` (512-token prompts,
exponential outputs of mean 300, `bench.scale=1`) capped at 32, 128, 512 and 1536 tokens; the
last needs 2,048 positions, which every preset has. Each is one `scripts/bench.py
bench.task=policies` process (both policies compiled first, then timed one after the other on
the same requests); what is compared is its fcfs / static throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

WORKLOADS = {
    "lognormal": [],
    **{f"exp-output cap {cap}": ["bench.workload=exp-output", "bench.scale=1", f"bench.output_cap={cap}"]
       for cap in (32, 128, 512, 1536)},
}


def run_policies(tree: Path, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(tree))
        cmd = [sys.executable, str(tree / "scripts" / "bench.py"), "bench.task=policies", *overrides,
               f"hydra.run.dir={out}"]
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
        with open(Path(out) / "bench.json") as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=HERE, help="the checkout whose scripts/bench.py runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    print("| workload | fcfs out tok/s | static out tok/s | fcfs / static | ideal | fcfs steps | static steps |")
    print("|---|---|---|---|---|---|---|")
    for name, extra in WORKLOADS.items():
        r = run_policies(args.tree, [*extra, *args.overrides])
        fcfs, static = r["runs"]["fcfs"], r["runs"]["static"]
        print(f"| {name} | {fcfs['output_tokens_per_s']:,.0f} | {static['output_tokens_per_s']:,.0f} | "
              f"**{r['fcfs_over_static']:.2f}x** | {r['ideal_ratio']:.2f}x | {fcfs['num_steps']} | "
              f"{static['num_steps']} |", flush=True)


if __name__ == "__main__":
    main()
