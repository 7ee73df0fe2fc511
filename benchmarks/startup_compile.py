"""Start-up's compile phase, cold, side by side: every variant at start-up on 1 thread and on 2
(engine.compile_workers), and the default (greedy and full at start-up, the rest deferred).

    python benchmarks/startup_compile.py                       # tiny, 2 rounds
    python benchmarks/startup_compile.py --rounds 3 -- model=small engine.max_model_len=512

Each engine starts in a process of its own with an empty compilation cache (a warm one would
time reads, not compiles); the three settings take turns, in a rotated order each round. Prints
each run's compile seconds and the median ratio of each setting to the first.
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

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SETTINGS = {  # name -> overrides
    "all variants, 1 thread": ["engine.compile_rare_variants=startup", "engine.compile_workers=1"],
    "all variants, 2 threads": ["engine.compile_rare_variants=startup", "engine.compile_workers=2"],
    "default (greedy + full at start-up)": [],
}


def child(setting: str, overrides: list[str]) -> None:
    sys.path.insert(0, HERE)
    from jaxcb.config import compose_config
    from jaxcb.engine import Engine

    with tempfile.TemporaryDirectory() as cache:
        cfg = compose_config(["model=tiny", *SETTINGS[setting], f"engine.compilation_cache_dir={cache}", *overrides])
        t0 = time.process_time()
        engine = Engine(cfg, progress=False)
        phases = dict(engine.startup.phases)
        print(json.dumps({"compile_s": phases["compile"], "num_compiled": len(engine.runner.compiled),
                          "process_cpu_s": time.process_time() - t0}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every engine")
    a = p.parse_args()
    if a.child is not None:
        return child(a.child, a.overrides)
    names = list(SETTINGS)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for i in range(a.rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            out = subprocess.run([sys.executable, __file__, "--child", name, "--", *a.overrides],
                                 capture_output=True, text=True, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            seconds[name].append(run["compile_s"])
            print(f"round {i + 1}, {name}: compile {run['compile_s']:.1f} s for {run['num_compiled']} step variants "
                  f"(process CPU {run['process_cpu_s']:.1f} s)", flush=True)
    first = names[0]
    for name in names[1:]:
        ratios = [a_ / b for a_, b in zip(seconds[first], seconds[name])]
        print(f"{first} / {name}: {statistics.median(ratios):.2f}x (rounds: "
              + ", ".join(f"{r:.2f}x" for r in ratios) + f"; {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
