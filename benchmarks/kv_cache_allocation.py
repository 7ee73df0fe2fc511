"""The KV cache's allocation on CPU: lazily zeroed pages (the cpu attention form's allocator) against
a zero fill that writes every page, for SmolLM2's 4 GiB cache (the `cache.cpu_kv_cache_gib`
default). Each variant runs in its own process, alternating, so one's pages never help the other:

    .venv/bin/python benchmarks/kv_cache_allocation.py --rounds 3

prints, per variant, the median seconds to allocate K and V and the process's peak memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SHAPE = (30, 3, 5825, 16, 64)  # [layers, KV heads, blocks, block size, head dim]: 2 GiB each for K and V


def allocate(variant: str) -> None:
    import jax
    import jax.numpy as jnp

    from jaxcb.kernels.attention.cpu import lazy_zeros

    make = lazy_zeros if variant == "lazy" else (lambda shape, dtype: jnp.zeros(shape, dtype))
    make((4, 4), jnp.float32).block_until_ready()  # compile outside the timed part
    start = time.perf_counter()
    jax.block_until_ready((make(SHAPE, jnp.float32), make(SHAPE, jnp.float32)))
    seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_mib": peak_mib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", choices=("lazy", "written"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        allocate(args.variant)
        return
    runs: dict[str, list[dict]] = {"lazy": [], "written": []}
    for _ in range(args.rounds):
        for variant in runs:
            out = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True,
                                 check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for variant, rows in runs.items():
        seconds = [r["seconds"] for r in rows]
        print(f"{variant:8s} allocate {statistics.median(seconds):.3f} s (min {min(seconds):.3f}, max {max(seconds):.3f}), "
              f"peak {max(r['peak_mib'] for r in rows):.0f} MiB")


if __name__ == "__main__":
    main()
