"""The paged KV cache's device layout and the XLA forms of writing into it.

K and V of all layers live in two preallocated arrays, `[num_layers, num_kv_heads,
num_blocks, block_size, head_dim]` -- one block of one head is a contiguous
[block_size, head_dim] tile, what the attention kernels read -- allocated once and updated
in place by the jitted step (which donates them). Block 0 is the null block: padding tokens
write there and unused block-table entries point there, so it never holds data anyone reads.
Under tensor parallelism both arrays are split on the KV-head axis.

An 8-bit cache (`quantization.py`) carries its scales beside the buffers, f32[num_layers,
num_kv_heads] for K and for V (split on the KV-head axis like them); an unquantized cache has
none (None: no operand at all, so its steps compile as they always did). Every write keeps them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxcb.core.block_pool import NULL_BLOCK  # noqa: F401  (the pool reserves it; the cache layout keeps it)

SWAP_CHUNK = 16  # blocks per device<->host copy call: one compiled shape, padded with the null block


@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    v: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    k_scale: Optional[jax.Array] = None  # f32[num_layers, num_kv_heads]: an 8-bit cache's K scales; None: not quantized
    v_scale: Optional[jax.Array] = None  # f32[num_layers, num_kv_heads]: its V scales

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def with_buffers(self, k: jax.Array, v: jax.Array) -> "KVCache":
        """The same cache (scales kept) over new K/V buffers: what every write returns."""
        return dataclasses.replace(self, k=k, v=v)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "k_scale", "v_scale"], meta_fields=[])


def scatter_kv_rows(
    cache: KVCache,
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]; slot = block * block_size + offset; outside the cache -> dropped
) -> KVCache:
    """One layer's new K/V scattered into their slots (in place when the cache is donated)."""
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
    return cache.with_buffers(k_flat.reshape(cache.k.shape), v_flat.reshape(cache.v.shape))


@jax.jit
def gather_blocks(cache: KVCache, block_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K and V of `block_ids` (i32[SWAP_CHUNK]): [num_layers, num_kv_heads, SWAP_CHUNK, block_size, head_dim] each."""
    return cache.k[:, :, block_ids], cache.v[:, :, block_ids]


@functools.partial(jax.jit, donate_argnums=0)
def scatter_blocks(cache: KVCache, block_ids: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Write K and V into `block_ids` (in place: the cache is donated). Padding targets the null block.
    Raw blocks as they were gathered (an 8-bit cache's quantized bytes): no conversion."""
    return cache.with_buffers(cache.k.at[:, :, block_ids].set(k), cache.v.at[:, :, block_ids].set(v))


def block_rows(block_ids: jax.Array, k: jax.Array, v: jax.Array, layer: int, block_size: int):
    """(slots i32[n * BS], k rows, v rows [n * BS, Hkv, D]) of whole blocks of one layer, for a row write."""
    num_kv_heads, head_dim = k.shape[1], k.shape[-1]
    slots = (block_ids[:, None] * block_size + jnp.arange(block_size, dtype=block_ids.dtype)).reshape(-1)

    def rows(x: jax.Array) -> jax.Array:  # [L, Hkv, n, BS, D] -> [n * BS, Hkv, D]
        return jnp.moveaxis(x[layer], 0, -2).reshape(-1, num_kv_heads, head_dim)

    return slots, rows(k), rows(v)
