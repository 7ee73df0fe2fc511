"""Speculative decoding's host side: who proposes what, and when a sequence stands aside (no jax).

A decoding sequence may bring proposed tokens (drafts) to a step: its last token and k drafts
are 1 + k query rows of the ordinary ragged step, each sampling the target's token for its
position (the runner splits them into rows, `jaxcb.runner.step_inputs`). The scheduler keeps
the longest run of drafts equal to the target's own samples, plus the target's next token, and
rolls the rest back (`Scheduler.update`). A draft is accepted exactly when it equals the token
the target samples there with that position's own noise (`jaxcb.sampling`): the rejection rule
for a deterministic proposer, so greedy and seeded outputs are identical with and without
speculation.

This module decides, for each decoding sequence and step (`Speculation.drafts`):

- whether it may speculate at all: not with a token constraint (structured outputs,
  allowed_token_ids, bad_words: their masks do not advance speculatively yet) or
  prompt_logprobs -- such a request decodes plainly in the same batches and is counted once
  (`num_unspeculated_requests`); not while more than `disable_by_batch_size` sequences
  decode (a large batch is compute-bound: k drafts cost about k decodes); not while it
  backs off (below);
- what it proposes, through one protocol (`proposers.py`), asked once a step for every sequence
  that may speculate (`prepare`): the n-gram proposer (`NgramProposer`) looks up the sequence's last n
  tokens (longest first) in its prompt and output so far, and proposes what followed their
  latest earlier occurrence (past the end, what the proposal itself continues: a repeating
  pattern keeps repeating); a draft model (`jaxcb.runner.draft_runner.DraftProposer`) drafts k
  tokens on the device, drawn from distributions the verify step then checks them against;
- async scheduling's rule: proposals come from the tokens known when the step is scheduled.
  Under async scheduling a decoding sequence's last token is still in flight then: the match
  is looked up for its known tokens, and its continuation's first token stands for the one in
  flight (the step reads the real one from the device, so a wrong guess only costs rejected
  drafts: what is accepted is always the target's own samples). A sequence whose previous step
  verified drafts sits the next step out: how many it accepts is not known yet.
- back-off: a sequence whose last `acceptance_window` verify steps accepted fewer than
  `min_mean_accepted` tokens on average stops proposing for 16 tokens, then 32, 64, ... while
  it keeps failing.
- a costly proposer (a draft model: k + 1 forwards of its own and a host read before each verify
  step, and under async scheduling the step its sequence sits out after it) backs off faster,
  because each failed probe costs about a step of its own: its first back-off is 64 tokens, a
  probe after a back-off is judged on its first `acceptance_window // 2` verify steps, and while
  the engine's last `4 x acceptance_window` verify steps (all sequences) fell below
  `min_mean_accepted`, a sequence starts already backed off instead of proposing from its first
  decode. Outputs never change; only how often a failing draft is asked.

It also keeps the counters that `/metrics` publishes under vLLM's names (`SpeculationStats`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from jaxcb.core.proposers import NO_PROPOSAL, Proposal, Proposer, ProposalRequest

if TYPE_CHECKING:
    from jaxcb.config import SpeculativeConfig
    from jaxcb.core.sequence import Sequence

FIRST_BACKOFF_TOKENS = 16
COSTLY_FIRST_BACKOFF_TOKENS = 64  # a draft model's (module docstring)


class NgramIndex:
    """One sequence's n-grams (lengths `min_n`..`max_n`), each mapped to where its latest
    occurrence ends (exclusive), indexed lazily up to the sequence's current length."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # every n-gram ending at or before this (exclusive end) is indexed

    def index_upto(self, tokens: list[int], end: int) -> None:
        """Index the n-grams that end (exclusive) at positions num_indexed + 1 .. `end`."""
        last_end = self.last_end
        for e in range(self.num_indexed + 1, end + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                last_end[tuple(tokens[e - n : e])] = e
        self.num_indexed = max(self.num_indexed, end)

    def find(self, tokens: list[int], length: int, min_n: int) -> Optional[int]:
        """Where the continuation of the longest n-gram (n >= `min_n`) ending `tokens[:length]` starts
        in an earlier occurrence, or None. The occurrence ends before `length`, so at least one token follows it."""
        self.index_upto(tokens, length - 1)
        for n in range(min(self.max_n, length - 1), min_n - 1, -1):
            end = self.last_end.get(tuple(tokens[length - n : length]))
            if end is not None:
                return end
        return None


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """The `Proposer` protocol: each request's continuation (`continuation`)."""
        out = []
        for r in requests:
            state = r.seq.speculation
            drafts = self.continuation(state.index, r.token_ids, r.num_known, r.num_drafts)
            out.append(Proposal(drafts) if drafts else NO_PROPOSAL)
        return out

    def continuation(self, index: NgramIndex, tokens: list[int], num_known: int, k: int) -> list[int]:
        """Up to k drafts to follow `tokens`, of which the first `num_known` are known and the rest (at
        most one) in flight: the continuation of the longest match of the known tokens' suffix, its
        first tokens standing for those in flight."""
        start = index.find(tokens, num_known, self.min_n)
        if start is None:
            return []
        skip = len(tokens) - num_known
        continuation = tokens[start : min(num_known, start + skip + k)]
        # Past the known tokens the match goes on into its own continuation: a repeating pattern repeats.
        while len(continuation) < skip + k:
            continuation.append(continuation[start + len(continuation) - num_known])
        return continuation[skip:]


@dataclass
class SequenceSpeculation:
    """One sequence's speculation state, kept on it (`Sequence.speculation`)."""

    index: Optional[NgramIndex]  # the n-gram proposer's; None for a proposer that keeps no per-sequence index
    accepted: deque = field(default_factory=deque)  # accepted tokens of its last verify steps
    resume_at: int = 0  # it proposes again once it has this many tokens (back-off)
    backoff: int = FIRST_BACKOFF_TOKENS  # the next back-off's length, in tokens
    judged_after: int = 0  # verify steps it needs before a verdict; 0: the full acceptance window
    uncounted: list[int] = field(default_factory=list)  # accepted drafts the penalties' counts still lack


@dataclass
class SpeculationStats:
    """Totals since start-up (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0  # verify steps (sequences x steps that brought drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at each position
    num_unspeculated_requests: int = 0  # requests decoded without speculation (constraints, prompt_logprobs)


class Speculation:
    """The scheduler's proposer and back-off (module docstring)."""

    def __init__(self, cfg: "SpeculativeConfig", disable_by_batch_size: int, proposer: Optional[Proposer] = None,
                 costly: bool = False):
        """`proposer`: what proposes (default: n-gram prompt lookup, as `cfg` says); `costly`: each proposal
        costs device work of its own (a draft model), so failing proposals back off faster (module docstring)."""
        self.k = cfg.num_speculative_tokens
        self.proposer: Proposer = proposer or NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self._proposals: dict = {}  # this step's proposals, by sequence id (`prepare`)
        self.disable_by_batch_size = disable_by_batch_size
        self.min_mean_accepted = cfg.min_mean_accepted
        self.window = cfg.acceptance_window
        self.costly = costly
        self.first_backoff = COSTLY_FIRST_BACKOFF_TOKENS if costly else FIRST_BACKOFF_TOKENS
        self.probe_window = max(1, self.window // 2) if costly else 0
        # The engine's last verify steps, every sequence's (a costly proposer's new sequences read them).
        self.recent: deque = deque(maxlen=4 * self.window)
        self.stats = SpeculationStats(accepted_per_position=[0] * self.k)

    def _state(self, seq: "Sequence") -> Optional[SequenceSpeculation]:
        """The sequence's state, made on its first decode; None if it never speculates."""
        state = seq.speculation
        if state is None:
            p = seq.sampling_params
            if seq.constraint is not None or p.prompt_logprobs is not None:
                seq.speculation = False
                if seq.sample_index == 0:
                    self.stats.num_unspeculated_requests += 1
                return None
            index = self.proposer.new_index() if isinstance(self.proposer, NgramProposer) else None
            state = seq.speculation = SequenceSpeculation(index, backoff=self.first_backoff)
            if self.costly and self.failing():  # the draft fails on this traffic: probe it later, briefly
                self._back_off(seq, state)
        return state or None

    def failing(self) -> bool:
        """Whether the engine's last `4 x acceptance_window` verify steps accepted below `min_mean_accepted`."""
        return len(self.recent) == self.recent.maxlen and sum(self.recent) < self.min_mean_accepted * len(self.recent)

    def prepare(self, candidates: list[tuple["Sequence", bool, int]], num_decoding: int, max_drafts) -> None:
        """Ask the proposer, once for the step being scheduled, what each decoding sequence that may
        speculate proposes. `candidates`: (sequence, whether its last token is in flight, its row in the
        last dispatched step or -1); `num_decoding`: sequences decoding; `max_drafts(seq)`: the most
        drafts it may verify (its max_tokens and max_model_len)."""
        self._proposals = {}
        requests = []
        for seq, last_in_flight, row in candidates:
            state = self._state(seq)  # first: a request that never speculates is counted, whatever the batch
            if state is None or num_decoding > self.disable_by_batch_size:
                continue
            room = min(self.k, max_drafts(seq))
            if room <= 0 or seq.num_tokens < state.resume_at:
                continue
            tokens = seq.prompt_token_ids + seq.output_token_ids
            requests.append(ProposalRequest(seq, tokens, len(tokens) - last_in_flight, room, row))
        if requests:
            for r, proposal in zip(requests, self.proposer.propose(requests)):
                if proposal.token_ids:
                    self._proposals[r.seq.seq_id] = proposal

    def drafts(self, seq: "Sequence", max_drafts: int) -> Proposal:
        """What a decoding sequence brings to the step being scheduled (no drafts: it decodes plainly):
        its proposal from `prepare`, cut to `max_drafts`."""
        proposal = self._proposals.pop(seq.seq_id, NO_PROPOSAL)
        if max_drafts <= 0 or not proposal.token_ids:
            return NO_PROPOSAL
        return Proposal(proposal.token_ids[:max_drafts], proposal.probs_row)

    def verified(self, seq: "Sequence", drafts: tuple[int, ...], num_accepted: int) -> None:
        """A verify step's outcome: `num_accepted` of the sequence's `drafts` were the target's tokens."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        self.recent.append(num_accepted)
        state = seq.speculation
        if state:
            if seq.sampling_params.uses_penalties:
                state.uncounted += drafts[:num_accepted]
            self._record(seq, state, num_accepted)

    def _record(self, seq: "Sequence", state: SequenceSpeculation, num_accepted: int) -> None:
        state.accepted.append(num_accepted)
        if len(state.accepted) > self.window:
            state.accepted.popleft()
        judged = len(state.accepted)
        if judged < (state.judged_after or self.window):
            return
        if sum(state.accepted) < self.min_mean_accepted * judged:
            self._back_off(seq, state)
            return
        state.judged_after = 0  # past its probe: the full window from here
        if judged == self.window and sum(state.accepted) >= self.window:  # paying again: back-offs start short
            state.backoff = self.first_backoff

    def _back_off(self, seq: "Sequence", state: SequenceSpeculation) -> None:
        state.resume_at = seq.num_tokens + state.backoff
        state.backoff *= 2
        state.accepted.clear()
        state.judged_after = self.probe_window

    @staticmethod
    def take_uncounted(seq: "Sequence") -> tuple[int, ...]:
        """The accepted drafts the penalties' counts lack, handed to the step being built (once)."""
        state = seq.speculation
        if not state or not state.uncounted:
            return ()
        out, state.uncounted = tuple(state.uncounted), []
        return out
