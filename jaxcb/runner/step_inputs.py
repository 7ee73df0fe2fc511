"""Host batch building: a SchedulerOutput becomes the flat, padded arrays of one step.

Only the runner turns host lists into device arrays, and this is where. The inputs
(`StepInputs`, DESIGN.md "Data flow of one step") are built with whole-array numpy operations
and travel packed into one int32 and one float32 vector (`StepArgs`); the step cuts them back
into `StepInputs` (`unpack_step_inputs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.runner.buckets import BucketKey, Buckets
from jaxcb.runner.slots import SlotTable
from jaxcb.sampling import SamplingArrays, StepVariant, TokenMasks, sampling_level
from jaxcb.core.step import ScheduledSequence, SchedulerOutput

WRITE_CHUNK = 1024  # entries per call of the slot writer (what a step's own updates cannot hold)


def table_update_capacity(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Block-table entries a step writes itself: a sequence computing n tokens gains at most
    n // block_size + 1 blocks, so this holds every step but those that bring a sequence (back) to
    a slot with a table already long (a prefix-cache hit, a swap-in): the writer takes those."""
    return 2 * num_seqs + num_tokens // block_size


@dataclasses.dataclass
class StepInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]: where each token's K/V goes (block * block_size + offset)
    query_start_loc: jax.Array  # i32[R + 1]
    kv_lens: jax.Array  # i32[R]
    num_seqs: jax.Array  # i32[]
    row_slots: jax.Array  # i32[R]: each row's slot (runner/slots.py); padding rows 0 (their kv_len is 0)
    table_updates: jax.Array  # i32[3, U]: (slot, column, block) written to the block tables first; slot S pads
    token_rows: jax.Array  # i32[T]: each token's row; R for padding
    logits_indices: jax.Array  # i32[R]: each sequence's last new token
    sampling: SamplingArrays
    num_prompt: jax.Array  # i32[R]
    # Async scheduling: tokens the previous step drew, still on the device, for the tokens in flight.
    prev_tokens: jax.Array  # i32[max_rows]: the previous step's sampled token of each of its rows
    prev_rows: jax.Array  # i32[T]: for an input token in flight, its row in the previous step; else -1
    masks: Optional[TokenMasks] = None  # variants from MASKED on: token bitmask and logit bias of each row
    prompt_targets: Optional[jax.Array] = None  # i32[T], PROMPT_LOGPROBS only: the prompt token each row predicts; -1: none


jax.tree_util.register_dataclass(
    StepInputs,
    data_fields=[f.name for f in dataclasses.fields(StepInputs)],
    meta_fields=[],
)


class StepArgs(NamedTuple):
    """A step's inputs as the executable takes them: the host-built arrays packed into one int32
    and one float32 vector (each argument is a separate copy into the runtime, ~10 us apiece
    on CPU, and a step has ~30 of them), then the previous step's tokens, already on the device."""

    ints: np.ndarray  # i32[N]: every int32, uint32 (bit for bit) and bool (0/1) field, flattened
    floats: np.ndarray  # f32[M]: every float32 field, flattened
    prev_tokens: jax.Array


def _packed_fields(x: StepInputs) -> list:
    """The fields that travel packed, in a fixed order (the pytree's, without prev_tokens)."""
    return jax.tree_util.tree_leaves(dataclasses.replace(x, prev_tokens=None))


def packed_sizes(x: StepInputs) -> tuple[int, int]:
    """(ints, floats) lengths of StepArgs for inputs of x's shapes."""
    sizes = [(a.dtype == np.float32, math.prod(a.shape)) for a in _packed_fields(x)]
    return sum(n for f, n in sizes if not f), sum(n for f, n in sizes if f)


def pack_step_inputs(x: StepInputs) -> StepArgs:
    fields = _packed_fields(x)
    ints = [a.reshape(-1).view(np.int32) if a.dtype == np.uint32 else a.reshape(-1).astype(np.int32, copy=False)
            for a in fields if a.dtype != np.float32]
    floats = [a.reshape(-1) for a in fields if a.dtype == np.float32]
    return StepArgs(np.concatenate(ints), np.concatenate(floats), x.prev_tokens)


def unpack_step_inputs(like: StepInputs, ints: jax.Array, floats: jax.Array, prev_tokens) -> StepInputs:
    """Inside the step: StepInputs shaped as `like` (abstract), cut back out of the packed vectors."""
    skeleton = dataclasses.replace(like, prev_tokens=None)
    fields, treedef = jax.tree_util.tree_flatten(skeleton)
    out, at_int, at_float = [], 0, 0
    for a in fields:
        n = math.prod(a.shape)
        if a.dtype == jnp.float32:
            v, at_float = floats[at_float : at_float + n], at_float + n
        else:
            v, at_int = ints[at_int : at_int + n], at_int + n
            if a.dtype == jnp.uint32:
                v = jax.lax.bitcast_convert_type(v, jnp.uint32)
            elif a.dtype == jnp.bool_:
                v = v != 0
        out.append(v.reshape(a.shape))
    x = jax.tree_util.tree_unflatten(treedef, out)
    return dataclasses.replace(x, prev_tokens=prev_tokens)


