"""Sampling inside the jitted step: one token per row, each row with its own parameters.

Every parameter is an array over the batch's rows, so one compiled step serves any mix of
greedy and random, filtered and unfiltered requests. A row's randomness comes only from
its own key, `fold_in(key(seed), num_output_tokens)`, and Gumbel-argmax draws with it; so a
request with a seed samples the same tokens whether it runs alone or in any batch.

Order of operations, as in vLLM: penalties on the raw logits, logit_bias, banned tokens
(min_tokens), the token bitmask (grammars, allowed_token_ids, bad_words), then temperature,
then top-k / top-p / min-p filtering, then the draw. Logprobs are those of the raw model
distribution (log-softmax of the logits before any of it).

What a step computes is fixed when it is compiled, never chosen by a `lax.cond` on a device
value (on a GPU each such branch waits for the device to tell the host which way to go). The
host knows what its rows ask for and picks the least step variant (`StepVariant`) that serves
them all, each a superset of the one before. The first three are the sampling levels
(`sampling_level` picks one, `sample` runs one):

    GREEDY           every row greedy and nothing else: the logits' row argmax (a backend may
                     take it inside the head's matmul and never write the logits)
    RANDOM           + temperature and the Gumbel draw, + banned ids (min_tokens)
    FULL             + penalties, top-k / top-p / min-p, logprobs (the chosen token's and the top-n)
    MASKED           + the token bitmask and the logit bias (`TokenMasks`); samples at FULL
    PROMPT_LOGPROBS  + every prompt row's logprobs (the runner's); samples at FULL, masked

Penalties read counts that the step keeps on the device (`PenaltyCounts`, one row per
slot of the runner's `SlotTable`), never a history shipped from the host.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp

Argmax = Callable[[jax.Array], jax.Array]  # f32[R, V] -> i32[R], jnp.argmax's indices


class StepVariant(enum.IntEnum):
    """What a compiled step computes, each variant a superset of the one before (the order matters:
    a step runs the least compiled variant at or above the one it needs)."""

    GREEDY = 0
    RANDOM = 1
    FULL = 2
    MASKED = 3
    PROMPT_LOGPROBS = 4

    @property
    def label(self) -> str:
        """Its name in configs and logs: greedy, random, full, masked, prompt-logprobs."""
        return self.name.lower().replace("_", "-")

    @property
    def sampling_level(self) -> "StepVariant":
        """The level it samples at: GREEDY, RANDOM or FULL (the masked variants sample at FULL)."""
        return min(self, StepVariant.FULL)


SAMPLING_LEVELS = (StepVariant.GREEDY, StepVariant.RANDOM, StepVariant.FULL)  # what `sample` runs


def xla_argmax(x: jax.Array) -> jax.Array:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class SamplingArrays:
    temperature: jax.Array  # f32[R]; 0 -> greedy
    top_k: jax.Array  # i32[R]; 0 -> off
    top_p: jax.Array  # f32[R]; 1 -> off
    min_p: jax.Array  # f32[R]; 0 -> off
    repetition_penalty: jax.Array  # f32[R]; 1 -> off
    presence_penalty: jax.Array  # f32[R]
    frequency_penalty: jax.Array  # f32[R]
    seeds: jax.Array  # u32[R]
    counters: jax.Array  # i32[R]: tokens the row has generated so far (the step of its own stream)
    banned_token_ids: jax.Array  # i32[R, max_banned]; vocab_size (out of range) pads


jax.tree_util.register_dataclass(
    SamplingArrays,
    data_fields=[f.name for f in dataclasses.fields(SamplingArrays)],
    meta_fields=[],
)


def sampling_level(params: Iterable, any_banned: bool) -> StepVariant:
    """The least level that serves every row: `params` the SamplingParams of every scheduled
    sequence (a sequence with penalties needs FULL even in a chunk that does not sample: its
    tokens are counted), `any_banned` whether a sampling row has banned ids this step."""
    level = StepVariant.RANDOM if any_banned else StepVariant.GREEDY
    for p in params:
        if p.logprobs is not None or p.top_k > 0 or p.top_p < 1 or p.min_p > 0 or p.uses_penalties:
            return StepVariant.FULL
        if p.temperature > 0:
            level = StepVariant.RANDOM
    return level


@dataclasses.dataclass
class PenaltyCounts:
    """Tokens so far, per row (or per slot, as the runner keeps them on the device between steps)."""

    seen: jax.Array  # bool[R, V]: in the prompt or the output
    output_counts: jax.Array  # i32[R, V]: times in the output


jax.tree_util.register_dataclass(PenaltyCounts, data_fields=["seen", "output_counts"], meta_fields=[])


@dataclasses.dataclass
class TokenMasks:
    """The masked step variant's extra inputs."""

    bitmask: jax.Array  # i32[R, ceil(V / 32)]: bit t % 32 of word t // 32 set -> token t allowed
    bias_ids: jax.Array  # i32[R, max_logit_bias]: logit_bias token ids; V (out of range) pads
    bias_values: jax.Array  # f32[R, max_logit_bias]: added to those tokens' logits


