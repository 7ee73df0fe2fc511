"""`POST /v1/responses` bodies (OpenAI's Responses API, stateless but for `previous_response_id`) in the
chat endpoint's terms: the input items, instructions, tools and `text.format` become a chat request
that `requests.plan_chat_completion` plans, so that a response is read, constrained, templated and
validated exactly as a chat completion is. Refusals name the Responses field (`max_output_tokens`,
`text.format.schema`, `input.2.content.0`), never the chat field it became.

What the Responses API has and jaxcb does not (built-in tools, file and image inputs, reasoning
effort, item references) is refused by name. The conversation so far comes from
`ResponseStore` (response_store.py) for `previous_response_id`. No jax.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import ValidationError

from jaxcb.errors import InvalidRequestError
from jaxcb.request_fields import RefusedFieldError, check_fields
from jaxcb.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from jaxcb.server.protocol import ChatCompletionRequest, _is_union_member, _Strict, parse_request
from jaxcb.server.reasoning import ReasoningParser
from jaxcb.server.requests import PlannedRequest, plan_chat_completion
from jaxcb.server.response_store import ResponseStore
from jaxcb.server.tool_parsers import ToolParser
from jaxcb.tokenizer import Tokenizer

BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
                  "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")
_TEXT_PARTS = ("input_text", "output_text", "text")
# A text part's fields: an output_text part (a past reply sent back) also carries its annotations and logprobs,
# which say nothing the prompt holds.
_PART_FIELDS = {"input_text": frozenset({"type", "text"}), "text": frozenset({"type", "text"}),
                "output_text": frozenset({"type", "text", "annotations", "logprobs"})}
# text.format's fields per type (another type is refused by name when the format is read).
_FORMAT_FIELDS = {"text": frozenset({"type"}), "json_object": frozenset({"type"}),
                  "json_schema": frozenset({"type", "name", "schema", "strict", "description"})}
_STATUS = Literal["in_progress", "completed", "incomplete"]
# OpenAI's bounds on metadata (16 pairs; keys up to 64 characters, values up to 512).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class ResponsesRequest(_Strict):
    model: str
    input: Union[str, list[Any]]  # items read one by one (input_messages), each refusal naming input.i
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None  # function tools only: read item by item
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None  # {"format": ...}: text, json_object or json_schema
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    previous_response_id: Optional[str] = None
    store: bool = True
    background: bool = False  # answered at once (status "queued"); GET /v1/responses/{id} polls it, /cancel stops it
    reasoning: Optional[dict[str, Any]] = None  # effort: chat's reasoning_effort; a summary cannot be honoured
    include: Optional[list[str]] = None  # only empty: no extra output is available
    truncation: Optional[Literal["disabled"]] = None  # a prompt too long is refused, never cut
    metadata: Optional[dict[str, str]] = None  # generates nothing; kept with the response and echoed, as OpenAI does
    # Generate nothing either; echoed as OpenAI echoes them (`service_tier` stays ignored: every response is "default")
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[dict[str, Any]]]
    id: Optional[str] = None
    status: Optional[_STATUS] = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[_STATUS] = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[dict[str, Any]]]
    id: Optional[str] = None
    status: Optional[_STATUS] = None


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[dict[str, Any]] = []
    content: Optional[list[dict[str, Any]]] = None
    encrypted_content: Optional[str] = None
    status: Optional[_STATUS] = None


_ITEMS: dict[str, type[_Strict]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
# Chat's field (as a path prefix) -> the Responses field it came from, for refusals.
_RENAMED = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"), ("messages", "input"), ("reasoning_effort", "reasoning.effort"))


def parse_responses_request(body: Any) -> ResponsesRequest:
    """A /v1/responses body, every field read or refused by name."""
    if isinstance(body, dict):  # null is the default, as OpenAI reads it (stream: false, store: true)
        body = {k: v for k, v in body.items() if not (k in ("stream", "store", "background") and v is None)}
    req: ResponsesRequest = parse_request(ResponsesRequest, body)
    if req.background and not req.store:
        raise InvalidRequestError("background: a background response is fetched later (GET /v1/responses/{id}), so "
                                  "it must be stored: drop store=false, or background", "background")
    _check_metadata(req.metadata or {})
    reasoning = req.reasoning or {}
    for key, value in reasoning.items():
        if key in ("summary", "generate_summary") and value is not None:
            raise RefusedFieldError(f"reasoning.{key}: jaxcb cannot summarize a model's reasoning; it comes whole "
                                    "as a reasoning item", f"reasoning.{key}")
        if key not in ("effort", "summary", "generate_summary"):
            raise RefusedFieldError(f"reasoning.{key} is not a field jaxcb knows; remove it", f"reasoning.{key}")
    if req.include:
        raise RefusedFieldError(f"include: {req.include[0]!r} is not available from jaxcb; send include=[] or "
                                "leave it out", "include.0")
    return req


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequestError(f"metadata: the key {key[:20]!r}... is {len(key)} characters; at most "
                                      f"{MAX_METADATA_KEY}", "metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequestError(f"metadata.{key} is {len(value)} characters; at most {MAX_METADATA_VALUE}",
                                      f"metadata.{key}")


_FORMS = {"content": "a string or a list of content parts ({'type': 'input_text', 'text': ...})",
          "output": "a string or a list of content parts ({'type': 'input_text', 'text': ...})"}


def _parse_item(cls: type[_Strict], data: dict[str, Any], where: str) -> Any:
    """`data` as a `cls`, refusals naming the field under `where` (e.g. "input.2.")."""
    try:
        return cls.model_validate(check_fields(data, frozenset(cls.model_fields), where))
    except ValidationError as e:
        # Of a union's errors, the deepest: a list's bad part (content.0), not the string member's miss.
        err = max(e.errors(), key=lambda x: len([p for p in x["loc"] if not _is_union_member(p)]))
        loc = [str(p) for p in err["loc"] if not _is_union_member(p)]
        param = where + ".".join(loc)
        forms = f"; {loc[0]} takes {_FORMS[loc[0]]}" if loc and loc[0] in _FORMS else ""
        raise InvalidRequestError(f"{param}: {err['msg']}{forms}", param) from None


def _item_text(content: Union[str, list[dict[str, Any]]], at: str, role: Optional[str] = None) -> str:
    """A message's or a tool output's text (`at`: its path, "input.2.content"); parts other than text are
    refused by name, and as OpenAI refuses them, a reply's output_text in a `role` that writes input and
    an input_text in an assistant message."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise InvalidRequestError(f"{at}.{j}: a content part of type {kind!r} is not supported: "
                                      f"jaxcb serves text models; give parts of type {', '.join(_TEXT_PARTS)}",
                                      f"{at}.{j}")
        wrong = "input_text" if role == "assistant" else "output_text" if role is not None else None
        if kind == wrong:
            right = "output_text" if role == "assistant" else "input_text"
            raise InvalidRequestError(f"{at}.{j}.type: a {role} message's text parts are {right!r}, not {kind!r}",
                                      f"{at}.{j}.type")
        check_fields(part, _PART_FIELDS[kind], f"{at}.{j}.")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{at}.{j}.text must be a string (a part is {{'type': {kind!r}, 'text': ...}})",
                                      f"{at}.{j}.text")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: Union[str, list[Any]], earlier_call_ids: frozenset[str] = frozenset(),
                   unanswered: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """`input` as chat messages: items in order, function calls folded into the assistant turn before them,
    function outputs as tool messages. Reasoning items are left out, as chat templates leave out past
    reasoning. As OpenAI requires, a function output answers a call made before it, here or in
    `earlier_call_ids` (the calls of the previous_response_id's conversation), and every call has its
    output: those made here, and the `unanswered` ones of that conversation (its last reply's)."""
    if isinstance(value, str):
        if unanswered:
            raise _no_output(sorted(unanswered)[0], "input")
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    call_ids = set(earlier_call_ids)
    waiting = {call_id: "input" for call_id in sorted(unanswered)}  # call_id -> where the call was made, in order
    for i, data in enumerate(value):
        where = f"input.{i}."
        if not isinstance(data, dict):
            raise InvalidRequestError(f"input.{i} must be an object (a message or an item), not "
                                      f"{type(data).__name__}", f"input.{i}")
        kind = data.get("type", "message")
        if kind not in _ITEMS:
            raise RefusedFieldError(f"input.{i}.type: {kind!r} items are not supported; give messages, function_call, "
                                    "function_call_output and reasoning items", f"input.{i}.type")
        item = _parse_item(_ITEMS[kind], data, where)
        if isinstance(item, MessageItem):
            text = _item_text(item.content, f"input.{i}.content", item.role)
            messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            if not _is_json_object(item.arguments):
                raise InvalidRequestError(f"input.{i}.arguments must be a JSON object as a string",
                                          f"input.{i}.arguments")
            call_ids.add(item.call_id)
            waiting[item.call_id] = f"input.{i}"
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                raise InvalidRequestError(f"input.{i}.call_id: no function call with call_id {item.call_id!r} comes "
                                          "before this function_call_output (in input, or in the conversation of "
                                          "previous_response_id); send the function_call item first",
                                          f"input.{i}.call_id")
            waiting.pop(item.call_id, None)
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _item_text(item.output, f"input.{i}.output")})
    if waiting:  # the model would read a call without its result (OpenAI: "No tool output found ...")
        call_id = next(iter(waiting))
        raise _no_output(call_id, waiting[call_id])
    if not messages:
        raise InvalidRequestError("input has no message; give at least one", "input")
    return messages


