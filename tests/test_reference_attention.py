"""The pure-JAX ragged paged attention reference against a dense per-sequence computation."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from pallas_kernels import ragged_paged_attention_reference


def dense_attention(q, k, v, sm_scale):
    """Causal attention of q (the last len(q) positions) over k/v, one sequence, numpy f64."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * sm_scale
    pos = np.arange(ctx - q_len, ctx)[:, None]
    s = np.where(np.arange(ctx)[None, :] <= pos, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@st.composite
def ragged_batches(draw):
    block_size = draw(st.sampled_from([4, 8]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))
    num_seqs = draw(st.integers(1, 4))
    seqs = []
    for _ in range(num_seqs):
        kv_len = draw(st.integers(1, 30))
        q_len = draw(st.integers(1, kv_len))  # decode (1), a chunk, or the whole prompt
        seqs.append((q_len, kv_len))
    return block_size, num_kv_heads, group, seqs, draw(st.integers(0, 2**16))


@settings(max_examples=12, deadline=None)
@given(ragged_batches())
def test_reference_matches_dense_attention_and_ignores_nan_outside_tables(batch):
    block_size, num_kv_heads, group, seqs, seed = batch
    rng = np.random.default_rng(seed)
    head_dim, num_q_heads = 8, num_kv_heads * group
    max_blocks = max(-(-kv // block_size) for _, kv in seqs) + 1  # one spare column -> null block
    num_blocks = 1 + sum(-(-kv // block_size) for _, kv in seqs) + 3
    k_pages = np.full((num_blocks, block_size, num_kv_heads, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(seqs) + 1, max_blocks), np.int32)  # one padding row
    q_parts, expected, contexts = [], [], []
    for r, (q_len, kv_len) in enumerate(seqs):
        k = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32)
        for b in range(-(-kv_len // block_size)):
            block = free.pop()
            tables[r, b] = block
            n = min(block_size, kv_len - b * block_size)
            k_pages[block, :n] = k[b * block_size : b * block_size + n]
            v_pages[block, :n] = v[b * block_size : b * block_size + n]
        q = rng.standard_normal((q_len, num_q_heads, head_dim)).astype(np.float32)
        q_parts.append(q)
        expected.append(dense_attention(q.astype(np.float64), k, v, 0.3))
    num_tokens = sum(q for q, _ in seqs)
    padded = num_tokens + 3
    q_all = np.concatenate(q_parts + [np.ones((3, num_q_heads, head_dim), np.float32)])
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in seqs]), [num_tokens]]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in seqs] + [0], np.int32)
    with jax.default_matmul_precision("highest"):
        out = ragged_paged_attention_reference(
            jnp.asarray(q_all), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(kv_lens),
            jnp.asarray(tables), jnp.asarray(qsl), jnp.asarray(len(seqs), jnp.int32), sm_scale=0.3,
        )
    out = np.asarray(out)
    np.testing.assert_allclose(out[:num_tokens], np.concatenate(expected), atol=2e-5, rtol=1e-5)
    assert np.all(out[num_tokens:padded] == 0)
