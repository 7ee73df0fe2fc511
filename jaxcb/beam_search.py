"""Beam search, as vLLM runs it: above the engine, in rounds of one token.

Each round, every live beam asks the engine for one token and the top 2 x beam_width log-probabilities
of the model's next-token distribution (the raw logits' log-softmax), its prompt being the request's
prompt followed by the beam's tokens so far (the prefix cache serves all but the last block). Every
candidate extends its beam by one token; the candidates are ranked by cumulative log-probability over
length ** length_penalty (length: the prompt's tokens and the beam's, an end token not counted), and
the best beam_width go on to the next round. A candidate that is an end token (any of the model's EOS
ids, unless ignore_eos) finishes its beam with "stop", kept aside. After max_tokens rounds, or when no beam is left,
the best beam_width of the finished and the live beams (these "length") are the request's n
completions, best first. Sampling fields other than these are refused at the door
(`jaxcb.server.requests`): the ranking reads the model's log-probabilities alone.

`BeamSearch` is one prompt's search, with no engine: a driver queues `round_prompts()` with
`round_params`, and hands each request's final output to `advance`. The drivers: `EngineBeamSearches`
here (an Engine its caller steps: LLM.beam_search, offline jobs) and `jaxcb.server.beam_streams` (over an
EngineClient: the server, its batches, jobs over a server). No jax.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from jaxcb.errors import EngineOverloadedError, InvalidRequestError
from jaxcb.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxcb.prompts import PromptType, prompt_text_and_ids, truncated_ids
from jaxcb.sampling_params import SamplingParams
from jaxcb.tokenizer import Tokenizer

@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams (a request's n), each at most `max_tokens` long."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0  # the score divides by length ** length_penalty: above 1 favours longer beams
    ignore_eos: bool = False  # an end token is then a token like any other
    include_stop_str_in_output: bool = False  # a beam finished by an end token keeps it in its tokens and text
    skip_special_tokens: bool = True  # of the beams' text

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"n={self.beam_width!r} must be an integer >= 1 (the beam width)", "n")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens!r} must be an integer >= 1", "max_tokens")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise InvalidRequestError(f"length_penalty={self.length_penalty!r} must be a finite number",
                                      "length_penalty")

    @property
    def round_params(self) -> SamplingParams:
        """What each beam asks of the engine in a round: one token, with the top 2 x beam_width log-probabilities."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width,
                              skip_special_tokens=self.skip_special_tokens)


def width_refusal(error: InvalidRequestError, params: BeamSearchParams) -> InvalidRequestError:
    """The engine's refusal of a round's `logprobs` (past engine.max_logprobs), as the body's `n` says it."""
    if error.field != "logprobs":
        return error
    return InvalidRequestError(f"n={params.beam_width} beams need the top {2 * params.beam_width} log-probabilities "
                               f"of each token, past what this engine gives ({error}): ask for at most "
                               "engine.max_logprobs / 2 beams, or raise engine.max_logprobs", "n")


@dataclass
class Beam:
    tokens: list[int]  # generated, after the prompt
    cum_logprob: float
    finish_reason: Optional[str] = None  # "stop": ended by an end token; else None while live