def _no_output(call_id: str, where: str) -> InvalidRequestError:
    made = "the previous response made" if where == "input" else "this item is"
    return InvalidRequestError(f"{where}: no tool output found for the function call {call_id!r} ({made}); send its "
                               "function_call_output item in input", where)


def _call_ids(messages: Sequence[dict[str, Any]]) -> frozenset[str]:
    return frozenset(call["id"] for m in messages for call in m.get("tool_calls") or ())


def _unanswered_call_ids(messages: Sequence[dict[str, Any]]) -> frozenset[str]:
    return _call_ids(messages) - {m["tool_call_id"] for m in messages if m.get("role") == "tool"}


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _chat_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in BUILT_IN_TOOLS or (isinstance(kind, str) and kind.startswith(BUILT_IN_TOOLS)):
            raise RefusedFieldError(f"tools.{i}: the built-in tool {kind!r} is not implemented by jaxcb; only function "
                                    "tools ({\"type\": \"function\", \"name\": ...}) are", f"tools.{i}.type")
        if kind != "function":
            raise RefusedFieldError(f"tools.{i}.type={kind!r}: only function tools are supported", f"tools.{i}.type")
        function = _parse_item(FunctionTool, tool, f"tools.{i}.").model_dump(exclude_none=True)
        out.append({"type": "function", "function": {k: v for k, v in function.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: Union[str, dict[str, Any], None]) -> Union[str, dict[str, Any], None]:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"} or not isinstance(choice["name"], str):
        raise RefusedFieldError(f"tool_choice={choice!r} is not supported: give none, auto, required or "
                                "{\"type\": \"function\", \"name\": ...}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """`text.format` as chat's response_format (`verbosity` is refused by name, as in chat; null is left out)."""
    if text is None:
        return None
    fields = check_fields({k: v for k, v in text.items() if not (k == "verbosity" and v is None)},
                          frozenset({"format"}), "text.")
    fmt = fields.get("format")
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") in _FORMAT_FIELDS:
        check_fields(fmt, _FORMAT_FIELDS[fmt["type"]], "text.format.")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt  # text, json_object, or what from_response_format refuses
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def responses_field(error: InvalidRequestError) -> InvalidRequestError:
    """A chat refusal naming the Responses field it came from."""
    field = error.field
    tool = re.fullmatch(r"tools\.(\d+)\.function\.(.+)", field or "")
    if tool:  # a Responses tool has no `function` level: tools.i.name, tools.i.parameters
        name = f"tools.{tool.group(1)}.{tool.group(2)}"
        return InvalidRequestError(str(error).replace(field, name), name)
    for chat, responses in _RENAMED:
        if field is not None and (field == chat or field.startswith(chat + ".")):
            name = responses + field[len(chat):]
            return InvalidRequestError(str(error).replace(field, name), name)
    return error


@dataclass
class ResponsePlan:
    planned: PlannedRequest
    history: list[dict[str, Any]]  # the conversation before the reply, as chat messages (without instructions)


def plan_response(req: ResponsesRequest, store: ResponseStore, tokenizer: Tokenizer, parser: ToolParser,
                  max_model_len: int, tool_prompt_fallback: bool, reasoning: Optional[ReasoningParser],
                  structured_in_reasoning: bool, defaults: SamplingDefaults = NO_DEFAULTS) -> ResponsePlan:
    """The engine request of a Responses body; InvalidRequestError or APIError (404: an unknown
    previous_response_id) naming the field at fault."""
    history = list(store.history(req.previous_response_id)) if req.previous_response_id is not None else []
    history += input_messages(req.input, _call_ids(history), _unanswered_call_ids(history))
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    response_format = _response_format(req.text)
    # auto without tools asks for nothing (OpenAI's and vLLM's default choice, which clients send back as it is)
    tool_choice = None if req.tool_choice == "auto" and not req.tools else _chat_tool_choice(req.tool_choice)
    try:
        chat = parse_request(ChatCompletionRequest, {
            "model": req.model, "messages": system + history, "tools": _chat_tools(req.tools),
            "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "reasoning_effort": (req.reasoning or {}).get("effort"),
        })
        planned = plan_chat_completion(chat, tokenizer, parser, max_model_len, tool_prompt_fallback, reasoning,
                                       structured_in_reasoning, defaults)
    except InvalidRequestError as e:
        raise responses_field(_after_instructions(e, len(system))) from None
    planned.renamed_fields = {k: dict(_RENAMED).get(v, v) for k, v in planned.renamed_fields.items()}
    # The response echoes the sampling it got: a field left out takes the model's default, not OpenAI's.
    req.temperature = planned.params.temperature if req.temperature is None else req.temperature
    req.top_p = planned.params.top_p if req.top_p is None else req.top_p
    return ResponsePlan(planned, history)


def _after_instructions(error: InvalidRequestError, num_system: int) -> InvalidRequestError:
    """`messages.i` counts the instructions' system message; the body's input does not."""
    field = error.field or ""
    head, _, rest = field.partition(".")
    index, _, tail = rest.partition(".")
    if head != "messages" or not index.isdigit() or not num_system:
        return error
    name = "instructions" if int(index) < num_system else ".".join(filter(None, ["messages", str(int(index) - num_system), tail]))
    return InvalidRequestError(str(error).replace(field, name, 1), name)
