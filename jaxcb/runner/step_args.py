"""The arrays of one step (`StepInputs`, DESIGN.md "Data flow of one step"): their shapes for a
bucket, their padding values, and how they travel. A step runs two executables (`buckets.py`),
so its inputs come in two parts: the model's (`ModelInputs`: token and sequence rows), packed
into one int32 vector, and the sampler's (`SamplerInputs`: sequence rows only, or the sampler
would be compiled per token bucket again), packed into one int32 and one float32 vector
(`StepArgs`); each executable cuts its part back out (`unpack`).

The builder (`step_inputs.py`) fills a copy of a bucket's packed vectors at their padding values
(`PackedTemplate`) through one view per field, in one pass for both parts.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.runner.buckets import ModelKey, SamplerKey
from jaxcb.sampling import SamplingArrays, StepVariant, TokenMasks


def table_update_capacity(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Block-table entries a step writes itself: a sequence computing n tokens gains at most
    n // block_size + 1 blocks, so this holds every step but those that bring a sequence (back) to
    a slot with a table already long (a prefix-cache hit, a swap-in): the writer takes those."""
    return 2 * num_seqs + num_tokens // block_size


@dataclasses.dataclass
class ModelInputs:
    """What the model step reads: token rows and sequence rows."""

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
    num_prompt: jax.Array  # i32[R]
    # Async scheduling: for an input token in flight, its row in the previous step's sampled tokens
    # (on the device); else -1.
    prev_rows: jax.Array  # i32[T]
    prompt_targets: Optional[jax.Array] = None  # i32[T], prompt logprobs only: the prompt token each row predicts; -1: none
    lora_ids: Optional[jax.Array] = None  # i32[T], LoRA compiled in only: each token row's adapter slot; -1: the base


@dataclasses.dataclass
class SamplerInputs:
    """What the sampling step reads: sequence rows only (it is compiled per R, whatever T is)."""

    sampling: SamplingArrays
    # From FULL on: each row's slot, whose penalty counts it reads (ModelInputs.row_slots again).
    penalty_slots: Optional[jax.Array] = None  # i32[R]
    masks: Optional[TokenMasks] = None  # from MASKED on: token bitmask and logit bias of each row
    # Speculative decoding, from FULL on: each row's drafts before its token (a verify row j: drafts 1..j),
    # which its penalties count on top of its slot's counts; V (out of range) pads.
    row_drafts: Optional[jax.Array] = None  # i32[R, k]
    # Speculative decoding with a draft model, from RANDOM on: the draft token each row verifies (-1: none,
    # or a deterministic proposer's), and the row of the draft model's distributions (`DraftRunner.probs`)
    # it was drawn from (`jaxcb.sampling.DraftRows`).
    verify_draft_ids: Optional[jax.Array] = None  # i32[R]
    verify_probs_rows: Optional[jax.Array] = None  # i32[R]
    # The rows that sample (the step's sequence rows); the bucket's rows past them are padding, which
    # the LM head may skip. Its padding value is R: every row.
    sample_rows: Optional[jax.Array] = None  # i32[]


@dataclasses.dataclass
class StepInputs:
    model: ModelInputs
    sampler: SamplerInputs


for _cls in (ModelInputs, SamplerInputs, StepInputs):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


class StepArgs(NamedTuple):
    """A step's inputs as its two executables take them: the host-built arrays packed into one int32
    vector for the model (it has no float input) and one int32 and one float32 vector for the
    sampler (each argument is a separate copy into the runtime, ~10 us apiece on CPU, and a step has
    ~30 fields), then the previous step's tokens, already on the device."""

    model_ints: np.ndarray  # i32[N]: every int32 field of ModelInputs, flattened
    sampler_ints: np.ndarray  # i32[M]: every int32, uint32 (bit for bit) and bool (0/1) field of SamplerInputs
    sampler_floats: np.ndarray  # f32[K]: every float32 field of SamplerInputs
    prev_tokens: jax.Array  # i32[max_rows]: the previous step's sampled token of each of its rows


def packed_sizes(x) -> tuple[int, int]:
    """(ints, floats) lengths of the packed vectors of inputs (ModelInputs or SamplerInputs) of x's shapes."""
    sizes = [(a.dtype == np.float32, math.prod(a.shape)) for a in jax.tree_util.tree_leaves(x)]
    return sum(n for f, n in sizes if not f), sum(n for f, n in sizes if f)


def pack(x) -> tuple[np.ndarray, np.ndarray]:
    """(ints, floats) of host inputs (ModelInputs or SamplerInputs), their fields in the pytree's order."""
    fields = jax.tree_util.tree_leaves(x)
    ints = [a.reshape(-1).view(np.int32) if a.dtype == np.uint32 else a.reshape(-1).astype(np.int32, copy=False)
            for a in fields if a.dtype != np.float32]
    floats = [a.reshape(-1) for a in fields if a.dtype == np.float32]
    return (np.concatenate(ints) if ints else np.zeros(0, np.int32),
            np.concatenate(floats) if floats else np.zeros(0, np.float32))


def unpack(like, ints: jax.Array, floats: Optional[jax.Array] = None):
    """Inside a step: inputs shaped as `like` (abstract ModelInputs or SamplerInputs), cut back out of
    the packed vectors (`floats` None: `like` has no float field)."""
    fields, treedef = jax.tree_util.tree_flatten(like)
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
    return jax.tree_util.tree_unflatten(treedef, out)


