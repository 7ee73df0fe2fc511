"""The batched LoRA kernel (`jaxcb.kernels.batched_lora`) adds each row's own adapter's update, grouped
by slot, equal to the masked all-slots form the XLA backend computes (`jaxcb.model.lora.lora_delta`);
base rows keep their residual bit for bit; and what does not fit is refused. The engine's adapters
against transformers + peft: test_lora.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.kernels.batched_lora import (
    batched_lora, gate_up_pairs, lora_expand, lora_shrink, pack_lora_group, side_by_side,
)
from jaxcb.model.lora import LoraModule, lora_delta, lora_row_mask

def pack(a, b, columns, every_panel=False):
    return jax.jit(lambda a, b: pack_lora_group(a, b, columns, every_panel=every_panel))(a, b)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def group(rng, k: int, widths, slots: int, rank: int, dtype):
    a = [jnp.asarray(rng.standard_normal((k, slots, rank)) * 0.3, dtype) for _ in widths]
    b = [jnp.asarray(rng.standard_normal((slots, rank, w)) * 0.3, dtype) for w in widths]
    return a, b


def expected(x, a, b, row_slots, slots, rank, residuals):
    """Each projection's residual + the masked all-slots update (the XLA backend's form), in float64."""
    mask = lora_row_mask(jnp.asarray(row_slots), slots, rank)
    return [np.asarray(r, np.float64) + np.asarray(lora_delta(jnp.asarray(x, jnp.float32),
                                                              LoraModule(ai.astype(jnp.float32), bi.astype(jnp.float32)),
                                                              mask), np.float64)
            for ai, bi, r in zip(a, b, residuals)]


# Widths on and off the 16-column panels (a panel shared by two projections), rank 8 and 16 (and 5),
# rows of one slot past a 32-row item and an 8-row tile, 1-3 rows of a slot (bf16 read as it is) and
# 4 or more (widened first), base and padding rows (-1) among them.
@pytest.mark.parametrize("k,widths,slots,rank,rows", [(40, (48, 16, 16), 3, 8, 11), (37, (20, 7, 7), 4, 5, 40),
                                                      (64, (64,), 2, 16, 70), (96, (33, 40), 8, 16, 9)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("normed", [False, True])
def test_each_row_gets_its_own_slots_update_as_the_masked_all_slots_form_gives(k, widths, slots, rank, rows, dtype,
                                                                                 normed):
    rng = np.random.default_rng(k + rows + slots)
    a, b = group(rng, k, widths, slots, rank, dtype)
    x = rng.standard_normal((rows, k), np.float32)
    row_slots = rng.integers(-1, slots, rows).astype(np.int32)
    row_slots[: min(rows, 36)] = np.where(np.arange(min(rows, 36)) % 3 == 0, -1, 0)  # one slot with many rows
    residuals = [rng.standard_normal((rows, w), np.float32) for w in widths]
    norm = rng.standard_normal(k).astype(np.float32)
    got = batched_lora(jnp.asarray(x), pack(a, b, side_by_side(widths)), jnp.asarray(row_slots),
                       jnp.asarray(np.concatenate(residuals, axis=1)), norm=jnp.asarray(norm) if normed else None,
                       eps=1e-5)
    x_in = rms_norm(x, norm, 1e-5) if normed else x
    want = np.concatenate(expected(x_in, a, b, row_slots, slots, rank, residuals), axis=1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    base = row_slots < 0
    np.testing.assert_array_equal(np.asarray(got)[base], np.concatenate(residuals, axis=1)[base])


def test_gate_and_up_go_into_the_mlps_pairs_of_panels():
    """`gate_up_pairs`: gate's 16 columns, up's 16, pair by pair, zero past F (the MLP kernel's layout)."""
    rng = np.random.default_rng(0)
    k, f, slots, rank, rows = 24, 40, 3, 8, 9
    a, b = group(rng, k, (f, f), slots, rank, jnp.float32)
    x = rng.standard_normal((rows, k), np.float32)
    row_slots = np.arange(rows, dtype=np.int32) % (slots + 1) - 1
    num_pairs = 3
    got = np.asarray(batched_lora(jnp.asarray(x), pack(a, b, gate_up_pairs(f, num_pairs)), jnp.asarray(row_slots),
                                  jnp.zeros((rows, 2 * num_pairs * 16)))).reshape(rows, num_pairs, 2, 16)
    gate, up = expected(x, a, b, row_slots, slots, rank, [np.zeros((rows, f))] * 2)
    for c, want in enumerate((gate, up)):
        cols = got[:, :, c].reshape(rows, -1)
        np.testing.assert_allclose(cols[:, :f], want, rtol=1e-5, atol=1e-5)
        assert not cols[:, f:].any()


def test_without_a_residual_the_rows_with_a_slot_get_their_update_alone():
    """The addend form (for the fused q/k/v kernel): each row with a slot holds its update, zero on the
    columns no projection reaches (here gate/up's padding past F); base rows are not read after."""
    rng = np.random.default_rng(3)
    k, f, slots, rank, rows = 24, 40, 3, 8, 21
    a, b = group(rng, k, (f, f), slots, rank, jnp.bfloat16)
    x = rng.standard_normal((rows, k), np.float32)
    row_slots = np.arange(rows, dtype=np.int32) % (slots + 1) - 1
    columns = gate_up_pairs(f, 4)  # a last pair past F: two panels no entry reaches, zeroed
    got = np.asarray(batched_lora(jnp.asarray(x), pack(a, b, columns), jnp.asarray(row_slots), None, width=128))
    want = np.asarray(batched_lora(jnp.asarray(x), pack(a, b, columns), jnp.asarray(row_slots),
                                   jnp.zeros((rows, 128))))
    mine = row_slots >= 0
    np.testing.assert_array_equal(got[mine], want[mine])
    assert not got[mine][:, columns[:, 0] < 0].any()
    with pytest.raises(ValueError, match="needs the output's width"):
        batched_lora(jnp.asarray(x), pack(a, b, columns), jnp.asarray(row_slots), None)


def test_a_step_with_no_adapter_row_leaves_the_residual_as_it_is():
    rng = np.random.default_rng(1)
    a, b = group(rng, 16, (32,), 2, 8, jnp.bfloat16)
    residual = rng.standard_normal((5, 32), np.float32)
    got = batched_lora(jnp.ones((5, 16)), pack(a, b, side_by_side((32,))), jnp.full((5,), -1, jnp.int32),
                       jnp.asarray(residual))
    np.testing.assert_array_equal(np.asarray(got), residual)


def test_a_slot_past_the_buffers_or_a_mismatched_input_is_refused():
    rng = np.random.default_rng(2)
    a, b = group(rng, 16, (32,), 2, 8, jnp.float32)
    w = pack(a, b, side_by_side((32,)))
    with pytest.raises(Exception, match="names slot 2 of 2"):
        jax.block_until_ready(batched_lora(jnp.ones((3, 16)), w, jnp.asarray([0, 2, -1], jnp.int32),
                                           jnp.zeros((3, 32))))
    with pytest.raises(ValueError, match="do not match x"):
        batched_lora(jnp.ones((3, 8)), w, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 32)))
    with pytest.raises(ValueError, match="float32 x"):
        batched_lora(jnp.ones((3, 16), jnp.bfloat16), w, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 32)))


