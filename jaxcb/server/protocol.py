"""OpenAI request bodies -- from HTTP, or a JSONL job record, which takes the same fields -- parsed
into the engine's terms, and OpenAI-style errors.

This module reads the wire format only: types are strict (a string where a number belongs is
refused, not coerced) and unknown fields are refused by name. It checks no range: every range
is `SamplingParams`'s and every engine limit `jaxcb.validation`'s, so that HTTP, jobs and
`LLM.generate` give the same answer. Every refusal is an `InvalidRequestError` naming its field.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxcb.errors import InvalidRequestError
from jaxcb.request_fields import check_fields
from jaxcb.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from jaxcb.sampling_params import SamplingParams


def served_model_name(cfg) -> str:
    """The model name requests must give (`model`): server.served_model_name, else the preset's name,
    else (model=hf) the checkpoint's folder."""
    if cfg.server.served_model_name:
        return cfg.server.served_model_name
    if cfg.model.name == "hf" and cfg.model.checkpoint:
        return os.path.basename(os.path.normpath(cfg.model.checkpoint))
    return cfg.model.name


class APIError(Exception):
    """An error response: HTTP status + OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, type: str = "invalid_request_error",
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # Unknown fields were refused or dropped by name before validation (parse_request,
    # jaxcb.request_fields); "forbid" is the backstop.
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far (with include_usage)


class _SamplingFields(_Strict):
    model: str
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    # extra sampling fields of the engine (as vLLM accepts them)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's field)
    return_token_ids: bool = False  # the prompt's and each choice's token ids beside the text (vLLM's field)
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: only the prompt's last k tokens (-1: engine.max_model_len)
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    priority: int = 0
    # vLLM's: the tenant's salt; only requests with the same salt share cached prefix blocks
    cache_salt: Optional[str] = None
    timeout: Optional[Union[int, float]] = None  # seconds: end with what it has by then (never past server.request_timeout_s)
    # constraints (jaxcb.structured): vLLM's structured_outputs, and the token-level fields
    structured_outputs: Optional[dict[str, Any]] = None
    logit_bias: Optional[dict[str, Union[int, float]]] = None  # token id (as a string, as OpenAI sends it) -> bias
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: each prompt token's logprob and the top-n at its place
    request_id: Optional[str] = None  # vLLM's: the response's id is "cmpl-"/"chatcmpl-" + this (X-Request-Id wins)
    use_beam_search: bool = False  # vLLM's: n beams ranked by the model's log-probabilities (jaxcb.beam_search)
    length_penalty: float = 1.0  # beam search's: a beam's score divides by its length ** length_penalty


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = None  # null: 16 (OpenAI's), at most the model's max_new_tokens
    logprobs: Optional[int] = None
    echo: bool = False  # the prompt comes back before the completion (with its logprobs when logprobs is set)
    add_special_tokens: bool = True  # false: a text prompt is encoded without the tokenizer's BOS (vLLM's field)


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCallMessage(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None  # null only in an assistant turn with tool_calls
    name: Optional[str] = None  # passed to the chat template with the message
    tool_calls: Optional[list[ToolCallMessage]] = None  # an assistant turn's calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers


class FunctionDefinition(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None  # null: true, as OpenAI
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra variables for the chat template
    documents: Optional[list[dict[str, str]]] = None  # RAG documents for a template that renders them (vLLM's)
    echo: bool = False  # vLLM's: the reply's content starts with the last message's, when that is the reply's role
    reasoning_effort: Optional[Literal["minimal", "low", "medium", "high"]] = None  # for a template that reads it
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message


def _known_fields(body: dict[str, Any], cls: type[_Strict]) -> dict[str, Any]:
    """The body with ignored fields dropped; InvalidRequestError naming a field jaxcb does not honour."""
    body = check_fields(body, frozenset(cls.model_fields))
    if isinstance(body.get("messages"), list):
        body["messages"] = [
            check_fields(m, frozenset(ChatMessage.model_fields), f"messages.{i}.") if isinstance(m, dict) else m
            for i, m in enumerate(body["messages"])
        ]
    if isinstance(body.get("stream_options"), dict):
        body["stream_options"] = check_fields(body["stream_options"], frozenset(StreamOptions.model_fields),
                                              "stream_options.")
    return body


def parse_request(cls: type[_Strict], body: Any) -> Any:
    """`body` (a decoded JSON object) as a `cls`, or InvalidRequestError naming the first field at fault."""
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    body = _known_fields(body, cls)
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not _is_union_member(p)) or None
        parts = param.split(".") if param else []
        forms = _ACCEPTED_FORMS.get(cls.__name__, {})
        name = next((p for p in (parts[:1] + parts[-1:]) if p in forms), None)
        if name is not None:  # a union's error names only the member pydantic tried last
            raise InvalidRequestError(f"{param}: {err['msg']}; {name} takes {forms[name]}", param) from None
        raise InvalidRequestError(f"{param}: {err['msg']}" if param else err["msg"], param) from None


# Per request type, the fields whose type is a union: what each takes, for a refusal's message.
_STOP, _TIMEOUT = "a string or a list of strings", "a number of seconds (an integer or a float)"
_ACCEPTED_FORMS = {
    "CompletionRequest": {
        "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
        "stop": _STOP, "timeout": _TIMEOUT},
    "ChatCompletionRequest": {
        "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "stop": _STOP, "timeout": _TIMEOUT, "content": "a string or a list of text parts"},
    "ResponsesRequest": {
        "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        "input": "a string or a list of input items (messages, function calls and their outputs)",
        "content": "a string or a list of content parts"},
}


def _is_union_member(loc_part: Any) -> bool:
    """Pydantic's error path names the member of a Union it tried ("stop.list[str].0"); a body has no such field."""
    return isinstance(loc_part, str) and (loc_part in ("str", "int", "float", "bool") or "[" in loc_part
                                          or loc_part[:1].isupper())


