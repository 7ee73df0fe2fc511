"""Async scheduling's rule (`jaxcb.core.in_flight`), driven through the scheduler with no model:
step N+1 is scheduled before step N's tokens are known, as the engine does."""

from jaxcb.core.step import RunnerOutput, SampledToken
from jaxcb.core.sequence import RequestStatus, Sequence
from jaxcb.sampling_params import SamplingParams
from test_scheduler import make_scheduler


def sampled(out, token):
    return RunnerOutput({s.seq_id: SampledToken(token) for s in out.scheduled if s.samples})


def test_next_step_reads_each_token_in_flight_from_its_row_of_the_step_before():
    sched = make_scheduler(max_num_batched_tokens=32)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    b = Sequence("b", [4, 5], SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.2))
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    sched.commit(first)  # dispatched; its tokens are not known yet
    rows = {s.seq_id: i for i, s in enumerate(first.scheduled)}
    second = sched.schedule()  # scheduled before the first step's tokens reach the host
    by_id = {s.seq_id: s for s in second.scheduled}
    for seq in (a, b):
        s = by_id[seq.seq_id]
        assert s.in_flight_row == rows[seq.seq_id] and s.token_ids == [0]  # carried as 0, read on the device
        assert seq.num_tokens == seq.num_prompt_tokens + 1  # the token in flight counts
    assert by_id["b"].prior_token_ids() == [4, 5]  # what the runner counts for its penalties, if new to a slot
    sched.commit(second)
    touched = sched.update(first, sampled(first, 7))  # the first step's tokens arrive
    assert [(seq.seq_id, token) for seq, token, _ in touched] == [("a", 7), ("b", 7)]
    third_rows = {s.seq_id: i for i, s in enumerate(second.scheduled)}
    sched.update(second, sampled(second, 8))
    assert a.output_token_ids == [7, 8] and b.output_token_ids == [7, 8]
    third = sched.schedule()  # synchronous again: everything is known
    assert all(s.in_flight_row == -1 for s in third.scheduled) and third_rows


def test_a_token_drawn_past_a_stop_is_discarded_and_its_blocks_freed():
    sched = make_scheduler()
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    sched.add_request(seq)
    first = sched.schedule()
    sched.commit(first)
    second = sched.schedule()
    sched.commit(second)  # a second token is in flight behind the first
    sched.update(first, sampled(first, 9))
    sched.finish("a", RequestStatus.FINISHED_STOPPED)  # the first token was a stop
    assert seq.output_token_ids == [9]
    assert sched.pool.num_free_blocks == sched.pool.num_blocks - 1
    sched.update(second, sampled(second, 5))  # the dropped token arrives: nothing to apply
    assert seq.output_token_ids == [9]


def test_the_last_token_in_flight_is_not_computed_past_max_tokens():
    sched = make_scheduler()
    seq = Sequence("a", [1, 2], SamplingParams(max_tokens=1, temperature=0))
    sched.add_request(seq)
    sched.commit(sched.schedule())
    assert sched.schedule().is_empty  # its only token is in flight: nothing more to compute


def test_a_block_is_registered_in_the_prefix_cache_only_once_its_last_token_is_known():
    sched = make_scheduler(enable_prefix_caching=True)
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))  # block size 4
    sched.add_request(seq)
    first = sched.schedule()
    sched.commit(first)
    second = sched.schedule()  # computes the token in flight: the first block is full of computed tokens
    sched.commit(second)
    assert seq.num_computed_tokens == 4 and seq.num_registered_blocks == 0
    sched.update(first, sampled(first, 7))
    assert seq.num_registered_blocks == 1  # [1, 2, 3, 7]: known now
    assert not sched.in_flight.any_in_flight(seq.token_ids(0, 4))
