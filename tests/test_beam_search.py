"""Beam search (`use_beam_search`, `LLM.beam_search`): vLLM's algorithm above the engine, the same beams as
transformers' beam search, the same result by every door, and every field it would not use refused by name."""

import json
import time

import httpx
import pytest
import torch

from engine_factory import BASE, shared_engine
from hf_checkpoints import make_hf_llama, write_word_tokenizer
from jaxcb.beam_search import BeamSearch, BeamSearchParams
from jaxcb.config import compose_config
from jaxcb.engine import LLM
from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.sampling_params import SamplingParams
from server_harness import running_server

PROMPTS = [[1, 5, 9, 77, 3], [1] + list(range(10, 30)), [1, 130, 129, 4, 4, 4, 4, 8, 100]]


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A random tiny Llama checkpoint in fp32: transformers' model (which never ends a beam: no EOS) and a
    jaxcb LLM over the same files."""
    path = str(tmp_path_factory.mktemp("beam-hf"))
    model = make_hf_llama(path)
    write_word_tokenizer(path, 131)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    llm = LLM(compose_config(BASE + ("model=hf", f"model.checkpoint={path}", "model.dtype=float32")), progress=False)
    return model, llm


@pytest.mark.parametrize("width, max_tokens, length_penalty", [(3, 6, 1.0), (4, 5, 0.0), (2, 8, 2.0)])
def test_the_beams_are_transformers_beam_searchs_beams(hf_pair, width, max_tokens, length_penalty):
    """With no end token both keep the best `width` extensions of every round and end with them, best first."""
    model, llm = hf_pair
    outs = llm.beam_search(PROMPTS, BeamSearchParams(width, max_tokens, length_penalty, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                max_new_tokens=max_tokens, do_sample=False, early_stopping=False,
                                length_penalty=length_penalty)
        assert [c.token_ids for c in out.outputs] == [s[len(prompt):].tolist() for s in hf]
        assert out.prompt_token_ids == prompt and all(c.finish_reason == "length" for c in out.outputs)
    assert not llm.engine.has_unfinished_requests()
    pool = llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_one_beam_is_greedy_decoding(hf_pair):
    _, llm = hf_pair
    beams = llm.beam_search(PROMPTS, BeamSearchParams(1, 7, ignore_eos=True))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert [b.outputs[0].token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]


def _round(*candidates: dict[int, float], finish: str = "length") -> list[RequestOutput]:
    return [RequestOutput("r", None, [], [CompletionOutput(0, "", [max(c, key=c.get)] if c else [], finish,
                                                           [c] if c else [])], True)
            for c in candidates]


def test_a_round_ranks_extensions_and_sets_beams_ended_by_an_end_token_aside_as_vllm_does():
    eos = 2
    search = BeamSearch(None, [1, 7, 8], BeamSearchParams(2, 3), frozenset({eos}))
    search.advance(_round({5: -0.1, eos: -0.5, 6: -1.0, 9: -2.0}))  # top 4 = 2 x width candidates
    assert [(b.tokens, b.cum_logprob) for b in search.live] == [([5], -0.1), ([6], -1.0)]
    assert [(b.tokens, b.finish_reason) for b in search.finished] == [([], "stop")]  # the end token: not in tokens
    search.advance(_round({4: -3.0, 3: -3.5, 10: -9, 11: -9}, {4: -0.2, 3: -0.3, 10: -9, 11: -9}))
    assert [b.tokens for b in search.live] == [[6, 4], [6, 3]]  # -1.2, -1.3 beat [5, 4]'s -3.1
    search.advance(_round({eos: -0.01, 9: -5, 10: -9, 11: -9}, {9: -0.1, eos: -4, 10: -9, 11: -9}))
    assert search.done and search.rounds == 3
    out = search.result("r", _DigitTokenizer())
    # Scores: cumulative logprob / length (prompt + tokens, the end token not counted): the early stop's -0.5 / 3
    # first, then the live [6, 3, 9] (-1.4 / 6 = -0.233) before [6, 4] stopped (-1.21 / 5 = -0.242), cut by the width.
    assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [([], "stop"), ([6, 3, 9], "length")]
    assert out.outputs[1].text == "6 3 9" and out.prompt_token_ids == [1, 7, 8]
    assert [b.tokens for b in search.finished] == [[], [6, 4], [6, 3]]  # [6, 3]'s end was among its candidates


def test_length_penalty_include_stop_str_and_ignore_eos_change_what_a_round_keeps():
    eos = 2
    long_first = BeamSearch(None, [1], BeamSearchParams(1, 2, length_penalty=4.0), frozenset({eos}))
    long_first.advance(_round({eos: -0.5, 5: -0.6}))
    long_first.advance(_round({6: -0.1, eos: -3}))
    # -0.7 / 3**4 beats the stopped -0.5 / 1**4: a large penalty favours the longer beam
    assert long_first.result("r", _DigitTokenizer()).outputs[0].token_ids == [5, 6]
    kept = BeamSearch(None, [1], BeamSearchParams(1, 2, include_stop_str_in_output=True), frozenset({eos}))
    kept.advance(_round({eos: -0.1, 5: -3}))
    kept.advance(_round({5: -3, 6: -4}))
    assert kept.result("r", _DigitTokenizer()).outputs[0].token_ids == [eos]  # its score still leaves the end out
    plain = BeamSearch(None, [1], BeamSearchParams(2, 1, ignore_eos=True), frozenset({eos}))
    plain.advance(_round({eos: -0.1, 5: -3, 6: -4, 7: -5}))
    assert not plain.finished and [b.tokens for b in plain.live] == [[eos], [5]]
    cut = BeamSearch(None, [1], BeamSearchParams(2, 5), frozenset({eos}))
    cut.advance(_round({5: -0.1, 6: -0.2, 7: -1, 8: -1}))
    cut.advance(_round({}, {}, finish="timeout"))
    assert cut.done and [c.finish_reason for c in cut.result("r", _DigitTokenizer()).outputs] == ["timeout"] * 2


class _DigitTokenizer:
    eos_token_ids = [2]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(f"server.batch_dir={tmp_path_factory.mktemp('batches')}", engine=shared_engine()) as (url, state):
        yield url, state


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=120, **kw)


def assert_idle(state):
    engine = state.client.engine
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    pool = engine.block_pool
    assert not engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks - 1


COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "n": 3, "use_beam_search": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2,
        "use_beam_search": True, "length_penalty": 0.5}


def test_every_door_gives_the_same_beams(server, tmp_path):
    """HTTP whole and streamed, a batch line, a job over the server, and LLM.beam_search / an offline job on the
    same engine: one search, one answer; nothing left in the engine."""
    from openai import OpenAI

    from jaxcb.jobs import JobRecord, generate_results

    url, state = server
    whole = {}
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = post(url, path, body)
        assert r.status_code == 200, r.text
        whole[path] = [c["text"] if "text" in c else c["message"]["content"] for c in r.json()["choices"]]
        assert len(whole[path]) == body["n"] and r.json()["usage"]["completion_tokens"] > 0
        r = post(url, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        streamed = [""] * body["n"]
        for c in chunks:
            for choice in c["choices"]:
                streamed[choice["index"]] += choice.get("text") or choice.get("delta", {}).get("content") or ""
        assert streamed == whole[path] and chunks[-1]["usage"]["completion_tokens"] > 0
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": COMPLETION}]
    upload = client.files.create(file=("in.jsonl", json.dumps(lines[0]).encode() + b"\n"), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        time.sleep(0.05)
    [result] = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [c["text"] for c in result["response"]["body"]["choices"]] == whole["/v1/completions"]
    assert_idle(state)
    llm = LLM.__new__(LLM)  # offline: an engine of the same config beside the server's
    llm.engine = shared_engine("scheduler.policy=fcfs")
    [offline] = llm.beam_search("hello", BeamSearchParams(3, 6))
    assert [c.text for c in offline.outputs] == whole["/v1/completions"]
    records = [JobRecord(1, "a", {"id": "a", **COMPLETION}), JobRecord(2, "b", {"id": "b", **CHAT}),
               JobRecord(3, "plain", {"id": "plain", "prompt": "hello", "max_tokens": 3})]
    results = {r["id"]: r for r in generate_results(llm, records, 64)}
    assert [c["text"] for c in results["a"]["choices"]] == whole["/v1/completions"]
    assert [c["text"] for c in results["b"]["choices"]] == whole["/v1/chat/completions"]
    assert results["plain"]["usage"]["completion_tokens"] == 3
    pool = llm.engine.block_pool
    assert not llm.engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks - 1


@pytest.mark.parametrize("path, change, param", [
    ("/v1/completions", {"top_p": 0.5}, "top_p"),
    ("/v1/completions", {"temperature": 0.7}, "temperature"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"stop": ["x"]}, "stop"),
    ("/v1/completions", {"seed": 3}, "seed"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ("/v1/completions", {"n": 11}, "n"),  # 22 log-probabilities a round: past engine.max_logprobs=20
    ("/v1/completions", {"length_penalty": float("inf")}, None),  # not JSON: the body is refused as a whole
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
])
def test_a_field_beam_search_would_not_use_is_refused_naming_it_and_nothing_is_queued(server, path, change, param):
    url, state = server
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), **change}
    r = httpx.post(url + path, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if param not in (None, "n", "length_penalty"):
        assert "not used by beam search" in r.json()["error"]["message"]
    assert_idle(state)


def test_temperature_zero_is_taken_and_responses_refuse_beam_search_naming_it(server):
    url, state = server
    assert post(url, "/v1/completions", {**COMPLETION, "temperature": 0, "max_tokens": 2}).status_code == 200
    r = post(url, "/v1/responses", {"model": "tiny", "input": "hi", "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    assert "/v1/completions and /v1/chat/completions" in r.json()["error"]["message"]
    assert_idle(state)


def test_a_search_past_its_timeout_ends_with_its_beams_so_far_and_a_client_gone_aborts_its_round(server):
    url, state = server
    long = {**COMPLETION, "max_tokens": 200, "ignore_eos": True}
    r = post(url, "/v1/completions", {**long, "timeout": 0.5})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]  # (fewer than 3 only if the first round itself ran out of time)
    assert {c["finish_reason"] for c in choices} == {"timeout"} and 1 <= len(choices) <= 3
    assert r.json()["usage"]["completion_tokens"] < 3 * 200
    assert_idle(state)
    with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        time.sleep(0.3)  # a few rounds in, the client leaves without reading
    assert_idle(state)


def test_offline_rounds_wait_for_room_under_admission_limits_as_plain_records_do():
    """A later round the engine says to retry (scheduler.max_waiting_requests) waits for the next step, and a
    plain record refused beside a search in flight waits too: every record is served, nothing is left."""
    from jaxcb.jobs import JobRecord, generate_results

    llm = LLM.__new__(LLM)
    llm.engine = engine = shared_engine("scheduler.policy=fcfs")
    saved = engine.max_waiting_requests
    engine.max_waiting_requests = (1, "scheduler.max_waiting_requests=1")
    try:
        records = [JobRecord(1, "beam", {"id": "beam", "prompt": "hello", "max_tokens": 4, "n": 1,
                                         "use_beam_search": True, "ignore_eos": True}),
                   *(JobRecord(2 + i, f"p{i}", {"id": f"p{i}", "prompt": "hi", "max_tokens": 3}) for i in range(3))]
        results = {r["id"]: r for r in generate_results(llm, records, 64)}
        assert not any("error" in r for r in results.values()), results
        assert len(results["beam"]["token_ids"]) == 4
        [searched] = llm.beam_search("hello", BeamSearchParams(1, 4, ignore_eos=True))
        assert searched.outputs[0].token_ids == results["beam"]["token_ids"]
    finally:
        engine.max_waiting_requests = saved
    pool = engine.block_pool
    assert not engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks - 1


class _FakeClient:
    """An EngineClient whose every request's one token ranks the vocabulary the same way; records each add."""

    def __init__(self, overloaded_after: int = 10 ** 9):
        from jaxcb.tokenizer import ByteTokenizer

        self.tokenizer, self.max_model_len, self.max_n = ByteTokenizer(), 256, 16
        self.adds, self.streams, self.overloaded_after = [], [], overloaded_after

    async def add(self, prompt, params, **kw):
        from jaxcb.errors import EngineOverloadedError

        if len(self.adds) >= self.overloaded_after:
            raise EngineOverloadedError("the queue is full; retry later", retry_after_s=0.01)
        self.adds.append((list(prompt), params, kw))
        top = {t: -0.1 * k - 0.01 * len(prompt) for k, t in enumerate(range(70, 70 + params.logprobs))}
        out = RequestOutput(f"r{len(self.adds)}", None, list(prompt),
                            [CompletionOutput(0, "", [70], "length", [top])], True)
        stream = _FakeStream(out)
        self.streams.append(stream)
        return stream


