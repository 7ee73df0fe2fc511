"""Start-up's compile phase with 1 thread against 2 (engine.compile_workers), cold, side by side.

    python benchmarks/startup_compile.py                       # tiny, every variant at start-up, 2 pairs
    python benchmarks/startup_compile.py --pairs 3 -- model=small engine.max_model_len=512

Each engine starts in a process of its own with an empty compilation cache (a warm one would
time reads, not compiles), every step variant compiled at start-up
(engine.compile_rare_variants=startup), the two worker counts alternating. Prints each run's
compile seconds and the median ratio serial / parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(workers: int, overrides: list[str]) -> None:
    sys.path.insert(0, HERE)
    from jaxcb.config import compose_config
    from jaxcb.engine import Engine

    with tempfile.TemporaryDirectory() as cache:
        cfg = compose_config(["model=tiny", "engine.compile_rare_variants=startup", f"engine.compile_workers={workers}",
                              f"engine.compilation_cache_dir={cache}", *overrides])
        engine = Engine(cfg, progress=False)
        phases = dict(engine.startup.phases)
        print(json.dumps({"workers": workers, "compile_s": phases["compile"], "num_compiled": len(engine.runner.compiled)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for both engines")
    a = p.parse_args()
    if a.child is not None:
        return child(a.child, a.overrides)
    ratios = []
    for i in range(a.pairs):
        runs = {}
        for workers in ((1, 2) if i % 2 == 0 else (2, 1)):
            out = subprocess.run([sys.executable, __file__, "--child", str(workers), "--", *a.overrides],
                                 capture_output=True, text=True, check=True)
            runs[workers] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"pair {i + 1}: {workers} thread(s): {runs[workers]['compile_s']:.1f} s for "
                  f"{runs[workers]['num_compiled']} step variants", flush=True)
        ratios.append(runs[1]["compile_s"] / runs[2]["compile_s"])
    print(f"compile phase, 1 thread / 2 threads: {statistics.median(ratios):.2f}x (pairs: "
          + ", ".join(f"{r:.2f}x" for r in ratios) + f"; {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
