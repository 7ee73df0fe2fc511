"""Multi-LoRA's updates on CPU (`jaxcb.kernels.cpu`, batched_lora.cc): residual + each row's own
adapter's x @ A @ B, the rows grouped by slot, for a group of projections that read one input.

`pack_lora_group` lays out one group's slot buffers (q/k/v, o, gate/up or down; `LoraModule`s A
[in, S, R] and B [S, R, out]) for the kernel, given where each projection's columns sit in the
output the call adds to (`side_by_side`, or `gate_up_pairs` for `pack_gate_up`'s interleaved
panels). `batched_lora` adds the updates into that output in one call (or writes them alone, for a
fused kernel to add): a row's work is its own slot's R columns, a base row's (slot -1) nothing.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.kernels.cpu import BATCHED_LORA_TARGET, PANEL, load_cpu_kernels


class BatchedLoraWeights(NamedTuple):
    """One group's slots as `batched_lora` reads them; S slots, G projections of rank R."""

    a: jax.Array  # [S, in, C]: per slot the G A sides side by side, C = G R padded to 16 columns
    b: jax.Array  # [S, E, R, 16]: per slot entry e's block of a B side (`entries`)
    entries: jax.Array  # i32[E, 2]: (output panel, projection), by panel: B_g's R x 16 block for the
    # panel's 16 output columns, zero on the columns that are not g's


def side_by_side(widths: Sequence[int]) -> np.ndarray:
    """The output columns of projections laid side by side (q, k, v: the packed q/k/v projection's):
    i32[sum(widths), 2] of (projection, its column)."""
    return np.concatenate([np.stack([np.full(w, g), np.arange(w)], axis=1) for g, w in enumerate(widths)]).astype(
        np.int32)


def gate_up_pairs(f: int, num_pairs: int) -> np.ndarray:
    """The output columns of `pack_gate_up`'s panels (gate's 16 columns, up's 16, gate's next 16, ...),
    num_pairs pairs for an intermediate size f: i32[2 num_pairs 16, 2] of (0 gate or 1 up, its column),
    (-1, -1) for padding past f."""
    j = np.arange(2 * num_pairs * PANEL)
    panel, lane = j // PANEL, j % PANEL
    col = panel // 2 * PANEL + lane
    group = np.where(col < f, panel % 2, -1)
    return np.stack([group, np.where(col < f, col, -1)], axis=1).astype(np.int32)


