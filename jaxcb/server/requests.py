"""A completions or chat body in the engine's terms: the one path that HTTP requests and JSONL job
records share, so that the same field with the same value gets the same answer from both (and from
`LLM.generate`, which starts at `SamplingParams`).

body -> `protocol.parse_request` (wire types, unknown fields refused) -> `plan_completion` /
`plan_chat_completion` (prompts, constraints, chat template, tools) -> `SamplingParams` (every
range) -> `Engine.add_request` (`jaxcb.validation`: every engine limit). Each step raises
`InvalidRequestError` naming the field; `PlannedRequest.body_field` turns the engine's name for
a field back into the body's (chat's `top_logprobs` is the engine's `logprobs`). No jax.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from jaxcb.beam_search import BeamSearchParams
from jaxcb.errors import InvalidRequestError
from jaxcb.prompts import EncodedText, encode_text, tokens_to_keep
from jaxcb.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.chat import ChatPlan, plan_chat
from jaxcb.server.protocol import ChatCompletionRequest, CompletionRequest, sampling_params
from jaxcb.server.reasoning import ReasoningParser
from jaxcb.server.tool_parsers import ToolParser
from jaxcb.structured.spec import StructuredOutputs, from_structured_outputs
from jaxcb.tokenizer import Tokenizer

Prompt = Union[str, list[int], EncodedText]


@dataclass
class PlannedRequest:
    prompts: list[Prompt]  # one engine request each (a completions body may carry several)
    params: SamplingParams
    priority: int = 0
    cache_salt: Optional[str] = None
    timeout: Optional[float] = None  # the body's own deadline in seconds, if it gave one
    chat: Optional[ChatPlan] = None  # a chat request's plan: how tool calls are read back out of the reply
    renamed_fields: dict[str, str] = field(default_factory=dict)  # the engine's field name -> the body's
    model: Optional[str] = None  # the body's `model`: the base model's name or a LoRA adapter's (Engine.add_request's lora)
    beam: Optional[BeamSearchParams] = None  # use_beam_search: each prompt is beam-searched (jaxcb.beam_search)

    def body_field(self, name: Optional[str]) -> Optional[str]:
        return self.renamed_fields.get(name, name) if name is not None else None

    def refusal(self, error: InvalidRequestError) -> InvalidRequestError:
        """`error` (from the engine) naming the body's field rather than the engine's."""
        return _renamed(error, self.renamed_fields)


def _renamed(error: InvalidRequestError, renamed: dict[str, str]) -> InvalidRequestError:
    if error.field not in renamed:
        return error
    name = renamed[error.field]
    return InvalidRequestError(str(error).replace(error.field, name), name)


def _prompts(prompt: Any) -> list[Prompt]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidRequestError("prompt is empty; give a non-empty string or list of token ids", "prompt")
    return prompts


def _check_timeout(timeout: Optional[float]) -> None:
    if timeout is None:
        return
    try:
        seconds = float(timeout)
    except OverflowError:  # an integer past float's range
        seconds = math.inf
    if not 0 < seconds < math.inf:
        shown = repr(timeout) if len(repr(seconds)) < 30 and seconds < math.inf else "a number that large"
        raise InvalidRequestError(f"timeout={shown} must be a finite number of seconds > 0", "timeout")


def _check_stream_options(req: Union[CompletionRequest, ChatCompletionRequest]) -> None:
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM answer it
        raise InvalidRequestError("stream_options applies to a streamed response only; set stream=true or drop "
                                  "stream_options", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats and \
            not req.stream_options.include_usage:  # vLLM ignores it then
        raise InvalidRequestError("stream_options.continuous_usage_stats adds usage to every chunk of a stream that "
                                  "reports it: set stream_options.include_usage=true too",
                                  "stream_options.continuous_usage_stats")


# What beam search reads of a body (with temperature 0 or left out): any other field set to other than its
# default is refused by name, never dropped (vLLM's beam search ignores the sampling fields).
BEAM_SEARCH_FIELDS = frozenset({
    "id", "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "use_beam_search",
    "length_penalty", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stream", "stream_options",
    "echo", "add_special_tokens", "truncate_prompt_tokens", "priority", "cache_salt", "timeout", "request_id",
    "return_token_ids", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "documents",
    "reasoning_effort", "add_generation_prompt", "continue_final_message"})


def _beam_search(req: Union[CompletionRequest, ChatCompletionRequest], params: SamplingParams,
                 structured_from: Optional[str] = None) -> Optional[BeamSearchParams]:
    """The body's beam search (use_beam_search), or None; InvalidRequestError naming a field it would not
    honour. `structured_from`: the field a grammar came from other than structured_outputs (chat's tool_choice)."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise InvalidRequestError(f"length_penalty={req.length_penalty} applies to beam search; set "
                                      "use_beam_search=true, or drop length_penalty", "length_penalty")
        return None
    for name in sorted(req.model_fields_set - BEAM_SEARCH_FIELDS):
        value, default = getattr(req, name), type(req).model_fields[name].default
        if (name == "temperature" and value == 0) or (value == default and type(value) is type(default)) or \
                (name == "response_format" and value == {"type": "text"}):
            continue
        raise InvalidRequestError(f"{name} is not used by beam search, which ranks beams by the model's "
                                  f"log-probabilities alone: drop {name}, or drop use_beam_search", name)
    if structured_from is not None:
        raise InvalidRequestError(f"{structured_from} constrains the reply to a grammar, which beam search does not "
                                  f"apply: drop {structured_from}, or drop use_beam_search", structured_from)
    return BeamSearchParams(params.n, params.max_tokens, req.length_penalty, params.ignore_eos,
                            params.include_stop_str_in_output, params.skip_special_tokens)


