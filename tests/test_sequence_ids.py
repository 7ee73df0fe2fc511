"""Sequence ids and request ids are apart: a request (the user's id, a string) has n sequences, each
keyed everywhere between the scheduler and the runner by its `SequenceId` (request id, index)."""

from engine_factory import shared_engine
from jaxcb.core.sequence import Sequence, SequenceId
from jaxcb.sampling_params import SamplingParams


def test_a_sequence_given_a_plain_pair_holds_a_sequence_id():
    seq = Sequence(("chat-1", 2), [1, 2, 3], SamplingParams(max_tokens=1))
    assert type(seq.seq_id) is SequenceId
    assert seq.seq_id.request_id == "chat-1" and seq.seq_id.index == 2
    assert seq.seq_id == ("chat-1", 2) and hash(seq.seq_id) == hash(("chat-1", 2))


def test_each_of_a_requests_sequences_is_keyed_by_the_request_id_and_its_index():
    e = shared_engine()
    params = SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True)
    request_id = e.add_request([5, 6, 7], params, request_id="req")
    seqs = sorted((s for s in e.scheduler.sequences.values() if s.group_id == request_id), key=lambda s: s.sample_index)
    assert [s.seq_id for s in seqs] == [SequenceId("req", 0), SequenceId("req", 1)]
    assert all(type(s.seq_id) is SequenceId for s in seqs)
    assert seqs[0].parent_id is None and seqs[1].parent_id == seqs[0].seq_id
    sampled_keys = []
    collect = e.runner.collect

    def recording(handle):
        out = collect(handle)
        sampled_keys.extend(out.sampled)
        return out

    e.runner.collect = recording
    try:
        outputs = {}
        while e.has_unfinished_requests():
            outputs.update({out.request_id: out for out in e.step() if out.finished})
    finally:
        del e.runner.collect
    assert set(sampled_keys) == {SequenceId("req", 0), SequenceId("req", 1)}
    assert [len(c.token_ids) for c in outputs["req"].outputs] == [3, 3]
