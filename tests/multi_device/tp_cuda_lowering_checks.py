"""A tensor-parallel (TP=2) llama8b step with the Pallas kernel lowers for CUDA, from a machine without a GPU.

Run by tests/test_cuda_lowering.py in a subprocess with fake CPU devices: the mesh is made
of CPU devices, but lowering only needs its shape. `jax.export` would refuse the module
(the Triton custom call has no compatibility guarantee, with or without TP), so this uses
`.lower(lowering_platforms=("cuda",))` as the one-device checks do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxcb.attention import AttentionBackend, AttentionMetadata
from jaxcb.kv_cache import KVCache, kv_cache_shape
from jaxcb.model.config import LlamaConfig, RopeScaling
from jaxcb.model.llama import build_abstract_model
from jaxcb.reference_generate import forward_step
from jaxcb.sharding import TP_AXIS, TensorParallel
from pallas_kernels import ragged_paged_attention

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2")

LLAMA8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=131072, tie_word_embeddings=False,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), dtype="bfloat16",
)


def test_tp2_llama8b_step_lowers_for_cuda_with_the_kernel_per_shard():
    tp = TensorParallel(Mesh(np.asarray(jax.devices()[:2]), (TP_AXIS,)))
    backend = AttentionBackend("pallas", ragged_paged_attention, tp.mesh)
    graphdef, state = nnx.split(build_abstract_model(LLAMA8B, backend))
    state = jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state, tp.params(state)
    )
    num_tokens, num_seqs, width = 256, 64, 64
    cache = jax.ShapeDtypeStruct(kv_cache_shape(LLAMA8B, num_seqs * width + 1, 16), jnp.bfloat16, sharding=tp.kv_cache)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=tp.replicated)  # noqa: E731
    md = AttentionMetadata(i32(num_tokens), i32(num_seqs + 1), i32(num_seqs), i32(num_seqs, width), i32())
    traced = forward_step.trace(graphdef, state, KVCache(cache, cache), i32(num_tokens), i32(num_tokens), md, i32(num_seqs))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_paged_attention" in text and "triton" in text.lower()
    assert "mhlo.num_partitions = 2" in text  # one SPMD program for both devices
    # The kernel sees one device's share: query rows of 4 KV heads (256 tokens x group 4 + a 16-row
    # tile of slack), and the cache blocks of 32 layers x 4 KV heads, not 8.
    kernel_call = next(line for line in text.splitlines() if "custom_call" in line and "triton" in line)
    num_blocks = num_seqs * width + 1
    assert "tensor<4x1040x128xbf16>" in kernel_call
    assert f"tensor<{32 * 4 * num_blocks}x16x128xbf16>" in kernel_call
