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
    cumulative_logprob: Optional[float] = None  # a beam's (jaxcb.beam_search): the sum its ranking read; else None

    def followed_by(self, later: "CompletionOutput") -> "CompletionOutput":
        """This delta with a later delta of the same completion appended."""
        logprobs = None if later.logprobs is None else (self.logprobs or []) + later.logprobs
        return CompletionOutput(later.index, self.text + later.text, self.token_ids + later.token_ids,
                                later.finish_reason, logprobs, later.num_generated, later.cumulative_logprob)


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
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (first admission)
    # prompt_logprobs: per prompt token, {its id: logprob, top-n ids: logprobs}; None for the first token
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None


def join_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One request's DELTA outputs, in order, as one whole output (a cumulative one is taken as it is).
    Pieces are joined once at the end: rebuilding the whole after every delta would cost O(L^2)."""
    last = outputs[-1]
    if not last.delta:
        return last
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    lps: dict[int, list] = {}
    for out in outputs:
        for c in out.outputs:
            texts.setdefault(c.index, []).append(c.text)
            ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs)
    completions = [CompletionOutput(c.index, "".join(texts[c.index]), ids[c.index], c.finish_reason,
                                    lps.get(c.index) if c.logprobs is not None else None, c.num_generated,
                                    c.cumulative_logprob)
                   for c in last.outputs]
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, completions, last.finished,
                         last.metrics, delta=False, num_cached_tokens=last.num_cached_tokens,
                         prompt_logprobs=last.prompt_logprobs)
