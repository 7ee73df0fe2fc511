"""One front door: the same request field with the same value gets the same answer over HTTP, in a
/v1/batches line, in a JSONL job record and through `LLM.generate` -- served everywhere, or refused
everywhere naming the same field. A job file mixing bad records with good ones finishes with one line per record."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine_factory import VARIANTS, make_engine
from jaxcb.engine import LLM
from jaxcb.errors import InvalidRequestError
from jaxcb.jobs import generate_results, read_input
from jaxcb.sampling_params import SamplingParams
from server_harness import running_server

PROMPT = "Hello"
SIXTEEN = [f"s{i}" for i in range(16)]
# (fields beside a short prompt and max_tokens=2, the field a refusal names, or None: served)
CASES = [
    ({"temperature": 0}, None),
    ({"temperature": 2}, None),
    ({"top_k": -1}, None),  # vLLM's "no limit", at every door
    ({"top_k": 5, "seed": 3}, None),
    ({"top_k": 2 ** 31, "seed": 3}, None),  # no limit; it once overflowed the step's int32 and stopped the engine
    ({"seed": 2 ** 64 - 1}, None),
    ({"top_p": 0.5, "seed": 3}, None),
    ({"min_p": 0.1, "seed": 3}, None),
    ({"stop": SIXTEEN}, None),
    ({"presence_penalty": 1.5, "frequency_penalty": -1}, None),
    ({"repetition_penalty": 1.2}, None),
    ({"logprobs": 2}, None),
    ({"n": 2, "seed": 1}, None),
    ({"logit_bias": {"5": 10}}, None),
    ({"allowed_token_ids": [5, 6, 7]}, None),
    ({"stop_token_ids": [3], "min_tokens": 1}, None),
    ({"ignore_eos": True}, None),
    ({"bad_words": ["ab"]}, None),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, None),
    ({"prompt_logprobs": 1}, None),
    ({"temperature": 5}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"seed": "abc"}, "seed"),  # once crashed a whole job
    ({"seed": 2 ** 64}, "seed"),
    ({"logit_bias": {"\uff15": 1}}, "logit_bias"),  # a full-width 5: int() takes it, a token id is ASCII
    ({"seed": 1.5}, "seed"),
    ({"stop": SIXTEEN + ["s16"]}, "stop"),
    ({"stop": [""]}, "stop.0"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"n": 100}, "n"),  # past scheduler.max_num_seqs
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),  # past engine.max_model_len
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 1000}, "logprobs"),  # past engine.max_logprobs
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids.0"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
]


def body(fields: dict) -> dict:
    return {"prompt": PROMPT, "max_tokens": 2, **fields}


@pytest.fixture(scope="module")
def engine():
    return make_engine(*VARIANTS)


def generate_door(llm: LLM, fields: dict):
    b = body(fields)
    prompt = b.pop("prompt")
    try:
        llm.generate([prompt], SamplingParams(**b), use_tqdm=False)  # one prompt, whatever its form
    except InvalidRequestError as e:
        return e.field
    return None


@pytest.fixture(scope="module")
def outcomes(engine, tmp_path_factory):
    """{door: [the field each case's refusal named, or None]}, the doors taken one after another on one engine."""
    llm = LLM.__new__(LLM)
    llm.engine = engine
    result = {"generate": [generate_door(llm, fields) for fields, _ in CASES]}
    # A job: every case as a record, between lines that are no record at all.
    path = tmp_path_factory.mktemp("job") / "in.jsonl"
    lines = []
    for i, (fields, _) in enumerate(CASES):
        lines.append(json.dumps({"id": f"r{i}", **body(fields)}))
        if i % 10 == 0:
            lines.append("{not json")
    path.write_text("\n".join(lines) + "\n")
    records = read_input(str(path))
    written = list(generate_results(llm, records, max_in_flight=8))
    assert len(written) == len(records)  # one line per record, good or bad: the job finished
    assert sum(1 for r in written if r["id"] is None) == sum(1 for line in lines if line == "{not json")
    by_id = {r["id"]: r for r in written if r["id"] is not None}
    result["job"] = [by_id[f"r{i}"].get("field", "?") if "error" in by_id[f"r{i}"] else None
                     for i in range(len(CASES))]
    result["job_records"] = by_id
    assert not engine.has_unfinished_requests()
    with running_server(f"server.batch_dir={tmp_path_factory.mktemp('batches')}", engine=engine) as (url, _):
        http = []
        for fields, _ in CASES:
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body(fields)}, timeout=120)
            assert r.status_code in (200, 400), r.text
            http.append(None if r.status_code == 200 else r.json()["error"]["param"])
        result["http"] = http
        result["batch"] = batch_door(url)
    return result


