"""The scheduler alone (no model): hand-built runner outputs drive it step by step."""

import itertools

import pytest

from jaxcb.core.block_pool import BlockPool
from jaxcb.config import SchedulerConfig
from jaxcb.output import token_stop_status
from jaxcb.core.sequence import RequestStatus, Sequence
from jaxcb.sampling_params import SamplingParams
from jaxcb.core.scheduler import Scheduler
from jaxcb.core.step import RunnerOutput, SampledToken

BLOCK = 4
_ids = itertools.count()


def make_request(prompt_len, max_tokens=4, arrival=None, **params):
    rid = f"r{next(_ids)}"
    return Sequence(
        rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0, **params),
        eos_token_ids=(99,), arrival_time=arrival if arrival is not None else next(_ids),
    )


def make_scheduler(num_blocks=64, max_model_len=256, enable_prefix_caching=False, **cfg):
    cfg = dict(dict(max_num_seqs=4, max_num_batched_tokens=16), **cfg)
    return Scheduler(
        SchedulerConfig(**cfg), BlockPool(num_blocks), BLOCK, max_model_len, enable_prefix_caching=enable_prefix_caching
    )


def update_and_stop(sched, out, sampled: dict):
    """What the engine does with a step's tokens: the scheduler takes them, and the sequences that stop on
    one (the output processor's rule, `token_stop_status`) finish."""
    for request, token, _ in sched.update(out, RunnerOutput(sampled)):
        status = token_stop_status(request.sampling_params, token, request.num_output_tokens,
                                   request.num_prompt_tokens, request.eos_token_ids, sched.max_model_len)
        if status is not None:
            sched.finish(request.seq_id, status)


def run_step(sched, token=7):
    out = sched.schedule()
    sched.commit(out)
    update_and_stop(sched, out, {s.seq_id: SampledToken(token) for s in out.scheduled if s.samples})
    return out


def test_budget_and_sequence_cap_are_never_exceeded():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for n in (7, 2, 9, 1, 5, 3):
        sched.add_request(make_request(n, max_tokens=6))
    for _ in range(40):
        out = run_step(sched)
        assert out.num_scheduled_tokens <= 10
        assert len(out.scheduled) <= 3 and len(sched.running) <= 3
    assert sched.num_unfinished == 0


def test_prefill_chunks_and_decodes_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request(3, max_tokens=5)
    sched.add_request(a)
    run_step(sched)  # a prefilled, sampled its first token
    b = make_request(20)
    sched.add_request(b)
    out = run_step(sched)
    sizes = {s.seq_id: len(s.token_ids) for s in out.scheduled}
    assert sizes == {a.seq_id: 1, b.seq_id: 7}
    assert not [s for s in out.scheduled if s.seq_id == b.seq_id][0].samples


def test_waiting_requests_are_admitted_in_arrival_order():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(2, max_tokens=2) for _ in range(4)]
    for r in reqs:
        sched.add_request(r)
    order = []
    for _ in range(10):
        for s in run_step(sched).scheduled:
            if s.seq_id not in order:
                order.append(s.seq_id)
    assert order == [r.seq_id for r in reqs]


def test_long_prefill_threshold_caps_one_prompt_per_step():
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=5)
    big = make_request(40)
    sched.add_request(big)
    out = run_step(sched)
    assert [len(s.token_ids) for s in out.scheduled] == [5]


def test_max_num_partial_prefills_keeps_a_second_long_prompt_waiting():
    sched = make_scheduler(max_num_batched_tokens=16, max_num_partial_prefills=1)
    first, second = make_request(40), make_request(40)
    sched.add_request(first)
    sched.add_request(second)
    out = run_step(sched)
    assert [s.seq_id for s in out.scheduled] == [first.seq_id]


