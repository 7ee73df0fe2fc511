"""Ragged paged attention in plain JAX/XLA: the fast path where there is no Pallas kernel (CPU).

The same query tiling as the kernel, vectorised: the batch is cut into tiles of up to
`tokens_per_tile` tokens of one sequence. Cost is tiles x context instead of tokens x
context (a 512-token prefill with 16-token tiles reads its context 32 times, not 512).
Decode-only batches use 1-token tiles, so no query work is wasted.

Short block tables gather each tile's whole context at once. Longer ones list the (tile,
block) pairs each tile really sees and attend to a chunk of pairs per loop iteration, with an
online softmax combined per tile by sorted segment reductions: blocks are read straight from
the stacked cache, and the work follows the batch's real context rather than its longest.

A sliding window (`window`, a traced i32[]; None: none) masks keys outside each token's window;
the long-table path lists no pair for a block before the window of its tile's first token, so
those blocks are never read. The short-table path gathers them and masks them (scores and V
alike, so even NaN there cannot reach the output): a few blocks, not worth a second shape.

A logit soft-cap (`softcap`, a static float c; None: none, and no op of it) caps every score to
c * tanh(score / c) before the masks, in both paths: the online softmax's max is the capped one.

An 8-bit cache (int8, fp8) is gathered in its own dtype (a quarter of f32's bytes) and widened
to q's dtype (the short path) or f32 (the long one) after the gather; the scales are applied by
the caller (`quantization.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxcb.kernels.attention.inputs import check_attention_inputs
from jaxcb.kernels.attention.query_tiles import max_query_tiles, query_tile_table


GATHER_MAX_WIDTH = 16  # block-table widths up to this gather the context at once; wider ones go by pairs


def default_tokens_per_tile(num_tokens: int, num_seqs_max: int) -> int:
    """1 when the batch can only be decodes; otherwise up to 16 tokens, scaled to tokens per sequence."""
    per_seq = max(1, num_tokens // max(1, num_seqs_max))
    return min(16, 1 << (per_seq.bit_length() - 1))


@functools.partial(jax.jit, static_argnames=("sm_scale", "tokens_per_tile", "gather_max_width", "pairs_per_chunk",
                                             "softcap"))
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
    gather_max_width: int = GATHER_MAX_WIDTH,
    pairs_per_chunk: int | None = None,
    window: jax.Array | None = None,  # i32[]: sliding window (keys p - window < j <= p); None: none
    softcap: float | None = None,  # static: scores -> softcap * tanh(scores / softcap); None: none
) -> jax.Array:  # [T, num_q_heads, head_dim]; padding tokens -> 0
    check_attention_inputs(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer,
                           window=window, softcap=softcap)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
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

    window = None if window is None else jnp.reshape(window, ())
    if width <= gather_max_width:
        out = _attend_gathered(q_tiles, k_cache, v_cache, block_tables, seq, pos0, kv_len, layer, tq, sm_scale, window,
                               softcap)
    else:
        out = _attend_block_pairs(
            q_tiles, k_cache, v_cache, block_tables, seq, q_count, pos0, kv_len, layer, tq, sm_scale, pairs_per_chunk,
            window, softcap,
        )
    out = out.reshape(num_tiles, num_kv_heads, group, tq, head_dim).transpose(0, 3, 1, 2, 4)
    out = out.reshape(num_tiles * tq, num_q_heads, head_dim).astype(q.dtype)
    # Each real token sits in exactly one tile; padding rows go out of range and are dropped.
    dest = jnp.where(tok_valid, tok, num_tokens).reshape(-1)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")



def _cap(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's logit soft-cap, softcap * tanh(scores / softcap); the scores as they are without one."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _window_start(pos0: jax.Array, window: jax.Array) -> jax.Array:  # i32[G]
    """The first key any token of each tile sees: its first token's window starts earliest."""
    return jnp.maximum(pos0 - window + 1, 0)


