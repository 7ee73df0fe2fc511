"""The OpenAI server over 2 engine replicas on Ray: same greedy outputs, both replicas used, aborts reach them."""

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine_factory import shared_engine
from jaxcb.sampling_params import SamplingParams
from jaxcb.tokenizer import chat_prompt_ids
from ray_cluster import actor_pids, start_local_cluster
from server_harness import running_server

RAY = ("server.backend=ray", "server.num_replicas=2", "ray.cpus_per_replica=0.5")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ray = start_local_cluster()
    try:
        with running_server(*RAY, f"server.batch_dir={tmp_path_factory.mktemp('batches')}") as (url, state):
            yield url, state
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def engine_greedy(prompt, max_tokens: int) -> str:
    """What one engine in this process makes of the prompt."""
    engine = shared_engine()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), request_id="ref")
    while True:
        for out in engine.step():
            if out.finished:
                return out.outputs[0].text


def metric(text: str, name: str, replica: int) -> float:
    pattern = rf'^{re.escape(name)}{{[^}}]*replica="{replica}"[^}}]*}} (\S+)$'
    values = [float(v) for v in re.findall(pattern, text, flags=re.M)]
    return sum(values)


def routed_by(text: str, reason: str, replica: int) -> float:
    """jaxcb:router_route_decisions_total for one reason and replica."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jaxcb:router_route_decisions_total{")
               and f'replica="{replica}"' in line and f'reason="{reason}"' in line)


def test_concurrent_requests_match_one_engine_and_use_both_replicas(client, server):
    prompts = [f"Request {i} says" + " hello" * (i % 4) for i in range(12)]

    def ask(i):
        prompt = prompts[i]
        if i % 2:
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        if i % 4 == 0:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=10, temperature=0)
            return r.choices[0].message.content
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, range(12)))
    tokenizer = shared_engine().tokenizer
    for i, text in enumerate(texts):
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompts[i]}]) if i % 4 == 0 else prompts[i]
        assert text == engine_greedy(prompt, 10), i
    metrics = httpx.get(server[0] + "/metrics").text
    for replica in (0, 1):
        assert metric(metrics, "jaxcb:router_requests_routed", replica) >= 3, metrics
        routed = metric(metrics, "jaxcb:router_route_decisions_total", replica)
        assert routed >= 3 and routed_by(metrics, "load", replica) == routed  # routing=least_loaded: by load alone
        assert metric(metrics, "jaxcb:request_success_total", replica) >= 3
        assert f'jaxcb:num_requests_running{{model_name="tiny",replica="{replica}"}}' in metrics
        assert f'jaxcb:num_requests_waiting{{model_name="tiny",replica="{replica}"}}' in metrics
        assert metric(metrics, "jaxcb:replica_up", replica) == 1


def test_a_beam_search_runs_its_rounds_over_the_replicas_with_one_engines_beams(client):
    from jaxcb.beam_search import BeamSearchParams
    from jaxcb.engine import LLM

    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=5, n=3,
                                      extra_body={"use_beam_search": True})
    llm = LLM.__new__(LLM)
    llm.engine = shared_engine()
    [one_engine] = llm.beam_search("hello", BeamSearchParams(3, 5))
    assert [c.text for c in reply.choices] == [c.text for c in one_engine.outputs]


def test_a_client_that_disconnects_aborts_its_request_on_the_replica(client, server):
    url = server[0]
    before = sum(metric(httpx.get(url + "/metrics").text, "jaxcb:request_abort_total", r) for r in (0, 1))
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n >= 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics").text
        if sum(metric(text, "jaxcb:request_abort_total", r) for r in (0, 1)) == before + 1:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the abort did not reach the replica")
    state = server[1]
    assert not state.client.streams
    assert all(not r.waiting_tokens for r in state.client.replicas)


def test_a_batch_runs_over_the_replicas_with_one_engines_greedy_output_per_custom_id(client, server):
    import json

    prompts = {f"line-{i}": f"Batch line {i} reads" for i in range(10)}
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}}
             for cid, prompt in prompts.items()]
    before = [metric(httpx.get(server[0] + "/metrics").text, "jaxcb:request_success_total", r) for r in (0, 1)]
    upload = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.request_counts
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(lines)
    results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(prompts)
    for r in results:
        assert r["response"]["body"]["choices"][0]["text"] == engine_greedy(prompts[r["custom_id"]], 6)
    after = [metric(httpx.get(server[0] + "/metrics").text, "jaxcb:request_success_total", r) for r in (0, 1)]
    assert sum(after) - sum(before) == len(lines) and all(a > b for a, b in zip(after, before)), (before, after)
    assert batch.usage.output_tokens == 6 * len(lines)


def test_a_killed_replica_is_routed_around_and_health_stays_ok(client, server):
    url, state = server
    assert httpx.get(url + "/health").status_code == 200
    [victim, _] = sorted(actor_pids("EngineReplica"))
    os.kill(victim, signal.SIGKILL)
    for i in range(4):  # the router learns of the death from a failed call or its poll, and retries elsewhere
        r = client.completions.create(model="tiny", prompt=f"after the kill {i}", max_tokens=5, temperature=0)
        assert r.choices[0].text == engine_greedy(f"after the kill {i}", 5)
    assert httpx.get(url + "/health").status_code == 200
    deadline = time.monotonic() + 120  # Ray restarts the replica; the router's poll brings it back
    while not all(r.alive for r in state.client.replicas):
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.5)
