"""The checkpoint's sampling defaults (generation_config.json, a GGUF's general.sampling keys) fill the
fields a request leaves out, through every door; a field the request gives always wins."""

import dataclasses
import json
import logging

import gguf
import numpy as np
import openai
import pytest

from engine_factory import BASE, shared_engine
from jaxcb.config import ConfigError, ModelConfig, compose_config
from jaxcb.engine import LLM, Engine
from jaxcb.jobs import JobContext, plan_record
from jaxcb.sampling_defaults import NO_DEFAULTS, SamplingDefaults, read_sampling_defaults
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from jaxcb.server.requests import plan_chat_completion, plan_completion
from jaxcb.server.tool_parsers import get_tool_parser
from server_harness import running_server

QWEN_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.7, "top_p": 0.8,
             "top_k": 20, "repetition_penalty": 1.05, "transformers_version": "4.51.0"}


def checkpoint_dir(tmp_path, generation: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def hf_model(directory: str, generation_config: str = "auto") -> ModelConfig:
    return ModelConfig(name="hf", checkpoint=directory, generation_config=generation_config)


def test_generation_config_json_fields_become_the_defaults_and_its_other_settings_are_named(tmp_path, caplog):
    d = checkpoint_dir(tmp_path, {**QWEN_LIKE, "max_new_tokens": 5, "num_beams": 4, "no_repeat_ngram_size": 0})
    with caplog.at_level(logging.INFO, logger="jaxcb.sampling_defaults"):
        defaults = read_sampling_defaults(hf_model(d))
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty, defaults.max_tokens) == (
        0.7, 0.8, 20, 1.05, 5)
    assert defaults.min_p is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "num_beams=4" in warned[0] and "no_repeat_ngram_size" not in warned[0]
    assert read_sampling_defaults(hf_model(d, "none")) == NO_DEFAULTS


def test_do_sample_false_makes_greedy_the_default(tmp_path):
    d = checkpoint_dir(tmp_path, {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7})
    defaults = read_sampling_defaults(hf_model(d))
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.0, None, 7)


def test_a_directory_without_generation_config_json_has_no_defaults(tmp_path):
    assert read_sampling_defaults(hf_model(str(tmp_path))) == NO_DEFAULTS


@pytest.mark.parametrize("generation, named", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"repetition_penalty": "high"}, "repetition_penalty"),
])
def test_a_default_no_request_could_give_is_refused_at_start_up_naming_it(tmp_path, generation, named):
    with pytest.raises(ConfigError, match=named) as e:
        read_sampling_defaults(hf_model(checkpoint_dir(tmp_path, generation)))
    assert "model.generation_config=none" in str(e.value)


def test_unreadable_generation_config_json_is_refused_naming_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json is not readable JSON"):
        read_sampling_defaults(hf_model(str(tmp_path)))


def test_model_generation_config_must_be_auto_none_or_a_directory_with_the_file(tmp_path):
    with pytest.raises(ConfigError, match="model.generation_config="):
        compose_config(["model=tiny", f"model.generation_config={tmp_path}"])
    compose_config(["model=tiny", f"model.generation_config={checkpoint_dir(tmp_path, QWEN_LIKE)}"])


def write_gguf(path, **sampling):
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        if isinstance(value, float):
            w.add_float32(f"general.sampling.{key}", value)
        else:
            w.add_int32(f"general.sampling.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_ggufs_sampling_keys_are_its_defaults_and_a_windowed_repeat_penalty_is_named(tmp_path, caplog):
    path = write_gguf(tmp_path / "m.gguf", temp=0.8, top_k=40, top_p=0.95, min_p=0.05, penalty_repeat=1.1,
                      penalty_last_n=64, mirostat=0)
    with caplog.at_level(logging.WARNING, logger="jaxcb.sampling_defaults"):
        defaults = read_sampling_defaults(ModelConfig(name="hf", checkpoint=path))
    assert defaults.temperature == pytest.approx(0.8) and defaults.top_k == 40
    assert defaults.top_p == pytest.approx(0.95) and defaults.min_p == pytest.approx(0.05)
    assert defaults.repetition_penalty is None  # llama.cpp's penalty over the last 64 tokens is not ours
    assert any("penalty_repeat" in r.getMessage() for r in caplog.records)
    whole = write_gguf(tmp_path / "w.gguf", penalty_repeat=1.1, penalty_last_n=-1)
    assert read_sampling_defaults(ModelConfig(name="hf", checkpoint=whole)).repetition_penalty == pytest.approx(1.1)


DEFAULTS = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=5, source="t")