jax.tree_util.register_dataclass(
    TokenMasks, data_fields=[f.name for f in dataclasses.fields(TokenMasks)], meta_fields=[],
)


def allowed_tokens(bitmask: jax.Array, vocab: int) -> jax.Array:
    """bool[R, V] from a bitmask i32[R, ceil(V / 32)] (little-endian bit order, as llguidance writes it)."""
    as_bytes = jax.lax.bitcast_convert_type(bitmask, jnp.uint8).reshape(bitmask.shape[0], -1)
    return jnp.unpackbits(as_bytes, axis=-1, bitorder="little")[:, :vocab].astype(jnp.bool_)


def record_tokens(
    counts: PenaltyCounts,  # over slots: bool[S, V], i32[S, V]
    slots: jax.Array,  # i32[N]: each token's slot; S or more (out of range) -> not recorded
    tokens: jax.Array,  # i32[N]
    is_output: jax.Array,  # bool[N]: an output token (counted) or a prompt token (only seen)
) -> PenaltyCounts:
    """Add tokens to their slots' counts: each token of a sequence is recorded once, by the step
    that computes it (or, for a sequence new to its slot, by the runner before its first step)."""
    return PenaltyCounts(
        counts.seen.at[slots, tokens].set(True, mode="drop"),
        counts.output_counts.at[slots, tokens].add(is_output.astype(jnp.int32), mode="drop"),
    )


def apply_penalties(logits, counts: PenaltyCounts, s: SamplingArrays):
    """HF repetition penalty on every seen token; OpenAI presence/frequency on generated ones."""
    rep = s.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(counts.seen, penalised, logits)
    logits = logits - s.frequency_penalty[:, None] * counts.output_counts
    return logits - s.presence_penalty[:, None] * (counts.output_counts > 0)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """i32 keys that order as the float32 values do (-inf lowest): the float's bits, negatives flipped."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _largest_key_where(keys: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """i32[R]: per row, the largest key t among the row's range for which `holds(t)` (bool[R], true at
    the row's smallest key and false past some point) is true: 32 halvings of the int32 range, exact.
    Unrolled: a loop XLA cannot see the end of asks the device for its predicate on every turn."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (((lo & 1) + (hi & 1) + 1) >> 1)  # ceil((lo + hi) / 2), no overflow
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (keys.min(axis=-1), keys.max(axis=-1)), unroll=True)
    return lo


