"""What a request asks of generation: how to sample and when to stop. Plain data, checked on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from jaxcb.errors import InvalidRequestError

if TYPE_CHECKING:
    from jaxcb.structured.spec import StructuredOutputs

MAX_LOGIT_BIAS = 100.0  # |value| of a logit_bias entry at most, as OpenAI allows


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    max_tokens: int = 16  # generated tokens at most
    min_tokens: int = 0  # EOS and stop tokens are ignored until this many are generated
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; >1 discourages tokens of the prompt and output (HF rule)
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: Optional[int] = None  # same seed -> same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # also return the top-n log-probabilities of each chosen token
    # Constraints, all through the step's token bitmask (jaxcb.structured) or its sparse bias list.
    # output must match this: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} (or a spec)
    structured_outputs: Optional["StructuredOutputs"] = None
    allowed_token_ids: Optional[list[int]] = None  # only these tokens may be generated
    bad_words: list[str] = field(default_factory=list)  # never generated (a word's last token banned after the rest)
    logit_bias: Optional[dict[int, float]] = None  # token id -> value in [-100, 100] added to its logit
    prompt_logprobs: Optional[int] = None  # also the logprob of every prompt token (and the top-n at each position)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):  # vLLM's form: {"json": schema} / regex / choice / grammar
            from jaxcb.structured.spec import from_structured_outputs

            self.structured_outputs = from_structured_outputs(self.structured_outputs)

        checks = [
            (self.n >= 1, f"n={self.n} must be >= 1"),
            (self.max_tokens >= 1, f"max_tokens={self.max_tokens} must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0"),
            (self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]"),
            (0 <= self.min_p <= 1, f"min_p={self.min_p} must be in [0, 1]"),
            (self.repetition_penalty > 0, f"repetition_penalty={self.repetition_penalty} must be > 0"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty={self.presence_penalty} must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs={self.logprobs} must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs={self.prompt_logprobs} must be >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "allowed_token_ids must not be empty (null allows every token)"),
            (all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words must be non-empty strings"),
            (all(math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS for v in (self.logit_bias or {}).values()),
             f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

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
