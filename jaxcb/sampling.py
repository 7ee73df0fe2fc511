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
    seeds: jax.Array  # u32[R]: the low 32 bits of each row's 64-bit seed
    counters: jax.Array  # i32[R]: tokens the row has generated so far (the step of its own stream)
    banned_token_ids: jax.Array  # i32[R, max_banned]; vocab_size (out of range) pads
    seeds_hi: jax.Array  # u32[R]: the seed's high 32 bits (0 for a seed below 2**32)


def seed_key(seed: jax.Array, seed_hi: jax.Array) -> jax.Array:
    """A row's key from its 64-bit seed: threefry's two key words are the seed's high and low halves,
    so a seed below 2**32 gets `jax.random.key(seed)`, and seeds that differ anywhere get different keys."""
    return jax.random.wrap_key_data(jnp.stack([seed_hi, seed]).astype(jnp.uint32), impl="threefry2x32")


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


@dataclasses.dataclass
class DraftRows:
    """Speculative decoding with a draft model: what each verify row checks (`sample`'s `drafts`)."""

    token_ids: jax.Array  # i32[R]: the draft the row verifies, sampled by the draft model; -1: none (or n-gram)
    probs: jax.Array  # f32[R, V]: the draft model's distribution q that token was drawn from


jax.tree_util.register_dataclass(DraftRows, data_fields=["token_ids", "probs"], meta_fields=[])

ACCEPT_SALT = 1  # a verify row's acceptance draw: fold_in(fold_in(key(seed), counter), ACCEPT_SALT)


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


DIGIT_BITS = (11, 11, 10)  # the radix select's digits, most significant first: histograms of <= 2,048 bins


def _ordered_keys(x: jax.Array) -> jax.Array:
    """u32 keys that order as the float32 values do (-inf lowest, -0 equal to 0): negatives' bits all
    flipped, positives' sign bit set."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = jnp.where(bits == jnp.uint32(0x80000000), jnp.uint32(0), bits)  # -0 is 0
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _shift(level: int) -> int:
    return 32 - sum(DIGIT_BITS[:level + 1])  # digit `level` is the low DIGIT_BITS[level] bits of keys >> shift


def _digit(keys: jax.Array, level: int) -> jax.Array:
    return (keys >> _shift(level)).astype(jnp.int32) & ((1 << DIGIT_BITS[level]) - 1)


def _histogram(keys: jax.Array, prefix: jax.Array, level: int, weights: jax.Array) -> jax.Array:
    """f32[R, 2**DIGIT_BITS[level], C]: per row and value of digit `level`, the sums of `weights`
    (f32[R, V, C]) over the keys (u32[R, V]) whose higher digits are those of `prefix` (u32[R]):
    one scatter-add, the other keys sent out of range and dropped."""
    num_rows, _, num_sums = weights.shape
    num_bins = 1 << DIGIT_BITS[level]
    index = jnp.arange(num_rows, dtype=jnp.int32)[:, None] * num_bins + _digit(keys, level)
    if level > 0:
        above = _shift(level) + DIGIT_BITS[level]
        index = jnp.where(keys >> above == (prefix >> above)[:, None], index, num_rows * num_bins)
    hist = jnp.zeros((num_rows * num_bins, num_sums), jnp.float32)
    hist = hist.at[index.reshape(-1)].add(weights.reshape(-1, num_sums), mode="drop")
    return hist.reshape(num_rows, num_bins, num_sums)


def _sums_from(hist: jax.Array) -> jax.Array:
    """f32[R, B + 1]: column d the sum of `hist` (f32[R, B]) over digits >= d (0 past the last)."""
    return jnp.pad(jnp.cumsum(hist[:, ::-1], axis=-1)[:, ::-1], ((0, 0), (0, 1)))


def _largest_digit(sums_from: jax.Array, above: jax.Array, enough: jax.Array) -> jax.Array:
    """i32[R]: the largest d with `above` + sums_from[:, d] >= `enough` (sums_from falls with d), -1 if none."""
    return (above[:, None] + sums_from[:, :-1] >= enough[:, None]).sum(axis=-1, dtype=jnp.int32) - 1


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, index[:, None], axis=-1)[:, 0]


def _with_digit(prefix: jax.Array, level: int, digit: jax.Array) -> jax.Array:
    return prefix | (digit.astype(jnp.uint32) << _shift(level))


def _kth_largest_key(keys: jax.Array, mass: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(u32[R] the k-th largest of `keys` (u32[R, V]), f32[R, B] the mass (f32[R, V]) kept by it in each
    bucket of the first digit): a digit at a time, the largest whose bucket and those above it hold k."""
    kth = jnp.zeros(keys.shape[:1], jnp.uint32)
    count_above = jnp.zeros(keys.shape[:1], jnp.float32)  # keys above the bucket of the digits so far
    first_masses, kept_in_bucket = None, []
    for level in range(len(DIGIT_BITS)):
        hist = _histogram(keys, kth, level, jnp.stack([jnp.ones_like(mass), mass], axis=-1))
        counts_from = _sums_from(hist[..., 0])
        digit = _largest_digit(counts_from, count_above, k)  # >= 0: counts are exact and k <= V
        count_above = count_above + _at(counts_from, digit + 1)
        kept_in_bucket.append(_at(_sums_from(hist[..., 1]), digit + 1))  # (those above it, in the bucket before)
        first_masses = hist[..., 1] if level == 0 else first_masses
        kth = _with_digit(kth, level, digit)
    kept_in_bucket = _at(hist[..., 1], digit) + sum(kept_in_bucket[1:])  # kth's first-digit bucket
    bins = jnp.arange(first_masses.shape[1])[None, :]
    first_digit = _digit(kth, 0)[:, None]
    kept = jnp.where(bins > first_digit, first_masses, 0.0)
    return kth, jnp.where(bins == first_digit, kept_in_bucket[:, None], kept)


