"""Tool calls in model output: parse them and stream them.

Owns the syntaxes a model writes OpenAI-style tool calls in (`server.tool_call_parser`): `hermes`
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Qwen, Hermes), `llama3_json` (`{"name":
..., "parameters": {...}}`, `;`-separated, maybe after `<|python_tag|>`), `pythonic` (`[f(a=1), g()]`)
and `mistral` (`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`: Mistral's v0.3 tokenizers;
`[TOOL_CALLS]` is a special token there, kept in the text of requests with tools, `chat.py`).
Each syntax has one `_scan` of the text so far: `parse` is its final reading, and a
`ToolCallStreamer` sends what each new reading adds, so stream and non-stream agree by
construction. The grammars that make a model write valid calls are `tool_grammar`'s. Imports
neither jax nor llguidance; never raises on model output: malformed calls are content.

Canonical `arguments`: for the JSON syntaxes, the model's JSON text of the arguments object with
the whitespace outside strings removed (key order, escapes, numbers as written; `json.loads` of it
is the parsed value). Its prefix is known as soon as the text's is, so it streams in fragments that
add up to exactly the non-streamed string; grammar-forced JSON is compact already, so verbatim.
For pythonic, `json.dumps(args, ensure_ascii=False, separators=(",", ":"))`, each call sent whole.

What a stream cannot avoid: it announces a JSON call once its head (`{"name": "f", "arguments": `)
is read; if the call then turns out malformed, that partial call stays sent, and its text also
arrives as content, as `parse` has it. A call cut short (max_tokens, a timeout: `cut=True`) is
dropped from the content instead, in both forms: its markup never reaches the client as text.
"""

from __future__ import annotations

import abc

import ast
import json
import math
import re
import secrets
import string
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ToolCall:
    id: str  # "call_" + 24 random alphanumerics
    name: str
    arguments: str  # a JSON object, in the canonical form above


@dataclass
class ParsedToolOutput:
    content: Optional[str]  # text outside the calls, stripped; None if empty
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """One streamed piece of a call, as OpenAI's `delta.tool_calls[i]`."""
    index: int
    id: Optional[str] = None  # set on the call's first delta only, with name
    name: Optional[str] = None
    arguments: str = ""  # a fragment of the arguments string


@dataclass
class _Scan:
    """What the text so far says. Without `final`, only what more text cannot change."""
    content: list[str] = field(default_factory=list)  # raw content pieces, in order
    calls: list[tuple[int, str, str]] = field(default_factory=list)  # (text position, name, arguments)
    partial: Optional[tuple[int, str, str]] = None  # a call still being written: arguments so far


TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", "hermes", "llama3_json", "pythonic", "mistral")
_ID_CHARS = string.ascii_letters + string.digits
_JSON_WS = re.compile(r"[ \t\n\r]*")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"  # also written by tool_grammar
_PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"  # also written by tool_grammar
# A JSON call's head, complete once its arguments object opens. JSON whitespace (not \s) so that
# the head never matches an object that `_read_object` refuses.
_CALL_HEAD = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")'
                        r'[ \t\n\r]*,[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*(?=\{)')
# An unclosed string runs to the end of the text. Unrolled loops: alternation per character is slow.
_JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)'
_JSON_TOKENS = re.compile(_JSON_STRING + r"|[\[\]{}()]", re.DOTALL)
_PY_TOKENS = re.compile(_JSON_STRING + r"|'[^'\\]*(?:\\.[^'\\]*)*(?:'|\\?\Z)|[\[\]{}()]", re.DOTALL)
_COMPACT = re.compile(f"({_JSON_STRING})|[ \\t\\n\\r]+", re.DOTALL)
_LIST_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")  # where a pythonic call list begins
_LIST_MAY_START = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?\Z")  # ... or may, once more text comes
_PY_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json accepts NaN/Infinity; clients' parsers do not


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _compact(json_text: str) -> str:
    """Without whitespace outside strings; of a prefix, a prefix of the whole's."""
    return _COMPACT.sub(r"\1", json_text)  # an unmatched group expands to ""


