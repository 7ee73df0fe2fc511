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


def sse_chunks(response) -> list[dict]:
    """A streamed response's JSON chunks (not its [DONE])."""
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


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
    # A lone UTF-16 surrogate is no text: it reached the tokenizer, a block hash (on the engine's thread)
    # or a batch's output file before, and took the engine or the batch down.
    (r'{"model": "tiny", "prompt": "a\ud800b"}', "lone UTF-16 surrogate escape (\\uD800-\\uDFFF) at prompt"),
    (r'{"model": "tiny", "prompt": "' + "a" * 40 + r'", "cache_salt": "\ud800"}', "at cache_salt"),
    (r'{"model": "tiny", "messages": [{"role": "user", "content": "\udc00"}]}', "at messages.0.content"),
    (r'{"model": "tiny", "prompt": "hi", "\ud800": 1}', "in a key of the top-level object"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", "more than 4,300 digits"),
    ('{"model": "tiny", "prompt": "hi", "timeout": 1e400}', "the number 1e400 is past the range of a 64-bit float"),
    ('{"model": "tiny", "prompt": "hi", "timeout": 1' + "0" * 400 + "}", "must be a finite number of seconds"),
    ('{"model": "tiny", "prompt": "hi", "logit_bias": {"5": 1' + "0" * 400 + "}}", "logit_bias['5']="),
    ('{"model": "tiny", "prompt": "hi", "logit_bias": {"\u00b2": 1}}', "logit_bias keys must be token ids"),
    ('{"model": "tiny", "prompt": "hi", "logit_bias": {"\uff15": 1}}', "logit_bias keys must be token ids"),
    ('{"model": "tiny", "prompt": "hi", "seed": 18446744073709551616}', "seed=18446744073709551616 must fit in 64 bits"),
])
def test_hostile_bodies_are_400s_and_the_engine_keeps_serving(server, body, message):
    url, state = server
    r = post(url, "/v1/completions" if '"messages"' not in body else "/v1/chat/completions", body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert post(url, "/v1/completions", COMPLETION).status_code == 200
    assert_nothing_queued(state)


def test_a_top_k_past_the_vocabulary_is_no_limit_and_the_engine_keeps_serving(server):
    # Written into the step's int32 slots as it was, 2**31 stopped the engine loop for good.
    url, state = server
    body = {**COMPLETION, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    texts = []
    for top_k in (2**31, 10**30, 0):
        r = post(url, "/v1/completions", {**body, "top_k": top_k})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert_nothing_queued(state)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def tool(**function):
    return {"type": "function", "function": {**TOOL["function"], **function}}


@pytest.mark.parametrize("path, change, param", [
    # each was accepted and then ignored, rendered into the prompt as given, or answered with a Python error
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"max_tokens": 2, "max_completion_tokens": 6}, "max_completion_tokens"),
    ("/v1/chat/completions", {"tools": [tool(name="")], "tool_choice": "auto"}, "tools.0.function.name"),
    ("/v1/chat/completions", {"tools": [tool(name='a b"c</tool_call>')]}, "tools.0.function.name"),
    ("/v1/chat/completions", {"tools": [TOOL, TOOL], "tool_choice": "none"}, "tools.1.function.name"),
    ("/v1/chat/completions", {"tools": [tool(parameters={"type": "string"})]}, "tools.0.function.parameters"),
    ("/v1/chat/completions", {"tools": [tool(parameters={"type": "object", "properties": 3})]},
     "tools.0.function.parameters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_call_id": "c1"}]},
     "messages.0.tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
])
def test_fields_that_contradict_or_misplace_are_refused_naming_them(server, path, change, param):
    url, state = server
    r = post(url, path, {**(CHAT if "chat" in path else COMPLETION), **change})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert_nothing_queued(state)


def test_agreeing_max_tokens_tools_under_auto_and_stream_options_on_a_stream_are_served(server):
    url, _ = server
    for change in ({"max_tokens": 2, "max_completion_tokens": 2}, {"tools": [TOOL], "tool_choice": "auto"},
                   {"stream": True, "stream_options": {"include_usage": True}}):
        r = post(url, "/v1/chat/completions", {**CHAT, **change})
        assert r.status_code == 200, (change, r.text)


def test_a_too_long_chat_names_what_the_client_sent(server):
    url, state = server
    long = [{"role": "user", "content": "a" * state.client.max_model_len}]
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": long})  # no max_tokens: not its fault
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": CHAT["messages"],
                                           "max_completion_tokens": state.client.max_model_len})
    error = r.json()["error"]
    assert error["param"] == "max_completion_tokens" and "max_tokens" not in error["message"].replace(
        "max_completion_tokens", ""), error