def plan_completion(req: CompletionRequest, defaults: SamplingDefaults = NO_DEFAULTS, *,
                    tokenizer: Optional[Tokenizer] = None) -> PlannedRequest:
    """A /v1/completions body (or a job record with `prompt`) as engine requests; `defaults`: the model's for
    the sampling fields it leaves out (`Engine.sampling_defaults`); `tokenizer` encodes a text prompt sent
    with add_special_tokens=false (otherwise the engine encodes it)."""
    _check_stream_options(req)
    prompts = _prompts(req.prompt)
    if not req.add_special_tokens:
        if tokenizer is None:
            raise ValueError("add_special_tokens=false needs the tokenizer")
        prompts = [encode_text(p, tokenizer, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]
    structured: Optional[StructuredOutputs] = (
        from_structured_outputs(req.structured_outputs) if req.structured_outputs is not None else None)
    _check_timeout(req.timeout)
    params = sampling_params(req, req.max_tokens, req.logprobs, structured, defaults)
    return PlannedRequest(prompts, params, req.priority, req.cache_salt, req.timeout, model=req.model,
                          beam=_beam_search(req, params))


def plan_chat_completion(req: ChatCompletionRequest, tokenizer: Tokenizer, parser: ToolParser, max_model_len: int,
                         tool_prompt_fallback: bool = True, reasoning: Optional[ReasoningParser] = None,
                         structured_in_reasoning: bool = False,
                         defaults: SamplingDefaults = NO_DEFAULTS) -> PlannedRequest:
    """A /v1/chat/completions body (or a job record with `messages`) as one engine request; `reasoning`
    and `structured_in_reasoning` as `chat.plan_chat` takes them; `defaults` as `plan_completion`'s."""
    _check_stream_options(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise InvalidRequestError(f"max_tokens={req.max_tokens} and max_completion_tokens={req.max_completion_tokens} "
                                  "disagree; give one (max_completion_tokens is OpenAI's current name)",
                                  "max_completion_tokens")
    plan = plan_chat(req, tokenizer, parser, tool_prompt_fallback, reasoning, structured_in_reasoning)
    if req.truncate_prompt_tokens is not None:  # the rendered conversation's last tokens, as vLLM cuts it
        plan.prompt_ids = plan.prompt_ids[-tokens_to_keep(req.truncate_prompt_tokens, max_model_len):]
    renamed = {}
    if req.max_completion_tokens is not None:
        max_tokens, renamed["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens = req.max_tokens
    if max_tokens is None:  # as OpenAI: as many as the context leaves
        if len(plan.prompt_ids) >= max_model_len:  # none: the messages are at fault, not a max_tokens never sent
            raise InvalidRequestError(f"the prompt rendered from the messages is {len(plan.prompt_ids)} tokens, which "
                                      f"leaves no room for a reply within engine.max_model_len={max_model_len}; "
                                      "shorten the messages", "messages")
        max_tokens = defaults.left_out_max_tokens(max_model_len - len(plan.prompt_ids))
    if req.structured_outputs is None and plan.structured is not None:  # the grammar came from another field
        json_format = isinstance(req.response_format, dict) and req.response_format.get("type") != "text"
        renamed["structured_outputs"] = "response_format" if json_format else "tool_choice"
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
    top_n = req.top_logprobs or 0
    if req.logprobs:
        renamed["logprobs"] = "top_logprobs"
    _check_timeout(req.timeout)
    # logprobs=true alone is the chosen token's logprob: the engine's logprobs=1 carries it
    logprobs = (max(top_n, 1) if top_n >= 0 else top_n) if req.logprobs else None
    try:
        params = sampling_params(req, max_tokens, logprobs, plan.structured, defaults)
    except InvalidRequestError as e:
        raise _renamed(e, renamed) from None
    if plan.tool_parser is not None and plan.tool_parser.reads_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)  # [TOOL_CALLS] must reach the parser
    structured_from = renamed.get("structured_outputs") if plan.structured is not None else None
    beam = _beam_search(req, params, structured_from)  # (its refusals name the body's fields already)
    return PlannedRequest([plan.prompt_ids], params, req.priority, req.cache_salt, req.timeout, plan, renamed,
                          model=req.model, beam=beam)

