"""What a speculative proposer is (no jax): requests in, proposals out, for every proposer alike.

A proposer gets, once per step, every decoding sequence that may speculate (`ProposalRequest`)
and returns what each proposes (`Proposal`). Host proposers (n-gram, `speculation.NgramProposer`)
read the tokens; device proposers (a draft model, `jaxcb.runner.draft_runner.DraftProposer`) run
on the device and leave there the distributions their drafts were drawn from, which the step
that verifies them reads by row (`Proposal.probs_row`). Each request also names the row of the
target's last dispatched step whose final hidden state precedes its last token (`hidden_row`,
`ModelRunner.last_hidden`), so a proposer that reads the target's hidden states (an EAGLE-style
head) fits behind the same protocol.

Proposals are made from the tokens known when the step is scheduled: under async scheduling a
sequence's last token is usually still in flight, and the proposer proposes past it (its first
guess stands for that token, which the step reads from the device instead, `speculation.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from jaxcb.core.sequence import Sequence


@dataclass(slots=True)
class ProposalRequest:
    seq: "Sequence"
    token_ids: list[int]  # its prompt and output; those from num_known on are in flight (placeholders)
    num_known: int  # how many of token_ids the host knows
    num_drafts: int  # the most drafts it may verify this step (>= 1)
    hidden_row: int  # its row of the target's last dispatched step (its last token's hidden state); -1: none


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # the drafts, at most num_drafts; empty: it decodes plainly
    # The row of the device proposer's distributions (q) that drew the first draft, one row per draft
    # after it; -1: a deterministic proposer (q one-hot on each draft).
    probs_row: int = -1


NO_PROPOSAL = Proposal([])


class Proposer(Protocol):
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order."""
        ...
