"""Sampling inside the jitted step: one token per row, each row with its own parameters.

Every parameter is an array over the batch's rows, so one compiled step serves any mix of
greedy and random, filtered and unfiltered requests. A row's randomness comes only from
its own key, `fold_in(key(seed), num_output_tokens)`, and Gumbel-argmax draws with it; so a
request with a seed samples the same tokens whether it runs alone or in any batch.

Order of operations, as in vLLM: penalties on the raw logits, logit_bias, banned tokens
(min_tokens), the token bitmask (grammars, allowed_token_ids, bad_words), then temperature,
then top-k / top-p / min-p filtering, then the draw. Logprobs are those of the raw model
distribution (log-softmax of the logits before any of it).

The bitmask and the bias exist only in the masked variant of the step (`TokenMasks`, chosen by
the host when some row has a constraint): other steps never pay for them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

Argmax = Callable[[jax.Array], jax.Array]  # f32[R, V] -> i32[R], jnp.argmax's indices


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
    any_penalty: jax.Array  # bool[]: skip the penalty pass when no row asks for one
    any_filter: jax.Array  # bool[]: skip the sort when no row uses top-k / top-p
    # On a small model these two cost as much as the layers: skip them when no row needs them.
    any_random: jax.Array = True  # bool[]: skip drawing noise when every row is greedy
    any_logprobs: jax.Array = True  # bool[]: skip the top-n logprobs when no row asks for them
    # bool[]: skip the log-softmax normaliser (a max and a sum of exps over [R, V]) when no row
    # wants even its chosen token's logprob (every row's `logprobs` is None); those rows' are 0.
    any_token_logprob: jax.Array = True

    FLAGS = ("any_penalty", "any_filter", "any_random", "any_logprobs", "any_token_logprob")  # the bool[] fields


jax.tree_util.register_dataclass(
    SamplingArrays,
    data_fields=[f.name for f in dataclasses.fields(SamplingArrays)],
    meta_fields=[],
)


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


def token_counts(
    history: jax.Array,  # i32[R, L]: each row's tokens, prompt then outputs
    num_prompt: jax.Array,  # i32[R]
    num_known: jax.Array,  # i32[R]: valid length of each history row
    vocab_size: int,
) -> tuple[jax.Array, jax.Array]:  # (bool[R, V] seen in prompt or output, i32[R, V] output counts)
    pos = jnp.arange(history.shape[1])[None, :]
    valid = pos < num_known[:, None]
    is_output = valid & (pos >= num_prompt[:, None])
    rows = jnp.arange(history.shape[0])[:, None]
    tokens = jnp.where(valid, history, vocab_size)  # out of range -> dropped
    seen = jnp.zeros((history.shape[0], vocab_size), jnp.bool_).at[rows, tokens].set(True, mode="drop")
    out_counts = jnp.zeros((history.shape[0], vocab_size), jnp.int32).at[rows, tokens].add(
        is_output.astype(jnp.int32), mode="drop"
    )
    return seen, out_counts


def apply_penalties(logits, seen, out_counts, s: SamplingArrays):
    """HF repetition penalty on every seen token; OpenAI presence/frequency on generated ones."""
    rep = s.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    return logits - s.presence_penalty[:, None] * (out_counts > 0)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """i32 keys that order as the float32 values do (-inf lowest): the float's bits, negatives flipped."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _largest_key_where(keys: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """i32[R]: per row, the largest key t among the row's range for which `holds(t)` (bool[R], true at
    the row's smallest key and false past some point) is true: 32 halvings of the int32 range, exact."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (((lo & 1) + (hi & 1) + 1) >> 1)  # ceil((lo + hi) / 2), no overflow
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (keys.min(axis=-1), keys.max(axis=-1)))
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


def any_banned(s: SamplingArrays, vocab: int) -> jax.Array:
    return jnp.any(s.banned_token_ids < vocab)  # ids past the vocab pad


def needs_logits(s: SamplingArrays, vocab: int) -> jax.Array:
    """bool[]: whether `sample` reads the logits themselves; where not, every row takes the plain
    argmax of its logits (greedy, no penalty, no banned id, no logprobs)."""
    return s.any_random | s.any_penalty | any_banned(s, vocab) | s.any_logprobs | s.any_token_logprob