@dataclass
class BeamSearch:
    """One prompt's beam search (the module's docstring)."""

    prompt: Optional[str]  # the prompt's text, None for token ids
    prompt_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    live: list[Beam] = field(default_factory=list)
    finished: list[Beam] = field(default_factory=list)
    rounds: int = 0
    num_cached_tokens: int = 0  # of the first round: the prompt's own tokens found in the prefix cache
    cut_short: Optional[str] = None  # a round's request that ended otherwise ("abort", a timeout): its reason
    metrics: Optional[RequestMetrics] = None  # the first round's arrival and first token, the last round's end

    def __post_init__(self) -> None:
        self.live = [Beam([], 0.0)]

    @property
    def done(self) -> bool:
        return self.cut_short is not None or self.rounds >= self.params.max_tokens or not self.live

    def round_prompts(self) -> list[list[int]]:
        return [self.prompt_ids + beam.tokens for beam in self.live]

    def score(self, beam: Beam) -> float:
        length = len(self.prompt_ids) + len(beam.tokens)
        if beam.tokens and beam.tokens[-1] in self.eos_token_ids and beam.finish_reason == "stop":
            length -= 1
        return beam.cum_logprob / (length ** self.params.length_penalty)

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """One round's final outputs, one per `round_prompts()` entry, in that order."""
        assert len(outputs) == len(self.live), (len(outputs), len(self.live))
        if self.rounds == 0:
            self.num_cached_tokens = outputs[0].num_cached_tokens
            self.metrics = dataclasses.replace(outputs[0].metrics, finished_time=outputs[0].metrics.arrival_time)
        # Each round's length by its requests' own clocks (over Ray its beams may run on replicas, even hosts,
        # whose clocks differ), added to the first round's arrival: the search's end on that clock.
        self.metrics.finished_time += max((o.metrics.finished_time - o.metrics.arrival_time for o in outputs
                                           if o.metrics.finished_time is not None), default=0.0)
        candidates: list[Beam] = []
        for beam, out in zip(self.live, outputs):
            [c] = out.outputs
            if c.finish_reason not in ("length", "stop") or not c.logprobs:
                self.cut_short = c.finish_reason or "abort"
                return
            ranked = sorted(c.logprobs[0].items(), key=lambda kv: -kv[1])[: 2 * self.params.beam_width]
            for token, logprob in ranked:
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    kept = beam.tokens + [token] if self.params.include_stop_str_in_output else beam.tokens
                    self.finished.append(Beam(kept, beam.cum_logprob + logprob, "stop"))
                else:
                    candidates.append(Beam(beam.tokens + [token], beam.cum_logprob + logprob))
        self.live = sorted(candidates, key=self.score, reverse=True)[: self.params.beam_width]
        self.rounds += 1

    def result(self, request_id: str, tokenizer: Tokenizer) -> RequestOutput:
        """The request's output: its best beams as its n completions, best first."""
        last = self.cut_short or "length"
        best = sorted(self.finished + self.live, key=self.score, reverse=True)[: self.params.beam_width]
        outputs = []
        for i, beam in enumerate(best):
            text = tokenizer.decode(beam.tokens, skip_special_tokens=self.params.skip_special_tokens)
            outputs.append(CompletionOutput(i, text, list(beam.tokens), beam.finish_reason or last,
                                            num_generated=len(beam.tokens), cumulative_logprob=beam.cum_logprob))
        return RequestOutput(request_id, self.prompt, list(self.prompt_ids), outputs, finished=True,
                             metrics=self.metrics or RequestMetrics(0.0), num_cached_tokens=self.num_cached_tokens)


def beam_searches(prompts: Sequence[PromptType], params: BeamSearchParams, tokenizer: Tokenizer, max_model_len: int,
                  max_n: int, truncate_prompt_tokens: Optional[int] = None) -> list[BeamSearch]:
    """One search per prompt (text, EncodedText or token ids), each prompt cut as truncate_prompt_tokens
    says; InvalidRequestError naming the field for more beams than server.max_n (`max_n`) or a prompt
    that leaves no room for max_tokens."""
    if params.beam_width > max_n:
        raise InvalidRequestError(f"n={params.beam_width} exceeds server.max_n={max_n}; ask for at most {max_n} "
                                  "beams", "n")
    searches = []
    for prompt in prompts:
        text, ids = prompt_text_and_ids(prompt, tokenizer)
        text, ids = truncated_ids(prompt, text, ids, truncate_prompt_tokens, max_model_len, tokenizer)
        if not ids:
            raise InvalidRequestError("prompt is empty; give a non-empty string or list of token ids", "prompt")
        if len(ids) + params.max_tokens > max_model_len:
            raise InvalidRequestError(f"the prompt's {len(ids)} tokens and max_tokens={params.max_tokens} exceed "
                                      f"engine.max_model_len={max_model_len}; shorten the prompt or lower max_tokens",
                                      "max_tokens")
        searches.append(BeamSearch(text, ids, params, frozenset(tokenizer.eos_token_ids or ())))
    return searches


