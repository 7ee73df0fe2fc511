"""`POST /tokenize` and `POST /detokenize` in vLLM's shape.

/tokenize takes a `prompt` (encoded as /v1/completions encodes it: with the tokenizer's special
tokens unless `add_special_tokens: false`) or chat `messages` (rendered by `chat.plan_chat`, the
path /v1/chat/completions takes, tools and template variables included), so that its `count`
is the `prompt_tokens` the server counts for the same request. /detokenize turns token ids back
into text. Both read their bodies with the protocol's strict models: unknown fields are refused
by name. No jax.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from jaxcb.errors import InvalidRequestError
from jaxcb.server.chat import plan_chat
from jaxcb.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    ToolDefinition,
    _Strict,
    parse_request,
)
from jaxcb.server.tool_parsers import ToolParser
from jaxcb.tokenizer import Tokenizer


class TokenizeCompletionRequest(_Strict):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions encodes a text prompt
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: Optional[str] = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Chat templates write their own special tokens, so nothing is added (true is refused, as in chat).
    add_special_tokens: Literal[False] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


def parse_tokenize_request(body: Any) -> Union[TokenizeCompletionRequest, TokenizeChatRequest]:
    """A /tokenize body: `prompt` or `messages`, not both; InvalidRequestError naming the field at fault."""
    if isinstance(body, dict) and "prompt" in body and "messages" in body:
        raise InvalidRequestError("give prompt or messages, not both", "messages")
    if isinstance(body, dict) and "prompt" not in body and "messages" not in body:
        raise InvalidRequestError("give prompt (text) or messages (a chat) to tokenize", "prompt")
    kind = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
    return parse_request(kind, body)


def tokenize(req: Union[TokenizeCompletionRequest, TokenizeChatRequest], tokenizer: Tokenizer, parser: ToolParser,
             max_model_len: int, tool_prompt_fallback: bool) -> dict[str, Any]:
    """vLLM's /tokenize response: `tokens`, `count`, `max_model_len`, and `token_strs` when asked for."""
    if isinstance(req, TokenizeChatRequest):
        chat = ChatCompletionRequest.model_validate({
            "model": req.model or "", "messages": req.messages, "tools": req.tools, "tool_choice": req.tool_choice,
            "chat_template_kwargs": req.chat_template_kwargs, "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
        })
        ids = plan_chat(chat, tokenizer, parser, tool_prompt_fallback).prompt_ids
    else:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, tokenizer: Tokenizer) -> dict[str, Any]:
    """vLLM's /detokenize response: `prompt`, the ids' text (special tokens kept, as vLLM decodes them)."""
    for i, t in enumerate(req.tokens):
        if not 0 <= t < tokenizer.vocab_size:
            raise InvalidRequestError(f"tokens.{i}={t} is not a token id of this model (0 to {tokenizer.vocab_size - 1})",
                                      f"tokens.{i}")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
