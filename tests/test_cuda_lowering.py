"""Every kernel variant and the whole jitted step lower for an H200, on a machine without a GPU.

jax >= 0.11 reads the GPU's compute capability while lowering a Pallas Triton kernel; here it
comes from an abstract H200 of an abstract mesh (jaxcb/kernels/triton_calls.py), which also
stands in for the devices of a tensor-parallel step. Each test reads the Triton custom call
XLA would launch -- its grid, warps, stages and operand shapes -- not only that one exists.
Compiling the Triton IR to machine code is tests/test_triton_resources.py (and, on the GPU,
scripts/gpu_check.py).
"""

import dataclasses
import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from flax import nnx

from cuda_variants import (
    ENGINE_LLAMA8B, GEMMA2_9B, GEMMA3_4B, KERNEL_VARIANTS, LLAMA8B, PREFILL_TILE_VARIANTS, KernelVariant, preset,
)
from benchmarks.reference_generate import forward_step
from jaxcb.backends import Backend
from jaxcb.backends.base import fuse_layer_weights
from jaxcb.kernels.attention import AttentionMetadata, KVCache, pallas_form
from jaxcb.kernels.triton_calls import gpu_mesh, lower_for_gpu, triton_calls
from jaxcb.kv_cache import kv_cache_shape
from jaxcb.model.llama import LayerWeights, StepWeights, build_abstract_model
from jaxcb.sharding import TP_AXIS, TensorParallel


def spare_rows(variant: KernelVariant, num_tokens: int, num_seqs: int) -> int:
    """q's padding past the last token: the largest tile class's rows, so its last tile loads in bounds."""
    return max(variant.tile_plan(num_tokens, num_seqs).classes)


def lower_kernel(variant: KernelVariant, num_tokens: int, num_seqs: int, width: int):
    """The kernel's launches: the decode tiles' and, where a bucket can hold a prefill, the prefill tiles'."""
    return triton_calls(lower_for_gpu(variant.kernel(), *variant.args(num_tokens, num_seqs, width)))


def test_lowering_without_a_gpu_reads_the_abstract_h200():
    """Without the abstract device jax >= 0.11 refuses to lower a Triton kernel on a CPU host."""
    fn, args = LLAMA8B.kernel(), LLAMA8B.args(1, 1, 64)
    with pytest.raises(Exception, match="abstract GPU"):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert [call.name for call in lower_kernel(LLAMA8B, 1, 1, 64)] == ["ragged_paged_attention_decode"]
    assert [call.name for call in lower_kernel(LLAMA8B, 64, 16, 64)] == [
        "ragged_paged_attention_decode", "ragged_paged_attention_prefill"]


@pytest.mark.parametrize(
    "num_tokens, num_seqs, width, grids",
    [
        # Decode tiles in a launch of their own (5 programs an SM: 96 registers, 45 KiB), the prefill tiles'
        # after it (3 an SM) where a bucket can hold a prefill. Split-KV per launch, from 2k tokens of
        # context: the fewest splits (powers of two, 512+ tokens each) within 5% of the least time, a
        # launch taking as many waves over the 132 SMs as its programs fill, each wave one program's share
        # of the context and a fixed cost (`choose_num_splits`): a batch of 1 splits as far as shares of
        # 512 tokens, 32 decodes at 2k (256 programs, 0.4 of a wave) 2 ways, 128 at 128k 8 ways.
        (1, 1, 64, [(1, 8, 1)]),
        (1, 1, 256, [(1, 8, 8)]),
        (1, 1, 8192, [(1, 8, 64)]),
        (8, 8, 512, [(8, 8, 8), (1, 8, 16)]),
        (32, 32, 128, [(32, 8, 2), (8, 8, 4)]),
        (32, 32, 64, [(32, 8, 1), (8, 8, 1)]),
        (128, 128, 64, [(128, 8, 1), (33, 8, 1)]),
        (128, 128, 8192, [(128, 8, 8), (33, 8, 16)]),
        (256, 256, 256, [(256, 8, 2), (67, 8, 2)]),
        # mixed and prefill: a decode tile per sequence; 64-row prefill tiles of 16 tokens, plus at most one
        # partial tile per sequence long enough to take them.
        (512, 64, 128, [(64, 8, 1), (96, 8, 1)]),
        (2048, 1, 128, [(1, 8, 4), (129, 8, 1)]),
        (2048, 256, 512, [(256, 8, 2), (384, 8, 1)]),
    ],
    ids=["decode-1", "decode-1-4k", "decode-1-128k", "decode-8-8k", "decode-32-2k", "decode-32-1k", "decode-128",
         "decode-128-128k", "decode-256-4k", "mixed-512", "prefill-2048", "mixed-2048-256"],
)
def test_llama8b_kernel_launch_grids_warps_and_stages(num_tokens, num_seqs, width, grids):
    calls = lower_kernel(ENGINE_LLAMA8B, num_tokens, num_seqs, width)
    assert [call.grid for call in calls] == grids == ENGINE_LLAMA8B.expected_grids(num_tokens, num_seqs, width)
    assert all((call.num_warps, call.num_stages) == (4, 3) for call in calls)
    # q as rows of (token, head in group) per KV head, plus one prefill tile of slack (a decode tile's where a
    # bucket of at most 4 tokens cannot hold a prefill); the cache flattened to blocks.
    slack = 16 if num_tokens <= 4 else 64
    for call in calls:
        assert call.operand_types[4] == f"tensor<8x{num_tokens * 4 + slack}x128xbf16>"
        assert call.operand_types[5] == f"tensor<{32 * 8 * (num_seqs * width + 1)}x16x128xbf16>"


