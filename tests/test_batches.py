"""OpenAI's Files and Batch APIs through the official client: batches run to completion over the
server's own engine, every line is served or refused as its endpoint would, and a server killed
mid-batch resumes it with every custom_id answered exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from openai import BadRequestError, ConflictError, NotFoundError, OpenAI

from engine_factory import BASE, shared_engine
from jaxcb.config import ConfigError, compose_config
from server_harness import free_port, running_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINISHED = ("completed", "failed", "expired", "cancelled")
MAX_FILE_BYTES = 2 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    batch_dir = tmp_path_factory.mktemp("batches")
    with running_server(f"server.batch_dir={batch_dir}", f"server.max_file_bytes={MAX_FILE_BYTES}",
                        engine=shared_engine()) as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def batch_file(lines) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def chat_line(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], **body}}


def completion_line(custom_id, prompt, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, **body}}


def wait_until_finished(client, batch_id, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINISHED:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.1)


def results(client, file_id) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.split("\n")[:-1]] if file_id else []


def run_batch(client, lines, endpoint):
    upload = client.files.create(file=("in.jsonl", batch_file(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    batch = wait_until_finished(client, batch.id)
    return batch, results(client, batch.output_file_id), results(client, batch.error_file_id)


def test_the_openai_client_runs_a_50_line_batch_to_completion_with_one_result_per_custom_id(server, client):
    lines = [chat_line(f"req-{i}", f"Tell me about {i}", max_tokens=4 + i % 5, temperature=0) for i in range(50)]
    lines[7]["body"]["request_id"] = "line-7"  # vLLM's field: it names the line's response, as a POST's
    batch, output, errors = run_batch(client, lines, "/v1/chat/completions")
    assert batch.status == "completed" and batch.error_file_id is None and errors == []
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (50, 50, 0)
    assert sorted(r["custom_id"] for r in output) == sorted(line["custom_id"] for line in lines)
    by_id = {r["custom_id"]: r for r in output}
    for r in output:
        assert r["error"] is None and r["id"].startswith("batch_req_")
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"]
        assert r["response"]["body"]["object"] == "chat.completion"
    # A line's response is the response the same body POSTed gets (greedy: the same text).
    direct = httpx.post(server[0] + "/v1/chat/completions", json=lines[7]["body"], timeout=60).json()
    assert by_id["req-7"]["response"]["body"]["choices"] == direct["choices"]
    assert by_id["req-7"]["response"]["body"]["id"] == direct["id"] == "chatcmpl-line-7"
    assert len({r["response"]["body"]["id"] for r in output}) == 50
    assert by_id["req-7"]["response"]["body"]["usage"]["completion_tokens"] == 4 + 7 % 5
    # The batch's usage is its lines' usage, summed.
    lines_usage = [r["response"]["body"]["usage"] for r in output]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in lines_usage)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in lines_usage) == sum(4 + i % 5 for i in range(50))
    assert batch.usage.input_tokens_details.cached_tokens == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                                 for u in lines_usage)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert batch.usage.output_tokens_details.reasoning_tokens == 0  # the tiny model's template has no reasoning


def test_a_line_its_endpoint_would_refuse_is_answered_with_that_refusal_in_the_error_file(server, client):
    good = completion_line("good", "Hello", max_tokens=3, temperature=0)
    bad = [completion_line("temperature", "x", temperature=-1), completion_line("unknown", "x", colour="blue"),
           completion_line("model", "x", model="gpt-4"), completion_line("stream", "x", stream=True),
           completion_line("too-long", [1] * 300)]
    batch, output, errors = run_batch(client, [good] + bad, "/v1/completions")
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 5)
    assert [r["custom_id"] for r in output] == ["good"] and output[0]["response"]["body"]["object"] == "text_completion"
    by_id = {r["custom_id"]: r["response"] for r in errors}
    assert by_id.keys() == {line["custom_id"] for line in bad}
    for line in bad:
        if line["custom_id"] == "stream":
            continue  # POSTed, a stream is served; a batch writes responses whole
        direct = httpx.post(server[0] + "/v1/completions", json=line["body"], timeout=60)
        assert by_id[line["custom_id"]]["status_code"] == direct.status_code
        assert by_id[line["custom_id"]]["body"] == direct.json()
    assert by_id["stream"]["status_code"] == 400 and by_id["stream"]["body"]["error"]["param"] == "stream"
    assert by_id["temperature"]["body"]["error"]["param"] == "temperature"


def response_line(custom_id, input, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
            "body": {"model": "tiny", "input": input, **body}}


def test_a_responses_batch_answers_each_line_as_its_post_would_and_keeps_what_it_stores(server, client):
    """OpenAI's Batch API takes /v1/responses too: each line is the Responses body POSTed (greedy: the same output),
    a stored one can be continued by previous_response_id, a refused one gets the POST's refusal, and the batch's
    usage sums the Responses usage (input/output tokens)."""
    lines = [response_line("plain", "Tell me a story", max_output_tokens=5, temperature=0),
             response_line("instructed", "Hi", instructions="Be brief.", max_output_tokens=4, temperature=0,
                           store=False),
             response_line("bad-format", "x", text={"format": {"type": "xml"}}),
             response_line("stream", "x", stream=True)]
    batch, output, errors = run_batch(client, lines, "/v1/responses")
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 2)
    by_id = {r["custom_id"]: r["response"] for r in output + errors}
    for line in lines[:3]:
        direct = httpx.post(server[0] + "/v1/responses", json=line["body"], timeout=60)
        assert by_id[line["custom_id"]]["status_code"] == direct.status_code
        if direct.status_code == 200:
            assert by_id[line["custom_id"]]["body"]["output"][0]["content"] == direct.json()["output"][0]["content"]
        else:
            assert by_id[line["custom_id"]]["body"] == direct.json()
    assert by_id["bad-format"]["body"]["error"]["param"] == "text.format.type"
    assert by_id["stream"]["status_code"] == 400 and by_id["stream"]["body"]["error"]["param"] == "stream"
    plain, instructed = by_id["plain"]["body"], by_id["instructed"]["body"]
    assert plain["object"] == "response" and plain["status"] == "incomplete" and plain["store"] is True
    assert instructed["store"] is False
    assert batch.usage.input_tokens == plain["usage"]["input_tokens"] + instructed["usage"]["input_tokens"]
    assert batch.usage.output_tokens == plain["usage"]["output_tokens"] + instructed["usage"]["output_tokens"] == 9
    # The stored line's response is kept as a POSTed one is: retrievable, and continued by previous_response_id.
    assert client.responses.retrieve(plain["id"]).id == plain["id"]
    later = client.responses.create(model="tiny", input="And then?", previous_response_id=plain["id"],
                                    max_output_tokens=2, temperature=0)
    assert later.previous_response_id == plain["id"] and later.usage.input_tokens > plain["usage"]["input_tokens"]
    with pytest.raises(NotFoundError):
        client.responses.retrieve(instructed["id"])


def test_a_line_the_server_fails_on_is_answered_with_a_500_and_the_batch_goes_on(server, client, monkeypatch):
    # Before, the exception stopped the batch "until the server restarts", where the same line stopped it again.
    from jaxcb.server import batch_runner

    plan_body = batch_runner.plan_body

    def failing_on_poison(state, url, body):
        if body.get("prompt") == "poison":
            raise RuntimeError("a bug this line meets")
        return plan_body(state, url, body)

    monkeypatch.setattr(batch_runner, "plan_body", failing_on_poison)
    lines = [completion_line("ok", "Hello", max_tokens=2, temperature=0), completion_line("bad", "poison")]
    batch, output, errors = run_batch(client, lines, "/v1/completions")
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    [error] = errors
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 500
    assert "RuntimeError" in error["response"]["body"]["error"]["message"]
    assert [r["custom_id"] for r in output] == ["ok"]


@pytest.mark.parametrize("line, named", [
    ("{not json", "line 2 is not a JSON object"),
    ({"method": "POST", "url": "/v1/completions", "body": {}}, "line 2 has no custom_id"),
    (completion_line("a", "x"), "custom_id 'a' is used by an earlier line"),
    ({**completion_line("b", "x"), "url": "/v1/embeddings"}, "url '/v1/embeddings'"),
    ({**completion_line("b", "x"), "method": "GET"}, "method 'GET'"),
    ({**completion_line("b", "x"), "priority": 1}, "priority is not a field of a batch line"),
    # Lone surrogates once left a batch in_progress (or cancelling) for good: its output file could not be written.
    ('{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
     "line 2 is not a JSON object a batch takes (the JSON holds a lone UTF-16 surrogate escape"),
    ('{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\udc00"}}',
     "at body.prompt"),
])
def test_an_upload_with_a_line_that_could_never_run_is_refused_naming_the_line(client, line, named):
    with pytest.raises(BadRequestError) as e:
        client.files.create(file=("in.jsonl", batch_file([completion_line("a", "x"), line])), purpose="batch")
    assert named in e.value.message and e.value.body["param"] == "file"


def test_an_upload_past_server_max_file_bytes_is_a_413_and_keeps_nothing(client):
    before = len(client.files.list().data)
    line = completion_line("a", "x" * 100_000)
    with pytest.raises(Exception) as e:
        client.files.create(file=("in.jsonl", batch_file([{**line, "custom_id": f"c{i}"} for i in range(25)])),
                            purpose="batch")
    assert getattr(e.value, "status_code", None) == 413 and "server.max_file_bytes" in str(e.value)
    assert len(client.files.list().data) == before


def test_config_values_batches_cannot_work_with_are_refused_naming_them():
    with pytest.raises(ConfigError, match="server.max_file_bytes=1024 must be >= server.max_request_bytes"):
        compose_config(BASE + ("server.max_file_bytes=1024",))


def test_an_upload_for_another_purpose_is_refused_naming_purpose(client):
    with pytest.raises(BadRequestError) as e:
        client.files.create(file=("in.jsonl", batch_file([completion_line("a", "x")])), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"


@pytest.mark.parametrize("change, param", [
    ({"completion_window": "1h"}, "completion_window"),
    ({"endpoint": "/v1/embeddings"}, "endpoint"),
    ({"endpoint": "/v1/chat/completions"}, "endpoint"),  # the file's lines are for /v1/completions
    ({"output_expires_after": {"anchor": "created_at", "seconds": 3600}}, "output_expires_after"),
    ({"colour": "blue"}, "colour"),
    ({"metadata": {"k": 1}}, "metadata.k"),
])
def test_a_batch_jaxcb_would_not_run_as_asked_is_refused_naming_the_field(server, client, change, param):
    upload = client.files.create(file=("in.jsonl", batch_file([completion_line("a", "x")])), purpose="batch")
    body = {"input_file_id": upload.id, "endpoint": "/v1/completions", "completion_window": "24h", **change}
    r = httpx.post(server[0] + "/v1/batches", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_bom_and_line_separators_inside_json_strings_neither_split_a_line_nor_stall_the_batch(client):
    # U+2028 and NEL are text to JSON and written raw in results: str.splitlines once cut the uploaded line there
    # (a 400) and cut the results file on reading, which left a batch "finalizing" for good.
    raw = json.dumps(completion_line("raw\u2028id", "x\x85y", max_tokens=1), ensure_ascii=False)
    lines = ["\ufeff" + raw, completion_line("escaped\u2028\x85id", "x", max_tokens=1)]
    batch, output, errors = run_batch(client, lines, "/v1/completions")
    assert batch.status == "completed" and errors == []
    assert sorted(r["custom_id"] for r in output) == ["escaped\u2028\x85id", "raw\u2028id"]


def test_a_missing_input_file_or_batch_is_a_404(client):
    with pytest.raises(NotFoundError) as e:
        client.batches.create(input_file_id="file-nothere", endpoint="/v1/completions", completion_window="24h")
    assert e.value.body["param"] == "input_file_id"
    with pytest.raises(NotFoundError):
        client.batches.retrieve("batch_nothere")
    with pytest.raises(NotFoundError):
        client.files.content("file-nothere")


def test_a_cancelled_batch_answers_every_custom_id_once_and_leaves_the_engine_idle(server, client):
    lines = [completion_line(f"c{i}", f"prompt {i}", max_tokens=200, ignore_eos=True, temperature=0)
             for i in range(24)]
    upload = client.files.create(file=("in.jsonl", batch_file(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_until_finished(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    answered = results(client, batch.output_file_id) + results(client, batch.error_file_id)
    assert sorted(r["custom_id"] for r in answered) == sorted(line["custom_id"] for line in lines)
    assert batch.request_counts.completed + batch.request_counts.failed == 24
    assert all(r["error"]["code"] == "batch_cancelled" for r in results(client, batch.error_file_id))
    deadline = time.monotonic() + 30
    while server[1].client.engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_finished_batch_cannot_be_cancelled(client):
    batch, _, _ = run_batch(client, [completion_line("x", "x", max_tokens=1)], "/v1/completions")
    with pytest.raises(ConflictError):
        client.batches.cancel(batch.id)


def test_batches_are_listed_newest_first_and_paged(client):
    ids = [run_batch(client, [completion_line("a", "x", max_tokens=1)], "/v1/completions")[0].id for _ in range(2)]
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [ids[1]] and page.has_more
    assert client.batches.list(limit=1, after=ids[1]).data[0].id == ids[0]


# --- a server killed mid-batch ----------------------------------------------------------------------


def start_server(port, batch_dir, log_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "serve.py"), f"server.port={port}", *BASE,
                             f"server.batch_dir={batch_dir}", f"hydra.run.dir={batch_dir}/hydra"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, open(log_path).read()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def test_a_server_killed_mid_batch_resumes_it_with_every_custom_id_once_and_the_same_greedy_output(
        client, tmp_path):
    lines = [completion_line(f"k{i}", f"prompt number {i}", max_tokens=48, ignore_eos=True, temperature=0)
             for i in range(40)]
    _, uninterrupted, _ = run_batch(client, lines, "/v1/completions")
    expected = {r["custom_id"]: r["response"]["body"]["choices"] for r in uninterrupted}

    port, batch_dir, log_path = free_port(), tmp_path / "batches", tmp_path / "server.log"
    remote = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    proc = start_server(port, batch_dir, log_path)
    try:
        upload = remote.files.create(file=("in.jsonl", batch_file(lines)), purpose="batch")
        batch = remote.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 300
        while remote.batches.retrieve(batch.id).request_counts.completed < 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        results_path = batch_dir / "batches" / f"{batch.id}.results.jsonl"
        before = {}
        for line in results_path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):  # a torn last line is cut on restart
                before[json.loads(line)["custom_id"]] = json.loads(line)["id"]
        assert 5 <= len(before) < 40, "the kill came too late to show a resume"

        proc = start_server(port, batch_dir, log_path)
        batch = wait_until_finished(remote, batch.id)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (40, 0)
        output = results(remote, batch.output_file_id)
        assert sorted(r["custom_id"] for r in output) == sorted(expected)  # each exactly once
        for r in output:
            assert r["response"]["body"]["choices"] == expected[r["custom_id"]]
            if r["custom_id"] in before:  # answered before the kill: never run again
                assert r["id"] == before[r["custom_id"]]
    finally:
        proc.kill()
        proc.wait()
