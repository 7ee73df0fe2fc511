"""Top-k / top-p filtering in the step: the sort-free bisection (jaxcb.sampling) against one descending
sort of the vocabulary, the same rows, interleaved; both keep exactly the same tokens
(tests/test_sampling.py).

    python benchmarks/sampling_filter.py [--rows 64] [--vocab 32000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.timing import time_in_loop  # noqa: E402
from jaxcb.sampling import SamplingArrays, _filter_top_k_top_p  # noqa: E402


def sorted_filter(logits, top_k, top_p):
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((args.rows, args.vocab)).astype(np.float32) * 3)
    top_k = jnp.asarray(rng.integers(0, 50, args.rows).astype(np.int32))
    top_p = jnp.asarray(rng.uniform(0.05, 1.0, args.rows).astype(np.float32))
    fields = {f: None for f in SamplingArrays.__dataclass_fields__}
    s = SamplingArrays(**{**fields, "top_k": top_k, "top_p": top_p})
    clean = lambda y: jnp.where(jnp.isneginf(y), 0.0, y)  # noqa: E731  (the loop feeds its output back)
    fns = {"sort": lambda x: clean(sorted_filter(x, top_k, top_p)),
           "bisection": lambda x: clean(_filter_top_k_top_p(x, s))}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(time_in_loop(fn, logits, iters=5, repeats=3).median_s)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(f"{args.rows} rows x {args.vocab} vocabulary on {jax.devices()[0].platform}, {args.rounds} interleaved rounds")
    for name, t in med.items():
        print(f"  {name:10s} {t * 1e3:8.2f} ms  (rounds: {', '.join(f'{x * 1e3:.1f}' for x in times[name])})")
    print(f"  bisection is {med['sort'] / med['bisection']:.1f}x faster")


if __name__ == "__main__":
    main()
