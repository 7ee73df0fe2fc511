"""GGUF files of Qwen2, Qwen3 and Mistral, written as llama.cpp's convert script writes them, load as the
model transformers' own GGUF loader builds from the same file: each family's own tensors under
llama.cpp's names, q/k rows un-permuted for llama (Mistral) only, a window on every layer from
{arch}.attention.sliding_window; Qwen's byte-level BPE splits text as transformers' GGUF tokenizer
does; and a GGUF converted to an HF directory is the same family there."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from gguf_checkpoints import hf_state_dict, write_gguf
from hf_checkpoints import TINY_HF, make_hf_family, make_hf_llama
from test_hf_parity import PROMPTS, hf_logits, jax_logits
from jaxcb.config import ModelConfig
from jaxcb.model.config import read_hf_config
from jaxcb.model.gguf import read_gguf_config
from jaxcb.model.gguf_to_hf import convert_gguf_to_hf
from jaxcb.model.loader import CheckpointError, load_model
from jaxcb.tokenizer import load_tokenizer

FAMILIES = ["qwen2", "qwen3", "mistral"]
NO_WINDOW = {"qwen2": dict(use_sliding_window=False), "qwen3": dict(use_sliding_window=False),
             "mistral": dict(sliding_window=None)}
# A GGUF holds one window for every layer: Qwen's window from the first layer on.
EVERY_LAYER_WINDOW = {"qwen2": dict(max_window_layers=0), "qwen3": dict(max_window_layers=0), "mistral": {}}
# Qwen's byte-level BPE is split by llama.cpp's "qwen2" (Mistral's SentencePiece, refused, is test_gguf.py's).
PRE_TOKENIZER = {"qwen2": "qwen2", "qwen3": "qwen2", "mistral": "gpt-2"}


def model_config(path) -> ModelConfig:
    return ModelConfig(name="hf", checkpoint=str(path), init="checkpoint", dtype="float32")


def transformers_from_gguf(path):
    """transformers' model built by its own GGUF loader from the file (not from the HF directory beside it)."""
    from transformers import AutoModelForCausalLM

    # transformers' GGUF reader leaves qwen3.attention.key_length unread and takes Qwen3Config's
    # head_dim of 128; the tiny model's is 8.
    extra = dict(head_dim=TINY_HF["head_dim"]) if read_gguf_config(path)["architecture"] == "qwen3" else {}
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, **extra).eval()


def write_family_gguf(directory, family: str, windowed: bool):
    """(the GGUF's path, the transformers model it holds) for a random `family` model saved to directory."""
    hf = make_hf_family(str(directory), family, **(EVERY_LAYER_WINDOW if windowed else NO_WINDOW)[family])
    with open(directory / "config.json") as f:
        config = json.load(f)
    return write_gguf(str(directory / f"{family}.gguf"), hf_state_dict(hf), config, pre=PRE_TOKENIZER[family]), hf


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """(family, windowed) -> (the GGUF's path, the transformers model it was written from)."""
    return {(family, windowed): write_family_gguf(tmp_path_factory.mktemp(f"{family}-{windowed}"), family, windowed)
            for family in FAMILIES for windowed in (False, True)}


@pytest.mark.parametrize("windowed", [False, True], ids=["no-window", "window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_gives_the_architecture_of_its_hf_directory(ggufs, family, windowed):
    path, _ = ggufs[family, windowed]
    _, gguf_cfg = load_model(model_config(path))
    _, hf_cfg = load_model(model_config(os.path.dirname(path)))
    # A Mistral without a window is a Llama: llama.cpp writes both as llama, and their forward is the same.
    expected = "llama" if family == "mistral" and not windowed else family
    assert gguf_cfg == dataclasses.replace(hf_cfg, architecture=expected)
    assert gguf_cfg.sliding_window > 0 if windowed else gguf_cfg.sliding_window == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_loading_the_same_gguf(ggufs, family):
    path, _ = ggufs[family, False]
    model, _ = load_model(model_config(path))
    theirs = transformers_from_gguf(path)
    for prompt in PROMPTS:
        diff = np.abs(jax_logits(model, prompt) - hf_logits(theirs, prompt)).max()
        assert diff <= 1e-4, f"{family}: max |logits diff| {diff} for a prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_window_a_gguf_states_is_applied(ggufs, family):
    """transformers' GGUF reader drops {arch}.attention.sliding_window, so the reference is the model the
    file was written from; the long prompt passes the window, where the window-less model differs."""
    path, windowed = ggufs[family, True]
    model, _ = load_model(model_config(path))
    for prompt in PROMPTS:
        diff = np.abs(jax_logits(model, prompt) - hf_logits(windowed, prompt)).max()
        assert diff <= 1e-4, f"{family}: max |logits diff| {diff} for a prompt of {len(prompt)} tokens"
    assert np.abs(hf_logits(transformers_from_gguf(path), PROMPTS[1]) - hf_logits(windowed, PROMPTS[1])).max() > 1e-3


def test_qwen_gguf_tokenizer_splits_text_as_transformers_does(ggufs):
    from transformers import AutoTokenizer

    path, _ = ggufs["qwen2", False]
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ["the cat  in the hat", "then\n\n  an answer, 12345!", "  a\n b  \n\nc ?", "<think>the</s> 45 123"]:
        assert ours.encode(text) == theirs.encode(text), text
    assert [ours.decode([i]) for i in ours.encode("a 123")] == ["a", " ", "1", "2", "3"]  # digits one by one


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_gguf_is_the_same_family_in_its_hf_directory(ggufs, tmp_path, family):
    from transformers import AutoModelForCausalLM

    path, hf = ggufs[family, True]
    out = convert_gguf_to_hf(path, str(tmp_path / "hf"), "float32")
    keys = ("architecture", "qkv_bias", "qk_norm", "sliding_window", "layer_types")
    assert {k: read_hf_config(out)[k] for k in keys} == {k: read_gguf_config(path)[k] for k in keys}
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(converted).__name__ == type(hf).__name__
    np.testing.assert_allclose(hf_logits(converted, PROMPTS[1]), hf_logits(hf, PROMPTS[1]), atol=1e-5)


def test_tensors_of_another_family_are_named_as_the_gguf_names_them(ggufs, tmp_path):
    """A qwen2 file of Llama's tensors lacks its biases; a llama file of Qwen3's has q/k norms to spare."""
    llama = make_hf_llama(str(tmp_path / "llama"))
    with open(tmp_path / "llama" / "config.json") as f:
        config = json.load(f)
    path = write_gguf(str(tmp_path / "q.gguf"), hf_state_dict(llama), config, arch="qwen2")
    with pytest.raises(CheckpointError, match="missing tensor blk.0.attn_q.bias.*missing tensor blk.0.attn_v.bias"):
        load_model(model_config(path))
    _, qwen3 = ggufs["qwen3", False]
    path = write_gguf(str(tmp_path / "l.gguf"), hf_state_dict(qwen3), qwen3.config.to_dict(), arch="llama")
    with pytest.raises(CheckpointError, match="unexpected tensor blk.0.attn_k_norm.weight"):
        load_model(model_config(path))
