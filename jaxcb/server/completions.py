"""/v1/completions and /v1/chat/completions as the steps that the HTTP handlers and the batch runner
share: a body checked and planned into engine requests (`plan_body`), its grammar compiled off the
engine's thread (`compile_grammar`), and the whole response written from the final outputs
(`response_body`). One path, so that a batch line is served, or refused, exactly as the same body
POSTed to its endpoint would be. No jax.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from jaxcb.errors import InvalidRequestError
from jaxcb.outputs import RequestOutput
from jaxcb.server import openai_format as fmt
from jaxcb.server.chat import assistant_message, reasoning_tokens
from jaxcb.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from jaxcb.server.requests import PlannedRequest, plan_chat_completion, plan_completion
from jaxcb.server.streaming import usage_of

if TYPE_CHECKING:
    from jaxcb.server.app import ServerState

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass
class PlannedBody:
    """A body as the engine will serve it: `req` (the parsed body) and `planned` (its engine requests)."""

    endpoint: str  # COMPLETIONS or CHAT_COMPLETIONS
    req: Union[CompletionRequest, ChatCompletionRequest]
    planned: PlannedRequest

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_COMPLETIONS

    def response_id(self, header: Optional[str] = None) -> tuple[str, str]:
        """The response's id and its base (what follows "cmpl-" or "chatcmpl-"), vLLM's way: the request's
        X-Request-Id header (`header`), else the body's request_id, else a fresh uuid. Ids are the
        client's to keep apart: two requests given one id get responses of one id (the engine's own
        request ids stay unique)."""
        base = header or self.req.request_id or uuid.uuid4().hex
        return f"{'chatcmpl' if self.is_chat else 'cmpl'}-{base}", base


MAX_REQUEST_ID_CHARS = 256


def is_request_id(value: str) -> bool:
    """Whether `value` may name a response: it goes into the response's id and back out in a header, so 1 to
    MAX_REQUEST_ID_CHARS visible ASCII characters."""
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and all("!" <= ch <= "~" for ch in value)


def check_request_id(value: Optional[str]) -> None:
    """A body's request_id (None: not given); InvalidRequestError naming it when no response can be named by it."""
    if value is None or is_request_id(value):
        return
    shown = value if len(value) <= 40 else value[:40] + "..."
    raise InvalidRequestError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters (letters, "
                              f"digits, punctuation; no spaces or control characters), not {shown!r} "
                              f"({len(value)} characters)", "request_id")


def check_model(state: "ServerState", model: str) -> None:
    """The base model's name or a loaded LoRA adapter's; else a 404 naming `model`."""
    if model == state.model_name:
        return
    adapters = state.client.served_adapters()
    if model not in adapters:
        served = ", ".join(repr(n) for n in [state.model_name, *adapters])
        raise APIError(404, f"model {model!r} is not served here; this server serves {served}",
                       param="model", type="not_found_error", code="model_not_found")


def plan_body(state: "ServerState", endpoint: str, body: Any) -> PlannedBody:
    """`body` (decoded JSON) for `endpoint`, checked and planned; InvalidRequestError / APIError naming the field."""
    srv = state.cfg.server
    if endpoint == COMPLETIONS:
        req = parse_request(CompletionRequest, body)
        check_model(state, req.model)
        check_request_id(req.request_id)
        return PlannedBody(endpoint, req, plan_completion(req, state.client.sampling_defaults,
                                                          tokenizer=state.client.tokenizer))
    assert endpoint == CHAT_COMPLETIONS, endpoint
    req = parse_request(ChatCompletionRequest, body)
    check_model(state, req.model)
    check_request_id(req.request_id)
    planned = plan_chat_completion(req, state.client.tokenizer, state.tool_parser(), state.client.max_model_len,
                                   srv.tool_prompt_fallback, state.reasoning_parser,
                                   srv.structured_outputs_in_reasoning, state.client.sampling_defaults)
    return PlannedBody(endpoint, req, planned)


async def compile_grammar(state: "ServerState", planned: PlannedRequest) -> None:
    """Compile the request's grammar off the engine's thread (cached: the engine then finds it compiled);
    a grammar that does not compile, or not in time, is a 400 naming its field and nothing is queued."""
    spec = planned.params.structured_outputs
    grammars = state.client.grammars  # None: Ray replicas compile their own
    if spec is None or grammars is None:
        return
    await asyncio.to_thread(grammars.compile, spec)  # StructuredOutputsError: a 400 naming its field


def request_deadlines(state: "ServerState", timeout: Optional[float], queued: bool = True) -> dict[str, float]:
    """Engine.add_request's timeouts: the smaller of server.request_timeout_s and the request's own
    `timeout` (which may ask for less, never more), and server.max_queue_time_s unless `queued` is
    false (batch work waits for room by design: only its running time is bounded)."""
    srv = state.cfg.server
    if timeout is not None:
        if srv.request_timeout_s is not None and timeout > srv.request_timeout_s:
            raise APIError(400, f"timeout={timeout} is longer than this server allows "
                                f"(server.request_timeout_s={srv.request_timeout_s:g})", param="timeout")
    deadlines = {}
    total = timeout if timeout is not None else srv.request_timeout_s
    if total is not None:
        deadlines["timeout_s"] = float(total)
    if queued and srv.max_queue_time_s is not None:
        deadlines["queue_timeout_s"] = float(srv.max_queue_time_s)
    return deadlines


def response_body(state: "ServerState", rid: str, body: PlannedBody, finals: list[RequestOutput]) -> dict:
    """The whole (non-streamed) response of `body` from its prompts' final outputs."""
    tok, req, choices = state.client.tokenizer, body.req, []
    thought = None  # chat replies read by a reasoning parser: their reasoning tokens, summed
    for p_idx, out in enumerate(finals):
        for c in out.outputs:
            generated = list(c.token_ids)
            if body.is_chat:
                n = reasoning_tokens(body.planned.chat, tok, c.token_ids, c.text)
                thought = None if n is None else (thought or 0) + n
                message, finish = assistant_message(body.planned.chat, c.text, fmt.finish_reason(c))
                if body.planned.chat.echo:
                    message["content"] = body.planned.chat.echo + (message.get("content") or "")
                logprobs = (fmt.chat_logprobs(tok, c, 0, req.top_logprobs or 0, req.return_tokens_as_token_ids)
                            if req.logprobs else None)
                choice = {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            else:
                if req.echo:  # the prompt, then the completion, as one text (and one logprobs list)
                    c = fmt.echo_output(tok, out, c, req.skip_special_tokens).followed_by(c)
                logprobs = (fmt.completion_logprobs(tok, c, 0, 0, req.skip_special_tokens,
                                                    req.return_tokens_as_token_ids)
                            if req.logprobs is not None else None)
                choice = {"index": p_idx * req.n + c.index, "text": c.text, "logprobs": logprobs,
                          "finish_reason": fmt.finish_reason(c)}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = fmt.prompt_logprobs(tok, out)
            if req.return_token_ids:  # vLLM's places: chat's prompt ids beside the choices, a completion's in each
                choice["token_ids"] = generated
                if not body.is_chat:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choices.append(choice)
    if body.is_chat:
        response = fmt.chat_response(rid, req.model, choices, *usage_of(finals), reasoning_tokens=thought)
        if req.return_token_ids:
            response["prompt_token_ids"] = list(finals[0].prompt_token_ids)
        return response
    return fmt.completion_response(rid, req.model, choices, *usage_of(finals))
