"""Speculative decoding with n-gram proposals: outputs identical to decoding without it, blocks returned."""

import random

import pytest

from engine_factory import assert_same_tokens_and_logprobs, make_engine, shared_engine
from test_engine import run_with_arrivals
from jaxcb.config import ConfigError, SpeculativeConfig, compose_config
from jaxcb.core.sequence import Sequence
from jaxcb.core.speculation import NgramProposer, Speculation
from jaxcb.sampling_params import SamplingParams

# Blocks of 8 tokens and too few of them: preemption, and rejected drafts' blocks freed and taken again.
SPEC_BASE = ("cache.block_size=8", "cache.num_blocks=40", "engine.context_buckets=[32]")
NGRAM = "speculative.method=ngram"


def spec_workload(seed: int, n: int = 200):
    """Random prompts, prompts that repeat a pattern (proposals accepted), prompts sharing a prefix
    (prefix cache hits), arriving over 60 steps."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(20)]
    work = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        elif kind == 1:
            pattern = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
            prompt = (pattern * 12)[: rng.randint(8, 50)]
        else:
            prompt = shared + [rng.randrange(256) for _ in range(rng.randint(1, 20))]
        work.append((f"req{i}", prompt, rng.randint(1, 40), rng.randint(0, 60)))
    return work


def completions(results):
    return {rid: None if out is None else [c.token_ids for c in out.outputs] for rid, out in results.items()}


def assert_all_blocks_free(engine):
    assert not engine.has_unfinished_requests() and engine.scheduler.num_unfinished == 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
    engine.block_pool.check_invariants()


# --- the proposer and the back-off, alone ---------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(min_n=2, max_n=3)
    propose = lambda tokens, k: proposer.continuation(proposer.new_index(), tokens, len(tokens), k)  # noqa: E731
    # [1, 2, 3] (3 tokens, the longest) last occurred at 0..2, followed by 9, 9, 7, ...
    assert propose([1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 1, 2, 3], 3) == [9, 9, 7]
    # [1, 2, 3] never occurred before; [2, 3] did, latest at 6..7, followed by 6, 1, ...
    assert propose([5, 2, 3, 4, 4, 8, 2, 3, 6, 1, 2, 3], 2) == [6, 1]
    assert propose([1, 2, 3, 4, 5], 4) == []
    # past the known tokens the match runs into its own continuation: a period-2 pattern goes on
    assert propose([4, 5, 4, 5, 4, 5], 4) == [4, 5, 4, 5]


def test_a_token_in_flight_is_guessed_from_the_match_and_never_indexed():
    proposer = NgramProposer(min_n=2, max_n=4)
    index = proposer.new_index()
    tokens = [3, 4, 5, 6, 3, 4]
    assert proposer.continuation(index, tokens, 6, 4) == [5, 6, 3, 4]
    # the next token in flight (-1): the match of the known suffix [3, 4] continues 5, 6, 3, ...; 5 stands
    # for the token in flight, and the drafts follow it
    tokens.append(-1)
    assert proposer.continuation(index, tokens, 6, 3) == [6, 3, 4]
    assert all(-1 not in gram for gram in index.last_end)
    tokens[-1] = 5
    assert proposer.continuation(index, tokens, 7, 2) == [6, 3]
    assert all(-1 not in gram for gram in index.last_end)


def _sequence(prompt, **params):
    return Sequence(("r", 0), list(prompt), SamplingParams(max_tokens=100, **params))


def _drafts(spec, seq, last_in_flight, num_decoding, max_drafts):
    """What `seq` alone brings to a step: its proposal (`Speculation.prepare`), cut to max_drafts."""
    spec.prepare([(seq, last_in_flight, -1)], num_decoding, lambda s: max_drafts)
    return spec.drafts(seq, max_drafts).token_ids


def test_backoff_stops_proposals_after_low_acceptance_and_resumes_later():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_mean_accepted=1.0, acceptance_window=2)
    spec = Speculation(cfg, disable_by_batch_size=8)
    seq = _sequence([1, 2, 3, 1, 2, 3, 1, 2])
    assert _drafts(spec, seq, False, 1, 3) == [3, 1, 2]
    spec.verified(seq, (3, 1, 2), 0)
    assert _drafts(spec, seq, False, 1, 3) == [3, 1, 2]
    spec.verified(seq, (3, 1, 2), 1)  # 0.5 accepted a step over the window, below 1.0
    assert _drafts(spec, seq, False, 1, 3) == []
    seq.output_token_ids += [3] * 16  # 16 tokens later it proposes again
    assert _drafts(spec, seq, False, 1, 3) != []
    assert spec.stats.num_drafts == 2 and spec.stats.num_draft_tokens == 6 and spec.stats.num_accepted_tokens == 1
    assert spec.stats.accepted_per_position == [1, 0, 0]
    # too many sequences decoding: compute-bound, no proposals
    assert _drafts(spec, seq, False, 9, 3) == []


def test_a_costly_proposer_backs_off_longer_judges_probes_sooner_and_new_sequences_learn_from_the_engine():
    """A draft model's failed probe costs about a step: 64 tokens of back-off, a probe judged on
    acceptance_window // 2 verify steps, and new sequences start backed off while the engine's last
    4 x acceptance_window verify steps failed -- until accepted drafts bring them back."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_mean_accepted=0.5, acceptance_window=4)
    spec = Speculation(cfg, disable_by_batch_size=8, costly=True)
    prompt = [1, 2, 3] * 4
    first = _sequence(prompt)
    for _ in range(4):  # the first window: 4 verify steps, nothing accepted
        assert _drafts(spec, first, False, 1, 3) == [1, 2, 3]
        spec.verified(first, (1, 2, 3), 0)
    assert _drafts(spec, first, False, 1, 3) == []
    first.output_token_ids += [1] * 63
    assert _drafts(spec, first, False, 1, 3) == []  # 64 tokens, not 16
    first.output_token_ids += [1]
    assert _drafts(spec, first, False, 1, 3) != []
    spec.verified(first, (1, 2, 3), 0)
    spec.verified(first, (1, 2, 3), 0)  # the probe: judged after 2 verify steps, backed off 128 tokens
    assert _drafts(spec, first, False, 1, 3) == []
    assert not spec.failing()  # 6 of the engine's 16 verify steps seen
    for _ in range(10):
        spec.verified(_sequence(prompt), (1, 2, 3), 0)
    assert spec.failing()
    late = _sequence(prompt)
    assert _drafts(spec, late, False, 1, 3) == []  # starts backed off: the engine's drafts fail
    late.output_token_ids += [1] * 64
    drafts = _drafts(spec, late, False, 1, 3)
    assert drafts  # its probe
    for _ in range(16):  # its drafts pay: the engine's verdict turns, and new sequences propose at once
        spec.verified(late, tuple(drafts), 3)
    assert not spec.failing() and _drafts(spec, _sequence(prompt), False, 1, 3) == [1, 2, 3]
    # a cheap proposer (n-gram) keeps 16-token back-offs and full windows: never a prior
    cheap = Speculation(cfg, disable_by_batch_size=8)
    for _ in range(16):
        cheap.verified(_sequence(prompt), (1, 2, 3), 0)
    assert cheap.failing() and _drafts(cheap, _sequence(prompt), False, 1, 3) == [1, 2, 3]


