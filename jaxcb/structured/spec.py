"""What a request asks its output to match: the one `StructuredOutputs` spec behind every API form.

Chat's `response_format` (`json_object`, `json_schema` with `strict`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) on both endpoints
and in job records, and the tool-call grammars of `tool_choice` all become one spec: a kind,
its text, and the request field it came from (so that a grammar that does not compile is a
400 naming that field). Plain data and request checks only: no llguidance, no jax.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

from jaxcb.request_fields import RefusedFieldError

Kind = Literal["json", "regex", "choice", "grammar", "lark"]

# vLLM's structured_outputs keys: the ones that choose a grammar, and the options jaxcb takes at its own value.
GRAMMAR_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS_AT_JAXCB_VALUE = {
    # JSON is always compact (single separators, no free whitespace): a bounded schema then
    # finishes in bounded tokens even on a random model.
    "disable_any_whitespace": (True,),
    "disable_fallback": (True, False),  # there is one backend and nothing to fall back to
    "disable_additional_properties": (False,),
}
_NOT_SUPPORTED_OPTIONS = {
    "structural_tag": "structural_tag is not supported; use tools with tool_choice, or a grammar",
    "whitespace_pattern": "whitespace_pattern is not supported: JSON output is always compact",
    "backend": "a per-request grammar backend is not supported (jaxcb uses llguidance)",
}


@dataclass(frozen=True)
class ReasoningGate:
    """Where a reply's reasoning ends, for a grammar that holds only the answer after it: the grammar starts
    after the token `end_token_id` (`</think>` as one token of the vocabulary). `inside`: the reply starts
    inside its reasoning; else, when `open_token_id` is given, a reply whose first token it is reasons first."""
    end_token_id: int
    inside: bool
    open_token_id: Optional[int] = None


@dataclass(frozen=True)
class StructuredOutputs:
    kind: Kind  # json: a JSON schema; regex; choice: a JSON list of strings; grammar: EBNF/GBNF or Lark; lark: llguidance Lark
    text: str  # the schema / regex / grammar as text (the cache key with `kind`)
    field: str  # the request field it came from, named in errors (e.g. "response_format.json_schema.schema")
    # Set by the server's reasoning parser: the grammar holds only what follows the reasoning (not part of the
    # compile key: the same grammar serves both).
    after_reasoning: Optional[ReasoningGate] = None


class StructuredOutputsError(RefusedFieldError):
    """A structured-outputs request that cannot be honoured; `field` names where."""


# OpenAI's rule for the name of a function (a tool) or of a response format's JSON schema.
OPENAI_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _fail(message: str, field: str) -> StructuredOutputsError:
    return StructuredOutputsError(f"{field}: {message}", field)


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: an object schema that does not say otherwise allows no other properties
    (a copy; the schema given is not changed)."""
    if isinstance(schema, dict):
        out = {k: strict_schema(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    return schema


def _schema_text(schema: Any, field: str, strict: bool = False) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _fail(f"is not a valid JSON schema (not JSON: {e})", field) from None
    if not isinstance(schema, dict):
        raise _fail(f"must be a JSON schema object, not {type(schema).__name__}", field)
    if strict:
        schema = strict_schema(schema)
    return json.dumps(schema, ensure_ascii=False)


JSON_OBJECT_SCHEMA = '{"type": "object"}'


def from_response_format(value: Any) -> Optional[StructuredOutputs]:
    """OpenAI's chat `response_format`: text (None), json_object, or json_schema (with `strict`)."""
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _fail("must be an object with a 'type' of text, json_object or json_schema", field)
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise _fail(f"has fields jaxcb does not know: {sorted(extra)}", field)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json", JSON_OBJECT_SCHEMA, field)
    if kind != "json_schema":
        raise _fail(f"type={kind!r} is not supported; use text, json_object or json_schema", f"{field}.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _fail("json_schema must be an object with a name, and a schema (none: any JSON object)",
                    f"{field}.json_schema")
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise _fail(f"has fields jaxcb does not know: {sorted(extra)}", f"{field}.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not OPENAI_NAME.fullmatch(name):
        raise _fail(f"must be 1-64 letters, digits, '_' or '-', not {name!r}", f"{field}.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _fail("must be true, false or null", f"{field}.json_schema.strict")
    if "schema" not in spec:  # OpenAI: no schema means any JSON object
        return StructuredOutputs("json", JSON_OBJECT_SCHEMA, f"{field}.json_schema")
    return StructuredOutputs("json", _schema_text(spec["schema"], f"{field}.json_schema.schema", bool(strict)),
                             f"{field}.json_schema.schema")


def from_structured_outputs(value: Any, field: str = "structured_outputs") -> Optional[StructuredOutputs]:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(value, dict):
        raise _fail("must be an object with one of " + ", ".join(GRAMMAR_KEYS), field)
    for key, v in value.items():
        if key in GRAMMAR_KEYS:
            continue
        if key in _NOT_SUPPORTED_OPTIONS:
            raise _fail(_NOT_SUPPORTED_OPTIONS[key], f"{field}.{key}")
        if key in _OPTIONS_AT_JAXCB_VALUE:
            if not any(v == a and type(v) is type(a) for a in _OPTIONS_AT_JAXCB_VALUE[key]):
                raise _fail(f"{key}={v!r} is not supported (jaxcb's value: "
                            f"{_OPTIONS_AT_JAXCB_VALUE[key][0]!r})", f"{field}.{key}")
            continue
        raise _fail(f"{key} is not a field jaxcb knows; use one of {', '.join(GRAMMAR_KEYS)}", f"{field}.{key}")
    given = [k for k in GRAMMAR_KEYS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise _fail(f"gives {', '.join(given)}; give exactly one", field)
    if not given:
        raise _fail("gives none of " + ", ".join(GRAMMAR_KEYS) + "; give exactly one", field)
    key = given[0]
    v, where = value[key], f"{field}.{key}"
    if key == "json":
        return StructuredOutputs("json", _schema_text(v, where), where)
    if key == "json_object":
        if v is not True:
            raise _fail("must be true", where)
        return StructuredOutputs("json", JSON_OBJECT_SCHEMA, where)
    if key == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise _fail("must be a non-empty list of non-empty strings", where)
        return StructuredOutputs("choice", json.dumps(v, ensure_ascii=False), where)
    if not isinstance(v, str) or not v:
        raise _fail("must be a non-empty string", where)
    return StructuredOutputs("regex" if key == "regex" else "grammar", v, where)
