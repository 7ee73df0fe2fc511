"""A grammar that holds only the answer after the model's reasoning, gated on the `</think>` token (the engine's
token constraint leaves the reasoning free and the grammar untouched until that token), on a random HF Llama whose
byte-level vocabulary has `<think>` and `</think>` as tokens of their own, as Qwen3's and DeepSeek-R1's do."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest

from engine_factory import VARIANTS, make_engine
from hf_checkpoints import make_hf_llama, write_byte_tokenizer
from jaxcb.server.reasoning import ReasoningParser, ReplyStart, hold_answer
from jaxcb.structured import GrammarCompiler, StructuredOutputs, TokenConstraint, bitmask_words
from jaxcb.structured.spec import ReasoningGate
from jaxcb.tokenizer import load_tokenizer
from server_harness import running_server
from test_reasoning import ASK, THINK_TEMPLATE  # Qwen3's shape: the generation prompt opens <think>

BOS, EOS, THINK, END_THINK = 256, 257, 258, 259
INSIDE, MAY_OPEN = ReplyStart(True, False), ReplyStart(False, True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("think-vocab")
    vocab = write_byte_tokenizer(str(path), ("<think>", "</think>"), THINK_TEMPLATE)
    make_hf_llama(str(path), vocab_size=vocab, bos_token_id=BOS, eos_token_id=EOS)
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(str(checkpoint))


@pytest.fixture(scope="module")
def overrides(checkpoint):
    return (*VARIANTS, "model=hf", f"model.checkpoint={checkpoint}", "model.dtype=float32")


@pytest.fixture(scope="module")
def engine(overrides):
    return make_engine(*overrides)


def allowed(constraint: TokenConstraint, vocab: int) -> set[int]:
    row = np.zeros(bitmask_words(vocab), np.int32)
    constraint.fill(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_a_single_think_token_gates_the_grammar_and_a_split_one_composes_it(tokenizer):
    regex = StructuredOutputs("regex", "[a-z]{1,8}", "structured_outputs.regex")
    gated = hold_answer(regex, INSIDE, tokenizer)
    assert (gated.kind, gated.text) == (regex.kind, regex.text)
    assert gated.after_reasoning == ReasoningGate(END_THINK, True, None)
    assert hold_answer(regex, MAY_OPEN, tokenizer).after_reasoning == ReasoningGate(END_THINK, False, THINK)
    # A GBNF grammar cannot be composed, but it can be gated.
    gbnf = StructuredOutputs("grammar", 'root ::= "yes" | "no"', "structured_outputs.grammar")
    assert hold_answer(gbnf, INSIDE, tokenizer).after_reasoning is not None

    from jaxcb.tokenizer import ByteTokenizer  # </think> is eight tokens there: the grammar is composed

    composed = hold_answer(regex, INSIDE, ByteTokenizer())
    assert composed.kind == "lark" and r"<\/think>" in composed.text and composed.after_reasoning is None


def test_the_constraint_leaves_the_reasoning_free_then_holds_the_answer(tokenizer):
    vocab = tokenizer.vocab_size
    compiled = GrammarCompiler(tokenizer, vocab, [EOS], max_compile_s=30).compile(
        StructuredOutputs("regex", "[a-z]{1,3}", "structured_outputs.regex"))
    letters = set(tokenizer.encode("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False))

    inside = TokenConstraint(vocab, grammar=compiled.matcher(), after_reasoning=ReasoningGate(END_THINK, True))
    assert allowed(inside, vocab) == set(range(vocab)) and inside.in_reasoning
    for token in tokenizer.encode("{not [a-z]} 42", add_special_tokens=False):
        assert inside.accept(token) is None and not inside.is_terminated
    assert inside.accept(END_THINK) is None and not inside.in_reasoning
    assert allowed(inside, vocab) == letters  # the grammar's first tokens, from its start
    assert inside.accept(tokenizer.encode("{", add_special_tokens=False)[0]) is not None  # now held
    fresh = TokenConstraint(vocab, grammar=compiled.matcher(), after_reasoning=ReasoningGate(END_THINK, True))
    fresh.accept(END_THINK)
    for token in tokenizer.encode("abc", add_special_tokens=False):
        assert fresh.accept(token) is None
    assert fresh.is_terminated and allowed(fresh, vocab) == {EOS}

    # A reply that may open its reasoning: the answer's first tokens or <think>, which frees what follows.
    opening = TokenConstraint(vocab, grammar=compiled.matcher(), after_reasoning=ReasoningGate(END_THINK, False, THINK))
    assert allowed(opening, vocab) == letters | {THINK}
    assert opening.accept(THINK) is None and opening.in_reasoning and allowed(opening, vocab) == set(range(vocab))
    answering = TokenConstraint(vocab, grammar=compiled.matcher(), after_reasoning=ReasoningGate(END_THINK, False, THINK))
    answering.accept(tokenizer.encode("a", add_special_tokens=False)[0])
    assert THINK not in allowed(answering, vocab) and not answering.in_reasoning

    # allowed_token_ids and bad words bind in the reasoning too.
    bounded = TokenConstraint(vocab, grammar=compiled.matcher(), allowed_token_ids=[5, 6, END_THINK],
                              bad_words_ids=[(6,)], after_reasoning=ReasoningGate(END_THINK, True))
    assert allowed(bounded, vocab) == {5, END_THINK}


def chat(url: str, model: str, whole: bool = False, **body) -> dict:
    reply = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": ASK, "temperature": 1.0, "max_tokens": 48, **body})
    assert reply.status_code == 200, reply.text
    return reply.json() if whole else reply.json()["choices"][0]


def streamed_usage(url: str, model: str, **body) -> dict:
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": ASK, "temperature": 1.0, "max_tokens": 48, "stream": True,
                            "stream_options": {"include_usage": True}, **body}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return chunks[-1]["usage"]


def test_the_answer_is_held_to_the_grammar_after_free_reasoning(engine, overrides, tokenizer):
    # The bias makes the random model close its reasoning within a few tokens; the grammar masks </think> after.
    bias = {str(END_THINK): 6.0}
    with running_server(*overrides, engine=engine) as (url, state):
        free = state.client.engine.block_pool.num_free_blocks
        reasonings = []
        for seed in range(4):
            choice = chat(url, state.model_name, structured_outputs={"regex": "[a-z]{1,8}"}, logit_bias=bias, seed=seed)
            message = choice["message"]
            assert choice["finish_reason"] == "stop", choice
            assert re.fullmatch(r"[a-z]{1,8}", message["content"]), message
            reasonings.append(message["reasoning_content"] or "")
        # Usage counts the reasoning's tokens, through </think>, whole and streamed alike.
        reply = chat(url, state.model_name, whole=True, structured_outputs={"regex": "[a-z]{1,8}"},
                     logit_bias=bias, seed=0)
        text = reply["choices"][0]["message"]
        thought = reply["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert thought == len(tokenizer.encode(text["reasoning_content"] or "", add_special_tokens=False)) + 1
        assert streamed_usage(url, state.model_name, structured_outputs={"regex": "[a-z]{1,8}"}, logit_bias=bias,
                              seed=0) == reply["usage"]
        # The reasoning ran free: a random model's bytes, not the answer's letters.
        assert any(not re.fullmatch(r"[a-z]*", r) for r in reasonings), reasonings

        # A GBNF grammar, refused where it would have to be composed, holds the answer here.
        for seed in range(3):
            choice = chat(url, state.model_name, structured_outputs={"grammar": 'root ::= "yes" | "no"'}, logit_bias=bias, seed=seed)
            assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop", choice

        # The reasoning may end the reply, as an unconstrained one may: EOS is not masked before </think>.
        choice = chat(url, state.model_name, structured_outputs={"regex": "[a-z]{1,8}"}, logit_bias={str(EOS): 100.0}, seed=0)
        assert choice["finish_reason"] == "stop" and not choice["message"]["content"], choice
        assert state.client.engine.block_pool.num_free_blocks == free


def test_a_closed_reasoning_in_the_prompt_holds_the_reply_from_its_first_token(engine, overrides):
    with running_server(*overrides, engine=engine) as (url, state):
        choice = chat(url, state.model_name, structured_outputs={"regex": "[a-z]{1,8}"}, seed=1,
                      chat_template_kwargs={"enable_thinking": False})
        assert choice["message"]["reasoning_content"] is None
        assert re.fullmatch(r"[a-z]{1,8}", choice["message"]["content"]), choice


def test_the_parser_reads_the_gated_reply_as_the_engine_held_it(tokenizer):
    # What the engine let through splits at the same </think> token the gate opened at.
    text = tokenizer.decode(tokenizer.encode("x{1</think>abc", add_special_tokens=False), skip_special_tokens=True)
    split = ReasoningParser("qwen3").split(text, INSIDE)
    assert (split.reasoning, split.content) == ("x{1", "abc")
