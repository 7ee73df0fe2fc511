"""The continuous-batching engine on the tiny model: outputs do not depend on who else is in the batch."""

import random

import numpy as np
import pytest

from engine_factory import shared_engine
from benchmarks.reference_generate import greedy_generate
from jaxcb.sampling_params import InvalidRequestError, SamplingParams

SMALL_CACHE = "cache.num_blocks=24"  # 23 usable blocks x 16 tokens: far less than 40 requests need


def random_workload(seed, n=44, max_prompt=150, max_out=40):
    rng = random.Random(seed)
    work = []
    for i in range(n):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, max_prompt))]  # up to ~10 blocks, > budget
        work.append((f"req{i}", prompt, rng.randint(1, max_out), rng.randint(0, 30)))  # arrival step
    return work


def run_with_arrivals(engine, work, params_for, abort_at=None):
    """Add each request at its arrival step; step until all done. Returns {id: output}.

    params_for(request_id, max_tokens) -> SamplingParams."""
    results, step = {}, 0
    pending = sorted(work, key=lambda w: w[3])
    abort_at = abort_at or {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, max_tokens, _ = pending.pop(0)
            engine.add_request(prompt, params_for(rid, max_tokens), request_id=rid)
        for rid in [r for r, s in abort_at.items() if s == step]:
            if engine.abort(rid):
                results[rid] = None
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
        assert step < 5000
    return results


def alone(engine, prompt, max_tokens):
    runner = engine.runner
    return greedy_generate(None, prompt, max_tokens, block_size=16, backend=runner.backend, weights=runner.weights)


def assert_same_or_tied(batched_tokens, ref):
    for i, (got, want) in enumerate(zip(batched_tokens, ref.token_ids)):
        if got != want:
            top2 = np.sort(ref.logits[i])[-2:]
            assert top2[1] - top2[0] <= 1e-5, f"token {i}: {got} != {want} and the top-2 logits were not tied"
            return  # after a tie the continuations may legitimately differ
    assert len(batched_tokens) == len(ref.token_ids)


SWAP = ("scheduler.preemption_mode=swap", "cache.swap_space_gib=0.002")  # ~170 host blocks of 12 KiB


@pytest.mark.parametrize(
    "policy, extra",
    [("fcfs", ()), ("static", ()), ("fcfs", SWAP), ("priority", ())],
    ids=["fcfs-recompute", "static", "fcfs-swap", "priority"],
)
def test_greedy_outputs_do_not_depend_on_the_batch(policy, extra):
    engine = shared_engine(SMALL_CACHE, f"scheduler.policy={policy}", *extra)
    work = random_workload(seed={"fcfs": 1, "static": 2, "priority": 11}[policy] + len(extra))
    greedy = lambda rid, m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    results = run_with_arrivals(engine, work, greedy)
    if policy != "static":
        assert engine.scheduler.num_preemptions > 0, "the cache should have been small enough to preempt"
    if extra:
        assert engine.scheduler.num_swap_outs > 0 and engine.scheduler.num_swap_ins == engine.scheduler.num_swap_outs
    for rid, prompt, max_tokens, _ in work:
        out = results[rid].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        assert_same_or_tied(out.token_ids, alone(engine, prompt, max_tokens))
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
    if engine.scheduler.kv.host_pool is not None:
        assert engine.scheduler.kv.host_pool.num_free_blocks == engine.scheduler.kv.host_pool.num_blocks - 1
    assert engine.num_recompiles == 0


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    engine = shared_engine(SMALL_CACHE, "scheduler.preemption_mode=swap", "cache.swap_space_gib=0.00004")  # 2 usable host blocks
    work = random_workload(seed=12, n=30)
    greedy = lambda rid, m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    results = run_with_arrivals(engine, work, greedy)
    s = engine.scheduler
    assert s.num_swap_outs > 0 and s.num_preemptions > s.num_swap_outs  # some preemptions had to recompute
    for rid, prompt, max_tokens, _ in work[:10]:
        assert_same_or_tied(results[rid].outputs[0].token_ids, alone(engine, prompt, max_tokens))
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
    assert s.kv.host_pool.num_free_blocks == s.kv.host_pool.num_blocks - 1


def test_seeded_sampling_gives_the_same_tokens_alone_and_batched():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    prompt = list(b"seeded prompt")
    solo = run_with_arrivals(engine, [("seeded", prompt, 12, 0)], lambda rid, m: seeded)["seeded"]
    work = random_workload(seed=3, n=16, max_out=12) + [("seeded", prompt, 12, 3)]
    busy = run_with_arrivals(
        engine, work, lambda rid, m: seeded if rid == "seeded" else SamplingParams(temperature=1.0, max_tokens=m)
    )
    assert busy["seeded"].outputs[0].token_ids == solo.outputs[0].token_ids
    unseeded = [busy[rid].outputs[0].token_ids for rid, *_ in work[:16]]
    assert len({tuple(t) for t in unseeded}) > 1


def test_abort_at_any_point_leaks_no_block():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    work = random_workload(seed=4, n=30)
    rng = random.Random(5)
    abort_at = {rid: arrival + rng.randint(0, 12) for rid, _, _, arrival in work if rng.random() < 0.5}
    greedy = lambda rid, m: SamplingParams(temperature=0, max_tokens=m)  # noqa: E731
    results = run_with_arrivals(engine, work, greedy, abort_at)
    assert any(v is None for v in results.values())
    assert not engine.has_unfinished_requests() and engine.scheduler.num_unfinished == 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
    engine.block_pool.check_invariants()


def test_varied_workload_after_warm_up_compiles_nothing():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    work = random_workload(seed=6, n=20, max_prompt=200)
    params = lambda rid, m: SamplingParams(  # noqa: E731
        temperature=0.7, top_k=5, max_tokens=m, logprobs=2, repetition_penalty=1.2, presence_penalty=0.5
    )
    run_with_arrivals(engine, work, params)
    assert engine.num_recompiles == 0


def test_n_completions_share_the_prompt_and_differ():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    out = None
    engine.add_request(list(b"tell me a story about"), SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7), request_id="n3")
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1