def _filter_top_k_top_p(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Mask (to -inf) what top-k and top-p drop, exactly, without sorting the vocabulary: the k-th
    largest logit is the largest threshold that keeps at least k tokens, and top-p's cut-off the
    largest that keeps at least top_p of the mass (ties at a threshold are kept, as a sort would);
    each found by bisection over the logits' float32 bit patterns (32 passes of O(V) counts, ~7x
    faster than the sort on CPU at 64 rows of a 32k vocabulary)."""
    vocab = logits.shape[-1]
    keys = _ordered_keys(logits)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = _largest_key_where(keys, lambda t: (keys >= t[:, None]).sum(axis=-1) >= k)
    logits = jnp.where(keys < kth[:, None], -jnp.inf, logits)
    keys = _ordered_keys(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    mass_from = lambda t: jnp.where(keys >= t[:, None], probs, 0.0).sum(axis=-1)  # noqa: E731
    cutoff = _largest_key_where(keys, lambda t: mass_from(t) >= s.top_p)
    return jnp.where(keys < cutoff[:, None], -jnp.inf, logits)


def _draw(x: jax.Array, s: SamplingArrays, filtered: bool, argmax: Argmax) -> jax.Array:
    """i32[R]: temperature, (top-k / top-p / min-p,) then Gumbel-argmax; greedy rows' draws are not used."""
    greedy = s.temperature == 0
    x = x / jnp.where(greedy, 1.0, s.temperature)[:, None]
    if filtered:
        x = _filter_top_k_top_p(x, s)
        probs = jax.nn.softmax(x, axis=-1)
        x = jnp.where(probs < s.min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, x)

    def row_noise(seed, counter):
        key = jax.random.fold_in(jax.random.key(seed), counter)
        return jax.random.gumbel(key, (x.shape[-1],), jnp.float32)

    return argmax(x + jax.vmap(row_noise)(s.seeds, s.counters))


def _logprobs(logits: jax.Array, token: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(f32[R] the chosen tokens' logprobs, i32[R, n] top ids, f32[R, n] their logprobs), of the raw logits.
    log_softmax's own steps, kept apart so that only the chosen entries and the top-n are ever
    formed: neither the shifted logits nor the logprobs are a full [R, V] array (the shift fuses
    into the sum of exps), and each entry is still (logit - max) - log_norm, log_softmax's arithmetic."""
    row_max = logits.max(axis=-1, keepdims=True)
    log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))
    at = lambda ids: (jnp.take_along_axis(logits, ids, axis=-1) - row_max) - log_norm  # noqa: E731
    _, top_ids = jax.lax.top_k(logits, n)  # the same order as the logprobs'
    return at(token[:, None])[:, 0], top_ids.astype(jnp.int32), at(top_ids)


def sample(
    logits: Optional[jax.Array],  # f32[R, V]; None at GREEDY when `logits_argmax` is given
    s: SamplingArrays,
    level: StepVariant,  # GREEDY, RANDOM or FULL (static)
    num_logprobs: int,
    argmax: Argmax = xla_argmax,
    logits_argmax: Optional[jax.Array] = None,  # i32[R]: the logits' row argmax, computed on the way
    counts: Optional[PenaltyCounts] = None,  # FULL: the rows' counts, this step's tokens included
    masks: Optional[TokenMasks] = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(token i32[R], its logprob f32[R], top ids i32[R, n], top logprobs f32[R, n]) at a sampling
    `level`; below FULL the logprobs are zeros. With `masks` every row's logits get its
    bias and its bitmask before the choice (the masked variants sample at FULL)."""
    num_rows = s.temperature.shape[0]
    no_logprobs = (jnp.zeros((num_rows,), jnp.float32), jnp.zeros((num_rows, num_logprobs), jnp.int32),
                   jnp.zeros((num_rows, num_logprobs), jnp.float32))
    if level == StepVariant.GREEDY:
        token = logits_argmax if logits_argmax is not None else argmax(logits)
        return (token.astype(jnp.int32), *no_logprobs)
    vocab = logits.shape[-1]
    rows = jnp.arange(num_rows)[:, None]
    x = logits
    if level >= StepVariant.FULL:
        x = apply_penalties(x, counts, s)
    if masks is not None:
        x = x.at[rows, masks.bias_ids].add(masks.bias_values, mode="drop")
    x = x.at[rows, s.banned_token_ids].set(-jnp.inf, mode="drop")
    if masks is not None:
        x = jnp.where(allowed_tokens(masks.bitmask, vocab), x, -jnp.inf)
    token = jnp.where(s.temperature == 0, argmax(x), _draw(x, s, level >= StepVariant.FULL, argmax)).astype(jnp.int32)
    if level < StepVariant.FULL:
        return (token, *no_logprobs)
    token_lp, top_ids, top_lp = _logprobs(logits, token, num_logprobs)
    return token, token_lp, top_ids, top_lp
