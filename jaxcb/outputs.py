"""What generation returns: plain data, one `RequestOutput` per request (with n completions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str  # of a delta output: the new text only
    token_ids: list[int]  # of a delta output: the new tokens only
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"; None while running
    logprobs: Optional[list[dict[int, float]]] = None  # per token: {token id: logprob} (chosen + top-n)
    num_generated: int = 0  # tokens this completion has generated so far, whatever the output kind

    def followed_by(self, later: "CompletionOutput") -> "CompletionOutput":
        """This delta with a later delta of the same completion appended."""
        logprobs = None if later.logprobs is None else (self.logprobs or []) + later.logprobs
        return CompletionOutput(later.index, self.text + later.text, self.token_ids + later.token_ids,
                                later.finish_reason, logprobs, later.num_generated)


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
    # True: each completion's text, token_ids and logprobs are only what is new since the request's
    # previous output (OutputKind.DELTA); False: everything so far.
    delta: bool = False

    def merged(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by a later one of the same request: a delta appended, a cumulative one
        taken as it is (how a consumer of deltas rebuilds the whole output)."""
        if not later.delta:
            return later
        by_index = {c.index: c for c in self.outputs}
        outputs = [by_index[c.index].followed_by(c) if c.index in by_index else c for c in later.outputs]
        return RequestOutput(later.request_id, later.prompt, later.prompt_token_ids, outputs, later.finished,
                             later.metrics, delta=False)
