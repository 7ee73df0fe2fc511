"""Attention over the paged KV cache, as the model sees it.

The model asks for "attention of these query tokens over the paged cache" through an
`AttentionBackend`; which implementation answers is chosen once from `attention.impl`:

    pallas     the Pallas ragged paged-attention kernel (GPU; `attention.interpret=true`
               runs it in the Pallas interpreter, for tests on CPU)
    xla        the plain-JAX tiled path (CPU, or anywhere without a kernel)
    reference  the simple O(tokens x context) definition, for tests and debugging
    auto       pallas on GPU, xla elsewhere

`AttentionMetadata` is the per-step description of the ragged batch (DESIGN.md, "Data
flow of one step"); it is a pytree so that it travels into the jitted step as arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from jaxcb.config import AttentionConfig, ConfigError
from jaxcb.kv_cache import KVCache
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference, ragged_paged_attention_xla


@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: jax.Array  # i32[T]: cache slot (block * block_size + offset) of each new token
    query_start_loc: jax.Array  # i32[R + 1]: sequence r owns tokens [qsl[r], qsl[r+1])
    kv_lens: jax.Array  # i32[R]: context length of each sequence, new tokens included
    block_tables: jax.Array  # i32[R, max_blocks_per_seq]: unused entries -> null block
    num_seqs: jax.Array  # i32[]: real sequences; rows past it are padding


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "query_start_loc", "kv_lens", "block_tables", "num_seqs"],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One attention implementation; hashable so that it can sit in the model's static graph."""

    name: str
    fn: Callable[..., jax.Array]

    def attend(
        self,
        q: jax.Array,  # [T, num_q_heads, head_dim]
        cache: KVCache,
        layer: jax.Array,  # i32[]
        md: AttentionMetadata,
        sm_scale: float,
    ) -> jax.Array:  # [T, num_q_heads, head_dim]
        return self.fn(
            q, cache.k, cache.v, md.kv_lens, md.block_tables, md.query_start_loc, md.num_seqs, layer,
            sm_scale=sm_scale,
        )


def resolve_attention_impl(impl: str, platform: str | None = None) -> str:
    platform = platform or jax.default_backend()
    if impl == "auto":
        return "pallas" if platform == "gpu" else "xla"
    return impl


def get_attention_backend(cfg: AttentionConfig | None = None) -> AttentionBackend:
    cfg = cfg or AttentionConfig()
    impl = resolve_attention_impl(cfg.impl)
    if impl == "pallas":
        if jax.default_backend() != "gpu" and not cfg.interpret:
            raise ConfigError(
                f"attention.impl=pallas needs a GPU (this is {jax.default_backend()}); use attention.impl=xla, "
                f"or attention.interpret=true to run the kernel in the Pallas interpreter"
            )
        fn = functools.partial(ragged_paged_attention, interpret=cfg.interpret)
        return AttentionBackend("pallas-interpret" if cfg.interpret else "pallas", fn)
    if impl == "xla":
        return AttentionBackend("xla", ragged_paged_attention_xla)
    if impl == "reference":
        return AttentionBackend("reference", ragged_paged_attention_reference)
    raise ConfigError(f"attention.impl={impl!r} must be one of auto, pallas, xla, reference")
