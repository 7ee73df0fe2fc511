"""Background (batch) work yields to interactive requests under every scheduler.policy: admitted after
every waiting interactive sequence, and preempted first (the scheduler alone, no model)."""

import pytest

from jaxcb.config import SchedulerConfig
from jaxcb.core.block_pool import BlockPool
from jaxcb.core.scheduler import Scheduler
from jaxcb.core.sequence import RequestStatus, Sequence
from jaxcb.core.step import RunnerOutput, SampledToken
from jaxcb.sampling_params import SamplingParams

BLOCK = 4
POLICIES = ["fcfs", "priority", "static"]


def make_scheduler(policy, num_blocks=64, max_num_seqs=2):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16, policy=policy)
    return Scheduler(cfg, BlockPool(num_blocks), BLOCK, max_model_len=256)


def make_sequence(rid, arrival, *, background=False, prompt_len=3, max_tokens=50):
    return Sequence((rid, 0), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                    arrival_time=arrival, background=background)


def run_step(sched):
    out = sched.schedule()
    sched.commit(out)
    sched.update(out, RunnerOutput({s.seq_id: SampledToken(7) for s in out.scheduled if s.samples}))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_a_waiting_interactive_request_is_admitted_before_background_work_that_arrived_earlier(policy):
    sched = make_scheduler(policy)
    batch = [make_sequence(f"b{i}", arrival=i, background=True) for i in range(4)]
    user = make_sequence("user", arrival=10)
    for s in batch + [user]:
        sched.add_request(s)
    run_step(sched)
    assert [s.seq_id.request_id for s in sched.running] == ["user", "b0"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_interactive_arrival_into_an_engine_full_of_background_work_preempts_it(policy):
    sched = make_scheduler(policy)
    batch = [make_sequence(f"b{i}", arrival=i, background=True) for i in range(3)]
    for s in batch:
        sched.add_request(s)
    run_step(sched)
    run_step(sched)
    assert {s.seq_id.request_id for s in sched.running} == {"b0", "b1"}
    user = make_sequence("user", arrival=10)
    sched.add_request(user)
    out = run_step(sched)
    assert len(out.preempted_ids) == 1 and out.preempted_ids[0].request_id in ("b0", "b1")
    run_step(sched)
    assert user.status is RequestStatus.RUNNING
    assert batch[2].status is RequestStatus.WAITING  # the background work waits behind it


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_without_background_work_an_interactive_arrival_preempts_nothing(policy):
    sched = make_scheduler(policy)
    for i in range(2):
        sched.add_request(make_sequence(f"a{i}", arrival=i))
    run_step(sched)
    sched.add_request(make_sequence("late", arrival=10))
    assert not run_step(sched).preempted_ids


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_when_blocks_run_out_a_background_sequence_is_the_victim(policy):
    # Two long-running sequences on a small pool: the interactive one (which computed least under fcfs'
    # usual rule) keeps its blocks, the background one is preempted.
    sched = make_scheduler(policy, num_blocks=7)
    background = make_sequence("batch", arrival=0, background=True, prompt_len=4)
    user = make_sequence("user", arrival=1, prompt_len=2)
    sched.add_request(background)
    sched.add_request(user)
    preempted = []
    for _ in range(12):
        preempted += run_step(sched).preempted_ids
    assert preempted and all(p.request_id == "batch" for p in preempted)
    assert user.status is RequestStatus.RUNNING
