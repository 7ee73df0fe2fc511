"""The C++ CPU attention kernel and K/V write, called through the XLA FFI (`jaxcb.kernels.cpu`).

`ragged_paged_attention_cpu` takes the same arguments and gives the same result as the other
attention forms (a sliding window is the kernel's optional last operand, an i32[]: it varies by
layer; a logit soft-cap its optional attribute `softcap`, absent when None, so that the call is
then the one it always was); q (and the result) and the cache may differ in dtype (float32 / bfloat16 each): an f32
model can keep a bf16 cache, read as f32. An int8 cache is read as f32 values -128..127 (the
K scale is already in q and the V scale is applied to the result: `quantization.py`). `write_kv_rows` writes one layer's
new K/V rows into the paged cache in place (XLA:CPU's scatter into a bfloat16 cache converts
the whole cache to f32 and back, twice per layer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.kernels.attention.inputs import check_attention_inputs
from jaxcb.kernels.cpu import (
    ATTENTION_DTYPES, ATTENTION_TARGET, CACHE_DTYPES, KV_WRITE_TARGET, LAZY_ZEROS_TARGET, attention_path,
    load_cpu_kernels,
)


def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    v_cache: jax.Array,  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    kv_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, max_blocks_per_seq]
    query_start_loc: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[]
    layer: jax.Array,  # i32[]
    *,
    sm_scale: float,
    window: jax.Array | None = None,  # i32[]: sliding window (keys p - window < j <= p); None: none
    softcap: float | None = None,  # static: scores -> softcap * tanh(scores / softcap); None: none
) -> jax.Array:  # [T, num_q_heads, head_dim]; padding tokens -> 0
    check_attention_inputs(
        q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer, q_may_differ_from_cache=True,
        window=window, softcap=softcap,
    )
    for name, dtype, allowed in (("q", q.dtype, ATTENTION_DTYPES), ("the KV cache", k_cache.dtype, CACHE_DTYPES)):
        if jnp.dtype(dtype).name not in allowed:
            raise ValueError(f"the CPU attention kernel takes {' or '.join(allowed)} for {name}, got {dtype}; "
                             f"use cache.dtype={' or '.join(CACHE_DTYPES)}, or attention.impl=xla")
    load_cpu_kernels()
    if k_cache.dtype == jnp.bfloat16:
        attention_path()  # probed and selected once per process: AMX prefill tiles where they run
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    windowed = () if window is None else (jnp.reshape(window, ()),)  # the kernel's optional last operand
    capped = {} if softcap is None else {"softcap": np.float32(softcap)}  # the kernel's optional attribute
    return call(
        q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
        jnp.reshape(num_seqs, ()), jnp.reshape(layer, ()), *windowed, sm_scale=np.float32(sm_scale), **capped,
    )


def write_kv_rows(
    k_cache: jax.Array,  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    v_cache: jax.Array,  # same
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slots: jax.Array,  # i32[T]: block * block_size + offset; outside the cache -> dropped
) -> tuple[jax.Array, jax.Array]:
    """The caches with cache[layer, :, slot[t]] = k[t] (and v), converted to the cache's dtype;
    in place when the caches are donated. Same result as kv_cache.write_kv's scatter."""
    if k_cache.ndim != 5 or k.shape != v.shape or k.shape[1:] != (k_cache.shape[1], k_cache.shape[4]) \
            or slots.shape != k.shape[:1] or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches {k_cache.shape}/{v_cache.shape}, rows {k.shape}/{v.shape} and slots {slots.shape} "
                         "do not match")
    load_cpu_kernels()
    call = jax.ffi.ffi_call(KV_WRITE_TARGET, (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),) * 2,
                            input_output_aliases={0: 0, 1: 1})
    return call(k_cache, v_cache, k.astype(k_cache.dtype), v.astype(v_cache.dtype), slots.astype(jnp.int32),
                jnp.reshape(layer, ()).astype(jnp.int32))


def write_kv_rows_into(cache, layer: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array):
    """`AttentionForm.write` of the cpu form: write_kv_rows on a KVCache."""
    return cache.with_buffers(*write_kv_rows(cache.k, cache.v, layer, k, v, slots))


@functools.partial(jax.jit, donate_argnums=0)
def write_blocks(cache, block_ids: jax.Array, k: jax.Array, v: jax.Array):
    """Whole blocks (swap-in) written layer by layer as rows of slots, in place."""
    from jaxcb.kernels.attention.cache import block_rows

    k_cache, v_cache = cache.k, cache.v
    for layer in range(k_cache.shape[0]):
        slots, k_rows, v_rows = block_rows(block_ids, k, v, layer, k_cache.shape[3])
        k_cache, v_cache = write_kv_rows(k_cache, v_cache, jnp.int32(layer), k_rows, v_rows, slots)
    return cache.with_buffers(k_cache, v_cache)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _lazy_zeros(shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    return jax.ffi.ffi_call(LAZY_ZEROS_TARGET, jax.ShapeDtypeStruct(shape, dtype))()


def lazy_zeros(shape: tuple[int, ...], dtype, sharding=None) -> jax.Array:
    """A zero-filled cache buffer whose pages the OS zeroes on first touch (kv_cache_write.cc): no pass
    writes gigabytes at start-up. Sharded buffers (tensor parallelism over host devices) are written."""
    if sharding is not None:
        return jnp.zeros(shape, dtype, device=sharding)
    load_cpu_kernels()
    return _lazy_zeros(tuple(shape), jnp.dtype(dtype))
