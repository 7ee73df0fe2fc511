"""Multi-LoRA serving on a random-init tiny HF Llama: adapters made with `peft`, mixed in one batch,
against transformers with each adapter merged; PEFT fields honoured or refused; the prefix cache
kept apart per adapter."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine_factory import BASE
from hf_checkpoints import make_hf_llama
from lora_adapters import base_and_two_adapters, greedy_tokens, logprobs
from jaxcb.config import ConfigError, compose_config
from jaxcb.engine import LLM
from jaxcb.errors import InvalidRequestError
from jaxcb.lora.peft import load_peft_adapter
from jaxcb.model.config import resolve_llama_config
from jaxcb.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 77, 3], [1] + list(range(10, 40)), [1, 130, 129, 4, 4, 4, 4, 8, 100, 64, 33, 21, 17]]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(base dir, {adapter name: dir}, {None | name: the transformers model with it merged})."""
    return base_and_two_adapters(tmp_path_factory.mktemp("lora"))


def lora_overrides(base_dir: str, adapters: dict, *extra: str) -> tuple:
    listed = ", ".join(f"{name}: '{path}'" for name, path in adapters.items())
    return BASE + ("model=hf", f"model.checkpoint={base_dir}", "model.dtype=float32", "lora.max_loras=2",
                   "lora.max_rank=8", "lora.max_cpu_loras=4", "engine.max_logprobs=20", f"lora.adapters={{{listed}}}") + extra


# The cpu backend (packed matmul, unrolled layers), XLA with unrolled layers (a list of slot buffers per
# layer), and XLA scanning the layers (slot buffers stacked on [L], as on GPU).
BACKENDS = {"cpu": ("model.backend=cpu",), "xla": ("model.backend=xla", "model.layer_loop=unrolled"),
            "xla-scan": ("model.backend=xla", "model.layer_loop=scan")}


@pytest.fixture(scope="module", params=list(BACKENDS))
def llm(request, checkpoints):
    base_dir, adapters, _ = checkpoints
    overrides = lora_overrides(base_dir, adapters, *BACKENDS[request.param], "cache.enable_prefix_caching=true")
    return LLM(compose_config(overrides), progress=False)


def test_base_and_two_adapters_mixed_in_one_batch_equal_transformers_with_each_merged(llm, checkpoints):
    _, _, merged = checkpoints
    requests = [(p, name) for p in PROMPTS for name in (None, "a1", "a2")]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=20)
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False, lora=[name for _, name in requests])
    tokens_by_adapter = {}
    for (prompt, name), out in zip(requests, outs):
        completion = out.outputs[0]
        assert completion.token_ids == greedy_tokens(merged[name], prompt, NUM_TOKENS), f"adapter {name}"
        reference = logprobs(merged[name], prompt + completion.token_ids[:-1])[len(prompt) - 1 :]
        for position, entries in enumerate(completion.logprobs):
            for token, lp in entries.items():
                assert abs(lp - reference[position, token]) <= 1e-4, (name, position, token)
        tokens_by_adapter.setdefault(prompt[1], []).append(completion.token_ids)
    # The adapters change the model: not all three answers to a prompt are the same.
    assert any(len({tuple(t) for t in answers}) > 1 for answers in tokens_by_adapter.values())
    assert llm.engine.num_recompiles == 0


def test_a_step_with_no_adapter_row_gives_the_base_models_tokens_and_logprobs(llm, checkpoints):
    """The steps of base requests alone (the cpu backend skips the updates in them, and runs the fused
    MLP kernel), then a step with an adapter row again: each as transformers gives it."""
    _, _, merged = checkpoints
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=20)
    for names in ([None] * len(PROMPTS), ["a1"] + [None] * (len(PROMPTS) - 1)):
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora=names)
        for prompt, name, out in zip(PROMPTS, names, outs):
            completion = out.outputs[0]
            assert completion.token_ids == greedy_tokens(merged[name], prompt, NUM_TOKENS), name
            reference = logprobs(merged[name], prompt + completion.token_ids[:-1])[len(prompt) - 1 :]
            assert max(abs(lp - reference[i, t]) for i, entries in enumerate(completion.logprobs)
                       for t, lp in entries.items()) <= 1e-4, name
    assert llm.engine.num_recompiles == 0


def test_the_same_prompt_on_two_adapters_never_shares_cached_blocks(llm, checkpoints):
    _, _, merged = checkpoints
    prompt = [1] + list(range(50, 90))  # five full blocks of 8
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = llm.engine
    hits_before = engine.scheduler.prefix_cache_hits
    first = llm.generate([prompt], params, use_tqdm=False, lora="a1")[0]
    assert engine.scheduler.prefix_cache_hits == hits_before
    for name in ("a2", None):  # the same tokens, another adapter (or none): no block of a1's is found
        out = llm.generate([prompt], params, use_tqdm=False, lora=name)[0]
        assert out.outputs[0].token_ids == greedy_tokens(merged[name], prompt, 4)
    assert engine.scheduler.prefix_cache_hits == hits_before
    again = llm.generate([prompt], params, use_tqdm=False, lora="a1")[0]  # its own blocks are found
    assert engine.scheduler.prefix_cache_hits > hits_before
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1  # cached blocks count as free