# Rows past an 8-row tile, a 32-row item and a 128-row widened item; 1-3 rows of a slot (bf16 read as
# it is) and more (widened first); base rows among them.
@pytest.mark.parametrize("rows", [3, 40, 150])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_shrink_and_the_expand_alone_make_the_whole_update_bit_for_bit(rows, dtype):
    """`lora_shrink` then `lora_expand` (the halves the MLP kernel's LoRA uses around its own tiles) give
    what the one call gives, bit for bit, and the shrink is each row's normed x @ its slot's A sides."""
    rng = np.random.default_rng(rows)
    k, widths, slots, rank = 40, (20, 13), 3, 5
    a, b = group(rng, k, widths, slots, rank, dtype)
    w = pack(a, b, side_by_side(widths))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    norm = jnp.asarray(rng.standard_normal(k), jnp.float32)
    row_slots = np.where(np.arange(rows) % 7 == 3, -1, np.arange(rows) * 3 // rows).astype(np.int32)
    residual = jnp.asarray(rng.standard_normal((rows, sum(widths))), jnp.float32)
    whole = batched_lora(x, w, jnp.asarray(row_slots), residual, norm=norm, eps=1e-5)
    u = lora_shrink(x, w, jnp.asarray(row_slots), norm=norm, eps=1e-5)
    assert u.shape == (rows, 16)  # two A sides of rank 5, padded to 16 columns
    mine = row_slots >= 0
    xn = rms_norm(np.asarray(x), np.asarray(norm), 1e-5)
    a_sides = np.concatenate([np.asarray(ai, np.float64) for ai in a], axis=2)  # [K, S, 2R]
    want = np.einsum("tk,tkr->tr", xn[mine], a_sides[:, row_slots[mine]].transpose(1, 0, 2))
    np.testing.assert_allclose(np.asarray(u)[mine][:, : 2 * rank], want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    two = lora_expand(jnp.where(jnp.asarray(mine)[:, None], u, 0.0), w, jnp.asarray(row_slots), residual)
    np.testing.assert_array_equal(np.asarray(two), np.asarray(whole))
    np.testing.assert_array_equal(np.asarray(two)[~mine], np.asarray(residual)[~mine])


def test_every_panel_packing_gives_each_gate_up_panel_its_own_block_and_refuses_a_shared_panel():
    """`every_panel` (the MLP kernel's LoRA layout): entry e is panel e, padding panels past F hold zeros,
    and the update it makes is the usual one; q/k/v's panel shared by two projections cannot be laid so."""
    rng = np.random.default_rng(5)
    k, f, slots, rank, rows = 24, 40, 3, 8, 9
    a, b = group(rng, k, (f, f), slots, rank, jnp.float32)
    columns = gate_up_pairs(f, 4)  # 8 panels, the last two past F
    w = pack(a, b, columns, every_panel=True)
    # gate's and up's panels in turn; the last pair (panels 6 and 7) wholly past F = 40: projection 0, zeros
    np.testing.assert_array_equal(np.asarray(w.entries), [[p, p % 2] for p in range(6)] + [[6, 0], [7, 0]])
    assert not np.asarray(w.b)[:, 6:].any() and np.asarray(w.b)[:, :6].any()
    x, row_slots = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32), jnp.asarray(np.arange(rows) % 4 - 1)
    np.testing.assert_allclose(
        np.asarray(batched_lora(x, w, row_slots, jnp.zeros((rows, 128)))),
        np.asarray(batched_lora(x, pack(a, b, columns), row_slots, jnp.zeros((rows, 128)))), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="panel 1 holds columns of projections \\[0, 1, 2\\]"):
        a3, b3 = group(rng, k, (20, 7, 7), slots, rank, jnp.float32)
        pack_lora_group(a3, b3, side_by_side((20, 7, 7)), every_panel=True)


def test_the_halves_refuse_inputs_that_do_not_fit():
    rng = np.random.default_rng(6)
    a, b = group(rng, 16, (32,), 2, 8, jnp.float32)
    w = pack(a, b, side_by_side((32,)))
    with pytest.raises(ValueError, match="float32 x \\[T, 16\\]"):
        lora_shrink(jnp.ones((3, 8)), w, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="float32 u \\[T, 16\\]"):
        lora_expand(jnp.ones((3, 8)), w, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 32)))
    with pytest.raises(Exception, match="names slot 2 of 2"):
        jax.block_until_ready(lora_shrink(jnp.ones((3, 16)), w, jnp.asarray([0, 2, -1], jnp.int32)))