def test_logprobs_are_returned_for_each_token():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, logprobs=3), request_id="lp")
    outs = [o for _ in range(20) for o in engine.step() if o.finished]
    lp = outs[0].outputs[0].logprobs
    assert len(lp) == 4
    for token, entry in zip(outs[0].outputs[0].token_ids, lp):
        assert token in entry and len(entry) >= 3
        assert max(entry.values()) == pytest.approx(entry[token], abs=1e-5)  # greedy: the chosen is the best
        assert all(v <= 0 for v in entry.values())


def test_a_request_with_logprobs_0_gets_its_tokens_logprob_next_to_ones_that_ask_for_none():
    """logprobs=0 asks for the chosen token's logprob only; the step skips the log-softmax only
    when no row asks at all, so the row that asks gets the same logprobs as when it runs alone."""
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    asks = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)

    def run(requests):
        for rid, prompt, params in requests:
            engine.add_request(prompt, params, request_id=rid)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        return done

    alone = run([("alone", [5, 6, 7], asks)])["alone"]
    quiet = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    mixed = run([("asks", [5, 6, 7], asks), ("quiet", [8, 9], quiet)])
    assert mixed["quiet"].logprobs is None
    assert mixed["asks"].token_ids == alone.token_ids
    assert [list(e) for e in mixed["asks"].logprobs] == [[t] for t in alone.token_ids]
    for got, want in zip(mixed["asks"].logprobs, alone.logprobs):
        assert list(got.values())[0] == pytest.approx(list(want.values())[0], abs=1e-5) and list(got.values())[0] < 0


