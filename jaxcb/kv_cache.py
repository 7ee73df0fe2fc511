"""The paged KV cache's device buffers.

K and V of all layers live in two preallocated arrays, `[num_layers, num_kv_heads,
num_blocks, block_size, head_dim]` -- one block of one head is a contiguous
[block_size, head_dim] tile, what the attention kernel reads -- allocated once and updated
in place by the jitted step (which donates them). Block 0 is the null block: padding tokens write there and
unused block-table entries point there, so it never holds data anyone reads. Under tensor
parallelism both arrays are split on the KV-head axis: each device holds 1/tp of every block.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from cpu_kernels import CpuKernelUnavailable, load_cpu_kernels, write_kv_rows
from jaxcb.block_pool import NULL_BLOCK  # noqa: F401  (re-exported: the cache owns the null block)
from jaxcb.config import CacheConfig, ConfigError
from jaxcb.model.config import LlamaConfig

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    v: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v"], meta_fields=[])


def kv_cache_shape(model: LlamaConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (model.num_layers, model.num_kv_heads, num_blocks, block_size, model.head_dim)


def default_cache_dtype(requested: str) -> jnp.dtype:
    """`auto` is bf16 on accelerators and f32 on CPU, where a bf16 scatter costs time in the whole cache."""
    if requested != "auto":
        return jnp.dtype(requested)
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def format_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """How big the cache is and what that buys; measured at start-up, never written into the config."""

    num_blocks: int  # including the null block
    block_size: int
    dtype: jnp.dtype
    bytes_per_block: int  # K and V, all layers, all KV heads (over all devices)
    max_model_len: int
    source: str  # what the size came from
    tensor_parallel_size: int = 1  # devices the cache is split over, by KV head

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_full_length_seqs(self) -> float:
        return self.num_tokens / self.max_model_len

    @property
    def bytes_per_device(self) -> int:
        return self.total_bytes // self.tensor_parallel_size

    def describe(self) -> str:
        split = (
            f" ({format_bytes(self.bytes_per_device)} on each of {self.tensor_parallel_size} devices)"
            if self.tensor_parallel_size > 1 else ""
        )
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens:,} tokens, "
            f"{format_bytes(self.total_bytes)} {jnp.dtype(self.dtype).name}{split} ({self.source}); "
            f"holds {self.max_full_length_seqs:.1f} sequences of max_model_len={self.max_model_len}"
        )


def _free_device_bytes(device: jax.Device, memory_fraction: float) -> Optional[tuple[int, str]]:
    """Bytes the cache may take on an accelerator: fraction of its memory, minus what is already used
    (the weights). None where the device reports no memory statistics (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    budget = int(stats["bytes_limit"] * memory_fraction) - int(stats.get("bytes_in_use", 0))
    return budget, f"cache.memory_fraction={memory_fraction} of {stats['bytes_limit'] / GIB:.1f} GiB on {device.platform}"


def _available_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 * GIB


def plan_kv_cache(
    cache: CacheConfig,
    model: LlamaConfig,
    *,
    max_model_len: int,
    max_num_seqs: int,
    reserve_bytes: int = 0,
    device: Optional[jax.Device] = None,
    tensor_parallel_size: int = 1,
) -> KVCachePlan:
    """Size the cache from `cache.num_blocks`, or from free device memory.

    On a GPU/TPU the cache takes `memory_fraction` of device memory minus what is in use
    (load the weights first) and `reserve_bytes` (step activations). Under tensor
    parallelism every device holds 1/tensor_parallel_size of each block (its KV heads), so
    one device's free memory holds tensor_parallel_size times more blocks. On CPU, where JAX
    reports no memory statistics, it takes `memory_fraction` of available host memory but
    no more than `max_num_seqs` sequences of `max_model_len` need -- a CPU run should not
    pin gigabytes it cannot use. Fails if one sequence of max_model_len would not fit.
    """
    dtype = default_cache_dtype(cache.dtype)
    bytes_per_block = model.kv_bytes_per_token(jnp.dtype(dtype).itemsize) * cache.block_size
    blocks_per_seq = -(-max_model_len // cache.block_size)
    if cache.num_blocks is not None:
        num_blocks, source = cache.num_blocks, "cache.num_blocks"
    else:
        device = device or jax.local_devices()[0]  # on several hosts, one this process can query
        free = _free_device_bytes(device, cache.memory_fraction)
        if free is not None:
            budget, source = free[0] - reserve_bytes, free[1]
            num_blocks = max(0, budget // (bytes_per_block // tensor_parallel_size))
        else:  # fake CPU devices share the host's memory: the whole cache counts against it
            budget = int(_available_host_bytes() * cache.memory_fraction) - reserve_bytes
            needed = max_num_seqs * blocks_per_seq + 1
            num_blocks = min(max(0, budget // bytes_per_block), needed)
            source = (
                f"host memory, capped at scheduler.max_num_seqs={max_num_seqs} x max_model_len={max_model_len}"
                if num_blocks == needed
                else f"cache.memory_fraction={cache.memory_fraction} of available host memory"
            )
    plan = KVCachePlan(
        int(num_blocks), cache.block_size, dtype, bytes_per_block, max_model_len, source, tensor_parallel_size
    )
    if plan.num_blocks - 1 < blocks_per_seq:
        raise ConfigError(
            f"the KV cache ({source}) holds {max(0, plan.num_tokens)} tokens, fewer than one sequence of "
            f"max_model_len={max_model_len} needs ({blocks_per_seq * cache.block_size}); lower engine.max_model_len "
            f"or give the cache more memory (cache.num_blocks / cache.memory_fraction)"
        )
    return plan


def allocate_kv_cache(
    model: LlamaConfig, num_blocks: int, block_size: int, dtype: jnp.dtype, sharding: Optional[Sharding] = None
) -> KVCache:
    """The device buffers, allocated once (each device allocates only its shard, if `sharding` splits
    them); the step updates them in place (donated)."""
    shape = kv_cache_shape(model, num_blocks, block_size)
    return KVCache(k=jnp.zeros(shape, dtype, device=sharding), v=jnp.zeros(shape, dtype, device=sharding))


def allocate_planned_kv_cache(model: LlamaConfig, plan: KVCachePlan, sharding: Optional[Sharding] = None) -> KVCache:
    log.info(plan.describe())
    return allocate_kv_cache(model, plan.num_blocks, plan.block_size, plan.dtype, sharding)


def write_kv(
    cache: KVCache,
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]; slot = block * block_size + offset
) -> KVCache:
    """Scatter one layer's new K/V into their slots (in place when the cache is donated): on
    CPU with the C++ kernel, elsewhere with XLA's scatter."""

    def with_kernel(cache: KVCache, layer, k, v, slot_mapping) -> KVCache:
        return KVCache(*write_kv_rows(cache.k, cache.v, layer, k, v, slot_mapping))

    return _on_cpu_with_kernel(with_kernel, _scatter_kv, cache, layer, k, v, slot_mapping)


def _on_cpu_with_kernel(with_kernel, elsewhere, *args):
    """with_kernel(*args) where the step runs on CPU and the C++ kernels build, elsewhere(*args)
    otherwise. Chosen when the step is lowered, for the platform it is lowered for: a step
    lowered here for a GPU must not call a CPU kernel."""
    if not _cpu_write_available():
        return elsewhere(*args)
    return jax.lax.platform_dependent(*args, cpu=with_kernel, default=elsewhere)


def _scatter_kv(cache: KVCache, layer, k, v, slot_mapping) -> KVCache:
    num_layers, num_kv_heads, num_blocks, block_size, head_dim = cache.k.shape
    flat = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
    if slot_mapping.shape[0] == 1:
        # XLA rewrites a one-row scatter as a select around a dynamic-update-slice, which it
        # does not do in place: every layer's write would copy the whole cache (hundreds of
        # MB per step). A second row aimed past the end (dropped) keeps it a scatter.
        k, v = (jnp.concatenate([a, jnp.zeros_like(a)]) for a in (k, v))
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), flat[2], slot_mapping.dtype)])
    # Indexing [layer, :, slots] puts the token axis first: the update is [T, num_kv_heads, head_dim].
    k_flat = cache.k.reshape(flat).at[layer, :, slot_mapping].set(k.astype(cache.k.dtype), mode="drop")
    v_flat = cache.v.reshape(flat).at[layer, :, slot_mapping].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(k=k_flat.reshape(cache.k.shape), v=v_flat.reshape(cache.v.shape))


