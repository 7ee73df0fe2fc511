"""Iteration-level scheduling: which sequences compute which tokens in the next step (no jax).

One rule for every phase (after vLLM V1): a sequence has `num_tokens` known tokens (prompt +
outputs) and `num_computed_tokens` of them in the KV cache; each step it catches up by one
decode token or the next prefill chunk. `schedule()`:

    1. running sequences, in admission order, take their next tokens under the token budget
       (a prefill chunk is capped by long_prefill_token_threshold); each gets the blocks its
       new tokens need -- if none are free, the running sequence that has computed the least
       is preempted (blocks freed, back to the head of the queue, recompute later) until it fits
    2. a waiting sequence that outranks a running one and cannot start (max_num_seqs, or
       blocks) takes its place: the worst running one is preempted. Interactive sequences
       outrank background ones (batch work, `Sequence.background`) under every policy but
       static; policy=priority then ranks by aged priority
    3. the running sequences' shares of the step are final now -- nothing below preempts --
       so the full blocks they fill become findable in the prefix cache
    4. unless step 1 or 2 preempted, waiting sequences are admitted in FCFS order while the
       budget, max_num_seqs, max_num_partial_prefills and free blocks allow, background
       sequences after every interactive one
       (policy=static: only when nothing runs, and with each member's worst-case blocks
       reserved up front, so a static batch never preempts). An admitted sequence first
       takes the longest prefix of its full blocks found in the prefix cache -- blocks filled
       by earlier steps, or by this one (steps 3 and 4: the step's K/V are written before any
       row attends) -- and computes only the rest: always at least its last token, into a
       block of its own, so a cached block is never written. The blocks it fills become
       findable at once, by the sequences admitted after it (the n > 1 samples of one
       sequence, prompts sharing a system prompt).

So a block is registered only once the step that fills it is sure to be dispatched with it,
and a block found in the cache is filled by an earlier step or by the same one.

Every block question goes to the KV-cache manager (`kv_cache_manager.py`: does a sequence fit,
room for its next tokens or not, its cached prefix, preemption and swap), which alone takes blocks
from the block pool: this module counts tokens, never blocks.

`commit()` marks a dispatched step's computed tokens and, for every sampling sequence, a token
in flight (`in_flight.py`: under async scheduling the next step is scheduled before it is
known; a sequence whose token constraint needs that token sits the next step out); `update()`
applies the runner's sampled tokens and registers the blocks that waited for a token in flight.
Whether a sequence stops is decided by the output processor (`jaxcb.output`), which sees tokens
and text; `finish()` then frees its blocks at once.

Speculative decoding (`speculation.py`): in step 1 a decoding sequence may bring drafts -- 1 + k
tokens, counted against the budget; drafts never preempt (if their blocks are not free, it
decodes plainly). `commit()` counts only its first token as computed; `update()` keeps the
drafts the target sampled too, plus the target's next token, counts the accepted drafts as
computed, frees the blocks only the rejected ones needed, and registers only accepted tokens'
blocks in the prefix cache.
"""

from __future__ import annotations

import functools

import logging
import time
from collections import deque
from typing import Callable, Optional

