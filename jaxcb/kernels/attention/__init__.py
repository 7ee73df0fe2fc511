"""Attention over the paged KV cache: one protocol, several forms.

A form owns the cache layout (`cache.py`), the K/V write and attend. The model reaches
attention only through an `AttentionForm`, chosen once from `attention.impl`:

    pallas     the Pallas ragged paged-attention kernel, Triton backend (`pallas.py`; GPU, or
               the Pallas interpreter with `attention.interpret=true`, for tests on CPU)
    cpu        a C++ kernel through the XLA FFI (`cpu.py`), reading each sequence's blocks in
               place; its K/V write is C++ too
    xla        the plain-JAX tiled path (`xla.py`; anywhere, no compiler needed)
    reference  the simple O(tokens x context) definition (`reference.py`), for tests
    auto       pallas on GPU; on CPU the C++ kernel, or xla (with a warning) if it cannot be built

Every attend function takes q [T, Hq, D], the stacked caches, kv_lens [R], block_tables
[R, W], query_start_loc [R + 1], num_seqs, layer and sm_scale, and returns [T, Hq, D].

Sliding window: `window` is None (no window: the forms compile exactly as without the argument)
or a traced i32[] -- it varies per layer inside the layer scan -- with Hugging Face's meaning
(Mistral, Qwen2, Gemma): the token at position p sees key j iff j <= p and p - j < window.
`NO_WINDOW` (or any window >= the context) is none, for the full layers of a model that mixes
both. The pallas, cpu and xla forms skip the KV tiles or blocks that lie wholly before the
window of a query tile's first token (the xla form's short-table path masks them instead);
blocks that every layer's window has left stay allocated until the sequence ends, never read.

Logit soft-capping (Gemma 2): `softcap` is None (no capping: every form compiles exactly as without
the argument) or a static Python float c > 0, the same in every layer: each score q.k * sm_scale
becomes c * tanh(score / c), then the causal and window masks, then the softmax (transformers'
Gemma 2). A static argument of each form's jit (the C++ kernel's attribute), never an operand.

8-bit caches (`cache.dtype=int8 | fp8_e4m3 | fp8_e5m2`, `quantization.py`): the cache carries a scale
per (layer, KV head) for K and V; `write` quantizes with saturation before the form's write, and
`attend` folds the K scale into q and applies the V scale to the output, while each form widens the
8-bit blocks to the compute dtype as it reads them (in registers: no dequantized copy). `cache_dtypes`
lists what a form reads (the cpu form: float32, bfloat16, int8); others are refused at start-up.

Invariant of every form (and of every backend that writes the cache itself): in each layer,
every row's new K/V is written before any row's attention reads the cache (`write_and_attend`:
the whole step's write, then the attend). So a sequence attends to its own new tokens, and
to blocks that another sequence of the same step fills: the prefix cache makes a block
findable from the step that fills it (`jaxcb.core.kv_cache_manager`), so sequences sharing a
prefix and admitted together compute it once. A form that fuses the write into its attention
kernel must still finish every row's write before any row reads, whatever the rows' order
(`tests/test_attention.py::test_a_sequence_attends_to_blocks_another_sequence_writes_in_the_same_step`).

Under tensor parallelism the form carries the mesh and `write_and_attend` runs per shard of
heads in `shard_map`: each device writes and reads the cache of its own KV heads with its own
query heads, whatever the form (XLA cannot partition a Pallas kernel, and a scatter into a
sharded cache left to it might gather the whole cache).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Optional

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxcb.config import AttentionConfig, ConfigError
from jaxcb.kernels.attention.cache import NULL_BLOCK, SWAP_CHUNK, KVCache, scatter_blocks, scatter_kv_rows
from jaxcb.kernels.attention.quantization import (
    cache_dtype_name, is_quantized, quantize, scale_outputs, scale_queries,
)
from jaxcb.kernels.attention.reference import NO_WINDOW, ragged_paged_attention_reference
from jaxcb.kernels.attention.xla import ragged_paged_attention_xla
from jaxcb.sharding import HEADS_SPEC, KV_CACHE_SPEC

log = logging.getLogger(__name__)


def zeros_buffer(shape: tuple[int, ...], dtype, sharding=None) -> jax.Array:
    return jax.numpy.zeros(shape, dtype, device=sharding)

__all__ = [
    "AttentionForm", "AttentionMetadata", "KVCache", "NO_WINDOW", "NULL_BLOCK", "SWAP_CHUNK", "select_attention",
]


@dataclasses.dataclass
class AttentionMetadata:
    """The per-step description of the ragged batch (a pytree: it travels into the step as arrays)."""

    slot_mapping: jax.Array  # i32[T]: cache slot (block * block_size + offset) of each new token
    query_start_loc: jax.Array  # i32[R + 1]: sequence r owns tokens [qsl[r], qsl[r+1])
    kv_lens: jax.Array  # i32[R]: context length of each sequence, new tokens included
    block_tables: jax.Array  # i32[R, W]: unused entries -> null block
    num_seqs: jax.Array  # i32[]: real sequences; rows past it are padding
    # What a form derives from the above once per step, before the layer loop (`AttentionForm.prepare_step`),
    # instead of in every layer: the pallas kernel's query-tile table i32[6, num_tiles]. None: not prepared.
    tiles: Optional[jax.Array] = None


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "query_start_loc", "kv_lens", "block_tables", "num_seqs", "tiles"],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class AttentionForm:
    """One attention implementation with its cache write; hashable, so it can be static in a jit."""

    name: str
    attend_fn: Callable[..., jax.Array]
    write_rows_fn: Callable[..., KVCache] = scatter_kv_rows  # (cache, layer, k, v, slots) -> cache
    write_blocks_fn: Callable[..., KVCache] = scatter_blocks  # (cache, block_ids, k, v) -> cache, donated
    cache_dtypes: Optional[tuple[str, ...]] = None  # the cache dtypes it reads; None: any
    computes_in_cache_dtype: bool = True  # False: q keeps its dtype and the cache is read as it
    mesh: Optional[Mesh] = None  # tensor parallelism: runs per shard of heads on this mesh
    zeros_fn: Callable[..., jax.Array] = zeros_buffer  # (shape, dtype, sharding) -> a zero-filled cache buffer
    # (md, num_tokens, group, block_size) -> md with what every layer's attention reads derived once per step
    prepare_step_fn: Optional[Callable[..., "AttentionMetadata"]] = None

    def prepare_step(self, md: AttentionMetadata, num_tokens: int, group: int, block_size: int) -> AttentionMetadata:
        """The step's metadata with what this form derives from it once, outside the layer loop."""
        if self.prepare_step_fn is None:
            return md
        return self.prepare_step_fn(md, num_tokens=num_tokens, group=group, block_size=block_size)

    def with_mesh(self, mesh: Optional[Mesh]) -> "AttentionForm":
        return dataclasses.replace(self, mesh=mesh)

    def check_cache_dtype(self, dtype) -> None:
        """A ConfigError at start-up for a cache dtype this form cannot read, naming the ones it can."""
        name = cache_dtype_name(dtype)
        if self.cache_dtypes is not None and name not in self.cache_dtypes:
            others = "attention.impl=xla" + (" or pallas (GPU)" if is_quantized(dtype) else "")
            raise ConfigError(
                f"cache.dtype={name} cannot be read by attention.impl={self.name} (it reads "
                f"{', '.join(self.cache_dtypes)}): use cache.dtype={' or '.join(self.cache_dtypes)}, or {others}"
            )

    def write(self, cache: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
        """One layer's new K/V ([T, Hkv, D] each) into their slots i32[T] (in place when donated); an
        8-bit cache gets them divided by the layer's scales and saturated (`quantization.quantize`)."""
        if cache.quantized:
            k = quantize(k, cache.k_scale[layer], cache.k.dtype)
            v = quantize(v, cache.v_scale[layer], cache.v.dtype)
        return self.write_rows_fn(cache, layer, k, v, slot_mapping)

    def attend(
        self,
        q: jax.Array,  # [T, num_q_heads, head_dim]
        cache: KVCache,
        layer: jax.Array,  # i32[]
        md: AttentionMetadata,
        sm_scale: float,
        window: Optional[jax.Array] = None,  # i32[]: this layer's sliding window; None: none
        softcap: Optional[float] = None,  # static: logit soft-cap, scores -> c * tanh(scores / c); None: none
    ) -> jax.Array:  # [T, num_q_heads, head_dim], in q's dtype
        if cache.quantized:  # the K scale folded into q; each form converts the 8-bit tiles to q's dtype
            q_in = scale_queries(q, cache.k_scale[layer])
        else:
            q_in = q.astype(cache.k.dtype) if self.computes_in_cache_dtype else q
        prepared = {} if md.tiles is None else {"tiles": md.tiles}
        if window is not None:  # passed only when there is one: without it every form compiles as before
            prepared["window"] = window
        if softcap is not None:  # likewise
            prepared["softcap"] = softcap
        out = self.attend_fn(
            q_in, cache.k, cache.v, md.kv_lens, md.block_tables, md.query_start_loc, md.num_seqs, layer,
            sm_scale=sm_scale, **prepared,
        )
        if cache.quantized:  # the V scale, once per output row rather than once per key
            out = scale_outputs(out, cache.v_scale[layer])
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
        window: Optional[jax.Array] = None,  # i32[]: this layer's sliding window (traced); None: none
        softcap: Optional[float] = None,  # static: logit soft-cap (Gemma 2's 50.0); None: none
    ) -> tuple[jax.Array, KVCache]:  # ([T, num_q_heads, head_dim], cache with this layer's new K/V)
        """Write the new tokens' K/V into the cache, then attend over it (per shard of heads under TP)."""

        def write_then_attend(q, k, v, cache, layer, md, window):
            cache = self.write(cache, layer, k, v, md.slot_mapping)
            return self.attend(q, cache, layer, md, sm_scale, window, softcap), cache

        if self.mesh is None:
            return write_then_attend(q, k, v, cache, layer, md, window)
        cache_spec = jax.tree.map(lambda _: KV_CACHE_SPEC, cache)  # buffers and scales alike: by KV head
        # The window, like the layer, is replicated (None is an empty pytree: no operand at all); the softcap is
        # a constant of the traced function.
        return jax.shard_map(
            write_then_attend,
            mesh=self.mesh,
            in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, cache_spec, PartitionSpec(), PartitionSpec(),
                      PartitionSpec()),
            out_specs=(HEADS_SPEC, cache_spec),
            # A pallas_call's output declares no varying mesh axes, which the check would demand.
            check_vma=False,
        )(q, k, v, cache, layer, md, window)


