"""The step input builder (jaxcb/runner/step_inputs.py): each token's position and K/V slot,
each row's sampling values (kept per slot while a sequence holds it), padding everywhere else."""

import numpy as np

from jaxcb.core.sequence import SequenceId
from jaxcb.core.step import ScheduledSequence, SchedulerOutput
from jaxcb.runner.buckets import Buckets
from jaxcb.runner.slots import SlotTable
from jaxcb.runner.step_inputs import StepInputBuilder
from jaxcb.sampling import StepVariant
from jaxcb.sampling_params import SamplingParams

BLOCK = 4
VOCAB = 37


def builder() -> StepInputBuilder:
    buckets = Buckets(tokens=(1, 2, 4, 8, 16), seqs=(), widths=(8,), max_num_seqs=4)
    return StepInputBuilder(buckets, BLOCK, VOCAB, max_banned=2, max_logit_bias=2, serving=lambda v: v,
                            slots=SlotTable(8))


def scheduled(rid: str, start: int, num_tokens: int, blocks: list[int], params: SamplingParams, *, epoch: int = 1,
              num_prompt: int = 5, num_output: int = 0, seed: int = 0, banned: tuple[int, ...] = ()) -> ScheduledSequence:
    return ScheduledSequence(SequenceId(rid, 0), start, list(range(100, 100 + num_tokens)), blocks, epoch, True,
                             num_prompt, num_output, params, seed, banned)


def fields(b: StepInputBuilder, key, args) -> dict:
    """Each packed field by name, cut out of the step's three vectors (StepArgs' first three)."""
    out = {}
    for name, vector, start, stop, shape, dtype in b.template(key).fields:
        v = args[vector][start:stop]
        v = v.reshape(shape) if shape is not None else v
        out[name] = v.view(np.uint32) if dtype == np.uint32 else v
    return out


GREEDY = SamplingParams(temperature=0)
HOT = SamplingParams(temperature=0.7, top_p=0.9, seed=5)


def test_decode_rows_and_a_prefill_chunk_write_their_kv_where_their_blocks_say():
    b = builder()
    decodes = [scheduled("a", 9, 1, [3, 4, 5], GREEDY), scheduled("b", 4, 1, [7, 8], GREEDY)]
    key, args, _ = b.build(SchedulerOutput(decodes), prev_tokens=None)
    x = fields(b, key, args)
    assert key.num_tokens == 2 and key.variant == StepVariant.GREEDY
    assert x["positions"].tolist() == [9, 4] and x["slot_mapping"].tolist() == [5 * BLOCK + 1, 8 * BLOCK]
    assert x["token_rows"].tolist() == [0, 1] and x["query_start_loc"].tolist() == [0, 1, 2]
    # The same decode beside a chunk that spans blocks 1-2 of its own table (positions 6..10).
    mixed = [decodes[0], scheduled("c", 6, 5, [11, 12, 13], GREEDY)]
    key, args, _ = b.build(SchedulerOutput(mixed), prev_tokens=None)
    x = fields(b, key, args)
    assert (key.num_tokens, key.num_seqs) == (8, 4)
    assert x["positions"].tolist() == [9, 6, 7, 8, 9, 10, 0, 0]
    assert x["slot_mapping"].tolist() == [21, 12 * 4 + 2, 12 * 4 + 3, 13 * 4, 13 * 4 + 1, 13 * 4 + 2, 0, 0]
    assert x["token_rows"].tolist() == [0, 1, 1, 1, 1, 1, 4, 4]  # padding tokens: row R
    assert x["query_start_loc"].tolist() == [0, 1, 6, 6, 6] and x["logits_indices"].tolist() == [0, 5, 0, 0]
    assert x["kv_lens"].tolist() == [10, 11, 0, 0]
    assert x["sample_rows"].item() == 2  # the LM head may skip rows 2 and 3: the bucket's padding


def test_each_row_carries_its_sequences_sampling_values_and_padding_rows_sample_nothing():
    b = builder()
    rows = [scheduled("a", 9, 1, [3, 4, 5], GREEDY, seed=2**32 + 3, num_output=4),
            scheduled("b", 4, 1, [7, 8], HOT, num_prompt=3, num_output=1, seed=11, banned=(2, 3))]
    key, args, _ = b.build(SchedulerOutput(rows), prev_tokens=None)
    x = fields(b, key, args)
    assert key.variant == StepVariant.FULL  # b's top_p
    assert np.allclose(x["temperature"], [0, 0.7]) and np.allclose(x["top_p"], [1, 0.9])
    assert x["seeds"].tolist() == [3, 11] and x["counters"].tolist() == [4, 1]
    assert x["num_prompt"].tolist() == [5, 3]
    assert x["banned_token_ids"].tolist() == [[VOCAB, VOCAB], [2, 3]]
    # Three rows in a bucket of four: the fourth is padding.
    key, args, _ = b.build(SchedulerOutput(rows + [scheduled("c", 0, 1, [9], GREEDY)]), prev_tokens=None)
    x = fields(b, key, args)
    assert key.num_seqs == 4
    assert np.allclose(x["temperature"], [0, 0.7, 0, 0]) and np.allclose(x["repetition_penalty"], [1, 1, 1, 1])
    assert x["kv_lens"].tolist() == [10, 5, 1, 0] and x["query_start_loc"].tolist() == [0, 1, 2, 3, 3]
    assert x["sample_rows"].item() == 3


def test_a_slot_taken_by_another_sequence_carries_the_new_ones_values():
    b = builder()
    b.slots = SlotTable(4)
    b.build(SchedulerOutput([scheduled("hot", 0, 1, [1], HOT, seed=7)]), prev_tokens=None)
    for rid in "wxyz":  # four others take every slot; "hot" loses its own
        b.build(SchedulerOutput([scheduled(rid, 0, 1, [2], GREEDY)]), prev_tokens=None)
    key, args, _ = b.build(SchedulerOutput([scheduled("w", 1, 1, [2], GREEDY)]), prev_tokens=None)
    x = fields(b, key, args)
    assert key.variant == StepVariant.GREEDY and x["temperature"].tolist() == [0] and x["seeds"].tolist() == [0]
    key, args, _ = b.build(SchedulerOutput([scheduled("hot", 1, 1, [1], HOT, seed=7)]), prev_tokens=None)
    x = fields(b, key, args)
    assert key.variant == StepVariant.FULL and np.allclose(x["temperature"], [0.7]) and x["seeds"].tolist() == [7]
