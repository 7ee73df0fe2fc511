"""What generation returns: plain data, one `RequestOutput` per request (with n completions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"; None while running
    logprobs: Optional[list[dict[int, float]]] = None  # per token: {token id: logprob} (chosen + top-n)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