def test_constrained_and_prompt_logprobs_requests_decode_without_speculation_and_are_counted():
    spec = Speculation(SpeculativeConfig(method="ngram"), disable_by_batch_size=8)
    constrained = _sequence([1, 2, 1, 2, 1])
    constrained.constraint = object()  # a grammar, allowed_token_ids or bad_words
    assert _drafts(spec, constrained, False, 1, 4) == []
    assert _drafts(spec, _sequence([1, 2, 1, 2, 1], prompt_logprobs=1), False, 1, 4) == []
    assert _drafts(spec, _sequence([1, 2, 1, 2, 1]), False, 1, 4) == [2, 1, 2, 1]
    assert spec.stats.num_unspeculated_requests == 2


@pytest.mark.parametrize("overrides, field", [
    (("speculative.method=draft",), "speculative.method=draft"),
    (("speculative.draft_model=small",), "speculative.draft_model"),
    ((NGRAM, "scheduler.policy=static"), "scheduler.policy=static"),
    ((NGRAM, "scheduler.max_num_batched_tokens=16", "speculative.num_speculative_tokens=16"),
     "speculative.num_speculative_tokens=16"),
    ((NGRAM, "speculative.prompt_lookup_min=3", "speculative.prompt_lookup_max=2"), "prompt_lookup_min=3"),
])
def test_unsupported_speculation_configs_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigError, match=field):
        compose_config(overrides)