def test_bad_requests_are_refused_before_they_cost_anything():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    free = engine.block_pool.num_free_blocks
    with pytest.raises(InvalidRequestError, match="exceeds engine.max_model_len=256"):
        engine.add_request([1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request([5, 100000], SamplingParams())
    with pytest.raises(InvalidRequestError, match="top_p=0"):
        SamplingParams(top_p=0)
    assert not engine.has_unfinished_requests() and engine.block_pool.num_free_blocks == free


def _llm(engine):
    from jaxcb.engine import LLM

    llm = LLM.__new__(LLM)
    llm.engine = engine
    return llm


def test_generate_takes_numpy_token_ids_as_the_same_prompt():
    llm = _llm(shared_engine(SMALL_CACHE, "scheduler.policy=fcfs"))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    tokens = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    expected = tokens(llm.generate([[1, 2, 3]], greedy, use_tqdm=False))
    assert tokens(llm.generate(np.array([1, 2, 3]), greedy, use_tqdm=False)) == expected
    assert tokens(llm.generate([np.int64(1), np.int32(2), 3], greedy, use_tqdm=False)) == expected
    assert tokens(llm.generate(np.array([[1, 2, 3]]), greedy, use_tqdm=False)) == expected


def test_prompts_that_are_no_text_or_token_ids_are_refused_naming_the_prompt():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    llm = _llm(engine)
    free = engine.block_pool.num_free_blocks
    for prompts in (None, b"hi", {"prompt": "hi"}, [None], [b"hi"]):  # bytes would run as token ids 104, 105
        with pytest.raises(InvalidRequestError, match="prompt") as refused:
            llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
        assert refused.value.field == "prompt"
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.add_request(None, SamplingParams())
    with pytest.raises(ValueError, match="lora="):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, lora=3)
    assert not engine.has_unfinished_requests() and engine.block_pool.num_free_blocks == free


def test_timeouts_and_output_kinds_that_would_be_ignored_are_refused():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    for field, value in (("timeout_s", float("nan")), ("queue_timeout_s", float("nan")), ("timeout_s", "1"),
                         ("timeout_s", True), ("output_kind", "streaming")):
        with pytest.raises(InvalidRequestError, match=field) as refused:
            engine.add_request("hi", SamplingParams(max_tokens=2), **{field: value})
        assert refused.value.field == field
    assert not engine.has_unfinished_requests()
    # Its value names the kind, as the enum's does: a delta stream, not a cumulative one.
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4), output_kind="delta")
    sizes = []
    while engine.has_unfinished_requests():
        sizes += [len(out.outputs[0].token_ids) for out in engine.step()]
    assert sizes and max(sizes) == 1


def test_an_id_left_out_never_clashes_with_a_callers_numeric_id():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    taken = engine.add_request("hi", SamplingParams(max_tokens=2), request_id=str(engine._next_id))
    assert engine.add_request("hi", SamplingParams(max_tokens=2)) != taken
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1


def test_abort_while_preempted_and_mid_prefill_leaks_no_block():
    from jaxcb.core.sequence import RequestStatus

    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    for rid, prompt, max_tokens, _ in random_workload(seed=8, n=24, max_prompt=120):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens + 20), request_id=rid)
    aborted = {}
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for req in list(engine.scheduler.sequences.values()):
            if "preempted" not in aborted and req.status is RequestStatus.PREEMPTED:
                aborted["preempted"] = req.group_id
                assert engine.abort(req.group_id)
            elif "prefill" not in aborted and req.status is RequestStatus.RUNNING and 0 < req.num_computed_tokens < req.num_prompt_tokens:
                aborted["prefill"] = req.group_id
                assert engine.abort(req.group_id)
        engine.step()
    assert set(aborted) == {"preempted", "prefill"}
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1


def test_stop_string_ends_the_text_before_it():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    # Find what the model says greedily, then stop on a piece of it.
    engine.add_request("Once upon", SamplingParams(temperature=0, max_tokens=12), request_id="probe")
    probe = [o for _ in range(40) for o in engine.step() if o.finished][0].outputs[0]
    text = probe.text
    stop = text[5:7]
    assume_index = text.find(stop)
    engine.add_request("Once upon", SamplingParams(temperature=0, max_tokens=12, stop=[stop]), request_id="stopped")
    out = [o for _ in range(40) for o in engine.step() if o.finished][0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:assume_index] and stop not in out.text


