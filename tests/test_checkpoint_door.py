"""The checkpoint door: what an HF directory says that jaxcb does not compute is refused by name, before
any weight is read; what it does compute matches transformers. config.json fields, weight files and
tokenizer files, each mutated from a tiny checkpoint."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_checkpoints import TINY_HF, make_hf_llama, write_word_tokenizer
from jaxcb.config import ConfigError, ModelConfig
from jaxcb.model.config import read_hf_config
from jaxcb.model.loader import CheckpointError, convert_hf_to_orbax, load_model
from jaxcb.tokenizer import load_tokenizer

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


def hf_config(path) -> ModelConfig:
    return ModelConfig(name="hf", checkpoint=str(path), init="checkpoint", dtype="float32")


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


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope, named", [
    (dict(LLAMA3, factor=0), r"rope_scaling\.factor=0\.0 must be > 0"),
    (dict(LLAMA3, low_freq_factor=0), r"rope_scaling\.low_freq_factor=0\.0 and high_freq_factor=4\.0"),
    (dict(LLAMA3, low_freq_factor=4.0), r"rope_scaling\.low_freq_factor=4\.0 and high_freq_factor=4\.0"),
    (dict(YARN, beta_fast=0.5), r"rope_scaling\.beta_fast=0\.5 and beta_slow=1\.0"),
    (dict(YARN, original_max_position_embeddings=-1), r"rope_scaling\.original_max_position_embeddings=-1 must"),
])
def test_rope_scaling_outside_the_ranges_its_frequencies_are_computed_in_is_refused_naming_the_file(
        tmp_path, rope, named):
    """A zero divided by, or NaN frequencies: config.json's values checked as model.rope_scaling's are."""
    with pytest.raises(ConfigError, match=r"config\.json: " + named):
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


# --- weight files -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("door")
    make_hf_llama(str(path))
    return path


def mutated(llama_dir, tmp_path, edit=None):
    path = shutil.copytree(llama_dir, tmp_path / "c")
    if edit is not None:
        tensors = load_file(os.path.join(path, "model.safetensors"))
        edit(tensors)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def test_weights_that_are_not_floats_are_all_named_with_their_dtype(llama_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].astype(np.int8)
        t["model.norm.weight"] = t["model.norm.weight"] > 0
        t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.2.mlp.up_proj.weight"].astype(np.uint8)

    with pytest.raises(CheckpointError, match="3 problems") as info:
        load_model(hf_config(mutated(llama_dir, tmp_path, edit)))
    for name, dtype in (("model.layers.0.self_attn.q_proj.weight", "I8"), ("model.norm.weight", "BOOL"),
                        ("model.layers.2.mlp.up_proj.weight", "U8")):
        assert f"tensor {name} has dtype {dtype}" in str(info.value)


def test_an_fp8_weight_is_named_not_a_header_error(llama_dir, tmp_path):
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    path = mutated(llama_dir, tmp_path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_torch(file)
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"].to(
        torch.float8_e4m3fn)
    save_torch(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\.self_attn\.k_proj\.weight has dtype F8_E4M3"):
        load_model(hf_config(path))


@pytest.mark.parametrize("damage, named", [
    (lambda f: os.truncate(f, os.path.getsize(f) - 1000), "past its end"),
    (lambda f: os.truncate(f, 100), "its header does not fit"),
    (lambda f: open(f, "wb").close(), "its header does not fit"),
    (lambda f: open(f, "wb").write(b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]"), "not a safetensors header"),
], ids=["truncated", "cut-in-header", "empty", "header-a-list"])
def test_a_damaged_safetensors_file_is_named(llama_dir, tmp_path, damage, named):
    path = mutated(llama_dir, tmp_path)
    damage(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"model.safetensors is not a complete safetensors file.*{named}"):
        load_model(hf_config(path))


def test_pickled_pytorch_weights_alone_are_refused_saying_safetensors_are_needed(llama_dir, tmp_path):
    path = mutated(llama_dir, tmp_path)
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin, PyTorch pickles.*safe_serialization=True"):
        load_model(hf_config(path))


def test_a_tensor_in_two_files_is_a_checkpoint_error(llama_dir, tmp_path):
    path = mutated(llama_dir, tmp_path)
    shutil.copy(os.path.join(path, "model.safetensors"), os.path.join(path, "consolidated.safetensors"))
    with pytest.raises(CheckpointError, match="appears in both"):
        load_model(hf_config(path))


def test_an_unexpected_tensor_in_a_second_file_names_the_file(llama_dir, tmp_path):
    path = mutated(llama_dir, tmp_path)
    save_file({"base_model.model.lora_A.weight": np.ones(3, np.float32)},
              os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor base_model\.model\.lora_A\.weight in "
                                              r"adapter_model\.safetensors"):
        load_model(hf_config(path))


# --- tokenizer files ----------------------------------------------------------------------------

def tokenizer_dir(tmp_path, chat_template=None):
    os.makedirs(tmp_path, exist_ok=True)
    write_word_tokenizer(str(tmp_path), 131, chat_template=chat_template)
    return str(tmp_path)


def test_a_sentencepiece_model_without_tokenizer_json_says_how_to_write_one(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ConfigError, match=r"only tokenizer\.model, a slow tokenizer.*save_pretrained"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("template", [{"default": "x"}, 5, [], [{"template": "x"}]],
                         ids=["dict", "number", "empty-list", "unnamed"])
def test_a_malformed_chat_template_is_refused_naming_the_file(tmp_path, template):
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: chat_template must be"):
        load_tokenizer(tokenizer_dir(tmp_path, template))


@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json"])
def test_an_unreadable_tokenizer_file_is_named(tmp_path, name):
    path = tokenizer_dir(tmp_path)
    (tmp_path / name).write_text("{not json")
    with pytest.raises(ConfigError, match=name):
        load_tokenizer(path)


NAMED_TEMPLATES = [{"name": "default", "template": "D:{{ messages[0]['content'] }}"},
                   {"name": "tool_use", "template": "T:{{ tools | length }}:{{ messages[0]['content'] }}"}]
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_named_templates_render_as_transformers_picks_them(tmp_path):
    from transformers import AutoTokenizer

    path = tokenizer_dir(tmp_path, NAMED_TEMPLATES)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(MESSAGES, tools=tools) == \
            theirs.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
    saved = tmp_path / "saved"
    theirs.save_pretrained(saved)  # transformers 5: chat_template.jinja + additional_chat_templates/tool_use.jinja
    assert load_tokenizer(str(saved)).apply_chat_template(MESSAGES, tools=TOOLS) == "T:1:hi"
    ours.chat_template = "O"  # server.chat_template replaces every named template
    assert ours.apply_chat_template(MESSAGES, tools=TOOLS) == "O"


def test_named_templates_without_a_default_leave_chat_without_a_template(tmp_path):
    tok = load_tokenizer(tokenizer_dir(tmp_path, NAMED_TEMPLATES[1:]))
    assert tok.chat_template is None


def test_a_processors_chat_template_json_is_read(tmp_path):
    path = tokenizer_dir(tmp_path)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P:{{ messages[0]['content'] }}"}))
    assert load_tokenizer(path).apply_chat_template(MESSAGES) == "P:hi"


def test_conversion_to_orbax_keeps_the_named_chat_templates(llama_dir, tmp_path):
    from transformers import AutoTokenizer

    path = mutated(llama_dir, tmp_path)
    AutoTokenizer.from_pretrained(tokenizer_dir(tmp_path / "tok", NAMED_TEMPLATES)).save_pretrained(path)
    out = convert_hf_to_orbax(hf_config(path), str(tmp_path / "orbax"))
    assert load_tokenizer(out).apply_chat_template(MESSAGES, tools=TOOLS) == "T:1:hi"


def test_the_tool_call_syntax_is_detected_from_the_template_that_renders_tools(tmp_path):
    """A checkpoint whose tools go through its named tool_use template (Mistral's [TOOL_CALLS] there, not in
    the default one): `server.tool_call_parser=auto` reads the syntax off that template."""
    from jaxcb.server.tool_parsers import get_tool_parser
    from jaxcb.tokenizer import tools_chat_template

    tool_use = {"name": "tool_use", "template": "[AVAILABLE_TOOLS]{{ tools | tojson }}[TOOL_CALLS]"}
    tok = load_tokenizer(tokenizer_dir(tmp_path, [NAMED_TEMPLATES[0], tool_use]))
    assert get_tool_parser("auto", tools_chat_template(tok)).name == "mistral"
    assert get_tool_parser("auto", tok.chat_template).name == "hermes"  # the default template says nothing


def test_a_tokenizer_past_the_models_vocabulary_and_unreachable_end_ids_are_warned_about(tmp_path, caplog):
    from jaxcb.model_setup import check_tokenizer_fits

    tok = load_tokenizer(tokenizer_dir(tmp_path))  # 131 tokens, </s> = 2
    with caplog.at_level("WARNING", logger="jaxcb.model_setup"):
        check_tokenizer_fits(tok, 131)
        assert not [r for r in caplog.records if r.name == "jaxcb.model_setup"]
        check_tokenizer_fits(tok, 100)
        tok.eos_token_ids = [2, 120]
        check_tokenizer_fits(tok, 100)
        tok.eos_token_ids = [120]
        check_tokenizer_fits(tok, 100)
    messages = [r.getMessage() for r in caplog.records if r.name == "jaxcb.model_setup"]
    assert "the tokenizer has 131 tokens but the model's vocabulary is 100" in messages[0]
    assert "[120] lie past the model's vocabulary of 100" in messages[2] and "ends replies with [2]" in messages[2]
    assert "no reply ends but by max_tokens" in messages[4]


def test_a_mistral_config_without_sliding_window_takes_transformers_default_and_null_means_none(tmp_path):
    from transformers import MistralConfig

    left_out = read_hf_config(write_config(tmp_path / "a", "mistral"))
    assert left_out["sliding_window"] == MistralConfig().sliding_window == 4096
    with open(tmp_path / "b.json", "w") as f:  # v0.2 on: an explicit null
        json.dump({**json.load(open(tmp_path / "a" / "config.json")), "sliding_window": None}, f)
    os.makedirs(tmp_path / "b")
    shutil.move(tmp_path / "b.json", tmp_path / "b" / "config.json")
    assert read_hf_config(str(tmp_path / "b"))["sliding_window"] == 0


def test_a_checkpoint_whose_only_template_is_tool_use_serves_a_chat_with_tools_and_refuses_one_without(tmp_path):
    """transformers renders a chat that passes tools with "tool_use", and refuses one that does not (no default)."""
    from jaxcb.errors import InvalidRequestError
    from jaxcb.server.protocol import ChatCompletionRequest
    from jaxcb.server.requests import plan_chat_completion
    from jaxcb.server.tool_parsers import get_tool_parser
    from jaxcb.tokenizer import chat_prompt_ids, tools_chat_template

    tok = load_tokenizer(tokenizer_dir(tmp_path, NAMED_TEMPLATES[1:]))
    parser = get_tool_parser("auto", tools_chat_template(tok))
    planned = plan_chat_completion(ChatCompletionRequest(model="m", messages=MESSAGES, tools=TOOLS), tok, parser, 4096)
    assert tok.apply_chat_template(MESSAGES, tools=TOOLS) == "T:1:hi"
    assert planned.prompts[0] == chat_prompt_ids(tok, MESSAGES, True, TOOLS)
    with pytest.raises(InvalidRequestError, match="no chat template") as refusal:
        plan_chat_completion(ChatCompletionRequest(model="m", messages=MESSAGES), tok, parser, 4096)
    assert refusal.value.field == "messages"


@pytest.mark.parametrize("family, config_class", [("llama", "LlamaConfig"), ("mistral", "MistralConfig"),
                                                  ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config"),
                                                  ("gemma2", "Gemma2Config"), ("gemma3_text", "Gemma3TextConfig")])
def test_a_missing_max_position_embeddings_is_the_familys_transformers_default(tmp_path, family, config_class):
    """It bounds engine.max_model_len: Llama's 2048 for a Qwen2 checkpoint would refuse prompts that fit."""
    import transformers

    cfg = read_hf_config(write_config(tmp_path, family, max_position_embeddings=None))
    assert cfg["max_position_embeddings"] == getattr(transformers, config_class)().max_position_embeddings


def test_a_tool_use_only_template_that_ignores_tools_gets_them_written_into_the_conversation(tmp_path):
    """server.tool_prompt_fallback: the fallback renders with the template a chat with tools picks."""
    from jaxcb.server.protocol import ChatCompletionRequest
    from jaxcb.server.requests import plan_chat_completion
    from jaxcb.server.tool_parsers import get_tool_parser
    from jaxcb.tokenizer import tools_chat_template

    ignoring = {"name": "tool_use", "template": "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"}
    tok = load_tokenizer(tokenizer_dir(tmp_path, [ignoring]))
    parser = get_tool_parser("auto", tools_chat_template(tok))
    planned = plan_chat_completion(ChatCompletionRequest(model="m", messages=MESSAGES, tools=TOOLS), tok, parser, 4096)
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[])
    assert rendered == "<x>" and len(planned.prompts[0]) > len(tok.encode("<hi>"))  # the definitions written in


def test_a_yarn_factor_of_zero_is_refused_not_derived_from_the_context_lengths(tmp_path):
    rope = {"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 64}
    with pytest.raises(ConfigError, match=r"rope_scaling\.factor=0\.0 must be > 0"):
        read_hf_config(write_config(tmp_path, rope_scaling=rope))
