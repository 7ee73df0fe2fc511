"""The state of one sequence being generated, as the scheduler and engine see it (no jax).

A request with `n` > 1 becomes n sequences: the first (its leader) prefills the prompt, and
the others, admitted right behind it, find its full prompt blocks in the prefix cache from the
step that fills them on (`kv_cache_manager.py`). A request id is the user's (a string, the id
of the output group); a sequence id (`SequenceId`) is the pair of that and the sequence's
index among the n, and is what the scheduler, the step's contract and the runner key on.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from jaxcb.sampling_params import SamplingParams


class SequenceId(NamedTuple):
    """One sequence's own id: unique whatever the user's request id, and never parsed."""

    request_id: str  # the user's request it is a completion of (`Sequence.group_id`)
    index: int  # which of its n completions (`Sequence.sample_index`); 0 is the leader


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the queue; its blocks were freed and it will recompute
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens, or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"  # past its total deadline: ends with what it has
    FINISHED_QUEUE_TIMEOUT = "queue_timeout"  # past its queue deadline with nothing generated: refused

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATES


FINISHED_STATES = frozenset({
    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_TIMEOUT, RequestStatus.FINISHED_QUEUE_TIMEOUT,
})


@dataclass(eq=False)  # one object per sequence, compared by identity (value equality would compare its tokens)
class Sequence:
    seq_id: SequenceId  # the sequence's own id; not the user's request id (that is `group_id`)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # Batch work (/v1/batches): admitted only after every waiting interactive sequence, and preempted
    # first, under every scheduler.policy (scheduler.py).
    background: bool = False
    seed: int = 0  # resolved sampling seed (the params' seed, or one the engine drew)
    sample_index: int = 0  # which of the n completions this sequence is
    parent_id: Optional[SequenceId] = None  # the leader whose prompt blocks this sequence shares (n > 1)
    cache_salt: Optional[str] = None  # its tenant's: only sequences with the same salt share cached blocks
    lora_name: Optional[str] = None  # its LoRA adapter (None: the base model)
    # The adapter's identity (name and weights digest): part of its prefix-cache root, so two adapters
    # (or an adapter reloaded with other weights) never share K/V.
    lora_identity: Optional[str] = None
    lora_slot: int = -1  # the device slot its adapter is in while it runs (core/lora_slots.py); -1: the base
    group_id: Optional[str] = None  # the user's request id: the request (output group) this sequence belongs to
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    # Bumped whenever block_ids is replaced rather than extended (admission, preemption, swap), so
    # the runner knows when the table it keeps on the device for this sequence is stale.
    block_epoch: int = 0
    # Speculative decoding frees the blocks only rejected drafts needed, and the table may grow again
    # with other blocks: its first num_blocks_kept blocks are unchanged since it was last scheduled
    # (None: all of them), which the runner's copy of the table needs to know.
    num_blocks_kept: Optional[int] = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of its leading full blocks, in order (block_hash.py)
    num_registered_blocks: int = 0  # leading blocks findable in the prefix cache (found there, or registered)
    host_block_ids: list[int] = field(default_factory=list)  # where its K/V wait while swapped out
    num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache when first admitted
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # Its token constraint (jaxcb.structured.TokenConstraint), or None: the runner fills its step's bitmask
    # row from it, the output processor advances it past every generated token.
    constraint: Optional[Any] = None
    # Speculative decoding's state (jaxcb.core.speculation.SequenceSpeculation), made on its first decode;
    # False when it never speculates; None until then or with speculation off.
    speculation: Any = None

    def __post_init__(self) -> None:
        # Ids given as plain (request id, index) pairs, as the engine builds them, become SequenceIds.
        if type(self.seq_id) is tuple:
            self.seq_id = SequenceId(*self.seq_id)
        if type(self.parent_id) is tuple:
            self.parent_id = SequenceId(*self.parent_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_id(self, position: int) -> int:
        n = self.num_prompt_tokens
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_ids(self, start: int, stop: int) -> list[int]:
        n = self.num_prompt_tokens
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