def test_the_step_that_finishes_a_prompt_starts_the_next_one():
    # 20-token prompts at 16 tokens a step, one partial prefill at a time: the step that runs the
    # first prompt's last 4 tokens fills its budget with the second prompt's first 12.
    sched = make_scheduler(max_num_batched_tokens=16, max_num_partial_prefills=1)
    first, second = make_request(20), make_request(20)
    sched.add_request(first)
    sched.add_request(second)
    assert [len(s.token_ids) for s in run_step(sched).scheduled] == [16]
    out = run_step(sched)
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [(first.seq_id, 4),
                                                                         (second.seq_id, 12)]
    # and the step that finishes the second starts a third
    third = make_request(20)
    sched.add_request(third)
    out = run_step(sched)
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [(first.seq_id, 1),
                                                                         (second.seq_id, 8),
                                                                         (third.seq_id, 7)]


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = make_request(10), make_request(10)
    sched.add_request(a)
    sched.add_request(b)
    out = run_step(sched)
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [(a.seq_id, 10)]


def test_preemption_picks_the_request_that_computed_least_and_admits_nothing():
    # 7 usable blocks of 4 tokens.
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=32, max_num_seqs=4)
    old = make_request(12, max_tokens=20, arrival=0)  # 3 blocks
    small = make_request(3, max_tokens=20, arrival=1)  # 1 block
    mid = make_request(8, max_tokens=20, arrival=2)  # 2 blocks
    for r in (old, small, mid):
        sched.add_request(r)
    run_step(sched)  # all prefilled: 6 blocks used, 1 free
    late = make_request(2, max_tokens=2, arrival=3)
    sched.add_request(late)
    preempted = []
    for _ in range(12):
        out = run_step(sched)
        if out.preempted_ids:
            preempted = out.preempted_ids
            admitted = [s for s in out.scheduled if s.start_position == 0]
            assert admitted == [], "a preempting step must not admit"
            break
    assert preempted[0] == small.seq_id  # least computed, although not the newest
    assert small.status is RequestStatus.PREEMPTED and small.block_ids == []
    assert sched.waiting[0] is small  # back at the head of the queue


