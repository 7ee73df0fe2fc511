"""Random ragged batches over a paged cache: inputs for kernel tests, benchmarks and the GPU check."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass
class RaggedBatch:
    q: np.ndarray  # [T, Hq, D]
    k_cache: np.ndarray  # [L, Hkv, P, S, D]
    v_cache: np.ndarray
    kv_lens: np.ndarray  # i32[R]
    block_tables: np.ndarray  # i32[R, W]
    query_start_loc: np.ndarray  # i32[R + 1]
    num_seqs: int
    layer: int
    seqs: list[tuple[int, int]]  # (q_len, kv_len) of the real sequences

    def args(self, xp, dtype=None):
        cast = (lambda a: xp.asarray(a, dtype)) if dtype is not None else xp.asarray
        i32 = lambda a: xp.asarray(a, np.int32)  # noqa: E731
        return (
            cast(self.q), cast(self.k_cache), cast(self.v_cache), i32(self.kv_lens), i32(self.block_tables),
            i32(self.query_start_loc), i32(self.num_seqs), i32(self.layer),
        )

    @property
    def num_real_tokens(self) -> int:
        return int(self.query_start_loc[self.num_seqs])


def make_ragged_batch(
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per sequence, q_len <= kv_len
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_layers: int = 2,
    layer: int = 1,
    pad_tokens: int = 3,
    pad_seqs: int = 1,
    spare_blocks: int = 3,
    seed: int = 0,
) -> RaggedBatch:
    """Blocks are assigned in shuffled order; every slot that no sequence owns holds NaN."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-kv // block_size) for _, kv in seqs]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq, default=1) + 1  # a spare column that points at the null block
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = np.full(shape, np.nan, np.float32)
    v_cache = np.full(shape, np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(seqs) + pad_seqs, width), np.int32)
    for r, (_, kv_len) in enumerate(seqs):
        for b in range(blocks_per_seq[r]):
            block = free.pop()
            tables[r, b] = block
            n = min(block_size, kv_len - b * block_size)
            k_cache[:, :, block, :n] = rng.standard_normal((num_layers, num_kv_heads, n, head_dim))
            v_cache[:, :, block, :n] = rng.standard_normal((num_layers, num_kv_heads, n, head_dim))
    num_tokens = sum(q for q, _ in seqs)
    q = rng.standard_normal((num_tokens + pad_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in seqs]), [num_tokens] * pad_seqs]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in seqs] + [0] * pad_seqs, np.int32)
    return RaggedBatch(q, k_cache, v_cache, kv_lens, tables, qsl, len(seqs), layer, list(seqs))


def share_leading_blocks(batch: RaggedBatch, groups: list[tuple[list[int], int]]) -> RaggedBatch:
    """The batch with each group's sequences pointing their first `blocks` block-table entries at
    the blocks of the group's first sequence, as prefix caching hands one prompt's full blocks to
    every request that starts with it. `groups`: (sequence indices, shared blocks)."""
    tables = batch.block_tables.copy()
    for members, blocks in groups:
        lead = members[0]
        for r in members[1:]:
            assert blocks * batch.k_cache.shape[3] <= min(batch.kv_lens[r], batch.kv_lens[lead])
            tables[r, :blocks] = tables[lead, :blocks]
    return dataclasses.replace(batch, block_tables=tables)


def random_decode_batch(
    key: jax.Array,
    *,
    num_seqs: int,
    context_len: int,
    num_kv_heads: int,
    num_q_heads: int,
    head_dim: int,
    block_size: int,
    dtype=jnp.bfloat16,
    num_layers: int = 1,
) -> tuple:
    """Device arrays for one decode step of `num_seqs` sequences of `context_len` tokens each
    (blocks shuffled), made on the device so that multi-GiB caches cost no host time."""
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    k_key, v_key, q_key = jax.random.split(key, 3)
    k_cache = jax.random.normal(k_key, shape, dtype)
    v_cache = jax.random.normal(v_key, shape, dtype)
    perm = np.random.default_rng(0).permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = jnp.asarray(perm.reshape(num_seqs, blocks_per_seq))
    q = jax.random.normal(q_key, (num_seqs, num_q_heads, head_dim), dtype)
    kv_lens = jnp.full((num_seqs,), context_len, jnp.int32)
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    return q, k_cache, v_cache, kv_lens, tables, qsl, jnp.int32(num_seqs), jnp.int32(0)
