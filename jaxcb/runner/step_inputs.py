"""Host batch building: a SchedulerOutput becomes the flat, padded arrays of one step.

Only the runner turns host lists into device arrays, and this is where: whole-array numpy
operations over per-sequence columns, written into a copy of the bucket's packed vectors
(`step_args.py`: `StepInputs`, the model's and the sampler's parts, and `StepArgs` as they travel).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
from typing import Callable, Optional

import jax
import numpy as np

from jaxcb.runner.buckets import BucketKey, Buckets
from jaxcb.runner.slots import SlotTable
from jaxcb.runner.step_args import (
    PackedTemplate, StepArgs, StepInputs, model_inputs, sampler_inputs, table_update_capacity,
)
from jaxcb.sampling import StepVariant, sampling_level
from jaxcb.core.step import ScheduledSequence, SchedulerOutput

log = logging.getLogger(__name__)

WRITE_CHUNK = 1024  # entries per call of the slot writer (what a step's own updates cannot hold)
# The SamplingParams floats each row carries, as SamplingArrays names them.
SLOT_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclasses.dataclass
class SlotWrites:
    """What the slot writer (`slots.write_slots`) puts on the device before a step: chunks of
    WRITE_CHUNK entries, padded with slot `num_slots` (dropped); the resets go with the first."""

    table_updates: list  # [i32[3, WRITE_CHUNK]]: (slot, column, block)
    reset_slots: np.ndarray  # i32[max_rows]: slots whose penalty counts restart from zero
    counted: list  # [i32[3, WRITE_CHUNK]]: (slot, token, is_output) recorded after the resets


def _column(seqs: list[ScheduledSequence], name: str, dtype=np.int64, of: Optional[Callable] = None) -> np.ndarray:
    """One field of every scheduled sequence (or `of` it) as an array: one C-level pass, no Python loop."""
    values = map(operator.attrgetter(name), seqs)
    return np.fromiter(values if of is None else map(of, values), dtype, len(seqs))


@dataclasses.dataclass
class StepInputBuilder:
    """Builds each step's inputs; holds sizes, which slot each sequence holds and, per slot, its
    sequence's sampling values (fixed for its life: written when it takes the slot, gathered by
    slot every step)."""

    buckets: Buckets
    block_size: int
    vocab_size: int
    max_banned: int  # engine.max_stop_token_ids
    max_logit_bias: int  # engine.max_logit_bias
    # The least ready variant at or above the one a step needs (`StepCompiler.serving`); None: none is.
    serving: Callable[[StepVariant], Optional[StepVariant]]
    slots: SlotTable
    sharding: Optional[jax.sharding.Sharding] = None  # tensor parallelism: replicated on the mesh
    max_drafts: int = 0  # speculative decoding's k (0: off): the width of the rows' drafts (`StepInputs.row_drafts`)
    lora: bool = False  # LoRA compiled in: each token row carries its adapter's slot (`ModelInputs.lora_ids`)
    draft_probs: bool = False  # a draft model proposes: rows say which of its distributions drew their draft

    def __post_init__(self) -> None:
        num_slots = self.slots.num_slots
        self._templates: dict[BucketKey, PackedTemplate] = {}
        # Each slot's sequence's fixed values: its SamplingParams' floats, in SLOT_FLOATS' order ...
        self._slot_floats = np.zeros((len(SLOT_FLOATS), num_slots), np.float32)  # f32[6, num_slots]
        self._slot_top_k = np.zeros(num_slots, np.int32)  # i32[num_slots]
        self._slot_seeds = np.zeros(num_slots, np.uint32)  # u32[num_slots]: each seed's low 32 bits
        self._slot_seeds_hi = np.zeros(num_slots, np.uint32)  # and its high 32
        self._slot_num_prompt = np.zeros(num_slots, np.int32)  # i32[num_slots]
        # ... and what its params need of a step: the sampling level, and whether it samples masked.
        self._slot_level = np.zeros(num_slots, np.int8)  # i8[num_slots]: a StepVariant
        self._slot_masked = np.zeros(num_slots, bool)  # bool[num_slots]

    def variant(self, seqs: list[ScheduledSequence], row_slots: np.ndarray, samples: np.ndarray,
                num_banned: np.ndarray) -> StepVariant:
        """The least ready variant that serves the step: PROMPT_LOGPROBS when a sequence asks for its
        prompt's logprobs in this chunk, MASKED when a sampling row has a token constraint or a logit bias,
        else the sampling level its rows need (`jaxcb.sampling.sampling_level`: each row's params', and
        RANDOM when a sampling row has banned ids). `row_slots` i64[n], `samples` bool[n], `num_banned` i64[n]."""
        if any(map(operator.attrgetter("prompt_logprob_targets"), seqs)):
            needed = StepVariant.PROMPT_LOGPROBS
        elif (self._slot_masked[row_slots] & samples).any():
            needed = StepVariant.MASKED
        else:
            banned = StepVariant.RANDOM if (samples & (num_banned > 0)).any() else StepVariant.GREEDY
            needed = StepVariant(max(int(self._slot_level[row_slots].max(initial=0)), banned))
        variant = self.serving(needed)
        if variant is None:  # the engine holds back requests whose variant is not ready
            raise RuntimeError(f"no compiled step variant serves a {needed.label} step yet; this is a bug")
        return variant

    def template(self, key: BucketKey) -> PackedTemplate:
        if key not in self._templates:
            self._templates[key] = PackedTemplate(StepInputs(
                model_inputs(key.model, block_size=self.block_size, num_slots=self.slots.num_slots, lora=self.lora),
                sampler_inputs(key.sampler, max_banned=self.max_banned, vocab_size=self.vocab_size,
                               max_logit_bias=self.max_logit_bias, max_drafts=self.max_drafts,
                               draft_probs=self.draft_probs)))
        return self._templates[key]

    def build(self, out: SchedulerOutput, prev_tokens: jax.Array
              ) -> tuple[BucketKey, StepArgs, Optional[SlotWrites]]:
        """(the bucket and variant, the packed inputs, what the slot writer must write first, or None)
        of one step. `prev_tokens`: the previous step's sampled tokens, on the device, which feed each
        sequence's token in flight (`ScheduledSequence.in_flight_row`)."""
        # Built with whole-array numpy operations over per-sequence columns, each gathered in one
        # C-level pass (`_column`), and written into a copy of the bucket's packed vectors at their
        # padding values (`PackedTemplate`): with async scheduling this host work shares the CPU
        # with the step it overlaps, so every Python operation per sequence and step costs device
        # time. The only Python loop over the sequences is the slot table's (`_slot_updates`); the
        # sampling values come from each slot's, written when its sequence took it. Nothing here
        # is as long as a block table or a context: the tables stay on the device (`slots.py`), and
        # a step ships the blocks its sequences gained and the blocks its tokens write to.
        seqs = out.scheduled
        n = len(seqs)
        lens = _column(seqs, "token_ids", of=len)
        starts = _column(seqs, "start_position")
        num_tokens = int(lens.sum())
        num_drafts = _column(seqs, "draft_token_ids", of=len) if self.max_drafts else None
        verifies = num_drafts is not None and bool(num_drafts.any())
        num_rows = n + int(num_drafts.sum()) if verifies else n
        bs = self.block_size
        # The width follows the longest context, not the blocks held: a static batch reserves its
        # whole outputs' blocks at admission, and a decoding sequence may hold a run ahead.
        bucket = self.buckets.pick(num_tokens, num_rows, int(-(-(starts + lens).max() // bs)))
        t, r = bucket.num_tokens, bucket.num_seqs
        seq_slots, table, writes = self._slot_updates(seqs, t, r)
        samples = _column(seqs, "samples", bool)
        num_banned = _column(seqs, "banned_token_ids", of=len)
        key = BucketKey(*bucket, self.variant(seqs, seq_slots, samples, num_banned))
        vectors, x = self.template(key).fresh()

        begins, pos, slot_mapping = self._token_places(seqs, lens, starts)
        ends = begins + lens
        x.token_ids[:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(map(operator.attrgetter("token_ids"), seqs)), np.int32, num_tokens)
        x.positions[:num_tokens] = pos
        x.slot_mapping[:num_tokens] = slot_mapping  # padding: the null block
        if self.lora:
            x.lora_ids[:num_tokens] = np.repeat(_column(seqs, "lora_slot"), lens)
        num_output = _column(seqs, "num_output_tokens")
        if verifies:
            # Speculative decoding: a sequence verifying k drafts takes 1 + k rows, one per token, each
            # attending to the context up to its own token and sampling the token after it.
            row_seq, row_offset, row_begins, row_lens = self._verify_rows(num_drafts, begins, lens)
            row_slots = seq_slots[row_seq]
            x.token_rows[:num_tokens] = np.repeat(np.arange(num_rows), row_lens)
            x.token_rows[row_begins[row_offset > 0]] = r  # drafts: not counted (penalties)
            x.query_start_loc[:num_rows] = row_begins
            x.kv_lens[:num_rows] = starts[row_seq] + (row_begins - begins[row_seq]) + row_lens
            x.logits_indices[:num_rows] = row_begins + row_lens - 1
            x.counters[:num_rows] = num_output[row_seq] + row_offset
        else:
            row_seq = row_offset = None
            row_slots = seq_slots
            x.token_rows[:num_tokens] = np.repeat(np.arange(n), lens)
            x.query_start_loc[:n] = begins
            x.kv_lens[:n] = starts + lens
            x.logits_indices[:n] = ends - 1
            x.counters[:n] = num_output
        x.query_start_loc[num_rows:] = num_tokens
        x.num_seqs[()] = num_rows
        x.sample_rows[()] = num_rows
        x.row_slots[:num_rows] = row_slots
        x.table_updates[:, : table.shape[1]] = table
        # A sequence's last token may still be in flight (async scheduling): the step reads it from
        # its row of the previous step's tokens on the device, never from these ids.
        in_flight_rows = _column(seqs, "in_flight_row")
        in_flight = in_flight_rows >= 0
        last_known = ends - 1 - num_drafts if verifies else ends - 1  # drafts follow a token in flight
        x.prev_rows[last_known[in_flight]] = in_flight_rows[in_flight]

        for name, values in zip(SLOT_FLOATS, self._slot_floats[:, row_slots]):
            getattr(x, name)[:num_rows] = values
        x.top_k[:num_rows] = self._slot_top_k[row_slots]
        x.seeds[:num_rows] = self._slot_seeds[row_slots]
        x.seeds_hi[:num_rows] = self._slot_seeds_hi[row_slots]
        if verifies:
            self._fill_verify_banned(seqs, row_seq, row_offset, x.banned_token_ids)
            if key.variant >= StepVariant.FULL:
                self._fill_row_drafts(seqs, row_seq, row_offset, x.row_drafts)
            if self.draft_probs and key.variant >= StepVariant.RANDOM:
                self._fill_draft_rows(seqs, row_seq, row_offset, x.verify_draft_ids, x.verify_probs_rows)
        else:
            for i in np.flatnonzero(num_banned).tolist():
                ids = seqs[i].banned_token_ids[: self.max_banned]
                x.banned_token_ids[i, : len(ids)] = ids
        x.num_prompt[:num_rows] = self._slot_num_prompt[row_slots]
        if key.variant >= StepVariant.FULL:
            x.penalty_slots[:num_rows] = row_slots
        if key.variant >= StepVariant.MASKED:
            self._fill_token_masks(seqs, x.bitmask, x.bias_ids, x.bias_values,
                                   row_seq.tolist() if row_seq is not None else range(n))
        if key.variant >= StepVariant.PROMPT_LOGPROBS:
            self._fill_prompt_targets(seqs, begins, x.prompt_targets)
        # Host arrays go to the executables as they are (packed into three, `StepArgs`): their C++
        # call path copies them in, where a jnp.asarray or device_put per array (tens a step) cost
        # ~4 ms of Python a step on CPU. Under TP one device_put replicates them on every device (on
        # several hosts, each process supplies its own identical copy).
        args = StepArgs(*vectors, prev_tokens)
        if self.sharding is not None:  # arrays already there (prev_tokens) are not copied
            args = jax.device_put(args, self.sharding)
        return key, args, writes

    @staticmethod
    def _verify_rows(num_drafts: np.ndarray, begins: np.ndarray, lens: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(each row's sequence, its index among its sequence's rows, its first token's index in the
        step, its tokens), all i64[rows]: a sequence with k drafts has 1 + k rows of one token, the
        others one row of all their tokens."""
        rows_per_seq = 1 + num_drafts
        row_seq = np.repeat(np.arange(len(num_drafts)), rows_per_seq)
        row_offset = np.arange(len(row_seq)) - np.repeat(np.cumsum(rows_per_seq) - rows_per_seq, rows_per_seq)
        verify_row = num_drafts[row_seq] > 0
        return row_seq, row_offset, begins[row_seq] + row_offset, np.where(verify_row, 1, lens[row_seq])

    def _fill_verify_banned(self, seqs: list[ScheduledSequence], row_seq: np.ndarray, row_offset: np.ndarray,
                            banned: np.ndarray) -> None:
        """Each row's banned ids (min_tokens): a verify row j samples output token num_output + j, banned
        while that is below min_tokens."""
        for row, (i, j) in enumerate(zip(row_seq.tolist(), row_offset.tolist())):
            s = seqs[i]
            if not s.banned_token_ids:
                continue
            if j and s.num_output_tokens + j >= s.sampling_params.min_tokens:
                continue
            ids = s.banned_token_ids[: self.max_banned]
            banned[row, : len(ids)] = ids

    @staticmethod
    def _fill_row_drafts(seqs: list[ScheduledSequence], row_seq: np.ndarray, row_offset: np.ndarray,
                         row_drafts: np.ndarray) -> None:
        """Verify row j's drafts 1..j, which its penalties count (the step records only known tokens)."""
        for row in np.flatnonzero(row_offset).tolist():
            j = int(row_offset[row])
            row_drafts[row, :j] = seqs[int(row_seq[row])].draft_token_ids[:j]

    @staticmethod
    def _fill_draft_rows(seqs: list[ScheduledSequence], row_seq: np.ndarray, row_offset: np.ndarray,
                         draft_ids: np.ndarray, probs_rows: np.ndarray) -> None:
        """A draft model's verify row j (below k): draft j + 1, which it checks against its q (the
        distributions' row draft_probs_row + j); its last row (the bonus token) verifies none."""
        for row, (i, j) in enumerate(zip(row_seq.tolist(), row_offset.tolist())):
            s = seqs[i]
            if s.draft_probs_row >= 0 and j < len(s.draft_token_ids):
                draft_ids[row] = s.draft_token_ids[j]
                probs_rows[row] = s.draft_probs_row + j

    def _token_places(self, seqs: list[ScheduledSequence], lens: np.ndarray, starts: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each sequence's first token's index in the step (i64[n]), and each token's position and
        K/V slot (block * block_size + offset) (i64[num_tokens]), from the blocks the tokens write to."""
        bs, block_ids = self.block_size, map(operator.attrgetter("block_ids"), seqs)
        if (lens == 1).all():
            # Decode rows only (the steady state): one token each, in the block its start falls in.
            blocks = np.fromiter(map(operator.getitem, block_ids, (starts // bs).tolist()), np.int64, len(seqs))
            return np.arange(len(seqs)), starts, blocks * bs + starts % bs
        ends = np.cumsum(lens)
        begins = ends - lens
        pos = np.arange(ends[-1]) - np.repeat(begins - starts, lens)
        # Each sequence's blocks from its first token's to its last's, one after the other.
        first_block, last_block = starts // bs, (starts + lens - 1) // bs
        step_blocks = np.fromiter(itertools.chain.from_iterable(map(
            operator.getitem, block_ids, map(slice, first_block.tolist(), (last_block + 1).tolist()))), np.int64)
        num_blocks = last_block - first_block + 1
        token_block = pos // bs - np.repeat(first_block - (np.cumsum(num_blocks) - num_blocks), lens)
        return begins, pos, step_blocks[token_block] * bs + pos % bs

    def _slot_updates(self, seqs: list[ScheduledSequence], t: int, r: int
                      ) -> tuple[np.ndarray, np.ndarray, Optional[SlotWrites]]:
        """Each sequence's slot (i64[n]), the block-table entries the step writes itself (i32[3, k],
        k <= the bucket's capacity), and what the writer must write before it: tables too long for the
        step's own updates, and the penalty counts of sequences new to their slots. A sequence new to
        its slot also leaves its sampling values there."""
        num_slots = self.slots.num_slots
        row_slots = []
        new_slots, new_cols, new_blocks, resets, counted = [], [], [], [], []  # the first three: Python ints
        use, add_row = self.slots.use, row_slots.append
        for s in seqs:
            entry, fresh = use(s.seq_id, s.block_epoch)
            add_row(entry.slot)
            if fresh:
                self._remember(entry.slot, s)
            elif s.num_blocks_kept is not None:  # blocks past its accepted drafts went back (speculation)
                entry.num_blocks = min(entry.num_blocks, s.num_blocks_kept)
            if len(s.block_ids) > entry.num_blocks:
                gained = s.block_ids[entry.num_blocks :]
                new_slots += [entry.slot] * len(gained)
                new_cols += range(entry.num_blocks, len(s.block_ids))
                new_blocks += gained
                entry.num_blocks = len(s.block_ids)
            if fresh and s.prior_token_ids is not None:  # penalties: count what came before this step
                resets.append(entry.slot)
                prior = np.asarray(s.prior_token_ids(), np.int32)
                counted.append(np.stack([np.full(len(prior), entry.slot, np.int32), prior,
                                         (np.arange(len(prior)) >= s.num_prompt_tokens).astype(np.int32)]))
            elif s.uncounted_token_ids:  # drafts an earlier verify step accepted: output tokens
                uncounted = np.asarray(s.uncounted_token_ids, np.int32)
                counted.append(np.stack([np.full(len(uncounted), entry.slot, np.int32), uncounted,
                                         np.ones(len(uncounted), np.int32)]))
        table = np.array([new_slots, new_cols, new_blocks], np.int32).reshape(3, -1)
        in_step = table
        if table.shape[1] <= table_update_capacity(t, r, self.block_size):
            table = np.zeros((3, 0), np.int32)
        else:
            in_step = np.zeros((3, 0), np.int32)
        row_slots = np.array(row_slots, np.int64)
        if not resets and not counted and not table.shape[1]:
            return row_slots, in_step, None
        reset_slots = np.full(self.buckets.max_num_seqs, num_slots, np.int32)
        reset_slots[: len(resets)] = resets
        counted_all = np.concatenate(counted, axis=1) if counted else np.zeros((3, 0), np.int32)
        return row_slots, in_step, SlotWrites(_chunks(table, num_slots), reset_slots, _chunks(counted_all, num_slots))

    def _remember(self, slot: int, s: ScheduledSequence) -> None:
        """The sampling values of the sequence that takes `slot`: fixed while it holds it."""
        p = s.sampling_params
        self._slot_floats[:, slot] = [getattr(p, name) for name in SLOT_FLOATS]
        # The k best of a vocabulary of V <= k are all of it: no limit (and no int32 overflow for a huge k).
        self._slot_top_k[slot] = p.top_k if p.top_k < self.vocab_size else 0
        self._slot_seeds[slot] = s.seed & 0xFFFFFFFF
        self._slot_seeds_hi[slot] = s.seed >> 32
        self._slot_num_prompt[slot] = s.num_prompt_tokens
        self._slot_level[slot] = sampling_level([p], False)
        self._slot_masked[slot] = p.uses_masked_step

    @staticmethod
    def _fill_token_masks(seqs: list[ScheduledSequence], bitmask: np.ndarray, bias_ids: np.ndarray,
                          bias_values: np.ndarray, row_seq) -> None:
        """Each sampling row's allowed tokens (its constraint's bitmask; all, for rows without one) and bias.
        `row_seq`: each row's sequence (a sequence with a constraint never verifies drafts: one row)."""
        for row, i in enumerate(row_seq):
            s = seqs[i]
            if not s.samples:
                continue
            if s.constraint is not None:
                if not s.constraint.failed:
                    try:
                        s.constraint.fill(bitmask[row])
                    except Exception:  # noqa: BLE001 -- one request's matcher failing must not stop the others
                        log.exception("request %s: its constraints failed to give the allowed tokens; it ends here "
                                      "(finish_reason abort)", s.seq_id.request_id)
                        s.constraint.failed = s.constraint.dead_end = True
                if s.constraint.failed:
                    bitmask[row] = -1  # any token: the output processor drops the row's draw (dead_end), ends it
            bias = s.sampling_params.logit_bias
            if bias:
                bias_ids[row, : len(bias)] = list(bias.keys())
                bias_values[row, : len(bias)] = list(bias.values())

    @staticmethod
    def _fill_prompt_targets(seqs: list[ScheduledSequence], begins: np.ndarray, targets: np.ndarray) -> None:
        for s, begin in zip(seqs, begins.tolist()):
            if s.prompt_logprob_targets:
                targets[begin : begin + len(s.prompt_logprob_targets)] = s.prompt_logprob_targets


def _chunks(entries: np.ndarray, pad_slot: int) -> list[np.ndarray]:
    """i32[3, N] as i32[3, WRITE_CHUNK] pieces, the last padded with slot `pad_slot` (dropped)."""
    out = []
    for at in range(0, entries.shape[1], WRITE_CHUNK):
        piece = np.full((3, WRITE_CHUNK), pad_slot, np.int32)
        piece[:, : min(WRITE_CHUNK, entries.shape[1] - at)] = entries[:, at : at + WRITE_CHUNK]
        out.append(piece)
    return out
