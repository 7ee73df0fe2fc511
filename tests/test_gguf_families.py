"""GGUF files of Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3, written as llama.cpp's convert script writes
them, load as the model transformers' own GGUF loader builds from the same file: each family's own
tensors under llama.cpp's names, q/k rows un-permuted for llama (Mistral) only, Gemma's norms (stored
as 1 + w) read as w, a window on every layer from {arch}.attention.sliding_window (Gemma's on the
layers llama.cpp windows); Qwen's byte-level BPE splits text as transformers' GGUF tokenizer does; and a
GGUF converted to an HF directory is the same family there."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from gguf_checkpoints import hf_state_dict, write_gguf
from hf_checkpoints import TINY_HF, make_hf_family, make_hf_llama
from test_hf_parity import PROMPTS, hf_logits, jax_logits
from jaxcb.config import ConfigError, ModelConfig
from jaxcb.model.config import read_hf_config
from jaxcb.model.gguf import GGUFCheckpoint, read_gguf_config
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


# What transformers' GGUF reader leaves unread, taking its config class's default: qwen3.attention.key_length
# (Qwen3Config's head_dim of 128), Gemma 2's caps, Gemma 3's rope bases and scaling, and query_pre_attn_scalar
# (256, which llama.cpp does not assume). Passed from the model the file was written from.
UNREAD_BY_TRANSFORMERS = {
    "qwen3": ("head_dim",),
    "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
    "gemma3_text": ("query_pre_attn_scalar", "rope_parameters"),
}


def transformers_from_gguf(path, written_from):
    """transformers' model built by its own GGUF loader from the file (not from the HF directory beside it)."""
    from transformers import AutoModelForCausalLM

    config = written_from.config
    extra = {key: getattr(config, key) for key in UNREAD_BY_TRANSFORMERS.get(config.model_type, ())}
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
    path, hf = ggufs[family, False]
    model, _ = load_model(model_config(path))
    theirs = transformers_from_gguf(path, hf)
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
    theirs = transformers_from_gguf(path, windowed)
    assert np.abs(hf_logits(theirs, PROMPTS[1]) - hf_logits(windowed, PROMPTS[1])).max() > 1e-3


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


# The tiny Gemmas as a GGUF can hold them: llama.cpp's converter writes no query_pre_attn_scalar (llama.cpp
# takes the head size) and no layer pattern (gemma3's: five windowed layers of six).
GEMMA_FAMILIES = ["gemma2", "gemma3"]
AS_LLAMA_CPP_ASSUMES = {"gemma2": dict(query_pre_attn_scalar=TINY_HF["head_dim"]),
                        "gemma3": dict(query_pre_attn_scalar=TINY_HF["head_dim"], num_hidden_layers=6,
                                       sliding_window_pattern=6)}


def write_gemma_gguf(directory, family: str):
    hf = make_hf_family(str(directory), family, **AS_LLAMA_CPP_ASSUMES[family])
    with open(directory / "config.json") as f:
        config = json.load(f)
    return write_gguf(str(directory / f"{family}.gguf"), hf_state_dict(hf), config), hf


@pytest.fixture(scope="module")
def gemma_ggufs(tmp_path_factory):
    """family -> (the GGUF's path, the transformers model it was written from)."""
    return {family: write_gemma_gguf(tmp_path_factory.mktemp(family), family) for family in GEMMA_FAMILIES}


def without_dtype(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "checkpoint_dtype"}  # a GGUF's is per tensor


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_gemma_gguf_gives_the_config_of_its_hf_directory(gemma_ggufs, family):
    path, _ = gemma_ggufs[family]
    assert read_gguf_config(path) == without_dtype(read_hf_config(os.path.dirname(path)))
    _, gguf_cfg = load_model(model_config(path))
    _, hf_cfg = load_model(model_config(os.path.dirname(path)))
    assert gguf_cfg == hf_cfg
    assert gguf_cfg.layer_windows == ((7, 0, 7) if family == "gemma2" else (7, 7, 7, 7, 7, 0))
    assert (gguf_cfg.rope_scaling is not None, gguf_cfg.rope_local_theta) == (
        (False, 0.0) if family == "gemma2" else (True, 100.0))


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_gemma_gguf_tensors_are_the_hf_tensors_with_norms_as_w(gemma_ggufs, family):
    from gguf import GGUFReader

    path, hf = gemma_ggufs[family]
    state = hf_state_dict(hf)
    checkpoint = GGUFCheckpoint(path, TINY_HF["num_attention_heads"], TINY_HF["num_key_value_heads"])
    assert set(checkpoint.tensors) == set(state)
    for name, value in state.items():
        np.testing.assert_allclose(checkpoint.read(name), value, rtol=0, atol=2e-7, err_msg=name)
    names = {hf: info.gguf_name for hf, info in checkpoint.tensors.items()}
    assert [names[f"model.layers.1.{n}.weight"] for n in ("post_attention_layernorm", "pre_feedforward_layernorm",
                                                          "post_feedforward_layernorm")] == \
        ["blk.1.post_attention_norm.weight", "blk.1.ffn_norm.weight", "blk.1.post_ffw_norm.weight"]
    stored = {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}
    mlp_norm = state["model.layers.1.pre_feedforward_layernorm.weight"]
    np.testing.assert_allclose(stored["blk.1.ffn_norm.weight"], 1 + mlp_norm, rtol=1e-6)  # as llama.cpp stores it


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_gemma_logits_match_the_hf_model_and_transformers_loading_the_same_gguf(gemma_ggufs, family):
    path, hf = gemma_ggufs[family]
    model, _ = load_model(model_config(path))
    theirs = transformers_from_gguf(path, hf)
    for prompt in PROMPTS:  # the long one passes the window
        ours = jax_logits(model, prompt)
        for reference, torch_model in (("the HF model", hf), ("transformers' GGUF model", theirs)):
            diff = np.abs(ours - hf_logits(torch_model, prompt)).max()
            assert diff <= 1e-4, f"{family}: max |logits diff| {diff} from {reference}, a prompt of {len(prompt)} tokens"


