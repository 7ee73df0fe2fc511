"""LoRA adapters over HTTP: `model` selects base or adapter (chat, completions, JSONL jobs), /v1/models
lists the adapters with their parent, and adapters load and unload at run time under load with no
failed request, no recompile and no leaked block."""

from __future__ import annotations

import json
import threading

import pytest
import requests
from openai import OpenAI

from engine_factory import BASE
from lora_adapters import base_and_two_adapters, greedy_tokens
from server_harness import running_server
from jaxcb.config import compose_config
from jaxcb.engine import Engine, LLM
from jaxcb.jobs import JobRecord, generate_results
from jaxcb.sampling_params import SamplingParams

PROMPT = [1, 5, 9, 77, 3, 8, 12]
API_KEY = "k"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base_dir, adapters, merged = base_and_two_adapters(tmp_path_factory.mktemp("lora-serving"))
    overrides = ("model=hf", f"model.checkpoint={base_dir}", "model.dtype=float32", "lora.max_loras=2",
                 "lora.max_rank=8", f"lora.adapters={{a1: '{adapters['a1']}'}}", "server.allow_runtime_lora=true",
                 f"server.api_key={API_KEY}", "server.served_model_name=base")
    engine = Engine(compose_config(BASE + overrides), progress=False)
    return overrides, engine, adapters, merged


def test_model_names_the_adapter_and_models_lists_it_with_its_parent(setup):
    overrides, engine, adapters, merged = setup
    with running_server(*overrides, engine=engine) as (url, _):
        client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"base", "a1"} and listed["a1"].parent == "base"
        for model, name in (("base", None), ("a1", "a1")):
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})
            ids = engine.tokenizer.encode(reply.choices[0].text, add_special_tokens=False)
            assert ids == greedy_tokens(merged[name], PROMPT, 6)
            assert reply.model == model  # the response names the model the request named, as vLLM's do
        r = requests.post(f"{url}/v1/completions", json={"model": "a9", "prompt": "w3", "max_tokens": 2},
                          headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_job_record_names_its_adapter_in_model(setup):
    overrides, engine, adapters, merged = setup
    llm = LLM.__new__(LLM)  # the module's engine, without building another
    llm.engine = engine
    records = [JobRecord(1, "x", {"id": "x", "model": "a1", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True,
                                  "temperature": 0}),
               JobRecord(2, "y", {"id": "y", "model": "nope", "prompt": PROMPT, "max_tokens": 5})]
    # A beam search runs its rounds with the adapter too: one beam is the adapter's greedy decoding.
    records.append(JobRecord(3, "z", {"id": "z", "model": "a1", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True,
                                      "use_beam_search": True, "n": 1}))
    results = {r["id"]: r for r in generate_results(llm, records, max_in_flight=4)}
    assert results["y"]["field"] == "model"
    assert results["x"]["token_ids"] == results["z"]["token_ids"] == greedy_tokens(merged["a1"], PROMPT, 5)


def test_load_and_unload_at_run_time_under_load_fail_nothing_and_leak_nothing(setup):
    """A stream on a1 runs while a2 is loaded and a1 unloaded: the stream finishes with a1's tokens,
    a2 serves at once, a1 is refused after its unload; no recompile, no block left referenced."""
    overrides, engine, adapters, merged = setup
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with running_server(*overrides, engine=engine) as (url, _):
        assert requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]}
                             ).status_code == 401  # behind the API key
        client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
        stream = client.completions.create(model="a1", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)  # a1's request is running
        r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]},
                          headers=headers)
        assert r.status_code == 200, r.text
        unloaded = {}
        thread = threading.Thread(target=lambda: unloaded.setdefault("r", requests.post(
            f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=headers)))
        thread.start()
        reply = client.completions.create(model="a2", prompt=PROMPT, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
        ids = engine.tokenizer.encode(reply.choices[0].text, add_special_tokens=False)
        assert ids == greedy_tokens(merged["a2"], PROMPT, 6)
        text = first.choices[0].text + "".join(c.choices[0].text for c in chunks)
        thread.join(timeout=60)
        assert unloaded["r"].status_code == 200, unloaded["r"].text
        assert engine.tokenizer.encode(text, add_special_tokens=False) == greedy_tokens(merged["a1"], PROMPT, 40)
        r = requests.post(f"{url}/v1/completions", json={"model": "a1", "prompt": PROMPT, "max_tokens": 2},
                          headers=headers)
        assert r.status_code == 404
        assert {m.id for m in client.models.list().data} == {"base", "a2"}
        metrics = requests.get(f"{url}/metrics").text
        assert 'jaxcb:lora_requests_total{lora_name="a1",model_name="base"}' in metrics
        assert 'jaxcb:lora_generation_tokens_total{lora_name="a2",model_name="base"} 6.0' in metrics
        assert "jaxcb:lora_requests_info{" in metrics and 'max_lora="2"' in metrics
    assert engine.num_recompiles == 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
    assert engine.lora.slots.num_held == 0


def test_runtime_loading_is_off_unless_allowed(setup):
    overrides, engine, adapters, _ = setup
    off = tuple(o for o in overrides if not o.startswith("server.allow_runtime_lora"))
    with running_server(*off, engine=engine) as (url, _):
        r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["a2"]},
                          headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 404
