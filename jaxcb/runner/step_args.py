"""The arrays of one step (`StepInputs`, DESIGN.md "Data flow of one step"): their shapes for a
bucket, their padding values, and how they travel -- packed into one int32 and one float32
vector (`StepArgs`) that the step cuts back into `StepInputs` (`unpack_step_inputs`).

The builder (`step_inputs.py`) fills a copy of a bucket's packed vectors at their padding values
(`PackedTemplate`) through one view per field.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.runner.buckets import BucketKey
from jaxcb.sampling import SamplingArrays, StepVariant, TokenMasks


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
    # Speculative decoding, from FULL on: each row's drafts before its token (a verify row j: drafts 1..j),
    # which its penalties count on top of its slot's counts; V (out of range) pads.
    row_drafts: Optional[jax.Array] = None  # i32[R, k]


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
                         max_logit_bias: int, max_drafts: int = 0,
                         sharding: Optional[jax.sharding.Sharding] = None) -> StepInputs:
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
        row_drafts=i32(r, max_drafts) if max_drafts and variant >= StepVariant.FULL else None,
    )
    if sharding is None:
        return inputs
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), inputs)


def padded_step_inputs(key: BucketKey, *, max_banned: int, block_size: int, vocab_size: int, max_logit_bias: int,
                       num_slots: int, max_drafts: int = 0) -> StepInputs:
    """One bucket's inputs with every token and row at its padding value: tokens write K/V to the
    null block and belong to row R; rows have no context and sample greedily with no filter (top_p 1,
    repetition 1), nothing banned or biased (ids V), every token allowed; table updates go to slot
    `num_slots` (dropped); prev_tokens is left out (it is on the device). query_start_loc and
    num_seqs depend on the step: the builder writes them whole."""
    t, r, variant = key.num_tokens, key.num_seqs, key.variant
    i32 = lambda shape, value=0: np.full(shape, value, np.int32)  # noqa: E731
    f32 = lambda shape, value=0.0: np.full(shape, value, np.float32)  # noqa: E731
    return StepInputs(
        token_ids=i32(t), positions=i32(t), slot_mapping=i32(t), query_start_loc=i32(r + 1), kv_lens=i32(r),
        num_seqs=i32(()), row_slots=i32(r), table_updates=i32((3, table_update_capacity(t, r, block_size)), num_slots),
        token_rows=i32(t, r), logits_indices=i32(r),
        sampling=SamplingArrays(
            temperature=f32(r), top_k=i32(r), top_p=f32(r, 1.0), min_p=f32(r), repetition_penalty=f32(r, 1.0),
            presence_penalty=f32(r), frequency_penalty=f32(r), seeds=np.zeros(r, np.uint32), counters=i32(r),
            banned_token_ids=i32((r, max_banned), vocab_size),
        ),
        num_prompt=i32(r), prev_tokens=None, prev_rows=i32(t, -1),
        masks=TokenMasks(i32((r, (vocab_size + 31) // 32), -1), i32((r, max_logit_bias), vocab_size),
                         f32((r, max_logit_bias))) if variant >= StepVariant.MASKED else None,
        prompt_targets=i32(t, -1) if variant >= StepVariant.PROMPT_LOGPROBS else None,
        row_drafts=i32((r, max_drafts), vocab_size) if max_drafts and variant >= StepVariant.FULL else None,
    )


class PackedTemplate:
    """A bucket's packed vectors at their padding values (`padded_step_inputs`), and the cut of a
    step's copy of them into views, one per field, which the builder writes the step's tokens and
    rows into: a step allocates two arrays, whatever its number of fields."""

    def __init__(self, padded: StepInputs):
        self.ints, self.floats, _ = pack_step_inputs(padded)
        fields = jax.tree_util.tree_flatten_with_path(dataclasses.replace(padded, prev_tokens=None))[0]
        # (name, in floats?, start, stop, shape or None for a vector, dtype) in the packed order; the
        # names of StepInputs' fields and of its SamplingArrays' and TokenMasks' are all distinct.
        self.fields = []
        at = {True: 0, False: 0}
        for path, a in fields:
            is_float = a.dtype == np.float32
            shape = None if a.ndim == 1 else a.shape
            self.fields.append((path[-1].name, is_float, at[is_float], at[is_float] + a.size, shape, a.dtype))
            at[is_float] += a.size

    def fresh(self) -> tuple[np.ndarray, np.ndarray, types.SimpleNamespace]:
        """(ints, floats, each field's view into them by its name), at the padding values."""
        ints, floats = self.ints.copy(), self.floats.copy()
        views = {}
        for name, is_float, start, stop, shape, dtype in self.fields:
            v = (floats if is_float else ints)[start:stop]
            if shape is not None:
                v = v.reshape(shape)
            views[name] = v.view(np.uint32) if dtype == np.uint32 else v
        return ints, floats, types.SimpleNamespace(**views)
