"""Every kernel variant lowers for CUDA at the engine's llama8b shapes, on a machine without a GPU.

This catches shape and primitive restrictions of the Triton backend (power-of-two tiles,
unsupported ops); it does not compile PTX -- that needs a GPU (scripts/gpu_check.py).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import ragged_paged_attention

# llama8b: bf16, 32 query heads, 8 KV heads, head dim 128, 32 layers; block size 16.
NUM_LAYERS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 32, 8, 128


def lower_for_cuda(num_tokens, num_seqs, width, block_size=16, head_dim=HEAD_DIM, **kernel_kw):
    num_blocks = num_seqs * width + 1
    cache = jax.ShapeDtypeStruct((NUM_LAYERS, NUM_KV_HEADS, num_blocks, block_size, head_dim), jnp.bfloat16)
    args = (
        jax.ShapeDtypeStruct((num_tokens, NUM_Q_HEADS, head_dim), jnp.bfloat16),
        cache,
        cache,
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, width), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    fn = functools.partial(ragged_paged_attention, sm_scale=HEAD_DIM**-0.5, **kernel_kw)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "num_tokens, num_seqs, width",
    [(1, 1, 64), (128, 128, 64), (256, 256, 256), (512, 64, 128), (2048, 1, 128)],
    ids=["decode-1", "decode-128", "decode-256-4k", "mixed-512", "prefill-2048"],
)
def test_kernel_lowers_for_cuda_at_llama8b_shapes(num_tokens, num_seqs, width):
    text = lower_for_cuda(num_tokens, num_seqs, width)
    assert "ragged_paged_attention" in text and "triton" in text.lower()


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_lowers_for_cuda_for_every_block_size_and_head_dim(block_size, head_dim):
    assert "triton" in lower_for_cuda(64, 16, 16, block_size=block_size, head_dim=head_dim).lower()


@pytest.mark.parametrize("block_m, kv_tile", [(16, 16), (32, 64), (64, 128)])
def test_kernel_lowers_for_cuda_for_every_tile_configuration(block_m, kv_tile):
    assert "triton" in lower_for_cuda(256, 32, 32, block_m=block_m, kv_tile=kv_tile).lower()


def test_full_llama8b_step_lowers_for_cuda_with_the_pallas_kernel():
    """The whole jitted step (scan over 32 layers, K/V writes, kernel, logits) at 8B shapes, never allocated."""
    from flax import nnx

    from jaxcb.attention import AttentionBackend, AttentionMetadata
    from jaxcb.model.config import LlamaConfig, RopeScaling
    from jaxcb.model.llama import build_abstract_model
    from jaxcb.kv_cache import KVCache, kv_cache_shape
    from jaxcb.reference_generate import forward_step

    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), dtype="bfloat16",
    )
    graphdef, state = nnx.split(build_abstract_model(cfg, AttentionBackend("pallas", ragged_paged_attention)))
    num_tokens, num_seqs, width = 256, 64, 64
    cache_sds = jax.ShapeDtypeStruct(kv_cache_shape(cfg, num_seqs * width + 1, 16), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(num_tokens), i32(num_seqs + 1), i32(num_seqs), i32(num_seqs, width), i32())
    traced = forward_step.trace(
        graphdef, state, KVCache(cache_sds, cache_sds), i32(num_tokens), i32(num_tokens), md, i32(num_seqs)
    )
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_paged_attention" in text
    assert "@jaxcb_" not in text  # none of the C++ CPU kernels (the KV write is one on a CPU host)


def test_tensor_parallel_llama8b_step_lowers_for_cuda():
    """TP=2 with the kernel per shard (tests/multi_device/tp_cuda_lowering_checks.py), on two fake CPU devices."""
    from fake_devices import assert_all_passed, run_tests_on_fake_devices

    assert_all_passed(run_tests_on_fake_devices("tests/multi_device/tp_cuda_lowering_checks.py", num_devices=2))
