"""Fail closed: every request field is honoured, ignored by name (harmless OpenAI fields), or
refused with a 400 naming it -- never dropped. Hostile bodies are 400s, and nothing is queued."""

from __future__ import annotations

import json

import httpx
import pytest

from jaxcb.errors import InvalidRequestError
from jaxcb.jobs import JobContext, plan_record, read_input
from jaxcb.server.protocol import ChatCompletionRequest, CompletionRequest
from jaxcb.request_fields import HONOURED_VALUES, IGNORED, NOT_SUPPORTED, check_fields
from server_harness import running_server

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
SAMPLE_VALUES = {  # a value of the shape a client would send, for each refused field
    "best_of": 3, "guided_json": {"type": "object"}, "functions": [{"name": "f"}], "suffix": "end", "echo": True,
}


@pytest.fixture(scope="module")
def server():
    with running_server() as (url, state):
        yield url, state


def post(url, path, body):
    return httpx.post(f"{url}{path}", content=body if isinstance(body, (bytes, str)) else json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"})


def assert_nothing_queued(state):
    pool = state.client.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1 and not state.client.engine.has_unfinished_requests()


# Every refused field on every endpoint that does not honour it (echo, say, is honoured by completions only).
REFUSED = [(path, body, field) for path, body, request in (("/v1/chat/completions", CHAT, ChatCompletionRequest),
                                                           ("/v1/completions", COMPLETION, CompletionRequest))
           for field in sorted(NOT_SUPPORTED) if field not in request.model_fields]


@pytest.mark.parametrize("path, body, field", REFUSED)
def test_every_field_jaxcb_does_not_honour_is_a_400_that_names_it(server, path, body, field):
    url, state = server
    value = SAMPLE_VALUES.get(field, "x")
    r = post(url, path, {**body, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert_nothing_queued(state)


def test_legacy_guided_fields_name_their_replacement(server):
    r = post(server[0], "/v1/chat/completions", {**CHAT, "guided_regex": "a+"})
    assert "replaced by structured_outputs.regex" in r.json()["error"]["message"]


def test_unknown_fields_and_unknown_message_fields_are_refused_by_name(server):
    url, state = server
    r = post(url, "/v1/completions", {**COMPLETION, "temprature": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temprature"
    assert "not a field jaxcb knows" in r.json()["error"]["message"]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "index": 0}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "x"}]
    r = post(url, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.tool_calls.0.index"
    r = post(url, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    assert_nothing_queued(state)


@pytest.mark.parametrize("field", sorted(IGNORED))
def test_harmless_openai_fields_are_accepted(server, field):
    r = post(server[0], "/v1/chat/completions", {**CHAT, field: {"k": "v"} if field == "metadata" else "x"})
    assert r.status_code == 200, r.text


def test_fields_whose_value_is_what_jaxcb_does_are_accepted(server):
    url, _ = server
    for field, values in HONOURED_VALUES.items():
        if field in ("tool_calls", "refusal"):
            continue  # message fields
        r = post(url, "/v1/completions", {**COMPLETION, field: values[-1]})
        assert r.status_code == 200, (field, r.text)
    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "yo", "refusal": None}]
    assert post(url, "/v1/chat/completions", {**CHAT, "messages": messages}).status_code == 200


@pytest.mark.parametrize("body, message", [
    ("[" * 50_000 + "]" * 50_000, "nests JSON too deeply"),
    ('{"model": "tiny", "prompt": "hi", "temperature": NaN}', "NaN is not a valid JSON number"),
    ('{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "Infinity is not a valid JSON number"),
    ("[1, 2]", "must be a JSON object, not list"),
    ('"hi"', "must be a JSON object, not str"),
    ("3", "must be a JSON object, not int"),
])
def test_hostile_bodies_are_400s_and_the_engine_keeps_serving(server, body, message):
    url, state = server
    r = post(url, "/v1/completions", body)
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert post(url, "/v1/completions", COMPLETION).status_code == 200
    assert_nothing_queued(state)


def test_priority_under_a_policy_that_ignores_it_names_the_policy_that_uses_it(server):
    r = post(server[0], "/v1/completions", {**COMPLETION, "priority": 3})
    assert r.status_code == 400 and "scheduler.policy=priority" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "priority"
    assert post(server[0], "/v1/completions", {**COMPLETION, "priority": 0}).status_code == 200


def test_job_records_are_refused_by_the_same_table(tmp_path):
    from jaxcb.config import compose_config

    # No model: these records are refused before a tokenizer or an engine is needed.
    llm = JobContext(compose_config(()), tokenizer=None, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="guided_json is vLLM's legacy field") as e:
        plan_record(llm, {"id": "a", "prompt": "hi", "guided_json": {"type": "object"}})
    assert e.value.field == "guided_json"
    with pytest.raises(InvalidRequestError, match="structured_outputs.backend"):
        plan_record(llm, {"id": "a", "prompt": "hi", "structured_outputs": {"json": {}, "backend": "xgrammar"}})
    with pytest.raises(InvalidRequestError, match="messages.0.tool_calls.0.id") as e:  # a chat body's own types
        plan_record(llm, {"id": "a", "messages": [{"role": "assistant", "content": "", "tool_calls": [{}]}]})
    assert e.value.field == "messages.0.tool_calls.0.id"
    assert check_fields({"id": "a", "user": "u", "prompt": "x"}, {"id", "prompt"}) == {"id": "a", "prompt": "x"}
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "deep", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}\n"
                    '{"id": "nan", "prompt": "x", "temperature": NaN}\n')
    errors = [r.error for r in read_input(str(path))]
    assert "nests JSON too deeply" in errors[0] and "NaN is not a valid JSON number" in errors[1]


def test_docs_api_names_every_ignored_refused_and_honoured_value_field():
    import os

    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "api.md")).read()
    missing = [f for f in sorted(IGNORED | set(NOT_SUPPORTED) | set(HONOURED_VALUES)) if f"`{f}" not in doc]
    assert not missing, f"docs/api.md does not list {missing}"
