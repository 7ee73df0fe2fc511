"""Engine outputs -> OpenAI response objects (completions and chat, whole and streamed)."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from jaxcb.outputs import CompletionOutput
from jaxcb.tokenizer import Tokenizer


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def finish_reason(c: CompletionOutput) -> Optional[str]:
    return c.finish_reason if c.finish_reason in ("stop", "length", "timeout") else (c.finish_reason and "abort")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: Optional[int] = None) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens: prompt tokens whose K/V came from the prefix cache; reasoning_tokens
    (chat replies read by a reasoning parser): completion tokens up to the one that closes the reasoning."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def token_label(tok: Tokenizer, token: int, as_id: bool = False) -> str:
    """How logprobs name a token: its text (a special token by its name), or with vLLM's
    return_tokens_as_token_ids "token_id:N", which says which token even where texts coincide."""
    return f"token_id:{token}" if as_id else tok.decode([token], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, c: CompletionOutput, start: int, text_offset: int,
                        skip_special_tokens: bool = True, as_ids: bool = False) -> dict[str, Any]:
    """Legacy completions logprobs for tokens start..: tokens, token_logprobs, top_logprobs, text_offset.
    A token's string names a special token always (`token_label`); its offset advances by what it puts in
    the text, which holds special tokens only with skip_special_tokens=false."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token, lps in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        tokens.append(token_label(tok, token, as_ids))
        token_lps.append(lps.get(token))
        tops.append({token_label(tok, t, as_ids): lp for t, lp in lps.items()})
        offsets.append(offset)
        offset += len(tok.decode([token], skip_special_tokens=skip_special_tokens))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(tok: Tokenizer, out) -> list[Optional[dict[str, Any]]]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, decoded_token}}
    (keyed by id already: return_tokens_as_token_ids leaves them as they are, as in vLLM)."""
    return [None if entry is None else {
        str(t): {"logprob": lp, "decoded_token": tok.decode([t], skip_special_tokens=False)} for t, lp in entry.items()
    } for entry in out.prompt_logprobs]


def echo_output(tok: Tokenizer, out, c: CompletionOutput, skip_special_tokens: bool = True) -> CompletionOutput:
    """The request's prompt as a completion's leading part (echo): its text, tokens and, when computed, logprobs.
    With skip_special_tokens=false the text is the prompt's tokens decoded with their special tokens (a BOS the
    tokenizer added shows), as the completion's own text keeps them."""
    if skip_special_tokens:
        text = out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)
    else:
        text = tok.decode(out.prompt_token_ids, skip_special_tokens=False)
    logprobs = None
    if out.prompt_logprobs is not None:
        logprobs = [entry or {} for entry in out.prompt_logprobs]  # the first token has none
    return CompletionOutput(c.index, text, list(out.prompt_token_ids), None, logprobs)


def chat_logprobs(tok: Tokenizer, c: CompletionOutput, start: int, top_n: int, as_ids: bool = False) -> dict[str, Any]:
    content = []
    for token, lps in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        def entry(t, lp):
            text = token_label(tok, t, as_ids)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(dict(entry(token, lps.get(token)), top_logprobs=[entry(t, lp) for t, lp in top]))
    return {"content": content}


def completion_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                        cached_tokens: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chat_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int = 0, reasoning_tokens: Optional[int] = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}


def completion_chunk(rid: str, model: str, created: int, choices: list[dict], usage_: Optional[dict] = None) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(rid: str, model: str, created: int, choices: list[dict], usage_: Optional[dict] = None) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk
