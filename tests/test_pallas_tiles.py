"""The Pallas kernel's two query-tile classes: 16-row decode tiles, 64-row prefill tiles.

A sequence with at most 16 / group query tokens takes one decode tile; a longer one (a prefill
chunk) is cut into prefill tiles of 64 rows, so it reads its context once per 64 / group tokens
instead of once per 16 / group. The grid is static per bucket; which class a sequence takes is
decided per step, in the tile table. Parity runs the kernel in the Pallas interpreter, with every
unused cache slot NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attention_batches import make_ragged_batch
from jaxcb.kernels.attention.pallas import query_tiles, ragged_paged_attention, step_tile_table
from jaxcb.kernels.attention.reference import ragged_paged_attention_reference

SM_SCALE = 0.3
SEQ, Q_START, Q_COUNT, POS0, KV_LEN, PREFILL = range(6)


def tile_table(q_lens, kv_lens, *, num_tokens, num_seqs_max, group=4, block_size=16):
    """The kernel's tile table (numpy) for sequences with these query and context lengths."""
    qsl = np.zeros(num_seqs_max + 1, np.int32)
    qsl[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1 :] = qsl[len(q_lens)]
    kv = np.zeros(num_seqs_max, np.int32)
    kv[: len(kv_lens)] = kv_lens
    table = jitted_step_tile_table(jnp.asarray(qsl), jnp.asarray(kv), jnp.int32(len(q_lens)), num_tokens=num_tokens,
                                   group=group, block_size=block_size)
    return np.asarray(table)


# One program per shape, as a step builds it inside its jitted step: op by op, each random case's new shapes
# compiled every op anew (~3x the time).
jitted_step_tile_table = jax.jit(step_tile_table, static_argnames=("num_tokens", "group", "block_size"))


@pytest.mark.parametrize(
    "num_tokens, num_seqs_max, num_tiles, classes",
    [
        (1, 1, 1, (16,)),  # a bucket of at most 4 tokens holds no prefill: decode tiles only
        (4, 4, 4, (16,)),
        (16, 16, 16, (16, 64)),
        (256, 256, 256, (16, 64)),  # decode bucket: one tile per sequence, as many programs as before
        (512, 64, 96, (16, 64)),  # prefill-bearing buckets: 16 tokens a tile, + one partial tile per sequence
        (2048, 1, 129, (16, 64)),
        (2048, 256, 384, (16, 64)),
    ],
)
def test_llama8b_bucket_launches_16_row_decode_and_64_row_prefill_tiles(num_tokens, num_seqs_max, num_tiles, classes):
    plan = query_tiles(num_tokens, num_seqs_max, group=4, block_size=16)
    assert (plan.num_tiles, plan.classes) == (num_tiles, classes)
    assert (plan.decode_tokens, plan.pages_per_tile) == (4, 2)
    assert plan.prefill_tokens == (16 if len(classes) == 2 else 4)


def test_group_8_fills_a_decode_tile_with_2_tokens_and_a_prefill_tile_with_8():
    plan = query_tiles(256, 64, group=8, block_size=16)
    assert (plan.block_m, plan.decode_tokens, plan.prefill_block_m, plan.prefill_tokens) == (16, 2, 64, 8)
    wide = query_tiles(256, 64, group=64, block_size=16)  # a group of 64 already fills 64 rows: one class
    assert wide.classes == (64,) and wide.decode_tokens == wide.prefill_tokens == 1


def test_a_decode_step_runs_only_16_row_tiles():
    table = tile_table([1] * 200, list(range(1, 201)), num_tokens=256, num_seqs_max=256)
    real = table[Q_COUNT] > 0
    assert real.sum() == 200 and not table[PREFILL].any()
    np.testing.assert_array_equal(table[SEQ, real], np.arange(200))


def test_a_mixed_step_cuts_prefills_into_64_row_tiles_first_and_decodes_into_16_row_tiles_after():
    # A prefill of 40 tokens at the end of 100, decodes, a sequence of 4 new tokens (the largest decode
    # tile) and one of 5 (the smallest prefill tile).
    q_lens, kv_lens = [40, 1, 4, 1, 5], [100, 37, 9, 1, 5]
    table = tile_table(q_lens, kv_lens, num_tokens=64, num_seqs_max=8)
    real = table[:, table[Q_COUNT] > 0]
    expected = [  # seq, first token, tokens, first position, kv_len, prefill tile
        [0, 0, 16, 60, 100, 1], [0, 16, 16, 76, 100, 1], [0, 32, 8, 92, 100, 1], [4, 46, 5, 0, 5, 1],
        [1, 40, 1, 36, 37, 0], [2, 41, 4, 5, 9, 0], [3, 45, 1, 0, 1, 0],
    ]
    np.testing.assert_array_equal(real.T, expected)
    assert (table[Q_COUNT, len(expected):] == 0).all()  # padding tiles after the real ones


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8), st.integers(0, 8))
def test_every_real_token_lies_in_exactly_one_tile_of_its_class(q_lens, extra):
    num_tokens, num_seqs_max = sum(q_lens) + extra, len(q_lens) + 1
    if num_tokens == 0:
        return
    table = tile_table(q_lens, [q + 3 for q in q_lens], num_tokens=num_tokens, num_seqs_max=num_seqs_max)
    plan = query_tiles(num_tokens, num_seqs_max, group=4, block_size=16)
    assert table.shape == (6, plan.num_tiles)
    covered = np.zeros(num_tokens, int)
    for seq, start, count, pos0, kv_len, prefill in table.T:
        if count == 0:
            continue
        assert prefill == (q_lens[seq] > plan.decode_tokens)
        assert count <= (plan.prefill_tokens if prefill else plan.decode_tokens)
        covered[start : start + count] += 1
        assert pos0 == kv_len - q_lens[seq] + (start - sum(q_lens[:seq]))
    np.testing.assert_array_equal(covered, [1] * sum(q_lens) + [0] * extra)


