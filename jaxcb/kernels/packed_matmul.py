"""The packed C++ matmul for CPU (`jaxcb.kernels.cpu`), as the `cpu` backend's linear layers use it.

Weights are float32 (`pack_columns`) or bfloat16 (`pack_columns` of a bf16 matrix: pairs of rows
in uint32 words, which the kernels multiply on AVX512-BF16 dot products, or widened to float32
where the CPU has none: `jaxcb.kernels.cpu.bf16_matmul_path`). Activations, norms and outputs are
float32 either way: a bf16 product accumulates in float32, and x is rounded to bf16 on its way in.

- `packed_matmul`: float32 x @ w with w packed once by `pack_columns`. It can RMS-normalise x
  on the way in and add a residual on the way out.
- `packed_qkv`: a decoder layer's q/k/v projection (normed x @ w), with rope over q and k and
  the new K/V rows written into the paged cache, in one call: q comes back, the cache in place.
- `packed_matmul_argmax`: the same product and its row argmax, taken inside the multiply; the
  LM head, which writes its logits only when the step reads them (not when every row is greedy).
- `packed_mlp`: the SwiGLU MLP, (silu(x @ gate) * (x @ up)) @ down, in one call, with gate
  and up packed in pairs of panels by `pack_gate_up` and down by `pack_columns`.

`packed_matmul`, `packed_qkv`, `packed_mlp` and `packed_matmul_argmax` take `real_rows` (i32[]): the
rows past the first `real_rows` are the padding of the engine's fixed-size steps, neither read nor
multiplied, and zeros in the result (their K/V rows not written; the LM head's argmax 0), so that a
step costs its tokens and sequences, not its bucket.

XLA:CPU's dot re-packs its weight operand on every call and streams it at a few GB/s for a
decode step's few rows, where the packed kernel runs near the machine's matmul peak
(docs/benchmarks.md has the side-by-side figures).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.kernels.cpu import (
    ATTENTION_DTYPES, MATMUL_ARGMAX_TARGET, MATMUL_TARGET, MLP_TARGET, PANEL, QKV_TARGET, bf16_matmul_path,
    load_cpu_kernels,
)


def pack_columns(w: jax.Array) -> jax.Array:
    """The layout `packed_matmul` reads: panel p holds columns [16p, 16p + 16) of w, row by row.

    float32 w [K, N] -> f32[ceil(N / 16), K, 16]; bfloat16 w -> u32[ceil(N / 16), depth, 16], each
    word the pair of rows (2i, 2i + 1) of one column (row 2i in the low half), the layout of
    AVX512-BF16's pair dot products and of AMX's B tiles, with K padded to a multiple of 32 (a B
    tile's 16 pairs): depth = `packed_depth(K, bf16)`. Padding (columns, rows) is zeros."""
    k, n = w.shape
    panels = -(-n // PANEL)
    if w.dtype == jnp.bfloat16:
        w = jnp.pad(w, ((0, 2 * _pair_depth(k) - k), (0, panels * PANEL - n)))
        pairs = w.reshape(-1, 2, panels, PANEL).transpose(2, 0, 3, 1)  # [P, K / 2, 16, 2]
        return jax.lax.bitcast_convert_type(pairs, jnp.uint32)
    if w.dtype != jnp.float32:
        raise ValueError(f"the CPU matmul packs float32 or bfloat16 weights, not {w.dtype}; use model.backend=xla")
    w = jnp.pad(w, ((0, 0), (0, panels * PANEL - n)))
    return w.reshape(k, panels, PANEL).transpose(1, 0, 2)


def _pair_depth(k: int) -> int:
    return -(-k // 32) * 16


def packed_depth(k: int, packed: jax.Array) -> int:
    """The rows of a packed weight for input width k: k (float32), or the pairs of k padded to a
    multiple of 32 (bf16, packed as uint32)."""
    return _pair_depth(k) if packed.dtype == jnp.uint32 else k


# Whether the kernels take `real_rows` (an optional operand): a build from before it took none, and
# benchmarks/bench_kernels.py's replay against such a revision turns this off while it traces. The LM
# head's (`packed_matmul_argmax`) took it later than the others.
TAKES_REAL_ROWS = True
ARGMAX_TAKES_REAL_ROWS = True


def _real_rows(real_rows: jax.Array | None, taken: bool | None = None) -> tuple:
    """The kernels' optional last operand: the count of real rows, i32[1]; none when not given."""
    if real_rows is None or not (TAKES_REAL_ROWS if taken is None else taken):
        return ()
    return (jnp.reshape(real_rows, (1,)).astype(jnp.int32),)


def _optional_inputs(x: jax.Array, n: int, norm: jax.Array | None, residual: jax.Array | None) -> tuple:
    """The kernels' optional rms-norm weight [K] and residual [rows, n], empty when not given."""
    k = x.shape[-1]
    if norm is not None and (norm.shape != (k,) or norm.dtype != jnp.float32):
        raise ValueError(f"the rms-norm weight must be float32 [{k}], got {norm.dtype} {norm.shape}")
    if residual is not None and (residual.shape != (*x.shape[:-1], n) or residual.dtype != jnp.float32):
        raise ValueError(f"the residual must be float32 {(*x.shape[:-1], n)}, got {residual.dtype} {residual.shape}")
    return (jnp.zeros((0,), jnp.float32) if norm is None else norm,
            jnp.zeros((0, n), jnp.float32) if residual is None else residual.reshape(-1, n))


def _load_for(*packed: jax.Array) -> None:
    """Loads the kernels, and before a first bf16 product chooses its path (probed, timed, logged)."""
    load_cpu_kernels()
    if any(p.dtype == jnp.uint32 for p in packed):
        bf16_matmul_path()


def _check_packed_matmul(x: jax.Array, packed: jax.Array, n: int) -> None:
    if x.dtype != jnp.float32 or packed.dtype not in (jnp.float32, jnp.uint32):
        raise ValueError(f"the CPU matmul takes float32 x and weights packed from float32 or bfloat16, got x {x.dtype} "
                         f"and w {packed.dtype}; use model.backend=xla")
    if (packed.ndim != 3 or packed.shape[2] != PANEL or packed.shape[1] != packed_depth(x.shape[-1], packed)
            or packed.shape[0] != -(-n // PANEL)):
        raise ValueError(f"packed weight {packed.shape} does not match x {x.shape} and n={n}")


def packed_matmul(x: jax.Array, packed: jax.Array, n: int, *, norm: jax.Array | None = None, eps: float = 0.0,
                  residual: jax.Array | None = None, real_rows: jax.Array | None = None
                  ) -> jax.Array:  # [..., K] @ [K, n] -> [..., n]
    """x @ w for float32 x, with `packed = pack_columns(w)` and n = w.shape[1]. With `norm` ([K]) x
    is RMS-normalised first (`rms_norm(x, norm, eps)`, fused into the kernel's packing of x); with
    `residual` ([..., n]) the result is residual + x @ w. With `real_rows` (i32[]) only x's first
    rows (flattened) are computed, the others' results are zeros."""
    _check_packed_matmul(x, packed, n)
    norm, residual = _optional_inputs(x, n, norm, residual)
    _load_for(packed)
    rows = x.reshape(-1, x.shape[-1])
    y = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))(
        rows, packed, norm, residual, *_real_rows(real_rows), eps=np.float32(eps))
    return y.reshape(*x.shape[:-1], n)


def packed_qkv(
    h: jax.Array,  # f32[T, K]: the residual stream
    packed: jax.Array,  # pack_columns of [K, (Hq + 2 Hkv) D]: q, k and v side by side
    norm: jax.Array | None,  # f32[K]: rms-norm weight of h (None: h as it is)
    eps: float,
    cos: jax.Array,  # f32[T, D // 2]: the tokens' rotary angles
    sin: jax.Array,  # f32[T, D // 2]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D], float32 or bfloat16
    v_cache: jax.Array,  # same
    layer: jax.Array,  # i32[]
    slots: jax.Array,  # i32[T]: block * block_size + offset; outside the cache -> not written; rows
    # sharing a slot (the engine's padding, in the null block): any one of them lands there, as with XLA's scatter
    num_q_heads: int,
    addend: jax.Array | None = None,  # f32[T, (Hq + 2 Hkv) D]: added to the projection before rope and the write,
    addend_rows: jax.Array | None = None,  # i32[T]: on the rows where this is >= 0 (others' addend rows never read)
    real_rows: jax.Array | None = None,  # i32[]: rows past it are padding: q zeros, K/V not written
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (q f32[T, Hq, D], k_cache, v_cache)
    """q = rope(rms_norm(h) @ w_q), and rope(rms_norm(h) @ w_k) and rms_norm(h) @ w_v written at
    `slots` of `layer` into the caches (in place when they are donated), in one call: what
    `packed_matmul`, two `apply_rope`s and `write_kv_rows` give, bit for bit, with no XLA op
    left between the projection and the attention call after it (whose pool thread then finds
    the pool awake)."""
    if h.ndim != 2 or h.dtype != jnp.float32 or cos.dtype != jnp.float32 or sin.dtype != jnp.float32:
        raise ValueError(f"the CPU q/k/v projection takes float32 h [T, K] and rotary angles, got h {h.dtype} "
                         f"{h.shape}, cos {cos.dtype} and sin {sin.dtype}; use model.backend=xla")
    _, num_kv_heads, _, _, head_dim = k_cache.shape
    _check_packed_matmul(h, packed, (num_q_heads + 2 * num_kv_heads) * head_dim)
    t = h.shape[0]
    if cos.shape != (t, head_dim // 2) or sin.shape != cos.shape or slots.shape != (t,) or head_dim % 2:
        raise ValueError(f"cos {cos.shape} and sin {sin.shape} must be [{t}, {head_dim // 2}] and slots {slots.shape} "
                         f"[{t}] (head_dim {head_dim}, even)")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or k_cache.dtype.name not in ATTENTION_DTYPES:
        raise ValueError(f"caches {k_cache.dtype} {k_cache.shape} / {v_cache.dtype} {v_cache.shape}: the CPU q/k/v "
                         f"projection writes two caches of one shape, in one of {ATTENTION_DTYPES}")
    norm, _ = _optional_inputs(h, 1, norm, None)
    addend, addend_rows = _addend(addend, addend_rows, t, (num_q_heads + 2 * num_kv_heads) * head_dim)
    _load_for(packed)
    call = jax.ffi.ffi_call(QKV_TARGET, (jax.ShapeDtypeStruct((t, num_q_heads, head_dim), jnp.float32),
                                         jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                                         jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
                            input_output_aliases={5: 1, 6: 2})
    return call(h, packed, norm, cos, sin, k_cache, v_cache, slots.astype(jnp.int32),
                jnp.reshape(layer, ()).astype(jnp.int32), addend, addend_rows, *_real_rows(real_rows),
                eps=np.float32(eps))


def _addend(addend: jax.Array | None, rows: jax.Array | None, t: int, n: int) -> tuple[jax.Array, jax.Array]:
    """A kernel's optional addend [t, n] and its rows [t] (i32; >= 0: added), empty when not given."""
    if addend is None:
        return jnp.zeros((0, n), jnp.float32), jnp.zeros((0,), jnp.int32)
    if addend.shape != (t, n) or addend.dtype != jnp.float32 or rows is None or rows.shape != (t,):
        raise ValueError(f"the addend must be float32 {(t, n)} with its rows [{t}], got {addend.dtype} {addend.shape} "
                         f"and rows {None if rows is None else rows.shape}")
    return addend, rows.astype(jnp.int32)


def packed_matmul_argmax(x: jax.Array, packed: jax.Array, n: int, want_y: jax.Array,
                         real_rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(x @ w, its row argmax) for x [M, K] float32, with `packed = pack_columns(w)`: the argmax
    (i32[M], jnp.argmax's indices: the first of the largest, or the first NaN) is taken inside the
    multiply. Where `want_y` (a bool or int scalar, traced) is false the product is never
    written: only the argmax is defined, and no [M, n] array is written or read back. With
    `real_rows` (i32[]) only x's first real_rows rows are multiplied: the rows past them get
    argmax 0 and (where written) zero products."""
    if x.ndim != 2:
        raise ValueError(f"the matmul with a row argmax takes x as rows [M, K], got {x.shape}")
    _check_packed_matmul(x, packed, n)
    if n == 0 and x.shape[0] > 0:
        raise ValueError("the row argmax of rows with no columns is undefined (n=0)")
    _load_for(packed)
    out = (jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return jax.ffi.ffi_call(MATMUL_ARGMAX_TARGET, out)(x, packed, jnp.asarray(want_y, jnp.int32).reshape(()),
                                                      *_real_rows(real_rows, ARGMAX_TAKES_REAL_ROWS))


def gate_up_pair_count(f: int, dtype) -> int:
    """Q, the pairs of panels `pack_gate_up` makes of gate and up [K, f] in `dtype`: ceil(f / 16), f first
    padded to whole 32-column blocks in bf16 (down's bf16 rows come in 32s, `packed_mlp`)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        f += -f % 32
    return -(-f // PANEL)


def pack_gate_up(gate: jax.Array, up: jax.Array) -> jax.Array:  # [K, F] x 2 -> [2 Q, K, 16]
    """The layout `packed_mlp` reads: gate's and up's panels (`pack_columns`) in pairs, gate's first,
    so that one tile sees the same 16 columns of both; Q = `gate_up_pair_count`."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} and up {up.shape} must have the same shape")
    pad = ((0, 0), (0, gate_up_pair_count(gate.shape[1], gate.dtype) * PANEL - gate.shape[1]))
    gate, up = jnp.pad(gate, pad), jnp.pad(up, pad)
    pairs = jnp.stack([pack_columns(gate), pack_columns(up)], axis=1)  # [Q, 2, K, 16]
    return pairs.reshape(-1, *pairs.shape[2:])


class MlpLora(NamedTuple):
    """Multi-LoRA's gate/up and down updates, done inside `packed_mlp`'s tiles (the `cpu` backend).
    bf16 B blocks come with their rank rows in pairs (`pair_rows`)."""

    slots: jax.Array  # i32[M]: each row's slot, -1 for none
    gate_up_u: jax.Array  # f32[M, Cu]: the rows' gate/up shrink (`batched_lora.lora_shrink`): gate's R, then up's
    gate_up_b: jax.Array  # [S, 2Q, R, 16]: the B block of every gate/up panel (`pack_lora_group`, every_panel)
    down_a: jax.Array  # [S, Fd, Cd]: down's A sides (its group's `a`)


def pair_rows(w: jax.Array) -> jax.Array:
    """w [..., rows, cols] with each two rows 2j and 2j + 1 interleaved column by column (row 2j's
    element, then row 2j + 1's), an odd last row left as it is; the same shape. The layout in which
    `packed_mlp` reads bf16 LoRA B blocks: 64 bytes are 16 columns of a pair of rank rows, the pair
    layout of AMX's B tiles (tdpbf16ps), or two rows of floats once split. Traceable."""
    rows = w.shape[-2]
    even = rows - rows % 2
    head = w[..., :even, :].reshape(*w.shape[:-2], even // 2, 2, w.shape[-1])
    head = jnp.swapaxes(head, -1, -2).reshape(*w.shape[:-2], even, w.shape[-1])
    return jnp.concatenate([head, w[..., even:, :]], axis=-2)


def packed_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, n: int, *, norm: jax.Array | None = None,
               eps: float = 0.0, residual: jax.Array | None = None, lora: MlpLora | None = None,
               real_rows: jax.Array | None = None):
    # [..., K] -> [..., n], or ([..., n], [..., Cd]) with lora
    """(silu(x @ gate) * (x @ up)) @ down for float32, with `gate_up = pack_gate_up(gate, up)`,
    `down = pack_columns(down_weight)` and n = down_weight.shape[1]; `norm`, `eps` and
    `residual` as in `packed_matmul`, and `real_rows` (down's shrink zeros past them too). With
    `lora` each row with a slot s gets its adapter's gate/up update before the activation (gate's columns + u[:R] @ B_gate, up's + u[R:2R] @ B_up, from
    `gate_up_b[s]`), and the call also returns down's shrink of its activation (float32
    [M, Cd]: act[:, :Fd] @ down_a[s]; a base row's undefined), for `lora_expand` to add after."""
    if x.dtype != jnp.float32 or gate_up.dtype != down.dtype or down.dtype not in (jnp.float32, jnp.uint32):
        raise ValueError(f"the CPU MLP takes float32 x and weights packed alike from float32 or bfloat16, got x "
                         f"{x.dtype}, gate/up {gate_up.dtype} and down {down.dtype}; use model.backend=xla")
    # bf16: gate/up padded to whole pairs of panels (pack_gate_up), which down's padding rows meet
    f = gate_up.shape[0] // 2 * PANEL if down.dtype == jnp.uint32 else down.shape[1]
    if (gate_up.ndim != 3 or gate_up.shape[0] != 2 * -(-f // PANEL) or down.shape[1] != packed_depth(f, down)
            or gate_up.shape[1:] != (packed_depth(x.shape[-1], gate_up), PANEL)
            or down.ndim != 3 or down.shape[2] != PANEL or down.shape[0] != -(-n // PANEL)):
        raise ValueError(f"packed gate/up {gate_up.shape} and down {down.shape} do not match x {x.shape} and n={n}")
    norm, residual = _optional_inputs(x, n, norm, residual)
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if lora is None:
        cd = 0
        operands = (jnp.zeros((0,), jnp.int32), jnp.zeros((0, 0), jnp.float32),
                    jnp.zeros((0, 0, 0, PANEL), jnp.float32), jnp.zeros((0, 0, 0), jnp.float32))
    else:
        s, panels, r, _ = lora.gate_up_b.shape
        cd = lora.down_a.shape[2]
        if (lora.slots.shape != (m,) or lora.gate_up_u.shape[0] != m or lora.gate_up_u.shape[1] < 2 * r
                or lora.gate_up_u.dtype != jnp.float32 or panels != gate_up.shape[0] or lora.down_a.shape[0] != s
                or lora.down_a.shape[1] > f or cd % PANEL or cd == 0 or lora.gate_up_b.dtype != lora.down_a.dtype):
            raise ValueError(f"the MLP's LoRA operands do not fit {m} rows, {gate_up.shape[0]} gate/up panels and "
                             f"F={f}: slots {lora.slots.shape}, u {lora.gate_up_u.dtype} {lora.gate_up_u.shape}, b "
                             f"{lora.gate_up_b.dtype} {lora.gate_up_b.shape}, down's a {lora.down_a.dtype} "
                             f"{lora.down_a.shape}")
        operands = (lora.slots.astype(jnp.int32), lora.gate_up_u, lora.gate_up_b, lora.down_a)
    _load_for(gate_up, down)
    y, down_u = jax.ffi.ffi_call(MLP_TARGET, (jax.ShapeDtypeStruct((m, n), jnp.float32),
                                              jax.ShapeDtypeStruct((m if cd else 0, cd), jnp.float32)))(
        rows, gate_up, down, norm, residual, *operands, *_real_rows(real_rows), eps=np.float32(eps))
    y = y.reshape(*x.shape[:-1], n)
    return (y, down_u.reshape(*x.shape[:-1], cd)) if lora is not None else y
