"""Attention over the paged KV cache, as the model sees it.

The model asks for "attention of these query tokens over the paged cache" through an
`AttentionBackend`; which implementation answers is chosen once from `attention.impl`:

    pallas     the Pallas ragged paged-attention kernel (GPU; `attention.interpret=true`
               runs it in the Pallas interpreter, for tests on CPU)
    cpu        a C++ kernel called through the XLA FFI (`cpu_kernels/`), built on first use
               with the system compiler: reads each sequence's blocks in place
    xla        the plain-JAX tiled path (anywhere; no compiler needed)
    reference  the simple O(tokens x context) definition, for tests and debugging
    auto       pallas on GPU; on CPU the C++ kernel, or xla (with a warning) if it cannot be built

`AttentionMetadata` is the per-step description of the ragged batch (DESIGN.md, "Data
flow of one step"); it is a pytree so that it travels into the jitted step as arrays.

Under tensor parallelism the backend carries the mesh, and `write_and_attend` runs per
shard of heads in `shard_map`: each device writes and reads the cache of its own KV heads
with its own query heads, whatever the implementation (XLA cannot partition a Pallas
kernel, and a scatter into a sharded cache left to it might gather the whole cache).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Optional

import jax
from jax.sharding import Mesh, PartitionSpec

from cpu_kernels import ATTENTION_DTYPES as CPU_ATTENTION_DTYPES
from cpu_kernels import CpuKernelUnavailable, load_cpu_kernels, ragged_paged_attention_cpu
from jaxcb.config import AttentionConfig, ConfigError
from jaxcb.kv_cache import KVCache, write_kv
from jaxcb.sharding import HEADS_SPEC, KV_CACHE_SPEC
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference, ragged_paged_attention_xla

log = logging.getLogger(__name__)


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
    mesh: Optional[Mesh] = None  # tensor parallelism: attention runs per shard of heads on this mesh

    def attend(
        self,
        q: jax.Array,  # [T, num_q_heads, head_dim]
        cache: KVCache,
        layer: jax.Array,  # i32[]
        md: AttentionMetadata,
        sm_scale: float,
    ) -> jax.Array:  # [T, num_q_heads, head_dim], in q's dtype
        """With a cache in another dtype than the model's (`cache.dtype`), the CPU kernel reads
        the cache as f32 and computes in f32; the others compute in the cache's dtype."""
        q_in = q if self.name == "cpu" else q.astype(cache.k.dtype)
        out = self.fn(
            q_in, cache.k, cache.v, md.kv_lens, md.block_tables, md.query_start_loc, md.num_seqs, layer,
            sm_scale=sm_scale,
        )
        return out.astype(q.dtype)

    def write_and_attend(
        self,
        q: jax.Array,  # [T, num_q_heads, head_dim]
        k: jax.Array,  # [T, num_kv_heads, head_dim]
        v: jax.Array,  # [T, num_kv_heads, head_dim]
        cache: KVCache,
        layer: jax.Array,  # i32[]
        md: AttentionMetadata,
        sm_scale: float,
    ) -> tuple[jax.Array, KVCache]:  # ([T, num_q_heads, head_dim], cache with this layer's new K/V)
        """Write the new tokens' K/V into the cache, then attend over it (per shard of heads under TP)."""

        def write_then_attend(q, k, v, cache, layer, md):
            cache = write_kv(cache, layer, k, v, md.slot_mapping)
            return self.attend(q, cache, layer, md, sm_scale), cache

        if self.mesh is None:
            return write_then_attend(q, k, v, cache, layer, md)
        cache_spec = KVCache(KV_CACHE_SPEC, KV_CACHE_SPEC)
        return jax.shard_map(
            write_then_attend,
            mesh=self.mesh,
            in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, cache_spec, PartitionSpec(), PartitionSpec()),
            out_specs=(HEADS_SPEC, cache_spec),
            # A pallas_call's output declares no varying mesh axes, which the check would demand.
            check_vma=False,
        )(q, k, v, cache, layer, md)


def check_cache_dtype(backend: AttentionBackend, cache_dtype) -> None:
    """A ConfigError at start-up for a cache dtype the chosen attention cannot read."""
    name = jax.numpy.dtype(cache_dtype).name
    if backend.name == "cpu" and name not in CPU_ATTENTION_DTYPES:
        raise ConfigError(
            f"cache.dtype={name} cannot be read by the C++ CPU attention kernel (attention.impl=cpu, the "
            f"default on CPU): use cache.dtype=float32 or bfloat16, or attention.impl=xla"
        )


def resolve_attention_impl(impl: str, platform: str | None = None) -> str:
    """The implementation `impl` stands for on `platform`; building the CPU kernel if auto picks it."""
    platform = platform or jax.default_backend()
    if impl != "auto":
        return impl
    if platform == "gpu":
        return "pallas"
    if platform == "cpu":
        try:
            load_cpu_kernels()
            return "cpu"
        except CpuKernelUnavailable as e:
            log.warning("attention.impl=auto: the C++ CPU kernel is unavailable, using the slower xla path (%s)", e)
    return "xla"


def get_attention_backend(cfg: AttentionConfig | None = None, mesh: Optional[Mesh] = None) -> AttentionBackend:
    """The implementation `attention.impl` names; with a mesh, it runs per shard of heads."""
    cfg = cfg or AttentionConfig()
    impl = resolve_attention_impl(cfg.impl)
    if impl == "pallas":
        if jax.default_backend() != "gpu" and not cfg.interpret:
            raise ConfigError(
                f"attention.impl=pallas needs a GPU (this is {jax.default_backend()}); use attention.impl=auto, "
                f"or attention.interpret=true to run the kernel in the Pallas interpreter"
            )
        fn = functools.partial(ragged_paged_attention, interpret=cfg.interpret)
        return AttentionBackend("pallas-interpret" if cfg.interpret else "pallas", fn, mesh)
    if impl == "cpu":
        if jax.default_backend() != "cpu":
            raise ConfigError(f"attention.impl=cpu runs on CPU only (this is {jax.default_backend()}); use attention.impl=auto")
        try:
            load_cpu_kernels()
        except CpuKernelUnavailable as e:
            raise ConfigError(f"attention.impl=cpu: {e}\nInstall a C++ compiler, or use attention.impl=xla") from e
        return AttentionBackend("cpu", ragged_paged_attention_cpu, mesh)
    if impl == "xla":
        return AttentionBackend("xla", ragged_paged_attention_xla, mesh)
    if impl == "reference":
        return AttentionBackend("reference", ragged_paged_attention_reference, mesh)
    raise ConfigError(f"attention.impl={impl!r} must be one of auto, pallas, cpu, xla, reference")