def _shapes(q_tiles, k_cache, block_tables, tq):
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    num_layers, _, num_blocks, block_size, _ = k_cache.shape
    return num_tiles, num_kv_heads, rows // tq, head_dim, num_layers, num_blocks, block_size, block_tables.shape[1]


def _attend_gathered(q_tiles, k_cache, v_cache, block_tables, seq, pos0, kv_len, layer, tq, sm_scale, window, softcap):
    """Short tables: gather each tile's whole context in one go, attend in one einsum
    (fewer, larger ops than the loop: faster when the context is a few blocks)."""
    num_tiles, num_kv_heads, group, head_dim, num_layers, num_blocks, block_size, width = _shapes(
        q_tiles, k_cache, block_tables, tq
    )
    offs = jnp.arange(tq)
    # Block ids of (layer, head) in the flat block axis: one gather from the stacked cache.
    ctx = width * block_size
    flat_ids = (layer * num_kv_heads + jnp.arange(num_kv_heads))[None, :, None] * num_blocks + block_tables[seq][:, None, :]
    flat_shape = (num_layers * num_kv_heads * num_blocks, block_size, head_dim)
    # An 8-bit cache's blocks are gathered as they are stored, then widened to q's dtype (scales: outside).
    k = k_cache.reshape(flat_shape)[flat_ids].reshape(num_tiles, num_kv_heads, ctx, head_dim).astype(q_tiles.dtype)
    v = v_cache.reshape(flat_shape)[flat_ids].reshape(num_tiles, num_kv_heads, ctx, head_dim).astype(q_tiles.dtype)
    key_pos = jnp.arange(ctx)
    key_valid = key_pos[None, :] < kv_len[:, None]  # [G, C]
    if window is not None:  # keys before every token's window: as if past kv_len
        key_valid &= key_pos[None, :] >= _window_start(pos0, window)[:, None]
    # Slots past kv_len may hold stale values or NaN: scores there are masked below, and V is
    # zeroed so that 0 * NaN cannot reach the output.
    v = jnp.where(key_valid[:, None, :, None], v, 0)

    scores = _cap(jnp.einsum("ghrd,ghcd->ghrc", q_tiles, k, preferred_element_type=jnp.float32) * sm_scale, softcap)
    q_pos = pos0[:, None] + offs[None, :]  # [G, tq]
    visible = key_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [G, tq, C]
    if window is not None:
        visible &= q_pos[:, :, None] - key_pos[None, None, :] < window
    visible = jnp.broadcast_to(visible[:, None], (num_tiles, group, tq, ctx)).reshape(num_tiles, 1, group * tq, ctx)
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("ghrc,ghcd->ghrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.where(denom == 0, 1.0, denom)
    return out  # f32[G, Hkv, group * tq, D]


def default_pairs_per_chunk(rows: int) -> int:
    """(tile, block) pairs one loop iteration takes: ~8k score rows, at most 512 pairs."""
    return max(32, min(512, 8192 // rows))


def _attend_block_pairs(
    q_tiles, k_cache, v_cache, block_tables, seq, q_count, pos0, kv_len, layer, tq, sm_scale, pairs_per_chunk, window,
    softcap,
):
    """Long tables: attend over the (tile, block) pairs that are really visible, a chunk of
    pairs per loop iteration with an online softmax. Pairs are listed tile by tile, so a tile's
    partial results are combined with sorted segment reductions; the loop runs
    ceil(real pairs / chunk) times. Cost follows the context the batch really has, not
    tiles x the longest context (one 1,000-token sequence among 63 short ones no longer makes
    every tile walk 64 blocks), and with a window it starts at the block of the tile's first key in it."""
    num_tiles, num_kv_heads, group, head_dim, num_layers, num_blocks, block_size, width = _shapes(
        q_tiles, k_cache, block_tables, tq
    )
    rows = group * tq
    chunk = min(num_tiles * width, pairs_per_chunk or default_pairs_per_chunk(rows))
    num_pairs = -(-num_tiles * width // chunk) * chunk  # a whole number of chunks, >= every real count
    # Blocks a tile sees: up to its last token's position (causal), at most the table width.
    seen = jnp.where(q_count > 0, jnp.minimum((pos0 + q_count + block_size - 1) // block_size, width), 0)
    if window is not None:  # ... from the block of the first key in its first token's window
        window_start = _window_start(pos0, window)  # i32[G]
        first_col = window_start // block_size  # i32[G]
        seen = jnp.where(q_count > 0, seen - first_col, 0)
    pair_end = jnp.cumsum(seen)
    pair = jnp.arange(num_pairs)
    pair_tile = jnp.minimum(jnp.searchsorted(pair_end, pair, side="right"), num_tiles - 1)
    pair_col = pair - (pair_end[pair_tile] - seen[pair_tile])
    if window is not None:
        pair_col += first_col[pair_tile]
    pair_real = pair < pair_end[-1]
    pair_block = block_tables[seq[pair_tile], jnp.clip(pair_col, 0, width - 1)]

    offs = jnp.arange(tq)
    flat_shape = (num_layers * num_kv_heads * num_blocks, block_size, head_dim)
    k_flat, v_flat = k_cache.reshape(flat_shape), v_cache.reshape(flat_shape)
    head_base = (layer * num_kv_heads + jnp.arange(num_kv_heads))[None, :] * num_blocks  # [1, Hkv]
    q_pos = pos0[:, None] + offs[None, :]  # [G, tq]: causal limit of each row's token
    row_pos = jnp.broadcast_to(q_pos[:, None, :], (num_tiles, group, tq)).reshape(num_tiles, rows)
    q_scaled = q_tiles.astype(jnp.float32) * sm_scale

    def step(i, carry):
        m, l, acc = carry
        part = lambda a: jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk)  # noqa: E731
        tile, col, real, block = part(pair_tile), part(pair_col), part(pair_real), part(pair_block)
        ids = head_base + block[:, None]  # [C, Hkv]
        k = k_flat[ids].astype(jnp.float32)  # [C, Hkv, S, D]
        v = v_flat[ids].astype(jnp.float32)
        key_pos = col[:, None] * block_size + jnp.arange(block_size)[None, :]  # [C, S]
        key_valid = real[:, None] & (key_pos < kv_len[tile][:, None])
        if window is not None:  # keys of the first block before every token's window: as if past kv_len
            key_valid &= key_pos >= window_start[tile][:, None]
        # Slots past kv_len may hold stale values or NaN: their scores are masked and V zeroed,
        # so 0 * NaN cannot reach the output.
        v = jnp.where(key_valid[:, None, :, None], v, 0.0)
        scores = _cap(jnp.einsum("chrd,chsd->chrs", q_scaled[tile], k), softcap)
        visible = key_valid[:, None, :] & (key_pos[:, None, :] <= row_pos[tile][:, :, None])  # [C, rows, S]
        if window is not None:
            visible &= row_pos[tile][:, :, None] - key_pos[:, None, :] < window
        scores = jnp.where(visible[:, None], scores, -jnp.inf)
        m_new = jnp.maximum(m, jax.ops.segment_max(scores.max(axis=-1), tile, num_tiles, indices_are_sorted=True))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[tile][..., None])
        correction = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        pv = jnp.einsum("chrs,chsd->chrd", p, v)
        l = l * correction + jax.ops.segment_sum(p.sum(axis=-1), tile, num_tiles, indices_are_sorted=True)
        acc = acc * correction[..., None] + jax.ops.segment_sum(pv, tile, num_tiles, indices_are_sorted=True)
        return m_new, l, acc

    init = (
        jnp.full((num_tiles, num_kv_heads, rows), -jnp.inf, jnp.float32),
        jnp.zeros((num_tiles, num_kv_heads, rows), jnp.float32),
        jnp.zeros((num_tiles, num_kv_heads, rows, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, (pair_end[-1] + chunk - 1) // chunk, step, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    return out  # f32[G, Hkv, group * tq, D]
