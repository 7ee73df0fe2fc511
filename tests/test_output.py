"""The output processor: one owner of per-request output state. Request groups are objects (a user's
id is never parsed), every stop is decided in one place, and DELTA outputs cost the same at any
point of a long stream."""

import pytest

from engine_factory import shared_engine
from jaxcb.output import OutputKind, token_stop_status
from jaxcb.outputs import join_deltas
from jaxcb.core.sequence import RequestStatus
from jaxcb.sampling_params import SamplingParams

N2 = SamplingParams(n=2, max_tokens=6, temperature=0.7, seed=3)


def run_until_done(e, request_ids) -> dict:
    done = {}
    for _ in range(2000):
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
        if not e.has_unfinished_requests():
            break
    assert set(request_ids) <= set(done)
    return done


@pytest.mark.parametrize("ids", [["a#b"], ["a#0", "a"], ["a", "a#1"], ["x#0#1", "x#0"]],
                         ids=["hash-in-id", "a#0-then-a", "a-then-a#1", "nested"])
def test_request_ids_with_a_hash_and_n_above_one_are_accepted_and_all_finish(ids):
    e = shared_engine()
    for rid in ids:
        assert e.add_request(list(b"hello"), N2, request_id=rid) == rid
    done = run_until_done(e, ids)
    for rid in ids:
        assert done[rid].finished and [c.index for c in done[rid].outputs] == [0, 1]
        assert all(len(c.token_ids) == 6 for c in done[rid].outputs)
    assert not e.has_unfinished_requests() and e.block_pool.num_free_blocks == e.block_pool.num_blocks - 1


def test_an_id_in_use_is_refused_and_the_first_request_is_untouched():
    from jaxcb.errors import InvalidRequestError

    e = shared_engine()
    e.add_request(list(b"hi"), N2, request_id="same")
    with pytest.raises(InvalidRequestError, match="already in use"):
        e.add_request(list(b"hi"), N2, request_id="same")
    assert run_until_done(e, ["same"])["same"].finished


def test_delta_outputs_add_up_to_the_cumulative_output():
    e = shared_engine()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2, stop=["zz"])
    e.add_request(list(b"Once upon"), params, request_id="whole")
    e.add_request(list(b"Once upon"), params, request_id="parts", output_kind=OutputKind.DELTA)
    whole, parts = None, []
    for _ in range(500):
        for out in e.step():
            if out.request_id == "whole":
                whole = out
            else:
                assert out.delta
                parts.append(out)
        if not e.has_unfinished_requests():
            break
    merged = join_deltas(parts)
    a, b = whole.outputs[0], merged.outputs[0]
    assert (a.text, a.token_ids, a.logprobs, a.finish_reason) == (b.text, b.token_ids, b.logprobs, b.finish_reason)
    assert b.num_generated == 40 and merged.finished


def test_what_the_processor_copies_per_step_does_not_grow_with_the_stream():
    e = shared_engine()
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, logprobs=1)
    e.add_request(list(b"a long stream"), params, request_id="long", output_kind=OutputKind.DELTA)
    copied = []
    while e.has_unfinished_requests():
        before = e.output.num_items_copied
        if e.step():
            copied.append(e.output.num_items_copied - before)
    assert len(copied) >= 150
    # A step copies its new token, its logprobs and the text they make: a few items, never the stream.
    assert max(copied[-50:]) <= max(copied[:50]) <= 12
    # For contrast, the cumulative kind copies everything so far at every step.
    e.add_request(list(b"a long stream"), params, request_id="cumulative")
    steps = []
    while e.has_unfinished_requests():
        before = e.output.num_items_copied
        if e.step():
            steps.append(e.output.num_items_copied - before)
    assert steps[-1] >= 400 > 50 * max(copied)


def test_every_stop_is_decided_by_one_rule():
    p = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[42])
    eos = (99,)
    assert token_stop_status(p, 99, 1, 10, eos, 100) is None  # EOS under min_tokens
    assert token_stop_status(p, 99, 2, 10, eos, 100) is RequestStatus.FINISHED_STOPPED
    assert token_stop_status(p, 42, 3, 10, eos, 100) is RequestStatus.FINISHED_STOPPED
    assert token_stop_status(p, 7, 5, 10, eos, 100) is RequestStatus.FINISHED_LENGTH  # max_tokens
    assert token_stop_status(p, 7, 3, 97, eos, 100) is RequestStatus.FINISHED_LENGTH  # max_model_len
    ignore = SamplingParams(max_tokens=5, ignore_eos=True)
    assert token_stop_status(ignore, 99, 1, 10, eos, 100) is None
