"""Ragged paged attention for mixed prefill/decode batches, as a Pallas (Triton backend) kernel.

A step's query tokens are one flat ragged batch: sequence r owns tokens
`query_start_loc[r]:query_start_loc[r+1]` (one token for a decode, a chunk for a prefill),
sits at the end of a context of `kv_lens[r]` tokens -- which already include its new tokens --
held in the blocks `block_tables[r]`, and attends causally to it: the i-th of its q_len new
tokens sits at position `kv_lens[r] - q_len + i` and sees keys 0..that position. Tokens past
`query_start_loc[num_seqs]` are padding and return 0. `ragged_paged_attention_reference` is
the definition; the kernel is tested against it.

Sliding window (`window`, a traced i32[] or None), as Hugging Face's Mistral, Qwen2 and Gemma:
the token at position p sees key j iff j <= p and p - j < window; a window >= the context
(`NO_WINDOW`) is no window. None compiles the kernel without it, exactly as before.

Logit soft-capping (`softcap`, a static float c > 0 or None), as Hugging Face's Gemma 2: each
score q.k * sm_scale becomes c * tanh(score / c) before the causal and window masks and the
softmax, so the online softmax's running max (and split-KV's merge) works on capped scores. None
compiles the kernel without it, exactly as before.

8-bit caches (int8, float8_e4m3fn, float8_e5m2; `QUANTIZED_CACHE_DTYPES`): the K/V tiles are loaded
as they are stored, one byte an element, and converted to q's dtype in registers (every such
value is exact in bf16 and f32) before the dots. The kernel knows no scales: the caller multiplies
q by the K scale before and the output by the V scale after (they are per KV head, constant over
the KV loop). The reference reads such a cache as its integer/fp8 values in float32, alike.

Cache layout: `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`, so one
block of one head is a contiguous [block_size, head_dim] tile. The layer is an argument:
a model's layer scan passes the whole stacked cache, which is never copied.

Work decomposition (after vLLM's Triton "unified attention"):

    grid = (query tile, kv head, kv split)

    query tile: consecutive tokens of ONE sequence, times the `group` query heads that
    share the kv head -> a [block_m, head_dim] matrix whose rows are (token, head-in-group)
    pairs, so a decode token of an 8B model (group 4) still gives the matrix unit several
    rows. Two static tile classes share the launch (`QueryTiles`): a sequence with at most
    `decode_tokens` query tokens takes one 16-row decode tile; a longer one (a prefill
    chunk) is cut into 64-row prefill tiles, which read its context 4x less often.
    kv loop: the sequence's context in tiles of `pages_per_tile` blocks, gathered from the
    cache through the block table; online softmax; stops at the tile's last causal key, and with
    a sliding window starts at the KV tile of the first key in the window of the tile's first
    row (tiles before it are never read); software-pipelined (the next tile's K/V loads while
    this one is computed).
    kv split: for small decode batches, the context (in the window) shared among programs
    (`choose_num_splits`, from the launch's occupancy).

    Each tile class is a launch of its own (`QueryTiles.launches`): the decode launch first, over
    the table's decode tiles (they follow the prefill tiles: it starts at their count), then, in a
    bucket that can hold a prefill tile, the prefill launch, which writes its rows into the decode
    launch's output (aliased: no copy; in a step with no prefill its programs return at once). A
    decode program so has the registers and shared memory of a 16-row tile, not of the 64-row one,
    and more of them fit an SM. Each launch has its own warps (`default_num_warps`: 8 where a tile's
    f32 accumulator would spill at 4, as the 64-row tiles at head dim 256 do), and head dims above
    128 read 16-key KV tiles (`default_kv_tile`).

The wrapper turns the ragged batch into a per-tile table (which sequence, first token,
number of tokens, position of the first token, context length, tile class; `query_tiles.py`)
with a few cheap jnp ops, so the kernel never searches. Padding tiles (past the real ones) do
no work.

In this file: the reference, the shape and dtype checks, the kernel, the jitted wrapper.
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.query_tiles import Launch, default_kv_tile, query_tiles, two_class_tile_table

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)
NO_WINDOW = 2**30  # a window longer than any context: a full-attention layer of a model with windowed ones
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# 8-bit cache dtypes every form reads, converted to q's dtype as the tiles are loaded; q may differ from them.
QUANTIZED_CACHE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


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
    window: Optional[jax.Array] = None,  # i32[]: sliding window (keys p - window < j <= p); None: none
    softcap: Optional[float] = None,  # static: scores -> softcap * tanh(scores / softcap); None: none
) -> jax.Array:  # [T, num_q_heads, head_dim], q.dtype
    """The definition, written for clarity, not speed: it gathers every sequence's whole block table and
    then every token's sequence, which is O(T x context). Keys outside a sequence's `kv_lens` or outside
    a token's window never contribute, even if they hold NaN."""
    check_attention_inputs(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer,
                           window=window, softcap=softcap)
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
    if softcap is not None:  # as transformers' Gemma 2: capped before the mask
        scores = softcap * jnp.tanh(scores / softcap)
    visible = (key_idx[None, :] <= q_pos[:, None]) & (key_idx[None, :] < kv_lens[seq][:, None]) & is_real[:, None]
    if window is not None:
        visible &= q_pos[:, None] - key_idx[None, :] < jnp.reshape(window, ())
        v_tok = jnp.where(visible[:, :, None, None], v_tok, 0)  # keys before the window may hold anything, even NaN
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(scores - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thgc,tchd->thgd", p, v_tok) / jnp.where(denom == 0, 1.0, denom)
    out = jnp.where(is_real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def check_attention_inputs(
    q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer, *, q_may_differ_from_cache=False,
    window=None, softcap=None,
) -> None:
    """Shape and dtype checks with messages that name the offending argument. An implementation
    that reads the cache in one dtype and computes in q's passes q_may_differ_from_cache; every
    form computes an 8-bit cache in q's dtype."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {q.shape=}")
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_layers, num_kv_heads, num_blocks, block_size, head_dim], "
            f"got {k_cache.shape=} {v_cache.shape=}"
        )
    _, num_kv_heads, _, block_size, head_dim = k_cache.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim} ({q.shape=}, {k_cache.shape=})")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_q_heads={q.shape[1]} must be a multiple of num_kv_heads={num_kv_heads}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{block_size=} must be one of {SUPPORTED_BLOCK_SIZES}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} must equal v_cache dtype {v_cache.dtype}")
    if q.dtype != k_cache.dtype and not q_may_differ_from_cache and k_cache.dtype not in QUANTIZED_CACHE_DTYPES:
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks_per_seq], got {block_tables.shape=}")
    num_seqs_max = block_tables.shape[0]
    if kv_lens.shape != (num_seqs_max,):
        raise ValueError(f"kv_lens must be [{num_seqs_max}] like block_tables' rows, got {kv_lens.shape=}")
    if query_start_loc.shape != (num_seqs_max + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs_max + 1}], got {query_start_loc.shape=}")
    for name, x in (("kv_lens", kv_lens), ("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("num_seqs", num_seqs), ("layer", layer)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if window is not None and (getattr(window, "dtype", None) != jnp.int32 or jnp.shape(window) not in ((), (1,))):
        raise ValueError(f"window must be an int32 scalar array (None: no window), got "
                         f"{getattr(window, 'dtype', type(window).__name__)}{list(jnp.shape(window))}")
    # A static number, the same in every layer of a model (a jit's static argument), never an array.
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not 0 < softcap < float("inf")):
        raise ValueError(f"softcap must be a positive Python float (None: no capping), got {softcap!r}")


def _attend(
    tile, head, split,  # the program's ids, read outside the class branches (the interpreter wants them there)
    tiles_ref, layer_ref, window_ref, block_tables_ref, q_ref, k_ref, v_ref, o_ref, split_refs, *,
    block_m: int, group: int, pages_per_tile: int, num_kv_heads: int, num_blocks: int, sm_scale: float,
    num_splits: int, softcap: Optional[float],
):
    """One (query tile, KV head, split) program with a tile of `block_m` rows. With a window
    (`window_ref` i32[1]; None: none, and none of its code), the KV loop starts at the first KV tile
    that the tile's first row -- the one whose window starts earliest -- can see: whole tiles before
    it are never read. With a `softcap` the scores are capped before the masks (None: none of its code)."""
    seq, q_start, q_count, pos0, kv_len = (tiles_ref[i, tile] for i in range(5))
    block_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    kv_tile = pages_per_tile * block_size
    rows = pl.ds(q_start * group, block_m)
    q = q_ref[head, rows, :]  # [block_m, head_dim]
    row_tok = lax.broadcasted_iota(jnp.int32, (block_m,), 0) // group
    row_valid = row_tok < q_count
    row_pos = pos0 + row_tok  # causal limit of each row
    page_base = (layer_ref[0] * num_kv_heads + head) * num_blocks
    num_kv_tiles = pl.cdiv(jnp.minimum(kv_len, pos0 + q_count), kv_tile)  # >= 1: q_count > 0 here
    # Split-KV: this program takes its share of the tile's KV tiles (in the window), an empty share writes
    # the identity.
    if window_ref is None:
        per_split = pl.cdiv(num_kv_tiles, num_splits)
        first_kv_tile = jnp.minimum(split * per_split, num_kv_tiles)
    else:
        window = window_ref[0]
        first_key = jnp.maximum(pos0 - window + 1, 0)  # the first key any row of the tile sees
        window_kv_tile = first_key // kv_tile  # < num_kv_tiles: row 0 sees its own position
        per_split = pl.cdiv(num_kv_tiles - window_kv_tile, num_splits)
        first_kv_tile = jnp.minimum(window_kv_tile + split * per_split, num_kv_tiles)
    last_kv_tile = jnp.minimum(first_kv_tile + per_split, num_kv_tiles)

    def pages_of(t):  # i32[pages_per_tile]; t clamped: the block ids read one tile ahead stay in the table
        t = jnp.minimum(t, num_kv_tiles - 1)
        return block_tables_ref[seq, pl.ds(t * pages_per_tile, pages_per_tile)] + page_base

    # Each iteration reads the next tile's block ids, and takes its own from the carry: so the K/V
    # addresses of a tile are known an iteration early, and Triton's software pipeliner (num_stages=3)
    # keeps the next tile's K/V copies in flight, in a second shared-memory buffer, while this tile is
    # computed. With the block ids read in the same iteration the K/V loads depend on a load of that
    # iteration: the pipeliner then gives them one buffer, issued after the dots and awaited at once.
    def body(t, carry):
        acc, m_prev, l_prev, pages = carry
        next_pages = pages_of(t + 1)
        k = k_ref[pages].reshape(kv_tile, head_dim)
        v = v_ref[pages].reshape(kv_tile, head_dim)
        if k.dtype != q.dtype:  # an 8-bit cache: widened in registers (its scales are applied outside)
            # Through f16, which holds every int8 and fp8 value exactly, as bf16 and f32 do after it: int8's
            # direct conversion spilled at head dim 256 (Gemma 2's decode launch), this one does not.
            k, v = k.astype(jnp.float16).astype(q.dtype), v.astype(jnp.float16).astype(q.dtype)
        key_pos = t * kv_tile + lax.broadcasted_iota(jnp.int32, (kv_tile,), 0)
        key_valid = key_pos < kv_len
        if window_ref is not None:  # keys of the first tile before every row's window: as if past kv_len
            key_valid &= key_pos >= first_key
        # Rows past kv_len may be stale or NaN. Their scores are replaced by MASK_VALUE below (a select,
        # so a NaN score never survives); only V needs zeroing, where 0 * NaN would reach the output.
        v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
        s = plgpu.dot(q, k.T).astype(jnp.float32) * sm_scale  # [block_m, kv_tile]
        if softcap is not None:  # before the masks: a masked key stays MASK_VALUE, far below -softcap
            s = softcap * jnp.tanh(s * (1.0 / softcap))
        visible = key_valid[None, :] & (key_pos[None, :] <= row_pos[:, None])
        if window_ref is not None:
            visible &= row_pos[:, None] - key_pos[None, :] < window
        s = jnp.where(visible, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=-1)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return acc, m_next, l_next, next_pages

    init = (
        jnp.zeros((block_m, head_dim), jnp.float32),
        jnp.full((block_m,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
        pages_of(first_kv_tile),
    )
    acc, m_max, l_sum, *_ = lax.fori_loop(first_kv_tile, last_kv_tile, body, init)
    if num_splits == 1:
        out = acc / jnp.where(l_sum == 0, 1.0, l_sum)[:, None]
        plgpu.store(o_ref.at[head, rows, :], out.astype(o_ref.dtype), mask=row_valid[:, None])
    else:  # partial results; `_combine_splits` merges them
        m_ref, l_ref = split_refs
        plgpu.store(o_ref.at[split, head, rows, :], acc, mask=row_valid[:, None])
        plgpu.store(m_ref.at[split, head, rows], m_max, mask=row_valid)
        plgpu.store(l_ref.at[split, head, rows], l_sum, mask=row_valid)


def _kernel(
    first_ref,  # i32[1]: the launch's first tile in the table (the decode launch starts past the prefill tiles)
    tiles_ref,  # i32[6, num_tiles]: `step_tile_table`
    layer_ref,  # i32[1]
    block_tables_ref,  # i32[R, W] (W a multiple of pages_per_tile)
    q_ref,  # [num_kv_heads, T * group + spare rows, head_dim]
    k_ref,  # [num_layers * num_kv_heads * num_blocks, block_size, head_dim]
    v_ref,
    *refs,  # [window_ref], [o_in_ref (aliased to o_ref: the rows another launch wrote)], o_ref, [m_ref, l_ref]
    tile_class: int,
    block_m: int,
    num_tiles: int,
    aliased: bool,
    windowed: bool,
    **static,
):
    """One launch's program: the tile of its class at `first + program_id(0)`; any other tile (the other
    class's, padding, past the table) runs nothing."""
    window_ref = refs[0] if windowed else None  # i32[1]
    refs = refs[int(windowed) + int(aliased):]
    o_ref, *split_refs = refs
    index = first_ref[0] + pl.program_id(0)
    tile = jnp.minimum(index, num_tiles - 1)
    head, split = pl.program_id(1), pl.program_id(2)
    runs = (index < num_tiles) & (tiles_ref[2, tile] > 0) & (tiles_ref[5, tile] == tile_class)

    @pl.when(runs)
    def _():
        _attend(tile, head, split, tiles_ref, layer_ref, window_ref, block_tables_ref, q_ref, k_ref, v_ref, o_ref,
                split_refs, block_m=block_m, **static)


def _row_tile_class(query_start_loc: jax.Array, num_rows: int, group: int, decode_tokens: int) -> jax.Array:
    """i32[num_rows]: the tile class of each (token, head-in-group) row's sequence (1: prefill tiles), as
    `two_class_tile_table` classes it; rows past the real tokens take the last sequence's."""
    token = jnp.arange(num_rows) // group
    num_seqs_max = query_start_loc.shape[0] - 1
    seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right"), num_seqs_max - 1)
    return (query_start_loc[seq + 1] - query_start_loc[seq] > decode_tokens).astype(jnp.int32)


def _combine_splits(acc: jax.Array, m: jax.Array, l_sum: jax.Array) -> jax.Array:
    """Merge split-KV partials: acc f32[S, H, rows, D] with each split's running max m and sum of exps
    l_sum f32[S, H, rows] -> the normalised output f32[H, rows, D] (online softmax, split by split)."""
    m_all = m.max(axis=0)
    weight = jnp.exp(m - m_all[None])  # an empty split (m = MASK_VALUE) weighs 0
    total = (l_sum * weight).sum(axis=0)
    out = (acc * weight[..., None]).sum(axis=0)
    return out / jnp.where(total == 0, 1.0, total)[..., None]


def kernel_launches(num_tokens: int, num_seqs_max: int, width: int, *, group: int, num_kv_heads: int, head_dim: int,
                    block_size: int, dtype, block_m: int = 16, prefill_block_m: int = 64,
                    kv_tile: Optional[int] = None, num_warps: Optional[int] = None, num_stages: int = 3,
                    num_splits: Optional[int] = None) -> tuple[Launch, ...]:
    """The launches `ragged_paged_attention` makes for a bucket of `num_tokens` tokens, `num_seqs_max`
    sequences and block tables `width` blocks wide (the same defaults): decode tiles first."""
    kv_tile = kv_tile or default_kv_tile(head_dim)
    plan = query_tiles(num_tokens, num_seqs_max, group, block_size, block_m, prefill_block_m, kv_tile)
    return plan.launches(num_tokens, num_seqs_max, num_kv_heads, width * block_size, head_dim=head_dim,
                         itemsize=jnp.dtype(dtype).itemsize, kv_tile=plan.pages_per_tile * block_size,
                         num_warps=num_warps, num_stages=num_stages, num_splits=num_splits)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_m", "prefill_block_m", "kv_tile", "num_warps",
                                             "num_stages", "interpret", "num_splits", "softcap"))