def _bracket_end(text: str, start: int, tokens: re.Pattern = _JSON_TOKENS) -> Optional[int]:
    """The index after the bracket that closes text[start] (strings skipped), None if unclosed."""
    depth = 0
    for token in tokens.finditer(text, start):
        depth += 1 if token.group() in "([{" else -1 if token.group() in ")]}" else 0
        if depth <= 0:
            return token.end()
    return None


def _skip_ws(text: str, pos: int) -> int:
    return _JSON_WS.match(text, pos).end()


def _read_object(text: str) -> dict[str, tuple[Any, str]]:
    """`text`, one JSON object with whitespace around it, as {key: (value, raw value text)}; the
    first of duplicate keys wins, as in a stream. ValueError if it is not that."""
    if not isinstance(_DECODER.decode(text), dict):  # valid: the walk below need not check
        raise ValueError("not an object")
    members, pos = {}, _skip_ws(text, 0) + 1
    while text[pos := _skip_ws(text, pos)] != "}":
        key, pos = _DECODER.raw_decode(text, pos)
        start = _skip_ws(text, _skip_ws(text, pos) + 1)  # past the ":"
        value, pos = _DECODER.raw_decode(text, start)
        members.setdefault(key, (value, text[start:pos]))
        pos = _skip_ws(text, pos)
        pos += text[pos] == ","
    return members


def _parse_call(text: str) -> Optional[tuple[str, str]]:
    """(name, canonical arguments) of the one JSON call object in `text`, or None."""
    try:
        members = _read_object(text)
    except (ValueError, RecursionError):
        return None
    name = members.get("name", (None, ""))[0]
    args_key = next((key for key in members if key in ("arguments", "parameters")), None)
    if not isinstance(name, str) or args_key is None:
        return None
    value, raw = members[args_key]
    if isinstance(value, str):  # some models write the arguments as a string holding the object
        try:
            value, raw = _DECODER.decode(value), value
        except (ValueError, RecursionError):
            return None
    return (name, _compact(raw)) if isinstance(value, dict) else None


def _partial_call(text: str, at: int) -> Optional[tuple[int, str, str]]:
    """(at, name, arguments so far) of the call being written in `text`, once its head is read."""
    if (head := _CALL_HEAD.match(text)) is None:
        return None
    try:
        name = _DECODER.decode(head.group(1))
    except ValueError:
        return None
    return at, name, _compact(text[head.end():_bracket_end(text, head.end())])


def _decided_end(text: str, marker: str, final: bool) -> int:
    """Where decided text ends: at the end, or while more may come, before an end piece of `text`
    that could be the start of `marker`."""
    held = 0 if final else next(
        (k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)
    return len(text) - held


class ToolCallStreamer:
    """Turns one completion's text deltas into content and tool call deltas. Re-reads the whole
    text at each delta (string search and JSON decoding, cheap next to a decode step) and sends
    what the reading adds: new content, new calls, the new end of a call's arguments."""

    def __init__(self, parser: "ToolParser"):
        self._parser = parser
        self._text = ""
        self._content_sent = 0  # characters of the reading's content already sent
        self._calls_sent = 0  # complete calls of the reading already sent
        self._index = 0  # the stream index of the next call
        self._announced: Optional[tuple[int, int]] = None  # (text position, arguments sent)

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content text safe to send now, call deltas) once `delta_text` is added."""
        self._text += delta_text
        return self._update(final=False)

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: what was held back -- unless the output was `cut` short (as `parse`)."""
        return self._update(final=not cut)

    def _update(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        scan = self._parser._scan(self._text, final)
        # Stripped as `parse` has it: trailing whitespace waits for more text, then is dropped.
        content = "".join(scan.content).strip()
        new_content, self._content_sent = content[self._content_sent:], len(content)
        live = scan.calls[self._calls_sent:] + ([scan.partial] if scan.partial else [])
        num_done, self._calls_sent = len(scan.calls) - self._calls_sent, len(scan.calls)
        if self._announced and all(at != self._announced[0] for at, _, _ in live):
            self._announced, self._index = None, self._index + 1  # malformed: now content
        deltas = []
        for i, (at, name, arguments) in enumerate(live):
            deltas += self._send(at, name, arguments, done=i < num_done)
        return new_content, deltas

    def _send(self, at: int, name: str, arguments: str, done: bool) -> list[ToolCallDelta]:
        if self._announced is None:
            deltas = [ToolCallDelta(self._index, _new_call_id(), name, arguments)]
        else:
            new = arguments[self._announced[1]:]
            deltas = [ToolCallDelta(self._index, arguments=new)] if new else []
        self._announced = None if done else (at, len(arguments))
        self._index += int(done)
        return deltas


class ToolParser(abc.ABC):
    """One tool call syntax: how to read it. `tool_grammar` writes it, by `name`."""
    name: str = ""
    # Its markers are special tokens in the tokenizers that write them: a request it reads keeps
    # special tokens in its text (skip_special_tokens=False), as vLLM's parser for the syntax asks.
    reads_special_tokens: bool = False

    def parse(self, text: str, cut: bool = False) -> ParsedToolOutput:
        """A finished completion as content and calls. `cut`: it ended before the model finished (max_tokens,
        a timeout), so a call being written is dropped, not read as content, and so is a last piece of text
        that may begin one -- the markup of an unfinished call never reaches the content."""
        scan = self._scan(text, final=not cut)
        calls = [ToolCall(_new_call_id(), name, arguments) for _, name, arguments in scan.calls]
        return ParsedToolOutput("".join(scan.content).strip() or None, calls)

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self)

    @abc.abstractmethod
    def _scan(self, text: str, final: bool) -> _Scan:
        """The text read so far: its content pieces, its finished calls, and a call being written."""


