"""Continuous (fcfs) against request-level (static) batching on the five workloads of docs/benchmarks.md.

    python benchmarks/policy_workloads.py                     # this checkout
    python benchmarks/policy_workloads.py --tree /tmp/base    # another one (a git worktree)
    python benchmarks/policy_workloads.py --repeats 5         # pairs per workload (default 3)
    python benchmarks/policy_workloads.py -- model=small      # extra Hydra overrides for every run

The workloads: `lognormal` (the default lengths), then `exp-output` (512-token prompts,
exponential outputs of mean 300, `bench.scale=1`) capped at 32, 128, 512 and 1536 tokens; the
last needs 2,048 positions, which every preset has. Each workload is one process that compiles
an fcfs and a static engine, then runs what `scripts/bench.py bench.task=policies
bench.repeats=N` runs: N pairs of one fcfs and one static run, the order swapped from one pair
to the next, each pair on fresh prompts of the same lengths (`jaxcb.benchmark.run_policy_pairs`);
the median pair's fcfs / static throughput ratio is what is compared. A tree from before that
function existed is driven by this checkout's copy of it, on that tree's engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

WORKLOADS = {
    "lognormal": [],
    **{f"exp-output cap {cap}": ["bench.workload=exp-output", "bench.scale=1", f"bench.output_cap={cap}"]
       for cap in (32, 128, 512, 1536)},
}


def run_child(repeats: int, overrides: list[str]) -> None:
    """In a process whose jaxcb is the tree's: the pairs of one workload, as one JSON line."""
    import jaxcb.benchmark as bench
    from jaxcb.config import compose_config
    from jaxcb.engine import LLM

    if not hasattr(bench, "run_policy_pairs"):  # an older tree: this checkout's pairing on its engine
        spec = importlib.util.spec_from_file_location("jaxcb_benchmark_pairs", HERE / "jaxcb" / "benchmark.py")
        pairing = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(pairing)
        bench.run_policy_pairs, bench.median_pair = pairing.run_policy_pairs, pairing.median_pair
    cfg = compose_config(overrides)
    engines = {p: LLM(bench.with_policy(cfg, p)) for p in ("fcfs", "static")}  # compiled before any timing
    first = engines["fcfs"].engine
    items = bench.make_workload(cfg.bench, first.model_config.vocab_size, first.max_model_len)
    pairs = bench.run_policy_pairs(engines, items, repeats, first.model_config.vocab_size, cfg.bench.seed)
    middle = bench.median_pair(pairs)
    print(json.dumps({
        "ratios": [p.fcfs_over_static for p in pairs], "median": middle.fcfs_over_static,
        "ideal": bench.ideal_static_ratio(items, getattr(first, "scheduler_config", cfg.scheduler).max_num_seqs),
        "out_tok_s": {p: r.output_tokens_per_s for p, r in middle.runs.items()},
        "steps": {p: r.num_steps for p, r in middle.runs.items()},
    }))


def run_workload(tree: Path, repeats: int, overrides: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--repeats", str(repeats), "--", *overrides]
    proc = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=HERE, help="the checkout whose engine runs")
    parser.add_argument("--repeats", type=int, default=3, help="fcfs/static pairs per workload")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    if args.child:
        run_child(args.repeats, args.overrides)
        return
    print("| workload | fcfs / static, median pair | every pair | ideal | fcfs out tok/s | static out tok/s | "
          "fcfs steps | static steps |")
    print("|---|---|---|---|---|---|---|---|")
    for name, extra in WORKLOADS.items():
        r = run_workload(args.tree, args.repeats, [*extra, *args.overrides])
        print(f"| {name} | **{r['median']:.2f}x** | {', '.join(f'{x:.2f}' for x in r['ratios'])} | "
              f"{r['ideal']:.2f}x | {r['out_tok_s']['fcfs']:,.0f} | {r['out_tok_s']['static']:,.0f} | "
              f"{r['steps']['fcfs']} | {r['steps']['static']} |", flush=True)


if __name__ == "__main__":
    main()
