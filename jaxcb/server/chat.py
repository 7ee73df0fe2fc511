"""A chat request's plan: its prompt (messages, tools and template variables through the chat
template), what constrains its reply (response_format, structured_outputs, tool_choice), and
how tool calls are read back out of the reply.

tool_choice: "none" (the reply is text), "auto" (the default with tools: the model may call;
its text is parsed with server.tool_call_parser), "required" or a named function (enforced:
a grammar built from the tools' parameter schemas, in the parser's syntax, so the reply is
always one or more valid calls -- never an empty tool_calls list).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import jsonschema

from jaxcb.errors import InvalidRequestError
from jaxcb.server.protocol import ChatCompletionRequest, message_text
from jaxcb.server.reasoning import ReasoningParser, ReplyStart, hold_answer, reasoning_token_count
from jaxcb.server.tool_grammar import tool_call_grammar
from jaxcb.server.tool_parsers import ParsedToolOutput, ToolCallDelta, ToolParser
from jaxcb.server.tool_prompt import template_ignores_tools, with_tools_in_messages
from jaxcb.structured.spec import (
    OPENAI_NAME,
    StructuredOutputs,
    from_response_format,
    from_structured_outputs,
    strict_schema,
)
from jaxcb.tokenizer import ChatTemplateError, Tokenizer, chat_prompt_ids, tools_chat_template


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    structured: Optional[StructuredOutputs]  # what the reply must match, or None
    tool_parser: Optional[ToolParser]  # reads tool calls out of the reply; None: the reply is text
    max_tool_calls: Optional[int]  # 1 when parallel_tool_calls is false
    reasoning: Optional[ReasoningParser] = None  # reads the reasoning out of the reply; None: all content
    reply_start: Optional[ReplyStart] = None  # with `reasoning`: where the reply starts
    echo: str = ""  # vLLM's echo: the last message's text, which the reply's content starts with

    def streamer(self) -> "ReplyStreamer":
        return ReplyStreamer(self)


class ReplyStreamer:
    """One reply's text deltas read as `assistant_message` reads the whole reply: the reasoning apart, then
    tool calls out of the rest (text that may start a call is held back until it is known)."""

    def __init__(self, plan: ChatPlan):
        self._max_tool_calls = plan.max_tool_calls
        self._reasoning = plan.reasoning.streamer(plan.reply_start) if plan.reasoning is not None else None
        self._calls = plan.tool_parser.streamer() if plan.tool_parser is not None else None

    def feed(self, text: str, done: Optional[str]) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, tool call deltas) that `text` lets out; `done`: the reply's finish reason once
        it has one (a reply cut short lets out no unfinished call)."""
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text)
            if done:
                more_reasoning, more_text = self._reasoning.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        calls: list[ToolCallDelta] = []
        if self._calls is not None:
            text, calls = self._calls.feed(text)
            if done:
                more_text, more_calls = self._calls.finish(cut=done != "stop")
                text, calls = text + more_text, calls + more_calls
            if self._max_tool_calls is not None:
                calls = [d for d in calls if d.index < self._max_tool_calls]
        return reasoning, text, calls


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat templates read them (tool-call arguments as objects, as transformers passes them)."""
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise InvalidRequestError(f"messages.{i}.content is null; only an assistant message with tool_calls may "
                                "omit its content", f"messages.{i}.content")
        if m.role == "tool" and m.tool_call_id is None:
            raise InvalidRequestError(f"messages.{i} is a tool message without tool_call_id; say which call it answers",
                           f"messages.{i}.tool_call_id")
        # content null (an assistant turn that only calls tools) reaches templates as "", as vLLM passes it:
        # most templates concatenate the content.
        message: dict[str, Any] = {"role": m.role, "content": message_text(m, f"messages.{i}") or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
        out.append(message)
    return out


def _template_call(call, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON object as a string",
                       f"{where}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _structured(req: ChatCompletionRequest) -> Optional[StructuredOutputs]:
    from_format = from_response_format(req.response_format) if req.response_format is not None else None
    from_vllm = from_structured_outputs(req.structured_outputs) if req.structured_outputs is not None else None
    if from_format is not None and from_vllm is not None:
        raise InvalidRequestError("response_format and structured_outputs both constrain the reply; give one",
                       "structured_outputs")
    return from_format or from_vllm


def plan_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, parser: ToolParser,
              tool_prompt_fallback: bool = True, reasoning: Optional[ReasoningParser] = None,
              structured_in_reasoning: bool = False) -> ChatPlan:
    """The prompt and constraints of a chat request, or InvalidRequestError naming the field at fault.
    `tool_prompt_fallback` (server.tool_prompt_fallback): tools, calls and results that the chat
    template does not render are written into the conversation (`tool_prompt`); off, they are refused.
    `reasoning` (server.reasoning_parser): the reply's reasoning is read apart, and what constrains the
    reply holds only the answer after it unless `structured_in_reasoning`."""
    if not req.messages:
        raise InvalidRequestError("messages is empty; give at least one message", "messages")
    _check_tool_fields(req)
    structured = _structured(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    _check_tools(tools)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise InvalidRequestError(f"tool_choice={_choice_name(choice)} needs tools; give tools or drop tool_choice",
                       "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if not isinstance(choice, str) and choice.function.name not in names:
        raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                            f"({', '.join(names)})", "tool_choice")
    parallel = req.parallel_tool_calls is not False
    if choice == "required" or not isinstance(choice, str):
        if structured is not None:
            raise InvalidRequestError(f"tool_choice={_choice_name(choice)} and a response format both constrain the reply; "
                                "give one", "tool_choice")
        try:
            grammar = tool_call_grammar(parser, [_strict_tool(t) for t in tools],
                                        choice if choice == "required" else choice.model_dump(), parallel)
        except ValueError as e:  # a name or schema the parser's syntax cannot carry
            raise InvalidRequestError(f"tools: {e}", "tools") from None
        # A grammar that does not compile comes from a tool's parameter schema (a bad `pattern`, say).
        structured = StructuredOutputs("lark", grammar, "tools")
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequestError("continue_final_message=true continues the last message, so add_generation_prompt must be "
                            "false", "add_generation_prompt")
    try:
        messages, template_tools = _messages_with_tools(req, tokenizer, parser, tools, tool_prompt_fallback)
    except InvalidRequestError as e:
        raise _naming_messages(e) from None
    reserved = sorted(set(req.chat_template_kwargs or {}) & _TEMPLATE_ARGUMENTS)
    if req.reasoning_effort is not None and "reasoning_effort" in (req.chat_template_kwargs or {}):
        reserved = ["reasoning_effort"]  # given twice: the request's own field is the one to keep
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs.{reserved[0]} is set by the request itself (its own field "
                                  "or messages); remove it from chat_template_kwargs",
                                  f"chat_template_kwargs.{reserved[0]}")
    def render(**extra: Any) -> list[int]:
        try:
            return chat_prompt_ids(
                tokenizer, messages, req.add_generation_prompt, template_tools,
                continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}), **extra,
            )
        except InvalidRequestError as e:
            raise _naming_messages(e) from None
        except TypeError as e:  # a chat_template_kwargs key that clashes with the template's own arguments
            raise InvalidRequestError(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None

    # Fields passed to the template as vLLM passes them; one the template leaves unread is refused (vLLM would
    # drop it silently). A template reads a field when the prompt changes without it, or with another value
    # in its place (the value given may be the template's own default: gpt-oss's "medium").
    extra = {k: v for k, v in (("documents", req.documents), ("reasoning_effort", req.reasoning_effort)) if v}
    prompt_ids = render(**extra)
    for name in extra:
        others = {k: v for k, v in extra.items() if k != name}
        if prompt_ids != render(**others):
            continue
        try:
            unread = render(**others, **{name: _PROBES[name]}) == prompt_ids
        except InvalidRequestError:  # the template looked at the value, and refused the probe
            unread = False
        if unread:
            raise InvalidRequestError(f"{name}: this model's chat template {_UNREAD_BY_TEMPLATE[name]}", name)
    reply_start = None
    if reasoning is not None:
        reply_start = reasoning.reply_start(tokenizer.decode(prompt_ids, skip_special_tokens=False))
        if structured is not None and reply_start.may_reason and not structured_in_reasoning:
            structured = hold_answer(structured, reply_start, tokenizer)
    return ChatPlan(prompt_ids, structured, parser if choice != "none" else None, None if parallel else 1,
                    reasoning, reply_start, _echo_text(req))


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text when it is the reply's role (the assistant's, or with
    add_generation_prompt=false the last message's own: a reply continuing it), else nothing."""
    last = req.messages[-1] if req.messages else None
    role = "assistant" if req.add_generation_prompt else (last.role if last is not None else None)
    if not req.echo or last is None or last.role != role:
        return ""
    return message_text(last, f"messages.{len(req.messages) - 1}") or ""


