"""Speculative decoding with a draft model: greedy outputs identical to decoding without it, sampled
outputs distributed as the served model's (chi-square), blocks returned, refusals by name."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from engine_factory import make_engine, shared_engine
from test_engine import run_with_arrivals
from test_speculation import SPEC_BASE, assert_all_blocks_free, completions, spec_workload
from jaxcb.config import ConfigError, compose_config
from jaxcb.draft_setup import DraftModel
from jaxcb.kv_cache import step_activation_bytes
from jaxcb.sampling import DraftRows, PenaltyCounts, SamplingArrays, StepVariant, sample
from jaxcb.sampling_params import SamplingParams

DRAFT = "speculative.method=draft"
SELF_DRAFT = (DRAFT, "speculative.draft_model=tiny")  # the served model drafting for itself: all accepted
OTHER_DRAFT = (DRAFT, "speculative.draft_model={name:tiny,seed:1}")  # another random model, the same vocabulary
MIN_P_VALUE = 1e-3  # a chi-square test passes above this p-value


def chi_square(observed: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(statistic, p-value) of observed counts against expected counts over the cells expected > 0."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token the target never samples was sampled"
    statistic = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    return statistic, float(scipy_stats.chi2.sf(statistic, int(keep.sum()) - 1))


# --- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, field", [
    ((DRAFT,), "speculative.method=draft needs speculative.draft_model"),
    ((DRAFT, "speculative.draft_model=nosuch"), "speculative.draft_model's name='nosuch'"),
    ((DRAFT, "speculative.draft_model={name:tiny,sed:1}"), "sed"),
    ((*SELF_DRAFT, "scheduler.preemption_mode=swap"), "scheduler.preemption_mode=swap"),
    ((*SELF_DRAFT, "scheduler.policy=static"), "scheduler.policy=static"),
    (("speculative.method=ngram", "speculative.draft_model=tiny"), "speculative.draft_model"),
])
def test_draft_model_configs_it_cannot_serve_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigError, match=field):
        compose_config(overrides)


def test_a_draft_model_with_another_vocabulary_is_refused_at_start_up():
    with pytest.raises(ConfigError, match="speculative.draft_model=tiny must share model=tiny's tokenizer"):
        make_engine(*SPEC_BASE, DRAFT, "speculative.draft_model={name:tiny,vocab_size:300}")


def test_the_cache_plan_counts_both_models_bytes_per_block():
    on, off = shared_engine(*SPEC_BASE, *OTHER_DRAFT), shared_engine(*SPEC_BASE)
    assert on.cache_plan.bytes_per_block == 2 * off.cache_plan.bytes_per_block  # the draft is a tiny too
    assert on.draft_runner.kv_cache.num_blocks > on.cache_plan.num_blocks  # + its proposals' scratch blocks


def test_the_cache_plan_leaves_room_for_what_the_draft_runner_allocates_after_it():
    on = shared_engine(*SPEC_BASE, *OTHER_DRAFT)
    runner, plan = on.draft_runner, on.cache_plan
    draft = DraftModel(None, runner.backend, runner.weights, runner.kv_cache.k.dtype)
    tokens = max(on.runner.buckets.tokens)
    reserve = draft.reserve_bytes(plan.block_size, max_proposals=runner.max_proposals,
                                  num_speculative_tokens=runner.k, max_num_batched_tokens=tokens)
    scratch = (runner.kv_cache.num_blocks - plan.num_blocks) * draft.bytes_per_block(plan.block_size)
    assert scratch > 0 and runner.probs.nbytes > 0
    workspace = step_activation_bytes(runner.backend.cfg, tokens, runner.max_proposals)
    assert reserve == scratch + runner.probs.nbytes + workspace


# --- the sampler's rule, alone ---------------------------------------------------------------------


def test_speculative_sampling_draws_the_targets_distribution_whatever_the_draft():
    """8 tokens, temperature 1, top-p 0.9; a draft q that puts most of its mass where p has little.
    Over 20,000 seeded rows each verifying a draft drawn from q, the tokens follow p (chi-square); the
    drafts themselves (what accepting every draft would give) do not."""
    vocab, num_rows = 8, 20_000
    logits = jnp.log(jnp.array([0.30, 0.22, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03], jnp.float32))
    q = np.array([0.02, 0.03, 0.05, 0.05, 0.15, 0.2, 0.2, 0.3], np.float32)
    rng = np.random.default_rng(0)
    drafts = rng.choice(vocab, size=num_rows, p=q / q.sum()).astype(np.int32)
    s = SamplingArrays(
        temperature=jnp.ones(num_rows), top_k=jnp.zeros(num_rows, jnp.int32), top_p=jnp.full(num_rows, 0.9),
        min_p=jnp.zeros(num_rows), repetition_penalty=jnp.ones(num_rows), presence_penalty=jnp.zeros(num_rows),
        frequency_penalty=jnp.zeros(num_rows), seeds=jnp.arange(num_rows, dtype=jnp.uint32),
        counters=jnp.full(num_rows, 3, jnp.int32), banned_token_ids=jnp.full((num_rows, 1), vocab, jnp.int32),
        seeds_hi=jnp.zeros(num_rows, jnp.uint32))
    counts = PenaltyCounts(jnp.zeros((num_rows, vocab), bool), jnp.zeros((num_rows, vocab), jnp.int32))
    rows = DraftRows(jnp.asarray(drafts), jnp.broadcast_to(jnp.asarray(q), (num_rows, vocab)))
    x = jnp.broadcast_to(logits, (num_rows, vocab))
    # Compiled with XLA:CPU's default backend optimisation (the suite's level 0 ran these 20,000 rows'
    # sampling ~8x slower); the semantics are the same.
    step = jax.jit(lambda x: sample(x, s, StepVariant.FULL, 1, counts=counts, drafts=rows))
    token, *_ = step.lower(x).compile(compiler_options={"xla_backend_optimization_level": 2})(x)
    token = np.asarray(token)
    # p: top-p 0.9 keeps the fewest largest tokens whose mass reaches 0.9 (the first six), renormalized.
    p = np.array([0.30, 0.22, 0.15, 0.12, 0.08, 0.06, 0, 0])
    p /= p.sum()
    observed = np.bincount(token, minlength=vocab)
    _, p_value = chi_square(observed, p * num_rows)
    accepted = token == drafts
    print(f"sampler: chi-square p = {p_value:.3f}, drafts accepted {accepted.mean():.2f}")  # pytest -s shows it
    assert p_value > MIN_P_VALUE, (observed, p * num_rows, p_value)
    assert 0.1 < accepted.mean() < 0.6  # the draft disagrees often: many rows resample from the residual
    _, p_drafts = chi_square(np.bincount(drafts, minlength=vocab)[:6], p[:6] * (drafts < 6).sum())
    assert p_drafts < 1e-12  # the test tells q from p


# --- the engine: tiny model ------------------------------------------------------------------------


@pytest.mark.parametrize("draft", [SELF_DRAFT, OTHER_DRAFT], ids=["self", "other_random"])
def test_greedy_outputs_with_a_draft_model_equal_those_without_it(draft):
    """200 requests with preemption, prefix-cache hits and n = 2: token for token the same, with the
    served model drafting for itself (every draft accepted) or another random model (few accepted)."""
    off, on = shared_engine(*SPEC_BASE), shared_engine(*SPEC_BASE, *draft)
    work = spec_workload(seed=11)
    params = lambda rid, m: SamplingParams(temperature=0, max_tokens=m, n=2 if rid.endswith("7") else 1)  # noqa: E731
    before = on.scheduler.num_preemptions, on.scheduler.prefix_cache_hits, on.speculation.stats.num_draft_tokens
    accepted_before = on.speculation.stats.num_accepted_tokens
    assert completions(run_with_arrivals(on, work, params)) == completions(run_with_arrivals(off, work, params))
    stats = on.speculation.stats
    proposed, accepted = stats.num_draft_tokens - before[2], stats.num_accepted_tokens - accepted_before
    assert proposed > 0
    if draft is SELF_DRAFT:
        assert accepted == proposed  # the same model, greedy: every draft is the target's own token
    else:
        assert accepted < proposed / 2
    assert on.scheduler.num_preemptions > before[0] and on.scheduler.prefix_cache_hits > before[1]
    assert on.num_recompiles == 0 and off.num_recompiles == 0
    assert_all_blocks_free(on)


def test_sampled_tokens_with_a_draft_model_follow_the_targets_distribution():
    """Temperature 1, top-k 4 and top-p 0.8, a draft that disagrees often (another random model, which
    samples from all 259 tokens): each request's second token -- the first one a verify step draws --
    follows the served model's distribution given its first (chi-square over 1,200 seeded requests;
    the expected probabilities from the served model's own top-4 logprobs at that position)."""
    on = shared_engine(*SPEC_BASE, *OTHER_DRAFT)
    prompt = [72, 101, 108, 108, 111, 32]
    top_k, top_p, n = 4, 0.8, 1200
    drafts_before = on.speculation.stats.num_drafts
    work = [(f"req{i}", prompt, 3, i // 8) for i in range(n)]  # 3 tokens: room for one draft after the first
    params = lambda rid, m: SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=int(rid[3:]),  # noqa: E731
                                           max_tokens=m, logprobs=top_k)
    # No back-off while these run, as speculative.min_mean_accepted=0 gives (the shared engine, idle, with the
    # setting it was built with restored after): the draft disagrees often, and every second token is verified.
    saved = on.speculation.min_mean_accepted
    on.speculation.min_mean_accepted = 0.0
    try:
        results = run_with_arrivals(on, work, params)
    finally:
        on.speculation.min_mean_accepted = saved
    assert on.speculation.stats.num_drafts - drafts_before > n * 0.9  # nearly every second token was verified
    groups: dict[int, list] = {}
    for out in results.values():
        c = out.outputs[0]
        groups.setdefault(c.token_ids[0], []).append((c.token_ids[1], c.logprobs[1]))
    statistic, dof = 0.0, 0
    for first, entries in groups.items():
        top = entries[0][1]  # {token: raw logprob}: the top 4 (and the chosen one) at the second position
        ids = sorted(top, key=lambda t: -top[t])[:top_k]
        probs = np.exp(np.array([top[t] for t in ids]))
        probs /= probs.sum()
        keep = int(np.searchsorted(np.cumsum(probs), top_p - 1e-6) + 1)  # the fewest whose mass reaches top_p
        probs = np.where(np.arange(len(ids)) < keep, probs, 0.0)
        probs /= probs.sum()
        observed = np.array([sum(1 for t, _ in entries if t == i) for i in ids])
        assert observed.sum() == len(entries)  # every token sampled is among the top 4
        if len(entries) < 40:
            continue  # too few draws after this first token to test
        expected = probs * len(entries)
        kept = expected > 0
        assert observed[~kept].sum() == 0  # nothing top-p cuts is ever sampled
        statistic += float((((observed - expected) ** 2)[kept] / expected[kept]).sum())
        dof += int(kept.sum()) - 1
    assert dof >= 3
    p_value = float(scipy_stats.chi2.sf(statistic, dof))
    print(f"engine: chi-square {statistic:.2f}, {dof} degrees of freedom, p = {p_value:.3f}")  # pytest -s shows it
    assert p_value > MIN_P_VALUE, (statistic, dof, p_value)
    assert on.num_recompiles == 0
    assert_all_blocks_free(on)


def test_draft_speculation_without_async_scheduling_gives_the_same_outputs():
    off = shared_engine(*SPEC_BASE)
    on_sync = make_engine(*SPEC_BASE, *SELF_DRAFT, "engine.async_scheduling=false")
    work = spec_workload(seed=13, n=60)
    params = lambda rid, m: SamplingParams(temperature=0, max_tokens=m)  # noqa: E731
    assert completions(run_with_arrivals(on_sync, work, params)) == completions(run_with_arrivals(off, work, params))
    stats = on_sync.speculation.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert_all_blocks_free(on_sync)


def test_aborts_in_the_middle_of_draft_speculation_leak_no_block():
    on = shared_engine(*SPEC_BASE, *OTHER_DRAFT)
    work = spec_workload(seed=14, n=80)
    rng = random.Random(7)
    abort_at = {rid: arrival + rng.randint(0, 25) for rid, _, _, arrival in work if rng.random() < 0.5}
    params = lambda rid, m: SamplingParams(temperature=0.8, seed=int(rid[3:]), max_tokens=m)  # noqa: E731
    results = run_with_arrivals(on, work, params, abort_at)
    assert any(v is None for v in results.values())
    assert_all_blocks_free(on)
    assert on.num_recompiles == 0