def _entries(columns: np.ndarray, every_panel: bool) -> np.ndarray:
    """i32[E, 2]: (panel, projection) for each projection with a column in each 16-column panel; with
    `every_panel`, exactly one entry a panel (a panel with no column: projection 0, its block zero)."""
    n = columns.shape[0]
    out = []
    for p in range(-(-n // PANEL)):
        groups = sorted(g for g in set(columns[p * PANEL : (p + 1) * PANEL, 0].tolist()) if g >= 0)
        if every_panel and len(groups) > 1:
            raise ValueError(f"panel {p} holds columns of projections {groups}: one entry a panel holds one")
        out += [(p, g) for g in (groups or ([0] if every_panel else []))]
    return np.asarray(out, np.int32).reshape(-1, 2)


def pack_lora_group(a_sides: Sequence[jax.Array], b_sides: Sequence[jax.Array], columns: np.ndarray, *,
                    every_panel: bool = False) -> BatchedLoraWeights:
    """A group's slots for `batched_lora`: `a_sides` [in, S, R] and `b_sides` [S, R, out_g] of its G
    projections, `columns` where each output column comes from (`side_by_side`, `gate_up_pairs`).
    With `every_panel` (gate/up, whose panels are each gate's or up's) entry e is panel e's block, the
    layout `packed_mlp`'s LoRA reads. Traceable (the slot buffers are packed under jit after every
    slot write)."""
    rank = a_sides[0].shape[-1]
    a = jnp.concatenate([m.transpose(1, 0, 2) for m in a_sides], axis=2)  # [S, in, G R]
    a = jnp.pad(a, ((0, 0), (0, 0), (0, -a.shape[2] % PANEL)))
    entries = _entries(columns, every_panel)
    offsets = np.cumsum([0] + [b.shape[2] for b in b_sides])
    zero = offsets[-1]  # the index of a zero column appended to the B sides
    index = np.full((entries.shape[0], PANEL), zero, np.int32)
    for e, (p, g) in enumerate(entries):
        cols = columns[p * PANEL : (p + 1) * PANEL]
        mine = cols[:, 0] == g
        index[e, : len(cols)][mine] = offsets[g] + cols[mine, 1]
    b_all = jnp.concatenate([*b_sides, jnp.zeros((*b_sides[0].shape[:2], 1), b_sides[0].dtype)], axis=2)
    b = b_all[:, :, index.reshape(-1)].reshape(b_all.shape[0], rank, *index.shape).transpose(0, 2, 1, 3)
    return BatchedLoraWeights(a, b, jnp.asarray(entries))


def batched_lora(x: jax.Array, w: BatchedLoraWeights, slots: jax.Array, residual: Optional[jax.Array], *,
                 width: Optional[int] = None, norm: Optional[jax.Array] = None, eps: float = 0.0) -> jax.Array:
    """residual [T, N] + for each row t with slots[t] = s >= 0 its update rms_norm(x[t]) @ A_s @ B_s,
    per projection into its columns (x [T, in] float32; normed by `norm` [in] where given, as the
    packed matmul norms); rows with slot -1 get nothing. Float32 out.

    With `residual=None` (and `width` = N): the updates alone, as an addend for `packed_qkv` or
    `packed_mlp`, which add it on the rows with a slot only: a base row's is left unwritten
    (undefined), so a step with few adapter rows writes few rows."""
    t, k = x.shape
    n = residual.shape[-1] if residual is not None else width
    if n is None:
        raise ValueError("batched LoRA without a residual needs the output's width")
    if x.dtype != jnp.float32 or slots.shape != (t,) or (
            residual is not None and (residual.dtype != jnp.float32 or residual.shape != (t, n))):
        raise ValueError(f"batched LoRA takes float32 x [T, K] and residual [T, N] and slots [T], got x {x.dtype} "
                         f"{x.shape}, residual {None if residual is None else (residual.dtype, residual.shape)}, "
                         f"slots {slots.shape}")
    if w.a.shape[1] != k or w.a.dtype != w.b.dtype:
        raise ValueError(f"LoRA A {w.a.dtype} {w.a.shape} and B {w.b.dtype} {w.b.shape} do not match x {x.shape}")
    if norm is not None and (norm.shape != (k,) or norm.dtype != jnp.float32):
        raise ValueError(f"the rms-norm weight must be float32 [{k}], got {norm.dtype} {norm.shape}")
    return _call(SHRINK_EXPAND, x, w, slots, residual, n, norm, eps)


# The kernel's modes (batched_lora.cc): both halves; the shrink alone; the expand alone.
SHRINK_EXPAND, SHRINK, EXPAND = 0, 1, 2


def _call(mode: int, x, w: BatchedLoraWeights, slots, residual, n: int, norm, eps: float) -> jax.Array:
    load_cpu_kernels()
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    call = jax.ffi.ffi_call(BATCHED_LORA_TARGET, out, input_output_aliases={2: 0} if residual is not None else None)
    return call(x, jnp.zeros((0,), jnp.float32) if norm is None else norm,
                jnp.zeros((0, n), jnp.float32) if residual is None else residual, slots.astype(jnp.int32), w.a, w.b,
                w.entries, eps=np.float32(eps), mode=np.int32(mode))


def lora_shrink(x: jax.Array, w: BatchedLoraWeights, slots: jax.Array, *, norm: Optional[jax.Array] = None,
                eps: float = 0.0) -> jax.Array:
    """u [T, C] = rms_norm(x[t]) @ A_s for each row t with slots[t] = s >= 0 (the G A sides' columns
    side by side, as `w.a` holds them); a base row's u is left unwritten (undefined). For a fused
    kernel that adds u @ B inside its own tiles (`packed_mlp`'s gate/up)."""
    t, k = x.shape
    if x.dtype != jnp.float32 or slots.shape != (t,) or w.a.shape[1] != k:
        raise ValueError(f"the LoRA shrink takes float32 x [T, {w.a.shape[1]}] and slots [T], got x {x.dtype} "
                         f"{x.shape} and slots {slots.shape}")
    if norm is not None and (norm.shape != (k,) or norm.dtype != jnp.float32):
        raise ValueError(f"the rms-norm weight must be float32 [{k}], got {norm.dtype} {norm.shape}")
    return _call(SHRINK, x, w, slots, None, w.a.shape[2], norm, eps)


def lora_expand(u: jax.Array, w: BatchedLoraWeights, slots: jax.Array, residual: jax.Array) -> jax.Array:
    """residual [T, N] + u[t] @ B_s for each row t with slots[t] = s >= 0, u [T, C] a shrink's result
    (`lora_shrink`, or `packed_mlp`'s down shrink); rows with slot -1 keep the residual's."""
    t, c = u.shape
    if (u.dtype != jnp.float32 or c != w.a.shape[2] or slots.shape != (t,) or residual.dtype != jnp.float32
            or residual.ndim != 2 or residual.shape[0] != t):
        raise ValueError(f"the LoRA expand takes float32 u [T, {w.a.shape[2]}], slots [T] and residual [T, N], got "
                         f"u {u.dtype} {u.shape}, slots {slots.shape} and residual {residual.dtype} {residual.shape}")
    return _call(EXPAND, u, w, slots, residual, residual.shape[1], None, 0.0)
