"""Split a ragged batch of query tokens into tiles of one sequence each (shared by the kernel and the XLA path).

`query_tile_table` cuts every sequence at one tile size. `two_class_tile_table` (the Pallas
kernel's) gives each sequence the tile size of its class: sequences with few query tokens
(decodes) get small tiles, the others (prefill chunks) large ones, so a long prefill reads its
context once per large tile instead of once per few tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def max_query_tiles(num_tokens: int, num_seqs_max: int, tokens_per_tile: int) -> int:
    """A static bound on the tiles a batch can need: each sequence adds at most one partial tile.
    Also the bound for `two_class_tile_table` at its large tile size: a sequence of the small class
    has one tile, and one of the large class at most one partial tile."""
    return min(num_tokens, -(-num_tokens // tokens_per_tile) + num_seqs_max)


def query_tile_table(
    query_start_loc: jax.Array,  # i32[R + 1]
    kv_lens: jax.Array,  # i32[R]
    num_seqs: jax.Array,  # i32[]
    num_tiles: int,
    tokens_per_tile: int,
) -> jax.Array:  # i32[5, num_tiles]: seq, first token, num tokens (0: padding tile), first position, kv_len
    return two_class_tile_table(query_start_loc, kv_lens, num_seqs, num_tiles, tokens_per_tile, tokens_per_tile)[:5]


def two_class_tile_table(
    query_start_loc: jax.Array,  # i32[R + 1]
    kv_lens: jax.Array,  # i32[R]
    num_seqs: jax.Array,  # i32[]
    num_tiles: int,  # max_query_tiles(T, R, large_tokens_per_tile)
    small_tokens_per_tile: int,
    large_tokens_per_tile: int,
) -> jax.Array:  # i32[6, num_tiles]: the rows of `query_tile_table`, then 1 for a large tile (0: small)
    """A sequence with more than `small_tokens_per_tile` query tokens is cut into large tiles, any other
    into one small tile. The large tiles come first (the longest programs start first), then the small
    ones, each class in sequence order; padding tiles (num tokens 0) last."""
    num_seqs_max = kv_lens.shape[0]
    seq_ids = jnp.arange(num_seqs_max)
    q_lens = jnp.where(seq_ids < num_seqs, query_start_loc[1:] - query_start_loc[:-1], 0)
    large = q_lens > small_tokens_per_tile  # bool[R]
    if large_tokens_per_tile <= small_tokens_per_tile:  # one tile size: every tile is of the small class
        large = jnp.zeros_like(large)
    tokens_per_tile = jnp.where(large, large_tokens_per_tile, small_tokens_per_tile)  # i32[R]
    tiles_per_seq = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    large_end = jnp.cumsum(jnp.where(large, tiles_per_seq, 0))  # i32[R]: end of each sequence's large tiles
    small_end = large_end[-1] + jnp.cumsum(jnp.where(large, 0, tiles_per_seq))
    tile = jnp.arange(num_tiles)
    in_large = tile < large_end[-1]
    seq = jnp.where(in_large, jnp.searchsorted(large_end, tile, side="right"),
                    jnp.searchsorted(small_end, tile, side="right"))
    seq = jnp.minimum(seq, num_seqs_max - 1)
    class_end = jnp.where(in_large, large_end[seq], small_end[seq])
    first_in_seq = tile - (class_end - tiles_per_seq[seq])
    real = tile < small_end[-1]
    offset = first_in_seq * tokens_per_tile[seq]
    q_start = query_start_loc[seq] + offset
    q_count = jnp.where(real, jnp.minimum(tokens_per_tile[seq], q_lens[seq] - offset), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + offset
    is_large = real & large[seq]
    return jnp.stack([seq, q_start, q_count, pos0, kv_lens[seq], is_large]).astype(jnp.int32)
