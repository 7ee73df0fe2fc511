"""LoRA on the `cpu` backend: the slots packed for the C++ matmul, the projections that share an input
fused, so that a layer's low-rank updates cost 8 kernel calls (not 14 XLA:CPU dots, which take several
times as long at these thin shapes).

    qkv      x @ [A_q | A_k | A_v] -> masked -> @ blockdiag(B_q, B_k, B_v), added to the fused q/k/v
    o        attn @ A_o -> masked -> @ B_o, added to the residual the o matmul adds
    gate/up  x @ [A_gate | A_up] -> masked -> @ blockdiag(B_gate, B_up) laid out as `pack_gate_up`'s
             (gate, up) pairs of 16 columns, added to the gate/up matmul's output
    down     hidden @ A_down -> masked -> @ B_down, added to the residual

The masks zero every column outside a row's slot (`jaxcb.model.lora.lora_row_mask`). Packed once per
slot write (`pack_lora_layers`, one compiled program) in the model's dtype: a bf16 model's adapters
run on the bf16 matmul path as its layers do (x rounded to bf16 at each product).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxcb.kernels.packed_matmul import PANEL, pack_columns, packed_matmul
from jaxcb.model.lora import LoraLayerWeights, LoraModule


class PackedLoraLayer(NamedTuple):
    """One layer's slots as `packed_matmul` reads them (`pack_columns` panels); S R = slots x rank."""

    qkv_a: jax.Array  # panels of [D, 3 S R]
    qkv_b: jax.Array  # panels of [3 S R, (Hq + 2 Hkv) K], block-diagonal
    o_a: jax.Array  # panels of [Hq K, S R]
    o_b: jax.Array  # panels of [S R, D]
    gate_up_a: jax.Array  # panels of [D, 2 S R]
    gate_up_b: jax.Array  # panels of [2 S R, 2 P 16] in pack_gate_up's pair layout (P = ceil(F / 16))
    down_a: jax.Array  # panels of [F, S R]
    down_b: jax.Array  # panels of [S R, D]


def _flat(m: LoraModule) -> tuple[jax.Array, jax.Array]:
    d_in, num_slots, rank = m.a.shape
    return m.a.reshape(d_in, num_slots * rank), m.b.reshape(num_slots * rank, -1)


def _block_diag(*bs: jax.Array) -> jax.Array:
    rows, cols = sum(b.shape[0] for b in bs), sum(b.shape[1] for b in bs)
    out, r, c = jnp.zeros((rows, cols), bs[0].dtype), 0, 0
    for b in bs:
        out = out.at[r : r + b.shape[0], c : c + b.shape[1]].set(b)
        r, c = r + b.shape[0], c + b.shape[1]
    return out


def _gate_up_pairs(b_gate: jax.Array, b_up: jax.Array, panels: int) -> jax.Array:
    """[S R, F] x 2 -> [2 S R, 2 P 16]: gate's rows write gate's columns of each pair, up's rows up's;
    P = `panels`, the gate/up weight's pairs (`pack_gate_up` pads bf16 ones to whole 32 columns)."""
    sr, f = b_gate.shape
    pad = lambda b: jnp.pad(b, ((0, 0), (0, panels * PANEL - f))).reshape(sr, panels, 1, PANEL)  # noqa: E731
    zeros = jnp.zeros((sr, panels, 1, PANEL), b_gate.dtype)
    top = jnp.concatenate([pad(b_gate), zeros], axis=2)
    bottom = jnp.concatenate([zeros, pad(b_up)], axis=2)
    return jnp.concatenate([top, bottom]).reshape(2 * sr, panels * 2 * PANEL)


@functools.partial(jax.jit, static_argnames="gate_up_panels")
def pack_lora_layers(buffers: list[LoraLayerWeights], gate_up_panels: int) -> list[PackedLoraLayer]:
    out = []
    for layer in buffers:
        (qa, qb), (ka, kb), (va, vb), (oa, ob), (ga, gb), (ua, ub), (da, db) = (_flat(m) for m in layer)
        out.append(PackedLoraLayer(
            pack_columns(jnp.concatenate([qa, ka, va], axis=1)), pack_columns(_block_diag(qb, kb, vb)),
            pack_columns(oa), pack_columns(ob),
            pack_columns(jnp.concatenate([ga, ua], axis=1)), pack_columns(_gate_up_pairs(gb, ub, gate_up_panels)),
            pack_columns(da), pack_columns(db),
        ))
    return out


def lora_add(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array, n: int, residual: jax.Array, *,
             norm: Optional[jax.Array] = None, eps: float = 0.0) -> jax.Array:
    """residual + ((x' @ A) * mask) @ B for float32 x [T, in], x' = x RMS-normed by `norm` where given
    (in the kernel, as the layer's own projection norms it); `mask` [T, columns of A]."""
    shrunk = packed_matmul(x, a, mask.shape[1], norm=norm, eps=eps) * mask
    return packed_matmul(shrunk, b, n, residual=residual)
