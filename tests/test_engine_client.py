"""One suite, two EngineClients: an engine in this process and 2 replicas behind the Ray router give the
same greedy outputs, the same refusals, aborts that free their requests, metrics, and the same job results."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest

from engine_factory import BASE, make_engine, shared_engine
from jaxcb.config import compose_config
from jaxcb.errors import InvalidRequestError
from jaxcb.jobs import generate_results, generate_results_over, read_input
from jaxcb.outputs import join_deltas
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.engine_client import EngineClient, LocalEngineClient, make_engine_client
from ray_cluster import start_local_cluster

RAY = ("server.backend=ray", "server.num_replicas=2", "ray.cpus_per_replica=0.5")
PROMPTS = ["The client says", "Another prompt, a little longer than the first one", "x"]


class LoopThread:
    """An asyncio loop in a thread of its own, as a server runs one: the tests hand it coroutines."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 180):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module", params=["local", "ray"])
def served(request):
    loop, ray = LoopThread(), None
    if request.param == "ray":
        ray = start_local_cluster()
        client = make_engine_client(compose_config(BASE + RAY), "tiny")
    else:
        client = make_engine_client(compose_config(BASE), "tiny", make_engine())
        assert isinstance(client, LocalEngineClient)

    async def start():
        client.start()

    loop.run(start())
    try:
        yield client, loop
    finally:
        client.stop()
        loop.close()
        if ray is not None:
            ray.shutdown()


def reference_greedy(prompt, max_tokens: int) -> list[int]:
    engine = shared_engine()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].token_ids


async def whole(client: EngineClient, prompt, params: SamplingParams):
    stream = await client.add(prompt, params)
    try:
        return join_deltas([out async for out in stream])
    finally:
        stream.close()


def test_the_client_is_an_engine_client_with_the_model_s_tokenizer(served):
    client, _ = served
    assert isinstance(client, EngineClient) and client.is_alive
    assert client.max_model_len == shared_engine().max_model_len
    assert client.tokenizer.encode(PROMPTS[0]) == shared_engine().tokenizer.encode(PROMPTS[0])


def test_concurrent_greedy_requests_equal_one_engine_s(served):
    client, loop = served
    params = SamplingParams(temperature=0, max_tokens=6)

    async def all_at_once():
        return await asyncio.gather(*(whole(client, p, params) for p in PROMPTS))

    outs = loop.run(all_at_once())
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(p, 6) for p in PROMPTS]
    assert all(o.finished for o in outs)


def test_a_refusal_is_raised_by_add_naming_its_field(served):
    client, loop = served
    with pytest.raises(InvalidRequestError) as e:
        loop.run(client.add("hi", SamplingParams(max_tokens=10 ** 6)))
    assert e.value.field == "max_tokens"
    assert loop.run(whole(client, "hi", SamplingParams(temperature=0, max_tokens=2))).finished


def running_requests(client, loop) -> float:
    text = loop.run(client.render_metrics()).decode()
    return sum(float(v) for v in re.findall(r"^jaxcb:num_requests_running(?:{[^}]*})? (\S+)$", text, flags=re.M))


def test_closing_a_stream_aborts_its_request(served):
    client, loop = served

    async def start_then_close():
        stream = await client.add("a long story", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for out in stream:
            if out.outputs[0].token_ids:
                break
        stream.close()

    loop.run(start_then_close())
    deadline = time.monotonic() + 30
    while running_requests(client, loop) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_requests(client, loop) == 0
    assert isinstance(loop.run(client.dashboard_samples()), list)


def test_a_job_over_the_client_writes_what_a_job_on_one_engine_writes(served, tmp_path):
    client, loop = served
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "a", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}),
        json.dumps({"id": "b", "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "n": 2, "seed": 5}),
        json.dumps({"id": "c", "prompt": "x", "seed": "abc"}),
        "{not json",
        json.dumps({"id": "d", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}),
    ]) + "\n")
    records = read_input(str(path))

    async def collect():
        return [r async for r in generate_results_over(client, compose_config(BASE), records, max_in_flight=4)]

    over_client = {r["id"]: r for r in loop.run(collect())}
    from jaxcb.engine import LLM

    llm = LLM.__new__(LLM)
    llm.engine = shared_engine()
    on_engine = {r["id"]: r for r in generate_results(llm, records, max_in_flight=4)}
    assert over_client.keys() == on_engine.keys() == {"a", "b", "c", "d", None}
    for key in ("a", "d"):
        assert over_client[key] == on_engine[key]
    assert [c["token_ids"] for c in over_client["b"]["choices"]] == [c["token_ids"] for c in on_engine["b"]["choices"]]
    assert over_client["c"]["field"] == "seed" and over_client[None]["line"] == 4
