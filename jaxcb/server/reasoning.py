"""Reasoning in model output: models that think in `<think>...</think>` before they answer (Qwen3,
DeepSeek-R1 and its distills). Owns `server.reasoning_parser`, splitting a reply into
`reasoning_content` and `content` (whole and streamed, from one `_scan` so that both agree), and
the grammar that holds only the answer to a request's structured outputs or forced tool calls.

Where a reply starts is read from the prompt: a prompt whose last marker is an open `<think>`
(DeepSeek-R1's templates, Qwen3's thinking ones) leaves the reply inside its reasoning; one that
ends with `</think>` (Qwen3 with `enable_thinking: false`) leaves it outside. Otherwise the parser
decides: `deepseek_r1` reads the reply as reasoning until `</think>` (a leading `<think>`
dropped), `qwen3` only when the reply opens with `<think>` (else all of it is content).

Structured outputs and forced tool calls apply after the reasoning (vLLM's default),
`hold_answer` decides how. Where `</think>` is one token of the vocabulary (as in every reasoning
model's tokenizer), the grammar is gated (`ReasoningGate`): the engine's token constraint leaves
every token allowed and the grammar untouched until that token, so the reasoning is free, may end
the reply, and any grammar (GBNF included) holds the answer. Otherwise the request's grammar is
wrapped as `(any text)</think>` then the grammar: the model then cannot end before it closes its
reasoning, and a GBNF/Lark grammar cannot be wrapped, so it is refused by name.
`server.structured_outputs_in_reasoning=true` leaves the grammar over the whole reply instead.
No jax, no llguidance: a grammar is text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Optional

from jaxcb.structured.spec import ReasoningGate, StructuredOutputs, StructuredOutputsError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS: tuple[str, ...] = ("auto", "deepseek_r1", "qwen3")
# Compact JSON, as jaxcb.structured.grammar writes it for a json spec.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_START_RULE = re.compile(r"^start(\s*):", re.MULTILINE)


@dataclass(frozen=True)
class ReplyStart:
    """Where one reply starts: inside its reasoning, and whether a leading `<think>` opens (or is dropped)."""
    inside: bool
    may_open: bool

    @property
    def may_reason(self) -> bool:
        return self.inside or self.may_open


@dataclass
class ReasoningSplit:
    reasoning: Optional[str]  # None: the reply has none
    content: Optional[str]  # None: the reply is all reasoning


class ReasoningParser:
    """`<think>...</think>` reasoning; `name` is the server.reasoning_parser value."""

    def __init__(self, name: str):
        if name not in REASONING_PARSERS[1:]:
            raise ValueError(f"server.reasoning_parser={name!r} is not a reasoning parser jaxcb knows; use one of "
                             f"{', '.join(REASONING_PARSERS)}, or null for none")
        self.name = name

    def reply_start(self, prompt_text: str) -> ReplyStart:
        """Where the reply to `prompt_text` (special tokens kept) starts."""
        opened, closed = prompt_text.rfind(THINK_OPEN), prompt_text.rfind(THINK_CLOSE)
        if opened > closed:
            return ReplyStart(inside=True, may_open=False)
        if closed >= 0 and prompt_text.rstrip().endswith(THINK_CLOSE):
            return ReplyStart(inside=False, may_open=False)
        return ReplyStart(inside=self.name == "deepseek_r1", may_open=True)

    def split(self, text: str, start: ReplyStart) -> ReasoningSplit:
        """A whole reply as reasoning and content."""
        reasoning, content = _scan(text, start, final=True)
        if not reasoning and start.may_reason and not _opened(text, start):
            return ReasoningSplit(None, content)
        return ReasoningSplit(reasoning or None, content or None if reasoning else content)

    def streamer(self, start: ReplyStart) -> "ReasoningStreamer":
        return ReasoningStreamer(start)


def _opened(text: str, start: ReplyStart) -> bool:
    return start.inside or text.lstrip().startswith(THINK_OPEN)


def _scan(text: str, start: ReplyStart, final: bool) -> tuple[str, str]:
    """(reasoning, content) of the reply so far; without `final`, only what more text cannot change."""
    inside, pos = start.inside, 0
    if start.may_open:
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        if rest.startswith(THINK_OPEN):
            inside, pos = True, lead + len(THINK_OPEN)
        elif not final and THINK_OPEN.startswith(rest):
            return "", ""  # may still open: wait
    if not inside:
        return "", text
    end = text.find(THINK_CLOSE, pos)
    if end == -1:
        held = 0 if final else next(
            (k for k in range(min(len(THINK_CLOSE) - 1, len(text) - pos), 0, -1) if text.endswith(THINK_CLOSE[:k])), 0)
        return text[pos:len(text) - held], ""
    return text[pos:end], text[end + len(THINK_CLOSE):]


class ReasoningStreamer:
    """One reply's text deltas as (reasoning delta, content delta): what each new reading adds."""

    def __init__(self, start: ReplyStart):
        self._start = start
        self._text = ""
        self._sent = (0, 0)  # characters of reasoning and content sent

    def feed(self, delta_text: str) -> tuple[str, str]:
        self._text += delta_text
        return self._update(final=False)

    def finish(self) -> tuple[str, str]:
        return self._update(final=True)

    def _update(self, final: bool) -> tuple[str, str]:
        reasoning, content = _scan(self._text, self._start, final)
        sent_reasoning, sent_content = self._sent
        self._sent = (len(reasoning), len(content))
        return reasoning[sent_reasoning:], content[sent_content:]