def _filter_top_k_top_p(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Mask (to -inf) what top-k and top-p drop, exactly, without sorting the vocabulary. Top-k keeps
    the logits >= the k-th largest; top-p then the fewest largest of those whose softmax mass reaches
    top_p (ties at either cut-off are kept, as a sort would; top_p >= 1 keeps them all). Each cut-off
    is found by a radix select over the logits' ordered bit patterns, most significant digit first
    (`DIGIT_BITS`): a digit's value is the largest whose bucket and the buckets above it still hold
    k keys (top-k) or top_p of the mass kept (top-p), read off a histogram of that digit over the keys
    that share the digits found so far.

    Passes over the [R, V] logits: the row max (softmax's shift); one histogram per digit for top-k,
    of counts and masses together (the masses give the kept mass and top-p's first digit without a
    pass of their own); one per later digit for top-p. 1 + 3 + 2 = 6 with three digits, against 64
    for a bisection over the 32 bits (32 halvings per cut-off, each a count or a sum over the
    vocabulary). What it returns is one elementwise select, fused into whatever reads it next."""
    num_rows, vocab = logits.shape
    assert vocab < 1 << 24, vocab  # counts are summed in float32, exact below 2**24
    row_max = logits.max(axis=-1)
    keys = _ordered_keys(logits)  # u32[R, V]
    mass = jnp.exp(logits - row_max[:, None])  # f32[R, V]: softmax's numerators
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab).astype(jnp.float32)
    kth, hist = _kth_largest_key(keys, mass, k)
    kept = jnp.where(keys >= kth[:, None], mass, 0.0)[..., None]  # f32[R, V, 1]
    cutoff = jnp.zeros((num_rows,), jnp.uint32)
    mass_above = jnp.zeros((num_rows,), jnp.float32)  # kept mass above the bucket of the digits so far
    found = shared = jnp.ones((num_rows,), jnp.bool_)  # every digit so far found; all of them kth's
    for level in range(len(DIGIT_BITS)):
        if level > 0:
            hist = _histogram(keys, cutoff, level, kept)[..., 0]
        mass_from = _sums_from(hist)
        enough = s.top_p * mass_from[:, 0] if level == 0 else enough
        digit = _largest_digit(mass_from, mass_above, enough)
        found = found & (digit >= 0)  # (rounding can leave a level short of what the one before found)
        kth_digit = _digit(kth, level)
        digit = jnp.where(found, digit, jnp.where(shared, kth_digit, 0))
        mass_above = mass_above + _at(mass_from, digit + 1)
        shared = shared & (digit == kth_digit)
        cutoff = _with_digit(cutoff, level, digit)
    cutoff = jnp.minimum(cutoff, _ordered_keys(row_max))  # top_p <= 0 keeps the largest, as a sort would
    cutoff = jnp.where(s.top_p < 1, cutoff, kth)
    return jnp.where(keys < cutoff[:, None], -jnp.inf, logits)


def _draw(x: jax.Array, s: SamplingArrays, filtered: bool, argmax: Argmax, drafts: Optional[DraftRows] = None
          ) -> jax.Array:
    """i32[R]: temperature, (top-k / top-p / min-p,) then Gumbel-argmax; greedy rows' draws are not used.
    A row verifying a draft model's token (`drafts`) draws by speculative sampling instead (`_verify_draft`)."""
    greedy = s.temperature == 0
    x = x / jnp.where(greedy, 1.0, s.temperature)[:, None]
    if filtered:
        x = _filter_top_k_top_p(x, s)
        probs = jax.nn.softmax(x, axis=-1)
        x = jnp.where(probs < s.min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, x)

    def row_noise(seed, seed_hi, counter):
        key = jax.random.fold_in(seed_key(seed, seed_hi), counter)
        return jax.random.gumbel(key, (x.shape[-1],), jnp.float32)

    noise = jax.vmap(row_noise)(s.seeds, s.seeds_hi, s.counters)
    token = argmax(x + noise)
    if drafts is None:
        return token
    return _verify_draft(x, noise, token, s, drafts, argmax)


def _verify_draft(x: jax.Array, noise: jax.Array, token: jax.Array, s: SamplingArrays, drafts: DraftRows,
                  argmax: Argmax) -> jax.Array:
    """Speculative sampling of the rows that verify a draft model's token d, drawn from its distribution
    q: with p the row's target distribution (every penalty, ban, temperature and filter applied: softmax
    of `x`), d is kept with probability min(1, p(d) / q(d)), else the row draws from the residual
    norm(max(p - q, 0)), which is zero at a rejected d. So the row's token is distributed as p whatever
    q is, and it equals d exactly when d is accepted (the host's rule for every proposer). The acceptance
    draw is the row's own (`ACCEPT_SALT`), the residual's noise the row's Gumbel noise. Other rows keep
    `token`. x f32[R, V] (tempered, filtered), noise f32[R, V], token i32[R] -> i32[R]."""
    verifies = drafts.token_ids >= 0
    draft = jnp.maximum(drafts.token_ids, 0)[:, None]
    p = jax.nn.softmax(x, axis=-1)  # f32[R, V]
    p_draft = jnp.take_along_axis(p, draft, axis=-1)[:, 0]
    q_draft = jnp.take_along_axis(drafts.probs, draft, axis=-1)[:, 0]

    def row_uniform(seed, seed_hi, counter):
        key = jax.random.fold_in(jax.random.fold_in(seed_key(seed, seed_hi), counter), ACCEPT_SALT)
        return jax.random.uniform(key, (), jnp.float32)

    u = jax.vmap(row_uniform)(s.seeds, s.seeds_hi, s.counters)
    accept = u * q_draft < p_draft  # u < p/q without the division (q(d) > 0: d was drawn from q)
    residual = jnp.maximum(p - drafts.probs, 0.0)
    residual = jnp.where(drafts.token_ids[:, None] >= 0, residual.at[jnp.arange(x.shape[0]), draft[:, 0]].set(0.0),
                         residual)  # rounding aside, the residual is 0 at a rejected d already
    has_residual = residual.max(axis=-1) > 0
    resampled = argmax(jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0)) + noise, -jnp.inf))
    # p == q (no residual mass) accepts every d but for rounding: such a row keeps its plain draw.
    rejected = jnp.where(has_residual, resampled, token)
    return jnp.where(verifies, jnp.where(accept, draft[:, 0], rejected), token).astype(jnp.int32)


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
    drafts: Optional[DraftRows] = None,  # from RANDOM on: the draft model's tokens rows verify (`_verify_draft`)
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
    token = jnp.where(s.temperature == 0, argmax(x),
                      _draw(x, s, level >= StepVariant.FULL, argmax, drafts)).astype(jnp.int32)
    if level < StepVariant.FULL:
        return (token, *no_logprobs)
    token_lp, top_ids, top_lp = _logprobs(logits, token, num_logprobs)
    return token, token_lp, top_ids, top_lp