class _FakeStream:
    def __init__(self, out):
        self.out, self.closed = out, False

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        yield self.out

    def close(self):
        self.closed = True


def test_the_queue_deadline_holds_the_first_round_only_and_a_search_past_its_timeout_stops_retrying():
    import asyncio

    from jaxcb.server.beam_streams import start_planned_beam_search
    from jaxcb.server.requests import PlannedRequest

    planned = PlannedRequest(["hi"], SamplingParams(n=2, max_tokens=3), beam=BeamSearchParams(2, 3))

    async def run(client, deadlines):
        streams = await start_planned_beam_search(client, planned, deadlines)
        return [out for s in streams async for out in s]

    client = _FakeClient()
    [out] = asyncio.run(run(client, {"queue_timeout_s": 5.0, "timeout_s": 60.0}))
    assert [c.finish_reason for c in out.outputs] == ["length", "length"] and len(client.adds) == 1 + 2 + 2
    assert all("queue_timeout_s" in kw["deadlines"] for _, _, kw in client.adds[:1])
    assert not any("queue_timeout_s" in kw["deadlines"] for _, _, kw in client.adds[1:])
    assert all(s.closed for s in client.streams)
    # Overloaded for good after the first round: the retries stop at the search's timeout, with what it has.
    client = _FakeClient(overloaded_after=1)
    [out] = asyncio.run(asyncio.wait_for(run(client, {"timeout_s": 0.3}), 10))
    assert [c.finish_reason for c in out.outputs] == ["timeout", "timeout"]
    assert [len(c.token_ids) for c in out.outputs] == [1, 1]


