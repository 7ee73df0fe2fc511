"""Structured outputs and tool calls through the HTTP API with the official openai client, on the random
tiny model: only the grammar keeps its replies valid, so every check here is the grammar's doing."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from engine_factory import VARIANTS
from server_harness import running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


@pytest.fixture(scope="module")
def server():
    with running_server(*VARIANTS, "engine.max_model_len=1024") as (url, state):  # tools make the byte-level prompt long
        yield url, state


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def assert_valid_calls(calls, allowed=("get_weather", "get_time"), exactly_one=False):
    assert calls, "tool_choice forces at least one call"
    if exactly_one:
        assert len(calls) == 1
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_openai_parse_with_a_pydantic_model_round_trips(client):
    for seed in range(6):
        completion = client.beta.chat.completions.parse(
            model="tiny", messages=ASK, response_format=Person, temperature=1.0, seed=seed, max_tokens=80)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person), choice.message.content


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_always_gives_calls_whose_arguments_validate(client, parallel):
    finishes = []
    for seed in range(8):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=200)
        choice = r.choices[0]
        finishes.append(choice.finish_reason)
        # parallel: a random model may go on calling until max_tokens; the calls it finished are all valid
        assert choice.finish_reason == "tool_calls" or (parallel and choice.finish_reason == "length"), choice
        assert_valid_calls(choice.message.tool_calls, exactly_one=not parallel)
    assert "tool_calls" in finishes


def test_a_named_tool_choice_always_calls_that_function(client):
    for seed in range(6):
        r = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=seed, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert r.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(r.choices[0].message.tool_calls, allowed=("get_time",), exactly_one=True)


def test_streamed_tool_calls_concatenate_to_the_non_streamed_call(client):
    for seed, parallel in [(0, False), (1, False), (2, False), (3, True), (4, True), (5, True)]:
        kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0,
                  seed=seed, max_tokens=200, parallel_tool_calls=parallel)
        whole = client.chat.completions.create(**kw).choices[0]
        calls: dict[int, dict] = {}
        content, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                delta = choice.delta
                content += delta.content or ""
                for d in delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    if d.id:
                        assert call["id"] is None, "the id comes once, on the call's first piece"
                        call["id"] = d.id
                    if d.function and d.function.name:
                        call["name"] += d.function.name
                    if d.function and d.function.arguments:
                        call["arguments"] += d.function.arguments
                finish = choice.finish_reason or finish
        streamed = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert finish == whole.finish_reason
        if finish == "length":  # cut inside a call: the stream already sent that call's start
            streamed = streamed[: len(expected)]
        else:
            assert content == (whole.message.content or "")
        assert streamed == expected


def test_a_full_tool_round_trip_call_result_next_turn(client):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=120)
    message = first.choices[0].message
    assert_valid_calls(message.tool_calls, allowed=("get_weather",))
    call = message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    second = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=12)
    reply = second.choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_tool_choice_auto_reads_calls_the_model_writes(server):
    # On a random model "auto" mostly yields text; a logit_bias-free way to see the parser work: a reply
    # forced by a regex into hermes syntax, with tool_choice auto.
    import httpx

    call = '<tool_call>{"name":"get_time","arguments":{"zone":"utc"}}</tool_call>'
    body = {"model": "tiny", "messages": ASK, "tools": [TIME], "tool_choice": "auto", "max_tokens": 80,
            "structured_outputs": {"regex": "Sure\\. " + call.replace("{", "\\{").replace("}", "\\}")}}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [tc] = choice["message"]["tool_calls"]
    assert tc["function"] == {"name": "get_time", "arguments": '{"zone":"utc"}'}


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ({"tools": [TIME], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"logit_bias": {"5": 300}}, "logit_bias"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    # a tool's schema the call grammar cannot compile: the tools are at fault, not tool_choice
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/defs/nope"}}}}}]}, "tools"),
])
def test_constraints_that_cannot_be_honoured_are_400s_naming_the_field(server, body, param):
    import httpx

    url, state = server
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    pool = state.client.engine.block_pool
    assert not state.client.engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks - 1


def test_completions_take_structured_outputs_logit_bias_and_bad_words(client):
    r = client.completions.create(model="tiny", prompt="pick", max_tokens=10, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="pick", max_tokens=6, temperature=0,
                                  logit_bias={str(ord("z")): 100})
    assert r.choices[0].text == "zzzzzz"
    r = client.completions.create(model="tiny", prompt="pick", max_tokens=30, temperature=0,
                                  logit_bias={str(ord("z")): 100}, extra_body={"bad_words": ["z"]})
    assert "z" not in r.choices[0].text
