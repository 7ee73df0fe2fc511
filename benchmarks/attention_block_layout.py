"""What the order of a sequence's blocks in the paged cache costs the CPU attention kernel.

    python benchmarks/attention_block_layout.py                         # 64 decode rows, 768-token contexts
    python benchmarks/attention_block_layout.py --rows 16 --context 2048 --rounds 50

One decode row per sequence attends to its whole context in each of tiny's three layers
(`attention.impl=cpu`, float32 cache of 8,192 blocks of 16 tokens, 2 KV heads of 16), through
block tables laid out six ways; every layout holds the same number of blocks per sequence and
the rounds interleave the layouts (medians):

  contiguous    each sequence's blocks consecutive, ascending (a fresh pool, one prompt at a time)
  reversed      consecutive, descending (a pool whose sequences were freed last block first)
  runs of 8, 4  ascending runs of 8 or 4 blocks (cache.block_growth), the runs anywhere
  runs of 4 rev the same runs of 4, descending
  interleaved   the sequences took one block each in turn (decodes growing side by side)
  random        every block anywhere (a pool churned by many sequences)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxcb.kernels.attention.cpu import ragged_paged_attention_cpu  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, BLOCK, HEAD_DIM, NUM_BLOCKS = 3, 2, 6, 16, 16, 8193  # tiny; block 0 is the null block


def layouts(rows: int, blocks_per_seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """[rows, blocks_per_seq] block ids of each layout."""
    n = rows * blocks_per_seq
    def runs(length: int, step: int) -> np.ndarray:
        starts = 1 + length * rng.permutation((NUM_BLOCKS - 1) // length)[: -(-n // length)]
        return (starts[:, None] + np.arange(length)[::step]).reshape(-1)[:n].reshape(rows, blocks_per_seq)

    ascending = np.arange(1, 1 + n).reshape(rows, blocks_per_seq)
    return {
        "contiguous": ascending,
        "reversed": ascending[:, ::-1],
        "runs of 8": runs(8, 1),
        "runs of 4": runs(4, 1),
        "runs of 4 rev": runs(4, -1),
        "interleaved": 1 + np.arange(n).reshape(blocks_per_seq, rows).T,
        "random": 1 + rng.permutation(NUM_BLOCKS - 1)[:n].reshape(rows, blocks_per_seq),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="decode rows (sequences) in the step")
    parser.add_argument("--context", type=int, default=768, help="tokens each row attends to")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    blocks_per_seq = -(-args.context // BLOCK)
    if args.rows * blocks_per_seq >= NUM_BLOCKS:
        raise SystemExit(f"--rows x blocks of --context must stay under {NUM_BLOCKS - 1} blocks")
    rng = np.random.default_rng(0)
    shape = (LAYERS, KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    v = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    q = jnp.asarray(rng.standard_normal((args.rows, Q_HEADS, HEAD_DIM), dtype=np.float32))
    kv_lens = jnp.full((args.rows,), args.context, jnp.int32)
    starts = jnp.arange(args.rows + 1, dtype=jnp.int32)

    @jax.jit
    def step(tables):
        return sum(ragged_paged_attention_cpu(q, k, v, kv_lens, tables, starts, jnp.int32(args.rows), jnp.int32(layer),
                                              sm_scale=HEAD_DIM**-0.5) for layer in range(LAYERS))

    tables = {name: jnp.asarray(t, jnp.int32) for name, t in layouts(args.rows, blocks_per_seq, rng).items()}
    for t in tables.values():
        step(t).block_until_ready()
    seconds: dict[str, list[float]] = {name: [] for name in tables}
    for _ in range(args.rounds):
        for name, t in tables.items():
            t0 = time.perf_counter()
            step(t).block_until_ready()
            seconds[name].append(time.perf_counter() - t0)
    base = statistics.median(seconds["contiguous"])
    print(f"{args.rows} rows x {args.context} tokens x {LAYERS} layers, medians of {args.rounds} interleaved rounds")
    print("| layout | ms | us / row | / contiguous |")
    print("|---|---|---|---|")
    for name, s in seconds.items():
        m = statistics.median(s)
        print(f"| {name} | {m * 1e3:.2f} | {m / args.rows * 1e6:.1f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
