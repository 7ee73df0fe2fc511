"""Ragged paged attention in plain JAX/XLA: the fast path where there is no Pallas kernel (CPU).

The same query tiling as the kernel, vectorised: the batch is cut into tiles of up to
`tokens_per_tile` tokens of one sequence; each tile gathers its sequence's blocks straight
from the stacked cache (one gather, no per-layer copy) and attends to them. Cost is
tiles x context instead of tokens x context: a 512-token prefill with 16-token tiles
reads its context 32 times, not 512. Decode-only batches use 1-token tiles, so no query
work is wasted. The context read is bounded by the block table's width, which the
runner buckets to what the batch needs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.inputs import check_attention_inputs
from pallas_kernels.query_tiles import max_query_tiles, query_tile_table


def default_tokens_per_tile(num_tokens: int, num_seqs_max: int) -> int:
    """1 when the batch can only be decodes; otherwise up to 16 tokens, scaled to tokens per sequence."""
    per_seq = max(1, num_tokens // max(1, num_seqs_max))
    return min(16, 1 << (per_seq.bit_length() - 1))


@functools.partial(jax.jit, static_argnames=("sm_scale", "tokens_per_tile"))
def ragged_paged_attention_xla(
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
    tokens_per_tile: int | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim]; padding tokens -> 0
    check_attention_inputs(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs_max, width = block_tables.shape
    group = num_q_heads // num_kv_heads
    tq = tokens_per_tile or default_tokens_per_tile(num_tokens, num_seqs_max)
    num_tiles = max_query_tiles(num_tokens, num_seqs_max, tq)
    seq, q_start, q_count, pos0, kv_len = query_tile_table(
        query_start_loc, kv_lens, jnp.reshape(num_seqs, ()), num_tiles, tq
    )

    offs = jnp.arange(tq)
    tok = q_start[:, None] + offs[None, :]  # [G, tq]
    tok_valid = offs[None, :] < q_count[:, None]
    # Rows of a tile are (head-in-group, token) pairs: [G, Hkv, group * tq, D].
    q_tiles = q[jnp.clip(tok, 0, num_tokens - 1)].reshape(num_tiles, tq, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 3, 1, 4).reshape(num_tiles, num_kv_heads, group * tq, head_dim)

    # One gather straight from the stacked cache: block ids of (layer, head) in the flat block axis.
    num_layers, _, num_blocks, _, _ = k_cache.shape
    ctx = width * block_size
    flat_ids = (layer * num_kv_heads + jnp.arange(num_kv_heads))[None, :, None] * num_blocks + block_tables[seq][:, None, :]
    flat_shape = (num_layers * num_kv_heads * num_blocks, block_size, head_dim)
    k = k_cache.reshape(flat_shape)[flat_ids].reshape(num_tiles, num_kv_heads, ctx, head_dim)
    v = v_cache.reshape(flat_shape)[flat_ids].reshape(num_tiles, num_kv_heads, ctx, head_dim)
    key_pos = jnp.arange(ctx)
    key_valid = key_pos[None, :] < kv_len[:, None]  # [G, C]
    # Slots past kv_len may hold stale values or NaN: scores there are masked below, and V is
    # zeroed so that 0 * NaN cannot reach the output.
    v = jnp.where(key_valid[:, None, :, None], v, 0)

    scores = jnp.einsum("ghrd,ghcd->ghrc", q_tiles, k, preferred_element_type=jnp.float32) * sm_scale
    q_pos = pos0[:, None] + offs[None, :]  # [G, tq]
    visible = key_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [G, tq, C]
    visible = jnp.broadcast_to(visible[:, None], (num_tiles, group, tq, ctx)).reshape(num_tiles, 1, group * tq, ctx)
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("ghrc,ghcd->ghrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.where(denom == 0, 1.0, denom)
    out = out.reshape(num_tiles, num_kv_heads, group, tq, head_dim).transpose(0, 3, 1, 2, 4)
    out = out.reshape(num_tiles * tq, num_q_heads, head_dim).astype(q.dtype)
    # Each real token sits in exactly one tile; padding rows go out of range and are dropped.
    dest = jnp.where(tok_valid, tok, num_tokens).reshape(-1)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")
