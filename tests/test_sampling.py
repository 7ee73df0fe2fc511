"""In-jit sampling: each parameter does what it says, and a row's draw depends only on its own key."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.sampling import (SAMPLING_LEVELS, PenaltyCounts, SamplingArrays, StepVariant, record_tokens, sample,
                            sampling_level)
from jaxcb.errors import InvalidRequestError
from jaxcb.sampling_params import SamplingParams, sample_seed

VOCAB = 11
GREEDY, RANDOM, FULL = StepVariant.GREEDY, StepVariant.RANDOM, StepVariant.FULL


def arrays(rows, **overrides):
    base = dict(
        temperature=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32), repetition_penalty=np.ones(rows, np.float32),
        presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
        seeds=np.arange(rows, dtype=np.uint32), counters=np.zeros(rows, np.int32),
        banned_token_ids=np.full((rows, 2), VOCAB, np.int32), seeds_hi=np.zeros(rows, np.uint32),
    )
    base.update({k: np.asarray(v, base[k].dtype) for k, v in overrides.items()})
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in base.items()})


def counts_of(rows, prompt=(), output=()):
    """PenaltyCounts of `rows` rows that all saw the same prompt and output tokens."""
    seen = np.zeros((rows, VOCAB), bool)
    out = np.zeros((rows, VOCAB), np.int32)
    for t in list(prompt) + list(output):
        seen[:, t] = True
    for t in output:
        out[:, t] += 1
    return PenaltyCounts(jnp.asarray(seen), jnp.asarray(out))


@functools.partial(jax.jit, static_argnames="level")
def _sample_jitted(logits, s, counts, level):
    # Jitted as the step runs it: op by op, the sampler's many small operations would each compile
    # an executable of their own, and a process that compiles and drops thousands of them is what
    # XLA:CPU's unwinder crashes in (docs/architecture.md).
    return sample(logits, s, level, 3, counts=counts)


def draw(logits, s, counts=None, level=FULL):
    rows = logits.shape[0]
    counts = counts_of(rows) if counts is None else counts
    tok, lp, top_ids, top_lp = _sample_jitted(jnp.asarray(logits, jnp.float32), s, counts, level)
    return np.asarray(tok), np.asarray(lp), np.asarray(top_ids), np.asarray(top_lp)


LOGITS = np.array([[0.0, 1.0, 3.0, 2.9, 2.8, -1.0, 0.5, 0.2, 0.1, 0.0, -2.0]], np.float32)


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    tok, lp, top_ids, top_lp = draw(LOGITS, arrays(1, temperature=[0.0]))
    assert tok[0] == 2
    expected = LOGITS[0] - np.log(np.exp(LOGITS[0]).sum())
    assert np.isclose(lp[0], expected[2], atol=1e-5)
    assert list(top_ids[0]) == [2, 3, 4] and np.allclose(top_lp[0], expected[[2, 3, 4]], atol=1e-5)


def test_top_k_top_p_and_min_p_keep_only_what_they_allow():
    many = np.repeat(LOGITS, 300, axis=0)
    seeds = np.arange(300)
    tok_k, *_ = draw(many, arrays(300, top_k=[2] * 300, seeds=seeds))
    assert set(tok_k) == {2, 3}
    tok_p, *_ = draw(many, arrays(300, top_p=[0.05] * 300, seeds=seeds))
    assert set(tok_p) == {2}
    tok_m, *_ = draw(many, arrays(300, min_p=[0.85] * 300, seeds=seeds))
    assert set(tok_m) <= {2, 3, 4} and len(set(tok_m)) > 1
    tok_all, *_ = draw(many, arrays(300, seeds=seeds))
    assert len(set(tok_all)) > 5  # unfiltered sampling really samples


def test_a_rows_draw_depends_only_on_its_seed_and_counter():
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((5, VOCAB)).astype(np.float32)
    s = arrays(5, seeds=[7, 8, 9, 10, 11], counters=[3, 0, 5, 1, 2], top_k=[0, 3, 0, 0, 4])
    together, *_ = draw(batch, s)
    alone, *_ = draw(batch[2:3], arrays(1, seeds=[9], counters=[5]))
    assert together[2] == alone[0]
    moved, *_ = draw(batch[[4, 2]], arrays(2, seeds=[11, 9], counters=[2, 5], top_k=[4, 0]))
    assert moved[1] == together[2] and moved[0] == together[4]


def test_seeds_are_64_bits_and_those_below_2_32_draw_as_they_always_did():
    # The high half went nowhere before: seeds 1 and 2**32 + 1 drew the same tokens, silently.
    flat = np.zeros((64, VOCAB), np.float32)  # every token equally likely: the draws are the noise's
    same_low = draw(flat, arrays(64, seeds=[1] * 64, counters=np.arange(64)))[0]
    high = draw(flat, arrays(64, seeds=[1] * 64, seeds_hi=[1] * 64, counters=np.arange(64)))[0]
    assert (same_low != high).sum() > 32
    # below 2**32 the row's key is jax.random.key(seed), as it was: the same Gumbel-argmax draw
    key = jax.random.fold_in(jax.random.key(np.uint32(1)), 5)
    expected = int(jnp.argmax(jax.random.gumbel(key, (VOCAB,), jnp.float32)))
    assert same_low[5] == expected


def test_a_requests_samples_get_distinct_64_bit_seeds_that_keep_the_32_bit_ones():
    assert [sample_seed(5, i) for i in range(3)] == [(5 + 0x9E3779B1 * i) & 0xFFFFFFFF for i in range(3)]
    assert sample_seed(2**32 + 5, 1) == (1 << 32) | ((5 + 0x9E3779B1) & 0xFFFFFFFF)
    assert sample_seed(-1, 0) == 2**64 - 1 != sample_seed(2**32 - 1, 0)
    with pytest.raises(InvalidRequestError, match="seed=.* must fit in 64 bits"):
        SamplingParams(seed=2**64)
    with pytest.raises(InvalidRequestError, match="seed=.* must fit in 64 bits"):
        SamplingParams(seed=-(2**63) - 1)


def test_banned_tokens_are_never_drawn():
    s = arrays(1, temperature=[0.0], banned_token_ids=[[2, 3]])
    tok, *_ = draw(LOGITS, s)
    assert tok[0] == 4


def test_repetition_penalty_applies_to_prompt_and_output_presence_only_to_output():
    counts = counts_of(1, prompt=[2], output=[3])
    tok, *_ = draw(LOGITS, arrays(1, temperature=[0.0], repetition_penalty=[2.0]), counts)
    assert tok[0] == 4  # 3.0 -> 1.5 and 2.9 -> 1.45: 2.8 wins
    tok, *_ = draw(LOGITS, arrays(1, temperature=[0.0], presence_penalty=[0.15]), counts)
    assert tok[0] == 2  # only the output token 3 is penalised; 2 is still best
    tok, *_ = draw(LOGITS, arrays(1, temperature=[0.0], frequency_penalty=[2.0]), counts_of(1, prompt=[5], output=[2]))
    assert tok[0] == 3


def test_recorded_tokens_are_seen_and_only_outputs_counted():
    counts = PenaltyCounts(jnp.zeros((3, VOCAB), bool), jnp.zeros((3, VOCAB), jnp.int32))
    counts = record_tokens(counts, jnp.array([1, 1, 1, 3, 0]), jnp.array([4, 5, 5, 6, 7]),
                           jnp.array([False, True, True, True, False]))  # slot 3 is out of range: dropped
    assert np.flatnonzero(counts.seen[1]).tolist() == [4, 5] and np.flatnonzero(counts.seen[0]).tolist() == [7]
    assert counts.output_counts[1, 5] == 2 and counts.output_counts[1, 4] == 0 and not counts.seen[2].any()


def test_a_row_draws_the_same_token_at_every_level_that_serves_it():
    """A step's level follows the other rows (one top_p row lifts it to FULL), so a row's token must
    not depend on it: greedy rows match at all three levels, unfiltered random ones at RANDOM and FULL."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((64, VOCAB)).astype(np.float32) * 3
    greedy = arrays(64, temperature=np.zeros(64))
    by_level = [draw(logits, greedy, level=level)[0] for level in SAMPLING_LEVELS]
    np.testing.assert_array_equal(by_level[0], logits.argmax(axis=1))
    np.testing.assert_array_equal(by_level[0], by_level[1])
    np.testing.assert_array_equal(by_level[0], by_level[2])
    random = arrays(64, temperature=rng.uniform(0.2, 2, 64), seeds=np.arange(64) * 7, counters=np.arange(64))
    np.testing.assert_array_equal(draw(logits, random, level=RANDOM)[0], draw(logits, random, level=FULL)[0])
    banned = arrays(64, temperature=np.zeros(64), banned_token_ids=np.tile([[2, 3]], (64, 1)))
    np.testing.assert_array_equal(draw(LOGITS.repeat(64, 0), banned, level=RANDOM)[0], 4)