def lower_and_check_launch(variant: KernelVariant, num_tokens: int, num_seqs: int, width: int):
    """The kernel's launches, checked for the variant's grids, warps, stages and padded q operand."""
    calls = lower_kernel(variant, num_tokens, num_seqs, width)
    launches = variant.launches(num_tokens, num_seqs, width)
    assert [call.grid for call in calls] == variant.expected_grids(num_tokens, num_seqs, width)
    rows = num_tokens * variant.group + spare_rows(variant, num_tokens, num_seqs)
    dtype = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[variant.dtype]
    for call, launch in zip(calls, launches, strict=True):
        assert (call.num_warps, call.num_stages) == (launch.num_warps, variant.num_stages)
        assert variant.num_warps in (None, launch.num_warps)
        assert call.operand_types[4] == f"tensor<{variant.num_kv_heads}x{rows}x{variant.head_dim}x{dtype}>"
    return calls


@pytest.mark.parametrize("variant", KERNEL_VARIANTS, ids=lambda v: v.name)
def test_every_kernel_variant_lowers_with_its_tiles_warps_and_stages(variant):
    for call in lower_and_check_launch(variant, 256, 32, 32):
        assert re.search(r"tt\.dot", call.ir_text())  # the two matmuls reach Triton as dots (tensor cores)


@pytest.mark.parametrize("variant", PREFILL_TILE_VARIANTS, ids=lambda v: v.name)
def test_prefill_tile_variants_lower_with_both_tile_classes(variant):
    """A bucket that can hold a prefill launches both classes, each its own kernel: the decode launch a
    16-row tile's two dots, the prefill launch a prefill tile's."""
    decode, prefill = lower_and_check_launch(variant, 512, 64, 128)
    assert spare_rows(variant, 512, 64) == variant.prefill_block_m  # q padded for a whole prefill tile
    dots = lambda call: sorted(map(int, re.findall(r"tt\.dot %\S+, %\S+, %\S+.*-> tensor<(\d+)x", call.ir_text())))  # noqa: E731
    assert dots(decode) == [16, 16]
    assert dots(prefill) == [variant.prefill_block_m, variant.prefill_block_m]


def test_a_window_adds_one_i32_operand_after_the_cache_and_no_window_adds_nothing():
    """The sliding window reaches each launch as an i32[1] after the cache (the operands before it keep
    their places); without one the launches have exactly the operands they had before windows existed."""
    windowed = dataclasses.replace(ENGINE_LLAMA8B, window=True)
    plain_calls, window_calls = (lower_and_check_launch(v, 512, 64, 128) for v in (ENGINE_LLAMA8B, windowed))
    for plain, window in zip(plain_calls, window_calls, strict=True):
        assert plain.operand_types[:7] == window.operand_types[:7]
        assert window.operand_types[7] == "tensor<1xi32>"
        assert plain.operand_types[7:] == window.operand_types[8:]  # the prefill launch's aliased output
        assert "tensor<1xi32>" not in plain.operand_types[3:]


def test_softcap_none_lowers_exactly_the_program_without_it_and_a_cap_adds_no_operand():
    """softcap=None is the kernel as it was before soft-capping existed: the same lowered module, text for text.
    A cap is static: no operand, and one tanh (libdevice's) in each launch's kernel."""
    plain = lower_for_gpu(ENGINE_LLAMA8B.kernel(), *ENGINE_LLAMA8B.args(512, 64, 128))
    explicit_none = lower_for_gpu(functools.partial(ENGINE_LLAMA8B.kernel(), softcap=None),
                                  *ENGINE_LLAMA8B.args(512, 64, 128))
    assert plain.as_text() == explicit_none.as_text()
    capped = dataclasses.replace(ENGINE_LLAMA8B, softcap=50.0)
    plain_calls, capped_calls = triton_calls(plain), lower_and_check_launch(capped, 512, 64, 128)
    for call, cap in zip(plain_calls, capped_calls, strict=True):
        assert call.operand_types == cap.operand_types
        assert "tanh" not in call.ir_text()
        assert cap.ir_text().count("__nv_tanhf") == 1


