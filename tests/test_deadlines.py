"""Deadlines: a request past its queue deadline with nothing generated is refused (503, or a final
SSE error event), one past its total deadline ends with what it has (finish_reason "timeout");
either frees its blocks at once, and the requests without deadlines are not changed."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine_factory import generate_first_completions, make_engine
from jaxcb.sampling_params import SamplingParams
from server_harness import running_server

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
STEP_DELAY_S = 0.05


def run_until_done(engine, ids):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_deadlines_end_requests_free_their_blocks_and_leave_the_others_unchanged(async_scheduling):
    engine = make_engine("scheduler.max_num_seqs=1", f"engine.async_scheduling={str(async_scheduling).lower()}")
    pool = engine.block_pool
    [alone] = generate_first_completions(engine, [[3, 1, 4, 1, 5]], GREEDY)
    running = engine.add_request([3, 1, 4, 1, 5], GREEDY)
    queued = engine.add_request([2, 7, 1, 8], GREEDY, queue_timeout_s=3600)  # waits: one sequence at a time
    timed = engine.add_request([9, 9, 9], GREEDY, timeout_s=3600)
    for _ in range(4):
        engine.step()
    engine.output.groups[queued].queue_deadline = 0.0  # its queue deadline passes with nothing generated
    outputs = {out.request_id: out for out in engine.step()}
    assert outputs[queued].finished and outputs[queued].outputs[0].finish_reason == "queue_timeout"
    assert outputs[queued].outputs[0].token_ids == []
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
            elif out.request_id == timed and len(out.outputs[0].token_ids) >= 3 and timed in engine.output.groups:
                engine.output.groups[timed].deadline = 0.0  # its total deadline passes mid-generation
    assert results[running].outputs[0].token_ids == alone.token_ids  # untimed: token-identical
    cut = results[timed].outputs[0]
    assert cut.finish_reason == "timeout" and 3 <= len(cut.token_ids) < GREEDY.max_tokens
    assert pool.num_free_blocks == pool.num_blocks - 1  # every block back
    assert not engine.output.groups and not engine.output.timed_groups


@pytest.fixture(scope="module")
def slow_server():
    """One sequence at a time, each step >= STEP_DELAY_S: a second request surely waits. One server (and
    engine) for the module: each test leaves it idle, every block free (`wait_until_idle`)."""
    overrides = ("scheduler.max_num_seqs=1", "server.max_queue_time_s=0.5", "server.request_timeout_s=30")
    with running_server(*overrides) as (url, state):
        original = state.client.async_engine.on_step

        def slow(*args):
            time.sleep(STEP_DELAY_S)
            original(*args)

        state.client.async_engine.on_step = slow
        yield url, state
        state.client.async_engine.on_step = original


def wait_until_idle(state, timeout=20):
    deadline = time.monotonic() + timeout
    pool = state.client.engine.block_pool
    while time.monotonic() < deadline:
        if pool.num_free_blocks == pool.num_blocks - 1 and not state.client.engine.has_unfinished_requests():
            return True
        time.sleep(0.05)
    return False


def completion(url, **fields):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 40, "ignore_eos": True, "temperature": 0, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_queue_deadline_gets_503_with_retry_after(slow_server, stream):
    import threading

    url, state = slow_server
    first = {}
    blocker = threading.Thread(target=lambda: first.setdefault("r", completion(url)))
    blocker.start()
    time.sleep(0.2)  # the first request holds the only sequence slot for ~2 s
    r = completion(url, max_tokens=4, stream=stream)
    if stream:
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["code"] == "503" and "max_queue_time_s=0.5" in error["message"]
    else:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "server.max_queue_time_s=0.5" in r.json()["error"]["message"]
    blocker.join()
    assert first["r"].status_code == 200 and first["r"].json()["choices"][0]["finish_reason"] == "length"
    assert wait_until_idle(state)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_timeout_ends_with_what_it_has(slow_server, stream):
    url, state = slow_server
    r = completion(url, timeout=0.4, stream=stream)
    assert r.status_code == 200
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == "timeout" and len(chunks) < 40
    else:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "timeout" and 0 < r.json()["usage"]["completion_tokens"] < 40
    assert wait_until_idle(state)


def test_a_request_may_ask_for_less_time_than_the_server_allows_never_more(slow_server):
    url, _ = slow_server
    r = completion(url, timeout=60)
    assert r.status_code == 400 and "server.request_timeout_s=30" in r.json()["error"]["message"]
    assert completion(url, timeout=0).status_code == 400
