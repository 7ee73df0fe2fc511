"""The paged KV cache's device buffers.

K and V of all layers live in two preallocated arrays, `[num_layers, num_kv_heads,
num_blocks, block_size, head_dim]` -- one block of one head is a contiguous
[block_size, head_dim] tile, what the attention kernel reads -- allocated once and updated
in place by the jitted step (which donates them). Block 0 is the null block: padding tokens write there and
unused block-table entries point there, so it never holds data anyone reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxcb.model.config import LlamaConfig

NULL_BLOCK = 0


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


def allocate_kv_cache(model: LlamaConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> KVCache:
    shape = kv_cache_shape(model, num_blocks, block_size)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write_kv(
    cache: KVCache,
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]; slot = block * block_size + offset
) -> KVCache:
    """Scatter one layer's new K/V into their slots (in place when the cache is donated)."""
    num_layers, num_kv_heads, num_blocks, block_size, head_dim = cache.k.shape
    flat = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
    # Indexing [layer, :, slots] puts the token axis first: the update is [T, num_kv_heads, head_dim].
    k_flat = cache.k.reshape(flat).at[layer, :, slot_mapping].set(k.astype(cache.k.dtype), mode="drop")
    v_flat = cache.v.reshape(flat).at[layer, :, slot_mapping].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(k=k_flat.reshape(cache.k.shape), v=v_flat.reshape(cache.v.shape))
