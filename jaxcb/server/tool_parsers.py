"""Tool calls in model output: parse them, stream them, and force them with a grammar.

Owns the text syntaxes a model writes OpenAI-style tool calls in (`server.tool_call_parser`):
`hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `llama3_json`
(`{"name": ..., "parameters": {...}}`, `;`-separated, optionally after `<|python_tag|>`) and
`pythonic` (`[get_weather(city="Paris"), ping()]`). For each: `parse` splits a finished completion
into content + calls, `streamer()` does the same incrementally, and `tool_call_grammar` writes the
llguidance Lark grammar that makes a model write valid calls. Imports neither jax nor llguidance
(the grammar is text, compiled by the caller); never raises on model output.

Canonical `arguments`: for the JSON syntaxes, the model's own JSON text of the arguments object
with the whitespace outside strings removed (key order, escapes and numbers as written;
`json.loads` of it is the parsed value). It can be streamed character by character, so the
streamed fragments add up to exactly the non-streamed string; grammar-forced output is compact
already, so there it is verbatim. For pythonic, `json.dumps(args, ensure_ascii=False,
separators=(",", ":"))`: there is no JSON text to keep, so each call is sent whole.

Malformed calls stay content. A stream announces a JSON call once its head (`{"name": "f",
"arguments": `) is complete and cannot withdraw it; if its text then turns out malformed
(typically output cut by max_tokens), the stream keeps the partial call while `parse` returns
that text as content. Otherwise stream and `parse` agree for any split of the text.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union


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


TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", "hermes", "llama3_json", "pythonic")
_ID_CHARS = string.ascii_letters + string.digits
_JSON_WS = " \t\n\r"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# A JSON call's head: complete once the arguments object opens. JSON whitespace only (not \s),
# so that the stream never announces an object that `_read_object` would refuse.
_CALL_HEAD = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")'
                        r'[ \t\n\r]*,[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*(?=\{)')
_LIST_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")  # where a pythonic call list begins
_LIST_START_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")  # ... or may still begin
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_PY_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json accepts NaN/Infinity; clients' parsers do not


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


class _Scanner:
    """Bracket depth and string state over JSON (or Python) text, one character at a time."""

    def __init__(self, quotes: str = '"'):
        self.quotes = quotes
        self.depth = 0
        self.opened = False
        self.quote: Optional[str] = None
        self.escaped = False

    def step(self, ch: str) -> bool:
        """Advance over `ch`; False if it is whitespace between tokens (compaction drops it)."""
        if self.quote:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == self.quote:
                self.quote = None
            return True
        if ch in _JSON_WS:
            return False
        if ch in self.quotes:
            self.quote = ch
        elif ch in "([{":
            self.depth, self.opened = self.depth + 1, True
        elif ch in ")]}":
            self.depth -= 1
        return True

    @property
    def closed(self) -> bool:  # the first bracket opened has been closed
        return self.opened and self.depth <= 0 and self.quote is None


def _compact(json_text: str) -> str:
    scanner = _Scanner()
    return "".join(ch for ch in json_text if scanner.step(ch))


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _JSON_WS:
        pos += 1
    return pos


def _read_object(text: str, pos: int) -> tuple[dict[str, tuple[Any, str]], int]:
    """The JSON object at text[pos] as {key: (value, raw value text)} and the index after it.
    The first of duplicate keys wins, as in a stream. ValueError if there is no valid object."""
    if not text.startswith("{", pos):
        raise ValueError("not an object")
    members: dict[str, tuple[Any, str]] = {}
    pos = _skip_ws(text, pos + 1)
    if text.startswith("}", pos):
        return members, pos + 1
    while True:
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _skip_ws(text, pos)
        if not isinstance(key, str) or not text.startswith(":", pos):
            raise ValueError("bad key")
        start = _skip_ws(text, pos + 1)
        value, pos = _DECODER.raw_decode(text, start)
        members.setdefault(key, (value, text[start:pos]))
        pos = _skip_ws(text, pos)
        if text.startswith("}", pos):
            return members, pos + 1
        if not text.startswith(",", pos):
            raise ValueError("expected , or }")
        pos = _skip_ws(text, pos + 1)


def _call_from_members(members: dict[str, tuple[Any, str]]) -> Optional[tuple[str, str]]:
    """(name, canonical arguments) of a call object, or None if it is not one."""
    name = members.get("name", (None, ""))[0]
    args_key = next((key for key in members if key in ("arguments", "parameters")), None)
    if not isinstance(name, str) or args_key is None:
        return None
    value, raw = members[args_key]
    if isinstance(value, str):  # some models write the arguments as a string holding the object
        try:
            value, raw = _DECODER.decode(value), value
        except ValueError:
            return None
    return (name, _compact(raw)) if isinstance(value, dict) else None


def _parse_call(text: str) -> Optional[tuple[str, str]]:
    """The call in `text` (one JSON object, whitespace around it), or None."""
    try:
        members, end = _read_object(text, _skip_ws(text, 0))
    except (ValueError, RecursionError):
        return None
    return _call_from_members(members) if _skip_ws(text, end) == len(text) else None


def _output(content_pieces: list[str], calls: list[tuple[str, str]]) -> ParsedToolOutput:
    content = "".join(content_pieces).strip()
    return ParsedToolOutput(content or None, [ToolCall(_new_call_id(), n, a) for n, a in calls])


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _ContentOut:
    """Streamed content equal to the non-streamed one: leading whitespace dropped and trailing
    whitespace held until more text follows (`parse` strips the joined content)."""

    def __init__(self):
        self.started = False
        self.held = ""

    def emit(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out, self.held = self.held + body, text[len(body):]
        return out


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent argument fragments of one call as one delta."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and delta.id is None:
            merged[-1].arguments += delta.arguments
        else:
            merged.append(delta)
    return merged


class ToolCallStreamer:
    """Turns a stream of text deltas into content text and tool call deltas, for one completion."""

    def __init__(self):
        self.out = _ContentOut()
        self.pending = ""  # text received but not judged yet
        self.num_calls = 0

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content text safe to send now, call deltas) after `delta_text`."""
        self.pending += delta_text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self.pending and self._step(content, deltas):
            pass
        return self.out.emit("".join(content)), _merge(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: what was held back."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        self._finish(content, deltas)
        return self.out.emit("".join(content)), _merge(deltas)

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Judge some of `self.pending`; False when it needs more text."""
        raise NotImplementedError

    def _finish(self, content: list[str], deltas: list[ToolCallDelta]) -> None:
        raise NotImplementedError

    def _take_until(self, marker: str, content: list[str]) -> bool:
        """Move pending text before `marker` to `content`; True (marker consumed) if found."""
        at = self.pending.find(marker)
        if at == -1:
            keep = _marker_prefix_len(self.pending, marker)
            content.append(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        content.append(self.pending[:at])
        self.pending = self.pending[at + len(marker):]
        return True


class _CallReader:
    """Reads one JSON call object from streamed text. Announces the call as soon as its head is
    complete and streams its arguments compacted; any other object is judged when it ends."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""  # the object's text so far
        self.end: Optional[int] = None  # len(text) once the object's closing brace is read
        self.scanner = _Scanner()
        self.args_scanner: Optional[_Scanner] = None  # set once announced
        self.args_pos = 0
        self.refused = False  # the head matched but its name is not a JSON string

    def feed(self, chunk: str) -> tuple[list[ToolCallDelta], str]:
        """Deltas for `chunk`, and the part of it after the object's end."""
        if self.end is not None:
            return [], chunk
        leftover = ""
        for i, ch in enumerate(chunk):
            self.scanner.step(ch)
            if self.scanner.closed:
                chunk, leftover = chunk[:i + 1], chunk[i + 1:]
                self.end = len(self.text) + i + 1
                break
        self.text += chunk
        return self._announce() + self._stream_args(), leftover

    def result(self, text: str) -> Optional[list[ToolCallDelta]]:
        """At the call's end, given its whole text: the deltas still owed, or None if `text` is no
        call (it is content). An announced call is never withdrawn."""
        if self.args_scanner is not None:
            return []
        call = _parse_call(text)
        return None if call is None else [ToolCallDelta(self.index, _new_call_id(), *call)]

    def _announce(self) -> list[ToolCallDelta]:
        if self.args_scanner is not None or self.refused:
            return []
        head = _CALL_HEAD.match(self.text)
        if head is None:
            return []
        try:
            name = _DECODER.decode(head.group(1))
        except ValueError:
            self.refused = True
            return []
        self.args_scanner, self.args_pos = _Scanner(), head.end()
        return [ToolCallDelta(self.index, _new_call_id(), name)]

    def _stream_args(self) -> list[ToolCallDelta]:
        if self.args_scanner is None or self.args_scanner.closed:
            return []
        piece = []
        for ch in self.text[self.args_pos:]:
            if self.args_scanner.step(ch):
                piece.append(ch)
            if self.args_scanner.closed:
                break
        self.args_pos = len(self.text)
        return [ToolCallDelta(self.index, arguments="".join(piece))] if piece else []


class ToolParser:
    """One tool call syntax: parse, stream, and the pieces of its grammar."""
    name: str = ""
    _list_open, _list_sep, _list_close = "", "", ""  # how several calls are written

    def parse(self, text: str) -> ParsedToolOutput:
        raise NotImplementedError

    def streamer(self) -> ToolCallStreamer:
        raise NotImplementedError

    def _call_grammar(self, name: str, parameters: dict[str, Any]) -> str:
        """The Lark expression for one call of function `name`."""
        raise NotImplementedError


def _json_rule(schema: Any) -> str:
    """`%json` of `schema`, compact: llguidance allows any whitespace unless x-guidance says not."""
    schema = schema if isinstance(schema, dict) else {}  # `true` as a schema: any value
    options = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
    return "%json " + json.dumps({**schema, "x-guidance": options})


class HermesToolParser(ToolParser):
    name = "hermes"
    _list_sep = r'"\n"'

    def parse(self, text: str) -> ParsedToolOutput:
        content, calls, pos = [], [], 0
        while (start := text.find(_HERMES_OPEN, pos)) != -1:
            content.append(text[pos:start])
            body_start = start + len(_HERMES_OPEN)
            close = text.find(_HERMES_CLOSE, body_start)
            pos = len(text) if close == -1 else close + len(_HERMES_CLOSE)
            call = _parse_call(text[body_start:len(text) if close == -1 else close])
            if call:
                calls.append(call)
            else:
                content.append(text[start:pos])
        return _output(content + [text[pos:]], calls)

    def streamer(self) -> ToolCallStreamer:
        return _HermesStreamer()

    def _call_grammar(self, name: str, parameters: dict[str, Any]) -> str:
        head = json.dumps(_HERMES_OPEN + '\n{"name":"' + name + '","arguments":')
        return f"{head} {_json_rule(parameters)} {json.dumps('}' + chr(10) + _HERMES_CLOSE)}"


class _HermesStreamer(ToolCallStreamer):
    def __init__(self):
        super().__init__()
        self.reader: Optional[_CallReader] = None  # inside a <tool_call> block
        self.body = ""

    def _step(self, content, deltas) -> bool:
        if self.reader is None:
            if not self._take_until(_HERMES_OPEN, content):
                return False
            self.reader, self.body = _CallReader(self.num_calls), ""
            return True
        body: list[str] = []
        closed = self._take_until(_HERMES_CLOSE, body)
        self.body += body[0]
        deltas += self.reader.feed(body[0])[0]
        if closed:
            self._end_block(content, deltas, _HERMES_CLOSE)
        return closed

    def _finish(self, content, deltas) -> None:
        if self.reader is None:
            content.append(self.pending)
        else:  # an unclosed last block: a call if its JSON is complete
            self.body += self.pending
            deltas += self.reader.feed(self.pending)[0]
            self._end_block(content, deltas, "")

    def _end_block(self, content, deltas, close: str) -> None:
        owed = self.reader.result(self.body)
        if owed is None:
            content.append(_HERMES_OPEN + self.body + close)
        else:
            deltas += owed
            self.num_calls += 1
        self.reader = None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    _list_sep = '";"'

    def parse(self, text: str) -> ParsedToolOutput:
        start = _skip_ws(text, 0)
        if text.startswith("{", start):
            before, resume, pos = "", 0, 0
        elif (tag := text.find(_PYTHON_TAG)) != -1:
            before, resume, pos = text[:tag], tag, tag + len(_PYTHON_TAG)
        else:
            return _output([text], [])
        calls = []  # `resume`: where content picks up again, after the last good call
        while True:
            try:
                members, end = _read_object(text, _skip_ws(text, pos))
            except (ValueError, RecursionError):
                break
            if (call := _call_from_members(members)) is None:
                break
            calls.append(call)
            resume, pos = end, _skip_ws(text, end)
            if not text.startswith(";", pos):
                break
            pos += 1
        return _output([before, text[resume:]], calls)

    def streamer(self) -> ToolCallStreamer:
        return _Llama3Streamer()

    def _call_grammar(self, name: str, parameters: dict[str, Any]) -> str:
        head = json.dumps('{"name":"' + name + '","parameters":')
        return f'{head} {_json_rule(parameters)} "}}"'


class _Llama3Streamer(ToolCallStreamer):
    def __init__(self):
        super().__init__()
        self.state = "start"  # start -> content | calls -> rest
        self.held = ""  # in "calls": text since the last call (tag, whitespace, ";")
        self.reader: Optional[_CallReader] = None
        self.expect_object = True

    def _step(self, content, deltas) -> bool:
        if self.state == "start":
            first = _skip_ws(self.pending, 0)
            if first < len(self.pending):
                self.state = "calls" if self.pending[first] == "{" else "content"
            return first < len(self.pending)
        if self.state == "content":
            if self._take_until(_PYTHON_TAG, content):
                self.state, self.held = "calls", _PYTHON_TAG
            return self.state == "calls"
        if self.state == "rest":
            content.append(self.pending)
            self.pending = ""
            return False
        return self._step_calls(content, deltas)

    def _step_calls(self, content, deltas) -> bool:
        if self.reader is not None:
            new, self.pending = self.reader.feed(self.pending)
            deltas += new
            if self.reader.end is not None:
                self._end_object(content, deltas, self.reader.result(self.reader.text))
            return self.reader is None
        first = _skip_ws(self.pending, 0)
        self.held, self.pending = self.held + self.pending[:first], self.pending[first:]
        if not self.pending:
            return False
        if self.expect_object and self.pending[0] == "{":
            self.reader = _CallReader(self.num_calls)
        elif not self.expect_object and self.pending[0] == ";":
            self.held, self.pending, self.expect_object = self.held + ";", self.pending[1:], True
        else:  # the calls are over: the rest is content
            content.append(self.held)
            self.state, self.held = "rest", ""
        return True

    def _end_object(self, content, deltas, owed: Optional[list[ToolCallDelta]]) -> None:
        if owed is None:
            content.append(self.held + self.reader.text)
            self.state = "rest"
        else:
            deltas += owed
            self.num_calls += 1
            self.expect_object = False
        self.held, self.reader = "", None

    def _finish(self, content, deltas) -> None:
        if self.reader is not None:
            self._end_object(content, deltas, self.reader.result(self.reader.text))
        content.append(self.held + self.pending)


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
    if isinstance(value, (bool, int)) or (isinstance(value, float) and abs(value) != float("inf")
                                          and value == value):
        return value
    raise ValueError(f"{value!r} is not a JSON value")


def _parse_pythonic_list(text: str) -> Optional[list[tuple[str, str]]]:
    """The calls of `[f(a=1), g()]`, or None if `text` is not such a list."""
    try:
        with warnings.catch_warnings():  # invalid escapes warn; they are still just text
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


def _bracket_end(text: str, start: int) -> Optional[int]:
    """The index after the bracket matching text[start], or None if it is not closed."""
    scanner = _Scanner(quotes="\"'")
    for i in range(start, len(text)):
        scanner.step(text[i])
        if scanner.closed:
            return i + 1
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    _list_open, _list_sep, _list_close = '"["', '", "', '"]"'

    def parse(self, text: str) -> ParsedToolOutput:
        content, calls, pos = [], [], 0
        while (match := _LIST_START.search(text, pos)) is not None:
            content.append(text[pos:match.start()])
            end = _bracket_end(text, match.start()) or len(text)  # unclosed: content, as in a stream
            found = _parse_pythonic_list(text[match.start():end]) if end < len(text) or text.endswith("]") else None
            if found:
                calls.extend(found)
            else:
                content.append(text[match.start():end])
            pos = end
        return _output(content + [text[pos:]], calls)

    def streamer(self) -> ToolCallStreamer:
        return _PythonicStreamer()

    def _call_grammar(self, name: str, parameters: dict[str, Any]) -> str:
        if not name.isidentifier():
            raise ValueError(f"tool name {name!r} is not a Python identifier; the pythonic tool call "
                             "syntax cannot call it: choose another server.tool_call_parser")
        properties = dict(parameters.get("properties") or {})
        required = parameters.get("required") or []
        properties.update({key: {} for key in required if key not in properties})
        defs = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
        kwargs = []
        for key, schema in properties.items():
            if not key.isidentifier():
                raise ValueError(f"tool {name!r} parameter {key!r} is not a Python identifier; the "
                                 "pythonic syntax cannot pass it")
            value = _json_rule({**schema, **defs} if isinstance(schema, dict) else schema)
            kwargs.append((f'"{key}=" {value}', key in required))
        inner = _first_kwargs(kwargs, 0)
        return f'"{name}(" {inner} ")"' if inner else f'"{name}()"'


def _first_kwargs(kwargs: list[tuple[str, bool]], i: int) -> str:
    """Lark expression for kwargs[i:] when none is written yet: required ones always, optional
    ones optional, in order, joined by ", "."""
    if i == len(kwargs):
        return ""
    kwarg, required = kwargs[i]
    written = f"{kwarg} {_later_kwargs(kwargs, i + 1)}".strip()
    if required:
        return written
    skipped = _first_kwargs(kwargs, i + 1)
    return f"({written} | {skipped})" if skipped else f"({written})?"


def _later_kwargs(kwargs: list[tuple[str, bool]], i: int) -> str:
    """As `_first_kwargs`, after one is written: each with its ", " before it."""
    pieces = [f'", " {kwarg}' if required else f'(", " {kwarg})?' for kwarg, required in kwargs[i:]]
    return " ".join(pieces)


class _PythonicStreamer(ToolCallStreamer):
    def __init__(self):
        super().__init__()
        self.scanner: Optional[_Scanner] = None  # inside a call list
        self.list_text = ""

    def _step(self, content, deltas) -> bool:
        if self.scanner is not None:
            return self._step_list(content, deltas)
        at = self.pending.find("[")
        if at == -1:
            content.append(self.pending)
            self.pending = ""
            return False
        content.append(self.pending[:at])
        self.pending = self.pending[at:]
        if _LIST_START.match(self.pending):
            self.scanner, self.list_text = _Scanner(quotes="\"'"), ""
            return True
        if _LIST_START_PREFIX.fullmatch(self.pending):
            return False  # may still become a call list
        content.append("[")
        self.pending = self.pending[1:]
        return True

    def _step_list(self, content, deltas) -> bool:
        for i, ch in enumerate(self.pending):
            self.scanner.step(ch)
            if self.scanner.closed:
                self.list_text += self.pending[:i + 1]
                self.pending = self.pending[i + 1:]
                self._end_list(content, deltas)
                return True
        self.list_text += self.pending
        self.pending = ""
        return False

    def _end_list(self, content, deltas) -> None:
        calls = _parse_pythonic_list(self.list_text)
        if calls is None:
            content.append(self.list_text)
        for name, arguments in calls or []:
            deltas.append(ToolCallDelta(self.num_calls, _new_call_id(), name, arguments))
            self.num_calls += 1
        self.scanner = None

    def _finish(self, content, deltas) -> None:
        content.append(self.list_text + self.pending if self.scanner else self.pending)


_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)}