def test_min_tokens_suppresses_eos_until_reached():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    eos = engine.eos_token_ids[0]
    # Make EOS the greedy choice by banning nothing and using a stop token id that the model picks:
    engine.add_request([10, 20, 30], SamplingParams(temperature=0, max_tokens=6), request_id="probe")
    first = [o for _ in range(20) for o in engine.step() if o.finished][0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[first])
    engine.add_request([10, 20, 30], params, request_id="min")
    out = [o for _ in range(20) for o in engine.step() if o.finished][0].outputs[0]
    assert first not in out.token_ids[:3], "a stop token id must not be sampled before min_tokens"
    assert eos not in out.token_ids[:3]


def shared_prefix_workload(seed, n=24):
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(70)]  # 4 full blocks of 16 + 6 tokens
    work = []
    for i in range(n):
        suffix = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
        work.append((f"sys{i}", system + suffix, rng.randint(1, 24), rng.randint(0, 20)))
    return work


def test_prefix_caching_hits_a_shared_system_prompt_and_changes_no_output():
    on = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    off = shared_engine(SMALL_CACHE, "cache.enable_prefix_caching=false")
    work = shared_prefix_workload(seed=9)
    greedy = lambda rid, m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    hits0 = on.scheduler.prefix_cache_hits
    with_cache = run_with_arrivals(on, work, greedy)
    without = run_with_arrivals(off, work, greedy)
    assert on.scheduler.prefix_cache_hits - hits0 >= 64 * (len(work) // 2)  # most found the 4 system blocks
    assert off.scheduler.prefix_cache_hits == 0
    for rid, prompt, max_tokens, _ in work:
        a, b = with_cache[rid].outputs[0].token_ids, without[rid].outputs[0].token_ids
        if a != b:
            assert_same_or_tied(a, alone(on, prompt, max_tokens))
            assert_same_or_tied(b, alone(on, prompt, max_tokens))
    for engine in (on, off):
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
        engine.block_pool.check_invariants()


def test_admission_control_refuses_a_burst_beyond_the_queue_and_serves_the_rest():
    from jaxcb.errors import EngineOverloadedError

    engine = shared_engine(SMALL_CACHE, "scheduler.max_waiting_requests=4")
    admitted, refused, done = [], [], set()
    rng = random.Random(10)
    for i in range(50):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        try:
            admitted.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8), request_id=f"b{i}"))
        except EngineOverloadedError as e:
            assert e.retryable and e.retry_after_s >= 1 and "max_waiting_requests=4" in str(e)
            refused.append(i)
        if i % 5 == 4:
            done |= {o.request_id for o in engine.step() if o.finished}
    assert refused and admitted
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == set(admitted)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1


def test_request_that_can_never_fit_the_cache_is_not_retryable():
    engine = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([1] * 220, SamplingParams(max_tokens=50))
    assert not info.value.retryable and "max_model_len=256" in str(info.value)
    assert not engine.has_unfinished_requests()


