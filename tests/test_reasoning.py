"""Reasoning (`<think>...</think>`) read apart from the answer: the parsers on text, the grammar that holds only the
answer, and the chat endpoint on a random tiny model whose chat template opens `<think>` -- where only a grammar
makes the model close its reasoning, so every split checked here is the parser's doing."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest

from engine_factory import VARIANTS, make_engine
from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.server.reasoning import ReasoningParser, ReplyStart, after_reasoning, get_reasoning_parser
from jaxcb.structured.spec import StructuredOutputs, StructuredOutputsError
from server_harness import running_server

# Qwen3's shape: the generation prompt opens <think>, or writes an empty, closed one without thinking.
THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "Think, then answer."}]
THOUGHT_THEN_ANSWER = r"[a-z ]{1,12}</think>[a-z]{1,8}"
INSIDE, OUTSIDE, MAY_OPEN = ReplyStart(True, False), ReplyStart(False, False), ReplyStart(False, True)


def streamed_split(parser: ReasoningParser, text: str, start: ReplyStart, seed: int) -> tuple[str, str]:
    streamer, rng, pos, reasoning, content = parser.streamer(start), random.Random(seed), 0, "", ""
    while pos < len(text):
        step = rng.randint(1, 4)
        r, c = streamer.feed(text[pos:pos + step])
        reasoning, content, pos = reasoning + r, content + c, pos + step
    r, c = streamer.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name, start, text, reasoning, content", [
    ("qwen3", INSIDE, "plan it</think>\n\nanswer", "plan it", "\n\nanswer"),
    ("qwen3", INSIDE, "still thinking", "still thinking", None),
    ("qwen3", MAY_OPEN, "<think>hm</think>yes", "hm", "yes"),
    ("qwen3", MAY_OPEN, "no thoughts</think>", None, "no thoughts</think>"),
    ("qwen3", OUTSIDE, "<think>x</think>y", None, "<think>x</think>y"),
    ("deepseek_r1", ReplyStart(True, True), "<think>a</think>b", "a", "b"),
    ("deepseek_r1", ReplyStart(True, True), "a</think>b", "a", "b"),
    ("deepseek_r1", ReplyStart(True, True), "a </thi", "a </thi", None),
])
def test_reasoning_splits_whole_and_streamed_the_same(name, start, text, reasoning, content):
    parser = ReasoningParser(name)
    split = parser.split(text, start)
    assert (split.reasoning, split.content) == (reasoning, content)
    for seed in range(5):
        assert streamed_split(parser, text, start, seed) == (reasoning or "", content or "")


def test_where_a_reply_starts_is_read_from_the_prompt():
    qwen3, r1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")
    assert qwen3.reply_start("<|assistant|>\n<think>\n") == INSIDE
    assert qwen3.reply_start("<|assistant|>\n<think>\n\n</think>\n\n") == OUTSIDE
    assert qwen3.reply_start("<think>old</think>done\n<|assistant|>\n") == MAY_OPEN
    assert r1.reply_start("<|Assistant|>") == ReplyStart(True, True)


def test_auto_picks_a_parser_only_for_templates_that_write_think():
    assert get_reasoning_parser("auto", "{{ messages }}") is None
    assert get_reasoning_parser("auto", THINK_TEMPLATE).name == "qwen3"
    assert get_reasoning_parser("auto", "{{ '<think>\\n' }}").name == "deepseek_r1"
    assert get_reasoning_parser(None, THINK_TEMPLATE) is None


def test_the_grammar_after_reasoning_lets_the_reasoning_run_free_and_holds_the_answer():
    from jaxcb.structured.grammar import GrammarCompiler
    from jaxcb.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids, max_compile_s=30)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    grammar = compiler.compile(after_reasoning(StructuredOutputs("json", json.dumps(schema), "response_format")))

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        return all(matcher.consume(t) for t in tok.encode(text, add_special_tokens=False))

    assert accepts('free {"not": json} </thi then</think>{"a":12}')
    assert not accepts('thought</think>plain text')
    assert not accepts('thought</think>{"a":1}</think>')
    with pytest.raises(StructuredOutputsError, match="structured_outputs_in_reasoning"):
        after_reasoning(StructuredOutputs("grammar", "root ::= \"a\"", "structured_outputs.grammar"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    return make_engine(*VARIANTS, f"server.chat_template={template}")


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body}, timeout=120)


def streamed_chat(url: str, **body) -> tuple[str, str, str]:
    """(reasoning, content, finish reason) of a streamed chat reply."""
    reasoning, content, finish = "", "", None
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": ASK, "stream": True, **body}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            [choice] = json.loads(line[6:])["choices"]
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return reasoning, content, finish


def test_a_grammar_over_the_whole_reply_drives_reasoning_then_answer_split_whole_and_streamed(engine):
    with running_server(*VARIANTS, "server.structured_outputs_in_reasoning=true", engine=engine) as (url, _):
        for seed in range(4):
            body = {"structured_outputs": {"regex": THOUGHT_THEN_ANSWER}, "temperature": 1.0, "seed": seed,
                    "max_tokens": 40}
            message = chat(url, **body).json()["choices"][0]["message"]
            assert re.fullmatch(r"[a-z ]{1,12}", message["reasoning_content"]), message
            assert re.fullmatch(r"[a-z]{1,8}", message["content"]), message
            assert streamed_chat(url, **body) == (message["reasoning_content"], message["content"], "stop")


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_content(engine):
    with running_server(*VARIANTS, engine=engine) as (url, _):
        body = {"structured_outputs": {"regex": "[a-z]{1,8}"}, "chat_template_kwargs": {"enable_thinking": False},
                "temperature": 1.0, "seed": 0, "max_tokens": 20}
        message = chat(url, **body).json()["choices"][0]["message"]
        assert message["reasoning_content"] is None and re.fullmatch(r"[a-z]{1,8}", message["content"])
        assert streamed_chat(url, **body) == ("", message["content"], "stop")


def test_reasoning_cut_by_max_tokens_is_all_reasoning_and_no_content(engine):
    with running_server(*VARIANTS, engine=engine) as (url, _):
        [choice] = chat(url, max_tokens=6, temperature=0).json()["choices"]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None


def test_a_grammar_the_answer_cannot_be_held_to_after_reasoning_is_refused_by_name(engine):
    with running_server(*VARIANTS, engine=engine) as (url, _):
        refused = chat(url, structured_outputs={"grammar": 'root ::= "a"'}, max_tokens=4)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "structured_outputs.grammar"
        assert "structured_outputs_in_reasoning" in refused.json()["error"]["message"]
    with running_server(*VARIANTS, "server.structured_outputs_in_reasoning=true", engine=engine) as (url, _):
        reply = chat(url, structured_outputs={"grammar": 'root ::= "a</think>b"'}, max_tokens=12).json()
        assert reply["choices"][0]["message"] | {"role": None} == {"role": None, "content": "b",
                                                                     "reasoning_content": "a"}


class ReplayedStream:
    """A request's outputs replayed as the engine's deltas: `text` cut into pieces of one byte-token each."""

    def __init__(self, text: str, finish_reason: str):
        self.deltas = [RequestOutput("r", None, [1, 2, 3], [CompletionOutput(
            0, ch, [ord(ch)], finish_reason if i == len(text) - 1 else None, None, i + 1)], i == len(text) - 1,
            delta=True) for i, ch in enumerate(text)]

    async def _outputs(self):
        for out in self.deltas:
            yield out

    def __aiter__(self):
        return self._outputs()

    def close(self) -> None:
        pass


def test_responses_carry_reasoning_as_a_reasoning_item_whole_and_streamed():
    import asyncio

    from jaxcb.outputs import join_deltas
    from jaxcb.server.chat import ChatPlan
    from jaxcb.server.responses import ResponsesRequest
    from jaxcb.server.responses_output import ResponseWriter
    from jaxcb.tokenizer import ByteTokenizer

    plan = ChatPlan([1, 2, 3], None, None, None, ReasoningParser("qwen3"), INSIDE)
    req = ResponsesRequest(model="tiny", input="hi")
    reply = "weigh it</think>answer"
    whole = ResponseWriter(req, plan, "tiny", ByteTokenizer()).whole(join_deltas(ReplayedStream(reply, "stop").deltas))
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "weigh it"}]
    assert whole["output"][1]["content"][0]["text"] == "answer"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == len("weigh it</think>")

    async def events():
        writer = ResponseWriter(req, plan, "tiny", ByteTokenizer())
        return [json.loads(e.split("data: ", 1)[1]) async for e in writer.events([ReplayedStream(reply, "stop")],
                                                                                 lambda response: None)]

    streamed = asyncio.run(events())
    types = [e["type"] for e in streamed]
    assert types[2:4] == ["response.output_item.added", "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta") == "weigh it"
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta") == "answer"
    assert types.index("response.reasoning_text.done") < types.index("response.content_part.added")
    final = streamed[-1]["response"]
    assert final["output"][0]["content"] == whole["output"][0]["content"] and final["status"] == "completed"
    assert final["usage"] == whole["usage"]


def test_a_jsonl_job_chat_record_splits_reasoning_as_the_chat_endpoint_does(engine):
    import dataclasses
    import types

    from jaxcb.jobs import JobRecord, generate_results

    # The module's engine, read with reasoning's grammar over the whole reply (as the server test above).
    server = dataclasses.replace(engine.cfg.server, structured_outputs_in_reasoning=True)
    saved, engine.cfg = engine.cfg, dataclasses.replace(engine.cfg, server=server)
    try:
        body = {"id": "r1", "messages": ASK, "structured_outputs": {"regex": THOUGHT_THEN_ANSWER},
                "temperature": 1.0, "seed": 3, "max_tokens": 40}
        llm = types.SimpleNamespace(engine=engine, tokenizer=engine.tokenizer)
        [result] = generate_results(llm, [JobRecord(1, "r1", body)], max_in_flight=1)
    finally:
        engine.cfg = saved
    assert re.fullmatch(r"[a-z ]{1,12}", result["reasoning_content"]), result
    assert re.fullmatch(r"[a-z]{1,8}", result["text"]), result
