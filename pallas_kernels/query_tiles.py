"""How the ragged paged-attention kernel cuts a step into programs: tile sizes, grid, tile table.

The launch grid is (query tile, KV head, KV split). A query tile holds consecutive query tokens of
ONE sequence. Everything static (tile sizes, how many tiles a bucket of T tokens and R sequences
can need, how many splits share a context) is decided here from shapes alone; what changes per
step is the tile table, built with a few cheap jnp ops so that the kernel never searches.

`two_class_tile_table` gives each sequence the tile size of its class: sequences with few query
tokens (decodes) get small tiles, the others (prefill chunks) large ones, so a long prefill
reads its context once per large tile instead of once per few tokens. Each class runs in a
launch of its own (`QueryTiles.launches`), so decode programs get the small tile's registers and
shared memory, not the large one's, and as many of them run at once on an SM as those allow.
`query_tile_table` cuts every sequence at one size (jaxcb's XLA form uses it).

Split-KV is chosen per launch from occupancy (`choose_num_splits`): the programs an SM holds at
once (`ProgramResources`, from ptxas), the waves the launch makes over the GPU's SMs, and the
context. Pure jax.numpy and arithmetic: no Pallas here.

Head dim 256 (Gemma 2 and 3) keeps the query tiles -- the tile table is built once per step from
the batch alone (`step_tile_table`), which knows no head dim -- and changes only what a launch
holds: 16-key KV tiles (`default_kv_tile`) and 8 warps for the 64-row prefill tiles
(`default_num_warps`). At Gemma 2's shapes (window and cap) 32-key tiles took the decode launch to
166 registers and 89 KiB, two programs an SM (16 keys: 140 and 48 KiB, three), and at 4 warps the
prefill launch's 64 x 256 f32 accumulator spilled 436 bytes or more whatever the KV tile.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

NUM_SMS = 132  # H100 / H200: what split-KV aims to fill
SM_REGISTERS = 65536  # sm_90: 32-bit registers an SM holds
SM_SHARED_BYTES = 228 * 1024  # sm_90: shared memory an SM holds (227 KiB of it for one program)
SM_MAX_WARPS = 64
MIN_SPLIT_TOKENS = 512  # a split-KV share reads at least this much context
SPLIT_OVERHEAD_TOKENS = 256  # a program's fixed cost, in tokens of context it could read instead (an estimate)
SPLIT_SLACK = 0.05  # the fewest splits within 5% of the fastest


@dataclasses.dataclass(frozen=True)
class ProgramResources:
    """One program's registers (a thread) and shared memory, as ptxas reports them for a launch."""

    registers: int
    shared_bytes: int
    num_warps: int = 4

    @property
    def programs_per_sm(self) -> int:
        """Programs an SM runs at once: registers are allocated 8 a thread, a warp at a time."""
        by_registers = SM_REGISTERS // (-(-self.registers // 8) * 8 * 32 * self.num_warps)
        by_shared = SM_SHARED_BYTES // max(1, self.shared_bytes)
        return max(1, min(by_registers, by_shared, SM_MAX_WARPS // self.num_warps))


# ptxas -v on the engine's launches (bf16, block 16, 3 stages, the default KV tile and warps): llama8b (head
# dim 128, group 4, 32-key tiles, 4 warps) and Gemma 2 9B (head dim 256, group 2, 16-key tiles, the prefill
# launch at 8 warps; a window and the cap). tests/test_triton_resources.py compiles them and holds these
# figures to what it reports.
MEASURED_RESOURCES = {
    # (rows, head_dim, itemsize, kv_tile, num_warps, num_stages) -> ProgramResources
    (16, 128, 2, 32, 4, 3): ProgramResources(96, 45 * 1024),
    (64, 128, 2, 32, 4, 3): ProgramResources(164, 64 * 1024),
    (16, 256, 2, 16, 4, 3): ProgramResources(140, 48 * 1024),
    (64, 256, 2, 16, 8, 3): ProgramResources(230, 80 * 1024, num_warps=8),
}


def program_resources(rows: int, head_dim: int, itemsize: int, kv_tile: int, num_warps: int, num_stages: int
                      ) -> ProgramResources:
    """A launch's per-program resources: measured where the table has them, else an estimate from the
    tiles it holds (its K/V tiles in every stage and its query tile in shared memory; registers for the
    f32 accumulator and scores spread over the threads, never fewer than the measured decode launch)."""
    measured = MEASURED_RESOURCES.get((rows, head_dim, itemsize, kv_tile, num_warps, num_stages))
    if measured is not None:
        return measured
    shared = num_stages * 2 * kv_tile * head_dim * itemsize + rows * head_dim * itemsize
    threads = 32 * num_warps
    registers = min(255, 64 + (rows * head_dim + rows * kv_tile) * 4 // (4 * threads) * 2)
    return ProgramResources(registers, shared, num_warps)


def default_kv_tile(head_dim: int) -> int:
    """Keys of a KV tile: 32, or 16 above head dim 128, where a 32-key tile's K/V in three stages take a
    decode program to 89 KiB of shared memory and two programs an SM (16 keys: 48 KiB, four)."""
    return 32 if head_dim <= 128 else 16


def default_num_warps(rows: int, head_dim: int) -> int:
    """Warps of a launch whose query tiles have `rows` rows: 4, or 8 where the tile's f32 accumulator
    (rows x head_dim) is larger than 64 x 128: at 4 warps it spills (the 64-row tiles at head dim 256,
    the 128-row ones at 128)."""
    return 4 if rows * head_dim <= 64 * 128 else 8


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

    def num_class_tiles(self, num_tokens: int, num_seqs_max: int) -> tuple[int, ...]:
        """Tiles of each class a bucket can need: one decode tile a sequence; prefill tiles of
        prefill_tokens each, plus one partial tile per sequence long enough to take them. With one
        class, the whole table."""
        if len(self.classes) == 1:
            return (self.num_tiles,)
        num_decode = min(num_seqs_max, num_tokens, self.num_tiles)
        num_prefill_seqs = min(num_seqs_max, num_tokens // (self.decode_tokens + 1))
        return num_decode, min(self.num_tiles, num_tokens // self.prefill_tokens + num_prefill_seqs)

    def launches(self, num_tokens: int, num_seqs_max: int, num_kv_heads: int, max_context: int, *, head_dim: int,
                 itemsize: int, kv_tile: int, num_warps: Optional[int], num_stages: int,
                 num_splits: Optional[int] = None) -> tuple[Launch, ...]:
        """The kernel's launches for a bucket, decode tiles first, each with its warps (`num_warps` for every
        launch where given; else `default_num_warps` for its tiles) and split-KV (`num_splits` where given;
        else `choose_num_splits` from that launch's occupancy)."""
        out = []
        for cls, (rows, programs) in enumerate(zip(self.classes, self.num_class_tiles(num_tokens, num_seqs_max))):
            warps = num_warps or default_num_warps(rows, head_dim)
            per_sm = program_resources(rows, head_dim, itemsize, kv_tile, warps, num_stages).programs_per_sm
            splits = num_splits or choose_num_splits(programs, num_kv_heads, max_context, per_sm)
            out.append(Launch(cls, rows, programs, splits, warps))
        return tuple(out)


def query_tiles(num_tokens: int, num_seqs_max: int, group: int, block_size: int, block_m: int = 16,
                prefill_block_m: int = 64, kv_tile: int = 32) -> QueryTiles:
    """The tile sizes and grid for a bucket: static, from T = num_tokens and R = num_seqs_max."""
    block_m, decode_tokens, pages_per_tile = kernel_tile_sizes(group, block_size, block_m, kv_tile)
    prefill_block_m, prefill_tokens, _ = kernel_tile_sizes(group, block_size, max(prefill_block_m, block_m), kv_tile)
    if prefill_tokens <= decode_tokens or num_tokens <= decode_tokens:  # no sequence can take a prefill tile
        prefill_block_m, prefill_tokens = block_m, decode_tokens
    num_tiles = max_query_tiles(num_tokens, num_seqs_max, prefill_tokens)
    return QueryTiles(block_m, decode_tokens, prefill_block_m, prefill_tokens, pages_per_tile, num_tiles)


def choose_num_splits(num_tiles: int, num_kv_heads: int, max_context: int, programs_per_sm: int = 2,
                      num_sms: int = NUM_SMS) -> int:
    """How many programs share one (query tile, KV head)'s context, for one launch. A launch takes as
    many waves as its programs fill `programs_per_sm` x `num_sms` slots, and a wave as long as one
    program: its share of the context plus a fixed cost (SPLIT_OVERHEAD_TOKENS: the prologue, the
    partial results' writes and their merge). The split is the fewest (a power of two, each share at
    least MIN_SPLIT_TOKENS) within SPLIT_SLACK of the least time; 1 below 2k tokens of context. So
    one sequence at 4k splits 8 ways (a wave a tenth full either way, the programs 8x shorter), 32
    decodes at 2k (256 programs, 0.4 of a wave) 2 ways, and 128 at 4k (1.6 waves) not at all.
    Static: from the bucket's shapes and the launch's occupancy."""
    programs = num_tiles * num_kv_heads
    if max_context < 4 * MIN_SPLIT_TOKENS or programs == 0:
        return 1
    wave = programs_per_sm * num_sms
    most = 1 << ((max_context // MIN_SPLIT_TOKENS).bit_length() - 1)  # a power of two <= context / 512

    def time(splits: int) -> float:  # in tokens of context read by one program
        return -(-programs * splits // wave) * (max_context / splits + SPLIT_OVERHEAD_TOKENS)

    candidates = [1 << i for i in range(most.bit_length())]
    best = min(time(s) for s in candidates)
    return next(s for s in candidates if time(s) <= (1 + SPLIT_SLACK) * best)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One pallas_call of the kernel: a tile class, the programs it launches and how it splits."""

    tile_class: int  # 0: decode tiles, 1: prefill tiles (the tile table's last row)
    block_m: int  # rows of its query tiles
    num_programs: int  # grid axis 0: tiles of this class a bucket can need
    num_splits: int  # grid axis 2
    num_warps: int = 4


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