def test_below_full_no_logprobs_are_computed_and_greedy_takes_the_given_argmax():
    logits = np.random.default_rng(0).standard_normal((4, VOCAB)).astype(np.float32)
    s = arrays(4, temperature=[0, 0, 0, 0])
    tok, lp, top_ids, top_lp = (np.asarray(a) for a in jax.jit(lambda lg, s: sample(lg, s, RANDOM, 3))(
        jnp.asarray(logits), s))
    assert np.all(lp == 0) and np.all(top_ids == 0) and np.all(top_lp == 0)
    given = jnp.array([5, 6, 7, 8], jnp.int32)  # what a backend's fused matmul-argmax found
    tok, *_ = jax.jit(lambda s, g: sample(None, s, GREEDY, 3, logits_argmax=g))(s, given)
    np.testing.assert_array_equal(tok, given)
    full = draw(logits, s)
    expected = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(full[1], expected[np.arange(4), full[0]], atol=1e-5)


def optimised_hlo(level: StepVariant, rows: int = 2) -> str:
    s = arrays(rows, temperature=np.linspace(0, 1, rows))
    counts = counts_of(rows)
    return jax.jit(lambda lg, s, c: sample(lg, s, level, 3, counts=c)).lower(
        jnp.zeros((rows, VOCAB), jnp.float32), s, counts).compile().as_text()