def test_seeds_that_differ_past_32_bits_draw_differently_and_each_draws_the_same_again(server):
    url, _ = server
    body = {**COMPLETION, "max_tokens": 8, "temperature": 1.0}
    texts = {seed: post(url, "/v1/completions", {**body, "seed": seed}).json()["choices"][0]["text"]
             for seed in (1, 2**32 + 1, 2**64 - 1, -(2**63))}
    assert len(set(texts.values())) == 4  # cut to 32 bits, the first two were one seed
    assert post(url, "/v1/completions", {**body, "seed": 2**32 + 1}).json()["choices"][0]["text"] == texts[2**32 + 1]


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
                    '{"id": "nan", "prompt": "x", "temperature": NaN}\n'
                    '{"id": "lone", "prompt": "x\\ud800"}\n')
    errors = [r.error for r in read_input(str(path))]
    assert "nests JSON too deeply" in errors[0] and "NaN is not a valid JSON number" in errors[1]
    assert "lone UTF-16 surrogate" in errors[2] and "at prompt" in errors[2]


def test_docs_api_names_every_ignored_refused_and_honoured_value_field():
    import os

    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "api.md")).read()
    missing = [f for f in sorted(IGNORED | set(NOT_SUPPORTED) | set(HONOURED_VALUES)) if f"`{f}" not in doc]
    assert not missing, f"docs/api.md does not list {missing}"


