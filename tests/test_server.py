"""The HTTP server with the official openai client: formats, streaming, errors, disconnects, overload."""

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from engine_factory import shared_engine
import jaxcb
from jaxcb.sampling_params import SamplingParams
from server_harness import post_all_at_once, running_server


SEND_BUFFER_BYTES = 8192


@pytest.fixture(scope="module")
def server():
    with running_server("server.stream_stall_timeout_s=1.0", send_buffer_bytes=SEND_BUFFER_BYTES) as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def engine_greedy(state, prompt_ids, max_tokens):
    """What LLM.generate gives for the same prompt, computed on the same model with a separate engine."""
    engine = shared_engine("scheduler.policy=fcfs")
    engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens), request_id="ref")
    while True:
        for out in engine.step():
            if out.finished:
                return out.outputs[0]


def wait_until_idle(state, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool = state.client.engine.block_pool
        if pool.num_free_blocks == pool.num_blocks - 1 and not state.client.engine.has_unfinished_requests():
            return True
        time.sleep(0.05)
    return False


def test_completion_matches_the_engine_and_reports_usage(client, server):
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0)
    ref = engine_greedy(server[1], server[1].client.engine.tokenizer.encode("Hello there"), 12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 12 and r.usage.completion_tokens == 12 and r.usage.total_tokens == 24


def test_streamed_completion_concatenates_to_the_whole_one(client):
    whole = client.completions.create(model="tiny", prompt="Stream me", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(
        model="tiny", prompt="Stream me", max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_streaming_and_not_with_n_and_logprobs(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6, temperature=0.8,
                                       seed=3, n=2, logprobs=True, top_logprobs=2)
    assert r.object == "chat.completion" and len(r.choices) == 2
    for choice in r.choices:
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert len(choice.logprobs.content) == 6 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.8,
                                                 seed=3, n=2, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == r.choices[i].message.content


def test_stop_string_is_not_in_the_text(client):
    base = client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0).choices[0].text
    stop = base[4:6]
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[: base.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=12, temperature=0, stop=[stop], stream=True))
    assert streamed == r.choices[0].text


def test_completion_logprobs_and_token_id_prompts(client):
    r = client.completions.create(model="tiny", prompt=[[72, 105], [1, 2, 3]], max_tokens=3, temperature=0, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) >= 2 for t in lp.top_logprobs)


def test_models_health_and_metrics(server, client):
    url, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    retrieved, listed = client.models.retrieve("tiny").model_dump(), client.models.list().data[0].model_dump()
    assert retrieved | {"created": 0} == listed | {"created": 0} and retrieved["max_model_len"] > 0
    assert httpx.get(url + "/v1/models/").json()["data"][0]["id"] == "tiny"  # the list, as /v1/models
    with pytest.raises(openai.NotFoundError, match="'org/other' is not served here"):
        client.models.retrieve("org/other")  # a name with '/' reaches the route, and is named in the 404
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/ping").json() == httpx.post(url + "/ping").json() == {"status": "ok"}
    assert httpx.get(url + "/version").json() == {"version": jaxcb.__version__}
    text = httpx.get(url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "recompilations_total", "iteration_tokens", "device_busy_ratio",
                 "decode_tokens_per_second"):
        assert f"jaxcb:{name}" in text, name
    assert 'jaxcb:request_success_total{finished_reason="length",model_name="tiny"}' in text