def test_closing_a_search_before_it_has_run_closes_its_first_round():
    import asyncio

    from jaxcb.server.beam_streams import start_planned_beam_search
    from jaxcb.server.requests import PlannedRequest

    planned = PlannedRequest(["hi"], SamplingParams(n=2, max_tokens=3), beam=BeamSearchParams(2, 3))
    client = _FakeClient()

    async def start_and_close():
        [stream] = await start_planned_beam_search(client, planned)
        stream.close()  # before its task ever ran
        await asyncio.sleep(0.05)
        return stream

    stream = asyncio.run(start_and_close())
    assert stream.task.cancelled() and [s.closed for s in client.streams] == [True]


def test_more_beams_than_server_max_n_are_refused_naming_n(server):
    from jaxcb.beam_search import beam_searches
    from jaxcb.errors import InvalidRequestError
    from jaxcb.tokenizer import ByteTokenizer

    with pytest.raises(InvalidRequestError, match=r"n=3 exceeds server\.max_n=2; ask for at most 2 beams") as e:
        beam_searches(["hi"], BeamSearchParams(3, 2), ByteTokenizer(), 64, max_n=2)
    assert e.value.field == "n"
    url, state = server
    saved, state.client.max_n = state.client.max_n, 2
    try:
        r = post(url, "/v1/completions", COMPLETION)  # n=3 beams
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    finally:
        state.client.max_n = saved
    assert_idle(state)