def test_what_llama_cpp_leaves_out_of_a_gemma_gguf_is_what_it_assumes(gemma_ggufs, tmp_path):
    """Gemma 3's windowed layers' base when an older converter leaves freq_base_swa out; Gemma 2's caps and
    window; the 27B models' query scale, hidden_size / num_heads (a metadata-only file of 46 / 62 layers)."""
    _, gemma3 = gemma_ggufs["gemma3"]
    path = write_gguf(str(tmp_path / "old.gguf"), {}, gemma3.config.to_dict(), omit=("{arch}.rope.freq_base_swa",))
    assert read_gguf_config(path)["rope_local_theta"] == 10000.0
    _, gemma2 = gemma_ggufs["gemma2"]
    omit = ("{arch}.attn_logit_softcapping", "{arch}.final_logit_softcapping", "{arch}.attention.sliding_window")
    config = read_gguf_config(write_gguf(str(tmp_path / "bare.gguf"), {}, gemma2.config.to_dict(), omit=omit))
    assert (config["attn_logit_softcap"], config["final_logit_softcap"], config["sliding_window"]) == (50.0, 30.0, 4096)
    first_six = {"gemma2": ["sliding_attention", "full_attention"] * 3,
                 "gemma3": ["sliding_attention"] * 5 + ["full_attention"]}
    for family, hf, num_layers in (("gemma2", gemma2, 46), ("gemma3", gemma3, 62)):
        big = dict(hf.config.to_dict(), num_hidden_layers=num_layers, hidden_size=60)  # 60 / 6 heads: not the head size
        config = read_gguf_config(write_gguf(str(tmp_path / f"{num_layers}.gguf"), {}, big))
        assert (config["query_pre_attn_scalar"], config["head_dim"]) == (10.0, TINY_HF["head_dim"])
        assert config["layer_types"][:6] == first_six[family]


@pytest.mark.parametrize(
    "family, metadata, omit, message",
    [
        ("gemma3", {"gemma3.rope.scaling.type": "yarn"}, (), "gemma3.rope.scaling.type='yarn' is not supported.*linear"),
        ("gemma3", {"gemma3.attention.sliding_window_pattern": 2}, (), "sliding_window_pattern=2 is not understood"),
        ("gemma3", {}, ("{arch}.attention.sliding_window",), "gemma3.attention.sliding_window is missing"),
        ("gemma2", {"gemma2.rope.scaling.type": "linear"}, (), "gemma2.rope.scaling.type='linear' is not supported"),
    ],
    ids=["gemma3-yarn", "gemma3-pattern", "gemma3-no-window", "gemma2-linear"],
)
def test_gemma_metadata_jaxcb_does_not_read_is_refused_by_name(gemma_ggufs, tmp_path, family, metadata, omit, message):
    _, hf = gemma_ggufs[family]
    path = write_gguf(str(tmp_path / "m.gguf"), {}, hf.config.to_dict(), metadata=metadata, omit=omit)
    with pytest.raises(CheckpointError, match=message):
        read_gguf_config(path)


def test_a_linear_rope_factor_that_is_not_positive_is_refused_naming_the_key(gemma_ggufs, tmp_path):
    _, hf = gemma_ggufs["gemma3"]
    path = write_gguf(str(tmp_path / "m.gguf"), {}, hf.config.to_dict(), metadata={"gemma3.rope.scaling.factor": -2.0})
    with pytest.raises(ConfigError, match=r"m\.gguf: gemma3\.rope\.scaling\.factor=-2\.0 must be > 0"):
        read_gguf_config(path)


def test_gemmas_keys_are_refused_in_another_architecture(ggufs, tmp_path):
    _, qwen2 = ggufs["qwen2", False]
    cap = {"qwen2.final_logit_softcapping": 30.0}
    path = write_gguf(str(tmp_path / "m.gguf"), {}, qwen2.config.to_dict(), metadata=cap)
    with pytest.raises(CheckpointError, match="qwen2.final_logit_softcapping=30.0 is not understood"):
        read_gguf_config(path)


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_converted_gemma_gguf_is_the_same_model_in_its_hf_directory(gemma_ggufs, tmp_path, family):
    from transformers import AutoModelForCausalLM

    path, hf = gemma_ggufs[family]
    out = convert_gguf_to_hf(path, str(tmp_path / "hf"), "float32")
    assert without_dtype(read_hf_config(out)) == read_gguf_config(path)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(converted).__name__ == type(hf).__name__
    np.testing.assert_allclose(hf_logits(converted, PROMPTS[1]), hf_logits(hf, PROMPTS[1]), atol=1e-5)
