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

from jaxcb.errors import InvalidRequestError
from jaxcb.server.protocol import APIError, ChatCompletionRequest, message_text
from jaxcb.server.tool_grammar import tool_call_grammar
from jaxcb.server.tool_parsers import ParsedToolOutput, ToolParser
from jaxcb.structured.spec import (
    StructuredOutputs,
    StructuredOutputsError,
    from_response_format,
    from_structured_outputs,
    strict_schema,
)
from jaxcb.tokenizer import Tokenizer, chat_prompt_ids


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    structured: Optional[StructuredOutputs]  # what the reply must match, or None
    tool_parser: Optional[ToolParser]  # reads tool calls out of the reply; None: the reply is text
    max_tool_calls: Optional[int]  # 1 when parallel_tool_calls is false


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat templates read them (tool-call arguments as objects, as transformers passes them)."""
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages.{i}.content is null; only an assistant message with tool_calls may "
                                "omit its content", param=f"messages.{i}.content")
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(400, f"messages.{i} is a tool message without tool_call_id; say which call it answers",
                           param=f"messages.{i}.tool_call_id")
        # content null (an assistant turn that only calls tools) reaches templates as "", as vLLM passes it:
        # most templates concatenate the content.
        message: dict[str, Any] = {"role": m.role, "content": message_text(m) or ""}
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
        raise APIError(400, f"{where}.function.arguments must be a JSON object as a string",
                       param=f"{where}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _structured(req: ChatCompletionRequest) -> Optional[StructuredOutputs]:
    try:
        from_format = from_response_format(req.response_format) if req.response_format is not None else None
        from_vllm = from_structured_outputs(req.structured_outputs) if req.structured_outputs is not None else None
    except StructuredOutputsError as e:
        raise APIError(400, str(e), param=e.field) from None
    if from_format is not None and from_vllm is not None:
        raise APIError(400, "response_format and structured_outputs both constrain the reply; give one",
                       param="structured_outputs")
    return from_format or from_vllm


def plan_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, parser: ToolParser) -> ChatPlan:
    """The prompt and constraints of a chat request, or APIError(400) naming the field at fault."""
    if not req.messages:
        raise APIError(400, "messages is empty; give at least one message", param="messages")
    structured = _structured(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, f"tool_choice={_choice_name(choice)} needs tools; give tools or drop tool_choice",
                       param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if not isinstance(choice, str) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                            f"({', '.join(names)})", param="tool_choice")
    parallel = req.parallel_tool_calls is not False
    if choice == "required" or not isinstance(choice, str):
        if structured is not None:
            raise APIError(400, f"tool_choice={_choice_name(choice)} and a response format both constrain the reply; "
                                "give one", param="tool_choice")
        try:
            grammar = tool_call_grammar(parser, [_strict_tool(t) for t in tools],
                                        choice if choice == "required" else choice.model_dump(), parallel)
        except ValueError as e:  # a name or schema the parser's syntax cannot carry
            raise APIError(400, f"tools: {e}", param="tools") from None
        structured = StructuredOutputs("lark", grammar, "tool_choice")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message=true continues the last message, so add_generation_prompt must be "
                            "false", param="add_generation_prompt")
    try:
        prompt_ids = chat_prompt_ids(
            tokenizer, template_messages(req), req.add_generation_prompt, tools or None,
            continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}),
        )
    except InvalidRequestError as e:  # no chat template, or one that refuses the conversation
        raise APIError(400, str(e), param="messages") from None
    except TypeError as e:  # a chat_template_kwargs key that clashes with the template's own arguments
        raise APIError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
    return ChatPlan(prompt_ids, structured, parser if choice != "none" else None, None if parallel else 1)


def _strict_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool with `strict: true` allows no properties its schema does not list (OpenAI's strict mode)."""
    function = tool["function"]
    if not function.get("strict") or "parameters" not in function:
        return tool
    return {**tool, "function": {**function, "parameters": strict_schema(function["parameters"])}}


def _choice_name(choice) -> str:
    return choice if isinstance(choice, str) else f"function {choice.function.name!r}"


def assistant_message(plan: ChatPlan, text: str, finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
    """(OpenAI's assistant message, finish reason) of a finished reply: with tool calls read out of it
    (finish_reason "tool_calls") when the plan has a parser and the reply makes calls."""
    if plan.tool_parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed: ParsedToolOutput = plan.tool_parser.parse(text)
    calls = parsed.tool_calls[: plan.max_tool_calls] if plan.max_tool_calls else parsed.tool_calls
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": parsed.content, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason
