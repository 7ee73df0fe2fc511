"""In-jit sampling: each parameter does what it says, and a row's draw depends only on its own key."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.sampling import (SAMPLING_LEVELS, PenaltyCounts, SamplingArrays, StepVariant, record_tokens, sample,
                            sampling_level)
from jaxcb.sampling_params import SamplingParams

VOCAB = 11
GREEDY, RANDOM, FULL = StepVariant.GREEDY, StepVariant.RANDOM, StepVariant.FULL


def arrays(rows, **overrides):
    base = dict(
        temperature=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32), repetition_penalty=np.ones(rows, np.float32),
        presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
        seeds=np.arange(rows, dtype=np.uint32), counters=np.zeros(rows, np.int32),
        banned_token_ids=np.full((rows, 2), VOCAB, np.int32),
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


def draw(logits, s, counts=None, level=FULL):
    rows = logits.shape[0]
    counts = counts_of(rows) if counts is None else counts
    tok, lp, top_ids, top_lp = sample(jnp.asarray(logits, jnp.float32), s, level, 3, counts=counts)
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
    tok, lp, top_ids, top_lp = (np.asarray(a) for a in sample(jnp.asarray(logits), s, RANDOM, 3))
    assert np.all(lp == 0) and np.all(top_ids == 0) and np.all(top_lp == 0)
    given = jnp.array([5, 6, 7, 8], jnp.int32)  # what a backend's fused matmul-argmax found
    tok, *_ = sample(None, s, GREEDY, 3, logits_argmax=given)
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


def test_top_k_top_p_without_a_sort_keep_exactly_what_a_sort_keeps():
    from benchmarks.sampling_filter import sorted_filter  # the textbook filter: one descending sort
    from jaxcb.sampling import _filter_top_k_top_p

    rng = np.random.default_rng(0)
    rows, vocab = 48, 997
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * rng.uniform(0.1, 8, (rows, 1)).astype(np.float32)
    logits[0, :50] = 3.0  # ties at the cut
    logits[1] = np.round(logits[1])  # many ties
    logits[2, 10:] = -np.inf  # a row already filtered
    logits[3] = -1e30  # huge negative values
    top_k = rng.integers(0, 60, rows).astype(np.int32)
    top_k[:6] = [1, 0, 5, vocab, vocab + 7, 2]
    top_p = rng.uniform(0.01, 1.0, rows).astype(np.float32)
    top_p[6:10] = [1.0, 1e-6, 0.5, 0.999999]
    s = arrays(rows, top_k=top_k, top_p=top_p)
    ours = np.asarray(jax.jit(lambda x: _filter_top_k_top_p(x, s))(jnp.asarray(logits)))
    theirs = np.asarray(sorted_filter(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))
    np.testing.assert_array_equal(ours[~np.isneginf(ours)], logits[~np.isneginf(ours)])
