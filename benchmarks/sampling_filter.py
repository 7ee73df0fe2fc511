"""Top-k / top-p filtering in the step: the radix select (jaxcb.sampling, 6 passes over the logits)
against the bisection it replaced (64 passes, kept here), the same rows, jitted, interleaved round
by round; both keep exactly what a sort keeps (tests/test_sampling.py).

    python benchmarks/sampling_filter.py [--rows 256] [--vocab 131072] [--rounds 3] [--iters 2]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.timing import time_in_loop  # noqa: E402
from jaxcb.sampling import SamplingArrays, _filter_top_k_top_p  # noqa: E402


def _bisection_keys(x: jax.Array) -> jax.Array:
    """i32 keys that order as the float32 values do (-inf lowest): the float's bits, negatives flipped."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _largest_key_where(keys: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """i32[R]: per row, the largest key t in the row's range with `holds(t)`: 32 halvings, unrolled."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (((lo & 1) + (hi & 1) + 1) >> 1)  # ceil((lo + hi) / 2), no overflow
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (keys.min(axis=-1), keys.max(axis=-1)), unroll=True)
    return lo


def bisection_filter(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """The filter before the radix select (jaxcb/sampling.py until 2026-12-04): each cut-off by
    bisection over the logits' bit patterns, 32 passes of an O(V) count or masked sum."""
    vocab = logits.shape[-1]
    keys = _bisection_keys(logits)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = _largest_key_where(keys, lambda t: (keys >= t[:, None]).sum(axis=-1) >= k)
    logits = jnp.where(keys < kth[:, None], -jnp.inf, logits)
    keys = _bisection_keys(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    mass_from = lambda t: jnp.where(keys >= t[:, None], probs, 0.0).sum(axis=-1)  # noqa: E731
    cutoff = _largest_key_where(keys, lambda t: mass_from(t) >= s.top_p)
    return jnp.where(keys < cutoff[:, None], -jnp.inf, logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2, help="calls per timed loop (each round: the median of 3)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((args.rows, args.vocab)).astype(np.float32) * 3)
    top_k = rng.integers(0, 50, args.rows).astype(np.int32)
    top_p = rng.uniform(0.05, 1.0, args.rows).astype(np.float32)
    top_p[::4] = 1.0  # a quarter of the rows top-k only, and a quarter of the rest top-p only
    top_k[1::4] = 0
    fields = {f: None for f in SamplingArrays.__dataclass_fields__}
    s = SamplingArrays(**{**fields, "top_k": jnp.asarray(top_k), "top_p": jnp.asarray(top_p)})
    clean = lambda y: jnp.where(jnp.isneginf(y), 0.0, y)  # noqa: E731  (the loop feeds its output back)
    fns = {"bisection": lambda x: clean(bisection_filter(x, s)), "radix": lambda x: clean(_filter_top_k_top_p(x, s))}
    differ = jax.jit(lambda x: (jnp.isneginf(bisection_filter(x, s)) != jnp.isneginf(_filter_top_k_top_p(x, s)))
                     .any(axis=-1).sum())
    # float32 sums in another order round differently at a top-p cut-off that is a near-tie (the
    # bisection also drops a few tokens at top_p = 1): tests/test_sampling.py holds the radix select
    # to float64 sums; here, how many rows the two keep differently.
    num_differ = int(differ(logits))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(time_in_loop(fn, logits, iters=args.iters, repeats=3).median_s)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(" ".join(["python", *sys.argv]))
    print(f"{args.rows} rows x {args.vocab} vocabulary on {jax.devices()[0].platform}, {args.rounds} interleaved rounds")
    for name, t in med.items():
        print(f"  {name:10s} {t * 1e3:9.1f} ms  (rounds: {', '.join(f'{x * 1e3:.1f}' for x in times[name])})")
    print(f"  radix / bisection: the radix select is {med['bisection'] / med['radix']:.2f}x faster")
    print(f"  rows the two keep differently: {num_differ} of {args.rows} (near-ties of top-p, rounding)")


if __name__ == "__main__":
    main()