@pytest.mark.parametrize("variant", [GEMMA2_9B, GEMMA3_4B], ids=lambda v: v.name)
@pytest.mark.parametrize(
    "num_tokens, num_seqs, width",
    [(1, 1, 64), (1, 1, 512), (32, 32, 256), (256, 256, 256), (512, 64, 128), (2048, 256, 512)],
    ids=["decode-1", "decode-1-8k", "decode-32-4k", "decode-256-4k", "mixed-512", "mixed-2048-256"],
)
def test_head_dim_256_launches_take_16_key_tiles_and_8_warps_for_prefill_tiles(variant, num_tokens, num_seqs, width):
    """Gemma's head dim 256 keeps the query tiles (16-row decode, 64-row prefill: at group 2, 8 and 32
    tokens) and takes the kernel's own KV tile and warps for it: 16 keys a KV tile, 4 warps for the decode
    launch and 8 for the prefill launch, whose 64 x 256 accumulator spills at 4."""
    calls = lower_and_check_launch(variant, num_tokens, num_seqs, width)
    assert [call.num_warps for call in calls] == [4, 8][: len(calls)]
    plan = variant.tile_plan(num_tokens, num_seqs)
    assert (plan.pages_per_tile * variant.block_size, plan.decode_tokens) == (16, 8)
    assert plan.prefill_tokens == (32 if len(plan.classes) == 2 else 8)
    assert all(call.operand_types[7] == "tensor<1xi32>" for call in calls)  # the window, after the cache


def lower_step(model: str, tensor_parallel_size: int, num_tokens: int, num_seqs: int, width: int):
    """forward_step (layer scan, K/V writes, the kernel, logits) for `model` on an abstract mesh of H200s."""
    backend, args, mesh = step_args(model, tensor_parallel_size, num_tokens, num_seqs, width)
    return lower_for_gpu(forward_step, backend, *args, mesh=mesh)


