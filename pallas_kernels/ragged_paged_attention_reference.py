"""Pure-JAX reference of ragged paged attention: the definition every kernel is tested against.

A step's query tokens are one flat ragged batch: sequence r owns tokens
`query_start_loc[r]:query_start_loc[r+1]` (one token for a decode, a chunk for a prefill)
and attends to the first `kv_lens[r]` tokens of its context -- which already include its
new tokens -- through its row of `block_tables`. Queries are causal within the context:
the i-th of a sequence's q_len new tokens sits at position `kv_lens[r] - q_len + i` and sees
keys 0..that position. Tokens past `query_start_loc[num_seqs]` are padding and return 0.

Written for clarity, not speed: it gathers every sequence's whole block table and then
every token's sequence, which is O(T x context). Blocks outside a sequence's `kv_lens`
never contribute, even if they hold NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, max_blocks_per_seq]
    query_start_loc: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[] (or i32[1])
    *,
    sm_scale: float,
) -> jax.Array:  # [T, num_q_heads, head_dim], q.dtype
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    num_seqs_max, max_blocks = block_tables.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    group = num_q_heads // num_kv_heads
    num_seqs = jnp.reshape(num_seqs, ())
    ctx_len = max_blocks * block_size

    # Per-sequence contexts, with everything past kv_lens zeroed so NaN in unused blocks cannot leak.
    key_idx = jnp.arange(ctx_len)
    in_ctx = key_idx[None, :] < kv_lens[:, None]  # bool[R, C]
    k_seq = k_pages[block_tables].reshape(num_seqs_max, ctx_len, num_kv_heads, head_dim)
    v_seq = v_pages[block_tables].reshape(num_seqs_max, ctx_len, num_kv_heads, head_dim)
    k_seq = jnp.where(in_ctx[:, :, None, None], k_seq, 0)
    v_seq = jnp.where(in_ctx[:, :, None, None], v_seq, 0)

    # Which sequence each token belongs to, and its position in that sequence.
    tok = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc[1:], tok, side="right")
    seq = jnp.minimum(seq, num_seqs_max - 1)
    is_real = tok < query_start_loc[num_seqs]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    q_pos = kv_lens[seq] - q_len + (tok - query_start_loc[seq])  # [T]

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    k_tok = k_seq[seq].astype(jnp.float32)  # [T, C, Hkv, D]
    v_tok = v_seq[seq].astype(jnp.float32)
    scores = jnp.einsum("thgd,tchd->thgc", qg, k_tok) * sm_scale
    visible = (key_idx[None, :] <= q_pos[:, None]) & (key_idx[None, :] < kv_lens[seq][:, None]) & is_real[:, None]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(scores - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thgc,tchd->thgd", p, v_tok) / jnp.where(denom == 0, 1.0, denom)
    out = jnp.where(is_real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
