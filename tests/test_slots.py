"""The block tables and penalty counts that stay on the device between steps (jaxcb/runner/slots.py):
after every step they hold exactly what the host's sequences say, through preemption, swaps,
prefix-cache hits, slots lost and reused; and a step's inputs no longer grow with max_model_len."""

import collections
import random

import numpy as np
import pytest

from engine_factory import shared_engine
from jaxcb.runner.slots import SlotTable
from jaxcb.runner.buckets import BucketKey
from jaxcb.runner.step_args import model_inputs, packed_sizes
from jaxcb.sampling import StepVariant
from jaxcb.sampling_params import SamplingParams


def test_a_sequence_keeps_its_slot_and_is_fresh_only_when_new_or_its_blocks_were_replaced():
    slots = SlotTable(4)
    a, fresh = slots.use("a", block_epoch=1)
    assert fresh and a.num_blocks == 0
    a.num_blocks = 3
    again, fresh = slots.use("a", block_epoch=1)
    assert again is a and not fresh and a.num_blocks == 3
    moved, fresh = slots.use("a", block_epoch=2)  # preempted and readmitted, or swapped: new blocks
    assert fresh and moved.slot == a.slot and moved.num_blocks == 0


def test_the_least_recently_scheduled_sequence_gives_up_its_slot():
    slots = SlotTable(4)
    for rid in "abcd":
        slots.use(rid, 0)
    slots.use("a", 0)  # a is now the most recent; b the least
    e, fresh = slots.use("e", 0)
    assert fresh and e.slot == 1  # b's
    b, fresh = slots.use("b", 0)
    assert fresh and b.slot == 2  # c's: b comes back to a fresh slot
    slots.release("e")
    f, _ = slots.use("f", 0)
    assert f.slot == 1


def test_a_steps_packed_inputs_do_not_grow_with_the_block_table_width():
    sizes = {w: packed_sizes(model_inputs(BucketKey(64, 8, w, StepVariant.GREEDY).model, block_size=16, abstract=True))
             for w in (16, 8192)}  # 256 and 131,072 positions
    assert sizes[16] == sizes[8192]


def check_device_state(engine) -> int:
    """Every sequence whose slot is current: its table row and (with penalties) its counts are its own.
    Returns how many sequences were checked."""
    state = engine.runner.slot_state
    tables, seen, counts = (np.asarray(a) for a in (state.block_tables, state.counts.seen, state.counts.output_counts))
    checked = 0
    for rid, entry in engine.runner.inputs.slots._entries.items():
        request = engine.scheduler.sequences.get(rid)
        if request is None or entry.block_epoch != request.block_epoch or not request.block_ids:
            continue
        assert tables[entry.slot, : entry.num_blocks].tolist() == request.block_ids[: entry.num_blocks], rid
        if request.sampling_params.uses_penalties:
            tokens = request.token_ids(0, request.num_computed_tokens)
            assert set(np.flatnonzero(seen[entry.slot]).tolist()) == set(tokens), rid
            outputs = collections.Counter(tokens[request.num_prompt_tokens :])
            row = counts[entry.slot]
            assert {t: int(row[t]) for t in np.flatnonzero(row)} == dict(outputs), rid
        checked += 1
    return checked


WORKLOADS = {
    "recompute": ("cache.num_blocks=24",),
    "swap": ("cache.num_blocks=24", "scheduler.preemption_mode=swap", "cache.swap_space_gib=0.002"),
    "prefix-hits": ("cache.enable_prefix_caching=true",),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_device_tables_and_counts_match_the_host_after_every_step(name):
    engine = shared_engine(*WORKLOADS[name], "engine.async_scheduling=false")
    rng = random.Random(7)
    shared = [rng.randrange(1, 250) for _ in range(160)]  # ten full blocks every prompt shares
    writes = []
    write = engine.runner.write_slots
    engine.runner.write_slots = lambda w: (writes.append(w), write(w))
    try:
        for i in range(24):
            prompt = shared + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 40))]
            penalties = dict(repetition_penalty=1.3, frequency_penalty=0.5) if i % 2 else {}
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(4, 40), ignore_eos=True,
                                                      **penalties))
        checked = 0
        while engine.has_unfinished_requests():
            engine.step()
            if rng.random() < 0.2:  # a running sequence loses its slot: it comes back fresh
                rid = rng.choice(list(engine.runner.inputs.slots._entries))
                engine.runner.inputs.slots.release(rid)
            checked += check_device_state(engine)
    finally:
        del engine.runner.write_slots
    assert checked > 100
    assert any(w.counted for w in writes), "no sequence with penalties came fresh to a slot"
    if name == "prefix-hits":
        assert any(w.table_updates for w in writes), "no table was too long for the step's own updates"
    else:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1 or name == "prefix-hits"


def test_penalised_greedy_tokens_do_not_depend_on_the_slot_or_the_batch():
    """A request with penalties gives the same tokens alone and among others that come and go (its
    slot reused, its counts written afresh when it comes back)."""
    engine = shared_engine("cache.num_blocks=24", "engine.async_scheduling=false")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5,
                            presence_penalty=0.4, frequency_penalty=0.3)
    prompt = list(b"penalties on the device")
    engine.add_request(prompt, params, request_id="alone")
    alone = None
    while engine.has_unfinished_requests():
        alone = next((o for o in engine.step() if o.finished), alone)
    rng = random.Random(3)
    for i in range(12):
        engine.add_request([rng.randrange(1, 250) for _ in range(rng.randrange(5, 60))],
                           SamplingParams(temperature=0, max_tokens=rng.randrange(2, 30), ignore_eos=True))
    engine.add_request(prompt, params, request_id="batched")
    batched = None
    steps = 0
    while engine.has_unfinished_requests():
        batched = next((o for o in engine.step() if o.request_id == "batched" and o.finished), batched)
        steps += 1
        if steps % 5 == 0:
            engine.runner.inputs.slots.release("batched")
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > 0


def test_a_request_id_used_again_does_not_find_the_last_ones_table():
    engine = shared_engine("cache.num_blocks=24", "engine.async_scheduling=false")
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(prompt, rid):
        engine.add_request(prompt, greedy, request_id=rid)
        done = None
        while engine.has_unfinished_requests():
            done = next((o for o in engine.step() if o.finished), done)
        return done.outputs[0].token_ids

    run(list(b"the first request of this name, long enough for two blocks"), "same-id")
    assert run(list(b"another prompt"), "same-id") == run(list(b"another prompt"), "fresh-id")