def test_an_unknown_model_name_is_refused_naming_model(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), lora="nope")
    assert e.value.field == "model" and "'a1'" in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_more_adapters_than_slots_wait_for_a_slot_and_all_finish(llm, checkpoints, tmp_path):
    """Three adapters over two slots: the third waits until a slot is free (least recently used
    swapped out), and every request finishes with the tokens it would have alone."""
    base_dir, adapters, merged = checkpoints
    engine = llm.engine
    engine.load_lora_adapter("a1_again", adapters["a1"])
    try:
        loads_before = engine.lora.slots.num_loads
        requests = [(PROMPTS[0], "a1"), (PROMPTS[1], "a2"), (PROMPTS[2], "a1_again"), (PROMPTS[0], "a2")]
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = llm.generate([p for p, _ in requests], params, use_tqdm=False, lora=[n for _, n in requests])
        for (prompt, name), out in zip(requests, outs):
            expected = greedy_tokens(merged["a1" if name == "a1_again" else name], prompt, NUM_TOKENS)
            assert out.outputs[0].token_ids == expected, name
        assert engine.lora.slots.num_loads > loads_before
        assert engine.num_recompiles == 0
    finally:
        assert engine.unload_lora_adapter("a1_again")


def test_host_copies_past_max_cpu_loras_are_dropped_and_read_again_when_named(llm, checkpoints, tmp_path):
    """lora.max_cpu_loras=4 host copies for 5 loaded adapters: the least recently named idle one gives
    its weights up and is read again when a request names it, serving the same tokens; if its files
    changed in between, the request is refused naming the adapter, and nothing is left behind."""
    import shutil

    base_dir, adapters, merged = checkpoints
    engine, lora = llm.engine, llm.engine.lora
    copies = {f"c{i}": str(shutil.copytree(adapters["a1"], tmp_path / f"c{i}")) for i in range(3)}
    for name, path in copies.items():
        engine.load_lora_adapter(name, path)
    try:
        [gone] = [name for name in lora.adapters if name not in lora.resident]
        assert len(lora.resident) == 4 and not lora.adapters[gone].weights
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        reloads = lora.num_reloads
        [out] = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora=gone)
        assert out.outputs[0].token_ids == greedy_tokens(merged["a2" if gone == "a2" else "a1"], PROMPTS[0], NUM_TOKENS)
        assert lora.num_reloads == reloads + 1 and gone in lora.resident and len(lora.resident) == 4
        for name in ("a1", "a2", "c1", "c2"):  # named in turn: c0 is the least recently named, dropped
            lora.resolve(name)
        assert list(lora.resident) == ["a1", "a2", "c1", "c2"] and not lora.adapters["c0"].weights
        config = os.path.join(copies["c0"], "adapter_config.json")
        with open(config) as f:
            changed = {**json.load(f), "lora_alpha": 1}
        with open(config, "w") as f:
            json.dump(changed, f)
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(PROMPTS[0], params, lora="c0")
        assert e.value.field == "model" and "'c0'" in str(e.value) and "changed since the adapter was loaded" in str(e.value)
        assert not engine.has_unfinished_requests() and engine.num_recompiles == 0
    finally:
        for name in copies:
            assert engine.unload_lora_adapter(name)
    assert set(lora.adapters) == {"a1", "a2"} and set(lora.resident) <= {"a1", "a2"}
    [out] = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
                         use_tqdm=False, lora="a2")  # served as before, its copy read again if it was dropped
    assert out.outputs[0].token_ids == greedy_tokens(merged["a2"], PROMPTS[1], NUM_TOKENS)


# --- PEFT fields honoured or refused -----------------------------------------------------------


def _arch(base_dir):
    from jaxcb.config import ModelConfig

    return resolve_llama_config(ModelConfig(name="hf", checkpoint=base_dir, init="checkpoint", dtype="float32"))