def test_preempted_request_recomputes_prompt_and_outputs_and_continues():
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=32)
    a = make_request(8, max_tokens=6, arrival=0)
    b = make_request(4, max_tokens=6, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(50):
        run_step(sched)
        if sched.num_unfinished == 0:
            break
    assert sched.num_preemptions >= 1
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert sched.pool.num_free_blocks == 4


def test_static_policy_forms_no_batch_while_one_runs():
    sched = make_scheduler(policy="static", max_num_seqs=2)
    first = [make_request(3, max_tokens=2), make_request(3, max_tokens=8)]
    later = make_request(3, max_tokens=2)
    for r in first + [later]:
        sched.add_request(r)
    run_step(sched)
    assert later.status is RequestStatus.WAITING
    while not first[1].is_finished:
        out = run_step(sched)
        assert later.seq_id not in [s.seq_id for s in out.scheduled]
    run_step(sched)
    assert later.status in (RequestStatus.RUNNING,) or later.is_finished


def test_static_policy_reserves_worst_case_blocks_up_front():
    sched = make_scheduler(policy="static")
    r = make_request(5, max_tokens=10)  # 15 tokens -> 4 blocks
    sched.add_request(r)
    run_step(sched)
    assert len(r.block_ids) == 4


def test_stop_conditions_eos_stop_token_min_tokens_and_length():
    sched = make_scheduler()
    eos = make_request(2, max_tokens=5)
    stop_tok = make_request(2, max_tokens=5, stop_token_ids=[42])
    min_tok = make_request(2, max_tokens=5, min_tokens=3)
    ignore = make_request(2, max_tokens=3, ignore_eos=True)
    for r in (eos, stop_tok, min_tok, ignore):
        sched.add_request(r)
    out = sched.schedule()
    banned = {s.seq_id: s.banned_token_ids for s in out.scheduled}
    assert banned[min_tok.seq_id] == (99,) and banned[eos.seq_id] == ()
    sampled = {eos.seq_id: 99, stop_tok.seq_id: 42, min_tok.seq_id: 99, ignore.seq_id: 99}
    sched.commit(out)
    update_and_stop(sched, out, {k: SampledToken(v) for k, v in sampled.items()})
    assert eos.status is RequestStatus.FINISHED_STOPPED
    assert stop_tok.status is RequestStatus.FINISHED_STOPPED
    assert min_tok.status is RequestStatus.RUNNING  # under min_tokens, EOS does not stop it
    assert ignore.status is RequestStatus.RUNNING
    for _ in range(5):
        run_step(sched)
    assert ignore.status is RequestStatus.FINISHED_LENGTH and ignore.num_output_tokens == 3


def test_abort_frees_blocks_at_once_in_every_state():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=8)
    running, prefilling, waiting = make_request(4, max_tokens=9), make_request(12), make_request(4)
    for r in (running, prefilling, waiting):
        sched.add_request(r)
    run_step(sched)
    assert running.block_ids and prefilling.is_prefilling
    for r in (prefilling, running, waiting):
        assert sched.abort(r.seq_id)
        assert r.status is RequestStatus.FINISHED_ABORTED and r.block_ids == []
    assert sched.pool.num_free_blocks == 5 and sched.num_unfinished == 0
    assert not sched.abort(running.seq_id)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_follower_of_n_shares_the_leaders_full_prompt_blocks_in_the_leaders_first_step(enable_prefix_caching):
    sched = make_scheduler(enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(n=2, max_tokens=3, temperature=0.8)
    leader = Sequence("l", list(range(1, 11)), params)
    follower = Sequence("f", list(leader.prompt_token_ids), params, parent_id="l", sample_index=1)
    sched.add_request(leader)
    sched.add_request(follower)
    out = run_step(sched)
    f = [s for s in out.scheduled if s.seq_id == "f"][0]
    assert f.start_position == 8 and f.token_ids == [9, 10]  # shares 2 full blocks, recomputes the rest
    assert follower.block_ids[:2] == leader.block_ids[:2]
    assert sched.pool.ref_count(leader.block_ids[0]) == 2


def test_with_prefix_caching_off_only_the_samples_of_one_request_share():
    sched = make_scheduler(enable_prefix_caching=False, max_num_batched_tokens=64)
    prompt = list(range(1, 11))
    one = SamplingParams(n=2, max_tokens=2, temperature=0.8)
    sched.add_request(Sequence(("a", 0), prompt, one))
    sched.add_request(Sequence(("a", 1), prompt, one, parent_id=("a", 0), sample_index=1))
    sched.add_request(Sequence(("b", 0), prompt, one))  # another request with the same prompt
    sched.add_request(Sequence(("c", 0), prompt, SamplingParams(max_tokens=2, temperature=0)))
    out = run_step(sched)
    starts = {s.seq_id: s.start_position for s in out.scheduled}
    assert starts == {("a", 0): 0, ("a", 1): 8, ("b", 0): 0, ("c", 0): 0}
    assert sched.prefix_cache_hits == 0  # the counters are the prefix cache's


@pytest.mark.parametrize("policy", ["fcfs", "static"])
def test_every_block_is_free_when_all_requests_are_done(policy):
    sched = make_scheduler(num_blocks=12, policy=policy, max_num_batched_tokens=12)
    reqs = [make_request(n, max_tokens=m) for n, m in [(9, 3), (2, 7), (14, 2), (5, 5), (1, 1), (6, 4)]]
    for r in reqs:
        sched.add_request(r)
    for _ in range(200):
        run_step(sched)
        if not sched.num_unfinished:
            break
    assert all(r.is_finished for r in reqs)
    assert sched.pool.num_free_blocks == 11
    sched.pool.check_invariants()


def test_prefix_cache_hits_full_blocks_and_never_schedules_a_write_into_a_cached_block():
    sched = make_scheduler(num_blocks=40, enable_prefix_caching=True, max_num_batched_tokens=64)
    system = list(range(100, 113))  # 13 tokens: 3 full blocks of 4
    first = Sequence("first", system + [1, 2], SamplingParams(max_tokens=3, temperature=0))
    sched.add_request(first)
    run_step(sched)
    later = [Sequence(f"r{i}", system + [50 + i, 60 + i, 70 + i], SamplingParams(max_tokens=4, temperature=0)) for i in range(4)]
    for r in later:
        sched.add_request(r)
    for _ in range(30):
        cached = {b for b in range(1, sched.pool.num_blocks) if sched.pool.is_registered(b)}
        out = sched.schedule()
        writer = {}
        for s in out.scheduled:  # a block the step writes was not in the cache before, and has one writer
            for pos in range(s.start_position, s.start_position + len(s.token_ids)):
                block = s.block_ids[pos // BLOCK]
                assert block not in cached, "write into a cached block"
                assert writer.setdefault(block, s.seq_id) == s.seq_id, "two writers of one block"
        sched.commit(out)
        update_and_stop(sched, out, {s.seq_id: SampledToken(7) for s in out.scheduled if s.samples})
        if not sched.num_unfinished:
            break
    assert sched.prefix_cache_hits == 4 * 12  # each later request found the 3 full system blocks
    assert all(r.output_token_ids == [7] * 4 for r in later)
    assert sched.pool.num_free_blocks == 39 and sched.pool.num_cached_blocks > 0
    sched.pool.check_invariants()


def test_a_fully_cached_prompt_still_computes_its_last_block():
    sched = make_scheduler(num_blocks=20, enable_prefix_caching=True)
    prompt = list(range(1, 9))  # exactly 2 blocks
    sched.add_request(Sequence("a", prompt, SamplingParams(max_tokens=1, temperature=0)))
    run_step(sched)
    sched.add_request(Sequence("b", prompt, SamplingParams(max_tokens=1, temperature=0)))
    out = sched.schedule()
    [s] = out.scheduled
    assert (s.start_position, s.token_ids) == (4, [5, 6, 7, 8])


def test_eviction_takes_least_recently_freed_cached_blocks_first():
    sched = make_scheduler(num_blocks=7, enable_prefix_caching=True, max_num_batched_tokens=32)
    a = Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=1, temperature=0))  # 2 full blocks + 1
    sched.add_request(a)
    run_step(sched)
    assert sched.pool.num_cached_blocks == 2 and sched.pool.num_free_blocks == 6
    b = Sequence("b", list(range(50, 71)), SamplingParams(max_tokens=1, temperature=0))  # 6 blocks: must evict
    sched.add_request(b)
    run_step(sched)
    assert b.is_finished and sched.pool.num_evictions >= 1
    sched.pool.check_invariants()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_priority_scheduler(clock, **cfg):
    cfg = dict(dict(max_num_seqs=2, max_num_batched_tokens=16, policy="priority", priority_aging_s=10.0), **cfg)
    return Scheduler(SchedulerConfig(**cfg), BlockPool(64), BLOCK, 256, clock=clock)