def run(batch, dtype=jnp.float32, impl=ragged_paged_attention, **kw):
    with jax.default_matmul_precision("highest"):
        out = impl(*batch.args(jnp, dtype), sm_scale=SM_SCALE, **kw)
    return np.asarray(out.astype(jnp.float32))


def assert_matches_reference(batch, rtol=1e-5, dtype=jnp.float32, **kw):
    out = run(batch, dtype, interpret=True, **kw)
    semantics = {name: kw[name] for name in ("window", "softcap") if name in kw}  # the rest is how the kernel runs
    expected = run(batch, dtype, impl=ragged_paged_attention_reference, **semantics)
    n = batch.num_real_tokens
    err = np.abs(out[:n] - expected[:n]).max() / np.abs(expected[:n]).max()
    assert err <= rtol, f"relative error {err:.2e} > {rtol} for {batch.seqs}"
    assert np.all(out[n:] == 0), "padding tokens must come back as 0"


# Long prefills (several 64-row tiles), a chunk in the middle of a long context, decodes at
# contexts that end mid-block, on a KV-tile boundary and past several tiles, a sequence with
# no new tokens, and the class boundary (4 and 5 new tokens).
MIXED = [(70, 70), (1, 130), (0, 12), (33, 100), (1, 1), (4, 64), (5, 31), (1, 96)]


@pytest.mark.parametrize("group, block_size, head_dim", [(4, 16, 64), (4, 8, 16), (3, 32, 16), (1, 64, 16)])
def test_mixed_prefill_and_decode_batch_equals_the_reference(group, block_size, head_dim):
    batch = make_ragged_batch(MIXED, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim,
                              seed=group * block_size)
    assert_matches_reference(batch)


@pytest.mark.parametrize("prefill_block_m", [32, 128])
def test_other_prefill_tile_sizes_equal_the_reference(prefill_block_m):
    batch = make_ragged_batch(MIXED, block_size=16, num_kv_heads=1, group=4, head_dim=16, seed=prefill_block_m)
    assert_matches_reference(batch, prefill_block_m=prefill_block_m)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_prefill_tiles_split_over_the_context_equal_the_reference(num_splits):
    """Split-KV shares of a 64-row tile's context, some of them empty, merged after the call."""
    batch = make_ragged_batch(MIXED, block_size=8, num_kv_heads=2, group=4, head_dim=16, seed=num_splits)
    assert_matches_reference(batch, num_splits=num_splits)


def test_mixed_batch_in_bf16_equals_the_reference():
    batch = make_ragged_batch(MIXED, block_size=16, num_kv_heads=2, group=4, head_dim=64, seed=9)
    assert_matches_reference(batch, rtol=2e-2, dtype=jnp.bfloat16)


# --- each class in a launch of its own ----------------------------------------------------------

def launch_table(num_tokens, num_seqs, width, **kw):
    plan = query_tiles(num_tokens, num_seqs, group=4, block_size=16)
    return [(launch.block_m, launch.num_programs, launch.num_splits) for launch in plan.launches(
        num_tokens, num_seqs, 8, width * 16, head_dim=128, itemsize=2, kv_tile=32, num_warps=4, num_stages=3, **kw)]


def test_decode_tiles_launch_apart_from_prefill_tiles_one_program_per_sequence():
    assert launch_table(4, 4, 64) == [(16, 4, 1)]  # no prefill fits: the decode launch alone
    # 256 decodes: 256 decode programs; the prefill launch is bounded by the sequences long enough for it.
    assert [(rows, n) for rows, n, _ in launch_table(256, 256, 64)] == [(16, 256), (64, 67)]
    assert [(rows, n) for rows, n, _ in launch_table(2048, 1, 64)] == [(16, 1), (64, 129)]