from jaxcb.config import SchedulerConfig
from jaxcb.core.block_pool import BlockPool
from jaxcb.core.in_flight import InFlightTokens
from jaxcb.core.block_hash import BlockHash
from jaxcb.core.host_prefix_cache import HostPrefixCache
from jaxcb.core.kv_cache_manager import NO_ROOT, CachedPrefix, KVCacheManager
from jaxcb.core.lora_slots import LoraSlotTable
from jaxcb.core.sequence import RequestStatus, Sequence, SequenceId
from jaxcb.core.speculation import Speculation
from jaxcb.core.step import RunnerOutput, ScheduledSequence, SchedulerOutput

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        block_pool: BlockPool,
        block_size: int,
        max_model_len: int,
        *,
        enable_prefix_caching: bool = False,
        root: BlockHash = NO_ROOT,
        clock: Callable[[], float] = time.monotonic,
        host_pool: Optional[BlockPool] = None,
        block_growth: int = 1,
        speculation: Optional[Speculation] = None,
        lora_slots: Optional[LoraSlotTable] = None,
        host_cache: Optional[HostPrefixCache] = None,
    ):
        self.cfg = cfg
        # LoRA: a sequence with an adapter is admitted only once its adapter has a device slot.
        self.lora_slots = lora_slots
        # root: the model's identity, in which every block hash is rooted (Engine.prefix_cache_root).
        # Spare blocks are taken only while every running sequence could still take a run of its own.
        self.kv = KVCacheManager(block_pool, block_size, enable_prefix_caching=enable_prefix_caching,
                                 root=root, host_pool=host_pool, block_growth=block_growth,
                                 growth_reserve=cfg.max_num_seqs * block_growth, max_model_len=max_model_len,
                                 host_cache=host_cache)
        self.max_model_len = max_model_len
        self.clock = clock  # of arrival times and priority aging
        self.waiting: deque[Sequence] = deque()
        # Tokens each waiting sequence still has to compute, counted as it joined the queue, so that
        # num_waiting_tokens (read every step) costs nothing; _count_waiting keeps it exact.
        self._waiting_counts: dict = {}
        self._num_waiting_tokens = 0
        self.running: list[Sequence] = []
        self.sequences: dict[SequenceId, Sequence] = {}
        self.in_flight = InFlightTokens()
        self.speculation = speculation  # None: speculative decoding off
        self.num_preemptions = 0
        self._num_background = 0  # unfinished background sequences: while none, ranking costs nothing

    # --- requests in and out -------------------------------------------------------------------

    def add_request(self, sequence: Sequence) -> None:
        if sequence.seq_id in self.sequences:
            raise ValueError(f"sequence id {sequence.seq_id!r} is already in use")
        self.sequences[sequence.seq_id] = sequence
        self._num_background += sequence.background
        self.waiting.append(sequence)
        self._count_waiting(sequence)

    def abort(self, seq_id: SequenceId) -> bool:
        """Finish a sequence now, wherever it is, and free its blocks; False if it is unknown or done."""
        sequence = self.sequences.get(seq_id)
        if sequence is None or sequence.is_finished:
            return False
        if sequence in self.running:
            self.running.remove(sequence)
        else:
            self._leave_waiting(sequence)
        self._finish(sequence, RequestStatus.FINISHED_ABORTED)
        return True

    def finish(self, seq_id: SequenceId, status: RequestStatus) -> None:
        """Finish a sequence that stopped (the output processor saw its stop token, length or string)."""
        sequence = self.sequences.get(seq_id)
        if sequence is None or sequence.is_finished:
            return
        self.in_flight.discard(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
        else:
            self._leave_waiting(sequence)
        self._finish(sequence, status)

    def _finish(self, sequence: Sequence, status: RequestStatus) -> None:
        self.in_flight.discard(sequence)
        sequence.status = status
        sequence.finished_time = time.monotonic()
        self.kv.free(sequence)
        if self.lora_slots is not None:
            self.lora_slots.release(sequence)
        self._num_background -= sequence.background
        del self.sequences[sequence.seq_id]

    @property
    def pool(self) -> BlockPool:
        """The device block pool behind the KV-cache manager, for metrics and tests to read."""
        return self.kv.pool

    # Counters of the KV-cache manager, for metrics.
    prefix_cache_queries = property(lambda self: self.kv.prefix_cache_queries)
    prefix_cache_hits = property(lambda self: self.kv.prefix_cache_hits)
    num_swap_outs = property(lambda self: self.kv.num_swap_outs)
    num_swap_ins = property(lambda self: self.kv.num_swap_ins)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # --- one step ------------------------------------------------------------------------------

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting sequences still have to compute (admission control, metrics)."""
        return self._num_waiting_tokens

    def _count_waiting(self, sequence: Sequence) -> None:
        """(Re)count a waiting sequence's tokens to compute: as it joins the queue, or when a token
        still in flight when it was preempted lands."""
        n = sequence.num_tokens - sequence.num_computed_tokens
        self._num_waiting_tokens += n - self._waiting_counts.get(sequence.seq_id, 0)
        self._waiting_counts[sequence.seq_id] = n

    def _leave_waiting(self, sequence: Sequence, head: bool = False) -> None:
        if head:
            assert self.waiting[0] is sequence
            self.waiting.popleft()
        else:
            self.waiting.remove(sequence)
        self._num_waiting_tokens -= self._waiting_counts.pop(sequence.seq_id)

    def _priority_key(self, sequence: Sequence, now: float) -> tuple[float, float]:
        """Smaller is served first: priority, minus one level per priority_aging_s of waiting."""
        return (sequence.priority - (now - sequence.arrival_time) / self.cfg.priority_aging_s, sequence.arrival_time)

    def _rank(self, sequence: Sequence, now: float) -> tuple:
        """Smaller is admitted first and preempted last: interactive before background work (which
        yields to it under every policy), then under policy=priority the aged priority."""
        if self.cfg.policy == "priority":
            return (sequence.background, *self._priority_key(sequence, now))
        return (sequence.background,)

    def _choose_victim(self, now: float) -> Sequence:
        if self.cfg.policy == "priority":  # background first, then the worst priority, newest first
            return max(self.running, key=lambda r: self._rank(r, now))
        # Background first; recompute costs what the victim has computed: then the one that computed
        # least (newest on ties).
        return max(self.running, key=lambda r: (r.background, -r.num_computed_tokens, r.arrival_time))

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        scheduled: dict[SequenceId, ScheduledSequence] = {}
        preempted: list[str] = []
        now = self.clock()
        if self.cfg.policy == "priority":
            self.running.sort(key=lambda r: self._rank(r, now))
            self.waiting = deque(sorted(self.waiting, key=lambda r: self._rank(r, now)))
        elif self._num_background:  # stable: each kind keeps its order, background behind interactive
            self.running.sort(key=lambda r: r.background)
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.background))

        if self.speculation is not None:
            self._propose()
        for sequence in list(self.running):
            if sequence.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(sequence, budget)
            if num_new == 0:
                continue
            drafts: list[int] = []
            probs_row = -1
            num_blocks = len(sequence.block_ids)
            if self.speculation is not None and num_new == 1 and not sequence.is_prefilling:
                proposal = self._drafts(sequence, budget)
                drafts, probs_row = proposal.token_ids, proposal.probs_row
                if drafts and not self.kv.allocate(sequence, 1 + len(drafts)):
                    drafts = []  # drafts never preempt: without room for them it decodes plainly
                num_new += len(drafts)
            while not self.kv.allocate(sequence, num_new):
                victim = self._choose_victim(now)
                budget += self._preempt(victim, scheduled)
                preempted.append(victim.seq_id)
                if victim is sequence:
                    break
            else:
                scheduled[sequence.seq_id] = self._scheduled(sequence, num_new, drafts, num_blocks, probs_row)
                budget -= num_new

        ranked = self.cfg.policy == "priority" or (self._num_background > 0 and self.cfg.policy != "static")
        if not preempted and ranked:
            preempted += self._preempt_for_rank(now, scheduled)
        for seq in scheduled.values():  # final now: what they fill is findable by the admissions below
            self.kv.register_full_blocks(self.sequences[seq.seq_id],
                                         seq.start_position + len(seq.token_ids) - len(seq.draft_token_ids))
        if not preempted:
            budget = self._admit(budget, scheduled)

        swap_in, swap_out = self.kv.take_swaps()
        restore, offload = self.kv.take_host_tier_copies()
        return SchedulerOutput(list(scheduled.values()), preempted, swap_in, swap_out, restore, offload)

    def _num_new_tokens(self, sequence: Sequence, budget: int) -> int:
        if self.in_flight.verifying(sequence):
            return 0  # how many tokens its verify step accepts is not known yet
        num_tokens = sequence.num_tokens
        if self.in_flight.last_token_in_flight(sequence):
            done = sequence.num_output_tokens >= sequence.sampling_params.max_tokens
            if done or num_tokens >= self.max_model_len:
                return 0  # its token in flight is its last: computing past it would be wasted
            if sequence.constraint is not None and sequence.constraint.depends_on_last_token:
                return 0  # its next bitmask needs that token: it sits this step out (it advances every other)
        num_new = min(num_tokens - sequence.num_computed_tokens, budget)
        if self.cfg.long_prefill_token_threshold is not None and sequence.is_prefilling:
            num_new = min(num_new, self.cfg.long_prefill_token_threshold)
        return max(0, num_new)

    def _room_for_drafts(self, sequence: Sequence) -> int:
        """The most drafts a sequence may verify: its max_tokens and max_model_len less its next token."""
        return min(sequence.sampling_params.max_tokens - sequence.num_output_tokens - 1,
                   self.max_model_len - sequence.num_tokens - 1)

    def _propose(self) -> None:
        """The step's proposals, asked once for every decoding sequence that may speculate (speculation.py)."""
        candidates = [
            (s, self.in_flight.last_token_in_flight(s), self.in_flight.row_of(s)) for s in self.running
            if s.status is RequestStatus.RUNNING and not s.is_prefilling and not self.in_flight.verifying(s)
            and s.num_tokens - s.num_computed_tokens == 1
        ]
        self.speculation.prepare(candidates, len(self.running), self._room_for_drafts)

    def _drafts(self, sequence: Sequence, budget: int):
        """The drafts a decoding sequence verifies this step, and where their probabilities are (a Proposal)."""
        return self.speculation.drafts(sequence, min(budget - 1, self._room_for_drafts(sequence)))

    def _preempt(self, victim: Sequence, scheduled: dict[SequenceId, ScheduledSequence]) -> int:
        """Free the victim's blocks and requeue it at the head; return the budget it gives back.

        Swap mode copies the blocks holding its computed tokens to host memory first (the
        runner does it before this step's writes can reuse them) and keeps its progress;
        when the host pool is full it falls back to recompute."""
        self.running.remove(victim)
        returned = scheduled.pop(victim.seq_id, None)
        swap = self.kv.preempt(victim, swap=self.cfg.preemption_mode == "swap")
        if self.lora_slots is not None:
            self.lora_slots.release(victim)
        if not swap:
            victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        self._count_waiting(victim)
        log.debug("preempted %s (%s)", victim.seq_id, "swap" if swap else "recompute")
        return len(returned.token_ids) if returned else 0

    def _preempt_for_rank(self, now: float, scheduled: dict[SequenceId, ScheduledSequence]) -> list[str]:
        """A waiting sequence that cannot be admitted but outranks a running one (`_rank`) takes its place:
        the worst running sequence is preempted now, and the waiting one is admitted next step.
        Called before any block of this step is registered, so a victim leaves no block findable
        that the step will not fill."""
        if not self.waiting or not self.running:
            return []
        head = self.waiting[0]
        worst = self._choose_victim(now)
        if self._rank(head, now) >= self._rank(worst, now):
            return []
        first_chunk = min(head.num_tokens, self.cfg.max_num_batched_tokens)
        blocked = len(self.running) >= self.cfg.max_num_seqs or not self.kv.can_admit(CachedPrefix(), first_chunk)
        if not blocked:  # it waits for budget, not for room: preempting would not help
            return []
        self._preempt(worst, scheduled)
        # keep the outranking sequence first in line (the victim went to the head)
        self.waiting.remove(head)
        self.waiting.appendleft(head)
        return [worst.seq_id]

    def _admit(self, budget: int, scheduled: dict[SequenceId, ScheduledSequence]) -> int:
        if not self.waiting or (self.cfg.policy == "static" and self.running):
            return budget  # nothing waits; or a static batch runs until every member finishes
        # A static batch is formed whole -- every member that fits the cache joins now, whether or
        # not this step's budget reaches it; members the budget misses start in the next steps.
        static = self.cfg.policy == "static"
        # Partial prefills are counted after this step: a prompt whose last chunk runs now leaves its
        # place to the next one in the same step. Counting it would leave every other step a lone
        # prompt tail beside the decodes (at 32-token outputs, 199 of 430 steps).
        num_partial = sum(1 for r in self.running if self._still_prefilling_after(r, scheduled))
        # Sequences whose LoRA adapter finds no free device slot: set aside (in order) while the ones
        # behind them are admitted, then put back at the head of the queue.
        no_slot: list[Sequence] = []
        while self.waiting and (budget > 0 or static) and len(self.running) < self.cfg.max_num_seqs:
            sequence = self.waiting[0]
            if self.in_flight.verifying(sequence):
                break  # preempted while its verify step ran: its tokens are not known yet
            if self.lora_slots is not None and not self.lora_slots.can_acquire(sequence):
                no_slot.append(self.waiting.popleft())  # still counted as waiting: it stays in the queue
                continue
            if sequence.host_block_ids:
                admitted = self._admit_swapped(sequence, budget, scheduled)
                if admitted == 0:
                    break
                budget -= admitted
                continue
            # prompt_logprobs needs every prompt row's logits: such a sequence computes its whole prompt
            # (its n > 1 followers report none: they share it).
            wants_prompt_rows = sequence.sampling_params.prompt_logprobs is not None and sequence.parent_id is None
            share = CachedPrefix() if wants_prompt_rows else self.kv.cached_prefix(sequence)
            start = share.num_tokens
            if self.cfg.enable_chunked_prefill or sequence.num_preemptions or static:
                num_new = min(sequence.num_tokens - start, budget)
            else:
                num_new = sequence.num_tokens - start
                if num_new > budget:
                    break
            if self.cfg.long_prefill_token_threshold is not None:
                num_new = min(num_new, self.cfg.long_prefill_token_threshold)
            partial = start + num_new < sequence.num_prompt_tokens
            if not static and partial and num_partial >= self.cfg.max_num_partial_prefills:
                break
            reserve = sequence.num_prompt_tokens + sequence.sampling_params.max_tokens
            total = reserve if self.cfg.policy == "static" else start + num_new
            if not self.kv.can_admit(share, total):
                break
            if self.lora_slots is not None:
                self.lora_slots.acquire(sequence)  # can_acquire said yes above
            self._leave_waiting(sequence, head=True)
            self.kv.admit(sequence, share, total)
            sequence.num_computed_tokens = start
            if sequence.num_cached_tokens is None:
                sequence.num_cached_tokens = start
            sequence.status = RequestStatus.RUNNING
            if sequence.first_scheduled_time is None:
                sequence.first_scheduled_time = time.monotonic()
            self.running.append(sequence)
            if num_new > 0:
                scheduled[sequence.seq_id] = self._scheduled(sequence, num_new)
                self.kv.register_full_blocks(sequence, start + num_new)  # findable by the next admissions
                budget -= num_new
            if partial:
                num_partial += 1
        self.waiting.extendleft(reversed(no_slot))
        return budget

    @staticmethod
    def _still_prefilling_after(sequence: Sequence, scheduled: dict[SequenceId, ScheduledSequence]) -> bool:
        if not sequence.is_prefilling:
            return False
        seq = scheduled.get(sequence.seq_id)
        return seq is None or seq.start_position + len(seq.token_ids) < sequence.num_prompt_tokens

    def _admit_swapped(self, sequence: Sequence, budget: int, scheduled: dict[SequenceId, ScheduledSequence]) -> int:
        """Bring a swapped-out sequence back: fresh device blocks, its host blocks copied in; return
        the tokens it takes this step (0: it does not fit yet)."""
        start = sequence.num_computed_tokens
        num_new = min(sequence.num_tokens - start, budget)
        if self.cfg.long_prefill_token_threshold is not None:
            num_new = min(num_new, self.cfg.long_prefill_token_threshold)
        if num_new <= 0 or not self.kv.can_admit(CachedPrefix(), start + num_new):
            return 0
        if self.lora_slots is not None and not self.lora_slots.acquire(sequence):
            return 0
        self._leave_waiting(sequence, head=True)
        self.kv.swap_in_blocks(sequence, start + num_new)
        sequence.status = RequestStatus.RUNNING
        self.running.append(sequence)
        scheduled[sequence.seq_id] = self._scheduled(sequence, num_new)
        self.kv.register_full_blocks(sequence, start + num_new)  # its swapped-in blocks, then this step's
        return num_new

    def _scheduled(self, sequence: Sequence, num_new: int, drafts: list[int] = (), num_blocks: int = 0,
                   probs_row: int = -1) -> ScheduledSequence:
        start, stop = sequence.num_computed_tokens, sequence.num_computed_tokens + num_new - len(drafts)
        params = sequence.sampling_params
        num_prompt, num_output = len(sequence.prompt_token_ids), len(sequence.output_token_ids)
        banned: tuple[int, ...] = ()
        if num_output < params.min_tokens:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else sequence.eos_token_ids)
        targets = None
        if params.prompt_logprobs is not None and sequence.parent_id is None and start + 1 < num_prompt:
            targets = sequence.prompt_token_ids[start + 1 : min(stop + 1, num_prompt)]
        token_ids, in_flight_row = self.in_flight.token_ids_for_step(sequence, start, stop)
        if drafts:
            token_ids = token_ids + list(drafts)
        num_blocks_kept, sequence.num_blocks_kept = sequence.num_blocks_kept, None
        return ScheduledSequence(
            seq_id=sequence.seq_id,
            start_position=start,
            token_ids=token_ids,
            block_ids=sequence.block_ids,  # no copy: the KV-cache manager replaces the list, never extends it
            block_epoch=sequence.block_epoch,
            num_blocks_kept=num_blocks_kept,
            lora_slot=sequence.lora_slot,
            samples=stop == num_prompt + num_output,
            num_prompt_tokens=num_prompt,
            num_output_tokens=num_output,
            sampling_params=params,
            seed=sequence.seed,
            banned_token_ids=banned,
            prior_token_ids=functools.partial(sequence.token_ids, 0, start) if params.uses_penalties else None,
            in_flight_row=in_flight_row,
            constraint=sequence.constraint,
            prompt_logprob_targets=targets,
            draft_token_ids=tuple(drafts),
            draft_probs_row=probs_row if drafts else -1,
            num_blocks_without_drafts=num_blocks,
            uncounted_token_ids=Speculation.take_uncounted(sequence) if params.uses_penalties else (),
        )

    # --- applying a step's results -------------------------------------------------------------

    def commit(self, out: SchedulerOutput) -> None:
        """The step was dispatched: advance computed tokens now, and put each sampling sequence's
        next token in flight, so the next step can be scheduled (and read that token on the
        device) before this one's results reach the host."""
        for seq in out.scheduled:
            sequence = self.sequences.get(seq.seq_id)
            if sequence is not None:
                sequence.num_computed_tokens = seq.start_position + len(seq.token_ids) - len(seq.draft_token_ids)
        self.in_flight.dispatched(out, self.sequences)

    def update(
        self, out: SchedulerOutput, runner_out: RunnerOutput
    ) -> list[tuple[Sequence, int, Optional[dict[int, float]]]]:
        """Resolve the step's in-flight tokens to the sampled ones and register the blocks that were
        full but for one of them (their K/V are computed, or computed by a step already dispatched);
        return (sequence, new token, its logprobs with the top ones, or None) of each sampling sequence."""
        touched = []
        now = time.monotonic()
        for seq in out.scheduled:
            sequence = self.sequences.get(seq.seq_id)
            if sequence is None:
                continue  # finished or aborted since
            sampled = runner_out.sampled.get(seq.seq_id) if seq.samples else None
            if sampled is not None:
                if seq.draft_token_ids:
                    new = self._verified(sequence, seq, runner_out.verified[seq.seq_id])
                else:
                    self.in_flight.resolve(sequence, seq.num_output_tokens, sampled.token_id)
                    new = (sampled,)
                if sequence.first_token_time is None:
                    sequence.first_token_time = now
                for token in new:
                    top = None
                    if sequence.sampling_params.logprobs is not None:
                        top = dict(token.top_logprobs or {})
                        top[token.token_id] = token.logprob
                    touched.append((sequence, token.token_id, top))
                if sequence.seq_id in self._waiting_counts:  # preempted while its token was in flight
                    self._count_waiting(sequence)
            if sequence.status is RequestStatus.RUNNING:
                self.kv.register_full_blocks(sequence, sequence.num_computed_tokens)
        return touched

    def _verified(self, sequence: Sequence, seq: ScheduledSequence, rows: list) -> list:
        """Apply a verify step: the drafts up to the first the target disagrees with are accepted,
        then the target's own token at that row; return those tokens (SampledTokens). A draft is
        accepted exactly when it is the token the target sampled at its row: the rejection rule for a
        deterministic proposer, so the output is the target's, token for token."""
        drafts = seq.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and rows[accepted].token_id == drafts[accepted]:
            accepted += 1
        new = rows[: accepted + 1]
        self.in_flight.resolve_verified(sequence, seq.num_output_tokens, [t.token_id for t in new])
        if sequence.block_epoch == seq.block_epoch:  # it still holds the blocks its drafts' K/V went to
            sequence.num_computed_tokens += accepted
            if sequence.status is RequestStatus.RUNNING:  # the blocks only rejected drafts needed go back
                keep = max(seq.num_blocks_without_drafts, self.kv.num_blocks_for(sequence.num_tokens))
                self.kv.release_blocks_past(sequence, keep)
        self.speculation.verified(sequence, drafts, accepted)
        return new
