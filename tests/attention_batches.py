"""Random ragged batches over a paged cache, for attention tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

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


def dense_attention(batch: RaggedBatch, sm_scale: float) -> np.ndarray:
    """f64 causal attention, one sequence at a time, straight from the blocks: the ground truth."""
    _, num_kv_heads, _, block_size, head_dim = batch.k_cache.shape
    group = batch.q.shape[1] // num_kv_heads
    out = np.zeros(batch.q.shape, np.float64)
    for r, (q_len, kv_len) in enumerate(batch.seqs):
        blocks = batch.block_tables[r, : -(-kv_len // block_size)]
        k = batch.k_cache[batch.layer][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :kv_len].astype(np.float64)
        v = batch.v_cache[batch.layer][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :kv_len].astype(np.float64)
        start = batch.query_start_loc[r]
        q = batch.q[start : start + q_len].astype(np.float64)
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # [Hq, C, D]
        s = np.einsum("qhd,hcd->hqc", q, k) * sm_scale
        pos = np.arange(kv_len - q_len, kv_len)[:, None]
        s = np.where(np.arange(kv_len)[None, :] <= pos, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[start : start + q_len] = np.einsum("hqc,hcd->qhd", p, v)
    return out
