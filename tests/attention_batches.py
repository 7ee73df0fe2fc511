"""Ground truth for attention tests: dense f64 attention over the blocks of a RaggedBatch."""

from __future__ import annotations

import numpy as np

from jaxcb.kernels.attention.testing import RaggedBatch, make_ragged_batch  # noqa: F401  (re-exported for tests)


def dense_attention(batch: RaggedBatch, sm_scale: float, window: int | None = None,
                    softcap: float | None = None) -> np.ndarray:
    """f64 causal attention, one sequence at a time, straight from the blocks: the ground truth. With a
    `window`, the token at position p sees keys p - window < j <= p (Hugging Face's sliding window); with a
    `softcap` c, every score s is c * tanh(s / c) before the mask (Gemma 2's logit soft-capping)."""
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
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        pos = np.arange(kv_len - q_len, kv_len)[:, None]
        keys = np.arange(kv_len)[None, :]
        s = np.where((keys <= pos) & (pos - keys < (window or kv_len + 1)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[start : start + q_len] = np.einsum("hqc,hcd->qhd", p, v)
    return out


def blocks_outside_every_window(batch: RaggedBatch, window: int) -> list[int]:
    """The blocks of each sequence that lie wholly before the window of its first new token (whose window
    starts earliest): no query of the batch may see a key in them."""
    block_size = batch.k_cache.shape[3]
    outside = []
    for r, (q_len, kv_len) in enumerate(batch.seqs):
        first_key = max(0, kv_len - q_len - window + 1)
        outside += [int(b) for b in batch.block_tables[r, : first_key // block_size]]
    return outside
