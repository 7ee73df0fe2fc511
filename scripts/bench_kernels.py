"""Micro-benchmark of the attention implementations on this machine (CPU by default).

    python scripts/bench_kernels.py            # prints a markdown table; see docs/benchmarks.md

Compares, on the same random ragged batches, the C++ CPU kernel (`attention.impl=cpu`, the
CPU default) against the plain-XLA path, the reference, and the Pallas kernel run in the
interpreter. All are timed side by side in one run (median wall time per jitted call), so
the ratios are what to quote; absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from cpu_kernels import ragged_paged_attention_cpu
from jaxcb.timing import time_calls
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference, ragged_paged_attention_xla
from pallas_kernels.testing import make_ragged_batch

# The peers' tiny Llama attention (4 query heads, 2 KV heads, head dim 32), blocks of 16, a 4-layer cache.
HEADS = dict(num_kv_heads=2, group=2, head_dim=32, block_size=16, num_layers=4, layer=2, pad_tokens=0, pad_seqs=0)
WORKLOADS = {
    "decode 64 seqs @ 256 ctx": [(1, 256)] * 64,
    # 64 blocks: past the XLA path's gather width, so it walks (tile, block) pairs
    "decode 32 seqs @ 1024 ctx": [(1, 1024)] * 32,
    "decode 1 seq @ 1024 + 63 @ 64": [(1, 1024)] + [(1, 64)] * 63,
    "prefill 1 x 512": [(512, 512)],
    "mixed 32 decodes @ 256 + 224-token chunk": [(1, 256)] * 32 + [(224, 480)],
}
IMPLS = {
    "cpu": ragged_paged_attention_cpu,
    "xla": ragged_paged_attention_xla,
    "reference": ragged_paged_attention_reference,
    "pallas (interpret)": functools.partial(ragged_paged_attention, interpret=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; median of {args.calls} calls\n")
    others = [name for name in IMPLS if name != "cpu"]
    print("| workload | tokens | " + " | ".join(f"{name} (ms)" for name in IMPLS) + " | "
          + " | ".join(f"{name} / cpu" for name in others) + " |")
    print("|---|---|" + "---|" * (len(IMPLS) + len(others)))
    for name, seqs in WORKLOADS.items():
        batch = make_ragged_batch(seqs, seed=0, **HEADS)
        batch.k_cache[batch.k_cache != batch.k_cache] = 0  # no NaN: timing only
        batch.v_cache[batch.v_cache != batch.v_cache] = 0
        inputs = batch.args(jnp)
        ms = {}
        for impl, fn in IMPLS.items():
            jitted = jax.jit(functools.partial(fn, sm_scale=HEADS["head_dim"] ** -0.5))
            calls = max(2, args.calls // 5) if impl == "pallas (interpret)" else args.calls
            ms[impl] = time_calls(jitted, *inputs, calls=calls).median_ms
        cells = " | ".join(f"{ms[i]:.2f}" for i in IMPLS)
        ratios = " | ".join(f"{ms[i] / ms['cpu']:.1f}x" for i in others)
        print(f"| {name} | {batch.num_real_tokens} | {cells} | {ratios} |")


if __name__ == "__main__":
    main()
