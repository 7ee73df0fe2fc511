"""A checkpoint without a chat template: chat is refused by the server and by jobs (completions
work); server.chat_template supplies one."""

from __future__ import annotations

import json
import types

import httpx
import pytest

from hf_checkpoints import make_hf_llama, write_word_tokenizer
from jaxcb.jobs import generate_results, read_input
from server_harness import running_server

CHAT = {"messages": [{"role": "user", "content": "w5 w7"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def no_template_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("no-template")
    make_hf_llama(str(path))
    write_word_tokenizer(str(path), 131)  # tokenizer.json and tokenizer_config.json, no template
    return path


def test_chat_to_a_checkpoint_without_a_template_is_a_400_and_completions_still_work(no_template_checkpoint, tmp_path):
    with running_server("model=hf", f"model.checkpoint={no_template_checkpoint}", "model.dtype=float32") as (url, state):
        free = state.client.engine.block_pool.num_free_blocks
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": state.model_name, **CHAT}, timeout=60)
        assert chat.status_code == 400
        error = chat.json()["error"]
        assert "no chat template" in error["message"] and "server.chat_template" in error["message"]
        assert error["param"] == "messages"
        assert state.client.engine.block_pool.num_free_blocks == free and not state.client.engine.has_unfinished_requests()
        completion = httpx.post(f"{url}/v1/completions", json={"model": state.model_name, "prompt": "w5 w7", "max_tokens": 3}, timeout=60)
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3

        # The same refusal in a JSONL job: an error record for the chat, a result for the prompt.
        path = tmp_path / "in.jsonl"
        path.write_text(json.dumps({"id": "c", **CHAT}) + "\n" + json.dumps({"id": "p", "prompt": "w5", "max_tokens": 2}) + "\n")
        llm = types.SimpleNamespace(engine=state.client.engine, tokenizer=state.client.engine.tokenizer)
        results = {r["id"]: r for r in generate_results(llm, read_input(str(path)), max_in_flight=4)}
        assert "no chat template" in results["c"]["error"]
        assert len(results["p"]["token_ids"]) == 2


def test_server_chat_template_lets_chat_reach_a_checkpoint_without_one(no_template_checkpoint, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    overrides = ("model=hf", f"model.checkpoint={no_template_checkpoint}", "model.dtype=float32",
                 f"server.chat_template={template}")
    with running_server(*overrides) as (url, state):
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": state.model_name, **CHAT}, timeout=60)
        assert chat.status_code == 200
        assert chat.json()["usage"]["prompt_tokens"] == 2  # "w5 w7 " through the word tokenizer, no BOS added
