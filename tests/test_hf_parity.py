"""Logits of the jaxcb Llama equal transformers' LlamaForCausalLM on the same checkpoint."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from hf_checkpoints import LLAMA3_ROPE_SCALING, make_hf_llama
from benchmarks.reference_generate import SingleSequence
from jaxcb.backends import select_backend
from jaxcb.config import AttentionConfig, ModelConfig
from jaxcb.kernels.attention import select_attention
from jaxcb.backends.base import Backend
from jaxcb.model.loader import load_model

ATTENTION = {
    "xla": AttentionConfig(impl="xla"),
    "cpu": AttentionConfig(impl="cpu"),
    "reference": AttentionConfig(impl="reference"),
    "pallas-interpret": AttentionConfig(impl="pallas", interpret=True),
}

PROMPTS = [[1, 5, 9, 77, 3], [1] + list(range(10, 47)), [1, 130, 129, 4, 4, 4, 4, 8, 100, 64, 33, 21, 17]]


def hf_model_config(path) -> ModelConfig:
    return ModelConfig(name="hf", checkpoint=str(path), init="checkpoint", dtype="float32")


def jax_logits(model, prompt, chunk=None, block_size=8, backend=None):
    seq = SingleSequence(model, num_blocks_needed=-(-len(prompt) // block_size), block_size=block_size,
                         cache_dtype=np.float32, backend=backend)
    chunk = chunk or len(prompt)
    return np.concatenate([seq.extend(prompt[i : i + chunk], all_logits=True) for i in range(0, len(prompt), chunk)])


def hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(rope_scaling=LLAMA3_ROPE_SCALING),
        dict(tie_word_embeddings=True),
        dict(shards=3),
    ],
    ids=["gqa", "llama3-rope-scaling", "tied-embeddings", "sharded-safetensors"],
)
def test_logits_match_transformers_in_fp32(tmp_path, variant):
    hf = make_hf_llama(str(tmp_path), **variant)
    model, cfg = load_model(hf_model_config(tmp_path))
    assert cfg.tie_word_embeddings == variant.get("tie_word_embeddings", False)
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in variant)
    for prompt in PROMPTS:
        diff = np.abs(jax_logits(model, prompt) - hf_logits(hf, prompt)).max()
        assert diff <= 1e-4, f"max |logits diff| {diff} for prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_every_attention_form_matches_transformers(tmp_path, impl):
    hf = make_hf_llama(str(tmp_path), rope_scaling=LLAMA3_ROPE_SCALING)
    model, cfg = load_model(hf_model_config(tmp_path))
    backend = Backend(cfg, select_attention(ATTENTION[impl]))
    assert backend.attention.name == impl
    for prompt in PROMPTS[:2]:
        diff = np.abs(jax_logits(model, prompt, backend=backend) - hf_logits(hf, prompt)).max()
        assert diff <= 1e-4, f"{impl}: max |logits diff| {diff}"


@pytest.mark.parametrize("name", ["xla", "cpu"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_backend_matches_transformers(tmp_path, name, tied):
    hf = make_hf_llama(str(tmp_path), tie_word_embeddings=tied)
    m = hf_model_config(tmp_path)
    model, cfg = load_model(m)
    m.backend, m.layer_loop = name, "unrolled"
    backend = select_backend(m, cfg, AttentionConfig())
    assert backend.name == name
    for prompt in PROMPTS[:2]:
        diff = np.abs(jax_logits(model, prompt, backend=backend) - hf_logits(hf, prompt)).max()
        assert diff <= 1e-4, f"{name}: max |logits diff| {diff}"


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunks")
    make_hf_llama(str(path))
    model, _ = load_model(hf_model_config(path))
    prompt = PROMPTS[1]
    return model, prompt, jax_logits(model, prompt)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(1, 40), block_size=st.sampled_from([8, 16]))
def test_prefill_in_chunks_of_any_size_gives_the_same_logits(tiny_hf_model, chunk, block_size):
    model, prompt, full = tiny_hf_model
    np.testing.assert_allclose(jax_logits(model, prompt, chunk=chunk, block_size=block_size), full, atol=1e-5, rtol=0)


def test_chunked_prefill_then_decode_matches_one_full_forward(tmp_path):
    make_hf_llama(str(tmp_path), rope_scaling=LLAMA3_ROPE_SCALING)
    model, _ = load_model(hf_model_config(tmp_path))
    prompt = PROMPTS[1]
    full = jax_logits(model, prompt)
    # Chunks of 5 that end mid-block, then single-token decode steps for the last 6 tokens.
    seq = SingleSequence(model, num_blocks_needed=-(-len(prompt) // 8), block_size=8, cache_dtype=np.float32)
    pieces = [seq.extend(prompt[i : min(i + 5, len(prompt) - 6)], all_logits=True) for i in range(0, len(prompt) - 6, 5)]
    pieces += [seq.extend([t], all_logits=True) for t in prompt[-6:]]
    np.testing.assert_allclose(np.concatenate(pieces), full, atol=1e-5, rtol=0)


def test_rope_scaling_changes_logits_at_long_positions(tmp_path):
    """The llama3 variant really exercises the scaled frequencies (the parity test would not see a no-op)."""
    plain = make_hf_llama(str(tmp_path / "a"))
    scaled = make_hf_llama(str(tmp_path / "b"), rope_scaling=LLAMA3_ROPE_SCALING)
    prompt = PROMPTS[1]
    assert np.abs(hf_logits(plain, prompt) - hf_logits(scaled, prompt)).max() > 1e-3