def prio_request(rid, priority, arrival, max_tokens=50):
    return Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0), arrival_time=arrival, priority=priority)


def test_high_priority_arrival_into_a_full_engine_is_served_first():
    clock = FakeClock()
    sched = make_priority_scheduler(clock)
    low = [prio_request(f"low{i}", 5, arrival=0.01 * i) for i in range(3)]
    for r in low:
        sched.add_request(r)
    run_step(sched)  # low0, low1 run (max_num_seqs=2); low2 waits
    clock.now = 1.0
    high = prio_request("high", 0, arrival=1.0)
    sched.add_request(high)
    out = run_step(sched)
    assert out.preempted_ids == ["low1"]  # the engine was full: the worst-ranked running request yields
    out = run_step(sched)
    assert "high" in [s.seq_id for s in out.scheduled]
    assert low[2].status is RequestStatus.WAITING  # the earlier low-priority request still waits


def test_preempted_request_keeps_its_place_among_equals():
    clock = FakeClock()
    sched = make_priority_scheduler(clock, max_num_seqs=1)
    a, b = prio_request("a", 1, 0.0), prio_request("b", 1, 0.5)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    sched.add_request(prio_request("urgent", 0, 0.6, max_tokens=1))
    clock.now = 0.6
    run_step(sched)  # a preempted for urgent
    for _ in range(3):
        run_step(sched)
    assert list(sched.waiting)[0] is b or a.status is RequestStatus.RUNNING
    assert a.status is RequestStatus.RUNNING  # a (earlier) resumes before b


