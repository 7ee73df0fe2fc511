"""LoRA on the `cpu` backend: the slots packed for the batched LoRA kernel (`jaxcb.kernels.batched_lora`),
one group per input the projections share, each added into the output its base projection writes:

    qkv      normed x -> q, k and v side by side (the packed q/k/v projection's columns): one call,
             its updates an addend of the q/k/v kernel
    o        attn -> the residual the o matmul adds: one call
    gate/up  normed x -> gate's and up's pairs of panels (`pack_gate_up`'s columns, one block a panel):
             the shrink in one call, the B side inside the MLP kernel's tiles before its activation
             (bf16 on AMX, rank 16 or a multiple of 32: one tile multiply a chunk of one slot's rows)
    down     the MLP's activation -> the residual: the shrink inside the MLP kernel, the B side in one call

Each row multiplies only its own slot's A and B (the rows grouped by slot inside the kernels), so a
layer's updates cost each row 2 R (in + out) multiply-adds a projection and 4 calls beside the
base's, whatever the mix. Packed once per slot write (`pack_lora_layers`, one compiled program) in
the model's dtype; the products accumulate in float32 from float32 x.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcb.kernels.batched_lora import BatchedLoraWeights, gate_up_pairs, pack_lora_group, side_by_side
from jaxcb.kernels.packed_matmul import gate_up_pair_count, pair_rows
from jaxcb.model.lora import LoraLayerWeights


class PackedLoraLayer(NamedTuple):
    """One layer's slots as `batched_lora` reads them."""

    qkv: BatchedLoraWeights  # into q, k and v side by side
    o: BatchedLoraWeights
    gate_up: BatchedLoraWeights  # into gate's and up's pairs of panels, one entry a panel (`packed_mlp`'s LoRA);
    # bf16: b's rank rows in pairs (`pair_rows`), as the MLP kernel reads them
    down: BatchedLoraWeights


@jax.jit
def pack_lora_layers(buffers: list[LoraLayerWeights]) -> list[PackedLoraLayer]:
    out = []
    for layer in buffers:
        q, k, v, o, gate, up, down = layer
        f = gate.b.shape[-1]
        gate_up = pack_lora_group([gate.a, up.a], [gate.b, up.b], gate_up_pairs(f, gate_up_pair_count(f, gate.b.dtype)),
                                  every_panel=True)
        if gate.b.dtype == jnp.bfloat16:  # the B blocks the MLP kernel reads, their rank rows in pairs
            gate_up = gate_up._replace(b=pair_rows(gate_up.b))
        out.append(PackedLoraLayer(
            pack_lora_group([q.a, k.a, v.a], [q.b, k.b, v.b], side_by_side([q.b.shape[-1], k.b.shape[-1],
                                                                             v.b.shape[-1]])),
            pack_lora_group([o.a], [o.b], side_by_side([o.b.shape[-1]])),
            gate_up,
            pack_lora_group([down.a], [down.b], side_by_side([down.b.shape[-1]])),
        ))
    return out
