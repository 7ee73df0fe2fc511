"""What a request asks of generation: how to sample and when to stop. Plain data, checked on creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from jaxcb.errors import InvalidRequestError


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
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
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