def _rewrite_config(src: str, dst, **fields) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    os.link(os.path.join(src, "adapter_model.safetensors"), os.path.join(dst, "adapter_model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("fields, named", [
    (dict(use_dora=True), "use_dora"),
    (dict(bias="lora_only"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (dict(layer_replication=[[0, 2]]), "layer_replication"),
    (dict(r=3), "r=3"),
], ids=["dora", "bias", "modules_to_save", "fan_in_fan_out", "embed_tokens", "unknown-feature", "wrong-rank"])
def test_peft_features_jaxcb_does_not_serve_are_refused_by_name(checkpoints, tmp_path, fields, named):
    base_dir, adapters, _ = checkpoints
    path = _rewrite_config(adapters["a1"], tmp_path / "bad", **fields)
    with pytest.raises(InvalidRequestError) as e:
        load_peft_adapter("bad", path, _arch(base_dir), max_rank=8)
    assert named in str(e.value) and "'bad'" in str(e.value)


def test_rank_above_max_rank_and_wrong_base_shapes_are_refused(checkpoints, tmp_path):
    base_dir, adapters, _ = checkpoints
    with pytest.raises(InvalidRequestError, match="lora.max_rank=2"):
        load_peft_adapter("a1", adapters["a1"], _arch(base_dir), max_rank=2)
    other = str(tmp_path / "other")
    make_hf_llama(other, hidden_size=40, head_dim=8, num_attention_heads=5, num_key_value_heads=1)
    with pytest.raises(InvalidRequestError, match="do not fit the base"):
        load_peft_adapter("a1", adapters["a1"], _arch(other), max_rank=8)


def test_peft_scaling_rank_and_alpha_patterns_and_layers_are_read_as_peft_applies_them(checkpoints):
    base_dir, adapters, _ = checkpoints
    adapter = load_peft_adapter("a2", adapters["a2"], _arch(base_dir), max_rank=8)
    layers = {layer for layer, _ in adapter.weights}
    assert layers == {0, 2} and not any(m == "k_proj" for _, m in adapter.weights)
    a, b = adapter.weights[(0, "q_proj")]
    assert a.shape[1] == 2 and b.shape[0] == 2  # rank_pattern
    from safetensors.numpy import load_file

    raw = load_file(os.path.join(adapters["a2"], "adapter_model.safetensors"))
    raw_b = raw["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    np.testing.assert_allclose(adapter.weights[(0, "down_proj")][1], raw_b.T * (3 / np.sqrt(6)), rtol=1e-6)
    raw_b = raw["base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"]
    np.testing.assert_allclose(adapter.weights[(2, "q_proj")][1], raw_b.T * (5 / np.sqrt(2)), rtol=1e-6)


def test_a_start_up_adapter_that_cannot_be_served_stops_start_up_naming_it(checkpoints, tmp_path):
    base_dir, adapters, _ = checkpoints
    bad = _rewrite_config(adapters["a1"], tmp_path / "dora", use_dora=True)
    with pytest.raises(ConfigError, match="'dora'.*use_dora"):
        LLM(compose_config(lora_overrides(base_dir, {"dora": bad})), progress=False)


def test_lora_with_tensor_parallelism_is_refused_by_name():
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size=2"):
        compose_config(("lora.enable=true", "engine.tensor_parallel_size=2"))


def test_a_bf16_model_serves_its_adapters_in_bf16_close_to_fp32_transformers(checkpoints):
    """The cpu backend packs a bf16 model's adapter slots in bf16 (the bf16 matmul path, as its layers):
    logprobs stay within bf16 rounding of fp32 transformers with the adapter merged."""
    base_dir, adapters, merged = checkpoints
    llm = LLM(compose_config(lora_overrides(base_dir, adapters, "model.backend=cpu", "model.dtype=bfloat16")),
              progress=False)
    assert llm.engine.runner.lora_buffers[0].q_proj.a.dtype.name == "bfloat16"
    prompt = PROMPTS[2]
    for name in (None, "a1", "a2"):
        c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5),
                         use_tqdm=False, lora=name)[0].outputs[0]
        reference = logprobs(merged[name], prompt + c.token_ids[:-1])[len(prompt) - 1 :]
        worst = max(abs(lp - reference[i, t]) for i, entries in enumerate(c.logprobs) for t, lp in entries.items())
        assert worst <= 0.02, (name, worst)


def test_ngram_speculation_verifies_each_adapters_drafts_with_that_adapter(checkpoints):
    """Drafts are rows of the step like any token: each carries its sequence's adapter slot, so the
    tokens are those of transformers with the adapter merged, speculation on."""
    base_dir, adapters, merged = checkpoints
    llm = LLM(compose_config(lora_overrides(base_dir, adapters, "model.backend=cpu", "speculative.method=ngram",
                                            "speculative.disable_by_batch_size=8")), progress=False)
    prompt = [1] + [5, 9, 77, 3] * 6  # repetitive: the proposer finds continuations
    names = [None, "a1", "a2"]
    outs = llm.generate([prompt] * 3, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False, lora=names)
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == greedy_tokens(merged[name], prompt, 12), name
    assert llm.engine.speculation.stats.num_draft_tokens > 0
    assert llm.engine.num_recompiles == 0


def test_lora_with_a_draft_model_is_refused_by_name():
    with pytest.raises(ConfigError, match="speculative.method=draft"):
        compose_config(("lora.enable=true", "speculative.method=draft", "speculative.draft_model=tiny"))