_PROBES = {"documents": [{"title": "\x00", "text": "\x00"}], "reasoning_effort": "\x00"}
_UNREAD_BY_TEMPLATE = {
    "documents": "does not render documents, so the model would never see them; put them in the messages instead",
    "reasoning_effort": "does not read a reasoning effort, so it would change nothing; leave it out",
}
# What the template gets from the request itself: chat_template_kwargs may not set them.
_TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                 "documents", "chat_template", "tokenizer", "tokenize"})


def _check_tool_fields(req: ChatCompletionRequest) -> None:
    """tool_calls belong to assistant messages and tool_call_id to tool messages; elsewhere they would be
    rendered (or dropped) as nothing a chat template expects."""
    for i, m in enumerate(req.messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise InvalidRequestError(f"messages.{i}.tool_calls: only an assistant message makes tool calls, not a "
                                      f"{m.role} message", f"messages.{i}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise InvalidRequestError(f"messages.{i}.tool_call_id: only a tool message answers a call, not a "
                                      f"{m.role} message", f"messages.{i}.tool_call_id")


def _check_tools(tools: list[dict[str, Any]]) -> None:
    """Every tool definition as OpenAI takes it, whatever tool_choice: the model sees each one in its
    prompt, so a name or schema the grammar or parser could not carry is refused up front."""
    seen = set()
    for i, tool in enumerate(tools):
        function, where = tool["function"], f"tools.{i}.function"
        name = function["name"]
        if not OPENAI_NAME.fullmatch(name):
            raise InvalidRequestError(f"{where}.name={name!r} must be 1-64 letters, digits, '_' or '-'", f"{where}.name")
        if name in seen:
            raise InvalidRequestError(f"{where}.name={name!r} is the name of an earlier tool; names must be unique",
                                      f"{where}.name")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is None:
            continue
        if parameters.get("type", "object") != "object":
            raise InvalidRequestError(f"{where}.parameters must be the JSON schema of an object (\"type\": \"object\"), "
                                      f"not of type {parameters.get('type')!r}", f"{where}.parameters")
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as e:
            raise InvalidRequestError(f"{where}.parameters is not a valid JSON schema: {e.message}",
                                      f"{where}.parameters") from None


def _naming_messages(e: InvalidRequestError) -> InvalidRequestError:
    """A template's refusal (no chat template, one that refuses the conversation) names `messages`."""
    return e if e.field is not None else InvalidRequestError(str(e), "messages")


def _messages_with_tools(req: ChatCompletionRequest, tokenizer: Tokenizer, parser: ToolParser,
                         tools: list[dict[str, Any]], fallback: bool) -> tuple[list[dict[str, Any]], Optional[list]]:
    """(messages, tools) to render: as given when the template renders the request's tool use, else
    with the tools written into the conversation; InvalidRequestError when that is off."""
    messages = template_messages(req)
    try:
        dropped = template_ignores_tools(tokenizer, messages, tools or None)
    except ChatTemplateError:  # e.g. Gemma's: tool turns break the alternation it demands
        uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if not uses_tools:
            raise
        dropped = "tools" if tools else "messages"
    if dropped is None:
        return messages, tools or None
    if not fallback:
        raise InvalidRequestError(
            f"{dropped}: this model's chat template does not render tools, so the model would never see them; "
            "start the server with a chat template that does (server.chat_template=FILE) or with "
            "server.tool_prompt_fallback=true, or send the request without them", dropped)
    # Rendered without tools by the template tools pick: [] picks a checkpoint's "tool_use" one where it has
    # no default (and reads as no tools to `{% if tools %}`).
    no_tools = [] if tokenizer.chat_template is None and tools_chat_template(tokenizer) is not None else None
    written = with_tools_in_messages(parser.name, messages, tools or None)
    try:
        tokenizer.apply_chat_template(written, True, no_tools)
    except ChatTemplateError:  # a template that refuses a system turn (Gemma 2's): the definitions go to the user
        written = with_tools_in_messages(parser.name, messages, tools or None, system_turn=False)
    return written, no_tools


def _strict_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool with `strict: true` allows no properties its schema does not list (OpenAI's strict mode)."""
    function = tool["function"]
    if not function.get("strict") or "parameters" not in function:
        return tool
    return {**tool, "function": {**function, "parameters": strict_schema(function["parameters"])}}


def _choice_name(choice) -> str:
    return choice if isinstance(choice, str) else f"function {choice.function.name!r}"


def assistant_message(plan: ChatPlan, text: str, finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
    """(OpenAI's assistant message, finish reason) of a finished reply: its reasoning apart
    (`reasoning_content`) when the plan reads reasoning, and tool calls read out of the rest
    (finish_reason "tool_calls") when the plan has a parser and the reply makes calls."""
    if plan.reasoning is None:
        return _answer_message(plan, text, finish_reason)
    split = plan.reasoning.split(text, plan.reply_start)
    if split.content is None:
        message, finish = {"role": "assistant", "content": None}, finish_reason
    else:
        message, finish = _answer_message(plan, split.content, finish_reason)
    return {**message, "reasoning_content": split.reasoning}, finish


def _answer_message(plan: ChatPlan, text: str, finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
    """The message of a reply's answer: with its tool calls when it makes some. A reply cut short (by
    max_tokens, a timeout) keeps its finished calls, and a call it was still writing is dropped rather
    than left as markup in the content; finish_reason then says why it was cut."""
    if plan.tool_parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed: ParsedToolOutput = plan.tool_parser.parse(text, cut=finish_reason != "stop")
    calls = parsed.tool_calls[: plan.max_tool_calls] if plan.max_tool_calls else parsed.tool_calls
    if not calls:
        return {"role": "assistant", "content": parsed.content if finish_reason != "stop" else text}, finish_reason
    message = {"role": "assistant", "content": parsed.content, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def reasoning_tokens(plan: ChatPlan, tokenizer: Tokenizer, token_ids: list[int], text: str) -> Optional[int]:
    """A reply's reasoning tokens (usage's `completion_tokens_details.reasoning_tokens`); None when the plan
    reads no reasoning."""
    if plan.reasoning is None:
        return None
    split = plan.reasoning.split(text, plan.reply_start)
    return reasoning_token_count(tokenizer, token_ids, split.reasoning is not None)
