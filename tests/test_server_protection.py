"""The server protects itself by default (admission control), reports prefix-cache hits in usage,
and serves OpenAI's full top_logprobs range."""

from __future__ import annotations

import openai

from engine_factory import make_engine
from jaxcb.errors import EngineOverloadedError
from jaxcb.sampling_params import SamplingParams
from server_harness import post_all_at_once, running_server


def test_a_default_server_answers_an_overload_with_429s_and_no_5xx_and_leaks_nothing():
    # Only max_num_seqs is set: the limit is server.admission_control's default, 8 x 2 waiting requests.
    with running_server("scheduler.max_num_seqs=2") as (url, state):
        results = post_all_at_once(url, "/v1/completions", [
            {"model": "tiny", "prompt": [i % 200 + 1] * 20, "max_tokens": 8, "ignore_eos": True} for i in range(60)
        ])
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 16
        refused = next(r for r in results if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert "server.admission_control: 8 x scheduler.max_num_seqs=2" in refused.json()["error"]["message"]
        pool = state.client.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks - 1  # cached blocks wait in the free queue, unreferenced
        assert not state.client.engine.has_unfinished_requests()


def test_offline_engines_queue_without_bound_and_the_server_default_is_off_when_disabled():
    engine = make_engine("scheduler.max_num_seqs=2", "cache.num_blocks=64")
    params = SamplingParams(max_tokens=1)
    ids = [engine.add_request([5, 6, 7], params) for _ in range(40)]  # 20 x max_num_seqs: no refusal
    engine.enable_admission_control()
    try:
        engine.add_request([5, 6, 7], params)
        raise AssertionError("admission control did not refuse")
    except EngineOverloadedError as e:
        assert "8 x scheduler.max_num_seqs=2" in str(e)
    for rid in ids:
        engine.abort(rid)
    with running_server("server.admission_control=false") as (_, state):
        assert state.client.engine.max_waiting_requests is None and state.client.engine.max_waiting_tokens is None


def test_usage_reports_prompt_tokens_found_in_the_prefix_cache_and_top_logprobs_reach_20():
    with running_server() as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        prompt = [7] * 40  # two full 16-token blocks, then a partial one
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == 32
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=20,
        )
        assert all(len(t.top_logprobs) == 20 for t in chat.choices[0].logprobs.content)