def step_args(model: str, tensor_parallel_size: int, num_tokens: int, num_seqs: int, width: int):
    """(the xla backend over the pallas kernel, forward_step's abstract arguments, the mesh)."""
    cfg = preset(model)
    mesh = gpu_mesh(tensor_parallel_size, TP_AXIS)
    tp = TensorParallel(mesh) if tensor_parallel_size > 1 else None
    backend = Backend(cfg, pallas_form().with_mesh(mesh if tp else None))  # the xla backend, layers scanned
    graphdef, state = nnx.split(build_abstract_model(cfg))
    replicated = tp.replicated if tp else None
    if tp:
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, tp.params(state))
    params = nnx.to_pure_dict(state)
    rope_table = jax.ShapeDtypeStruct((2, 8192, cfg.head_dim // 2), jnp.float32, sharding=replicated)
    # As the xla backend prepares them: q/k/v and gate/up fused, grouped by device under TP.
    layers = jax.eval_shape(functools.partial(fuse_layer_weights, mesh=mesh if tp else None),
                            LayerWeights(**params["layers"]))
    weights = StepWeights(params["embed"], layers, params["final_norm"], params.get("lm_head"), rope_table)
    cache = jax.ShapeDtypeStruct(
        kv_cache_shape(cfg, num_seqs * width + 1, 16), jnp.bfloat16, sharding=tp.kv_cache if tp else None
    )
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)  # noqa: E731
    md = AttentionMetadata(i32(num_tokens), i32(num_seqs + 1), i32(num_seqs), i32(num_seqs, width), i32())
    return backend, (weights, KVCache(cache, cache), i32(num_tokens), i32(num_tokens), md, i32(num_seqs)), mesh


@pytest.mark.parametrize(
    "model, tensor_parallel_size, kv_heads_per_device, group",
    [("llama8b", 1, 8, 4), ("llama8b", 2, 4, 4), ("llama70b", 2, 4, 8), ("llama70b", 8, 1, 8)],
    ids=["llama8b", "llama8b-tp2", "llama70b-tp2", "llama70b-tp8"],
)
def test_whole_step_lowers_with_one_kernel_per_layer_scan_on_each_device(
    model, tensor_parallel_size, kv_heads_per_device, group
):
    num_tokens, num_seqs, width = 256, 64, 64
    lowered = lower_step(model, tensor_parallel_size, num_tokens, num_seqs, width)
    text = lowered.as_text()
    assert f"mhlo.num_partitions = {tensor_parallel_size}" in text  # one SPMD program for every device
    assert "@jaxcb_" not in text  # none of the C++ CPU kernels (the KV write is one on a CPU host)
    # The layers are scanned: the kernel's two launches in the loop body, each once per layer.
    calls = triton_calls(lowered)
    cfg = preset(model)
    variant = KernelVariant(model, kv_heads_per_device * group, kv_heads_per_device, num_layers=cfg.num_layers,
                            num_stages=3)
    assert [call.grid for call in calls] == variant.expected_grids(num_tokens, num_seqs, width)
    blocks = cfg.num_layers * kv_heads_per_device * (num_seqs * width + 1)
    for call in calls:
        assert (call.num_warps, call.num_stages) == (4, 3)
        # Each device sees its own share: query rows of its KV heads (+ a 64-row prefill tile of slack), and the
        # cache blocks of its heads.
        assert call.operand_types[4] == f"tensor<{kv_heads_per_device}x{num_tokens * group + 64}x128xbf16>"
        assert call.operand_types[5] == f"tensor<{blocks}x16x128xbf16>"


def test_the_engines_step_lowers_for_every_llama8b_bucket():
    """The runner's step as the engine compiles it (two executables: the model, then sampling), at each
    token bucket of a 2,048-token budget and 256 sequences, on an abstract 8B model: one kernel, no CPU
    kernel."""
    from jaxcb.backends import select_backend
    from jaxcb.config import compose_config
    from jaxcb.runner import ModelRunner, make_buckets
    from jaxcb.runner.buckets import BucketKey
    from jaxcb.sampling import StepVariant

    cfg = compose_config(["model=llama8b", "model.init=random", "scheduler.max_num_seqs=256",
                          "scheduler.max_num_batched_tokens=2048", "engine.max_model_len=8192"])
    model = build_abstract_model(preset("llama8b"))
    backend = select_backend(cfg.model, preset("llama8b"), cfg.attention, platform="gpu")  # as on a GPU host
    assert (backend.name, backend.attention.name, backend.unroll_layers) == ("xla", "pallas", False)
    width = 8192 // 16
    cache = jax.ShapeDtypeStruct(kv_cache_shape(preset("llama8b"), 256 * width + 1, 16), jnp.bfloat16)
    buckets = make_buckets(cfg.engine, cfg.scheduler, width, "pallas", platform="gpu")
    runner = ModelRunner(backend.prepare(model, 8192), backend, KVCache(cache, cache), buckets, max_model_len=8192,
                         max_logprobs=5, max_stop_token_ids=8)
    assert [b.num_tokens for b in buckets.all()] == [16, 32, 64, 128, 256, 512, 1024, 2048]

    first = buckets.all()[0]
    keys = [BucketKey(*b, StepVariant.GREEDY) for b in buckets.all()]
    keys += [BucketKey(*first, v) for v in StepVariant if v != StepVariant.GREEDY]
    def lowered(part):
        fn, args = runner.traceable(part)
        return lower_for_gpu(fn, *args)

    for key in keys:
        model = lowered(key.model)
        assert [call.grid for call in triton_calls(model)] == ENGINE_LLAMA8B.expected_grids(
            key.num_tokens, key.num_seqs, key.table_width), key
        sampler = lowered(key.sampler)
        assert not triton_calls(sampler), key  # the attention kernel runs in the model's executable only
        assert "@jaxcb_" not in model.as_text() and "@jaxcb_" not in sampler.as_text()


def _primitives(jaxpr, inside_scan: bool = False, found=None) -> dict[bool, set[str]]:
    """Primitive names of a jaxpr, split by whether they run inside a scan (the layer loop)."""
    found = found if found is not None else {False: set(), True: set()}
    for eqn in jaxpr.eqns:
        found[inside_scan].add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub, inside_scan or eqn.primitive.name == "scan", found)
    return found


def test_the_kernels_tile_table_is_built_once_per_step_outside_the_layer_scan():
    backend, args, _ = step_args("llama8b", 1, 256, 64, 64)
    jaxpr = jax.make_jaxpr(functools.partial(forward_step, backend))(*args)
    found = _primitives(jaxpr.jaxpr)
    assert "cumsum" in found[False]  # the tile table's running count of tiles per sequence: once
    assert "cumsum" not in found[True] and "pallas_call" in found[True]  # every layer only reads it
