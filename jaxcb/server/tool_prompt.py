"""Tools written into the prompt for chat templates that do not render them.

Many templates (SmolLM2's among them) never read `tools`, nor an assistant turn's `tool_calls`:
the request would reach the model without its tools, or with a conversation whose calls vanished.
Whether a template renders them is found by rendering the conversation with and without them
(`template_ignores_tools`). Where it does not, `with_tools_in_messages` rewrites the conversation
for it, in the syntax of the configured tool parser (`server.tool_call_parser`), which is also the
syntax the reply is read in:

- the tool definitions go into a system message (after the conversation's own system text),
  with an instruction to call them in that syntax;
- an assistant turn's tool calls become its content, written in that syntax;
- a tool result becomes a user turn holding `<tool_response>...</tool_response>`.

`server.tool_prompt_fallback=false` turns this off: such a request is then refused by name.
No jax.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from jaxcb.tokenizer import Tokenizer

_INSTRUCTIONS = {
    "hermes": (
        "To call a function, write one block per call, with the function's name and a JSON object of its arguments:\n"
        "<tool_call>\n{\"name\": \"function_name\", \"arguments\": {\"parameter\": \"value\"}}\n</tool_call>"
    ),
    "llama3_json": (
        "To call a function, reply with nothing but a JSON object of its name and parameters; separate several "
        "calls with \"; \":\n{\"name\": \"function_name\", \"parameters\": {\"parameter\": \"value\"}}"
    ),
    "pythonic": (
        "To call functions, reply with nothing but a Python list of calls with keyword arguments:\n"
        "[function_name(parameter=\"value\"), other_function()]"
    ),
    "mistral": (
        "To call functions, reply with [TOOL_CALLS] and a JSON list of the calls, each its name and arguments:\n"
        "[TOOL_CALLS][{\"name\": \"function_name\", \"arguments\": {\"parameter\": \"value\"}}]"
    ),
}


def _tools_text(syntax: str, tools: list[dict[str, Any]]) -> str:
    definitions = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call the functions described below, as JSON schemas, between <tools> and </tools>. "
            "Call one only when it helps answer the user; otherwise reply in text.\n"
            f"<tools>\n{definitions}\n</tools>\n\n{_INSTRUCTIONS[syntax]}")


def _py_literal(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, list):
        return "[" + ", ".join(_py_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_py_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)  # strings and numbers read the same in both


def calls_text(syntax: str, calls: list[dict[str, Any]]) -> str:
    """An assistant turn's tool calls ({"function": {"name", "arguments": object}}) as the model writes them."""
    named = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if syntax == "hermes":
        return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
                         for n, a in named)
    if syntax == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in named)
    if syntax == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in named], ensure_ascii=False)
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={_py_literal(v)}" for k, v in a.items()) + ")"
                           for n, a in named) + "]"


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> str:
    return tokenizer.apply_chat_template(messages, True, tools)


def template_ignores_tools(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                           tools: Optional[list[dict[str, Any]]]) -> Optional[str]:
    """What of the request's tool use the chat template would drop ("tools", "messages.i.tool_calls"),
    or None when it renders all of it (or there is none). Raises what the template raises."""
    with_calls = [i for i, m in enumerate(messages) if m.get("tool_calls")]
    if not tools and not with_calls:
        return None
    whole = _render(tokenizer, messages, tools)
    # Against the same template without tools: [] picks the one tools pick (a checkpoint's "tool_use",
    # which may be its only template) and renders as no tools to `{% if tools %}`.
    if tools and whole == _render(tokenizer, messages, []):
        return "tools"
    for i in with_calls:
        without = list(messages)
        without[i] = {k: v for k, v in messages[i].items() if k != "tool_calls"}
        if whole == _render(tokenizer, without, tools):
            return f"messages.{i}.tool_calls"
    return None


def with_tools_in_messages(syntax: str, messages: list[dict[str, Any]],
                           tools: Optional[list[dict[str, Any]]], system_turn: bool = True) -> list[dict[str, Any]]:
    """The conversation with its tools, calls and results written as plain turns (see the module's doc).
    Results that follow one another make one user turn (templates that want turns to alternate, as
    Gemma's, refuse two). `system_turn=False`, for a template that refuses a system message (Gemma 2's):
    the definitions open the first user turn instead."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            text = calls_text(syntax, m["tool_calls"])
            content = f"{m['content']}\n{text}" if m.get("content") else text
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_result"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
            else:
                out.append({"role": "user", "content": result, "tool_result": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_call_id"})
    out = [{k: v for k, v in m.items() if k != "tool_result"} for m in out]
    if tools:
        block = _tools_text(syntax, tools)
        first = out[0]["role"] if out else None
        if first in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        elif system_turn:
            out.insert(0, {"role": "system", "content": block})
        elif first == "user":  # the definitions before the question
            out[0] = {**out[0], "content": f"{block}\n\n{out[0]['content']}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "user", "content": block})
    return out