def pallas_form(interpret: bool = False) -> AttentionForm:
    from jaxcb.kernels.attention.pallas import prepare_step, ragged_paged_attention

    fn = functools.partial(ragged_paged_attention, interpret=interpret)
    return AttentionForm("pallas-interpret" if interpret else "pallas", fn, prepare_step_fn=prepare_step)


def cpu_form() -> AttentionForm:
    """Raises CpuKernelUnavailable when the C++ kernels cannot be built here."""
    from jaxcb.kernels.attention import cpu
    from jaxcb.kernels.cpu import CACHE_DTYPES, load_cpu_kernels

    load_cpu_kernels()
    return AttentionForm(
        "cpu", cpu.ragged_paged_attention_cpu, cpu.write_kv_rows_into, cpu.write_blocks,
        cache_dtypes=CACHE_DTYPES, computes_in_cache_dtype=False, zeros_fn=cpu.lazy_zeros,
    )


XLA = AttentionForm("xla", ragged_paged_attention_xla)
REFERENCE = AttentionForm("reference", ragged_paged_attention_reference)
IMPLS = ("auto", "pallas", "cpu", "xla", "reference")


def select_attention(
    cfg: AttentionConfig | None = None, mesh: Optional[Mesh] = None, platform: str | None = None
) -> AttentionForm:
    """The form `attention.impl` names on `platform` (default: JAX's); with a mesh, it runs per shard of heads."""
    from jaxcb.kernels.cpu import CpuKernelUnavailable

    cfg = cfg or AttentionConfig()
    platform = platform or jax.default_backend()
    impl = cfg.impl
    if impl not in IMPLS:
        raise ConfigError(f"attention.impl={impl!r} must be one of {', '.join(IMPLS)}")
    if impl == "auto":
        impl = {"gpu": "pallas", "cpu": "cpu"}.get(platform, "xla")
        if cfg.interpret and impl != "pallas":  # (an explicit impl other than pallas: config_unused says so)
            log.warning("attention.interpret=true is not used: attention.impl=auto takes the %s form on %s; set "
                        "attention.impl=pallas to run the Pallas kernel in the interpreter", impl, platform)
        if impl == "cpu":
            try:
                return cpu_form().with_mesh(mesh)
            except CpuKernelUnavailable as e:
                log.info("attention.impl=auto: the C++ CPU kernel is unavailable, using the xla form (%s)", e)
                impl = "xla"
    if impl == "pallas":
        if platform != "gpu" and not cfg.interpret:
            raise ConfigError(
                f"attention.impl=pallas needs a GPU (this is {platform}); use attention.impl=auto, "
                f"or attention.interpret=true to run the kernel in the Pallas interpreter"
            )
        return pallas_form(cfg.interpret).with_mesh(mesh)
    if impl == "cpu":
        if platform != "cpu":
            raise ConfigError(f"attention.impl=cpu runs on CPU only (this is {platform}); use attention.impl=auto")
        try:
            return cpu_form().with_mesh(mesh)
        except CpuKernelUnavailable as e:
            raise ConfigError(f"attention.impl=cpu: {e}\nInstall a C++ compiler, or use attention.impl=xla") from e
    return (XLA if impl == "xla" else REFERENCE).with_mesh(mesh)