def test_a_completion_body_takes_the_defaults_for_what_it_leaves_out_and_keeps_what_it_gives():
    left_out = plan_completion(parse_request(CompletionRequest, {"model": "m", "prompt": "hi"}), DEFAULTS).params
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert left_out.max_tokens == 5 and left_out.min_p == 0.0  # min(16, max_new_tokens); min_p: jaxcb's
    given = plan_completion(parse_request(CompletionRequest, {
        "model": "m", "prompt": "hi", "temperature": 0, "top_p": 1, "top_k": -1, "repetition_penalty": 1, "max_tokens": 50,
    }), DEFAULTS).params
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty, given.max_tokens) == (0, 1, 0, 1, 50)
    nulls = plan_completion(parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "temperature": None}), DEFAULTS).params
    assert nulls.temperature == 0.7
    plain = plan_completion(parse_request(CompletionRequest, {"model": "m", "prompt": "hi"})).params
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)


def test_a_chat_body_without_max_tokens_gets_the_models_max_new_tokens_within_the_context():
    tok = shared_engine().tokenizer
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def planned(extra, defaults, max_model_len=256):
        req = parse_request(ChatCompletionRequest, {**body, **extra})
        return plan_chat_completion(req, tok, get_tool_parser("auto", tok.chat_template), max_model_len,
                                    defaults=defaults).params

    assert planned({}, DEFAULTS).max_tokens == 5
    assert planned({"max_completion_tokens": 9}, DEFAULTS).max_tokens == 9
    long_default = dataclasses.replace(DEFAULTS, max_tokens=10_000)
    prompt_len = 256 - planned({}, NO_DEFAULTS).max_tokens
    assert planned({}, long_default).max_tokens == 256 - prompt_len  # the context's room is the cap
    assert planned({}, DEFAULTS).temperature == 0.7


def test_a_job_record_takes_the_defaults(tmp_path):
    ctx = JobContext(compose_config(BASE), shared_engine().tokenizer, 256, DEFAULTS)
    _, planned = plan_record(ctx, {"id": "a", "prompt": "hi"})
    assert (planned.params.temperature, planned.params.max_tokens) == (0.7, 5)
    _, planned = plan_record(ctx, {"id": "b", "prompt": "hi", "temperature": 0.2})
    assert planned.params.temperature == 0.2


def test_the_engine_reads_model_generation_config_and_llm_generate_uses_it(tmp_path):
    d = checkpoint_dir(tmp_path, {"do_sample": False, "max_new_tokens": 3})
    engine = Engine(compose_config(BASE + (f"model.generation_config={d}",)), compile_buckets=False, progress=False)
    assert engine.sampling_defaults.temperature == 0.0 and engine.sampling_defaults.max_tokens == 3
    shared = shared_engine()  # the same model, compiled: its defaults swapped for the run below
    llm = LLM.__new__(LLM)
    llm.engine = shared
    saved, shared.sampling_defaults = shared.sampling_defaults, engine.sampling_defaults
    try:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
        [out] = llm.generate(["Hello"], use_tqdm=False)
        [greedy] = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    finally:
        shared.sampling_defaults = saved
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids and len(out.outputs[0].token_ids) == 3


def test_the_server_applies_the_defaults_to_chat_completions_and_responses():
    engine = shared_engine()
    greedy_3 = SamplingDefaults(temperature=0.0, max_tokens=3, source="test")
    saved = engine.sampling_defaults
    engine.sampling_defaults = greedy_3
    try:
        with running_server(engine=engine) as (url, state):
            assert state.client.sampling_defaults is greedy_3
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": "Say something"}]
            left_out = client.chat.completions.create(model=state.model_name, messages=messages)
            again = client.chat.completions.create(model=state.model_name, messages=messages)
            given = client.chat.completions.create(model=state.model_name, messages=messages, max_tokens=5,
                                                   temperature=0)
            response = client.responses.create(model=state.model_name, input="Say something")
    finally:
        engine.sampling_defaults = saved
    assert left_out.usage.completion_tokens == 3 and left_out.choices[0].finish_reason == "length"
    assert left_out.choices[0].message.content == again.choices[0].message.content  # greedy by default
    assert given.usage.completion_tokens == 5
    assert response.usage.output_tokens == 3