def test_add_special_tokens_false_encodes_a_completions_text_prompt_without_bos_by_every_door(server):
    """vLLM's field: a prompt that already holds its specials (a chat written by hand) gets no second BOS. Chat's
    template writes them itself: true there is refused, naming the field."""
    from jaxcb.config import compose_config
    from jaxcb.prompts import EncodedText
    from jaxcb.tokenizer import ByteTokenizer

    url, state = server
    counts = {}
    for flag in (True, False):
        r = post(url, "/v1/completions", {**COMPLETION, "echo": True, "add_special_tokens": flag})
        assert r.status_code == 200, r.text
        counts[flag] = r.json()["usage"]["prompt_tokens"]
        assert r.json()["choices"][0]["text"].startswith("hi")  # echo gives the text back as sent
    assert counts == {True: 3, False: 2}  # <bos> h i, then h i
    r = post(url, "/v1/chat/completions", {**CHAT, "add_special_tokens": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
    assert "template writes the special tokens" in r.json()["error"]["message"]
    assert_nothing_queued(state)
    ctx = JobContext(compose_config(()), tokenizer=ByteTokenizer(), max_model_len=64)
    _, planned = plan_record(ctx, {"id": "a", "prompt": ["hi", "yo"], "add_special_tokens": False})
    assert planned.prompts == [EncodedText("hi", (104, 105)), EncodedText("yo", (121, 111))]
    assert plan_record(ctx, {"id": "a", "prompt": [1, 2], "add_special_tokens": False})[1].prompts == [[1, 2]]


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string_by_every_door(server):
    url, _ = server
    body = {**COMPLETION, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = post(url, "/v1/completions", body).json()["choices"][0]["text"]
    assert len(whole) >= 4, whole
    stop = whole[len(whole) // 2: len(whole) // 2 + 2]
    cut = whole.index(stop)
    for include, want in ((False, whole[:cut]), (True, whole[:cut + len(stop)])):
        for stream in (False, True):
            r = post(url, "/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": include,
                                              "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                chunks = sse_chunks(r)
                text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            else:
                text = r.json()["choices"][0]["text"]
            assert text == want, (include, stream)
    from jaxcb.config import compose_config

    ctx = JobContext(compose_config(()), tokenizer=None, max_model_len=64)
    _, planned = plan_record(ctx, {"id": "a", "prompt": "hi", "stop": "x", "include_stop_str_in_output": True})
    assert planned.params.include_stop_str_in_output


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_by_every_door(server):
    """vLLM's field: the last k tokens of the prompt (of the rendered chat too); -1 keeps engine.max_model_len of
    them."""
    from jaxcb.prompts import EncodedText, prompt_text_and_ids, tokens_to_keep, truncated
    from jaxcb.tokenizer import ByteTokenizer

    url, state = server
    long = "abcdefghij" * 30  # 301 tokens with <bos>: more than the tiny server's max_model_len
    for path, body in (("/v1/completions", {**COMPLETION, "prompt": long, "echo": True}),
                       ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": long}]})):
        assert post(url, path, body).status_code == 400  # too long without it
        r = post(url, path, {**body, "truncate_prompt_tokens": 20})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 20
        if "prompt" in body:  # the BOS kept, as vLLM keeps it; echo gives back the text the model read
            assert r.json()["choices"][0]["text"].startswith(long[-19:])
        for bad in (0, -2, state.client.max_model_len + 1):
            r = post(url, path, {**body, "truncate_prompt_tokens": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert_nothing_queued(state)
    tok = ByteTokenizer()  # the engine cuts: one place for every door (LLM.generate's SamplingParams too)
    for prompt, kept in (("hi", [256, 104, 105]), (list(range(1, 10)), list(range(2, 10))),
                         ("abcdefghi", [256] + list(b"cdefghi")),  # <bos> kept, as vLLM keeps it
                         (EncodedText("abcdefghi", tuple(b"abcdefghi")), list(b"bcdefghi"))):
        text, ids = prompt_text_and_ids(prompt, tok)
        assert truncated(prompt, text, ids, tokens_to_keep(-1, 8), tok)[1] == kept
    with pytest.raises(InvalidRequestError, match="no room for the prompt's text") as e:
        truncated("abc", "abc", tok.encode("abc"), 1, tok)
    assert e.value.field == "truncate_prompt_tokens"


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id_by_every_door(server):
    url, _ = server
    for stream in (False, True):
        r = post(url, "/v1/completions", {**COMPLETION, "logprobs": 2, "stream": stream, "ignore_eos": True,
                                          "return_tokens_as_token_ids": True})
        chunks = sse_chunks(r) if stream else [r.json()]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        tops = [k for c in choices if c["logprobs"] for top in c["logprobs"]["top_logprobs"] for k in top]
        assert len(tokens) == 2 and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens + tops)
        r = post(url, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": stream,
                                               "ignore_eos": True, "return_tokens_as_token_ids": True})
        chunks = sse_chunks(r) if stream else [r.json()]
        content = [e for chunk in chunks for c in chunk["choices"] if c.get("logprobs")
                   for e in c["logprobs"]["content"]]
        assert len(content) == 2 and all(e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode())
                                         and all(t["token"].startswith("token_id:") for t in e["top_logprobs"])
                                         for e in content)
    from types import SimpleNamespace

    from jaxcb.config import compose_config
    from jaxcb.server import openai_format as fmt
    from jaxcb.tokenizer import ByteTokenizer

    out = SimpleNamespace(prompt_logprobs=[None, {104: -1.0}])  # keyed by id already: decoded_token stays text
    assert fmt.prompt_logprobs(ByteTokenizer(), out) == [None, {"104": {"logprob": -1.0, "decoded_token": "h"}}]
    ctx = JobContext(compose_config(()), tokenizer=None, max_model_len=64)
    record = {"id": "a", "prompt": "hi", "return_tokens_as_token_ids": True}
    assert plan_record(ctx, record)[0].return_tokens_as_token_ids


def test_documents_reach_a_template_that_renders_them_and_are_refused_where_it_does_not(server):
    """vLLM's RAG field, passed to the chat template as transformers passes it; a template without documents
    would drop them silently (as vLLM does), so there it is a 400 naming the field."""
    from jaxcb.server.protocol import parse_request
    from jaxcb.server.requests import plan_chat_completion
    from jaxcb.server.tool_parsers import get_tool_parser
    from jaxcb.tokenizer import ByteTokenizer

    url, state = server
    docs = [{"title": "t", "text": "the sky is green"}]
    r = post(url, "/v1/chat/completions", {**CHAT, "documents": docs})  # the tiny model's template has no documents
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
    assert_nothing_queued(state)
    tok = ByteTokenizer()
    tok.chat_template = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "documents": docs}
    planned = plan_chat_completion(ChatCompletionRequest(**body), tok, get_tool_parser("auto", None), 256)
    assert tok.decode(planned.prompts[0]) == "[t: the sky is green]hi"
    with pytest.raises(InvalidRequestError) as e:
        parse_request(ChatCompletionRequest, {**body, "documents": [{"title": 5}]})
    assert e.value.field == "documents.0.title"


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_where_it_does_not(server):
    from jaxcb.server.protocol import ChatCompletionRequest
    from jaxcb.server.requests import plan_chat_completion
    from jaxcb.server.tool_parsers import get_tool_parser
    from jaxcb.tokenizer import ByteTokenizer

    url, state = server
    r = post(url, "/v1/chat/completions", {**CHAT, "reasoning_effort": "low"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    assert "does not read a reasoning effort" in r.json()["error"]["message"]
    assert post(url, "/v1/chat/completions", {**CHAT, "reasoning_effort": "huge"}).json()["error"]["param"] == \
        "reasoning_effort"
    assert_nothing_queued(state)
    tok = ByteTokenizer()
    tok.chat_template = "effort={{ reasoning_effort | default('medium') }}:{{ messages[0].content }}"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}
    planned = plan_chat_completion(ChatCompletionRequest(**body), tok, get_tool_parser("auto", None), 256)
    assert tok.decode(planned.prompts[0]) == "effort=high:hi"
    medium = {**body, "reasoning_effort": "medium"}  # the template's own default: read all the same
    planned = plan_chat_completion(ChatCompletionRequest(**medium), tok, get_tool_parser("auto", None), 256)
    assert tok.decode(planned.prompts[0]) == "effort=medium:hi"
    twice = {**body, "chat_template_kwargs": {"reasoning_effort": "low"}}
    with pytest.raises(InvalidRequestError) as e:
        plan_chat_completion(ChatCompletionRequest(**twice), tok, get_tool_parser("auto", None), 256)
    assert e.value.field == "chat_template_kwargs.reasoning_effort"
    alone = {k: v for k, v in twice.items() if k != "reasoning_effort"}  # vLLM's other way of passing it
    planned = plan_chat_completion(ChatCompletionRequest(**alone), tok, get_tool_parser("auto", None), 256)
    assert tok.decode(planned.prompts[0]) == "effort=low:hi"


def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk(server):
    url, _ = server
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/completions", {**COMPLETION, "max_tokens": 4, "n": 2}),
                       ("/v1/chat/completions", {**CHAT, "max_tokens": 4, "n": 2})):
        r = post(url, path, {**body, "stream": True, "stream_options": options, "ignore_eos": True})
        chunks = sse_chunks(r)
        *with_choices, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
        prompt = last["usage"]["prompt_tokens"]
        counts: dict[int, list[int]] = {}
        for chunk in with_choices:
            [choice] = chunk["choices"]
            usage = chunk["usage"]
            assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
            counts.setdefault(choice["index"], []).append(usage["completion_tokens"])
        assert all(c == sorted(c) and c[-1] == 4 for c in counts.values()) and len(counts) == 2, counts
        refused = post(url, path, {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "stream_options.continuous_usage_stats"


def test_return_token_ids_gives_the_prompts_and_each_choices_token_ids_where_vllm_puts_them(server):
    url, _ = server
    prompt_ids = [256] + list(b"hi")  # the tiny model's byte tokenizer: <bos> h i
    for stream in (False, True):
        body = {**COMPLETION, "max_tokens": 3, "n": 2, "ignore_eos": True, "stream": stream, "return_token_ids": True}
        r = post(url, "/v1/completions", body)
        choices = [c for chunk in (sse_chunks(r) if stream else [r.json()]) for c in chunk["choices"]]
        by_index: dict[int, list[int]] = {}
        for c in choices:
            by_index.setdefault(c["index"], []).extend(c["token_ids"])
        assert [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c] == [prompt_ids] * 2
        assert sorted(by_index) == [0, 1] and all(len(ids) == 3 for ids in by_index.values())
        r = post(url, "/v1/chat/completions", {**CHAT, "max_tokens": 3, "ignore_eos": True, "stream": stream,
                                               "return_token_ids": True})
        chunks = sse_chunks(r) if stream else [r.json()]
        assert len(chunks[0]["prompt_token_ids"]) > 3  # the rendered chat's
        ids = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids", [])]
        assert len(ids) == 3 and all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    from jaxcb.config import compose_config

    ctx = JobContext(compose_config(()), tokenizer=None, max_model_len=64)
    assert plan_record(ctx, {"id": "a", "prompt": "hi", "return_token_ids": True})[0].return_token_ids


def test_requests_in_flight_when_the_engine_loop_dies_get_503s_in_openais_shape():
    """An error inside the step itself stops the loop: a whole response is a 503 (not a bare 500), a stream ends
    with an error event, /health says so, and the next request is a 503 at once."""
    from engine_factory import make_engine

    engine = make_engine()

    def broken_step():
        raise RuntimeError("a device error")

    engine.step_with_stats = broken_step
    with running_server(engine=engine) as (url, _):
        r = post(url, "/v1/completions", COMPLETION)
        assert r.status_code == 503 and "a device error" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        r = post(url, "/v1/completions", {**COMPLETION, "stream": True})
        assert r.status_code == 503, r.text


def test_chat_echo_starts_the_reply_with_the_message_it_continues_as_vllm_does(server):
    url, _ = server
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {**CHAT, "messages": messages, "max_tokens": 3, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True}
    whole = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert whole.startswith("Once upon") and len(whole) > len("Once upon")
    chunks = sse_chunks(post(url, "/v1/chat/completions", {**body, "stream": True, "temperature": 0}))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    plain = post(url, "/v1/chat/completions", {**body, "echo": False, "temperature": 0}).json()
    assert streamed == "Once upon" + plain["choices"][0]["message"]["content"]
    # the last message is the user's, the reply the assistant's: nothing to echo (vLLM's rule)
    replies = [post(url, "/v1/chat/completions", {**CHAT, "echo": echo, "temperature": 0}).json()
               for echo in (True, False)]
    assert replies[0]["choices"][0]["message"]["content"] == replies[1]["choices"][0]["message"]["content"]


def test_a_key_given_twice_in_one_object_is_refused_by_every_door(server, tmp_path):
    """JSON keeps the last of a repeated key: the first would be dropped silently (a batch line: test_batches_door)."""
    url, state = server
    r = post(url, "/v1/completions", '{"model": "tiny", "prompt": "a", "max_tokens": 1, "prompt": "b"}')
    assert r.status_code == 400 and "gives the key 'prompt' more than once" in r.json()["error"]["message"]
    r = post(url, "/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a", '
                                          '"role": "system"}]}')
    assert r.status_code == 400 and "gives the key 'role' more than once" in r.json()["error"]["message"]
    assert_nothing_queued(state)
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "id": "b"}\n')
    assert "gives the key 'id' more than once" in read_input(str(path))[0].error


def test_request_id_names_the_response_and_an_x_request_id_header_wins_as_in_vllm(server):
    """vLLM's field and header: the response's id is the prefix and the client's id, whole and streamed, and the
    response's own X-Request-Id header gives the id back (a fresh one when the request gave none)."""
    from jaxcb.config import compose_config

    url, state = server
    for path, body, prefix in (("/v1/completions", COMPLETION, "cmpl-"), ("/v1/chat/completions", CHAT, "chatcmpl-")):
        r = post(url, path, {**body, "request_id": "trace-42.a"})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == prefix + "trace-42.a" and r.headers["x-request-id"] == "trace-42.a"
        r = httpx.post(url + path, json={**body, "request_id": "from-body", "stream": True},
                       headers={"X-Request-Id": "from-header"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "from-header"
        assert {c["id"] for c in sse_chunks(r)} == {prefix + "from-header"}
        ids = set()
        for _ in range(2):  # none given: a fresh id each time, the header its part after the prefix
            r = post(url, path, body)
            assert r.json()["id"] == prefix + r.headers["x-request-id"]
            ids.add(r.json()["id"])
        assert len(ids) == 2
        for bad in ("", "two words", "x" * 257, "caf\u00e9", "line\nbreak"):
            r = post(url, path, {**body, "request_id": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", (bad, r.text)
            assert "visible ASCII" in r.json()["error"]["message"]
        # A gateway's header this response cannot be named by is ignored, not the request refused (vLLM takes any)
        r = httpx.post(url + path, json=body, headers={"X-Request-Id": "a b"}, timeout=60)
        assert r.status_code == 200 and r.json()["id"] == prefix + r.headers["x-request-id"] != prefix + "a b"
        assert_nothing_queued(state)
    # Every answer to a request with the header carries it back: an error, a Responses answer.
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "temperature": -1}, headers={"X-Request-Id": "e-1"},
                   timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"] == "e-1"
    r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2},
                   headers={"X-Request-Id": "resp-1"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "resp-1" and r.json()["id"].startswith("resp_")
    r = post(url, "/v1/responses", {"model": "tiny", "input": "hi", "request_id": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert "stored under an id jaxcb chooses" in r.json()["error"]["message"]
    ctx = JobContext(compose_config(()), tokenizer=None, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="named by the record's id") as e:
        plan_record(ctx, {"id": "a", "prompt": "hi", "request_id": "x"})
    assert e.value.field == "request_id"