def _factories(abstract: bool, sharding: Optional[jax.sharding.Sharding]):
    """(i32, f32, u32) factories of ShapeDtypeStructs (`abstract`) or of host arrays at a fill value."""
    if abstract:
        def make(dtype):
            return lambda shape, value=0: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    else:
        def make(dtype):
            return lambda shape, value=0: np.full(shape, value, dtype)
    return make(np.int32), make(np.float32), make(np.uint32)


def model_inputs(key: ModelKey, *, block_size: int, num_slots: int = 0, abstract: bool = False,
                 sharding: Optional[jax.sharding.Sharding] = None, lora: bool = False) -> ModelInputs:
    """One model bucket's inputs: ShapeDtypeStructs (`abstract`: what it is compiled for) or host
    arrays at their padding values: tokens write K/V to the null block and belong to row R; rows have no
    context; table updates go to slot `num_slots` (dropped); tokens run on the base (LoRA slot -1). query_start_loc and num_seqs depend on the
    step: the builder writes them whole."""
    t, r = key.num_tokens, key.num_seqs
    i32, _, _ = _factories(abstract, sharding)
    return ModelInputs(
        token_ids=i32((t,)), positions=i32((t,)), slot_mapping=i32((t,)), query_start_loc=i32((r + 1,)),
        kv_lens=i32((r,)), num_seqs=i32(()), row_slots=i32((r,)),
        table_updates=i32((3, table_update_capacity(t, r, block_size)), num_slots),
        token_rows=i32((t,), r), logits_indices=i32((r,)), num_prompt=i32((r,)), prev_rows=i32((t,), -1),
        prompt_targets=i32((t,), -1) if key.prompt_logprobs else None,
        lora_ids=i32((t,), -1) if lora else None,
    )


def sampler_inputs(key: SamplerKey, *, max_banned: int, vocab_size: int, max_logit_bias: int, max_drafts: int = 0,
                   draft_probs: bool = False, abstract: bool = False,
                   sharding: Optional[jax.sharding.Sharding] = None) -> SamplerInputs:
    """One sampling bucket's inputs, abstract or at their padding values: rows sample greedily with no
    filter (top_p 1, repetition 1), nothing banned or biased (ids V), every token allowed, no draft
    model's token verified (-1). `draft_probs`: a draft model proposes (its rows from RANDOM on)."""
    r, variant = key.num_seqs, key.variant
    i32, f32, u32 = _factories(abstract, sharding)
    full = variant >= StepVariant.FULL
    return SamplerInputs(
        sampling=SamplingArrays(
            temperature=f32((r,)), top_k=i32((r,)), top_p=f32((r,), 1.0), min_p=f32((r,)),
            repetition_penalty=f32((r,), 1.0), presence_penalty=f32((r,)), frequency_penalty=f32((r,)),
            seeds=u32((r,)), counters=i32((r,)), banned_token_ids=i32((r, max_banned), vocab_size),
            seeds_hi=u32((r,)),
        ),
        penalty_slots=i32((r,)) if full else None,
        masks=TokenMasks(i32((r, (vocab_size + 31) // 32), -1), i32((r, max_logit_bias), vocab_size),
                         f32((r, max_logit_bias))) if variant >= StepVariant.MASKED else None,
        row_drafts=i32((r, max_drafts), vocab_size) if max_drafts and full else None,
        verify_draft_ids=i32((r,), -1) if draft_probs and variant >= StepVariant.RANDOM else None,
        verify_probs_rows=i32((r,)) if draft_probs and variant >= StepVariant.RANDOM else None,
        sample_rows=i32((), r),
    )


class PackedTemplate:
    """A step's packed vectors at their padding values (`model_inputs`, `sampler_inputs`), and the cut
    of a step's copy of them into views, one per field, which the builder writes the step's tokens and
    rows into: a step allocates three arrays, whatever its number of fields."""

    def __init__(self, padded: StepInputs):
        model_ints, _ = pack(padded.model)
        sampler_ints, sampler_floats = pack(padded.sampler)
        self.vectors = (model_ints, sampler_ints, sampler_floats)
        # (name, vector, start, stop, shape or None for a vector, dtype) in the packed order; the names of
        # the fields of ModelInputs, SamplerInputs, SamplingArrays and TokenMasks are all distinct.
        self.fields = []
        for part, (ints_at, floats_at) in ((padded.model, (0, None)), (padded.sampler, (1, 2))):
            at = {ints_at: 0, floats_at: 0}
            for path, a in jax.tree_util.tree_flatten_with_path(part)[0]:
                vector = floats_at if a.dtype == np.float32 else ints_at
                shape = None if a.ndim == 1 else a.shape
                self.fields.append((path[-1].name, vector, at[vector], at[vector] + a.size, shape, a.dtype))
                at[vector] += a.size

    def fresh(self) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], types.SimpleNamespace]:
        """((model ints, sampler ints, sampler floats), each field's view into them by its name), at the
        padding values."""
        vectors = tuple(v.copy() for v in self.vectors)
        views = {}
        for name, vector, start, stop, shape, dtype in self.fields:
            v = vectors[vector][start:stop]
            if shape is not None:
                v = v.reshape(shape)
            views[name] = v.view(np.uint32) if dtype == np.uint32 else v
        return vectors, types.SimpleNamespace(**views)
