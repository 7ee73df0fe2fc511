"""Which request fields jaxcb honours, ignores or refuses: one table for the HTTP API and JSONL jobs.

Fail closed: a field is either implemented (the server's protocol models and the job records
read it), on the short allow-list of OpenAI fields that change nothing about the output
(`IGNORED`, accepted and dropped), or refused with a 400 / an error record whose message names
it. Fields of OpenAI's or vLLM's API that jaxcb does not implement yet are refused with the
reason (`NOT_SUPPORTED`); a few are accepted when their value is what jaxcb does anyway
(`HONOURED_VALUES`, e.g. `skip_special_tokens: true`). Anything else is an unknown field.
No jax.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

from jaxcb.errors import InvalidRequestError

# OpenAI fields that do not change what is generated: accepted and ignored (docs/api.md lists them).
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})

_STRUCTURED = "use structured_outputs (or response_format) instead"
_TOOLS = "use tools and tool_choice instead"
NOT_SUPPORTED: dict[str, str] = {
    "guided_json": "guided_json is vLLM's legacy field, replaced by structured_outputs.json (or response_format)",
    "guided_regex": "guided_regex is vLLM's legacy field, replaced by structured_outputs.regex",
    "guided_choice": "guided_choice is vLLM's legacy field, replaced by structured_outputs.choice",
    "guided_grammar": "guided_grammar is vLLM's legacy field, replaced by structured_outputs.grammar",
    "guided_decoding_backend": "guided_decoding_backend is vLLM's legacy field; " + _STRUCTURED
                               + " (jaxcb uses llguidance)",
    "guided_whitespace_pattern": "guided_whitespace_pattern is vLLM's legacy field; JSON output is always compact",
    "functions": "functions (OpenAI's deprecated form of tools): " + _TOOLS,
    "function_call": "function_call (OpenAI's deprecated form of tool_choice): " + _TOOLS,
    "suffix": "suffix (insertion between a prompt and a suffix) is not supported",
    "best_of": "best_of is not supported; ask for n completions instead",
    "use_beam_search": "beam search is taken by /v1/completions and /v1/chat/completions",
    "length_penalty": "length_penalty applies to beam search, which /v1/completions and /v1/chat/completions take",
    "logits_processors": "logits_processors are not supported",
    "spaces_between_special_tokens": "spaces_between_special_tokens is not supported",
    "add_special_tokens": "add_special_tokens: true is not supported for chat, whose template writes the special "
                          "tokens itself (a second BOS would follow); leave it out",
    "chat_template": "a per-request chat_template is not supported; start the server with server.chat_template",
    "audio": "audio output is not supported",
    "modalities": "modalities other than text are not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "kv_transfer_params": "kv_transfer_params (disaggregated serving) is not supported",
    "request_id": "request_id is taken by /v1/completions and /v1/chat/completions (it names the response); "
                  "a response of /v1/responses is stored under an id jaxcb chooses",
}
# Fields accepted when their value is what jaxcb does anyway (the OpenAI and vLLM defaults).
HONOURED_VALUES: dict[str, tuple[Any, ...]] = {
    "spaces_between_special_tokens": (True,),
    "best_of": (None, 1),
    "use_beam_search": (False,),
    "add_special_tokens": (False,),
    "refusal": (None,),
}


class RefusedFieldError(InvalidRequestError):
    """A request field jaxcb does not honour; `field` is its path (e.g. "messages.0.tool_calls")."""


def check_fields(data: Mapping[str, Any], implemented: frozenset[str] | set[str], where: str = "") -> dict[str, Any]:
    """`data` without the ignored fields; InvalidRequestError naming the first field jaxcb would not honour.
    `where` prefixes the field's path in the message (e.g. "messages.0.")."""
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if key in implemented:
            kept[key] = value
        elif key in IGNORED:
            continue
        elif key in HONOURED_VALUES and _same(value, HONOURED_VALUES[key]):
            continue
        elif key in NOT_SUPPORTED:
            raise RefusedFieldError(f"{where}{key}: {NOT_SUPPORTED[key]}", f"{where}{key}")
        else:
            raise RefusedFieldError(
                f"{where}{key} is not a field jaxcb knows; remove it (known: {', '.join(sorted(implemented))})",
                f"{where}{key}",
            )
    return kept


def _same(value: Any, accepted: tuple[Any, ...]) -> bool:
    # `True == 1` in Python: compare types too, so that best_of=True is not taken for best_of=1.
    return any(value == a and type(value) is type(a) for a in accepted)


def reject_non_finite(constant: str) -> float:
    """`json.loads(parse_constant=...)`: NaN and Infinity are not JSON, and no field takes them."""
    raise InvalidRequestError(f"{constant} is not a valid JSON number; send a finite number")


# A JSON escape of a UTF-16 surrogate (\\uD800-\\uDFFF): the only way a lone surrogate gets into
# parsed text (valid UTF-8 cannot hold one). Pairs combine into one character; a lone one would
# reach the tokenizer, a hash or an output file as a string nothing can encode.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def loads_request(text: str | bytes, repeated_keys: bool = False) -> Any:
    """`json.loads` for a request body, a batch line or a job record. InvalidRequestError with the
    reason for what no request may hold: text that is not JSON, NaN or Infinity, an integer past
    Python's 4,300-digit limit, nesting too deep, a key given twice in one object (JSON keeps the
    last: the others would be dropped silently; `repeated_keys` allows it, for a batch file taken
    before this was refused), or a lone UTF-16 surrogate (with its path)."""
    try:
        data = json.loads(text, parse_constant=reject_non_finite, parse_float=_finite_float,
                          object_pairs_hook=None if repeated_keys else _once_each)
    except InvalidRequestError:
        raise
    except ValueError as e:  # not JSON, not UTF-8, or an integer of more than 4,300 digits
        if "integer string conversion" in str(e):
            raise InvalidRequestError("a number in the JSON has more than 4,300 digits; no field takes one that "
                                      "large") from None
        raise InvalidRequestError(f"not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError("it nests JSON too deeply to be a request") from None
    if _SURROGATE_ESCAPE.search(text if isinstance(text, str) else text.decode("utf-8", "replace")):
        found = _lone_surrogate(data, "")
        if found is not None:
            path, in_key = found
            where = (f" in a key of {path or 'the top-level object'}" if in_key else f" at {path}" if path else "")
            raise InvalidRequestError(f"the JSON holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF){where}, "
                                      "which is not text; send valid Unicode", path or None)
    return data


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) < len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise InvalidRequestError(f"it gives the key {twice!r} more than once in one object; give each key once")
    return data


def _finite_float(literal: str) -> float:
    value = float(literal)  # 1e400 reads as inf: refused as NaN and Infinity are
    if not math.isfinite(value):
        shown = literal if len(literal) <= 24 else literal[:20] + "..."
        raise InvalidRequestError(f"the number {shown} is past the range of a 64-bit float; send a finite number")
    return value


def _lone_surrogate(value: Any, path: str) -> tuple[str, bool] | None:
    """(path, whether in a key) of the first string in `value` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        return None if is_text(value) else (path, False)
    if isinstance(value, dict):
        for key, item in value.items():
            if not is_text(key):
                return path, True
            found = _lone_surrogate(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def is_text(text: str) -> bool:
    """Whether `text` is valid Unicode: no lone surrogate, which UTF-8 (a tokenizer, a hash, a file) cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