MALFORMED = [
    ("not json", b"{nope", 400),
    ("array body", b"[]", 400),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 404),
    ("missing model", {"prompt": "x"}, 400),
    ("missing prompt", {"model": "tiny"}, 400),
    ("empty prompt", {"model": "tiny", "prompt": ""}, 400),
    ("empty prompt list", {"model": "tiny", "prompt": []}, 400),
    ("empty token list in batch", {"model": "tiny", "prompt": [[1, 2], []]}, 400),
    ("prompt wrong type", {"model": "tiny", "prompt": 42}, 400),
    ("negative max_tokens", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400),
    ("zero max_tokens", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400),
    ("absurd max_tokens", {"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400),
    ("max_tokens string", {"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400),
    ("negative temperature", {"model": "tiny", "prompt": "x", "temperature": -0.1}, 400),
    ("temperature string", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400),
    ("top_p zero", {"model": "tiny", "prompt": "x", "top_p": 0}, 400),
    ("top_p above one", {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400),
    ("n zero", {"model": "tiny", "prompt": "x", "n": 0}, 400),
    ("n above cap", {"model": "tiny", "prompt": "x", "n": 1000}, 400),
    ("logprobs too many", {"model": "tiny", "prompt": "x", "logprobs": 50}, 400),
    ("stop wrong type", {"model": "tiny", "prompt": "x", "stop": 5}, 400),
    ("stream wrong type", {"model": "tiny", "prompt": "x", "stream": "yes"}, 400),
    ("token id out of vocab", {"model": "tiny", "prompt": [1, 99999]}, 400),
    ("prompt too long", {"model": "tiny", "prompt": [1] * 300}, 400),
    ("prompt + max_tokens too long", {"model": "tiny", "prompt": [1] * 200, "max_tokens": 100}, 400),
    ("presence_penalty out of range", {"model": "tiny", "prompt": "x", "presence_penalty": 5}, 400),
    ("prompt_logprobs too many", {"model": "tiny", "prompt": "x", "prompt_logprobs": 50}, 400),
]
MALFORMED_CHAT = [
    ("empty messages", {"model": "tiny", "messages": []}, 400),
    ("bad role", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("content wrong type", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400),
    ("image part", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("top_logprobs without logprobs", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
]


@pytest.mark.parametrize("name, body, status", MALFORMED + [(f"chat: {n}", b, s) for n, b, s in MALFORMED_CHAT],
                         ids=[m[0] for m in MALFORMED] + [f"chat-{m[0]}" for m in MALFORMED_CHAT])
def test_malformed_requests_get_a_4xx_with_an_openai_error_body(server, name, body, status):
    url, state = server
    path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and set(error) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health").status_code == 200
    assert wait_until_idle(state)


def test_oversized_body_is_refused_with_413(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x" * (2 << 20)})
    assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]


def test_a_chunked_body_without_content_length_is_held_to_the_same_limits(server):
    """Read no further than the limit (a handler, or the multipart parser spooling to disk, would take it all)."""
    import json

    url, state = server

    import socket
    from urllib.parse import urlparse

    def chunks(data: bytes, size: int):
        yield from (data[i:i + size] for i in range(0, len(data), size))

    where = urlparse(url)
    limit = state.cfg.server.max_request_bytes
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * (1 << 16)
        for _ in range(limit // len(chunk) + 2):  # past the limit, and the body not ended
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert sock.recv(12) == b"HTTP/1.1 413"  # answered before the body ends: none of the rest is read
    small = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    r = httpx.post(url + "/v1/completions", content=chunks(small, 5), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(url + "/health").status_code == 200


STEP_DELAY_S = 0.02


@pytest.fixture
def slow_steps(server):
    """Make every engine step take >= STEP_DELAY_S, so a request is surely in flight when the client leaves."""
    engine = server[1].client.async_engine
    original = engine.on_step

    def slow(*args):
        time.sleep(STEP_DELAY_S)
        original(*args)

    engine.on_step = slow
    yield
    engine.on_step = original


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, slow_steps):
    url, state = server
    before = state.client.metrics.aborts._value.get()
    with httpx.stream("POST", url + "/v1/completions", json={
        "model": "tiny", "prompt": "a long one", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
    }) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    assert wait_until_idle(state)
    assert state.client.metrics.aborts._value.get() == before + 1


def test_client_disconnect_while_waiting_for_a_whole_response_aborts_it(server, slow_steps):
    url, state = server
    before = state.client.metrics.aborts._value.get()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": [5] * 150, "max_tokens": 100, "ignore_eos": True, "temperature": 0,
        }, timeout=0.3)
    assert wait_until_idle(state)
    assert state.client.metrics.aborts._value.get() == before + 1


def test_client_disconnect_mid_prefill_aborts_and_frees_blocks(server, slow_steps, monkeypatch):
    """A 240-token prompt takes 4 prefill steps of the 64-token budget; at 0.1 s a step the client
    leaves during the second one."""
    monkeypatch.setattr(__import__(__name__), "STEP_DELAY_S", 0.1)
    url, state = server
    before = state.client.metrics.aborts._value.get()
    seen_prefilling = []

    def watch():
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            for r in list(state.client.engine.scheduler.sequences.values()):
                if 0 < r.num_computed_tokens < r.num_prompt_tokens:
                    seen_prefilling.append(r.num_computed_tokens)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [3] * 240, "max_tokens": 8}, timeout=0.15)
    watcher.join()
    assert seen_prefilling, "the request should have been mid-prefill"
    assert wait_until_idle(state)
    assert state.client.metrics.aborts._value.get() == before + 1
    assert state.client.engine.block_pool.num_free_blocks == state.client.engine.block_pool.num_blocks - 1


def test_a_stalled_stream_reader_is_aborted_and_others_are_unaffected(server, slow_steps):
    """A reader that stops reading: its outputs pile up in the server; after the stall timeout
    (1 s here; 150 steps take >= 3 s) the request is aborted and its blocks freed, while another
    stream carries on to the end."""
    from jaxcb.server.async_engine import StreamAbortedError

    url, state = server
    engine = state.client.async_engine
    before = state.client.metrics.aborts._value.get()

    async def scenario():
        params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
        stalled = await engine.add([7] * 20, params)
        healthy = await engine.add([9] * 20, params)
        await stalled.__anext__()  # reads one output, then nothing while the other stream runs
        outs = [out async for out in healthy]
        late = []
        with pytest.raises(StreamAbortedError, match="slow_reader"):
            async for out in stalled:
                late.append(out)
        return outs, late

    outs, late = asyncio.run(scenario())
    assert outs[-1].finished and outs[-1].outputs[0].num_generated == 150
    assert sum(len(out.outputs[0].token_ids) for out in outs) == 150  # deltas: each holds what is new
    assert not late or not late[-1].finished  # it never got to its end
    assert wait_until_idle(state)
    assert state.client.metrics.aborts._value.get() == before + 1


def test_an_http_client_that_stops_reading_is_aborted_and_others_are_unaffected(server, slow_steps):
    """A real HTTP client opens a stream, reads the headers and then nothing. Once its socket and
    the server's buffers fill, the server's writes wait, outputs pile up for that reader and
    after the 1 s stall timeout the request is aborted and its blocks freed; a client streaming
    at the same time gets its whole answer."""
    url, state = server
    before = state.client.metrics.aborts._value.get()
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({
        "model": "tiny", "prompt": [7] * 20, "max_tokens": 230, "n": 4, "logprobs": 5,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, as a slow link has
    stalled.connect(("127.0.0.1", port))
    stalled.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    assert stalled.recv(64).startswith(b"HTTP/1.1 200")  # the stream started; now read nothing
    try:
        with httpx.stream("POST", url + "/v1/completions", json={
            "model": "tiny", "prompt": [9] * 20, "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 150
        deadline = time.monotonic() + 30
        while state.client.metrics.aborts._value.get() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.client.metrics.aborts._value.get() == before + 1
        assert wait_until_idle(state)  # its blocks are free while its socket is still open
    finally:
        stalled.close()


def test_api_key_is_required_when_set():
    engine = shared_engine("scheduler.policy=fcfs")
    with running_server("server.api_key=sekrit", engine=None) as (url, _):
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.models.list().data[0].id == "tiny"
        assert httpx.get(url + "/health").status_code == 200  # only /v1/* is guarded
    del engine


def test_overload_burst_gets_429_with_retry_after_and_the_rest_complete():
    with running_server("scheduler.max_waiting_requests=4", "scheduler.max_num_seqs=4") as (url, state):
        results = post_all_at_once(url, "/v1/completions", [
            {"model": "tiny", "prompt": [i % 200 + 1] * 30, "max_tokens": 20, "ignore_eos": True, "temperature": 0}
            for i in range(40)
        ], timeout=60)
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) > 0
        for r in results:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 20
        assert httpx.get(url + "/health").status_code == 200
        assert wait_until_idle(state)
        assert 'reason="overloaded"' in httpx.get(url + "/metrics").text


def test_log_requests_logs_each_request_by_its_response_id_with_its_prompt_cut_at_max_log_len(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="jaxcb.server.request_log")
    with running_server("server.log_requests=true", "server.max_log_len=5", engine=shared_engine()) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello world", "max_tokens": 2,
                                                      "request_id": "log-me"}, timeout=60)
        assert r.status_code == 200
        chat = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "stream": True,
                                                               "messages": [{"role": "user", "content": "hi"}]},
                          timeout=60)
        assert chat.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxcb.server.request_log"]
    assert lines[0].startswith("received cmpl-log-me: /v1/completions, model tiny, prompt 'hello'... "
                               "(6 more characters) (12 tokens), params SamplingParams(")
    assert lines[1].startswith("received chatcmpl-") and "/v1/chat/completions" in lines[1] and len(lines) == 2
    caplog.clear()
    with running_server(engine=shared_engine()) as (url, _):  # off by default: prompts stay out of the logs
        assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                          timeout=60).status_code == 200
    assert not [r for r in caplog.records if r.name == "jaxcb.server.request_log"]


def test_browser_pages_of_the_allowed_origins_may_call_the_api_and_others_may_not():
    """CORS (server.allowed_origins; off by default, where vLLM allows any origin): a preflight needs no API
    key, the answers carry the allow header (and expose X-Request-Id), and an origin not allowed gets none."""
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    with running_server("server.api_key=k", "server.allowed_origins=[\"*\"]", engine=shared_engine()) as (url, _):
        r = httpx.options(url + "/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": "https://ui.example",
                                                                   "Authorization": "Bearer k"}, timeout=60)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": "https://ui.example"}, timeout=60)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # the page can read why
    with running_server("server.allowed_origins=[https://ui.example]", engine=shared_engine()) as (url, _):
        assert httpx.options(url + "/v1/completions", headers=preflight).headers["access-control-allow-origin"] == \
            "https://ui.example"
        r = httpx.options(url + "/v1/completions", headers={**preflight, "Origin": "https://other.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    with running_server(engine=shared_engine()) as (url, _):  # the default: no page of another origin reads it
        r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": "https://ui.example"}, timeout=60)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_an_exception_no_handler_takes_is_a_500_in_openais_shape_with_the_request_id(monkeypatch):
    with running_server(engine=shared_engine()) as (url, state):
        async def broken():
            raise RuntimeError("a bug")

        monkeypatch.setattr(state.client, "render_metrics", broken)
        r = httpx.get(url + "/metrics", headers={"X-Request-Id": "m-1"}, timeout=60)
        assert r.status_code == 500 and r.headers["x-request-id"] == "m-1"
        assert r.json()["error"]["type"] == "server_error" and "RuntimeError" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=60).json() == {"status": "ok"}  # and it serves on


def test_log_requests_shows_token_ids_it_cannot_decode_and_the_engine_still_refuses_them_by_name(caplog):
    import logging

    from jaxcb.server.request_log import _prompt

    class Strict:  # a tokenizer whose decode fails on ids past its vocabulary, as HF's does
        def decode(self, ids, skip_special_tokens=True):
            raise OverflowError("out of range integral type conversion attempted")

    assert _prompt([5, 2 ** 40], Strict(), None) == "token ids '[5, 1099511627776]' (2 tokens)"
    caplog.set_level(logging.INFO, logger="jaxcb.server.request_log")
    with running_server("server.log_requests=true", engine=shared_engine()) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [2 ** 40], "max_tokens": 1},
                       headers={"X-Request-Id": "ids-1"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 1},
                       headers={"X-Request-Id": "resp-log"}, timeout=60)
        assert r.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxcb.server.request_log"]
    assert any("(X-Request-Id 'resp-log')" in line and line.startswith("received resp_") for line in lines)
