"""What a request's prompt may be: text (encoded with the tokenizer's special tokens, as
transformers' `tokenizer(text)` encodes it and /v1/completions by default), token ids, or
`EncodedText`: text encoded some other way (a completions body's `add_special_tokens: false`),
served as its ids and kept as the request's prompt text (echo gives it back as sent). No jax."""

from __future__ import annotations

import numbers
from collections import abc
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from jaxcb.errors import InvalidRequestError
from jaxcb.request_fields import is_text
from jaxcb.tokenizer import Tokenizer


@dataclass(frozen=True)
class EncodedText:
    text: str
    token_ids: tuple[int, ...]


PromptType = Union[str, abc.Sequence[int], EncodedText]


def encode_text(text: str, tokenizer: Tokenizer, add_special_tokens: bool) -> Union[str, EncodedText]:
    """`text` as the engine takes it: the text itself when the tokenizer's own encoding (with special
    tokens) is wanted, else encoded here without them."""
    if add_special_tokens:
        return text
    _check_text(text)
    return EncodedText(text, tuple(tokenizer.encode(text, add_special_tokens=False)))


def prompt_text_and_ids(prompt: PromptType, tokenizer: Tokenizer) -> tuple[Optional[str], list[int]]:
    """(the prompt's text or None for token ids, its token ids); InvalidRequestError naming `prompt` for
    anything else (bytes iterate as ints: b"hi" would silently run as token ids 104, 105)."""
    if isinstance(prompt, EncodedText):
        return prompt.text, list(prompt.token_ids)
    if isinstance(prompt, str):
        _check_text(prompt)
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple, np.ndarray)) and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        return None, [int(t) for t in prompt]
    raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")


def _check_text(text: str) -> None:
    if not is_text(text):
        raise InvalidRequestError("the prompt holds a lone UTF-16 surrogate, which is not text; send valid Unicode",
                                  "prompt")


def tokens_to_keep(truncate_prompt_tokens: int, max_model_len: int) -> int:
    """vLLM's truncate_prompt_tokens: a prompt's last k tokens (-1: as many as engine.max_model_len)."""
    k = truncate_prompt_tokens
    if k == -1:
        return max_model_len
    if not 1 <= k <= max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens={k} must be -1 (the last engine.max_model_len="
                                  f"{max_model_len} tokens) or from 1 to {max_model_len}", "truncate_prompt_tokens")
    return k


def truncated(prompt: PromptType, text: Optional[str], ids: list[int], keep: int,
              tokenizer: Tokenizer) -> tuple[Optional[str], list[int]]:
    """(text, ids) of the prompt's last `keep` tokens, as vLLM cuts them (its tokenizer truncating on the left):
    a text prompt keeps the special tokens its encoding adds (the BOS) and loses its text's first tokens; token
    ids, and text encoded without specials, lose their first ids. Once cut, no text: echo gives back the text
    of the ids the model read."""
    if len(ids) <= keep:
        return text, ids
    if not isinstance(prompt, str):
        return None, ids[-keep:]
    before, after = _special_tokens_around(tokenizer)  # (the prompt is not encoded again: long, on the engine thread)
    room = keep - before - after
    if room < 1:
        raise InvalidRequestError(f"truncate_prompt_tokens={keep} leaves no room for the prompt's text beside the "
                                  f"{before + after} special tokens its encoding adds", "truncate_prompt_tokens")
    return None, ids[:before] + ids[len(ids) - after - room:]


def _special_tokens_around(tokenizer: Tokenizer) -> tuple[int, int]:
    """How many special tokens the tokenizer's encoding puts before and after a text's own (a BOS: (1, 0)),
    read off a one-character text."""
    full, bare = tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False)
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return i, len(full) - i - len(bare)
    return 0, 0  # specials merged into the text's tokens: nothing to keep apart


def truncated_ids(prompt: PromptType, text: Optional[str], ids: list[int], truncate_prompt_tokens: Optional[int],
                  max_model_len: int, tokenizer: Tokenizer) -> tuple[Optional[str], list[int]]:
    """(text, ids) as SamplingParams.truncate_prompt_tokens cuts them (`truncated`), or as they are without it."""
    if truncate_prompt_tokens is None:
        return text, ids
    return truncated(prompt, text, ids, tokens_to_keep(truncate_prompt_tokens, max_model_len), tokenizer)