def reasoning_token_count(tokenizer, token_ids: list[int], has_reasoning: bool) -> int:
    """Generated tokens up to and including the one that closes the reasoning (all of them if it never closes)."""
    if not has_reasoning:
        return 0
    lo, hi = 1, len(token_ids)
    if THINK_CLOSE not in tokenizer.decode(token_ids, skip_special_tokens=False):
        return len(token_ids)
    while lo < hi:  # the shortest prefix whose text holds </think>
        mid = (lo + hi) // 2
        if THINK_CLOSE in tokenizer.decode(token_ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo


def get_reasoning_parser(name: Optional[str], chat_template: Optional[str]) -> Optional[ReasoningParser]:
    """The parser for server.reasoning_parser; "auto" picks one when the chat template writes `<think>`
    (qwen3 when it takes enable_thinking), else none; None: none."""
    if name is None:
        return None
    if name == "auto":
        template = chat_template or ""
        if THINK_OPEN not in template and THINK_CLOSE not in template:
            return None
        name = "qwen3" if "enable_thinking" in template else "deepseek_r1"
    return ReasoningParser(name)


def single_token_id(tokenizer, text: str) -> Optional[int]:
    """The id of `text` when the tokenizer writes it as one token (and reads that token back as `text`)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1 or tokenizer.decode(ids, skip_special_tokens=False) != text:
        return None
    return ids[0]


def hold_answer(spec: StructuredOutputs, start: ReplyStart, tokenizer) -> StructuredOutputs:
    """`spec` holding only the answer after the reasoning of a reply that starts at `start`: gated on the
    `</think>` token where the vocabulary has one (and `<think>` too, where the reply may open it), else
    composed as one grammar (`after_reasoning`)."""
    end = single_token_id(tokenizer, THINK_CLOSE)
    opener = single_token_id(tokenizer, THINK_OPEN) if start.may_open and not start.inside else None
    if end is not None and (start.inside or opener is not None):
        return replace(spec, after_reasoning=ReasoningGate(end, start.inside, opener))
    return after_reasoning(spec)


def after_reasoning(spec: StructuredOutputs) -> StructuredOutputs:
    """`spec` as a grammar that lets the reasoning run free up to `</think>` and holds what follows to `spec`."""
    body = _lark_body(spec)
    grammar = "\n".join([
        "%llguidance {}",
        "start: reasoning answer",
        # Lazy: the reasoning ends at the first </think>, as the reasoning parser reads it.
        r"reasoning[lazy]: /(?s:.*)<\/think>/",
        body,
    ])
    return StructuredOutputs("lark", grammar + "\n", spec.field)


def _lark_body(spec: StructuredOutputs) -> str:
    """Lark rules whose rule `answer` is `spec`."""
    if spec.kind == "json":
        schema = json.loads(spec.text)
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **_JSON_OPTIONS}}
        return "answer: %json " + json.dumps(schema, ensure_ascii=False)
    if spec.kind == "regex":
        return "answer: /" + spec.text.replace("/", r"\/") + "/"
    if spec.kind == "choice":
        return "answer: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.text))
    if spec.kind == "lark":
        lines = [line for line in spec.text.splitlines() if not line.startswith("%llguidance")]
        return _START_RULE.sub(r"answer\1:", "\n".join(lines))
    raise StructuredOutputsError(
        f"{spec.field}: a grammar cannot be held to the answer after the model's reasoning when the vocabulary "
        "writes </think> as several tokens; use json, regex or "
        "choice, or start the server with server.structured_outputs_in_reasoning=true (the grammar then covers "
        "the reasoning too)", spec.field)
