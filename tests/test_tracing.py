"""OpenTelemetry tracing (server.otlp_endpoint): one span per request with the attributes vLLM sets,
continuing the caller's W3C traceparent; with tracing off nothing of OpenTelemetry is imported."""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from engine_factory import BASE, shared_engine
from jaxcb.config import compose_config
from jaxcb.server.app import build_app
from jaxcb.server.run import serve_app_in_thread

TESTS = os.path.dirname(os.path.abspath(__file__))
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    cfg = compose_config(BASE + ("server.otlp_endpoint=http://127.0.0.1:4318/v1/traces",
                                 f"server.batch_dir={tmp_path_factory.mktemp('batches')}"))
    with serve_app_in_thread(build_app(cfg, shared_engine(), span_exporter=exporter), start_timeout_s=60) as url:
        yield url, exporter


def test_an_otlp_endpoint_that_is_no_url_is_refused_at_start_up():
    from jaxcb.config import ConfigError

    with pytest.raises(ConfigError, match="server.otlp_endpoint='collector:4318' must be an http:// or https:// URL"):
        compose_config(BASE + ("server.otlp_endpoint=collector:4318",))


def spans_after(exporter, send, count=1):
    """`send()`'s result and the spans it made: a span is recorded just after its response is sent."""
    exporter.clear()
    result = send()
    deadline = time.monotonic() + 10
    while len(exporter.get_finished_spans()) < count:
        assert time.monotonic() < deadline, "no span was recorded"
        time.sleep(0.01)
    return result, exporter.get_finished_spans()


def test_a_request_is_one_span_with_vllms_attributes_in_the_callers_trace(traced):
    url, exporter = traced
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "top_p": 0.9}
    r, spans = spans_after(exporter, lambda: httpx.post(url + "/v1/completions", json=body,
                                                        headers={"traceparent": TRACEPARENT}, timeout=60))
    assert r.status_code == 200 and len(spans) == 1
    span, usage = spans[0], r.json()["usage"]
    assert span.name == "llm_request" and span.kind.name == "SERVER"
    assert span.context.trace_id == int(TRACE_ID, 16) and span.parent.span_id == int(PARENT_ID, 16)
    a = span.attributes
    assert a["gen_ai.request.id"] == r.json()["id"] and a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9) and a["gen_ai.request.n"] == 1
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert span.end_time - span.start_time >= a["gen_ai.latency.e2e"] * 1e9 * 0.5


def test_a_streamed_chat_request_without_traceparent_is_one_span_of_a_new_trace(traced):
    url, exporter = traced
    client = OpenAI(base_url=url + "/v1", api_key="unused")

    def send():
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, temperature=0, stream=True)
        return [chunk for chunk in stream]

    chunks, spans = spans_after(exporter, send)
    assert len(spans) == 1 and spans[0].parent is None
    assert spans[0].attributes["gen_ai.request.id"] == chunks[0].id
    assert spans[0].attributes["gen_ai.usage.completion_tokens"] == 5


def test_several_prompts_of_one_request_are_one_span(traced):
    url, exporter = traced
    body = {"model": "tiny", "prompt": ["a", "b c"], "max_tokens": 3, "n": 2, "temperature": 0}
    r, spans = spans_after(exporter, lambda: httpx.post(url + "/v1/completions", json=body, timeout=60))
    time.sleep(0.2)  # a second span, if one were made, would be recorded by now
    assert len(exporter.get_finished_spans()) == 1
    assert spans[0].attributes["gen_ai.usage.completion_tokens"] == r.json()["usage"]["completion_tokens"] == 12
    assert spans[0].attributes["gen_ai.usage.num_sequences"] == 4


def test_each_line_of_a_batch_is_one_span(traced):
    url, exporter = traced
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              # ignore_eos: a sampled EOS would end a line early and change its count
              "body": {"model": "tiny", "prompt": f"line {i}", "max_tokens": 2 + i, "ignore_eos": True}}
             for i in range(3)]

    def send():
        upload = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        while batch.status != "completed":
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
        return [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]

    output, spans = spans_after(exporter, send, count=3)
    assert sorted(s.attributes["gen_ai.request.id"] for s in spans) == sorted(r["response"]["body"]["id"]
                                                                             for r in output)
    assert sorted(s.attributes["gen_ai.usage.completion_tokens"] for s in spans) == [2, 3, 4]


WITHOUT_TRACING = """
import json, sys
sys.path.insert(0, sys.argv[1])
from engine_factory import BASE
from jaxcb.config import compose_config
from jaxcb.server.app import build_app
from starlette.testclient import TestClient
app = build_app(compose_config(BASE + ("server.batch_dir=" + sys.argv[2],)))
with TestClient(app) as client:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
                    headers={"traceparent": sys.argv[3]})
    assert r.status_code == 200, r.text
print(json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))))
"""


def test_with_tracing_off_nothing_of_opentelemetry_is_imported_or_exported(tmp_path):
    # The OpenTelemetry variables that make a framework export on its own are set: nothing may follow them.
    env = dict(os.environ, JAX_PLATFORMS="cpu", FASTAPI_OTEL_AUTO_CONFIGURE="true",
               OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318")
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRACING, TESTS, str(tmp_path), TRACEPARENT],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_a_beam_search_is_one_span_over_its_rounds_whole_and_streamed(traced):
    url, exporter = traced
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "n": 3, "use_beam_search": True,
            "ignore_eos": True}
    r, spans = spans_after(exporter, lambda: httpx.post(url + "/v1/completions", json=body, timeout=60))
    assert r.status_code == 200 and len(spans) == 1
    a = spans[0].attributes
    assert a["gen_ai.request.id"] == r.json()["id"] and a["gen_ai.request.n"] == 3
    assert a["gen_ai.request.temperature"] == 0 and a["gen_ai.usage.completion_tokens"] == 12
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",) * 3
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    r, spans = spans_after(exporter, lambda: httpx.post(url + "/v1/completions", json={**body, "stream": True},
                                                        timeout=60))
    texts = [json.loads(line[6:])["choices"] for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and len(texts) == 3
    assert spans[0].attributes["gen_ai.usage.completion_tokens"] == 12