class EngineBeamSearches:
    """Searches driven on an Engine by its caller's step loop (LLM.beam_search, offline jobs): `start()`
    queues every first round, `take(out)` takes a finished output of a round's request (False: not one of
    these) and queues the search's next round once its round is complete, `flush()` (after each step)
    queues what the engine said to retry later (admission control: a later round waits, it never fails),
    `done` says when every search has ended, and `results()` gives their outputs in order. `timeout_s`
    bounds each search as a whole; `abort()` aborts the rounds in flight."""

    def __init__(self, engine, searches: list[BeamSearch], *, priority: int = 0, cache_salt: Optional[str] = None,
                 lora: Optional[str] = None, timeout_s: Optional[float] = None):
        self.engine, self.searches = engine, searches
        self._queue_args = {"priority": priority, "cache_salt": cache_salt, "lora": lora}
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._in_flight: dict[str, tuple[int, int]] = {}  # request id -> (search, beam)
        self._pending: deque[tuple[int, int, list[int]]] = deque()  # (search, beam, prompt) the engine has not taken
        self._round: list[list[Optional[RequestOutput]]] = [[] for _ in searches]
        self._first_ids: list[Optional[str]] = [None] * len(searches)
        self._results: list[Optional[RequestOutput]] = [None] * len(searches)

    def start(self) -> None:
        """Queue every first round; the engine's refusal raised (InvalidRequestError as the body's field, or
        EngineOverloadedError: retry later), nothing left queued."""
        try:
            for i, search in enumerate(self.searches):
                prompts = search.round_prompts()
                self._round[i] = [None] * len(prompts)
                for j, prompt in enumerate(prompts):
                    self._add(i, j, prompt)
        except BaseException as e:
            self.abort()
            if isinstance(e, InvalidRequestError):
                raise width_refusal(e, self.searches[0].params) from None
            raise

    @property
    def done(self) -> bool:
        return all(r is not None for r in self._results)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight) + len(self._pending)

    def results(self) -> list[RequestOutput]:
        assert self.done
        return list(self._results)

    def take(self, out: RequestOutput) -> bool:
        entry = self._in_flight.pop(out.request_id, None)
        if entry is None:
            return False
        i, j = entry
        self._round[i][j] = out
        if any(o is None for o in self._round[i]):
            return True
        search = self.searches[i]
        search.advance(self._round[i])
        if not search.done and self._deadline is not None and time.monotonic() >= self._deadline:
            search.cut_short = "timeout"
        if search.done:
            self._finish(i)
        else:
            prompts = search.round_prompts()
            self._round[i] = [None] * len(prompts)
            self._pending.extend((i, j, prompt) for j, prompt in enumerate(prompts))
            self.flush()
        return True

    def flush(self) -> None:
        """Queue the round requests waiting for room, in order, until the engine says to retry later."""
        while self._pending:
            i, j, prompt = self._pending[0]
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._cut(i, "timeout")
                continue
            try:
                self._add(i, j, prompt)
            except EngineOverloadedError:
                return
            except InvalidRequestError:  # (its adapter unloaded since the first round, say)
                self._cut(i, "abort")
                continue
            self._pending.popleft()

    def abort(self) -> None:
        for rid in list(self._in_flight):
            self.engine.abort(rid)
        self._in_flight.clear()
        self._pending.clear()

    def _add(self, i: int, j: int, prompt: list[int]) -> None:
        left = None if self._deadline is None else max(self._deadline - time.monotonic(), 1e-3)
        rid = self.engine.add_request(prompt, self.searches[i].params.round_params, final_only=True, timeout_s=left,
                                      **self._queue_args)
        self._first_ids[i] = self._first_ids[i] or rid
        self._in_flight[rid] = (i, j)

    def _cut(self, i: int, reason: str) -> None:
        """Search i ends now with what it has (its round in flight aborted, the rest of it not queued)."""
        for rid, (k, _) in list(self._in_flight.items()):
            if k == i:
                self.engine.abort(rid)
                del self._in_flight[rid]
        self._pending = deque(p for p in self._pending if p[0] != i)
        self.searches[i].cut_short = reason
        self._finish(i)

    def _finish(self, i: int) -> None:
        self._results[i] = self.searches[i].result(self._first_ids[i], self.engine.tokenizer)
