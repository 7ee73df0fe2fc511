"""Grammars that force tool calls: `tool_call_grammar` writes the llguidance Lark grammar whose
every output a `ToolParser` reads back as valid calls of the chosen tools and nothing else.

Owns, per syntax in `_SYNTAXES`, how one call and a list of calls are written, and the checks
that the tools and tool_choice can be enforced at all (a ValueError whose message says what to
change). Reading model text is `tool_parsers`' job; this module only writes grammars. Imports
neither jax nor llguidance: a grammar is text.
"""

from __future__ import annotations

import json
import keyword
from dataclasses import dataclass
from typing import Any, Callable, Union

from jaxcb.server.tool_parsers import HERMES_CLOSE, HERMES_OPEN, MISTRAL_TOOL_CALLS, ToolParser
from jaxcb.structured.spec import OPENAI_NAME

_PLAIN_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "$defs", "definitions",
                      "title", "description", "$schema"}


def _json_rule(schema: Any) -> str:
    """`%json` of `schema`, compact: llguidance allows any whitespace unless x-guidance says not."""
    schema = schema if isinstance(schema, dict) else {}  # `true` as a schema: any value
    options = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def _hermes_call(name: str, parameters: dict[str, Any]) -> str:
    head = json.dumps(HERMES_OPEN + '\n{"name":"' + name + '","arguments":')
    return f'{head} {_json_rule(parameters)} {json.dumps("}\n" + HERMES_CLOSE)}'


def _llama3_json_call(name: str, parameters: dict[str, Any]) -> str:
    head = json.dumps('{"name":"' + name + '","parameters":')
    return f'{head} {_json_rule(parameters)} "}}"'


def _mistral_call(name: str, parameters: dict[str, Any]) -> str:
    head = json.dumps('{"name":"' + name + '","arguments":')
    return f'{head} {_json_rule(parameters)} "}}"'


def _pythonic_call(name: str, parameters: dict[str, Any]) -> str:
    required = parameters.get("required") or []
    properties = dict(parameters.get("properties") or {})
    properties.update({key: {} for key in required if key not in properties})
    defs = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    for word in (name, *properties):
        if not word.isidentifier() or keyword.iskeyword(word):
            raise ValueError(f"tool {name!r}: {word!r} is not a Python identifier, so the pythonic "
                             "syntax cannot write it; choose another server.tool_call_parser")
    if set(parameters) - _PLAIN_OBJECT_KEYS:  # a call writes keyword arguments, nothing more
        raise ValueError(f"tool {name!r}: the pythonic syntax can only write parameters schemas "
                         f"with the keys {sorted(_PLAIN_OBJECT_KEYS)}, not {sorted(set(parameters))}")
    kwargs = [(f'"{key}=" ' + _json_rule({**schema, **defs} if isinstance(schema, dict) else schema),
               key in required) for key, schema in properties.items()]
    inner = _first_kwargs(kwargs, 0)
    return f'"{name}(" {inner} ")"' if inner else f'"{name}()"'


def _first_kwargs(kwargs: list[tuple[str, bool]], i: int) -> str:
    """Lark for kwargs[i:] when none is written yet: required ones always, optional ones
    optional, in order, joined by ", "."""
    if i == len(kwargs):
        return ""
    kwarg, required = kwargs[i]
    later = " ".join(f'", " {kw}' if req else f'(", " {kw})?' for kw, req in kwargs[i + 1:])
    written = f"{kwarg} {later}".strip()
    if required:
        return written
    skipped = _first_kwargs(kwargs, i + 1)
    return f"({written} | {skipped})" if skipped else f"({written})?"


@dataclass(frozen=True)
class _Syntax:
    """How one tool call syntax is written, as Lark."""
    call: Callable[[str, dict[str, Any]], str]  # (function name, parameters schema) -> one call
    list_open: str = ""  # before the calls ("" for none)
    list_sep: str = ""  # between two calls
    list_close: str = ""  # after the calls


_SYNTAXES: dict[str, _Syntax] = {  # keyed by ToolParser.name
    "hermes": _Syntax(_hermes_call, list_sep=r'"\n"'),
    "llama3_json": _Syntax(_llama3_json_call, list_sep='";"'),
    "pythonic": _Syntax(_pythonic_call, list_open='"["', list_sep='", "', list_close='"]"'),
    # The marker as text: the grammar cannot name the tokenizer's special token, and the parser reads either.
    "mistral": _Syntax(_mistral_call, list_open=json.dumps(MISTRAL_TOOL_CALLS + "["), list_sep='", "',
                       list_close='"]"'),
}


def _chosen_functions(tools: list[dict], tool_choice: Union[str, dict]) -> list[dict]:
    functions = [tool.get("function") if isinstance(tool, dict) else None for tool in tools]
    for i, (tool, function) in enumerate(zip(tools, functions)):
        parameters = (function.get("parameters") or {}) if isinstance(function, dict) else None
        if not (isinstance(parameters, dict) and tool.get("type") == "function"
                and OPENAI_NAME.fullmatch(str(function.get("name"))) and parameters.get("type", "object") == "object"):
            raise ValueError(f'tools.{i} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                             f'{{"type": "object", ...}}}}}} with a name matching {OPENAI_NAME.pattern}')
    names = ", ".join(function["name"] for function in functions) or "none"
    if tool_choice == "required" and functions:
        return functions
    chosen = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(chosen, dict):
        raise ValueError(f'tool_choice={tool_choice!r} needs no grammar or is not one: only "required" '
                         '(with tools) or {"type": "function", "function": {"name": ...}} is enforced')
    named = [function for function in functions if function["name"] == chosen.get("name")]
    if not named:
        raise ValueError(f"tool_choice names function {chosen.get('name')!r}, which is not among the "
                         f"tools ({names})")
    return named[:1]


def tool_call_grammar(parser: ToolParser, tools: list[dict], tool_choice: Union[str, dict],
                      parallel_tool_calls: bool) -> str:
    """An llguidance Lark grammar whose every output `parser.parse`s into calls of the chosen
    tools and nothing else: one for a named function or parallel_tool_calls=False, else one or
    more; arguments valid against each tool's "parameters" schema (absent: {}); JSON compact."""
    syntax = _SYNTAXES[parser.name]
    functions = _chosen_functions(tools, tool_choice)
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    rules = [f"call_{j}: {syntax.call(function['name'], function.get('parameters') or empty)}"
             for j, function in enumerate(functions)]
    many = parallel_tool_calls and tool_choice == "required"
    calls = f"call ({syntax.list_sep} call)*" if many else "call"
    start = " ".join(part for part in (syntax.list_open, calls, syntax.list_close) if part)
    alternatives = " | ".join(f"call_{j}" for j in range(len(functions)))
    return "\n".join(["%llguidance {}", f"start: {start}", f"call: {alternatives}", *rules]) + "\n"
