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
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.kernels.attention import AttentionMetadata
from jaxcb.runner.buckets import Buckets
from jaxcb.sampling import SamplingArrays, TokenMasks
from jaxcb.core.step import SchedulerOutput


# Step variants, each a superset of the one before; the host picks the first that the step needs.
PLAIN, MASKED, PROMPT_LOGPROBS = 0, 1, 2
VARIANT_NAMES = ("plain", "masked", "prompt-logprobs")


@dataclasses.dataclass
class StepInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    md: AttentionMetadata
    logits_indices: jax.Array  # i32[R]: each sequence's last new token
    sampling: SamplingArrays
    history: jax.Array  # i32[R, max_model_len] (zeros unless a row uses penalties)
    num_prompt: jax.Array  # i32[R]
    num_known: jax.Array  # i32[R]
    # Async scheduling: tokens the previous step drew, still on the device, for the tokens in flight.
    prev_tokens: jax.Array  # i32[max_rows]: the previous step's sampled token of each of its rows
    prev_rows: jax.Array  # i32[T]: for an input token in flight, its row in the previous step; else -1
    history_fix: jax.Array  # i32[R, 2]: (position, previous row) of a token in flight in the history; -1: none
    masks: Optional[TokenMasks] = None  # variants >= MASKED: token bitmask and logit bias of each row
    prompt_targets: Optional[jax.Array] = None  # i32[T], PROMPT_LOGPROBS only: the prompt token each row predicts; -1: none


jax.tree_util.register_dataclass(
    StepInputs,
    data_fields=[f.name for f in dataclasses.fields(StepInputs)],
    meta_fields=[],
)


class StepArgs(NamedTuple):
    """A step's inputs as the executable takes them: the host-built arrays packed into one int32
    and one float32 vector (each argument is a separate copy into the runtime, ~10 us apiece
    on CPU, and a step has ~30 of them), then the two that may already be device arrays."""

    ints: np.ndarray  # i32[N]: every int32, uint32 (bit for bit) and bool (0/1) field, flattened
    floats: np.ndarray  # f32[M]: every float32 field, flattened
    history: jax.Array
    prev_tokens: jax.Array


def _packed_fields(x: StepInputs) -> list:
    """The fields that travel packed, in a fixed order (the pytree's, without the two apart)."""
    return jax.tree_util.tree_leaves(dataclasses.replace(x, history=None, prev_tokens=None))


def packed_sizes(x: StepInputs) -> tuple[int, int]:
    """(ints, floats) lengths of StepArgs for inputs of x's shapes."""
    sizes = [(a.dtype == np.float32, math.prod(a.shape)) for a in _packed_fields(x)]
    return sum(n for f, n in sizes if not f), sum(n for f, n in sizes if f)


def pack_step_inputs(x: StepInputs) -> StepArgs:
    fields = _packed_fields(x)
    ints = [a.reshape(-1).view(np.int32) if a.dtype == np.uint32 else a.reshape(-1).astype(np.int32, copy=False)
            for a in fields if a.dtype != np.float32]
    floats = [a.reshape(-1) for a in fields if a.dtype == np.float32]
    return StepArgs(np.concatenate(ints), np.concatenate(floats), x.history, x.prev_tokens)


def unpack_step_inputs(like: StepInputs, ints: jax.Array, floats: jax.Array, history, prev_tokens) -> StepInputs:
    """Inside the step: StepInputs shaped as `like` (abstract), cut back out of the packed vectors."""
    skeleton = dataclasses.replace(like, history=None, prev_tokens=None)
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
    return dataclasses.replace(x, history=history, prev_tokens=prev_tokens)


def abstract_step_inputs(t: int, r: int, w: int, variant: int, *, max_banned: int, max_model_len: int,
                         max_rows: int, vocab_size: int, max_logit_bias: int,
                         sharding: Optional[jax.sharding.Sharding] = None) -> StepInputs:
    """ShapeDtypeStructs of one bucket's inputs (what the step is compiled for)."""
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    inputs = StepInputs(
        token_ids=i32(t),
        positions=i32(t),
        md=AttentionMetadata(i32(t), i32(r + 1), i32(r), i32(r, w), i32()),
        logits_indices=i32(r),
        sampling=SamplingArrays(
            temperature=f32(r), top_k=i32(r), top_p=f32(r), min_p=f32(r), repetition_penalty=f32(r),
            presence_penalty=f32(r), frequency_penalty=f32(r), seeds=jax.ShapeDtypeStruct((r,), jnp.uint32),
            counters=i32(r), banned_token_ids=i32(r, max_banned),
            **{name: jax.ShapeDtypeStruct((), jnp.bool_) for name in SamplingArrays.FLAGS},
        ),
        history=i32(r, max_model_len),
        num_prompt=i32(r),
        num_known=i32(r),
        prev_tokens=i32(max_rows),
        prev_rows=i32(t),
        history_fix=i32(r, 2),
        masks=TokenMasks(i32(r, (vocab_size + 31) // 32), i32(r, max_logit_bias), f32(r, max_logit_bias))
        if variant >= MASKED else None,
        prompt_targets=i32(t) if variant >= PROMPT_LOGPROBS else None,
    )
    if sharding is None:
        return inputs
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), inputs)