def abstract_step_inputs(key: BucketKey, *, max_banned: int, block_size: int, max_rows: int, vocab_size: int,
                         max_logit_bias: int, sharding: Optional[jax.sharding.Sharding] = None) -> StepInputs:
    """ShapeDtypeStructs of one bucket's inputs (what the step is compiled for)."""
    t, r, variant = key.num_tokens, key.num_seqs, key.variant
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    inputs = StepInputs(
        token_ids=i32(t),
        positions=i32(t),
        slot_mapping=i32(t),
        query_start_loc=i32(r + 1),
        kv_lens=i32(r),
        num_seqs=i32(),
        row_slots=i32(r),
        table_updates=i32(3, table_update_capacity(t, r, block_size)),
        token_rows=i32(t),
        logits_indices=i32(r),
        sampling=SamplingArrays(
            temperature=f32(r), top_k=i32(r), top_p=f32(r), min_p=f32(r), repetition_penalty=f32(r),
            presence_penalty=f32(r), frequency_penalty=f32(r), seeds=jax.ShapeDtypeStruct((r,), jnp.uint32),
            counters=i32(r), banned_token_ids=i32(r, max_banned),
        ),
        num_prompt=i32(r),
        prev_tokens=i32(max_rows),
        prev_rows=i32(t),
        masks=TokenMasks(i32(r, (vocab_size + 31) // 32), i32(r, max_logit_bias), f32(r, max_logit_bias))
        if variant >= StepVariant.MASKED else None,
        prompt_targets=i32(t) if variant >= StepVariant.PROMPT_LOGPROBS else None,
    )
    if sharding is None:
        return inputs
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), inputs)


@dataclasses.dataclass
class SlotWrites:
    """What the slot writer (`slots.write_slots`) puts on the device before a step: chunks of
    WRITE_CHUNK entries, padded with slot `num_slots` (dropped); the resets go with the first."""

    table_updates: list  # [i32[3, WRITE_CHUNK]]: (slot, column, block)
    reset_slots: np.ndarray  # i32[max_rows]: slots whose penalty counts restart from zero
    counted: list  # [i32[3, WRITE_CHUNK]]: (slot, token, is_output) recorded after the resets