def test_async_scheduling_gives_the_same_outputs_as_sync():
    on = shared_engine(SMALL_CACHE, "scheduler.policy=fcfs")
    off = shared_engine(SMALL_CACHE, "engine.async_scheduling=false")
    assert on.cfg.engine.async_scheduling and not off.cfg.engine.async_scheduling
    work = random_workload(seed=13, n=30)
    kinds = [
        lambda m: SamplingParams(temperature=0, max_tokens=m),
        lambda m: SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, seed=5, logprobs=2),
        lambda m: SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=m, seed=6),
        lambda m: SamplingParams(temperature=1.0, min_tokens=min(3, m), max_tokens=m, seed=7, stop=["e"]),
        lambda m: SamplingParams(n=2, temperature=0.9, max_tokens=m, seed=8),
    ]
    params = {rid: kinds[i % len(kinds)](m) for i, (rid, _, m, _) in enumerate(work)}
    a = run_with_arrivals(on, work, lambda rid, m: params[rid])
    b = run_with_arrivals(off, work, lambda rid, m: params[rid])
    assert on.scheduler.num_preemptions > 0
    for rid, prompt, max_tokens, _ in work:
        for x, y in zip(a[rid].outputs, b[rid].outputs):
            if params[rid].temperature == 0 and x.token_ids != y.token_ids:
                assert_same_or_tied(x.token_ids, alone(on, prompt, max_tokens))
                assert_same_or_tied(y.token_ids, alone(on, prompt, max_tokens))
                continue
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason), rid
            if x.logprobs:
                assert [sorted(d) for d in x.logprobs] == [sorted(d) for d in y.logprobs]
    for engine in (on, off):
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
        assert engine.num_recompiles == 0


def test_a_final_only_request_is_reported_once_when_it_finishes_with_the_same_output():
    engine = shared_engine()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request([5, 6, 7, 8], params, request_id="streamed")
    engine.add_request([5, 6, 7, 8], params, request_id="final", final_only=True)
    seen = {"streamed": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["streamed"]) == 12 and [o.finished for o in seen["final"]] == [True]
    final, streamed = seen["final"][0].outputs[0], seen["streamed"][-1].outputs[0]
    assert (final.token_ids, final.text, final.finish_reason) == (streamed.token_ids, streamed.text, "length")


def test_sequences_growing_by_runs_of_blocks_generate_the_same_tokens_and_return_every_block():
    from engine_factory import generate_first_completions
    from jaxcb.config import CacheConfig
    from jaxcb.kv_cache import cache_block_growth

    assert cache_block_growth(CacheConfig(), "cpu") == 4 and cache_block_growth(CacheConfig(), "pallas") == 1
    assert cache_block_growth(CacheConfig(block_growth=2), "pallas") == 2
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 70))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    runs, single = shared_engine(), shared_engine("cache.block_growth=1")  # the CPU kernel's default: runs of 4
    assert (runs.scheduler.kv.block_growth, single.scheduler.kv.block_growth) == (4, 1)
    grown = generate_first_completions(runs, prompts, params)
    assert [c.token_ids for c in grown] == [c.token_ids for c in generate_first_completions(single, prompts, params)]
    assert runs.block_pool.num_free_blocks == runs.block_pool.num_blocks - 1


def test_the_step_width_follows_the_longest_context_not_the_blocks_held():
    # A static batch holds its whole outputs' blocks from admission (8 blocks here), but its
    # first steps' contexts fit the narrow width of 4 blocks.
    from engine_factory import make_engine

    e = make_engine("scheduler.policy=static", "engine.context_buckets=[4]")
    assert e.runner.buckets.widths == (4, 16)
    keys = []
    build = e.runner.build_inputs
    e.runner.build_inputs = lambda out: keys.append(build(out)) or keys[-1]
    e.add_request(list(range(20)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    e.step()
    e.step()
    assert len(e.scheduler.running[0].block_ids) == 8
    assert [key.table_width for key, _, _ in keys] == [4, 4]
    while e.has_unfinished_requests():
        e.step()
    last_key, _, _ = keys[-1]
    assert last_key.table_width == 16  # 119 tokens of context: the full width


def test_a_dropped_engine_frees_its_runner_and_compiled_steps():
    """Start-up freezes the collector's view of what it made; the engine going must undo that, or its
    runner and compiled steps (which hold one another in cycles) outlive it with their JIT code's
    memory maps, until a process that builds engine after engine hits the kernel's map limit."""
    import gc
    import weakref

    from engine_factory import make_engine

    engine = make_engine("scheduler.max_num_seqs=4")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    runner, compiler = weakref.ref(engine.runner), weakref.ref(engine.runner.compiler)
    del engine
    gc.collect()
    assert runner() is None and compiler() is None