@pytest.mark.parametrize("num_seqs, context, splits", [
    # The decode launch (5 programs an SM) at llama8b's 8 KV heads over 132 SMs.
    (1, 1024, 1), (1, 4096, 8), (1, 32768, 64),
    (16, 1024, 1), (16, 4096, 4), (16, 32768, 4),
    (32, 1024, 1), (32, 4096, 2), (32, 32768, 2),
    (128, 1024, 1), (128, 4096, 1), (128, 32768, 4),
])
def test_split_kv_follows_the_decode_launchs_occupancy(num_seqs, context, splits):
    [decode, *_] = launch_table(max(num_seqs, 1), num_seqs, context // 16)
    assert decode[0] == 16 and decode[2] == splits


def test_a_launch_that_holds_more_programs_an_sm_splits_further():
    from pallas_kernels.query_tiles import choose_num_splits

    # 64 programs at 8k context: a launch that holds 1 program an SM fills a wave with fewer splits.
    assert choose_num_splits(8, 8, 8192, programs_per_sm=5) > choose_num_splits(8, 8, 8192, programs_per_sm=1)
    assert choose_num_splits(8, 8, 1024, programs_per_sm=5) == 1  # under 2k of context: never split


# Verify rows: a sequence of 1 + k new tokens (speculative decoding) stays in the decode launch while
# it fits a decode tile: 32-row decode tiles hold 8 tokens at group 4.
VERIFY = [(1, 40), (5, 37), (8, 64), (9, 30), (3, 3), (6, 100), (0, 7), (40, 90)]


@pytest.mark.parametrize("num_splits", [None, 3])
def test_verify_rows_of_1_plus_k_tokens_run_in_the_decode_launch_and_equal_the_reference(num_splits):
    plan = query_tiles(64, len(VERIFY) + 1, group=4, block_size=8, block_m=32)
    assert plan.decode_tokens == 8 and plan.classes == (32, 64)
    batch = make_ragged_batch(VERIFY, block_size=8, num_kv_heads=2, group=4, head_dim=16, seed=11)
    assert_matches_reference(batch, block_m=32, num_splits=num_splits)


def test_a_step_without_prefill_tiles_runs_the_decode_launch_alone_and_equals_the_reference():
    batch = make_ragged_batch([(1, 20), (1, 90), (4, 33), (0, 5), (1, 1)], block_size=16, num_kv_heads=2, group=4,
                              head_dim=16, pad_tokens=40, seed=5)  # a bucket that could hold a prefill
    assert_matches_reference(batch)


# --- head dim 256 (Gemma 2 and 3) ---------------------------------------------------------------

def test_head_dim_256_keeps_the_query_tiles_and_takes_16_key_tiles_and_8_warps_for_prefill_tiles():
    """The tile table knows no head dim (`step_tile_table`, built before the layers): head dim 256 changes
    only the KV tile (16 keys) and the prefill launch's warps (8: its 64 x 256 accumulator spills at 4)."""
    from jaxcb.kernels.attention.pallas import kernel_launches

    def launches(head_dim):
        return [(launch.block_m, launch.num_warps) for launch in kernel_launches(
            512, 64, 128, group=2, num_kv_heads=8, head_dim=head_dim, block_size=16, dtype=jnp.bfloat16)]

    assert launches(128) == [(16, 4), (64, 4)]
    assert launches(256) == [(16, 4), (64, 8)]
    plan = query_tiles(512, 64, group=2, block_size=16, kv_tile=16)
    assert (plan.decode_tokens, plan.prefill_tokens, plan.pages_per_tile) == (8, 32, 1)
    assert plan.num_tiles == query_tiles(512, 64, group=2, block_size=16).num_tiles  # the same table


def gemma_batch(seed: int, **kw):
    """Gemma 2's heads in small: two query heads a KV head at head dim 256, and a MIXED batch."""
    return make_ragged_batch(MIXED, block_size=16, num_kv_heads=2, group=2, head_dim=256, seed=seed, **kw)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("softcap, window", [(None, None), (50.0, 37), (5.0, None)],
                         ids=["plain", "gemma2 cap and window", "cap 5"])
def test_head_dim_256_equals_the_reference_with_the_step_tile_table(softcap, window, num_splits):
    """The kernel at head dim 256 with its own KV tile and warps, reading the tile table built once per step
    without a head dim (as `AttentionForm.prepare_step` builds it), whole and split over the context."""
    batch = gemma_batch(seed=7)
    batch.q *= 3  # scores past 5: a cap of 5 bites
    q, k, v, kv_lens, tables, qsl, num_seqs, layer = batch.args(jnp)
    tiles = step_tile_table(qsl, kv_lens, num_seqs, num_tokens=q.shape[0], group=2, block_size=16)
    kw = dict(softcap=softcap, **({} if window is None else {"window": jnp.int32(window)}))
    assert_matches_reference(batch, tiles=tiles, num_splits=num_splits, **kw)


def test_head_dim_256_in_bf16_equals_the_reference():
    assert_matches_reference(gemma_batch(seed=8), rtol=2e-2, dtype=jnp.bfloat16, softcap=50.0, window=jnp.int32(37))
