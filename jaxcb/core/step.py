"""The typed contract of one step between the scheduler and the runner (no jax).

`Scheduler.schedule()` returns a `SchedulerOutput`: for each scheduled sequence the tokens to
compute, its block table and how it samples. The runner turns it into the step's arrays and,
once the step is collected, returns a `RunnerOutput` (the sampled tokens), which
`Scheduler.update()` applies. Both key sequences by their `SequenceId`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from jaxcb.core.sequence import SequenceId
from jaxcb.sampling_params import SamplingParams


@dataclass(slots=True)  # one a scheduled sequence and step: slots make it about half as costly to build
class ScheduledSequence:
    """One sequence's share of a step."""

    seq_id: SequenceId  # the sequence's id (`Sequence.seq_id`)
    start_position: int  # num_computed_tokens before the step
    token_ids: list[int]  # the tokens to compute, positions start_position...
    block_ids: list[int]  # the sequence's whole block table (its own list: the KV-cache manager replaces, never changes one)
    block_epoch: int  # changes when block_ids is replaced rather than extended (Sequence.block_epoch)
    samples: bool  # the step reaches its last known token, so it samples the next one
    num_prompt_tokens: int
    num_output_tokens: int
    sampling_params: SamplingParams
    seed: int
    banned_token_ids: tuple[int, ...] = ()  # EOS / stop ids while min_tokens is not reached
    # Only when the params use penalties: its tokens before start_position, for the runner to count
    # when the sequence is new to its slot (a callable: most steps never need them).
    prior_token_ids: Optional[Callable[[], list[int]]] = None
    # Async scheduling: the row of the previous step that draws this sequence's last token (it is
    # the last of token_ids before any drafts, carried there as 0); the step reads it from the
    # device. -1: every token is known on the host.
    in_flight_row: int = -1
    # Its token constraint (jaxcb.structured.TokenConstraint: grammar, allowed ids, bad words), or None;
    # the runner asks it for the row's bitmask when the sequence samples.
    constraint: Optional[Any] = None
    # prompt_logprobs: for rows start_position.. of this chunk, the prompt token each predicts (the
    # next one), while there is one; None when the sequence does not ask for its prompt's logprobs.
    prompt_logprob_targets: Optional[list[int]] = None
    # Speculative decoding: the proposed tokens, the last len(draft_token_ids) of token_ids. The
    # runner gives each of the 1 + k tokens a row of its own that samples the target's token after
    # it (`num_rows`); the scheduler keeps the drafts the target agrees with (`RunnerOutput.verified`).
    draft_token_ids: tuple[int, ...] = ()
    # A draft model's drafts: the row of its distributions (q) that drew the first draft, the others after it
    # (`jaxcb.runner.draft_runner`); -1: drafts from a deterministic proposer (n-gram), q one-hot.
    draft_probs_row: int = -1
    # Blocks it held before the drafts asked for more: those past it and past its accepted tokens are freed.
    num_blocks_without_drafts: int = 0
    # Penalties: drafts accepted by an earlier verify step, which the slot's counts do not hold yet.
    uncounted_token_ids: tuple[int, ...] = ()
    # Its table's first blocks unchanged since it was last scheduled, when blocks were freed from its
    # end since (speculative decoding: rejected drafts'); None: it only grew.
    num_blocks_kept: Optional[int] = None
    lora_slot: int = -1  # its adapter's device slot (core/lora_slots.py); -1: the base model

    @property
    def num_rows(self) -> int:
        """Rows it takes in the step: one, or 1 + k when it verifies k drafts (one per token)."""
        return 1 + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted_ids: list[SequenceId] = field(default_factory=list)  # sequences this step preempted
    # Block copies the runner makes before the step: first every read of device blocks (swap_out,
    # offload: a device block freed by a swap-out or evicted to the host tier may be refilled by a
    # swap-in or restore of the same step), then every write (swap_in, restore), whose host blocks are
    # read then -- before a swap-out or offload of the same step lands in a host block a swap-in freed.
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    # The prefix cache's host tier (cache.host_prefix_cache_gib): hits copied back, evicted blocks copied out.
    restore: list[tuple[int, int]] = field(default_factory=list)  # (host tier block, device block)
    offload: list[tuple[int, int]] = field(default_factory=list)  # (device block, host tier block)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_rows(self) -> int:
        """The step's rows: one per sequence, 1 + k per sequence verifying k drafts."""
        return sum(s.num_rows for s in self.scheduled)


@dataclass(slots=True)  # one a sampling sequence and step
class SampledToken:
    token_id: int
    logprob: float = 0.0
    top_logprobs: Optional[dict[int, float]] = None


@dataclass
class RunnerOutput:
    sampled: dict[SequenceId, SampledToken]  # each sequence with samples=True -> its token (its first row's)
    # each sequence with prompt_logprob_targets -> [(prompt position, {its token: logprob, top tokens:
    # logprobs})] of the step's chunk
    prompt_logprobs: dict[SequenceId, list[tuple[int, dict[int, float]]]] = field(default_factory=dict)
    # each sequence with drafts -> the target's token at each of its 1 + k rows
    verified: dict[SequenceId, list[SampledToken]] = field(default_factory=dict)
