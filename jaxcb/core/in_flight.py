"""Async scheduling's one rule: a token that is still being drawn on the device (no jax).

With `engine.async_scheduling` the engine dispatches step N+1 before step N's sampled tokens
reach the host. Every sequence that samples in step N then has one token *in flight*: it
counts as known (so step N+1 can schedule the decode that reads it, and `max_tokens` counts
it) but its value exists only on the device, in row `row` of step N's sampled tokens.

    dispatched(out)      step N went to the device: each sampling sequence gets an in-flight
                         token at the end of its output ids, and its row in step N is kept
    token_ids_for_step(seq, start, stop)
                         for step N+1's schedule: the sequence's tokens, its last as 0 if in
                         flight, and the row of step N that holds it, or -1 when the host knows
                         it; the runner's step reads that row from the device
                         (`ScheduledSequence.in_flight_row`)
    resolve(seq, i, t)   step N's token t reached the host: output token i becomes it
    discard(seq)         the sequence stopped: a token drawn past its stop is dropped
    num_known_tokens(seq) its tokens the host knows (the prefix cache hashes no other)

Speculative decoding: a sequence that verifies drafts in step N has one token in flight too,
but how many tokens follow it (the drafts it accepts) is known only when step N is. Its tokens
cannot be scheduled before then: it sits step N+1 out (`verifying`), and `resolve_verified`
puts all its new tokens in place. A sequence's row in step N is counted in rows (a verifying
sequence takes 1 + k, `ScheduledSequence.num_rows`).

A plain decoder whose last token is in flight still speculates: proposals come from its known
tokens, the proposer's first guess standing for the one in flight (an n-gram match's next token,
or the draft model's own draw), and the step reads the real token from the device; drafts made
after a wrong guess are simply rejected more often (`row_of` gives the proposer its row).

Without async scheduling a step is resolved before the next is scheduled, so that row is
always -1. Nothing outside this module knows how an in-flight token is marked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    from jaxcb.core.step import SchedulerOutput
    from jaxcb.core.sequence import Sequence, SequenceId

_IN_FLIGHT = -1  # the place of an output token still on the device; never a vocabulary id


class InFlightTokens:
    def __init__(self) -> None:
        self._row_of: dict["SequenceId", int] = {}  # each sequence's row in the last dispatched step
        self._verifying: set["SequenceId"] = set()  # sequences whose drafts' verification is in flight

    def dispatched(self, out: "SchedulerOutput", sequences: Mapping["SequenceId", "Sequence"]) -> None:
        """Step `out` went to the device: its sampling sequences' next tokens are in flight."""
        self._row_of = {}
        row = 0
        for scheduled in out.scheduled:
            seq = sequences.get(scheduled.seq_id)
            if seq is not None and scheduled.samples:
                seq.output_token_ids.append(_IN_FLIGHT)
                if scheduled.draft_token_ids:
                    self._verifying.add(scheduled.seq_id)
                else:
                    self._row_of[scheduled.seq_id] = row
            row += scheduled.num_rows

    def verifying(self, seq: "Sequence") -> bool:
        """Whether the sequence's tokens wait for a verify step still in flight (it cannot be scheduled)."""
        return seq.seq_id in self._verifying

    def row_of(self, seq: "Sequence") -> int:
        """Its row in the last dispatched step, whose token is its last one in flight; -1: none."""
        return self._row_of.get(seq.seq_id, -1) if self.last_token_in_flight(seq) else -1

    def last_token_in_flight(self, seq: "Sequence") -> bool:
        return bool(seq.output_token_ids) and seq.output_token_ids[-1] == _IN_FLIGHT

    @staticmethod
    def any_in_flight(token_ids: Iterable[int]) -> bool:
        """Whether some of these tokens are not known yet (a block holding one is not full yet)."""
        return _IN_FLIGHT in token_ids

    @staticmethod
    def num_known_tokens(seq: "Sequence") -> int:
        """How many of `seq`'s tokens the host knows: all but those in flight, which are its last."""
        out, num_in_flight = seq.output_token_ids, 0
        while num_in_flight < len(out) and out[-1 - num_in_flight] == _IN_FLIGHT:
            num_in_flight += 1
        return seq.num_tokens - num_in_flight

    def resolve(self, seq: "Sequence", index: int, token_id: int) -> None:
        """Output token `index` of `seq`, in flight until now, is `token_id`."""
        assert seq.output_token_ids[index] == _IN_FLIGHT, (seq.seq_id, index)
        seq.output_token_ids[index] = token_id

    def resolve_verified(self, seq: "Sequence", index: int, token_ids: list[int]) -> None:
        """Output token `index` of `seq`, in flight since its verify step, is `token_ids[0]`; the
        accepted tokens after it follow."""
        assert index == len(seq.output_token_ids) - 1 and seq.output_token_ids[index] == _IN_FLIGHT, (seq.seq_id, index)
        seq.output_token_ids[index:] = token_ids
        self._verifying.discard(seq.seq_id)

    def discard(self, seq: "Sequence") -> None:
        """A stopped sequence drops the tokens drawn after its stop."""
        while self.last_token_in_flight(seq):
            seq.output_token_ids.pop()
        self._verifying.discard(seq.seq_id)

    def token_ids_for_step(self, seq: "Sequence", start: int, stop: int) -> tuple[list[int], int]:
        """Tokens [start, stop) as a step's host arrays carry them -- an in-flight one as 0, which the
        step replaces with the device's token; any valid id would do, 0 keeps gathers in range -- and
        the row of the last dispatched step that draws it, or -1 when the host knows them all."""
        out = seq.output_token_ids
        if start < stop == seq.num_tokens and out[-1:] == [_IN_FLIGHT]:
            return seq.token_ids(start, stop - 1) + [0], self._row_of[seq.seq_id]
        return seq.token_ids(start, stop), -1