def run_flood(aging_s, steps=200):
    clock = FakeClock()
    sched = make_priority_scheduler(clock, max_num_seqs=1, priority_aging_s=aging_s)
    low = prio_request("low", 3, arrival=0.0, max_tokens=2)
    sched.add_request(low)
    flood = itertools.count()
    sched.add_request(prio_request(f"f{next(flood)}", 0, 0.0, max_tokens=4))
    for step in range(steps):
        clock.now = float(step)
        sched.add_request(prio_request(f"f{next(flood)}", 0, clock.now, max_tokens=4))  # one a second, forever
        run_step(sched)
        if low.is_finished:
            return clock.now
    return None


def test_aging_bounds_the_wait_of_a_low_priority_request_under_a_high_priority_flood():
    """The bound: with aging, a priority-p request ranks like a priority-q one that arrived
    (p - q) x priority_aging_s later. So it waits at most for the flood requests that arrived
    before then: here p - q = 3, aging 5 s -> flood arrivals at t <= 14 s, 16 requests of 4 steps
    (1 s each), then its own 2 steps: it finishes by t = 16 x 4 + 2 = 66 s, although the flood
    never stops and outpaces the engine 4 to 1."""
    finished_at = run_flood(aging_s=5.0)
    assert finished_at is not None and finished_at <= 16 * 4 + 2
    assert run_flood(aging_s=1e9, steps=150) is None  # without aging it starves


def test_static_batch_is_formed_whole_even_when_the_first_prompt_takes_the_budget():
    sched = make_scheduler(policy="static", max_num_seqs=4, max_num_batched_tokens=16)
    reqs = [make_request(16, max_tokens=3) for _ in range(6)]
    for r in reqs:
        sched.add_request(r)
    out = run_step(sched)
    assert [s.seq_id for s in out.scheduled] == [reqs[0].seq_id]  # the budget covers one prompt
    assert [r.status for r in reqs[:4]] == [RequestStatus.RUNNING] * 4  # but the batch has all four
    assert reqs[4].status is RequestStatus.WAITING
    for _ in range(30):
        run_step(sched)
    assert all(r.is_finished for r in reqs)


def make_growing_scheduler(num_blocks=64, max_num_seqs=2, block_growth=4):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16), BlockPool(num_blocks),
                     BLOCK, 256, block_growth=block_growth)


def test_a_decoding_sequence_grows_by_a_run_of_consecutive_blocks():
    sched = make_growing_scheduler()
    a = make_request(BLOCK, max_tokens=40)
    sched.add_request(a)
    run_step(sched)  # the prompt: exactly the one block it needs
    assert len(a.block_ids) == 1
    run_step(sched)  # its first decode needs a second block: it takes four, ascending
    assert len(a.block_ids) == 5 and a.block_ids[1:] == list(range(a.block_ids[1], a.block_ids[1] + 4))
    free = sched.pool.num_free_blocks
    while a.num_computed_tokens < 5 * BLOCK:  # the run holds the next 15 tokens: nothing more is taken
        run_step(sched)
        assert sched.pool.num_free_blocks == free
    run_step(sched)
    assert len(a.block_ids) == 9  # the 21st token starts the next run
    while sched.num_unfinished:
        run_step(sched)
    assert sched.pool.num_free_blocks == 63  # the spare blocks went back with the rest


