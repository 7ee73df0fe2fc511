"""Step buckets: on CPU the token buckets start at 1; under the xla backend, where a padded token costs
compute, they are dense where decode steps run (up to max_num_seqs), and powers of two above, where each one
more is a compile of every eager step variant at start-up; under the cpu backend, whose matmuls and LM head
skip padding rows, powers of four."""

import pytest

from jaxcb.config import ConfigError, EngineConfig, SchedulerConfig
from jaxcb.runner import default_token_buckets, make_buckets


def test_xla_backend_decode_buckets_pad_a_step_by_at_most_a_third_and_a_full_decode_batch_not_at_all():
    assert default_token_buckets(2048, "cpu", max_num_seqs=40) == [
        1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 64, 128, 256, 512, 1024, 2048
    ]
    assert default_token_buckets(512, "cpu", max_num_seqs=64, backend="xla") == [
        1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512
    ]


def test_cpu_backend_buckets_are_powers_of_four_and_a_full_decode_batch():
    """Its matmuls and LM head skip padding rows: denser buckets would only add compiles."""
    assert default_token_buckets(2048, "cpu", max_num_seqs=64, backend="cpu") == [1, 4, 16, 64, 256, 1024, 2048]
    assert default_token_buckets(2048, "cpu", max_num_seqs=40, backend="cpu") == [1, 4, 16, 40, 64, 256, 1024, 2048]
    assert default_token_buckets(50, "cpu", max_num_seqs=64, backend="cpu") == [1, 4, 16, 50]


def test_cpu_prefill_buckets_are_powers_of_two_up_to_the_budget():
    assert default_token_buckets(2000, "cpu", max_num_seqs=8) == [1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512,
                                                                  1024, 2000]
    assert default_token_buckets(50, "cpu", max_num_seqs=64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 50]
    assert default_token_buckets(3, "cpu", max_num_seqs=3) == [1, 2, 3]


def test_accelerator_token_buckets_are_powers_of_two_from_16():
    assert default_token_buckets(2048, "gpu", max_num_seqs=256) == [16, 32, 64, 128, 256, 512, 1024, 2048]


def test_smollm2_at_a_2048_budget_compiles_8_buckets_on_the_cpu_backend():
    """SmolLM2 at scheduler.max_num_batched_tokens=2048 on CPU (max_num_seqs 40 where the cache holds 40
    sequences): one sequence bucket per token bucket and one table width, so start-up compiles 8 models."""
    sched = SchedulerConfig(max_num_seqs=40, max_num_batched_tokens=2048)
    buckets = make_buckets(EngineConfig(), sched, max_blocks_per_seq=512, attention="cpu", platform="cpu",
                           backend="cpu")
    assert [(b.num_tokens, b.num_seqs) for b in buckets.all()] == [
        (1, 1), (4, 4), (16, 16), (40, 40), (64, 40), (256, 40), (1024, 40), (2048, 40)]
    assert buckets.pick(40, 40, 100) == (40, 40, 512) and buckets.pick(41, 40, 100) == (64, 40, 512)
    assert buckets.pick(3, 3, 100) == (4, 4, 512) and buckets.pick(17, 17, 100) == (40, 40, 512)


@pytest.mark.parametrize("engine, message", [
    (EngineConfig(seq_buckets=[8, 1000]),
     r"engine\.seq_buckets=\[8, 1000\] has 1000, above scheduler\.max_num_seqs=64"),
    (EngineConfig(context_buckets=[4, 100000]),
     r"engine\.context_buckets=\[4, 100000\] has 100000 blocks, above the 16 a sequence of engine\.max_model_len"),
])
def test_buckets_past_the_limits_in_force_are_refused_not_dropped(engine, message):
    # The limits as start-up resolved them (scheduler.max_num_seqs may have been auto).
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)
    with pytest.raises(ConfigError, match=message):
        make_buckets(engine, sched, max_blocks_per_seq=16, attention="cpu", platform="cpu", backend="cpu")