@dataclasses.dataclass
class StepInputBuilder:
    """Builds each step's inputs; holds only sizes and a few reusable zero arrays."""

    buckets: Buckets
    block_size: int
    vocab_size: int
    max_model_len: int
    max_banned: int  # engine.max_stop_token_ids
    max_logit_bias: int  # engine.max_logit_bias
    sharding: Optional[jax.sharding.Sharding] = None  # tensor parallelism: replicated on the mesh
    _zero_histories: dict = dataclasses.field(default_factory=dict)

    def build(self, out: SchedulerOutput, prev_tokens: jax.Array) -> tuple[tuple[int, int, int, int], StepArgs]:
        """(the bucket and variant, the packed inputs) of one step. `prev_tokens`: the previous step's sampled
        tokens, on the device, which feed each sequence's token in flight (`ScheduledSequence.in_flight_row`).
        The variant: PROMPT_LOGPROBS when a sequence asks for its prompt's logprobs in this chunk, MASKED
        when a sampling row has a token constraint or a logit bias, else PLAIN."""
        # Built with whole-array numpy operations over per-sequence columns gathered in one pass:
        # with async scheduling this host work shares the CPU with the step it overlaps, so every
        # Python operation per sequence and step costs device time (a loop of ~25 numpy element
        # writes per sequence took ~0.8 ms a 64-sequence step).
        seqs = out.scheduled
        n = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        num_blocks = np.fromiter((len(s.block_ids) for s in seqs), np.int64, n)
        num_tokens = int(lens.sum())
        t, r, w = self.buckets.pick(num_tokens, n, int(num_blocks.max()))
        if any(s.prompt_logprob_targets for s in seqs):
            variant = PROMPT_LOGPROBS
        elif any(s.samples and s.sampling_params.uses_masked_step for s in seqs):
            variant = MASKED
        else:
            variant = PLAIN
        key = (t, r, w, variant)
        bs = self.block_size
        ends = np.cumsum(lens)
        begins = ends - lens
        starts = np.fromiter((s.start_position for s in seqs), np.int64, n)
        flat = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int32, num_tokens)
        row_of_token = np.repeat(np.arange(n), lens)
        pos = np.arange(num_tokens) - np.repeat(begins - starts, lens)

        tables = np.zeros((r, w), np.int32)
        block_rows = np.repeat(np.arange(n), num_blocks)
        block_cols = np.arange(len(block_rows)) - np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)
        tables[block_rows, block_cols] = np.fromiter(
            itertools.chain.from_iterable(s.block_ids for s in seqs), np.int32, len(block_rows)
        )
        token_ids = np.zeros(t, np.int32)
        token_ids[:num_tokens] = flat
        positions = np.zeros(t, np.int32)
        positions[:num_tokens] = pos
        slots = np.zeros(t, np.int32)  # padding writes go to the null block
        slots[:num_tokens] = tables[row_of_token, pos // bs] * bs + pos % bs
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
        num_known = np.zeros(r, np.int32)
        history_fix = np.full((r, 2), -1, np.int32)
        history = None
        for i, s in enumerate(seqs):
            if s.banned_token_ids:
                ids = s.banned_token_ids[: self.max_banned]
                banned[i, : len(ids)] = ids
            if s.history is not None:
                if history is None:
                    history = np.zeros((r, self.max_model_len), np.int32)
                history[i, : len(s.history)] = s.history
                num_known[i] = len(s.history)
                if s.in_flight_row >= 0:  # the history ends with the token in flight
                    history_fix[i] = (len(s.history) - 1, s.in_flight_row)
        any_filter = bool(np.any(top_k > 0) or np.any(top_p < 1))
        # Host arrays go to the executable as they are (packed into two, `StepArgs`): its C++ call
        # path copies them in, where a jnp.asarray or device_put per array (tens a step) cost ~4 ms
        # of Python a step on CPU. Under TP one device_put replicates them on every device (on
        # several hosts, each process supplies its own identical copy).
        sampling = SamplingArrays(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
            presence_penalty=presence, frequency_penalty=frequency, seeds=seeds, counters=counters,
            banned_token_ids=banned,
            any_penalty=np.asarray(history is not None),
            any_filter=np.asarray(any_filter),
            any_random=np.asarray(bool(np.any(temperature > 0))),
            any_logprobs=np.asarray(any(s.sampling_params.logprobs for s in seqs)),
            any_token_logprob=np.asarray(any(s.sampling_params.logprobs is not None for s in seqs)),
        )
        inputs = StepInputs(
            token_ids=token_ids,
            positions=positions,
            md=AttentionMetadata(
                slots, qsl, kv_lens, tables,
                np.asarray(len(seqs), np.int32),
            ),
            logits_indices=logits_idx,
            sampling=sampling,
            history=history if history is not None else self._zero_history(r),
            num_prompt=num_prompt,
            num_known=num_known,
            prev_tokens=prev_tokens,
            prev_rows=prev_rows,
            history_fix=history_fix,
            masks=self._token_masks(seqs, r) if variant >= MASKED else None,
            prompt_targets=self._prompt_targets(seqs, begins, t) if variant >= PROMPT_LOGPROBS else None,
        )
        args = pack_step_inputs(inputs)
        if self.sharding is not None:  # arrays already there (prev_tokens) are not copied
            args = jax.device_put(args, self.sharding)
        return key, args

    def _token_masks(self, seqs: list, r: int) -> TokenMasks:
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
    def _prompt_targets(seqs: list, begins: np.ndarray, t: int) -> np.ndarray:
        targets = np.full(t, -1, np.int32)
        for s, begin in zip(seqs, begins):
            if s.prompt_logprob_targets:
                targets[begin : begin + len(s.prompt_logprob_targets)] = s.prompt_logprob_targets
        return targets

    def _zero_history(self, r: int) -> jax.Array:
        if r not in self._zero_histories:
            self._zero_histories[r] = jnp.zeros((r, self.max_model_len), jnp.int32, device=self.sharding)
        return self._zero_histories[r]
