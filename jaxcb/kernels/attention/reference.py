"""Pure-JAX reference of ragged paged attention: the definition every implementation is tested against.

A step's query tokens are one flat ragged batch: sequence r owns tokens
`query_start_loc[r]:query_start_loc[r+1]` (one token for a decode, a chunk for a prefill)
and attends to the first `kv_lens[r]` tokens of its context -- which already include its
new tokens -- through its row of `block_tables`. Queries are causal within the context:
the i-th of a sequence's q_len new tokens sits at position `kv_lens[r] - q_len + i` and sees
keys 0..that position. Tokens past `query_start_loc[num_seqs]` are padding and return 0.

The cache holds every layer, `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`;
`layer` picks one. Written for clarity, not speed: it gathers every sequence's whole block
table and then every token's sequence, which is O(T x context). Blocks outside a
sequence's `kv_lens` never contribute, even if they hold NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcb.kernels.attention.inputs import check_attention_inputs


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    v_cache: jax.Array,  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    kv_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, max_blocks_per_seq]
    query_start_loc: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[]
    layer: jax.Array,  # i32[]
    *,
    sm_scale: float,
) -> jax.Array:  # [T, num_q_heads, head_dim], q.dtype
    check_attention_inputs(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs_max, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    num_seqs = jnp.reshape(num_seqs, ())
    ctx_len = max_blocks * block_size

    # Per-sequence contexts [R, C, Hkv, D], with everything past kv_lens zeroed so NaN cannot leak.
    key_idx = jnp.arange(ctx_len)
    in_ctx = key_idx[None, :] < kv_lens[:, None]  # bool[R, C]

    def contexts(cache):
        x = cache[layer][:, block_tables]  # [Hkv, R, W, S, D]
        x = jnp.moveaxis(x, 0, 3).reshape(num_seqs_max, ctx_len, num_kv_heads, head_dim)
        return jnp.where(in_ctx[:, :, None, None], x, 0)

    k_seq, v_seq = contexts(k_cache), contexts(v_cache)

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
