"""The /v1/responses and /tokenize doors under bad input: every refusal a 400 (404 for what is not stored) in
OpenAI's error shape whose `param` names the field, nothing queued or held, and the engine serving the next
request. Also what a well-formed body gets that OpenAI's API gives it: nulls as defaults, metadata kept,
the sampling actually used echoed."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from jaxcb.errors import InvalidRequestError
from jaxcb.sampling_defaults import SamplingDefaults
from server_harness import running_server

USER = {"role": "user", "content": "hi"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}


@pytest.fixture(scope="module")
def server():
    with running_server() as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def respond(url: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "temperature": 0, **fields}
    return httpx.post(url + "/v1/responses", json=body, timeout=60)


def assert_nothing_held(state) -> None:
    import time

    engine = state.client.engine
    deadline = time.monotonic() + 30  # (an abort reaches the engine's thread at its next step)
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1  # every block back


def assert_refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


@pytest.mark.parametrize("fields, param", [
    ({"input": ["hi"]}, "input.0"),
    ({"input": [None]}, "input.0"),
    ({"input": [{"role": "user", "content": [3]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "foo": 1}]}]},
     "input.0.content.0.foo"),
    ({"input": [{"role": "user", "content": "x", "status": "weird"}]}, "input.0.status"),
    # as OpenAI: a reply's parts are output_text, what is written to the model input_text
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [USER, {"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]},
     "input.1.content.0.type"),
    ({"input": [USER, CALL, {**RESULT, "call_id": "call_2"}]}, "input.2.call_id"),
    ({"input": [RESULT]}, "input.0.call_id"),
    ({"input": [USER, CALL]}, "input.1"),  # a call without its output (OpenAI: "No tool output found")
    ({"input": [USER, CALL, RESULT, {**CALL, "call_id": "call_2"}, USER]}, "input.3"),
    ({"input": [USER, CALL, {**RESULT, "output": [{"type": "input_image", "image_url": "x"}]}]}, "input.2.output.0"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "foo": 1}}}, "text.format.foo"),
    ({"text": {"format": {"type": "json_schema", "json_schema": {"name": "x"}}}}, "text.format.json_schema"),
    ({"text": {"format": {"type": "text", "foo": 1}}}, "text.format.foo"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    # the engine's refusal names the Responses field that asked for a grammar (no masked steps here)
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
])
def test_bad_responses_input_is_refused_naming_the_field_and_holds_nothing(server, fields, param):
    url, state = server
    assert_refused(respond(url, **fields), param)
    assert_nothing_held(state)


def test_the_engine_serves_the_next_response_after_refusals(server, client):
    url, state = server
    for fields in ({"input": [RESULT]}, {"metadata": "x"}, {"input": [{"type": "item_reference", "id": "m"}]}):
        assert respond(url, **fields).status_code == 400
    response = client.responses.create(model="tiny", input="hi", max_output_tokens=2, temperature=0)
    assert response.output_text and response.usage.output_tokens == 2
    assert_nothing_held(state)


def test_null_stream_store_and_verbosity_and_auto_tool_choice_without_tools_are_the_defaults(server, client):
    url, _ = server
    response = respond(url, stream=None, store=None, text={"verbosity": None}, tool_choice="auto")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["store"] is True and client.responses.retrieve(body["id"]).id == body["id"]


def test_a_function_call_output_answers_a_call_of_the_previous_response(server):
    url, _ = server
    first = respond(url, input=[USER, CALL, RESULT]).json()
    chained = respond(url, input=[{**RESULT, "call_id": "call_1"}], previous_response_id=first["id"])
    assert chained.status_code == 200, chained.text  # call_1 is in the stored conversation's input
    assert_refused(respond(url, input=[{**RESULT, "call_id": "call_9"}], previous_response_id=first["id"]),
                   "input.0.call_id")


def test_the_previous_responses_function_calls_need_their_outputs_in_input():
    from jaxcb.server.responses import _unanswered_call_ids, input_messages

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    for value in ("thanks", [USER]):
        with pytest.raises(InvalidRequestError, match="no tool output found for the function call 'c1' \\(the "
                                                      "previous response made\\)") as refusal:
            input_messages(value, frozenset({"c1"}), frozenset({"c1"}))
        assert refusal.value.field == "input"
    answered = input_messages([{**RESULT, "call_id": "c1"}], frozenset({"c1"}), frozenset({"c1"}))
    assert answered == [{"role": "tool", "tool_call_id": "c1", "content": RESULT["output"]}]
    assert _unanswered_call_ids(history) == {"c1"}  # a stored conversation's: its last reply's call
    assert _unanswered_call_ids(history + answered) == set()


def test_metadata_is_kept_with_the_response_and_the_stream_says_store_from_the_start(server, client):
    url, _ = server
    response = client.responses.create(model="tiny", input="hi", max_output_tokens=2, metadata={"run": "7"})
    assert response.metadata == {"run": "7"} and client.responses.retrieve(response.id).metadata == {"run": "7"}
    with httpx.stream("POST", url + "/v1/responses", timeout=60, json={
            "model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": True, "metadata": {"a": "b"}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["response"]["store"] for e in events if "response" in e] == [True, True, True]
    assert events[-1]["response"]["metadata"] == {"a": "b"}


def test_user_safety_identifier_and_prompt_cache_key_are_echoed_and_the_tier_is_default(server, client):
    url, _ = server
    response = client.responses.create(model="tiny", input="hi", max_output_tokens=2, user="u1",
                                       safety_identifier="s1", prompt_cache_key="k1", service_tier="flex")
    assert (response.user, response.safety_identifier, response.prompt_cache_key) == ("u1", "s1", "k1")
    assert response.service_tier == "default"  # the tier it was served at
    assert client.responses.retrieve(response.id).user == "u1"
    assert_refused(respond(url, user=5), "user")


def test_a_response_echoes_the_models_sampling_defaults_it_was_served_with(server, monkeypatch):
    url, state = server
    monkeypatch.setattr(state.client, "sampling_defaults", SamplingDefaults(temperature=0.6, top_p=0.9))
    body = respond(url, temperature=None).json()
    assert (body["temperature"], body["top_p"]) == (0.6, 0.9)
    body = respond(url, temperature=0.3, top_p=0.5).json()
    assert (body["temperature"], body["top_p"]) == (0.3, 0.5)


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": [2**64]}, "tokens.0"),
    ("/detokenize", {"tokens": [1, 1.0]}, "tokens.1"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/detokenize", {"tokens": [[1]]}, "tokens.0"),
    ("/detokenize", {"tokens": None}, "tokens"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": [USER], "continue_final_message": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": [USER], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ("/tokenize", {"messages": [USER], "tools": [{"type": "function", "name": "f"}]}, "tools.0.function"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "input_image"}]}]}, "messages.0.content.0"),
])
def test_bad_tokenize_and_detokenize_bodies_are_refused_naming_the_field(server, path, body, param):
    url, state = server
    assert_refused(httpx.post(url + path, json=body, timeout=60), param)
    tokens = httpx.post(url + "/tokenize", json={"prompt": "hi", "return_token_strs": True}, timeout=60).json()
    assert tokens["count"] == len(tokens["token_strs"]) == 3
    assert_nothing_held(state)


@pytest.mark.parametrize("query", ["stream=true", "include[]=message.output_text.logprobs", "starting_after=3"])
def test_a_stored_responses_query_parameters_are_refused_by_name(server, query):
    url, state = server
    stored = respond(url).json()["id"]
    got = httpx.get(f"{url}/v1/responses/{stored}?{query}", timeout=60)
    assert_refused(got, query.split("=")[0])
    assert httpx.get(f"{url}/v1/responses/{stored}", timeout=60).json()["id"] == stored


@pytest.mark.parametrize("method, route", [("GET", "input_items")])
def test_the_response_routes_jaxcb_does_not_serve_say_so_in_a_sentence(server, method, route):
    url, _ = server
    got = httpx.request(method, f"{url}/v1/responses/resp_x/{route}", timeout=60)
    assert got.status_code == 404 and f"/v1/responses/{{id}}/{route} is not served by jaxcb" in got.json()["error"]["message"]


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_chat_text_parts_with_keys_jaxcb_would_drop_are_refused_by_name(server):
    url, state = server
    part = {"type": "text", "text": "hi", "foo": 1}
    assert_refused(chat(url, messages=[{"role": "user", "content": [part]}]), "messages.0.content.0.foo")
    assert chat(url, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]).status_code == 200
    assert_nothing_held(state)


def test_a_chat_grammar_this_server_cannot_run_names_the_field_that_asked_for_it(server):
    """This server compiled no masked step: the refusal names response_format or tool_choice, not
    the engine's structured_outputs."""
    url, state = server
    assert_refused(chat(url, response_format={"type": "json_object"}), "response_format")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert_refused(chat(url, tools=tools, tool_choice="required"), "tool_choice")
    assert_refused(chat(url, tools=tools, tool_choice="required", response_format={"type": "text"}), "tool_choice")
    assert_refused(chat(url, structured_outputs={"choice": ["a", "b"]}), "structured_outputs")
    assert_nothing_held(state)


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_echoed(server):
    url, state = server
    assert_refused(respond(url, reasoning={"effort": "high"}), "reasoning.effort")  # the tiny template reads none
    tokenizer = state.client.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = ("{{ reasoning_effort | default('medium') }}:"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    try:
        response = respond(url, reasoning={"effort": "high"})
        assert response.status_code == 200, response.text
        assert response.json()["reasoning"] == {"effort": "high", "summary": None}
        assert response.json()["usage"]["input_tokens"] == len("high:hi") + 1  # and <bos>
    finally:
        tokenizer.chat_template = template
    assert_refused(respond(url, reasoning={"summary": "auto"}), "reasoning.summary")


def wait_while_running(client, response_id: str, timeout_s: float = 60):
    import time

    deadline = time.monotonic() + timeout_s
    while (got := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, got.status
        time.sleep(0.02)
    return got


def test_a_background_response_answers_at_once_and_is_polled_to_the_foregrounds_result(server, client):
    url, state = server
    asked = dict(model="tiny", input="hello", max_output_tokens=12, temperature=0)
    started = client.responses.create(**asked, background=True)
    assert started.status == "queued" and started.background is True and started.output == []
    done = wait_while_running(client, started.id)
    foreground = client.responses.create(**asked)
    assert done.status == foreground.status and done.output_text == foreground.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens and done.background is True
    later = client.responses.create(model="tiny", input="and?", max_output_tokens=2, previous_response_id=done.id)
    assert later.usage.input_tokens > done.usage.input_tokens  # it continued the background response's conversation
    assert_nothing_held(state)


def test_a_background_response_is_cancelled_or_deleted_mid_run_and_its_request_aborted(server, client):
    url, state = server
    running = client.responses.create(model="tiny", input="hello", max_output_tokens=200, temperature=0,
                                      background=True)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    assert_refused(httpx.post(f"{url}/v1/responses/{running.id}/cancel", timeout=60), "response_id")  # once
    with pytest.raises(openai.BadRequestError, match="ended cancelled, with no reply to continue"):
        client.responses.create(model="tiny", input="x", previous_response_id=running.id)
    assert_refused(httpx.post(f"{url}/v1/responses/{respond(url).json()['id']}/cancel", timeout=60), "response_id")
    running = client.responses.create(model="tiny", input="hello", max_output_tokens=200, temperature=0,
                                      background=True)
    client.responses.delete(running.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    assert_nothing_held(state)


def test_a_background_response_still_running_cannot_be_continued_yet():
    from jaxcb.server.protocol import APIError
    from jaxcb.server.response_store import ResponseStore

    store = ResponseStore(4)
    store.put({"id": "resp_1", "status": "in_progress"}, None)
    with pytest.raises(APIError, match="is a background response still in_progress: continue it once"):
        store.history("resp_1")
    store.put({"id": "resp_1", "status": "completed"}, [USER])
    assert store.history("resp_1") == (USER,)


def test_a_running_background_response_is_never_dropped_from_the_store_and_their_number_is_capped(tmp_path):
    from engine_factory import shared_engine

    with running_server("server.responses_store_size=2", engine=shared_engine()) as (url, state):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        long = dict(model="tiny", input="hello", max_output_tokens=200, temperature=0, background=True)
        first = client.responses.create(**long)
        for _ in range(3):  # more stored responses than the store holds: the finished ones go, not the running one
            respond(url)
        assert client.responses.retrieve(first.id).status in ("queued", "in_progress")
        second = client.responses.create(**long)
        with pytest.raises(openai.RateLimitError, match="2 background responses are running"):
            client.responses.create(**long)
        stored = respond(url).json()  # with every other response running, the one just stored stays
        assert stored["store"] is True and httpx.get(f"{url}/v1/responses/{stored['id']}", timeout=60).status_code == 200
        for running in (first, second):
            assert client.responses.cancel(running.id).status == "cancelled"
        from server_harness import post_all_at_once

        burst = post_all_at_once(url, "/v1/responses", [{**long, "model": "tiny"} for _ in range(6)])
        started = [r.json()["id"] for r in burst if r.status_code == 200]  # at once: still at most 2 run
        assert len(started) <= 2 and all(r.status_code in (200, 429) for r in burst)
        for response_id in started:
            client.responses.cancel(response_id)
        assert_nothing_held(state)


def test_a_background_response_is_one_span_recorded_when_it_ends():
    import time

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine_factory import BASE, shared_engine
    from jaxcb.config import compose_config
    from jaxcb.server.app import build_app
    from jaxcb.server.run import serve_app_in_thread

    exporter = InMemorySpanExporter()
    cfg = compose_config(BASE + ("server.otlp_endpoint=http://127.0.0.1:4318/v1/traces",))
    with serve_app_in_thread(build_app(cfg, shared_engine(), span_exporter=exporter), start_timeout_s=60) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        started = client.responses.create(model="tiny", input="hi", max_output_tokens=5, temperature=0,
                                          background=True)
        done = wait_while_running(client, started.id)
        deadline = time.monotonic() + 10
        while not exporter.get_finished_spans() and time.monotonic() < deadline:
            time.sleep(0.01)
    [span] = exporter.get_finished_spans()
    assert span.attributes["gen_ai.request.id"] == started.id
    assert span.attributes["gen_ai.usage.completion_tokens"] == done.usage.output_tokens


def test_a_background_response_streams_and_its_stream_resumes_after_any_event(server, client):
    """background + stream (OpenAI's): the POST streams its events; a client that leaves does not stop it; GET
    ?stream=true&starting_after=N gives the events after N, while it runs and after it has ended."""
    url, state = server
    events = list(client.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0,
                                          background=True, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    response_id = events[0].response.id
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[4:]]
    assert client.responses.retrieve(response_id).output_text == events[-1].response.output_text
    with httpx.stream("POST", url + "/v1/responses", json={"model": "tiny", "input": "hello", "stream": True,
                                                           "background": True, "max_output_tokens": 30}) as r:
        lines = r.iter_lines()  # the client leaves after the first event
        assert next(lines).startswith("event: response.created")
        left = json.loads(next(lines)[len("data: "):])["response"]["id"]
    assert wait_while_running(client, left).status in ("completed", "incomplete")  # it ran on, whole
    for query, param in (("starting_after=2", "starting_after"), ("stream=yes", "stream"),
                         ("stream=true&starting_after=-5", "starting_after"),
                         ("stream=true&starting_after=--5", "starting_after"),
                         ("stream=true&starting_after=%C2%B2", "starting_after"),  # a superscript two
                         ("stream=true&starting_after=" + "1" * 5000, "starting_after")):
        assert_refused(httpx.get(f"{url}/v1/responses/{response_id}?{query}", timeout=60), param)
    assert_refused(httpx.get(f"{url}/v1/responses/{respond(url).json()['id']}?stream=true", timeout=60), "stream")
    assert_nothing_held(state)
