"""Two checkouts side by side in one run: `scripts/bench.py` of each, in turn.

    git worktree add /tmp/base <rev>
    python benchmarks/ab_revisions.py --base /tmp/base --rounds 2 model=tiny bench.num_requests=200
    python benchmarks/ab_revisions.py --base /tmp/base --rounds 4 --metric host_us model=tiny

Each round runs the base checkout, then this one (then the order flips), with the same Hydra
overrides, each in a fresh process that imports its own checkout (PYTHONPATH). What is compared
(`--metric`): `tok_s`, `output_tokens_per_s` of the offline run, which excludes start-up and
compilation; or `host_us`, bench.task=overhead's host time a step, in microseconds: the engine's
wall time less its compiled steps replayed alone, over its steps (lower is better). Two runs of
the base give the noise band the difference is read against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def offline_tok_s(result: dict) -> float:
    [run] = result["runs"].values()  # bench.task=offline: one run, of the configured policy
    return float(run["output_tokens_per_s"])


def host_us_per_step(result: dict) -> float:
    o = result["overhead"]  # read from the fields every checkout's bench.task=overhead writes
    return 1e6 * (o["engine_s"] - o["step_replay_s"]) / o["num_steps"]


# --metric -> (bench.task, its figure in bench.json, unit)
METRICS = {"tok_s": ("offline", offline_tok_s, "out tok/s"), "host_us": ("overhead", host_us_per_step, "us host/step")}


def run_bench(tree: Path, overrides: list[str], metric: str) -> float:
    task, read, _ = METRICS[metric]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(tree))
        cmd = [sys.executable, str(tree / "scripts" / "bench.py"), f"bench.task={task}", *overrides,
               f"hydra.run.dir={out}"]
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
        with open(Path(out) / "bench.json") as f:
            return read(json.load(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, type=Path, help="the other checkout (a git worktree)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--metric", choices=sorted(METRICS), default="tok_s")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for scripts/bench.py")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"base": [], "this": []}
    for i in range(args.rounds):
        order = [("base", args.base), ("this", HERE)]
        for name, tree in (order if i % 2 == 0 else order[::-1]):
            runs[name].append(run_bench(tree.resolve(), args.overrides, args.metric))
            print(f"round {i + 1}: {name} {runs[name][-1]:,.0f} {METRICS[args.metric][2]}", flush=True)
    base, this = (statistics.median(runs[k]) for k in ("base", "this"))
    spread = (max(runs["base"]) - min(runs["base"])) / base
    print(json.dumps({f"base_{args.metric}": runs["base"], f"this_{args.metric}": runs["this"],
                      "this_over_base": this / base, "base_spread": spread}, indent=1))


if __name__ == "__main__":
    main()