# --- the engine: tiny model ------------------------------------------------------------------------


def test_greedy_outputs_with_ngram_speculation_equal_those_without_it():
    """200 requests with preemption, prefix-cache hits and n = 2: token for token the same."""
    off, on = shared_engine(*SPEC_BASE), shared_engine(*SPEC_BASE, NGRAM)
    work = spec_workload(seed=1)
    params = lambda rid, m: SamplingParams(temperature=0, max_tokens=m, n=2 if rid.endswith("7") else 1)  # noqa: E731
    before = on.scheduler.num_preemptions, on.scheduler.prefix_cache_hits
    assert completions(run_with_arrivals(on, work, params)) == completions(run_with_arrivals(off, work, params))
    stats = on.speculation.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts accepted, and some rejected
    assert on.scheduler.num_preemptions > before[0] and on.scheduler.prefix_cache_hits > before[1]
    assert on.num_recompiles == 0 and off.num_recompiles == 0
    assert_all_blocks_free(on)


def test_seeded_sampling_with_ngram_speculation_is_bit_for_bit_the_same():
    """Temperature, top-p, penalties, min_tokens and logprobs: the same tokens and logprobs."""
    off, on = shared_engine(*SPEC_BASE), shared_engine(*SPEC_BASE, NGRAM)
    work = spec_workload(seed=2, n=60)

    def params(rid, m):
        i = int(rid[3:])
        return SamplingParams(temperature=0.8, top_p=0.9 if i % 2 else 1.0, seed=i, max_tokens=m, logprobs=2,
                              repetition_penalty=1.2 if i % 4 == 1 else 1.0, frequency_penalty=0.3 if i % 4 == 3 else 0.0,
                              min_tokens=min(m, 5))

    drafts = on.speculation.stats.num_draft_tokens
    a, b = run_with_arrivals(off, work, params), run_with_arrivals(on, work, params)
    assert on.speculation.stats.num_draft_tokens > drafts
    # The same tokens; logprobs equal but for float rounding (a verify step's shapes are not a decode's).
    assert_same_tokens_and_logprobs([a[rid].outputs[0] for rid in a], [b[rid].outputs[0] for rid in a], 1e-5)
    assert on.num_recompiles == 0
    assert_all_blocks_free(on)


def test_speculation_without_async_scheduling_gives_the_same_outputs():
    off = shared_engine(*SPEC_BASE)
    on_sync = make_engine(*SPEC_BASE, NGRAM, "engine.async_scheduling=false")
    work = spec_workload(seed=3, n=60)
    params = lambda rid, m: SamplingParams(temperature=0, max_tokens=m)  # noqa: E731
    assert completions(run_with_arrivals(on_sync, work, params)) == completions(run_with_arrivals(off, work, params))
    assert on_sync.speculation.stats.num_accepted_tokens > 0
    assert_all_blocks_free(on_sync)


def test_aborts_in_the_middle_of_speculation_leak_no_block():
    on = shared_engine(*SPEC_BASE, NGRAM)
    work = spec_workload(seed=4, n=80)
    rng = random.Random(6)
    abort_at = {rid: arrival + rng.randint(0, 25) for rid, _, _, arrival in work if rng.random() < 0.5}
    results = run_with_arrivals(on, work, lambda rid, m: SamplingParams(temperature=0, max_tokens=m), abort_at)
    assert any(v is None for v in results.values())
    assert_all_blocks_free(on)
    assert on.num_recompiles == 0