def test_a_run_stops_at_the_last_block_the_sequence_can_reach():
    sched = make_growing_scheduler()
    a = make_request(BLOCK, max_tokens=5)  # at most 9 tokens: 3 blocks
    sched.add_request(a)
    run_step(sched)
    run_step(sched)
    assert len(a.block_ids) == 3


def test_no_spare_blocks_are_taken_unless_every_running_sequence_could_still_take_a_run():
    # 11 usable blocks; 2 sequences x 4 = 8 must stay free before spares are taken
    sched = make_growing_scheduler(num_blocks=12)
    a = make_request(BLOCK, max_tokens=40)
    sched.add_request(a)
    run_step(sched)
    run_step(sched)  # 10 free: a run of 4 would leave 6
    assert len(a.block_ids) == 2


def test_prefill_chunks_take_only_the_blocks_they_fill():
    sched = make_growing_scheduler()
    a = make_request(30, max_tokens=40)
    sched.add_request(a)
    run_step(sched)  # a 16-token chunk
    assert len(a.block_ids) == 4
    run_step(sched)  # the other 14, and its first sampled token
    assert len(a.block_ids) == 8


@pytest.mark.parametrize("policy", ["fcfs", "priority", "static"])
def test_waiting_tokens_are_counted_exactly_through_admissions_preemptions_and_aborts(policy):
    """num_waiting_tokens is kept as sequences join and leave the queue (read every step): it always equals
    the sum over the queue, through chunked admissions, recompute preemptions and aborts of waiting ones."""
    sched = make_scheduler(num_blocks=12, max_num_seqs=3, max_num_batched_tokens=8, policy=policy)
    for i, n in enumerate((9, 3, 14, 5, 7, 2, 11)):
        request = make_request(n, max_tokens=8)
        request.priority = i % 3  # under policy=priority, later arrivals may outrank running ones
        sched.add_request(request)

    def brute():
        return sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)

    assert sched.num_waiting_tokens == brute() > 0
    for step in range(200):
        if step == 3 and sched.waiting:
            sched.abort(sched.waiting[-1].seq_id)
        run_step(sched)
        assert sched.num_waiting_tokens == brute(), step
        if not sched.num_unfinished:
            break
    assert sched.num_unfinished == 0 and sched.num_waiting_tokens == 0
    assert policy == "static" or sched.num_preemptions > 0  # the small cache makes them happen


def test_a_steps_block_tables_stay_as_they_were_scheduled():
    """A ScheduledSequence holds its sequence's own table list, uncopied: the blocks the sequence gains
    later go into a new list, so a step still in flight keeps the table it was built with."""
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request(3, max_tokens=12))
    first = run_step(sched).scheduled[0]
    table = list(first.block_ids)
    outs = [run_step(sched) for _ in range(10)]  # 13 tokens: the table grows past its first block
    assert len(outs[-1].scheduled[0].block_ids) > len(table)
    assert first.block_ids == table


def test_a_priority_past_64_bits_is_refused_before_the_scheduler_ages_it():
    # The aged priority is a float: 10**400 raised OverflowError on the engine's thread, which stopped it.
    from jaxcb.errors import InvalidRequestError
    from jaxcb.validation import RequestLimits, validate_request

    limits = RequestLimits(vocab_size=100, max_model_len=64, block_size=4, num_usable_blocks=100, max_num_seqs=4,
                           max_num_batched_tokens=64, enable_chunked_prefill=True, max_logprobs=5,
                           max_stop_token_ids=8, num_eos_token_ids=1, scheduler_policy="priority")
    validate_request([1, 2], SamplingParams(max_tokens=4), limits, priority=-(2**63))
    for priority in (2**63, 10**400):
        with pytest.raises(InvalidRequestError, match="priority must be a 64-bit integer") as e:
            validate_request([1, 2], SamplingParams(max_tokens=4), limits, priority=priority)
        assert e.value.field == "priority"
