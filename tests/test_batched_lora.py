"""The batched LoRA kernel (`jaxcb.kernels.batched_lora`) adds each row's own adapter's update, grouped
by slot, equal to the masked all-slots form the XLA backend computes (`jaxcb.model.lora.lora_delta`);
base rows keep their residual bit for bit; and what does not fit is refused. The engine's adapters
against transformers + peft: test_lora.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.kernels.batched_lora import batched_lora, gate_up_pairs, pack_lora_group, side_by_side
from jaxcb.model.lora import LoraModule, lora_delta, lora_row_mask

def pack(a, b, columns):
    return jax.jit(lambda a, b: pack_lora_group(a, b, columns))(a, b)


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
    """The addend form (for the fused q/k/v and MLP kernels): each row with a slot holds its update, zero
    on the columns no projection reaches (the MLP's padding past F); base rows are not read after."""
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
