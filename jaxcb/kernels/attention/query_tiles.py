"""Split a ragged batch of query tokens into tiles of one sequence each (shared by the kernel and the XLA path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def max_query_tiles(num_tokens: int, num_seqs_max: int, tokens_per_tile: int) -> int:
    """A static bound on the tiles a batch can need: each sequence adds at most one partial tile."""
    return min(num_tokens, -(-num_tokens // tokens_per_tile) + num_seqs_max)


def query_tile_table(
    query_start_loc: jax.Array,  # i32[R + 1]
    kv_lens: jax.Array,  # i32[R]
    num_seqs: jax.Array,  # i32[]
    num_tiles: int,
    tokens_per_tile: int,
) -> jax.Array:  # i32[5, num_tiles]: seq, first token, num tokens (0: padding tile), first position, kv_len
    num_seqs_max = kv_lens.shape[0]
    seq_ids = jnp.arange(num_seqs_max)
    q_lens = jnp.where(seq_ids < num_seqs, query_start_loc[1:] - query_start_loc[:-1], 0)
    tiles_per_seq = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    tile_end = jnp.cumsum(tiles_per_seq)
    tile = jnp.arange(num_tiles)
    seq = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), num_seqs_max - 1)
    first_in_seq = tile - (tile_end[seq] - tiles_per_seq[seq])
    real = tile < tile_end[-1]
    q_start = query_start_loc[seq] + first_in_seq * tokens_per_tile
    q_count = jnp.where(real, jnp.minimum(tokens_per_tile, q_lens[seq] - first_in_seq * tokens_per_tile), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + first_in_seq * tokens_per_tile
    return jnp.stack([seq, q_start, q_count, pos0, kv_lens[seq]]).astype(jnp.int32)