@functools.cache
def _cpu_write_available() -> bool:
    """Whether this host runs on CPU with the C++ kernels built: there the new rows are written by
    `cpu_kernels.write_kv_rows`, as XLA:CPU's scatter into a bfloat16 cache converts the whole
    cache to f32 and back, twice per layer. (A GPU host does not build the kernels for this.)"""
    if jax.default_backend() != "cpu":
        return False
    try:
        load_cpu_kernels()
        return True
    except CpuKernelUnavailable:
        return False


SWAP_CHUNK = 16  # blocks per device<->host copy call: one compiled shape, padded with the null block


@jax.jit
def gather_blocks(cache: KVCache, block_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K and V of `block_ids` (i32[SWAP_CHUNK]): [num_layers, num_kv_heads, SWAP_CHUNK, block_size, head_dim] each."""
    return cache.k[:, :, block_ids], cache.v[:, :, block_ids]


@functools.partial(jax.jit, donate_argnums=0)
def scatter_blocks(cache: KVCache, block_ids: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Write K and V into `block_ids` (in place: the cache is donated). Padding targets the null block."""

    def with_kernel(cache: KVCache, block_ids, k, v) -> KVCache:  # layer by layer, as rows of slots
        num_layers, num_kv_heads, _, block_size, head_dim = cache.k.shape
        slots = (block_ids[:, None] * block_size + jnp.arange(block_size, dtype=block_ids.dtype)).reshape(-1)

        def rows(x: jax.Array, layer: int) -> jax.Array:  # [L, Hkv, n, BS, D] -> [n * BS, Hkv, D]
            return jnp.moveaxis(x[layer], 0, -2).reshape(-1, num_kv_heads, head_dim)

        k_cache, v_cache = cache.k, cache.v
        for layer in range(num_layers):
            k_cache, v_cache = write_kv_rows(k_cache, v_cache, jnp.int32(layer), rows(k, layer), rows(v, layer), slots)
        return KVCache(k=k_cache, v=v_cache)

    def with_scatter(cache: KVCache, block_ids, k, v) -> KVCache:
        return KVCache(k=cache.k.at[:, :, block_ids].set(k), v=cache.v.at[:, :, block_ids].set(v))

    return _on_cpu_with_kernel(with_kernel, with_scatter, cache, block_ids, k, v)


class HostSwapSpace:
    """Preallocated host memory for swapped-out blocks, indexed by host block id (0 unused)."""

    def __init__(self, cache: KVCache, num_blocks: int):
        num_layers, num_kv_heads, _, block_size, head_dim = cache.k.shape
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        self.k = np.zeros(shape, cache.k.dtype)
        self.v = np.zeros(shape, cache.v.dtype)
        self.num_blocks = num_blocks

    def swap_out(self, cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device block, host block)."""
        for i in range(0, len(pairs), SWAP_CHUNK):
            chunk = pairs[i : i + SWAP_CHUNK]
            dev = np.zeros(SWAP_CHUNK, np.int32)
            dev[: len(chunk)] = [d for d, _ in chunk]
            k, v = gather_blocks(cache, jnp.asarray(dev))
            host = [h for _, h in chunk]
            self.k[:, :, host] = np.asarray(k)[:, :, : len(chunk)]
            self.v[:, :, host] = np.asarray(v)[:, :, : len(chunk)]

    def swap_in(self, cache: KVCache, pairs: list[tuple[int, int]]) -> KVCache:
        """Copy host blocks back into device blocks: pairs of (host block, device block)."""
        for i in range(0, len(pairs), SWAP_CHUNK):
            chunk = pairs[i : i + SWAP_CHUNK]
            dev = np.zeros(SWAP_CHUNK, np.int32)  # padding rows land in the null block
            dev[: len(chunk)] = [d for _, d in chunk]
            host = np.zeros(SWAP_CHUNK, np.int64)
            host[: len(chunk)] = [h for h, _ in chunk]
            cache = scatter_blocks(cache, jnp.asarray(dev), jnp.asarray(self.k[:, :, host]), jnp.asarray(self.v[:, :, host]))
        return cache


def num_swap_blocks(cache_cfg: CacheConfig, plan: "KVCachePlan") -> int:
    return int(cache_cfg.swap_space_gib * GIB // plan.bytes_per_block)
