"""What a request asks of generation: how to sample and when to stop. Plain data, checked on creation."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from jaxcb.errors import InvalidRequestError
from jaxcb.request_fields import is_text

if TYPE_CHECKING:
    from jaxcb.structured.spec import StructuredOutputs

MAX_LOGIT_BIAS = 100.0  # |value| of a logit_bias entry at most, as OpenAI allows
MAX_TEMPERATURE = 2.0  # as OpenAI allows
MAX_STOP_STRINGS = 16
# Far past any useful value; large enough that the penalty's float math stays finite.
MAX_REPETITION_PENALTY = 1e4


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    max_tokens: int = 16  # generated tokens at most
    min_tokens: int = 0  # EOS and stop tokens are ignored until this many are generated
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 (or -1, vLLM's form): off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; >1 discourages tokens of the prompt and output (HF rule)
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: Optional[int] = None  # same seed -> same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text, unless the next is true)
    include_stop_str_in_output: bool = False  # the text ends with the stop string that ended it (vLLM's field)
    # only the prompt's last k tokens (-1: engine.max_model_len of them); a text prompt keeps its BOS (vLLM's field)
    truncate_prompt_tokens: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # False: special tokens (a Mistral model's [TOOL_CALLS]) are in the text; the EOS or stop token
    # that ends the sequence never is
    skip_special_tokens: bool = True
    logprobs: Optional[int] = None  # also return the top-n log-probabilities of each chosen token
    # Constraints, all through the step's token bitmask (jaxcb.structured) or its sparse bias list.
    # output must match this: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} (or a spec)
    structured_outputs: Optional["StructuredOutputs"] = None
    allowed_token_ids: Optional[list[int]] = None  # only these tokens may be generated
    bad_words: list[str] = field(default_factory=list)  # never generated (a word's last token banned after the rest)
    logit_bias: Optional[dict[int, float]] = None  # token id -> value in [-100, 100] added to its logit
    prompt_logprobs: Optional[int] = None  # also the logprob of every prompt token (and the top-n at each position)

    def __post_init__(self) -> None:
        """Every range of every request field is checked here, once, whichever door the request came
        in by (HTTP, a job record, `LLM.generate`); what depends on the engine is `jaxcb.validation`'s."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1 and type(self.top_k) is int:  # vLLM's "no limit"
            self.top_k = 0
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL) and not _is_int(value):
                raise InvalidRequestError(f"{name}={value!r} must be an integer", name)
            if value is not None:
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_number(value):
                raise InvalidRequestError(f"{name}={value!r} must be a number", name)
            setattr(self, name, float(value))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos={self.ignore_eos!r} must be true or false", "ignore_eos")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequestError(f"include_stop_str_in_output={self.include_stop_str_in_output!r} must be true "
                                      "or false", "include_stop_str_in_output")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequestError(f"skip_special_tokens={self.skip_special_tokens!r} must be true or false",
                                      "skip_special_tokens")
        self.stop = _list_of(self.stop, "stop", lambda s: isinstance(s, str) and s and is_text(s),
                             "a non-empty string of valid Unicode")
        self.stop_token_ids = _list_of(self.stop_token_ids, "stop_token_ids", _is_int, "a token id")
        self.bad_words = _list_of(self.bad_words, "bad_words", lambda w: isinstance(w, str) and w.strip() and is_text(w),
                                  "a non-empty string of valid Unicode")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _list_of(self.allowed_token_ids, "allowed_token_ids", _is_int, "a token id")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):  # vLLM's form: {"json": schema} / regex / choice / grammar
            from jaxcb.structured.spec import from_structured_outputs

            self.structured_outputs = from_structured_outputs(self.structured_outputs)
        elif self.structured_outputs is not None and not hasattr(self.structured_outputs, "kind"):
            raise InvalidRequestError("structured_outputs must be an object such as {\"json\": schema}, "
                                      f"not {type(self.structured_outputs).__name__}", "structured_outputs")

        checks = [
            (self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
             f"truncate_prompt_tokens={self.truncate_prompt_tokens} must be -1 (as many as engine.max_model_len) "
             "or >= 1"),
            (self.n >= 1, "n", f"n={self.n} must be >= 1"),
            (self.max_tokens >= 1, "max_tokens", f"max_tokens={self.max_tokens} must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]"),
            (0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
             f"temperature={self.temperature:g} must be between 0 and {MAX_TEMPERATURE:g} (0: greedy)"),
            (self.top_k >= 0, "top_k", f"top_k={self.top_k} must be >= 1, or 0 or -1 for no limit"),
            (0 < self.top_p <= 1, "top_p", f"top_p={self.top_p:g} must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", f"min_p={self.min_p:g} must be in [0, 1]"),
            (0 < self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
             f"repetition_penalty={self.repetition_penalty:g} must be in (0, {MAX_REPETITION_PENALTY:g}] (1: off)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty={self.presence_penalty:g} must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty={self.frequency_penalty:g} must be in [-2, 2]"),
            (self.seed is None or MIN_SEED <= self.seed <= MAX_SEED, "seed",
             f"seed={_short(self.seed)} must fit in 64 bits: from -2**63 to 2**64 - 1"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", f"logprobs={self.logprobs} must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs={self.prompt_logprobs} must be >= 0"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop",
             f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be >= 0"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
             "allowed_token_ids must not be empty (null allows every token)"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise InvalidRequestError(message, name)
        if self.structured_outputs is not None:
            # A grammar ends the reply where it completes (EOS is all it allows then): it would overrule both.
            source = getattr(self.structured_outputs, "field", None) or "structured_outputs"
            for name, asked in (("min_tokens", self.min_tokens > 0), ("ignore_eos", self.ignore_eos)):
                if asked:
                    raise InvalidRequestError(f"{name} cannot be honoured under a grammar ({source}): the grammar "
                                              f"decides where the reply ends; drop {name}", name)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_token_mask(self) -> bool:
        """Whether some tokens are ruled out by a bitmask (grammar, allowed_token_ids, bad_words)."""
        return self.structured_outputs is not None or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def uses_masked_step(self) -> bool:
        """Whether its rows need the step variant with the token bitmask and logit bias."""
        return self.uses_token_mask or bool(self.logit_bias)

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def sample_seed(seed: int, index: int) -> int:
    """The 64-bit seed of a request's `index`-th sample (`n` > 1): the request's seed (a negative one as
    its two's complement), its low 32 bits stepped by a golden-ratio constant per sample. A seed below
    2**32 draws what it drew when seeds were 32 bits; seeds that differ in any bit draw differently."""
    seed %= 2**64
    return (seed >> 32 << 32) | ((seed + 0x9E3779B1 * index) & 0xFFFFFFFF)


# A seed is a signed or unsigned 64-bit integer, as OpenAI's API and vLLM take it.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1

_INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_OPTIONAL = frozenset({"seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"})
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _is_int(value: Any) -> bool:
    # bool is an int to Python, never to a request: `n: true` is refused, as JSON Schema would.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        return False


_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")  # longer is no token id (and int() refuses past 4,300 digits)


def _short(value: Any) -> str:
    """repr(value), cut to a length a message can hold (a request may send a 4,000-digit number)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a number that large"
    return text if len(text) <= 40 else text[:37] + "..."


def _list_of(value: Any, name: str, ok: Callable[[Any], Any], what: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a list, not {type(value).__name__}", name)
    for i, item in enumerate(value):
        if not ok(item):
            raise InvalidRequestError(f"{name}.{i}={item!r} must be {what}", f"{name}.{i}")
    return [int(v) if _is_int(v) else v for v in value]


def _logit_bias(value: Any) -> dict[int, float]:
    """token id (an int, or its decimal string as OpenAI sends it) -> a bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, not be a {type(value).__name__}",
                                  "logit_bias")
    bias = {}
    for key, v in value.items():
        # ASCII digits only: str.isdigit() and int() also take "²" or a full-width "５"
        if not (_is_int(key) or (isinstance(key, str) and _TOKEN_ID.fullmatch(key))):
            raise InvalidRequestError(f"logit_bias keys must be token ids, not {_short(key)}", "logit_bias")
        if not _is_number(v) or abs(v) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias[{_short(key)}]={_short(v)} must be a number between "
                                      f"-{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}", "logit_bias")
        bias[int(key)] = float(v)
    return bias
