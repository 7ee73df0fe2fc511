"""Which LoRA adapter sits in which device slot, and how the scheduler waits for slots (no model)."""

from __future__ import annotations

from test_scheduler import BLOCK, make_request, run_step
from jaxcb.config import SchedulerConfig
from jaxcb.core.block_pool import BlockPool
from jaxcb.core.lora_slots import LoraSlotTable
from jaxcb.core.scheduler import Scheduler
from jaxcb.core.sequence import RequestStatus
from jaxcb.core.step import RunnerOutput, SampledToken


def lora_scheduler(num_slots: int) -> tuple[Scheduler, LoraSlotTable]:
    slots = LoraSlotTable(num_slots)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockPool(64), BLOCK, 256,
                      lora_slots=slots)
    return sched, slots


def with_adapter(prompt_len: int, name, max_tokens: int = 4):
    seq = make_request(prompt_len, max_tokens=max_tokens)
    seq.lora_name = name
    return seq


def test_a_request_whose_adapter_has_no_free_slot_waits_while_those_behind_it_run():
    sched, slots = lora_scheduler(num_slots=1)
    a, b, base, a2 = with_adapter(5, "a"), with_adapter(5, "b"), with_adapter(5, None), with_adapter(5, "a")
    for seq in (a, b, base, a2):
        sched.add_request(seq)
    out = run_step(sched)
    ran = {s.seq_id for s in out.scheduled}
    assert ran == {a.seq_id, base.seq_id, a2.seq_id}  # b waits for the one slot; base and a's second go ahead
    assert sched.waiting[0] is b and a.lora_slot == a2.lora_slot == 0 and base.lora_slot == -1
    assert {s.lora_slot for s in out.scheduled} == {0, -1}
    assert slots.take_loads() == [(0, "a")]
    while b.lora_slot != 0:  # once a's sequences finish, b takes the slot over (a leaves it)
        run_step(sched)
    assert slots.take_loads() == [(0, "b")] and slots.slot_of == {"b": 0}
    while sched.num_unfinished:
        run_step(sched)
    assert slots.num_held == 0 and sched.pool.num_free_blocks == sched.pool.num_blocks - 1


def test_the_least_recently_used_idle_slot_is_reused_and_a_resident_adapter_is_not_reloaded():
    slots = LoraSlotTable(2)
    seqs = {name: with_adapter(3, name) for name in ("a", "b", "c")}
    assert slots.acquire(seqs["a"]) and slots.acquire(seqs["b"])
    assert not slots.can_acquire(seqs["c"])
    slots.release(seqs["b"])
    slots.release(seqs["a"])  # b left its slot first: it is the least recently used
    again = with_adapter(3, "a")
    assert slots.acquire(again) and slots.take_loads() == [(0, "a"), (1, "b")]  # a still resident: no load
    assert slots.acquire(seqs["c"]) and seqs["c"].lora_slot == 1 and slots.take_loads() == [(1, "c")]
    assert "b" not in slots.slot_of


def test_through_preemption_every_scheduled_row_carries_the_slot_its_adapter_is_in():
    """Few blocks and slots: sequences are preempted (their slots released) and come back, perhaps to
    another slot; in every step each sequence's slot holds its own adapter, and one slot one adapter."""
    slots = LoraSlotTable(2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), BlockPool(9), BLOCK, 256,
                      lora_slots=slots)
    seqs = [with_adapter(8, name, max_tokens=16) for name in ("a", "b", "c", None, "a", "c")]
    for seq in seqs:
        sched.add_request(seq)
    loaded: dict[int, str] = {}
    for _ in range(400):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        for slot, name in slots.take_loads():
            loaded[slot] = name
        by_id = {s.seq_id: s for s in seqs}
        for s in out.scheduled:
            name = by_id[s.seq_id].lora_name
            assert (s.lora_slot == -1) == (name is None)
            if name is not None:
                assert loaded[s.lora_slot] == name
        sched.commit(out)
        update = {s.seq_id: SampledToken(7) for s in out.scheduled if s.samples}
        for request, _, _ in sched.update(out, RunnerOutput(update)):
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                sched.finish(request.seq_id, RequestStatus.FINISHED_LENGTH)
    assert not sched.num_unfinished and sched.num_preemptions > 0
    assert slots.num_held == 0 and sched.pool.num_free_blocks == sched.pool.num_blocks - 1
