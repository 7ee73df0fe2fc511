"""Attention over the paged KV cache, as the model sees it.

The model asks for "attention of these query tokens over the paged cache" through
`AttentionBackend`; which implementation answers (the pure-JAX reference today, Pallas
kernels for GPU and an efficient XLA path for CPU later) is the backend's business.
`AttentionMetadata` is the per-step description of the ragged batch (DESIGN.md, "Data flow
of one step"); it is a pytree so that it travels into the jitted step as arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

from jaxcb.kv_cache import KVCache
from pallas_kernels import ragged_paged_attention_reference


@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: jax.Array  # i32[T]: cache slot of each new token (padding -> null block)
    query_start_loc: jax.Array  # i32[R + 1]: sequence r owns tokens [qsl[r], qsl[r+1])
    kv_lens: jax.Array  # i32[R]: context length of each sequence, new tokens included
    block_tables: jax.Array  # i32[R, max_blocks_per_seq]: unused entries -> null block
    num_seqs: jax.Array  # i32[]: real sequences; rows past it are padding


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "query_start_loc", "kv_lens", "block_tables", "num_seqs"],
    meta_fields=[],
)


class AttentionBackend(Protocol):
    def attend(
        self,
        q: jax.Array,  # [T, num_q_heads, head_dim]
        cache: KVCache,
        layer: jax.Array,  # i32[]
        md: AttentionMetadata,
        sm_scale: float,
    ) -> jax.Array:  # [T, num_q_heads, head_dim]
        ...


class ReferenceAttention:
    """The pure-JAX reference: exact and simple, O(tokens x context); for tests and tiny models."""

    def attend(self, q, cache, layer, md, sm_scale):
        return ragged_paged_attention_reference(
            q,
            cache.k[layer],
            cache.v[layer],
            md.kv_lens,
            md.block_tables,
            md.query_start_loc,
            md.num_seqs,
            sm_scale=sm_scale,
        )


def get_attention_backend(impl: str = "reference") -> AttentionBackend:
    if impl == "reference":
        return ReferenceAttention()
    raise ValueError(f"attention impl {impl!r} is not available; use 'reference'")
