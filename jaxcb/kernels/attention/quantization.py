"""The 8-bit KV cache: its dtypes, the write's quantization and the read's scales.

A quantized cache (`cache.dtype=int8 | fp8_e4m3 | fp8_e5m2`) stores K / scale and V / scale in 8
bits, with one float32 scale per (layer, KV head) for K and one for V (`KVCache.k_scale`,
`KVCache.v_scale`, f32[num_layers, num_kv_heads]), fixed at start-up (`jaxcb.kv_scales`). The
write divides by the scale and saturates to the dtype's range (int8 also rounds to nearest): a
value past the calibrated range is clipped, never NaN or wrapped. The read dequantizes in the
kernel's registers: every form loads the 8-bit tiles and converts them to the compute dtype as it
reads them (the int8 and fp8 values are exact in bf16 and f32), and the scales are applied outside
the loop, where they cost nothing per key: q . (s_k k8) = (s_k q) . k8, so the form multiplies q
by its KV head's K scale before the kernel, and sum_j p_j (s_v v8_j) = s_v sum_j p_j v8_j, so it
multiplies the output by the V scale after. No dequantized copy of the cache exists anywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# cache.dtype's names of the quantized dtypes -> the array dtype the cache is stored in.
QUANTIZED_CACHE_DTYPES: dict[str, jnp.dtype] = {
    "int8": jnp.dtype(jnp.int8),
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
}
# The largest magnitude each stores: int8 keeps 127 (symmetric: -128 is never written).
QUANTIZED_MAX: dict[str, float] = {
    "int8": 127.0,
    "float8_e4m3fn": float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    "float8_e5m2": float(jnp.finfo(jnp.float8_e5m2).max),  # 57344
}


def is_quantized(dtype) -> bool:
    """True for an 8-bit cache dtype (by array dtype or cache.dtype name)."""
    if isinstance(dtype, str) and dtype in QUANTIZED_CACHE_DTYPES:
        return True
    try:
        return jnp.dtype(dtype).name in QUANTIZED_MAX
    except TypeError:
        return False


def cache_dtype_name(dtype) -> str:
    """cache.dtype's name of an array dtype: int8, fp8_e4m3, fp8_e5m2, or the dtype's own name."""
    name = jnp.dtype(dtype).name
    for config_name, d in QUANTIZED_CACHE_DTYPES.items():
        if d.name == name:
            return config_name
    return name


def quantized_max(dtype) -> float:
    return QUANTIZED_MAX[jnp.dtype(dtype).name]


def scales_from_amax(amax: jax.Array, dtype) -> jax.Array:
    """f32 scales whose range covers `amax` (the largest |value| seen) exactly: amax / the dtype's
    largest value. A head that saw only zeros gets the smallest normal float32 (never 0: x / 0)."""
    amax = jnp.asarray(amax, jnp.float32)
    return jnp.maximum(amax / quantized_max(dtype), jnp.finfo(jnp.float32).tiny)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x [..., Hkv, D] / scale f32[Hkv], saturated to the dtype's range (int8 rounded to nearest)."""
    dtype = jnp.dtype(dtype)
    limit = quantized_max(dtype)
    y = jnp.clip(x.astype(jnp.float32) / scale[:, None], -limit, limit)
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype)


def dequantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """f32 values of a quantized cache [L, Hkv, ...] with scales f32[L, Hkv] (for references and tests)."""
    return x.astype(jnp.float32) * scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim))


def scale_queries(q: jax.Array, k_scale: jax.Array) -> jax.Array:
    """q [T, Hq, D] times its KV head's K scale (f32[Hkv]; query head h reads KV head h // group)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_scale.shape[0]
    per_head = jnp.repeat(k_scale, group)  # f32[Hq]
    return (q.astype(jnp.float32) * per_head[None, :, None]).astype(q.dtype)


def scale_outputs(out: jax.Array, v_scale: jax.Array) -> jax.Array:
    """Attention output [T, Hq, D] times its KV head's V scale (f32[Hkv])."""
    group = out.shape[1] // v_scale.shape[0]
    per_head = jnp.repeat(v_scale, group)
    return (out.astype(jnp.float32) * per_head[None, :, None]).astype(out.dtype)