def test_no_level_branches_or_loops_on_a_device_value():
    """On a GPU a conditional (or a loop whose end XLA cannot see) waits for the device to tell the
    host which way to go: no level has one, its work fixed when compiled (the random bits' own
    loops have a trip count XLA knows)."""
    for level in SAMPLING_LEVELS:
        hlo = optimised_hlo(level)
        assert " conditional(" not in hlo, level.label
        loops = [line for line in hlo.splitlines() if " while(" in line]
        assert all('"known_trip_count"' in line for line in loops), level.label


def test_the_host_picks_the_least_level_that_serves_every_row():
    p = lambda **kw: SamplingParams(**{"max_tokens": 4, **kw})  # noqa: E731
    assert sampling_level([p(temperature=0), p(temperature=0)], any_banned=False) == GREEDY
    assert sampling_level([p(temperature=0)], any_banned=True) == RANDOM
    assert sampling_level([p(temperature=0), p(temperature=0.7)], any_banned=False) == RANDOM
    for asks in (dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(logprobs=0), dict(presence_penalty=0.1),
                 dict(repetition_penalty=1.1, temperature=0)):
        assert sampling_level([p(temperature=0), p(**{"temperature": 0.7, **asks})], any_banned=False) == FULL, asks


def sorted_top_k_top_p(logits, top_k, top_p):
    """The textbook filter, one sort per row: top-k keeps the logits >= the k-th largest (ties too);
    top-p, on what top-k kept, sorts them, takes the softmax's cumulative mass (vLLM's way) and keeps
    every token up to and including the first that brings it to top_p, with the ties of the last;
    top_p >= 1 keeps them all."""
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(jnp.sort(logits, axis=-1)[:, ::-1], (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_desc = jnp.take_along_axis(logits, jnp.argsort(-logits, axis=-1), axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1)
    keep = keep.at[:, 0].set(True)
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def filter_both_ways(logits, top_k, top_p):
    """(the step's filter, the sort's) on the same rows, as numpy."""
    from jaxcb.sampling import _filter_top_k_top_p

    s = arrays(len(logits), top_k=top_k, top_p=top_p)
    ours = jax.jit(lambda x: _filter_top_k_top_p(x, s))(jnp.asarray(logits, jnp.float32))
    theirs = sorted_top_k_top_p(jnp.asarray(logits, jnp.float32), s.top_k, s.top_p)
    return np.asarray(ours), np.asarray(theirs)


def assert_same_tokens_kept(logits, top_k, top_p):
    ours, theirs = filter_both_ways(logits, top_k, top_p)
    dropped = np.isneginf(ours)
    for row in range(len(logits)):
        np.testing.assert_array_equal(dropped[row], np.isneginf(theirs[row]),
                                      err_msg=f"row {row}: top_k={top_k[row]} top_p={top_p[row]}")
    np.testing.assert_array_equal(ours[~dropped], np.asarray(logits, np.float32)[~dropped])


def random_rows(rng, rows, vocab):
    scale = rng.uniform(0.1, 8, (rows, 1))
    return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


def test_top_k_top_p_without_a_sort_keep_exactly_what_a_sort_keeps():
    rng = np.random.default_rng(0)
    rows, vocab = 64, 997  # odd: no power of two lines up by accident
    logits = random_rows(rng, rows, vocab)
    top_k = rng.integers(0, 60, rows)
    top_k[:6] = [1, 0, 5, vocab, vocab + 7, 2]
    top_p = rng.uniform(0.01, 1.0, rows)
    top_p[6:12] = [1.0, 1e-6, 0.5, 0.999999, 1e-30, 0.9]
    top_p[12:20] = 1.0  # top-k alone
    top_k[20:28] = 0  # top-p alone
    assert_same_tokens_kept(logits, top_k, top_p)


def kept_in_float64(logits, top_k, top_p, tol=1e-5):
    """(bool[R, V] what top-k then top-p keep with every sum in float64, bool[R] rows whose top-p cut-off
    is a near-tie: some token's mass before it lies within `tol` of top_p, where float32 sums in any
    order may fall either side)."""
    kept, near = np.zeros(logits.shape, bool), np.zeros(len(logits), bool)
    for r, (row, k, p) in enumerate(zip(logits.astype(np.float64), top_k, top_p)):
        desc = np.sort(row)[::-1]
        k = min(k, len(row)) if k > 0 else len(row)
        keep = row >= desc[k - 1]
        if p < 1:
            vals = np.sort(row[keep])[::-1]
            probs = np.exp(vals - vals[0]) / np.exp(vals - vals[0]).sum()
            before = np.cumsum(probs) - probs
            near[r] = bool((np.abs(before - p) < tol).any())
            last = max(1, int((before < p).sum()))
            keep &= row >= vals[last - 1]
        kept[r] = keep
    return kept, near


def test_on_a_large_vocabulary_top_p_keeps_what_float64_sums_keep_save_near_ties():
    """At 50k tokens the float32 sums of a sort and of the radix select's histograms round differently;
    against sums in float64 the filter is exact wherever the cut-off is not a near-tie."""
    from jaxcb.sampling import _filter_top_k_top_p

    rng = np.random.default_rng(5)
    rows, vocab = 24, 50021
    logits = random_rows(rng, rows, vocab)
    top_k = np.where(np.arange(rows) % 3 == 0, rng.integers(1, 4000, rows), 0)
    top_p = rng.uniform(0.3, 0.999, rows)
    s = arrays(rows, top_k=top_k, top_p=top_p)
    ours = ~np.isneginf(np.asarray(jax.jit(lambda x: _filter_top_k_top_p(x, s))(jnp.asarray(logits))))
    kept, near = kept_in_float64(logits, top_k, np.asarray(s.top_p))
    assert near.sum() <= rows // 4, near.sum()  # most rows are decided, or the test would prove nothing
    for r in np.nonzero(~near)[0]:
        np.testing.assert_array_equal(ours[r], kept[r], err_msg=f"row {r}: top_k={top_k[r]} top_p={top_p[r]}")


def test_ties_at_either_cut_off_are_all_kept():
    rng = np.random.default_rng(1)
    vocab = 301
    logits = np.round(random_rows(rng, 40, vocab))  # many ties everywhere
    logits[0, :50] = 99.0  # the largest, fifty times: k = 1 keeps all fifty
    logits[1] = 2.0  # one value: every k and p keep the row
    logits[2, :3], logits[2, 3:10], logits[2, 10:] = 5.0, 4.0, -3.0  # k = 5 falls inside the 4.0s
    logits[3] = logits[2]
    top_k = rng.integers(0, 40, 40)
    top_k[:4] = [1, 7, 5, 0]
    top_p = rng.uniform(0.01, 1.0, 40)
    top_p[:4] = [1.0, 0.3, 1.0, 0.6]  # row 3: the 5.0s hold 0.53 of the mass, the 4.0s bring it past 0.6
    assert_same_tokens_kept(logits, top_k, top_p)
    ours, _ = filter_both_ways(logits[:4], top_k[:4], top_p[:4])
    assert (~np.isneginf(ours)).sum(axis=1).tolist() == [50, vocab, 10, 10]


def test_minus_infinity_and_huge_logits_keep_what_a_sort_keeps():
    rng = np.random.default_rng(2)
    vocab = 257
    logits = random_rows(rng, 24, vocab)
    logits[0, 10:] = -np.inf  # a row already filtered: k past its finite entries keeps those
    logits[1, ::2] = -np.inf
    logits[2] = -1e30
    logits[3, :5] = 1e30
    logits[4, :3], logits[4, 3:6] = 3e38, -3e38
    logits[5] = -3e38
    logits[6, 7], logits[6, 100:] = -3e38, -1e30
    logits[7, :2], logits[7, 2:] = 1e30, -1e30
    logits[8:12] = logits[4:8] * np.float32(0.5)
    top_k = np.array([20, 0, 3, 2, 4, 1, 0, 0, 300, 2, 0, 1] + [0, 5] * 6)
    top_p = np.array([1.0, 0.5, 0.7, 0.9, 0.6, 1.0, 0.2, 0.999, 1.0, 0.4, 0.8, 1e-6] + [0.3] * 12)
    assert_same_tokens_kept(logits, top_k, top_p)


def test_k_of_one_or_the_whole_vocabulary_and_p_tiny_or_one():
    rng = np.random.default_rng(3)
    vocab = 1031
    logits = random_rows(rng, 16, vocab)
    top_k = np.array([1, vocab, 0, vocab, 1, 0, vocab + 1, 2] * 2)
    top_p = np.array([1.0, 1.0, 1e-7, 1e-7, 1e-7, 1.0, 0.999, 1.0] * 2)
    ours, _ = filter_both_ways(logits, top_k, top_p)
    kept = (~np.isneginf(ours)).sum(axis=1)
    assert kept[[0, 2, 3, 4]].tolist() == [1, 1, 1, 1] and kept[[1, 5, 7]].tolist() == [vocab, vocab, 2]
    assert_same_tokens_kept(logits, top_k, top_p)


def test_rows_with_the_filter_off_are_left_as_they_are():
    rng = np.random.default_rng(4)
    logits = random_rows(rng, 12, 509)
    logits[0, :30] = -np.inf
    logits[1, :4] = 1e30
    top_k = np.array([0, 0, 3, 0, 0, 7, 0, 0, 1, 0, 0, 0])
    top_p = np.array([1, 1, 1, 1, 0.5, 1, 1, 0.2, 1, 1, 1, 0.9])
    ours, _ = filter_both_ways(logits, top_k, top_p)
    off = (top_k == 0) & (top_p == 1)
    np.testing.assert_array_equal(ours[off], logits[off])
    assert_same_tokens_kept(logits, top_k, top_p)