def batch_door(url: str) -> list:
    """Every case as a line of one /v1/batches batch: the param of each line's error response, or None."""
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", **body(fields)}}) for i, (fields, _) in enumerate(CASES)]
    upload = httpx.post(f"{url}/v1/files", data={"purpose": "batch"},
                        files={"file": ("in.jsonl", "\n".join(lines).encode())}, timeout=60).json()
    batch = httpx.post(f"{url}/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}, timeout=60).json()
    while batch["status"] != "completed":
        time.sleep(0.05)
        batch = httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=60).json()
    answers = {}
    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        for line in httpx.get(f"{url}/v1/files/{file_id}/content", timeout=60).text.splitlines():
            r = json.loads(line)["response"]
            answers[json.loads(line)["custom_id"]] = None if r["status_code"] == 200 else r["body"]["error"]["param"]
    return [answers[f"r{i}"] for i in range(len(CASES))]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[json.dumps(c[0])[:40] for c in CASES])
def test_every_door_gives_the_same_answer(outcomes, i):
    fields, expected = CASES[i]
    got = {door: outcomes[door][i] for door in ("http", "batch", "job", "generate")}
    assert got == {"http": expected, "batch": expected, "job": expected, "generate": expected}, fields


def test_served_job_records_carry_what_was_asked(outcomes):
    by_id = outcomes["job_records"]
    index = {json.dumps(fields): i for i, (fields, _) in enumerate(CASES)}
    n2 = by_id[f"r{index[json.dumps({'n': 2, 'seed': 1})]}"]
    assert [c["index"] for c in n2["choices"]] == [0, 1] and n2["usage"]["completion_tokens"] == 4
    lp = by_id[f"r{index[json.dumps({'logprobs': 2})]}"]
    assert len(lp["logprobs"]["tokens"]) == len(lp["token_ids"]) == 2
    assert all(len(top) >= 1 for top in lp["logprobs"]["top_logprobs"])
    plp = by_id[f"r{index[json.dumps({'prompt_logprobs': 1})]}"]
    assert plp["prompt_logprobs"][0] is None and len(plp["prompt_logprobs"]) == plp["usage"]["prompt_tokens"]
    refused = by_id[f"r{index[json.dumps({'seed': 'abc'})]}"]
    assert "seed" in refused["error"] and refused["field"] == "seed"


def test_llm_chat_renders_as_the_chat_endpoint_does_and_generates_its_reply(engine, tmp_path):
    """vLLM's LLM.chat: the conversation rendered by the one chat path (the server's /tokenize gives the same
    ids), the greedy reply the chat endpoint's, messages checked as a body's; a chat_template of its own."""
    llm = LLM.__new__(LLM)
    llm.engine = engine
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [one], [again] = llm.chat(conversation, greedy, use_tqdm=False), llm.chat([conversation], greedy, use_tqdm=False)
    assert one.outputs[0].token_ids == again.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="images are not supported") as e:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    assert e.value.field == "messages.0.content.0"
    [own] = llm.chat(conversation, greedy, use_tqdm=False,
                     chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert llm.tokenizer.decode(own.prompt_token_ids) == "system: Be brief.\nuser: hi\n"
    assert llm.tokenizer.chat_template != "{% for m in messages %}"  # the engine's own template is untouched
    with running_server(engine=engine) as (url, _):
        ids = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": conversation}, timeout=60).json()
        reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": conversation,
                                                               "max_tokens": 4, "temperature": 0, "ignore_eos": True},
                           timeout=60).json()
    assert ids["tokens"] == one.prompt_token_ids
    assert reply["choices"][0]["message"]["content"] == one.outputs[0].text
