"""The Pallas kernel's variants and the model shapes the GPU lowering tests run, in one table.

A variant is what changes the kernel's code: dtype, head dim, block size, query heads per KV
head (group), tile sizes, warps and stages, a sliding window, a logit soft-cap. Batch shapes change
only the launch grid.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxcb.config import compose_config
from jaxcb.model.config import LlamaConfig, resolve_llama_config
from jaxcb.kernels.attention.pallas import query_tiles, ragged_paged_attention
from pallas_kernels.query_tiles import Launch, default_kv_tile


@functools.cache
def preset(name: str) -> LlamaConfig:
    """The architecture of `model=name` (conf/model/NAME.yaml)."""
    # model.dtype=auto would resolve for this CPU host: these checks lower for a GPU, in bfloat16.
    return resolve_llama_config(compose_config([f"model={name}", "model.init=random", "model.dtype=bfloat16"]).model)


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    name: str
    num_q_heads: int  # per device
    num_kv_heads: int  # per device
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    num_layers: int = 32
    block_m: int = 16  # decode tiles' rows
    prefill_block_m: int = 64  # prefill tiles' rows
    kv_tile: int | None = 32  # None: the kernel's default for the head dim (`default_kv_tile`)
    num_warps: int | None = 4  # every launch's; None: each launch's default (`default_num_warps`)
    num_stages: int = 2
    num_splits: int | None = None  # split-KV programs per (tile, KV head); None: chosen by the kernel
    window: bool = False  # a sliding window: one more operand, an i32[] (its value varies by layer)
    softcap: float | None = None  # a logit soft-cap: static, no operand (Gemma 2: 50.0)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def kernel_kwargs(self) -> dict:
        return dict(block_m=self.block_m, prefill_block_m=self.prefill_block_m, kv_tile=self.kv_tile,
                    num_warps=self.num_warps, num_stages=self.num_stages, num_splits=self.num_splits,
                    softcap=self.softcap)

    def tile_plan(self, num_tokens: int, num_seqs: int):
        """The query tiles of both classes (decode, prefill) a bucket of this many tokens and sequences can need."""
        return query_tiles(num_tokens, num_seqs, self.group, self.block_size, self.block_m, self.prefill_block_m,
                           self.kv_tile or default_kv_tile(self.head_dim))

    def launches(self, num_tokens: int, num_seqs: int, width: int) -> tuple[Launch, ...]:
        """The kernel's launches, the decode tiles' first: the tiles of each class a bucket can need, each
        launch's warps, and the split-KV it chooses at a block-table width of `width` blocks."""
        plan = self.tile_plan(num_tokens, num_seqs)
        return plan.launches(  # the K/V tile the kernel reads: whole blocks, kv_tile tokens or more
            num_tokens, num_seqs, self.num_kv_heads, width * self.block_size, head_dim=self.head_dim,
            itemsize=jnp.dtype(self.dtype).itemsize, kv_tile=plan.pages_per_tile * self.block_size,
            num_warps=self.num_warps, num_stages=self.num_stages, num_splits=self.num_splits)

    def expected_grids(self, num_tokens: int, num_seqs: int, width: int) -> list[tuple[int, int, int]]:
        """One (programs, KV heads, KV splits) per launch, the decode tiles' first."""
        return [(launch.num_programs, self.num_kv_heads, launch.num_splits)
                for launch in self.launches(num_tokens, num_seqs, width)]

    def args(self, num_tokens: int, num_seqs: int, width: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Abstract kernel arguments: a cache of one full table per sequence plus the null block."""
        dtype = jnp.dtype(self.dtype)
        cache = jax.ShapeDtypeStruct(
            (self.num_layers, self.num_kv_heads, num_seqs * width + 1, self.block_size, self.head_dim), dtype
        )
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return (
            jax.ShapeDtypeStruct((num_tokens, self.num_q_heads, self.head_dim), dtype),
            cache, cache, i32(num_seqs), i32(num_seqs, width), i32(num_seqs + 1), i32(), i32(),
            *((i32(),) if self.window else ()),
        )

    def kernel(self):
        """The kernel over `args()`: the window, where there is one, is the last."""
        kernel = functools.partial(ragged_paged_attention, sm_scale=self.head_dim**-0.5, **self.kernel_kwargs())
        if not self.window:
            return kernel
        return lambda *args: kernel(*args[:8], window=args[8])


# llama8b: 32 query / 8 KV heads; llama70b: 64 / 8, per device under TP=2: 32 / 4, TP=8: 8 / 1;
# llama3_1b: 32 / 8 at head dim 64.
LLAMA8B = KernelVariant("llama8b", 32, 8)
# The kernel as the engine launches it: its default tiles (16-row decode, 64-row prefill), warps and stages.
ENGINE_LLAMA8B = dataclasses.replace(LLAMA8B, name="llama8b engine (3 stages)", num_stages=3)
KERNEL_VARIANTS = [
    LLAMA8B,
    KernelVariant("llama8b f16", 32, 8, dtype="float16"),
    KernelVariant("llama8b f32 cache", 32, 8, dtype="float32"),
    KernelVariant("llama70b tp2", 32, 4, num_layers=80),
    KernelVariant("llama70b tp8", 8, 1, num_layers=80),
    KernelVariant("llama3_1b", 32, 8, head_dim=64, num_layers=16),
    *(KernelVariant(f"llama8b block {bs}", 32, 8, block_size=bs) for bs in (8, 32, 64)),
    KernelVariant("llama8b split-KV x8", 32, 8, num_splits=8),
    KernelVariant("llama8b window", 32, 8, window=True),
    KernelVariant("llama8b window split-KV x8", 32, 8, num_splits=8, window=True),
    *(KernelVariant(f"head dim 64 block {bs}", 32, 8, head_dim=64, block_size=bs) for bs in (8, 16, 32, 64)),
    KernelVariant("llama8b tile 16x16 1 stage", 32, 8, block_m=16, kv_tile=16, num_stages=1),
    KernelVariant("llama8b tile 32x64 3 stages", 32, 8, block_m=32, kv_tile=64, num_stages=3),
    KernelVariant("llama8b tile 64x128 8 warps", 32, 8, block_m=64, kv_tile=128, num_warps=8, num_stages=3),
]

# Gemma 2 9B (16 query / 8 KV heads, head dim 256, soft-cap 50, a sliding window in every other layer) and
# Gemma 3 4B (8 / 4, head dim 256, windows, no cap) as the engine launches them: the kernel's own tiles and
# warps for head dim 256 (16-key KV tiles; the 64-row prefill tiles at 8 warps), 3 stages.
GEMMA2_9B = KernelVariant("gemma2_9b engine", 16, 8, head_dim=256, num_layers=42, kv_tile=None, num_warps=None,
                          num_stages=3, window=True, softcap=50.0)
GEMMA3_4B = KernelVariant("gemma3_4b engine", 8, 4, head_dim=256, num_layers=34, kv_tile=None, num_warps=None,
                          num_stages=3, window=True)
KERNEL_VARIANTS += [  # head dim 256 beside the engine's Gemma launches (PREFILL_TILE_VARIANTS)
    dataclasses.replace(GEMMA2_9B, name="head dim 256 group 2, no window or cap", window=False, softcap=None),
    dataclasses.replace(GEMMA2_9B, name="gemma2_9b split-KV x8", num_splits=8),
    dataclasses.replace(GEMMA2_9B, name="gemma2_9b f32 cache", dtype="float32"),
    dataclasses.replace(LLAMA8B, name="llama8b softcap 50", softcap=50.0),
]

# The prefill tile sizes and stage counts beside the engine's: 128-row prefill tiles want 8 warps.
PREFILL_TILE_VARIANTS = [
    ENGINE_LLAMA8B,
    KernelVariant("llama8b prefill 32 rows", 32, 8, num_stages=3, prefill_block_m=32),
    KernelVariant("llama8b prefill 128 rows 8 warps", 32, 8, num_warps=8, num_stages=3, prefill_block_m=128),
    dataclasses.replace(ENGINE_LLAMA8B, name="llama70b tp2 3 stages", num_kv_heads=4, num_layers=80),
    dataclasses.replace(ENGINE_LLAMA8B, name="llama3_1b 3 stages", head_dim=64, num_layers=16),
    dataclasses.replace(ENGINE_LLAMA8B, name="llama8b window 3 stages", window=True),
    GEMMA2_9B,
    GEMMA3_4B,
]