def ragged_paged_attention(
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
    block_m: int = 16,  # rows of a decode tile
    prefill_block_m: int = 64,  # rows of a prefill tile
    kv_tile: Optional[int] = None,  # keys per KV tile; None: `default_kv_tile(head_dim)` (32; 16 above head dim 128)
    num_warps: Optional[int] = None,  # every launch's warps; None: each launch's `default_num_warps`
    num_stages: int = 3,  # 3: the next K/V tile loads while this one is computed (`_attend`)
    interpret: bool = False,
    tiles: Optional[jax.Array] = None,  # i32[6, num_tiles]: `step_tile_table`, built once per step; None: here
    num_splits: Optional[int] = None,  # split-KV programs per (tile, KV head); None: `choose_num_splits`
    window: Optional[jax.Array] = None,  # i32[]: sliding window, an operand (it varies by layer); None: none
    softcap: Optional[float] = None,  # static: logit soft-cap c (scores -> c * tanh(scores / c)); None: none
) -> jax.Array:  # [T, num_q_heads, head_dim]; padding tokens -> 0
    check_attention_inputs(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer,
                           window=window, softcap=softcap)
    num_tokens, num_q_heads, head_dim = q.shape
    kv_tile = kv_tile or default_kv_tile(head_dim)
    num_layers, num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    num_seqs_max, width = block_tables.shape
    plan = query_tiles(num_tokens, num_seqs_max, group, block_size, block_m, prefill_block_m, kv_tile)
    num_tiles, pages_per_tile = plan.num_tiles, plan.pages_per_tile
    if tiles is None:
        tiles = two_class_tile_table(query_start_loc, kv_lens, jnp.reshape(num_seqs, ()), num_tiles,
                                     plan.decode_tokens, plan.prefill_tokens)
    assert tiles.shape == (6, num_tiles), (tiles.shape, num_tiles)
    padded_width = pl.cdiv(width, pages_per_tile) * pages_per_tile
    block_tables = jnp.pad(block_tables, ((0, 0), (0, padded_width - width)))
    # Rows (token, head-in-group) per kv head; a prefill tile's spare rows so the last tile's load stays in bounds.
    spare_rows = max(plan.classes)
    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_rows = jnp.pad(q_rows.reshape(num_kv_heads, num_tokens * group, head_dim), ((0, 0), (0, spare_rows), (0, 0)))
    flat = (num_layers * num_kv_heads * num_blocks, block_size, head_dim)

    launches = kernel_launches(num_tokens, num_seqs_max, width, group=group, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, block_size=block_size, dtype=k_cache.dtype, block_m=block_m,
                               prefill_block_m=prefill_block_m, kv_tile=kv_tile, num_warps=num_warps,
                               num_stages=num_stages, num_splits=num_splits)
    static = dict(group=group, pages_per_tile=pages_per_tile, num_kv_heads=num_kv_heads, num_blocks=num_blocks,
                  sm_scale=sm_scale, num_tiles=num_tiles, softcap=None if softcap is None else float(softcap))
    operands = (tiles, jnp.reshape(layer, (1,)), block_tables, q_rows, k_cache.reshape(flat), v_cache.reshape(flat))
    if window is not None:  # after the cache: the operands before it keep their places
        operands += (jnp.reshape(window, (1,)),)
    num_large = jnp.sum(tiles[5]).astype(jnp.int32)  # the prefill tiles come first in the table

    def launch(spec, first, out=None):
        """One tile class's pallas_call; `out`: the rows the other launch wrote, which this one keeps."""
        kernel = functools.partial(_kernel, tile_class=spec.tile_class, block_m=spec.block_m,
                                   num_splits=spec.num_splits, aliased=out is not None and spec.num_splits == 1,
                                   windowed=window is not None, **static)
        rows = q_rows.shape[1]
        if spec.num_splits == 1:
            out_shape = jax.ShapeDtypeStruct(q_rows.shape, q.dtype)
        else:
            out_shape = (jax.ShapeDtypeStruct((spec.num_splits, num_kv_heads, rows, head_dim), jnp.float32),
                         jax.ShapeDtypeStruct((spec.num_splits, num_kv_heads, rows), jnp.float32),
                         jax.ShapeDtypeStruct((spec.num_splits, num_kv_heads, rows), jnp.float32))
        aliased = out is not None and spec.num_splits == 1
        result = pl.pallas_call(
            kernel,
            grid=(spec.num_programs, num_kv_heads, spec.num_splits),
            out_shape=out_shape,
            input_output_aliases={1 + len(operands): 0} if aliased else {},
            compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps, num_stages=num_stages),
            interpret=interpret,
            name="ragged_paged_attention_" + ("decode" if spec.tile_class == 0 else "prefill"),
        )(jnp.reshape(first, (1,)), *operands, *((out,) if aliased else ()))
        if spec.num_splits == 1:
            return result
        combined = _combine_splits(*result).astype(q.dtype)
        if out is None:
            return combined
        # Split partials cover only this class's rows: the other launch's rows come from `out`.
        row_tile_class = _row_tile_class(query_start_loc, rows, group, plan.decode_tokens)
        return jnp.where((row_tile_class == spec.tile_class)[None, :, None], combined, out)

    out = launch(launches[0], num_large if len(launches) == 2 else jnp.int32(0))
    if len(launches) == 2:
        # Launched in every step of a bucket that can hold a prefill: in a step without one, its programs
        # find no tile of their class and return at once (microseconds). A lax.cond on the device's tile
        # count would cost more: XLA's GPU conditional copies its predicate to the host and waits, once
        # a layer.
        out = launch(launches[1], jnp.int32(0), out)
    out = out[:, : num_tokens * group].reshape(num_kv_heads, num_tokens, group, head_dim).transpose(1, 0, 2, 3)
    real = jnp.arange(num_tokens) < query_start_loc[jnp.reshape(num_seqs, ())]
    # Rows of padding tokens were never written (uninitialised memory): define them as 0.
    return jnp.where(real[:, None, None], out.reshape(num_tokens, num_q_heads, head_dim), 0)
