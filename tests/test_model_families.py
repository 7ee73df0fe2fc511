"""Qwen2, Qwen3 and Mistral beside Llama: each family's differences read from config.json in both
schemas (or refused by name), its logits equal to transformers' on random weights with a sliding
window shorter than the prompts, in every attention form and backend, and its greedy tokens through
the engine (chunked prefill, prefix caching, preemption) equal to transformers' generate."""

import json

import numpy as np
import pytest
import torch

from hf_checkpoints import FAMILY_HF, TINY_HF, make_hf_family, write_word_tokenizer
from test_hf_parity import ATTENTION, hf_logits, hf_model_config, jax_logits
from engine_factory import CACHE_DIR
from jaxcb.backends import select_backend
from jaxcb.backends.base import Backend
from jaxcb.config import AttentionConfig, ConfigError, compose_config
from jaxcb.engine import Engine
from jaxcb.kernels.attention import select_attention
from jaxcb.model.config import read_hf_config
from jaxcb.model.loader import load_model
from jaxcb.sampling_params import SamplingParams

FAMILIES = list(FAMILY_HF)
# Up to 37 tokens: past every family's window (7 or 11), and not a multiple of the 8-token block.
PROMPTS = [[1, 5, 9, 77, 3], [1] + list(range(10, 47)), [1, 130, 129, 4, 4, 4, 4, 8, 100, 64, 33, 21, 17]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (directory, the transformers model saved there, jaxcb's model, its LlamaConfig)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        hf = make_hf_family(str(path), family)
        write_word_tokenizer(str(path), TINY_HF["vocab_size"])
        model, cfg = load_model(hf_model_config(path))
        out[family] = (path, hf, model, cfg)
    return out


def test_each_family_reads_its_differences_from_config_json(checkpoints):
    got = {f: checkpoints[f][3] for f in FAMILIES}
    assert (got["qwen2"].architecture, got["qwen2"].qkv_bias, got["qwen2"].qk_norm) == ("qwen2", True, False)
    assert got["qwen2"].layer_windows == (0, 7, 7)  # max_window_layers=1: the first layer sees everything
    assert (got["qwen3"].qkv_bias, got["qwen3"].qk_norm, got["qwen3"].layer_windows) == (False, True, (0, 0, 11))
    assert (got["mistral"].qkv_bias, got["mistral"].qk_norm, got["mistral"].layer_windows) == (False, False, (7, 7, 7))
    g2, g3 = got["gemma2"], got["gemma3"]
    assert (g2.embed_scale, g2.norm_offset, g2.hidden_act, g2.sandwich_norms) == (True, True, "gelu_tanh", True)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == (0.02, 1.5, 13)
    assert g2.layer_windows == (7, 0, 7) and g2.tie_word_embeddings  # every other layer, from the first
    assert (g3.qk_norm, g3.attn_logit_softcap, g3.final_logit_softcap, g3.layer_windows) == (True, 0, 0, (7, 0, 7))
    assert (g3.rope_theta, g3.rope_scaling.rope_type, g3.rope_scaling.factor, g3.rope_local_theta) == (
        1000.0, "linear", 2.0, 100.0)


def assert_logits_match(model, hf, backend, label: str, prompts=PROMPTS) -> None:
    """jaxcb's fp32 logits of every prompt within 1e-4 of transformers'."""
    for prompt in prompts:
        diff = np.abs(jax_logits(model, prompt, backend=backend) - hf_logits(hf, prompt)).max()
        assert diff <= 1e-4, f"{label}: max |logits diff| {diff} for a prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("impl", list(ATTENTION))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_in_fp32_in_every_attention_form(checkpoints, family, impl):
    """The two prompts past every window (each length compiles anew: 20 forms of 3 prompts cost a minute);
    the 5-token one runs through the cpu backend's test below."""
    _, hf, model, cfg = checkpoints[family]
    assert_logits_match(model, hf, Backend(cfg, select_attention(ATTENTION[impl])), f"{family}, {impl}", PROMPTS[1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cpu_backend_matches_transformers_or_refuses_by_name(checkpoints, family):
    """The packed C++ matmul fuses Llama's norms and SwiGLU: Gemma's layout is refused by it (auto takes xla)."""
    path, hf, _, _ = checkpoints[family]
    m = hf_model_config(path)
    model, cfg = load_model(m)  # prepare takes the weights over: a model of its own
    m.backend, m.layer_loop = "cpu", "unrolled"
    if family.startswith("gemma"):
        with pytest.raises(ConfigError, match=f"model.backend=cpu: .*not {cfg.architecture}'s"):
            select_backend(m, cfg, AttentionConfig())
        m.backend = "auto"
        assert select_backend(m, cfg, AttentionConfig()).name == "xla"
        return
    backend = select_backend(m, cfg, AttentionConfig())
    assert backend.name == "cpu"
    assert_logits_match(model, hf, backend, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_window_decides_the_logits_past_it(checkpoints, family):
    """Parity with the window is not parity by accident: without it, the long prompt's logits differ."""
    import dataclasses

    _, hf, model, cfg = checkpoints[family]
    no_window = Backend(dataclasses.replace(cfg, sliding_window=0, layer_types=None), select_attention(ATTENTION["xla"]))
    diff = np.abs(jax_logits(model, PROMPTS[1], backend=no_window) - hf_logits(hf, PROMPTS[1])).max()
    assert diff > 1e-3


# --- the engine: greedy tokens -----------------------------------------------------------------

def family_engine(path, *overrides: str) -> Engine:
    return Engine(compose_config([
        "model=hf", f"model.checkpoint={path}", "model.dtype=float32", "engine.max_model_len=80",
        "scheduler.max_num_batched_tokens=16", "scheduler.max_num_seqs=6", "cache.block_size=8",
        "cache.num_blocks=14", "engine.token_buckets=[8,16]", "engine.seq_buckets=[6]",
        "engine.sampling_variants=[greedy,full]", "engine.masked_sampling=false", "engine.prompt_logprobs=false",
        f"engine.compilation_cache_dir={CACHE_DIR}", *overrides,
    ]), progress=False)


def transformers_greedy(hf, prompt, max_new_tokens):
    """(transformers' greedy tokens, how many of them to compare: up to the first step whose top-2
    logits lie within 1e-4 of each other, where float rounding may pick either)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    for i, logits in enumerate(out.logits):
        top2 = torch.topk(logits[0], 2).values
        if float(top2[0] - top2[1]) < 1e-4:
            return tokens, i + 1  # this step's token may differ; the ones after it are not compared
    return tokens, len(tokens)


# Gemma 2's engine compiles the prompt-logprobs variants too: its greedy tokens (which never use them) and its
# prompt logprobs are checked on one engine.
GEMMA2_ENGINE = ("engine.prompt_logprobs=true", "engine.compile_rare_variants=startup")


@pytest.fixture(scope="module")
def gemma2_engine(checkpoints):
    return family_engine(checkpoints["gemma2"][0], *GEMMA2_ENGINE)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_through_the_engine_equal_transformers_generate(checkpoints, family, request):
    path, hf, _, _ = checkpoints[family]
    # A 16-token budget cuts the 37-token prompt into chunks; 13 usable blocks of 8 tokens hold fewer
    # than the six sequences need together, so some are preempted and recomputed; the prompts share
    # their first tokens, so prefix caching finds them.
    e = request.getfixturevalue("gemma2_engine") if family == "gemma2" else family_engine(path)
    preemptions, hits = e.scheduler.num_preemptions, e.scheduler.prefix_cache_hits
    prompts = PROMPTS + [PROMPTS[1][:20] + [3, 4, 5], PROMPTS[1][:30], PROMPTS[2] * 2]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [e.add_request(p, params) for p in prompts]
    done = {}
    while e.has_unfinished_requests():
        done.update({out.request_id: out.outputs[0].token_ids for out in e.step() if out.finished})
    assert e.scheduler.num_preemptions > preemptions, "the cache should have been small enough to preempt"
    assert e.scheduler.prefix_cache_hits > hits, "the shared first tokens should have been found in the cache"
    compared = 0
    for request_id, prompt in zip(ids, prompts):
        theirs, n = transformers_greedy(hf, prompt, 24)
        assert done[request_id][:n] == theirs[:n], f"{family}: prompt of {len(prompt)} tokens"
        compared += n
    assert compared >= len(prompts) * 12, f"only {compared} tokens compared"  # near-ties are rare, not the rule
    print(f"{family}: {compared} of {len(prompts) * 24} greedy tokens compared with transformers")


# --- config.json as checkpoints carry it --------------------------------------------------------

def write_config(tmp_path, **fields):
    """config.json of TINY_HF's shapes with `fields`; transformers 5's rope_parameters replace rope_theta."""
    base = {k: v for k, v in TINY_HF.items() if not (k == "rope_theta" and "rope_parameters" in fields)}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(base, **fields), f)
    return str(tmp_path)


def test_qwen2_5s_hub_config_with_use_sliding_window_false_has_no_window(tmp_path):
    """Qwen2.5's config.json says sliding_window=131072 beside use_sliding_window=false."""
    cfg = read_hf_config(write_config(tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                      use_sliding_window=False, sliding_window=131072, max_window_layers=28))
    assert (cfg["sliding_window"], cfg["layer_types"], cfg["qkv_bias"]) == (0, None, True)


def test_transformers_5s_layer_types_and_rope_parameters_are_read(tmp_path):
    cfg = read_hf_config(write_config(
        tmp_path, model_type="qwen3", sliding_window=5, use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (cfg["sliding_window"], cfg["rope_theta"], cfg["rope_scaling"], cfg["qk_norm"]) == (5, 1e6, None, True)


@pytest.mark.parametrize("fields, named", [
    (dict(model_type="qwen3", attention_bias=True), "attention_bias"),
    (dict(model_type="llama", mlp_bias=True), "mlp_bias"),
    (dict(model_type="llama", sliding_window=64), "sliding_window"),
    (dict(model_type="gemma4"), "gemma4"),
    (dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation"),
    (dict(model_type="qwen2", rope_scaling={"rope_type": "longrope", "factor": 4.0}), "longrope"),
    (dict(model_type="qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7,
                                              "original_max_position_embeddings": 64}), "mscale"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, layer_types=["chunked_attention"] * 3),
     "chunked_attention"),
])
def test_what_a_family_does_not_compute_is_refused_by_name(tmp_path, fields, named):
    with pytest.raises(ConfigError, match=named):
        read_hf_config(write_config(tmp_path, **fields))


def test_qwen_s_hub_yarn_rope_scaling_is_read(tmp_path):
    """As Qwen2.5's model card says to add it for 128k contexts (4.x keys: "type", no rope_theta)."""
    cfg = read_hf_config(write_config(tmp_path, model_type="qwen2", rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))
    rs = cfg["rope_scaling"]
    assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings, rs.attention_factor) == ("yarn", 4.0, 32768, None)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_yarn_rope_scaling_matches_transformers(tmp_path, family):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    hf = make_hf_family(str(tmp_path), family, use_sliding_window=False, rope_parameters=yarn)
    model, cfg = load_model(hf_model_config(tmp_path))
    assert cfg.rope_scaling.rope_type == "yarn"
    assert_logits_match(model, hf, None, f"{family}, yarn")
    plain = make_hf_family(str(tmp_path / "plain"), family, use_sliding_window=False)
    assert np.abs(hf_logits(plain, PROMPTS[1]) - hf_logits(hf, PROMPTS[1])).max() > 1e-3  # yarn changes them


def test_ids_past_the_tokenizer_decode_to_nothing(tmp_path):
    """Qwen's embedding has more rows than its tokenizer has tokens (152,064 against 151,665): a model
    may sample a padding id, which must decode to no text, never crash the detokenizer."""
    from jaxcb.detokenizer import IncrementalDetokenizer
    from jaxcb.tokenizer import ByteTokenizer, load_tokenizer

    write_word_tokenizer(str(tmp_path), 120)  # the model's vocabulary is larger: 131 rows
    for tokenizer, ids, text in ((load_tokenizer(str(tmp_path)), [5, 125, 130, 6], "w5 w6"),
                                 (ByteTokenizer(), [72, 300, 105], "Hi")):
        detok = IncrementalDetokenizer(tokenizer, stop=[])
        for token in ids:
            assert detok.add_token(token) is None
        detok.finish()
        assert detok.text == text
        assert tokenizer.decode([ids[1]], skip_special_tokens=False) == ""


# --- the new presets on a GPU --------------------------------------------------------------------

@pytest.mark.parametrize("name, tensor_parallel_size", [("qwen3_8b", 1), ("qwen2_5_7b", 1), ("mistral_7b", 1),
                                                        ("qwen3_8b", 2), ("gemma2_9b", 1), ("gemma3_12b", 1)])
def test_each_presets_whole_step_lowers_for_an_h200(name, tensor_parallel_size):
    """forward_step (the layer scan, K/V writes, the kernel's launches, logits) of the real shapes, for an
    abstract H200 mesh, as tests/test_cuda_lowering.py lowers llama8b's."""
    from cuda_variants import preset
    from jaxcb.kernels.triton_calls import triton_calls
    from test_cuda_lowering import lower_step

    cfg = preset(name)
    lowered = lower_step(name, tensor_parallel_size, 256, 64, 64)
    text = lowered.as_text()
    assert f"mhlo.num_partitions = {tensor_parallel_size}" in text and "@jaxcb_" not in text
    calls = triton_calls(lowered)
    assert calls, "no Triton kernel in the step"
    rows = 256 * cfg.num_query_groups  # each device's query rows: its KV heads' groups of every token
    kv_heads = cfg.num_kv_heads // tensor_parallel_size
    # q as the kernel reads it: its KV heads x (rows + one prefill tile of slack) x head_dim
    assert all(f"tensor<{kv_heads}x{rows + 64}x{cfg.head_dim}xbf16>" in call.operand_types for call in calls), \
        [call.operand_types for call in calls]


@pytest.mark.parametrize("name", ["qwen3_8b", "qwen2_5_7b", "mistral_7b", "llama8b", "gemma2_9b", "gemma3_12b"])
def test_start_ups_memory_plan_counts_every_weight_of_each_family(name):
    """The cache is planned from the weights' bytes (jaxcb.startup_memory): biases and q/k norms included."""
    from cuda_variants import preset
    from jaxcb.model.llama import build_abstract_model, count_params
    from jaxcb.startup_memory import weight_bytes

    cfg = preset(name)
    assert weight_bytes(cfg).total == 2 * count_params(build_abstract_model(cfg))  # bfloat16


def test_attention_flops_count_only_the_keys_a_window_lets_a_token_see():
    from jaxcb.benchmark import attended_keys

    assert attended_keys(10, 0) == 55 and attended_keys(10, 10) == 55
    assert attended_keys(10, 4) == 1 + 2 + 3 + 4 * 7


# --- Gemma -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cap", ["attn_logit_softcap", "final_logit_softcap"])
def test_gemma2s_caps_decide_its_logits(checkpoints, cap):
    """Both soft-caps bite on the test model (small caps): parity is not parity by accident."""
    import dataclasses

    _, hf, model, cfg = checkpoints["gemma2"]
    uncapped = Backend(dataclasses.replace(cfg, **{cap: 0.0}), select_attention(ATTENTION["xla"]))
    assert np.abs(jax_logits(model, PROMPTS[1], backend=uncapped) - hf_logits(hf, PROMPTS[1])).max() > 1e-3


def gemma3_hub_config(t5: dict) -> dict:
    """The 4.x keys the Hub's Gemma 3 config.json carries, for the same model as transformers 5's form."""
    hub = {k: v for k, v in t5.items() if k not in ("layer_types", "rope_parameters")}
    rp = t5["rope_parameters"]
    hub.update(rope_theta=rp["full_attention"]["rope_theta"], rope_local_base_freq=rp["sliding_attention"]["rope_theta"],
               rope_scaling={k: v for k, v in rp["full_attention"].items() if k != "rope_theta"},
               sliding_window_pattern=2)
    return hub


def test_a_hub_form_gemma3_config_loads_to_the_same_model_as_transformers_5s(checkpoints, tmp_path):
    path = checkpoints["gemma3"][0]
    with open(path / "config.json") as f:
        t5 = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps(gemma3_hub_config(t5)))
    ours = {k: v for k, v in read_hf_config(str(tmp_path)).items()}
    theirs = read_hf_config(str(path))
    assert ours == theirs


def test_gemma3_for_conditional_generation_serves_its_text_tower(checkpoints, tmp_path):
    """Gemma 3 4B and up: config.json's text_config, the text weights under language_model, an image
    tower beside them (ignored: images are refused at the door)."""
    from safetensors.numpy import load_file, save_file

    path, hf, model, _ = checkpoints["gemma3"]
    with open(path / "config.json") as f:
        text = json.load(f)
    multimodal = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                  "text_config": {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype", "dtype")},
                  "vision_config": {"model_type": "siglip_vision_model"}, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(multimodal))
    tensors = {"language_model." + k: v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((2, 3), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    tower, cfg = load_model(hf_model_config(tmp_path))
    assert cfg.architecture == "gemma3_text" and cfg.rope_local_theta == 100.0
    assert_logits_match(tower, hf, None, "gemma3 text tower")


def test_an_image_in_a_chat_message_is_refused_by_name():
    from jaxcb.errors import InvalidRequestError
    from jaxcb.server.protocol import ChatCompletionRequest, message_text

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:..."}}]}])
    with pytest.raises(InvalidRequestError, match="images are not supported") as e:
        message_text(req.messages[0])
    assert e.value.field == "messages.content.1"  # the part at fault (chat passes "messages.i" for messages[i])
    bad_text = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])
    with pytest.raises(InvalidRequestError, match="must be a string") as e:
        message_text(bad_text.messages[0], "messages.0")
    assert e.value.field == "messages.0.content.0.text"


def test_gemma2s_final_cap_keeps_greedy_tokens_and_gives_transformers_prompt_logprobs(checkpoints, gemma2_engine):
    """tanh keeps the order, so greedy tokens cannot tell a capped head from an uncapped one: prompt
    logprobs can, and they are transformers' (log-softmax of the capped logits)."""
    _, hf, _, _ = checkpoints["gemma2"]
    e = gemma2_engine
    prompt = PROMPTS[1]
    rid = e.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    out = [o for _ in range(100) for o in e.step() if o.finished and o.request_id == rid][0]
    ours = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
    theirs = torch.log_softmax(torch.tensor(hf_logits(hf, prompt)), dim=-1).numpy()
    expected = [theirs[i, token] for i, token in enumerate(prompt[1:])]
    np.testing.assert_allclose(ours, expected, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_end_of_turn_ids_come_from_generation_config_json(checkpoints, family, tmp_path):
    """Qwen's <|im_end|> and Gemma's <end_of_turn> are listed in generation_config.json, not config.json."""
    import shutil

    from jaxcb.model_setup import load_model_and_tokenizer

    path = tmp_path / family
    shutil.copytree(checkpoints[family][0], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 107]}))
    _, _, tokenizer = load_model_and_tokenizer(hf_model_config(path), AttentionConfig(impl="xla"))
    assert {2, 107} <= set(tokenizer.eos_token_ids)
    (path / "generation_config.json").unlink()
    _, _, tokenizer = load_model_and_tokenizer(hf_model_config(path), AttentionConfig(impl="xla"))
    assert 107 not in tokenizer.eos_token_ids
