"""LoRA on the `cpu` backend: the slots packed for the C++ matmul, the A sides of the projections
that share an input side by side, so that a layer's low-rank updates cost 11 kernel calls (not 14,
nor 14 XLA:CPU dots, which take several times as long at these thin shapes):

    qkv      x @ [A_q | A_k | A_v] (one call, the layer's norm in the kernel) -> masked ->
             @ B_q, @ B_k, @ B_v (three calls), added to q, k and v
    o        attn @ A_o -> masked -> @ B_o, added to the residual the o matmul adds
    gate/up  x @ [A_gate | A_up] (one call, normed in the kernel) -> masked -> @ B_gate, @ B_up
    down     hidden @ A_down -> masked -> @ B_down, added to the residual

The B sides stay apart: one block-diagonal B for q/k/v (or gate/up) saved two calls but multiplied
by the zero blocks too, 3x (2x) the B side's work, which cost more than the calls on a float32
`small` (docs/benchmarks.md, "Multi-LoRA"). The masks zero every column outside a row's slot
(`jaxcb.model.lora.lora_row_mask`). Packed once per slot write (`pack_lora_layers`, one compiled
program) in the model's dtype: a bf16 model's adapters run on the bf16 matmul path as its layers do
(x rounded to bf16 at each product).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxcb.kernels.packed_matmul import pack_columns, packed_matmul
from jaxcb.model.lora import LoraLayerWeights, LoraModule


class PackedLoraLayer(NamedTuple):
    """One layer's slots as `packed_matmul` reads them (`pack_columns` panels); S R = slots x rank."""

    qkv_a: jax.Array  # panels of [D, 3 S R]
    q_b: jax.Array  # panels of [S R, Hq K]
    k_b: jax.Array  # panels of [S R, Hkv K]
    v_b: jax.Array  # panels of [S R, Hkv K]
    o_a: jax.Array  # panels of [Hq K, S R]
    o_b: jax.Array  # panels of [S R, D]
    gate_up_a: jax.Array  # panels of [D, 2 S R]
    gate_b: jax.Array  # panels of [S R, F]
    up_b: jax.Array  # panels of [S R, F]
    down_a: jax.Array  # panels of [F, S R]
    down_b: jax.Array  # panels of [S R, D]


def _flat(m: LoraModule) -> tuple[jax.Array, jax.Array]:
    d_in, num_slots, rank = m.a.shape
    return m.a.reshape(d_in, num_slots * rank), m.b.reshape(num_slots * rank, -1)


@jax.jit
def pack_lora_layers(buffers: list[LoraLayerWeights]) -> list[PackedLoraLayer]:
    out = []
    for layer in buffers:
        (qa, qb), (ka, kb), (va, vb), (oa, ob), (ga, gb), (ua, ub), (da, db) = (_flat(m) for m in layer)
        out.append(PackedLoraLayer(
            pack_columns(jnp.concatenate([qa, ka, va], axis=1)), pack_columns(qb), pack_columns(kb), pack_columns(vb),
            pack_columns(oa), pack_columns(ob),
            pack_columns(jnp.concatenate([ga, ua], axis=1)), pack_columns(gb), pack_columns(ub),
            pack_columns(da), pack_columns(db),
        ))
    return out


def shrink(x: jax.Array, a: jax.Array, mask: jax.Array, copies: int = 1, *, norm: Optional[jax.Array] = None,
           eps: float = 0.0) -> list[jax.Array]:
    """(x' @ A) * mask for float32 x [T, in], A holding `copies` projections' [in, S R] side by side, x'
    x RMS-normed by `norm` where given (in the kernel, as the layer's own projection norms it): one
    [T, S R] per projection."""
    sr = mask.shape[1]
    shrunk = packed_matmul(x, a, copies * sr, norm=norm, eps=eps)
    return [shrunk[:, i * sr : (i + 1) * sr] * mask for i in range(copies)]


def expand(shrunk: jax.Array, b: jax.Array, n: int, residual: jax.Array) -> jax.Array:
    """residual + shrunk @ B: [T, S R] -> [T, n]."""
    return packed_matmul(shrunk, b, n, residual=residual)
