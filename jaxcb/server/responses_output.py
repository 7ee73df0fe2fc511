"""A reply as an OpenAI Response object: whole, or as the Responses API's stream of events.

Output items, in the order the reply writes them: a `reasoning` item (when the reasoning parser
finds some), a `message` with one `output_text` part, and a `function_call` per tool call. The
reply is read by the chat endpoint's readers (`chat.assistant_message` whole; the reasoning and
tool-call streamers streamed), so a response says what a chat completion of the same request says.

The stream, as the openai client and the Agents SDK parse it: `response.created`,
`response.in_progress`; per item `response.output_item.added`, its deltas
(`response.reasoning_text.delta`, `response.content_part.added` + `response.output_text.delta`,
`response.function_call_arguments.delta`), their `.done` events and `response.output_item.done`;
then `response.completed` (or `response.incomplete` when cut short) with the whole response. No jax.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.server import openai_format as fmt
from jaxcb.server.chat import ChatPlan, assistant_message
from jaxcb.server.protocol import APIError
from jaxcb.server.reasoning import reasoning_token_count
from jaxcb.server.responses import ResponsesRequest
from jaxcb.server.streaming import served_outputs, usage_of
from jaxcb.tokenizer import Tokenizer


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [_text_part(text)]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reply_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation (reasoning left out, as
    chat templates leave out past reasoning)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _status(finish: Optional[str]) -> tuple[str, Optional[dict[str, str]]]:
    """(the response's status, its incomplete_details) for a chat finish reason."""
    if finish in ("stop", "tool_calls"):
        return "completed", None
    return "incomplete", {"reason": "max_output_tokens" if finish == "length" else str(finish)}


class ResponseWriter:
    """One response's object and events; `id` and `created_at` fixed when the request is taken."""

    def __init__(self, req: ResponsesRequest, plan: ChatPlan, model: str, tokenizer: Tokenizer):
        self.req, self.plan, self.model, self.tokenizer = req, plan, model, tokenizer
        self.id, self.created_at = _item_id("resp"), int(time.time())
        self._stream = _EventStream(plan)

    def response(self, status: str, output: list[dict[str, Any]], final: Optional[RequestOutput] = None,
                 reasoning_tokens: int = 0, incomplete: Optional[dict[str, str]] = None) -> dict[str, Any]:
        req = self.req
        usage = None
        if final is not None:
            prompt, completion, cached = usage_of([final])
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": prompt + completion}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": output, "usage": usage, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
            # `store` as asked until the store says whether it kept the response (the app sets it then)
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "store": req.store,
            "metadata": req.metadata or {},
            "background": req.background, "service_tier": "default", "user": req.user,
            "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        }

    def whole(self, final: RequestOutput) -> dict[str, Any]:
        """The response to a finished request."""
        [c] = final.outputs
        message, finish = assistant_message(self.plan, c.text, fmt.finish_reason(c))
        status, incomplete = _status(finish)
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(_item_id("rs"), message["reasoning_content"]))
        if message["content"]:
            output.append(message_item(_item_id("msg"), message["content"], status))
        output += [function_call_item(_item_id("fc"), call["id"], call["function"]["name"],
                                      call["function"]["arguments"], "completed")
                   for call in message.get("tool_calls", [])]
        tokens = reasoning_token_count(self.tokenizer, c.token_ids, bool(message.get("reasoning_content")))
        return self.response(status, output, final, tokens, incomplete)

    async def events(self, streams, on_done) -> AsyncIterator[str]:
        """The response as events; `on_done(response)` (the store, which sets its `store`) runs before the
        last event is sent."""
        stream = self._stream
        yield stream.event("response.created", response=self.response("in_progress", []))
        yield stream.event("response.in_progress", response=self.response("in_progress", []))
        final, tokens = None, []
        async for _, out in served_outputs(streams):
            [c] = out.outputs
            tokens += c.token_ids
            for event in stream.feed(c):
                yield event
            if out.finished:
                final = out
        status, incomplete = _status(stream.finish)
        has_reasoning = any(item["type"] == "reasoning" for item in stream.output)
        response = self.response(status, stream.output, final,
                                 reasoning_token_count(self.tokenizer, tokens, has_reasoning), incomplete)
        on_done(response)
        yield stream.event("response.completed" if status == "completed" else "response.incomplete",
                           response=response)

    def error_event(self, error: APIError) -> str:
        """The stream's last event when the request fails on the way (sse_response's error_event)."""
        body = error.body()["error"]
        return self._stream.event("error", code=body["code"] or str(error.status), message=body["message"],
                                  param=body["param"], error=body)


class _EventStream:
    """The events of one response: items opened and closed as the reply's pieces come."""

    def __init__(self, plan: ChatPlan):
        self.plan = plan
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # items so far (an open one holds its text so far)
        self.open: Optional[dict[str, Any]] = None
        self.finish: Optional[str] = None  # the chat finish reason once done
        self.reader = plan.streamer()

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def feed(self, c: CompletionOutput) -> list[str]:
        done = fmt.finish_reason(c)
        reasoning, text, calls = self.reader.feed(c.text, done)
        events = self._reasoning(reasoning) + self._text(text)
        for d in calls:
            events += self._call(d)
        if done:
            called = any(item["type"] == "function_call" for item in self.output)
            self.finish = "tool_calls" if done == "stop" and called else done
            events += self._close()
        return events

    def _opened(self, item: dict[str, Any]) -> list[str]:
        events = self._close()
        self.open = item
        self.output.append(item)
        added = {**item, "status": "in_progress"} if "status" in item else item
        return events + [self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = [] if self.open and self.open["type"] == "reasoning" else self._opened(reasoning_item(_item_id("rs"), ""))
        self.open["content"][0]["text"] += delta
        return events + [self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta)]

    def _text(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = []
        if not (self.open and self.open["type"] == "message"):
            events = self._opened(message_item(_item_id("msg"), "", "in_progress"))
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=_text_part("")))
        self.open["content"][0]["text"] += delta
        return events + [self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                    logprobs=[])]

    def _call(self, d) -> list[str]:
        events = []
        if d.id is not None:  # a new call: its id and name come first
            events = self._opened(function_call_item(_item_id("fc"), d.id, d.name, "", "in_progress"))
        if not d.arguments:
            return events
        self.open["arguments"] += d.arguments
        return events + [self.event("response.function_call_arguments.delta", **self._where(), delta=d.arguments)]

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        if item["type"] == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0,
                                 text=item["content"][0]["text"])]
        elif item["type"] == "message":
            item["status"] = "completed" if self.finish in (None, "stop", "tool_calls") else "incomplete"
            part = item["content"][0]
            events = [self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            item["status"] = "completed"
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=item["arguments"])]
        return events + [self.event("response.output_item.done", **where, item=item)]
