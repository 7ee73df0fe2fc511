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
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "logits_processors": "logits_processors are not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported; send a prompt that fits max_model_len",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported: stop strings are never in the text",
    "spaces_between_special_tokens": "spaces_between_special_tokens is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "add_special_tokens": "add_special_tokens is not supported",
    "chat_template": "a per-request chat_template is not supported; start the server with server.chat_template",
    "documents": "documents are not supported",
    "echo": "echo is supported by /v1/completions only",
    "audio": "audio output is not supported",
    "modalities": "modalities other than text are not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning_effort is not supported by this model",
    "verbosity": "verbosity is not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "kv_transfer_params": "kv_transfer_params (disaggregated serving) is not supported",
    "request_id": "a client-chosen request_id is not supported",
    "continuous_usage_stats": "continuous_usage_stats is not supported; include_usage sends usage in the last chunk",
}
# Fields accepted when their value is what jaxcb does anyway (the OpenAI and vLLM defaults).
HONOURED_VALUES: dict[str, tuple[Any, ...]] = {
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "echo": (False,),
    "best_of": (None, 1),
    "use_beam_search": (False,),
    "add_special_tokens": (False,),
    "return_tokens_as_token_ids": (False,),
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