def sampling_params(req: _SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                    structured_outputs=None, defaults: SamplingDefaults = NO_DEFAULTS) -> SamplingParams:
    """The engine's SamplingParams for a request body: its fields under the engine's names (null: the
    model's default in `defaults`, else jaxcb's), every range checked by SamplingParams itself.
    `structured_outputs`: the request's spec (jaxcb.structured), already read from its fields."""
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and logprobs is not None and isinstance(logprobs, int):
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)  # the echoed prompt carries logprobs too
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens if max_tokens is not None else defaults.left_out_max_tokens(16),
        min_tokens=req.min_tokens,
        temperature=defaults.fill("temperature", req.temperature, 1.0),
        top_k=defaults.fill("top_k", req.top_k, 0),
        top_p=defaults.fill("top_p", req.top_p, 1.0),
        min_p=defaults.fill("min_p", req.min_p, 0.0),
        repetition_penalty=defaults.fill("repetition_penalty", req.repetition_penalty, 1.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=stop,
        include_stop_str_in_output=req.include_stop_str_in_output,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs,
        structured_outputs=structured_outputs,
        logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=list(req.bad_words or []),
        prompt_logprobs=prompt_logprobs,
    )


_TEXT_PART_FIELDS = frozenset({"type", "text"})


def message_text(message: ChatMessage, where: str = "messages") -> Optional[str]:
    """The message's text; `where` is its path ("messages.2") for a refusal naming the part at fault."""
    if message.content is None or isinstance(message.content, str):
        return message.content
    parts = []
    for j, part in enumerate(message.content):
        at = f"{where}.content.{j}"
        kind = part.get("type")
        if kind == "text":
            check_fields(part, _TEXT_PART_FIELDS, f"{at}.")  # a key it carries besides these would be dropped
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{at}.text must be a string (a text part is {{'type': 'text', 'text': ...}})",
                                          f"{at}.text")
            parts.append(part["text"])
            continue
        what = "images are" if kind in ("image_url", "image", "input_image") else f"a content part of type {kind!r} is"
        raise InvalidRequestError(f"{at}: {what} not supported: jaxcb serves text models (of a multimodal checkpoint "
                                  f"such as Gemma 3's, the text tower); only text content parts ({{'type': 'text', "
                                  f"'text': ...}}) are", at)
    return "".join(parts)
