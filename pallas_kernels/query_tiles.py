"""How the ragged paged-attention kernel cuts a step into programs: tile sizes, grid, tile table.

The launch grid is (query tile, KV head, KV split). A query tile holds consecutive query tokens of
ONE sequence. Everything static (tile sizes, how many tiles a bucket of T tokens and R sequences
can need, how many splits share a context) is decided here from shapes alone; what changes per
step is the tile table, built with a few cheap jnp ops so that the kernel never searches.

`two_class_tile_table` gives each sequence the tile size of its class: sequences with few query
tokens (decodes) get small tiles, the others (prefill chunks) large ones, so a long prefill
reads its context once per large tile instead of once per few tokens. `query_tile_table` cuts
every sequence at one size (jaxcb's XLA form uses it). Pure jax.numpy: no Pallas here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NUM_SMS = 132  # H100 / H200: what split-KV aims to fill


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def max_query_tiles(num_tokens: int, num_seqs_max: int, tokens_per_tile: int) -> int:
    """A static bound on the tiles a batch can need: each sequence adds at most one partial tile.
    Also the bound for `two_class_tile_table` at its large tile size: a sequence of the small class
    has one tile, and one of the large class at most one partial tile."""
    return min(num_tokens, -(-num_tokens // tokens_per_tile) + num_seqs_max)


def kernel_tile_sizes(group: int, block_size: int, block_m: int = 16, kv_tile: int = 32) -> tuple[int, int, int]:
    """(block_m, tokens_per_tile, pages_per_tile): power-of-two tiles of >= 16 rows/keys."""
    block_m = max(block_m, _next_pow2(group))
    tokens_per_tile = block_m // group
    pages_per_tile = max(1, kv_tile // block_size)
    return block_m, tokens_per_tile, pages_per_tile


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """The kernel's two static query-tile sizes and how many tiles a bucket of T tokens and R sequences launches.

    Decode tiles (`block_m` rows) hold a sequence of at most `decode_tokens` query tokens; a sequence
    with more (a prefill chunk) is cut into prefill tiles of `prefill_block_m` rows, `prefill_tokens`
    tokens each, and reads its context once per prefill tile. Both classes share one launch, classed
    per sequence at run time from its query length (after tpu-inference's ragged paged attention,
    which gives decode, prefill and mixed sequences their own static block sizes within one step;
    vLLM's Triton unified attention keeps 16-row tiles for every sequence and so re-reads a prefill's
    context once per 16 / group tokens). A per-bucket choice could not tell a 256-token prefill chunk
    from 256 decodes: both come in the same (256, 256) bucket. The grid is the prefill class's bound
    (a decode sequence has one tile, a prefill at most one partial tile), so a decode bucket launches
    as many programs as with decode tiles alone.
    """

    block_m: int  # decode tiles: rows (token, head in group)
    decode_tokens: int
    prefill_block_m: int  # equal to block_m where a bucket has one class (tiny buckets, very large groups)
    prefill_tokens: int
    pages_per_tile: int  # blocks per KV tile
    num_tiles: int  # grid: tiles of both classes that a bucket can need

    @property
    def classes(self) -> tuple[int, ...]:
        """The row counts of the tile classes the kernel compiles."""
        return (self.block_m,) if self.prefill_block_m == self.block_m else (self.block_m, self.prefill_block_m)


def query_tiles(num_tokens: int, num_seqs_max: int, group: int, block_size: int, block_m: int = 16,
                prefill_block_m: int = 64, kv_tile: int = 32) -> QueryTiles:
    """The tile sizes and grid for a bucket: static, from T = num_tokens and R = num_seqs_max."""
    block_m, decode_tokens, pages_per_tile = kernel_tile_sizes(group, block_size, block_m, kv_tile)
    prefill_block_m, prefill_tokens, _ = kernel_tile_sizes(group, block_size, max(prefill_block_m, block_m), kv_tile)
    if prefill_tokens <= decode_tokens or num_tokens <= decode_tokens:  # no sequence can take a prefill tile
        prefill_block_m, prefill_tokens = block_m, decode_tokens
    num_tiles = max_query_tiles(num_tokens, num_seqs_max, prefill_tokens)
    return QueryTiles(block_m, decode_tokens, prefill_block_m, prefill_tokens, pages_per_tile, num_tiles)


def choose_num_splits(num_tiles: int, num_kv_heads: int, max_context: int, num_sms: int = NUM_SMS) -> int:
    """How many programs share one (query tile, KV head)'s context: with fewer programs than two per SM
    (small decode batches) and a context of 2k tokens or more, enough splits to reach two per SM, in
    powers of two, each at least 512 tokens of context; otherwise 1. Static: from the bucket's shapes."""
    programs = num_tiles * num_kv_heads
    if max_context < 2048 or programs >= 2 * num_sms:
        return 1
    wanted = _next_pow2(-(-2 * num_sms // programs))
    most = 1 << ((max_context // 512).bit_length() - 1)  # a power of two <= max_context / 512
    return max(1, min(wanted, most))


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


def query_tile_table(
    query_start_loc: jax.Array,  # i32[R + 1]
    kv_lens: jax.Array,  # i32[R]
    num_seqs: jax.Array,  # i32[]
    num_tiles: int,
    tokens_per_tile: int,
) -> jax.Array:  # i32[5, num_tiles]: seq, first token, num tokens (0: padding tile), first position, kv_len
    return two_class_tile_table(query_start_loc, kv_lens, num_seqs, num_tiles, tokens_per_tile, tokens_per_tile)[:5]


def step_tile_table(query_start_loc: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, *, num_tokens: int,
                    group: int, block_size: int, block_m: int = 16, prefill_block_m: int = 64,
                    kv_tile: int = 32) -> jax.Array:
    """i32[6, num_tiles]: the kernel's query tiles for a step (`two_class_tile_table` at the kernel's tile sizes)."""
    tiles = query_tiles(num_tokens, kv_lens.shape[0], group, block_size, block_m, prefill_block_m, kv_tile)
    return two_class_tile_table(query_start_loc, kv_lens, jnp.reshape(num_seqs, ()), tiles.num_tiles,
                                tiles.decode_tokens, tiles.prefill_tokens)