@dataclasses.dataclass
class StepInputBuilder:
    """Builds each step's inputs; holds sizes and which slot each sequence holds."""

    buckets: Buckets
    block_size: int
    vocab_size: int
    max_banned: int  # engine.max_stop_token_ids
    max_logit_bias: int  # engine.max_logit_bias
    # The least ready variant at or above the one a step needs (`StepCompiler.serving`); None: none is.
    serving: Callable[[StepVariant], Optional[StepVariant]]
    slots: SlotTable
    sharding: Optional[jax.sharding.Sharding] = None  # tensor parallelism: replicated on the mesh

    def variant(self, seqs: list[ScheduledSequence]) -> StepVariant:
        """The least ready variant that serves the step: PROMPT_LOGPROBS when a sequence asks for its
        prompt's logprobs in this chunk, MASKED when a sampling row has a token constraint or a logit bias,
        else the sampling level its rows need (`jaxcb.sampling.sampling_level`)."""
        if any(s.prompt_logprob_targets for s in seqs):
            needed = StepVariant.PROMPT_LOGPROBS
        elif any(s.samples and s.sampling_params.uses_masked_step for s in seqs):
            needed = StepVariant.MASKED
        else:
            needed = sampling_level((s.sampling_params for s in seqs),
                                    any(s.samples and s.banned_token_ids for s in seqs))
        variant = self.serving(needed)
        if variant is None:  # the engine holds back requests whose variant is not ready
            raise RuntimeError(f"no compiled step variant serves a {needed.label} step yet; this is a bug")
        return variant

    def build(self, out: SchedulerOutput, prev_tokens: jax.Array
              ) -> tuple[BucketKey, StepArgs, Optional[SlotWrites]]:
        """(the bucket and variant, the packed inputs, what the slot writer must write first, or None)
        of one step. `prev_tokens`: the previous step's sampled tokens, on the device, which feed each
        sequence's token in flight (`ScheduledSequence.in_flight_row`)."""
        # Built with whole-array numpy operations over per-sequence columns gathered in one pass:
        # with async scheduling this host work shares the CPU with the step it overlaps, so every
        # Python operation per sequence and step costs device time (a loop of ~25 numpy element
        # writes per sequence took ~0.8 ms a 64-sequence step). Nothing here is as long as a
        # block table or a context: the tables stay on the device (`slots.py`), and a step
        # ships the blocks its sequences gained and the blocks its tokens write to.
        seqs = out.scheduled
        n = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        starts = np.fromiter((s.start_position for s in seqs), np.int64, n)
        num_tokens = int(lens.sum())
        bs = self.block_size
        # The width follows the longest context, not the blocks held: a static batch reserves its
        # whole outputs' blocks at admission, and a decoding sequence may hold a run ahead.
        bucket = self.buckets.pick(num_tokens, n, int(-(-(starts + lens).max() // bs)))
        variant = self.variant(seqs)
        key = BucketKey(*bucket, variant)
        t, r = bucket.num_tokens, bucket.num_seqs
        ends = np.cumsum(lens)
        begins = ends - lens
        flat = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int32, num_tokens)
        row_of_token = np.repeat(np.arange(n), lens)
        pos = np.arange(num_tokens) - np.repeat(begins - starts, lens)

        row_slots = np.zeros(r, np.int32)
        table_updates, writes = self._slot_updates(seqs, row_slots, t, r)
        # The blocks this step's tokens write to: each sequence's from its first token's to its last's.
        first_block, last_block = starts // bs, (starts + lens - 1) // bs
        step_blocks = np.fromiter(itertools.chain.from_iterable(
            s.block_ids[f : l + 1] for s, f, l in zip(seqs, first_block.tolist(), last_block.tolist())),
            np.int32)
        block_offsets = np.cumsum(last_block - first_block + 1) - (last_block - first_block + 1)
        token_block = pos // bs - np.repeat(first_block - block_offsets, lens)

        token_ids = np.zeros(t, np.int32)
        token_ids[:num_tokens] = flat
        positions = np.zeros(t, np.int32)
        positions[:num_tokens] = pos
        slot_mapping = np.zeros(t, np.int32)  # padding writes go to the null block
        slot_mapping[:num_tokens] = step_blocks[token_block] * bs + pos % bs
        token_rows = np.full(t, r, np.int32)
        token_rows[:num_tokens] = row_of_token
        qsl = np.full(r + 1, num_tokens, np.int32)
        qsl[:n] = begins
        kv_lens = np.zeros(r, np.int32)
        kv_lens[:n] = starts + lens
        logits_idx = np.zeros(r, np.int32)
        logits_idx[:n] = ends - 1
        # A sequence's last token may still be in flight (async scheduling): the step reads it from
        # its row of the previous step's tokens on the device, never from these ids.
        prev_rows = np.full(t, -1, np.int32)
        in_flight_rows = np.fromiter((s.in_flight_row for s in seqs), np.int32, n)
        prev_rows[(ends - 1)[in_flight_rows >= 0]] = in_flight_rows[in_flight_rows >= 0]

        params = [s.sampling_params for s in seqs]
        # Padding rows: temperature 0, top_p 1, min_p 0, repetition 1, presence 0, frequency 0.
        row_floats = np.array([[0.0, 1.0, 0.0, 1.0, 0.0, 0.0]] * r, np.float32)
        row_floats[:n] = [
            (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
            for p in params
        ]
        temperature, top_p, min_p, rep, presence, frequency = (np.ascontiguousarray(row_floats[:, j]) for j in range(6))
        row_ints = np.zeros((r, 4), np.int64)
        row_ints[:n] = [(p.top_k, s.seed & 0xFFFFFFFF, s.num_output_tokens, s.num_prompt_tokens)
                        for p, s in zip(params, seqs)]
        top_k, counters, num_prompt = (row_ints[:, j].astype(np.int32) for j in (0, 2, 3))
        seeds = row_ints[:, 1].astype(np.uint32)
        banned = np.full((r, self.max_banned), self.vocab_size, np.int32)
        for i, s in enumerate(seqs):
            if s.banned_token_ids:
                ids = s.banned_token_ids[: self.max_banned]
                banned[i, : len(ids)] = ids
        # Host arrays go to the executable as they are (packed into two, `StepArgs`): its C++ call
        # path copies them in, where a jnp.asarray or device_put per array (tens a step) cost ~4 ms
        # of Python a step on CPU. Under TP one device_put replicates them on every device (on
        # several hosts, each process supplies its own identical copy).
        sampling = SamplingArrays(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
            presence_penalty=presence, frequency_penalty=frequency, seeds=seeds, counters=counters,
            banned_token_ids=banned,
        )
        inputs = StepInputs(
            token_ids=token_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            kv_lens=kv_lens,
            num_seqs=np.asarray(n, np.int32),
            row_slots=row_slots,
            table_updates=table_updates,
            token_rows=token_rows,
            logits_indices=logits_idx,
            sampling=sampling,
            num_prompt=num_prompt,
            prev_tokens=prev_tokens,
            prev_rows=prev_rows,
            masks=self._token_masks(seqs, r) if variant >= StepVariant.MASKED else None,
            prompt_targets=self._prompt_targets(seqs, begins, t) if variant >= StepVariant.PROMPT_LOGPROBS else None,
        )
        args = pack_step_inputs(inputs)
        if self.sharding is not None:  # arrays already there (prev_tokens) are not copied
            args = jax.device_put(args, self.sharding)
        return key, args, writes

    def _slot_updates(self, seqs: list[ScheduledSequence], row_slots: np.ndarray, t: int, r: int
                      ) -> tuple[np.ndarray, Optional[SlotWrites]]:
        """Each sequence's slot (into `row_slots`), the block-table entries the step writes itself
        (i32[3, U]), and what the writer must write before it: tables too long for the step's own
        updates, and the penalty counts of sequences new to their slots."""
        num_slots = self.slots.num_slots
        new_slots, new_cols, new_blocks, resets, counted = [], [], [], [], []
        for i, s in enumerate(seqs):
            entry, fresh = self.slots.use(s.seq_id, s.block_epoch)
            row_slots[i] = entry.slot
            if len(s.block_ids) > entry.num_blocks:
                gained = s.block_ids[entry.num_blocks :]
                new_slots.append(np.full(len(gained), entry.slot, np.int32))
                new_cols.append(np.arange(entry.num_blocks, len(s.block_ids), dtype=np.int32))
                new_blocks.append(np.asarray(gained, np.int32))
                entry.num_blocks = len(s.block_ids)
            if fresh and s.prior_token_ids is not None:  # penalties: count what came before this step
                resets.append(entry.slot)
                prior = np.asarray(s.prior_token_ids(), np.int32)
                counted.append(np.stack([np.full(len(prior), entry.slot, np.int32), prior,
                                         (np.arange(len(prior)) >= s.num_prompt_tokens).astype(np.int32)]))
        capacity = table_update_capacity(t, r, self.block_size)
        table = np.stack([np.concatenate(new_slots), np.concatenate(new_cols), np.concatenate(new_blocks)]) \
            if new_slots else np.zeros((3, 0), np.int32)
        in_step = np.full((3, capacity), num_slots, np.int32)
        if table.shape[1] <= capacity:
            in_step[:, : table.shape[1]] = table
            table = np.zeros((3, 0), np.int32)
        if not resets and not table.shape[1]:
            return in_step, None
        reset_slots = np.full(self.buckets.max_num_seqs, num_slots, np.int32)
        reset_slots[: len(resets)] = resets
        counted_all = np.concatenate(counted, axis=1) if counted else np.zeros((3, 0), np.int32)
        return in_step, SlotWrites(_chunks(table, num_slots), reset_slots, _chunks(counted_all, num_slots))

    def _token_masks(self, seqs: list[ScheduledSequence], r: int) -> TokenMasks:
        """Each sampling row's allowed tokens (its constraint's bitmask; all, for rows without one) and bias."""
        bitmask = np.full((r, (self.vocab_size + 31) // 32), -1, np.int32)
        bias_ids = np.full((r, self.max_logit_bias), self.vocab_size, np.int32)
        bias_values = np.zeros((r, self.max_logit_bias), np.float32)
        for i, s in enumerate(seqs):
            if not s.samples:
                continue
            if s.constraint is not None:
                s.constraint.fill(bitmask[i])
            bias = s.sampling_params.logit_bias
            if bias:
                bias_ids[i, : len(bias)] = list(bias.keys())
                bias_values[i, : len(bias)] = list(bias.values())
        return TokenMasks(bitmask, bias_ids, bias_values)

    @staticmethod
    def _prompt_targets(seqs: list[ScheduledSequence], begins: np.ndarray, t: int) -> np.ndarray:
        targets = np.full(t, -1, np.int32)
        for s, begin in zip(seqs, begins):
            if s.prompt_logprob_targets:
                targets[begin : begin + len(s.prompt_logprob_targets)] = s.prompt_logprob_targets
        return targets


def _chunks(entries: np.ndarray, pad_slot: int) -> list[np.ndarray]:
    """i32[3, N] as i32[3, WRITE_CHUNK] pieces, the last padded with slot `pad_slot` (dropped)."""
    out = []
    for at in range(0, entries.shape[1], WRITE_CHUNK):
        piece = np.full((3, WRITE_CHUNK), pad_slot, np.int32)
        piece[:, : min(WRITE_CHUNK, entries.shape[1] - at)] = entries[:, at : at + WRITE_CHUNK]
        out.append(piece)
    return out
