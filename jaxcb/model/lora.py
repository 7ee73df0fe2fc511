"""LoRA in the step: the adapters' device slots and the low-rank update of a targeted projection.

Every targeted projection (q/k/v/o, gate/up/down) has two preallocated buffers per layer,
`max_loras` slots wide and `max_rank` deep:

    A  [in, S, R]   slot s's A in [:, s, :]   (rank padded with zeros)
    B  [S, R, out]  slot s's B (its scale folded in) in [s]

They are arguments of the compiled step (`StepWeights.lora`, as the backend prepares them:
`Backend.prepare_lora`), never constants: loading an adapter into a slot makes new arrays, and the
same executable serves any mix of adapters. Each token row carries its slot (`lora_ids`, -1 for the
base), turned once per step into a mask over the slots' rank columns (`lora_row_mask`); the update
of a projection over the flat batch is grouped by slot with it:

    x [T, in] @ A [in, S R] -> [T, S R], times the rows' masks [T, S R] -> @ B [S R, out]

so each row meets only its own slot's A and B, and a base row's update is exactly zero. Its cost
is the same for any mix (2 S R (in + out) multiply-adds a token and projection): the xla backend's
form (one program for any mix, on any device). The cpu backend groups the rows by slot in a kernel
of its own instead (`jaxcb.kernels.batched_lora`: 2 R (in + out) a token with an adapter, nothing for
a base row). `benchmarks/lora.py` measures both against the base.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.model.config import LlamaConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraModule(NamedTuple):
    a: jax.Array  # [in, S, R] (stacked: [L, in, S, R])
    b: jax.Array  # [S, R, out] (stacked: [L, S, R, out])


class LoraLayerWeights(NamedTuple):
    """One layer's slot buffers (or every layer's, stacked on a leading [L] axis)."""

    q_proj: LoraModule
    k_proj: LoraModule
    v_proj: LoraModule
    o_proj: LoraModule
    gate_proj: LoraModule
    up_proj: LoraModule
    down_proj: LoraModule


class LoraRows(NamedTuple):
    """What a layer's operations need to add each row's adapter: its slots (as the backend prepared
    them, `Backend.prepare_lora`), each row's slot, and each row's mask over the slots' rank columns
    (what a backend does not read, XLA drops)."""

    weights: LoraLayerWeights
    mask: jax.Array  # f32[T, S R]: 1 on the R columns of each token row's slot, all 0 for the base
    slots: jax.Array  # i32[T]: each token row's slot, -1 for the base (and padding)


LoraWeights = Union[LoraLayerWeights, list]  # stacked (scanned layers) or one per layer (unrolled)


def module_dims(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def empty_lora_weights(cfg: LlamaConfig, max_loras: int, max_rank: int, stacked: bool, dtype=None) -> LoraWeights:
    """Zeroed slot buffers: one tree stacked on [L], or a list of L trees. `dtype`: the backend's
    (`Backend.lora_dtype`: the model's, or float32 where the backend computes in float32)."""
    dt = jnp.dtype(dtype or cfg.dtype)
    dims = module_dims(cfg)
    lead = (cfg.num_layers,) if stacked else ()

    def layer() -> LoraLayerWeights:
        return LoraLayerWeights(**{m: LoraModule(jnp.zeros((*lead, i, max_loras, max_rank), dt),
                                                 jnp.zeros((*lead, max_loras, max_rank, o), dt))
                                   for m, (i, o) in dims.items()})

    return layer() if stacked else [layer() for _ in range(cfg.num_layers)]


def slot_values(adapter_weights: Optional[dict], cfg: LlamaConfig, max_rank: int, stacked: bool,
                dtype=None) -> LoraWeights:
    """One slot's contents as host arrays shaped like the buffers without their slot axis: each module's
    A [in, R] and B [R, out] (zero where the adapter has no such module or a smaller rank), cast to the
    model's dtype, then held in `dtype` (the buffers'). `adapter_weights`: `LoraAdapter.weights`, or None
    for an empty slot."""
    dims = module_dims(cfg)
    model_dt, buffer_dt = jnp.dtype(cfg.dtype), jnp.dtype(dtype or cfg.dtype)

    def layer(i: int) -> LoraLayerWeights:
        mods = {}
        for m, (d_in, d_out) in dims.items():
            a, b = np.zeros((d_in, max_rank), np.float32), np.zeros((max_rank, d_out), np.float32)
            if adapter_weights is not None and (i, m) in adapter_weights:
                wa, wb = adapter_weights[(i, m)]
                a[:, : wa.shape[1]], b[: wb.shape[0]] = wa, wb
            mods[m] = LoraModule(a.astype(model_dt).astype(buffer_dt), b.astype(model_dt).astype(buffer_dt))
        return LoraLayerWeights(**mods)

    layers = [layer(i) for i in range(cfg.num_layers)]
    return jax.tree.map(lambda *xs: np.stack(xs), *layers) if stacked else layers


def _write(buffers: LoraWeights, slot: jax.Array, values: LoraWeights) -> LoraWeights:
    def put(buf: jax.Array, val, axis: int) -> jax.Array:
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.expand_dims(val.astype(buf.dtype), axis), slot, axis)

    def put_module(buf: LoraModule, val: LoraModule) -> LoraModule:
        # A [..., in, S, R] takes [..., in, R] at S; B [..., S, R, out] takes [..., R, out] at S
        return LoraModule(put(buf.a, val.a, buf.a.ndim - 2), put(buf.b, val.b, buf.b.ndim - 3))

    return jax.tree.map(put_module, buffers, values, is_leaf=lambda x: isinstance(x, LoraModule))


write_slot = jax.jit(_write)  # (buffers, i32[] slot, one slot's values) -> new buffers; compiled once


def lora_row_mask(lora_ids: jax.Array, num_slots: int, rank: int) -> jax.Array:
    """f32[T, S R]: 1 on the rank columns of each token row's slot; a base row (-1) or padding row all 0."""
    onehot = lora_ids[:, None] == jnp.arange(num_slots, dtype=lora_ids.dtype)[None, :]  # [T, S]
    return jnp.repeat(onehot, rank, axis=1).astype(jnp.float32)


def slots_and_rank(buffers: LoraWeights) -> tuple[int, int]:
    """(S, R) of slot buffers (unprepared: A [..., in, S, R])."""
    first = buffers[0] if isinstance(buffers, list) else buffers
    return first.q_proj.a.shape[-2], first.q_proj.a.shape[-1]


def lora_delta(x: jax.Array, module: LoraModule, mask: jax.Array) -> jax.Array:
    """[T, in] -> [T, out]: each row's x @ A_slot @ B_slot (zero on base rows), in x's dtype."""
    d_in, num_slots, rank = module.a.shape
    shrunk = jnp.dot(x, module.a.reshape(d_in, num_slots * rank).astype(x.dtype)) * mask.astype(x.dtype)  # [T, S R]
    return jnp.dot(shrunk, module.b.reshape(num_slots * rank, -1).astype(x.dtype))