def sample(
    logits: jax.Array,  # f32[R, V]
    s: SamplingArrays,
    history: jax.Array,  # i32[R, L]
    num_prompt: jax.Array,  # i32[R]
    num_known: jax.Array,  # i32[R]
    num_logprobs: int,
    argmax: Argmax = xla_argmax,
    logits_argmax: jax.Array | None = None,  # i32[R]: the logits' row argmax, computed on the way
    history_fix: tuple[jax.Array, jax.Array] | None = None,  # (position i32[R], token i32[R])
    masks: TokenMasks | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(token i32[R], its logprob f32[R], top ids i32[R, n], top logprobs f32[R, n]); the logprobs
    are 0 when no row asks for them. With `logits_argmax`, a step that does not need the logits
    (`needs_logits` false) takes it as its tokens and never reads `logits`, which may then be
    undefined. `history_fix` puts one token into each row's history (a position outside it:
    none) before the penalties read it: the token the previous step sampled, which the host
    knew only as in flight. It is done only when a row has a penalty, and as a select: an
    in-place write made XLA copy the whole history (a step input, not donated) on every step,
    ~0.15 ms at 64 rows of 1,024 on CPU. With `masks` (the masked variant) every row's logits
    get its bias and its bitmask before the choice, and `logits_argmax` is not used."""
    num_rows, vocab = logits.shape
    greedy = s.temperature == 0

    def draw(x):  # temperature, top-k / top-p / min-p, then Gumbel-argmax; greedy rows ignore it
        x_scaled = x / jnp.where(greedy, 1.0, s.temperature)[:, None]
        x_scaled = jax.lax.cond(s.any_filter, lambda v: _filter_top_k_top_p(v, s), lambda v: v, x_scaled)
        probs = jax.nn.softmax(x_scaled, axis=-1)
        x_scaled = jnp.where(probs < s.min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, x_scaled)

        def row_noise(seed, counter):
            key = jax.random.fold_in(jax.random.key(seed), counter)
            return jax.random.gumbel(key, (vocab,), jnp.float32)

        return argmax(x_scaled + jax.vmap(row_noise)(s.seeds, s.counters))

    def choose(x):  # i32[R]: greedy rows take the argmax, the others a draw
        # With every row greedy (the common offline case) the draw is skipped whole.
        drawn = jax.lax.cond(s.any_random, draw, lambda x: jnp.zeros((num_rows,), jnp.int32), x)
        return jnp.where(greedy, argmax(x), drawn).astype(jnp.int32)

    def penalise(x):
        known = history
        if history_fix is not None:
            at = jnp.arange(history.shape[1])[None, :] == history_fix[0][:, None]
            known = jnp.where(at, history_fix[1][:, None], history)
        seen, out_counts = token_counts(known, num_prompt, num_known, vocab)
        return apply_penalties(x, seen, out_counts, s)

    def adjust_then_choose(x):  # penalties, then the banned ids (min_tokens), then choose
        x = jax.lax.cond(s.any_penalty, penalise, lambda x: x, x)
        rows = jnp.arange(num_rows)[:, None]
        return choose(x.at[rows, s.banned_token_ids].set(-jnp.inf, mode="drop"))

    def masked_choose(x):  # the masked variant: penalties, bias, banned ids, bitmask, then choose
        x = jax.lax.cond(s.any_penalty, penalise, lambda x: x, x)
        rows = jnp.arange(num_rows)[:, None]
        x = x.at[rows, masks.bias_ids].add(masks.bias_values, mode="drop")
        x = x.at[rows, s.banned_token_ids].set(-jnp.inf, mode="drop")
        return choose(jnp.where(allowed_tokens(masks.bitmask, vocab), x, -jnp.inf))


    # The branches return only the [R] tokens: a branch that returned the [R, V] logits (even
    # unchanged) would copy them, ~1 ms at 64 rows of a 32k vocab on CPU, on every step.
    def from_logits(x):
        return jax.lax.cond(s.any_penalty | any_banned(s, vocab), adjust_then_choose, choose, x)

    if masks is not None:
        token = masked_choose(logits)
    elif logits_argmax is None:
        token = from_logits(logits)
    else:
        token = jax.lax.cond(needs_logits(s, vocab), from_logits, lambda x: logits_argmax.astype(jnp.int32), logits)

    def with_logprobs():
        # log_softmax's own steps, kept apart so that only the rows' chosen entries (and the
        # top-n, when asked for) are ever formed: neither the shifted logits nor the logprobs
        # are ever a full [R, V] array (the shift fuses into the sum of exps), and each entry is
        # still (logit - max) - log_norm, the very arithmetic of log_softmax.
        row_max = logits.max(axis=-1, keepdims=True)
        log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))

        def logprobs_at(ids: jax.Array) -> jax.Array:  # i32[R, n] -> f32[R, n]
            return (jnp.take_along_axis(logits, ids, axis=-1) - row_max) - log_norm

        def top_logprobs():
            _, ids = jax.lax.top_k(logits, num_logprobs)  # the same order as the logprobs'
            return logprobs_at(ids), ids

        top_lp, top_ids = jax.lax.cond(s.any_logprobs, top_logprobs, lambda: no_top)
        return logprobs_at(token[:, None])[:, 0], top_lp, top_ids

    no_top = (jnp.zeros((num_rows, num_logprobs), jnp.float32), jnp.zeros((num_rows, num_logprobs), jnp.int32))
    token_logprob, top_lp, top_ids = jax.lax.cond(
        s.any_token_logprob | s.any_logprobs, with_logprobs, lambda: (jnp.zeros((num_rows,), jnp.float32), *no_top)
    )
    return token, token_logprob, top_ids.astype(jnp.int32), top_lp
