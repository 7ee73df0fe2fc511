"""The output processor: the one owner of per-request output state.

For every request (a group of n sequences) it keeps the detokenizers, the generated tokens
and logprobs, and what has been reported so far. After each step it takes the sequences'
new tokens and

    1. detokenizes them (incrementally; text grows by whole characters),
    2. applies every stop condition in one place -- EOS and stop token ids (after min_tokens),
       max_tokens, max_model_len, stop strings -- and says which sequences finished and why,
    3. emits one `RequestOutput` per request that changed, in the request's `OutputKind`:
       DELTA carries only what is new since the last output (the server's streams, metrics
       and jobs read these: a step costs the same at token 10 and token 10,000), CUMULATIVE
       everything so far, FINAL_ONLY one cumulative output when the request finishes.

It does not free blocks or touch the scheduler: the engine hands the stops to the scheduler.
No jax here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from jaxcb.detokenizer import IncrementalDetokenizer
from jaxcb.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxcb.core.sequence import RequestStatus, Sequence
from jaxcb.sampling_params import SamplingParams
from jaxcb.tokenizer import Tokenizer


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output holds everything generated so far
    DELTA = "delta"  # every output holds what is new since the previous one
    FINAL_ONLY = "final_only"  # one cumulative output, when the request finishes


@dataclass
class CompletionState:
    """One of a request's n completions: its text and tokens, and how much of them was reported."""

    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: Optional[list[dict[int, float]]]  # None unless the request asked for logprobs
    finish_reason: Optional[str] = None
    num_reported_tokens: int = 0
    num_reported_chars: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids

    @property
    def num_shown_chars(self) -> int:
        """How much of the text may be shown now: all of it once finished; while running, not a tail
        that may still turn into a stop string."""
        return len(self.detokenizer.text) if self.finish_reason else self.detokenizer.stream_length


@dataclass
class RequestGroup:
    """A user's request: its n sequences (the scheduler's unit) and their outputs."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    seqs: list[Sequence] = field(default_factory=list)
    completions: list[CompletionState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


def token_stop_status(
    params: SamplingParams, token: int, num_output: int, num_prompt: int, eos_token_ids: tuple[int, ...],
    max_model_len: int,
) -> Optional[RequestStatus]:
    """Whether the sequence stops on its `num_output`-th token `token`: on EOS or a stop token id
    once min_tokens are out (FINISHED_STOPPED), at max_tokens or max_model_len (FINISHED_LENGTH)."""
    if num_output >= params.min_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or num_prompt + num_output >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}
        self.num_items_copied = 0  # tokens, logprob entries and characters put into outputs (tests read it)

    def add(self, group: RequestGroup) -> None:
        want_logprobs = group.params.logprobs is not None
        group.completions = [
            CompletionState(i, IncrementalDetokenizer(self.tokenizer, group.params.stop), [] if want_logprobs else None)
            for i in range(group.params.n)
        ]
        self.groups[group.request_id] = group

    def remove(self, request_id: str) -> Optional[RequestGroup]:
        """Forget a request (aborted): nothing more is reported for it."""
        return self.groups.pop(request_id, None)

    def process(
        self, new_tokens: list[tuple[Sequence, int, Optional[dict[int, float]]]]
    ) -> tuple[list[RequestOutput], list[tuple[Sequence, RequestStatus]]]:
        """Apply one step's (sequence, token, its logprobs or None); return the outputs of the requests
        that changed, and the sequences that stop here with their status."""
        changed: dict[str, RequestGroup] = {}
        stops: list[tuple[Sequence, RequestStatus]] = []
        for seq, token, logprobs in new_tokens:
            group = self.groups.get(seq.group_id)  # None: aborted since
            if group is None:
                continue
            c = group.completions[seq.sample_index]
            if c.finish_reason is not None:
                continue  # a token drawn after the stop (async scheduling), already trimmed
            stop_string = c.detokenizer.add_token(token)
            if c.logprobs is not None and logprobs is not None:
                c.logprobs.append(logprobs)
            status = RequestStatus.FINISHED_STOPPED if stop_string is not None else self._token_stop(seq, token, group)
            if status is not None:
                c.detokenizer.finish()
                c.finish_reason = status.value
                stops.append((seq, status))
            changed[group.request_id] = group
        outputs = []
        for request_id, group in changed.items():
            finished = group.finished
            if finished or group.kind is not OutputKind.FINAL_ONLY:
                outputs.append(self._output(group, finished))
            if finished:
                del self.groups[request_id]
        return outputs, stops

    def _token_stop(self, seq: Sequence, token: int, group: RequestGroup) -> Optional[RequestStatus]:
        num_output = len(group.completions[seq.sample_index].token_ids)
        return token_stop_status(group.params, token, num_output, len(group.prompt_token_ids), self.eos_token_ids,
                                 self.max_model_len)

    def _output(self, group: RequestGroup, finished: bool) -> RequestOutput:
        delta = group.kind is OutputKind.DELTA
        completions = []
        for c in group.completions:
            num_chars, text = c.num_shown_chars, c.detokenizer.text
            if delta:  # only what is new: a step's cost does not grow with the stream
                t0, k0 = c.num_reported_chars, c.num_reported_tokens
                out_text, out_ids = text[t0:num_chars], c.token_ids[k0:]
                out_lps = c.logprobs[k0:] if c.logprobs is not None else None
            else:
                out_text, out_ids = text[:num_chars], list(c.token_ids)
                out_lps = list(c.logprobs) if c.logprobs is not None else None
            c.num_reported_chars, c.num_reported_tokens = num_chars, len(c.token_ids)
            self.num_items_copied += len(out_text) + len(out_ids) + (len(out_lps) if out_lps is not None else 0)
            completions.append(CompletionOutput(c.index, out_text, out_ids, c.finish_reason, out_lps,
                                                len(c.token_ids)))
        first = group.seqs[0]
        finished_time = first.finished_time or (time.monotonic() if finished else None)
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time, finished_time)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished, metrics,
                             delta=delta, num_cached_tokens=first.num_cached_tokens or 0)