def test_metrics_publish_speculation_under_vllms_names():
    from jaxcb.engine_stats import EMPTY_STEP, EngineStats
    from jaxcb.metrics import EngineMetrics

    metrics = EngineMetrics("tiny", prefix="vllm")
    base = dict(EMPTY_STEP, num_running=0, num_waiting=0, num_swapped=0, num_waiting_tokens=0, kv_usage=0.0,
                host_kv_usage=0.0, num_steps=1, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                num_recompiles=0)
    for drafts, proposed, accepted, per_pos in ((2, 8, 5, (2, 2, 1, 0)), (3, 12, 6, (3, 2, 1, 0))):
        metrics.on_step(EngineStats(**base, spec_num_drafts=drafts, spec_num_draft_tokens=proposed,
                                    spec_num_accepted_tokens=accepted, spec_accepted_per_position=per_pos), [], 0.01)
    text = metrics.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="tiny"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 12.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 6.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 3.0' in text
    assert EngineStats(**base, spec_num_drafts=3, spec_num_accepted_tokens=6).spec_mean_accepted_length == 3.0


def test_offline_benchmark_reports_acceptance_beside_throughput():
    from jaxcb.benchmark import WorkItem, describe_speculation, run_offline

    class Offline:  # what run_offline needs of an LLM
        engine = shared_engine(*SPEC_BASE, NGRAM)

        def generate(self, prompts, params, use_tqdm=False):
            from jaxcb.engine import LLM

            return LLM.generate(self, prompts, params, use_tqdm=use_tqdm)

    items = [WorkItem([7, 8, 9] * 5, 24), WorkItem([3, 1, 4, 1, 5] * 3, 24)]
    result = run_offline(Offline(), items, "fcfs")
    assert 0 < result.spec_accepted_tokens <= result.spec_draft_tokens and result.spec_drafts > 0
    assert "speculation accepted" in describe_speculation(vars(result))


def test_rejected_drafts_give_their_blocks_back_and_only_accepted_tokens_are_registered():
    from jaxcb.config import SchedulerConfig
    from jaxcb.core.block_pool import BlockPool
    from jaxcb.core.scheduler import Scheduler
    from jaxcb.core.step import RunnerOutput, SampledToken

    pool = BlockPool(32)
    spec = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4), disable_by_batch_size=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), pool, 4, 256,
                      enable_prefix_caching=True, speculation=spec)
    seq = _sequence([1, 2, 3, 1, 2, 3], temperature=0.0)
    sched.add_request(seq)

    def step(rows):
        out = sched.schedule()
        sched.commit(out)
        s = out.scheduled[0]
        sampled = [SampledToken(t) for t in rows(s)]
        verified = {s.seq_id: sampled} if s.draft_token_ids else {}
        sched.update(out, RunnerOutput({s.seq_id: sampled[0]}, {}, verified))
        return s

    step(lambda s: [1])  # the prompt; the first token: 7 tokens, 6 computed
    s = step(lambda s: [99] * s.num_rows)  # drafts proposed, the first already rejected
    assert len(s.draft_token_ids) == 4 and len(s.block_ids) == 3  # positions 6..10: a third block
    assert seq.output_token_ids == [1, 99] and seq.num_computed_tokens == 7
    assert len(seq.block_ids) == 2 and pool.num_free_blocks == 31 - 2  # the third went back
    assert seq.num_registered_blocks == 1  # only full blocks of known, computed tokens
    seq.output_token_ids[-1] = 2  # (as if the target had sampled 2: the pattern goes on)
    s = step(lambda s: list(s.draft_token_ids) + [5])  # every draft accepted, then the target's token
    assert s.num_blocks_kept == 2  # the runner's copy of the table learns the third block changed
    assert seq.output_token_ids == [1, 2, *s.draft_token_ids, 5]
    assert seq.num_computed_tokens == 8 + len(s.draft_token_ids)
    assert spec.stats.num_drafts == 2 and spec.stats.num_accepted_tokens == 4
    sched.abort(seq.seq_id)
    assert pool.num_free_blocks == 31
