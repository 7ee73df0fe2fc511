"""Tenant salts (vLLM's `cache_salt`): requests share cached prefix blocks only with the same salt."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import httpx
import pytest

from engine_factory import shared_engine
from jaxcb.jobs import generate_results, read_input
from jaxcb.sampling_params import InvalidRequestError, SamplingParams
from server_harness import running_server

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def engine():
    return shared_engine("cache.num_blocks=24", "scheduler.policy=fcfs")  # the engine of test_engine.py


def fresh_prompt(seed: int, length: int = 70) -> list[int]:
    """70 tokens: 4 full blocks of 16 that no other test's prompt shares."""
    rng = random.Random(1000 + seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def cached_tokens(e, requests: list[tuple[list[int], str | None]]) -> list[int]:
    """Submit all at once (one step admits them together); each one's prompt tokens found in the cache."""
    ids = [e.add_request(prompt, GREEDY, cache_salt=salt) for prompt, salt in requests]
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o.num_cached_tokens for o in e.step() if o.finished})
    return [done[i] for i in ids]


def test_different_salts_never_share_and_the_same_salt_does():
    e = engine()
    prompt = fresh_prompt(0)
    assert cached_tokens(e, [(prompt, "tenant-a")]) == [0]
    assert cached_tokens(e, [(prompt, "tenant-b"), (prompt, None)]) == [0, 0]
    assert cached_tokens(e, [(prompt, "tenant-a"), (prompt, "tenant-b"), (prompt, None)]) == [64, 64, 64]
    assert e.block_pool.num_free_blocks == e.block_pool.num_blocks - 1


def test_salts_separate_requests_admitted_in_the_same_step():
    e = engine()
    prompt = fresh_prompt(1)
    assert cached_tokens(e, [(prompt, "x"), (prompt, "y"), (prompt, "x")]) == [0, 0, 64]


def test_an_empty_salt_is_refused_naming_cache_salt():
    e = engine()
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        e.add_request([1, 2, 3], GREEDY, cache_salt="")
    assert not e.has_unfinished_requests()


def test_job_records_carry_a_salt(tmp_path):
    e = engine()
    prompt = fresh_prompt(2)
    path = tmp_path / "in.jsonl"
    records = [{"id": "a", "prompt": prompt, "max_tokens": 2, "cache_salt": "t1"},
               {"id": "b", "prompt": prompt, "max_tokens": 2, "cache_salt": "t2"},
               {"id": "empty", "prompt": prompt, "max_tokens": 2, "cache_salt": ""}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    hits0 = e.scheduler.prefix_cache_hits
    results = {r["id"]: r for r in generate_results(SimpleNamespace(engine=e, tokenizer=e.tokenizer),
                                                       read_input(str(path)), max_in_flight=1)}
    assert e.scheduler.prefix_cache_hits == hits0  # one at a time, and never across salts
    assert "text" in results["a"] and "text" in results["b"]
    assert "cache_salt" in results["empty"]["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_cache_salt_decides_what_usage_reports_as_cached(path):
    prompt = fresh_prompt(3)
    if path == "/v1/completions":
        base = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    else:
        text = "A system prompt that two tenants send word for word, to see what they share."  # byte tokens
        base = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
    with running_server() as (url, state):
        def cached(**extra) -> int:
            r = httpx.post(url + path, json={**base, **extra}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(cache_salt="a") == 0
        assert cached(cache_salt="b") == 0
        assert cached() == 0
        assert cached(cache_salt="a") > 0 and cached(cache_salt="b") > 0 and cached() > 0
        r = httpx.post(url + path, json={**base, "cache_salt": ""}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        pool = state.client.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks - 1
