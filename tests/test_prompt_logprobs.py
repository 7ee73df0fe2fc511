"""prompt_logprobs: every prompt token's logprob (and the top-n at each position), from the step's
prompt-logprobs variant, equal to what sampling reports for the same token at the same place."""

import json

import numpy as np
import pytest

from engine_factory import VARIANTS, shared_engine as _shared_engine
from jaxcb import SamplingParams
from jaxcb.errors import InvalidRequestError


def shared_engine(*overrides: str):
    return _shared_engine(*VARIANTS, *overrides)


def run(e, prompt, params):
    rid = e.add_request(prompt, params)
    final = None
    while e.has_unfinished_requests():
        for out in e.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def test_prompt_logprobs_equal_the_logprob_of_the_same_token_sampled_at_that_place():
    e = shared_engine()
    prompt = "The quick brown fox jumps over the lazy dog, twice over: the quick brown fox."  # > one 64-token chunk
    out = run(e, prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    ids = out.prompt_token_ids
    assert len(ids) > 64 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for k in (1, 5, 40, 63, 64, 65, len(ids) - 1):
        entry = out.prompt_logprobs[k]
        assert ids[k] in entry and len(entry) >= 3
        # the same token forced by allowed_token_ids after the same prefix: its (raw) logprob and the top 3
        forced = run(e, ids[:k], SamplingParams(max_tokens=1, temperature=0, logprobs=3, allowed_token_ids=[ids[k]]))
        sampled = forced.outputs[0].logprobs[0]
        assert forced.outputs[0].token_ids == [ids[k]]
        np.testing.assert_allclose(entry[ids[k]], sampled[ids[k]], rtol=1e-4, atol=1e-4)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:3]
        assert {t for t, _ in top} == set(sampled) - ({ids[k]} - {t for t, _ in top})
    assert e.num_recompiles == 0
    assert e.block_pool.num_free_blocks == e.block_pool.num_blocks - 1


def test_prompt_logprobs_skip_the_prefix_cache_and_give_the_same_values():
    e = shared_engine("cache.enable_prefix_caching=true")
    prompt = "shared prefix " * 6
    first = run(e, prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    again = run(e, prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert again.num_cached_tokens == 0  # computed again: a cached block has no logits
    for a, b in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys() and a == pytest.approx(b, abs=1e-5)


def test_prompt_logprobs_beyond_the_limit_or_without_the_variant_are_refused():
    e = shared_engine()
    with pytest.raises(InvalidRequestError, match="engine.max_logprobs"):
        e.add_request("x", SamplingParams(prompt_logprobs=e.cfg.engine.max_logprobs + 1))
    off = shared_engine("engine.prompt_logprobs=false")
    with pytest.raises(InvalidRequestError, match="engine.prompt_logprobs=true"):
        off.add_request("x", SamplingParams(prompt_logprobs=1))
    assert not e.has_unfinished_requests() and not off.has_unfinished_requests()


def test_echo_and_prompt_logprobs_over_http_whole_and_streamed():
    import httpx

    from server_harness import running_server

    with running_server(*VARIANTS) as (url, state):
        body = {"model": "tiny", "prompt": "echo me", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2,
                "prompt_logprobs": 1}
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        plain = httpx.post(url + "/v1/completions", json={**body, "echo": False}, timeout=60).json()["choices"][0]
        assert whole["text"] == "echo me" + plain["text"]
        lp = whole["logprobs"]
        num_prompt = len(state.client.engine.tokenizer.encode("echo me"))
        assert len(lp["tokens"]) == num_prompt + 4 and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][num_prompt:] == plain["logprobs"]["token_logprobs"]
        prompt_lps = whole["prompt_logprobs"]
        assert prompt_lps[0] is None and len(prompt_lps) == num_prompt
        assert lp["token_logprobs"][1] == prompt_lps[1][str(ord("e"))]["logprob"]  # tokens 0 is <bos>
        text, chunks = "", []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == whole["text"]
        assert chunks[0]["choices"][0]["prompt_logprobs"] == prompt_lps
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0})
        assert chat.json()["choices"][0]["prompt_logprobs"][0] is None
        # text_offset: where each token's text starts in the choice's text. The BOS the tokenizer added shows
        # in the text only with skip_special_tokens=false; its offset step follows (it once counted "<bos>" always).
        for skip, head in ((True, "echo me"), (False, "<bos>echo me")):
            got = httpx.post(url + "/v1/completions", json={**body, "skip_special_tokens": skip}, timeout=60).json()
            choice = got["choices"][0]
            assert choice["text"].startswith(head)
            offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
            assert tokens[0] == "<bos>" and offsets[:3] == ([0, 0, 1] if skip else [0, 5, 6])
            assert [choice["text"][o] for o in offsets[1:num_prompt]] == list("echo me")
