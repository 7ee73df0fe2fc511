"""The checkpoint door: what an HF directory says that jaxcb does not compute is refused by name, before
any weight is read; what it does compute matches transformers. config.json fields, weight files and
tokenizer files, each mutated from a tiny checkpoint."""

import json
import os

import pytest

from hf_checkpoints import TINY_HF
from jaxcb.config import ConfigError
from jaxcb.model.config import read_hf_config

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def write_config(path, family="llama", **fields):
    """config.json of TINY_HF's shapes for `family`, with `fields` (None: the key left out)."""
    os.makedirs(path, exist_ok=True)
    config = dict(TINY_HF, model_type=family, architectures=[ARCHITECTURES.get(family, "LlamaForCausalLM")])
    config.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f)
    return str(path)


# --- config.json --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(ARCHITECTURES))
@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_new"])
def test_an_activation_other_than_silu_is_refused_by_name(tmp_path, family, act):
    with pytest.raises(ConfigError, match=f"hidden_act='{act}'"):
        read_hf_config(write_config(tmp_path, family, hidden_act=act))


@pytest.mark.parametrize("act", ["silu", "swish", None])
def test_silu_under_either_name_or_left_out_is_served(tmp_path, act):
    assert read_hf_config(write_config(tmp_path, hidden_act=act))["architecture"] == "llama"


@pytest.mark.parametrize("quantization", [
    {"quant_method": "gptq", "bits": 4, "group_size": 128}, {"quant_method": "awq", "bits": 4},
    {"quant_method": "bitsandbytes", "load_in_4bit": True}, {"quant_method": "fp8", "activation_scheme": "dynamic"},
    {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"]}}},
])
def test_a_quantized_checkpoint_is_refused_naming_its_quant_method(tmp_path, quantization):
    with pytest.raises(ConfigError, match=f"quant_method='{quantization['quant_method']}'"):
        read_hf_config(write_config(tmp_path, quantization_config=quantization))


def test_a_quantized_multimodal_checkpoint_is_refused_though_its_text_config_does_not_say_so(tmp_path):
    text = {k: v for k, v in TINY_HF.items() if k not in ("bos_token_id", "eos_token_id")}
    write_config(tmp_path, "gemma3", architectures=["Gemma3ForConditionalGeneration"],
                 text_config=dict(text, model_type="gemma3_text"), quantization_config={"quant_method": "awq"},
                 **{k: None for k in text})
    with pytest.raises(ConfigError, match="quant_method='awq'"):
        read_hf_config(str(tmp_path))


def test_a_kv_cache_only_quantization_config_leaves_float_weights_served(tmp_path):
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {},
               "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    assert read_hf_config(write_config(tmp_path, quantization_config=kv_only))["architecture"] == "llama"


@pytest.mark.parametrize("architecture", ["LlamaForSequenceClassification", "LlamaModel", "LlamaForTokenClassification"])
def test_a_head_other_than_a_causal_lm_is_refused_by_its_class(tmp_path, architecture):
    """A reward model (LlamaForSequenceClassification) has a `score` head; served as a causal LM it
    would sample from logits its head never computed."""
    with pytest.raises(ConfigError, match=architecture):
        read_hf_config(write_config(tmp_path, architectures=[architecture]))


def test_a_config_with_neither_model_type_nor_architectures_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="neither model_type nor architectures"):
        read_hf_config(write_config(tmp_path, model_type=None, architectures=None))


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers"])
def test_a_missing_shape_key_is_named(tmp_path, key):
    with pytest.raises(ConfigError, match=f"has no {key}"):
        read_hf_config(write_config(tmp_path, **{key: None}))


@pytest.mark.parametrize("kv_heads", [4, 0])
def test_kv_heads_that_do_not_divide_the_heads_are_refused(tmp_path, kv_heads):
    with pytest.raises(ConfigError, match=f"num_key_value_heads={kv_heads}, which must divide num_attention_heads=6"):
        read_hf_config(write_config(tmp_path, num_key_value_heads=kv_heads))


@pytest.mark.parametrize("fields, named", [
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     "rope_parameters.partial_rotary_factor=0.25"),
])
def test_a_partial_rotary_embedding_is_refused(tmp_path, fields, named):
    with pytest.raises(ConfigError, match=named):
        read_hf_config(write_config(tmp_path, **fields))


def test_llama3_rope_scaling_without_its_frequency_factors_names_them(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}
    with pytest.raises(ConfigError, match="has no low_freq_factor, high_freq_factor"):
        read_hf_config(write_config(tmp_path, rope_scaling=rope))


def test_yarn_with_both_mscales_and_no_attention_factor_is_refused(tmp_path):
    """transformers scales cos/sin by the mscales' ratio (1.0 here), vLLM's Llama by 0.1 ln(factor) + 1."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1, "mscale_all_dim": 1}
    with pytest.raises(ConfigError, match="mscale=1, mscale_all_dim=1 without attention_factor"):
        read_hf_config(write_config(tmp_path, rope_scaling=yarn))
    cfg = read_hf_config(write_config(tmp_path, rope_scaling=dict(yarn, attention_factor=1.0)))
    assert cfg["rope_scaling"].attention_factor == 1.0


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_a_missing_rms_norm_eps_is_transformers_default(tmp_path, family):
    import transformers

    config_class = getattr(transformers, ARCHITECTURES[family].replace("ForCausalLM", "Config"))
    assert read_hf_config(write_config(tmp_path, family, rms_norm_eps=None))["rms_norm_eps"] == \
        config_class().rms_norm_eps


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_window_keys_left_out_are_transformers_defaults(tmp_path, family):
    """Qwen2Config / Qwen3Config: use_sliding_window false; max_window_layers 28."""
    cfg = read_hf_config(write_config(tmp_path, family, sliding_window=7))
    assert (cfg["sliding_window"], cfg["layer_types"]) == (0, None)
    cfg = read_hf_config(write_config(tmp_path, family, sliding_window=7, use_sliding_window=True,
                                      num_hidden_layers=30))
    assert cfg["layer_types"] == ["full_attention"] * 28 + ["sliding_attention"] * 2
