"""Start-up, cold and warm: from launching the process to an engine ready to serve, with an empty
compilation cache and then with the cache that first start-up filled.

    python benchmarks/startup_time.py -- model=smollm2 scheduler.max_num_batched_tokens=2048
    python benchmarks/startup_time.py --base /tmp/jaxcb-before --rounds 2 -- model=smollm2

Each start-up is a process of its own (`python -c`, the checkout on PYTHONPATH) that builds an
`Engine` and exits; a round starts each checkout cold (a fresh `engine.compilation_cache_dir`),
then warm (the same directory again), the checkouts' order flipped every round. The C++ kernels'
build is cached apart (JAXCB_KERNEL_CACHE) and is warm in both. Printed for every start-up: the
wall seconds from launch to ready, the process's CPU seconds by then (less sensitive than the
wall time to other work on a shared machine), the step executables compiled and start-up's
phases; then each checkout's medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys, time
from jaxcb.config import compose_config
from jaxcb.engine import Engine
engine = Engine(compose_config(sys.argv[1:]), progress=False)
ready = time.time()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"ready": ready, "cpu_s": usage.ru_utime + usage.ru_stime,
                  "num_compiled": len(engine.runner.compiled), "phases": engine.startup.phases}))
"""


def start_once(tree: Path, overrides: list[str], cache_dir: str) -> dict:
    """One start-up of the engine in `tree`: its wall seconds to ready, CPU seconds, compiles and phases."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    launched = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, *overrides, f"engine.compilation_cache_dir={cache_dir}"],
                         cwd=tree, env=env, check=True, capture_output=True, text=True)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(run, wall_s=run.pop("ready") - launched)


def describe(run: dict) -> str:
    phases = ", ".join(f"{name} {s:.1f}" for name, s in run["phases"])
    return (f"{run['wall_s']:5.1f} s wall, {run['cpu_s']:5.1f} s CPU, {run['num_compiled']} step executables "
            f"({phases})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="another checkout (a git worktree) to start in turns with this one")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every engine")
    args = parser.parse_args()
    trees = {"this": HERE} if args.base is None else {"base": args.base.resolve(), "this": HERE}
    runs: dict[tuple[str, str], list[dict]] = {}
    for i in range(args.rounds):
        names = list(trees) if i % 2 == 0 else list(trees)[::-1]
        for name in names:
            with tempfile.TemporaryDirectory(prefix="jaxcb-xla-cache-") as cache_dir:
                for state in ("cold", "warm"):
                    run = start_once(trees[name], args.overrides, cache_dir)
                    runs.setdefault((name, state), []).append(run)
                    print(f"round {i + 1}, {name}, {state}: {describe(run)}", flush=True)
    print(f"medians ({os.cpu_count()} cores):")
    for (name, state), rs in runs.items():
        print(f"  {name} {state}: {statistics.median(r['wall_s'] for r in rs):.1f} s wall, "
              f"{statistics.median(r['cpu_s'] for r in rs):.1f} s CPU, {rs[0]['num_compiled']} step executables")


if __name__ == "__main__":
    main()