def _detect_syntax(chat_template: str) -> str:
    if _HERMES_OPEN in chat_template:
        return "hermes"
    # Before llama3: pythonic Llama templates also mention ipython and the python tag.
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


def _chosen_functions(tools: list[dict], tool_choice: Union[str, dict]) -> list[dict]:
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not _TOOL_NAME.fullmatch(str(function.get("name"))):
            raise ValueError(f"tools.{i}.function.name={function.get('name')!r} must match "
                             f"{_TOOL_NAME.pattern}")
        functions.append(function)
    if not functions:
        raise ValueError("a tool call grammar needs at least one tool")
    if tool_choice == "required":
        return functions
    chosen = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if chosen is None:
        raise ValueError(f"tool_choice={tool_choice!r} needs no grammar: only \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}} is enforced")
    named = [f for f in functions if f["name"] == chosen]
    if not named:
        raise ValueError(f"tool_choice names function {chosen!r}, which is not among the tools "
                         f"({', '.join(f['name'] for f in functions)})")
    return named[:1]


def tool_call_grammar(parser: ToolParser, tools: list[dict], tool_choice: Union[str, dict],
                      parallel_tool_calls: bool) -> str:
    """An llguidance Lark grammar whose every output `parser.parse`s into calls of the chosen
    tools (one for a named function or parallel_tool_calls=False), arguments valid against each
    tool's "parameters" schema, no content. JSON is compact."""
    functions = _chosen_functions(tools, tool_choice)
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    rules = [f"call_{j}: {parser._call_grammar(f['name'], f.get('parameters') or empty)}"
             for j, f in enumerate(functions)]
    many = parallel_tool_calls and tool_choice == "required"
    calls = f"call ({parser._list_sep} call)*" if many else "call"
    start = " ".join(p for p in (parser._list_open, calls, parser._list_close) if p)
    alternatives = " | ".join(f"call_{j}" for j in range(len(functions)))
    return "\n".join(["%llguidance {}", f"start: {start}", f"call: {alternatives}", *rules]) + "\n"