class HermesToolParser(ToolParser):
    name = "hermes"

    def _scan(self, text: str, final: bool) -> _Scan:
        scan, pos = _Scan(), 0
        while (start := text.find(HERMES_OPEN, pos)) != -1:
            scan.content.append(text[pos:start])
            body_start = start + len(HERMES_OPEN)
            close = text.find(HERMES_CLOSE, body_start)
            if close == -1 and not final:  # the block is being written
                body = text[body_start:_decided_end(text, HERMES_CLOSE, final)]
                scan.partial = _partial_call(body, start)
                return scan
            pos = len(text) if close == -1 else close + len(HERMES_CLOSE)
            call = _parse_call(text[body_start:len(text) if close == -1 else close])
            if call is None:
                scan.content.append(text[start:pos])
            else:
                scan.calls.append((start, *call))
        scan.content.append(text[pos:max(pos, _decided_end(text, HERMES_OPEN, final))])
        return scan


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def _scan(self, text: str, final: bool) -> _Scan:
        first = _skip_ws(text, 0)
        if first == len(text) and not final:
            return _Scan()  # leading whitespace: content only if no call follows
        if text.startswith("{", first):
            before, resume = "", 0  # `resume`: where content picks up, after the last call
        elif (tag := text.find(_PYTHON_TAG)) != -1:
            before, resume = text[:tag], tag
            first = tag + len(_PYTHON_TAG)
        else:
            return _Scan([text[:_decided_end(text, _PYTHON_TAG, final)]])
        scan, pos = _Scan([before]), first
        while True:
            start = _skip_ws(text, pos)
            is_object = text.startswith("{", start)
            end = _bracket_end(text, start) if is_object else None
            if not final and (start == len(text) or (is_object and end is None)):  # being written
                scan.partial = _partial_call(text[start:], start) if is_object else None
                return scan
            call = _parse_call(text[start:end]) if end else None
            if call is None:
                break
            scan.calls.append((start, *call))
            resume = end
            pos = _skip_ws(text, end)
            if pos == len(text) and not final:
                return scan
            if not text.startswith(";", pos):
                break
            pos += 1
        scan.content.append(text[resume:])
        return scan


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` objects; text before the
    marker is content, and so is text after the list."""
    name = "mistral"
    reads_special_tokens = True

    def _scan(self, text: str, final: bool) -> _Scan:
        tag = text.find(MISTRAL_TOOL_CALLS)
        if tag == -1:
            return _Scan([text[:_decided_end(text, MISTRAL_TOOL_CALLS, final)]])
        scan = _Scan([text[:tag]])
        pos = _skip_ws(text, tag + len(MISTRAL_TOOL_CALLS))
        if pos == len(text) and not final:
            return scan
        if not text.startswith("[", pos):
            scan.content.append(text[tag:])  # a marker with no list: text
            return scan
        resume, pos = tag, pos + 1  # `resume`: where content picks up if what follows is not a call
        while True:
            start = _skip_ws(text, pos)
            if start == len(text) and not final:
                return scan
            is_object = text.startswith("{", start)
            end = _bracket_end(text, start) if is_object else None
            if not final and is_object and end is None:  # being written
                scan.partial = _partial_call(text[start:], start)
                return scan
            call = _parse_call(text[start:end]) if end else None
            if call is None:
                break
            scan.calls.append((start, *call))
            resume = pos = _skip_ws(text, end)
            if pos == len(text) and not final:
                return scan
            if text.startswith(",", pos):
                pos += 1
                continue
            if text.startswith("]", pos):
                resume = pos + 1
            break
        scan.content.append(text[resume:])
        return scan


def _literal(node: ast.AST) -> Any:
    """A pythonic argument value as JSON data; ValueError if it is not a literal."""
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:  # JSON's names too: grammars write JSON
        return _PY_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [None if key is None else _literal(key) for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("object keys must be strings")
        return dict(zip(keys, (_literal(value) for value in node.values)))
    value = ast.literal_eval(node)
    if isinstance(value, str):  # "\ud83d\ude00" is two surrogates in Python, one emoji in JSON
        return value.encode("utf-16", "surrogatepass").decode("utf-16")
    if value is None or isinstance(value, (bool, int)) or isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(f"{value!r} is not a JSON value")


def _parse_pythonic_list(text: str) -> Optional[list[tuple[str, str]]]:
    """The (name, arguments) of `[f(a=1), g()]`, or None if `text` is not such a list."""
    try:
        with warnings.catch_warnings():  # an invalid escape warns; it is still just text
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(kw.arg for kw in node.keywords)):
                return None
            args = {kw.arg: _literal(kw.value) for kw in node.keywords}
            calls.append((node.func.id, json.dumps(args, ensure_ascii=False, separators=(",", ":"))))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def _scan(self, text: str, final: bool) -> _Scan:
        scan, pos = _Scan(), 0
        while (match := _LIST_START.search(text, pos)) is not None:
            start = match.start()
            scan.content.append(text[pos:start])
            end = _bracket_end(text, start, _PY_TOKENS)
            if end is None and not final:
                return scan  # the list is being written: sent whole once it closes
            calls = _parse_pythonic_list(text[start:end]) if end else None
            if calls is None:
                scan.content.append(text[start:end])
            scan.calls += [(start + k, name, arguments) for k, (name, arguments) in enumerate(calls or [])]
            pos = end or len(text)
        maybe = None if final else _LIST_MAY_START.search(text, pos)
        scan.content.append(text[pos:maybe.start() if maybe else len(text)])
        return scan


_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser, MistralToolParser)}


def _detect_syntax(chat_template: str) -> str:
    if HERMES_OPEN in chat_template:
        return "hermes"
    if MISTRAL_TOOL_CALLS in chat_template:
        return "mistral"
    # Before llama3_json: pythonic Llama templates mention ipython and the python tag as well.
    if re.search(r"\[\s*func_name\d*\s*\(", chat_template):
        return "pythonic"
    if _PYTHON_TAG in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        return "llama3_json"
    return "hermes"


def get_tool_parser(name: str, chat_template: Optional[str]) -> ToolParser:
    """The parser for `server.tool_call_parser`; "auto" picks one from the chat template's text."""
    if name == "auto":
        name = _detect_syntax(chat_template or "")
    if name not in _PARSERS:
        raise ValueError(f"server.tool_call_parser={name!r} is not a tool call syntax jaxcb knows; "
                         f"use one of {', '.join(TOOL_CALL_PARSERS)}")
    return _PARSERS[name]()
