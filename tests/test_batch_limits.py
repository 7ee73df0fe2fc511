"""scheduler.max_num_seqs / max_num_batched_tokens = auto: the CPU's values on the CPU, GPU sizes on an
H200-sized device (capped by what the cache holds), and an explicit value always wins."""

import pytest

from cuda_variants import preset
from engine_factory import BASE
from jaxcb.engine import Engine
from jaxcb.batch_limits import cap_by_cache, resolve_batch_limits
from jaxcb.config import CacheConfig, ConfigError, SchedulerConfig, compose_config
from jaxcb.kv_cache import DeviceMemory, plan_kv_cache
from jaxcb.startup_memory import weight_bytes

H200_BYTES = 141 * 10**9


def after_weights(name: str, device_bytes: int = H200_BYTES, tp: int = 1) -> DeviceMemory:
    """The device as start-up reads it once the weights are prepared, XLA's pool at memory_fraction 0.9."""
    return DeviceMemory(int(device_bytes * 0.9), weight_bytes(preset(name), tp).total, 0.9)


def resolve(sched: SchedulerConfig, name: str = "llama8b", memory=None, max_model_len: int = 8192):
    arch = preset(name)
    limits = resolve_batch_limits(sched, arch, memory, memory_fraction=0.9, block_size=16)
    plan = plan_kv_cache(CacheConfig(dtype="bfloat16"), arch, max_model_len=max_model_len,
                         max_num_seqs=limits.max_num_seqs, memory=memory)
    return cap_by_cache(limits, sched, plan)


def test_auto_on_the_cpu_is_64_sequences_and_512_tokens():
    limits = resolve_batch_limits(SchedulerConfig(), preset("tiny"), None, memory_fraction=0.9, block_size=16)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (64, 512)
    assert "the CPU" in limits.describe()


def test_auto_on_an_h200_with_llama8b_is_256_sequences_and_8192_tokens():
    limits = resolve(SchedulerConfig(), memory=after_weights("llama8b"))
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (256, 8192)
    assert "scheduler.max_num_seqs=auto: 256" in limits.describe() and "131 GiB" in limits.describe()


def test_auto_sequences_are_capped_by_what_the_cache_holds():
    # llama70b at TP 2 leaves ~48 GiB of cache a device: ~156k tokens, 76 sequences of 2,048 tokens.
    memory = after_weights("llama70b", tp=2)
    arch = preset("llama70b")
    limits = resolve_batch_limits(SchedulerConfig(), arch, memory, memory_fraction=0.9, block_size=16,
                                  tensor_parallel_size=2)
    plan = plan_kv_cache(CacheConfig(dtype="bfloat16"), arch, max_model_len=8192, max_num_seqs=limits.max_num_seqs,
                         memory=memory, tensor_parallel_size=2)
    capped = cap_by_cache(limits, SchedulerConfig(), plan)
    assert capped.max_num_seqs == plan.num_tokens // 2048 // 8 * 8 < 256
    assert "hold" in capped.describe()
    # A 24 GB card with an 8B model: a small cache, and the small device's limits below it.
    small = resolve(SchedulerConfig(), memory=after_weights("llama8b", 24 * 10**9), max_model_len=2048)
    assert small.max_num_batched_tokens <= 2048 and small.max_num_seqs < 128


def test_an_explicit_value_always_wins():
    memory = after_weights("llama8b")
    both = resolve(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024), memory=memory)
    assert (both.max_num_seqs, both.max_num_batched_tokens, both.reasons) == (32, 1024, ())
    seqs = resolve(SchedulerConfig(max_num_seqs=512), memory=memory)
    assert (seqs.max_num_seqs, seqs.max_num_batched_tokens) == (512, 8192)
    tokens = resolve(SchedulerConfig(max_num_batched_tokens=128), memory=memory)
    assert (tokens.max_num_seqs, tokens.max_num_batched_tokens) == (128, 128)  # sequences never pass the budget
    cpu = resolve_batch_limits(SchedulerConfig(max_num_seqs=1024), preset("tiny"), None, memory_fraction=0.9,
                               block_size=16)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (1024, 1024)  # the budget holds every sequence


def test_the_engine_reads_the_resolved_limits_and_leaves_the_config_as_given():
    # Not compiled: the buckets are what this reads (compiling all of them took half a minute).
    engine = Engine(compose_config(BASE + ("scheduler.max_num_seqs=auto", "scheduler.max_num_batched_tokens=auto",
                                           "engine.token_buckets=null")), compile_buckets=False, progress=False)
    assert engine.cfg.scheduler.max_num_seqs == "auto"
    assert (engine.scheduler_config.max_num_seqs, engine.scheduler_config.max_num_batched_tokens) == (64, 512)
    assert engine.runner.buckets.max_num_seqs == 64 and max(engine.runner.buckets.tokens) == 512
    assert engine.limits.max_num_seqs == 64


@pytest.mark.parametrize("overrides, message", [
    (["scheduler.max_num_seqs=lots"], r"scheduler\.max_num_seqs='lots' must be a number, or auto"),
    (["scheduler.max_num_batched_tokens=0"], r"scheduler\.max_num_batched_tokens=0 must be >= 1, or auto"),
    (["scheduler.max_num_seqs=64", "scheduler.max_num_batched_tokens=32"],
     r"max_num_batched_tokens=32 must be >= scheduler\.max_num_seqs=64"),
    (["engine.token_buckets=[16,4096]"], r"engine\.token_buckets=\[16, 4096\] must not exceed .*=512"),
])
def test_bad_limits_fail_with_a_sentence(overrides, message):
    if overrides == ["engine.token_buckets=[16,4096]"]:
        overrides = overrides + ["scheduler.max_num_batched_tokens=512"]
    with pytest.raises(ConfigError, match=message):
        compose_config(["model=tiny", *overrides])


def test_an_auto_budget_holds_the_configured_token_buckets():
    limits = resolve_batch_limits(SchedulerConfig(), preset("tiny"), None, memory_fraction=0.9, block_size=16,
                                  token_buckets=[16, 2048])
    assert limits.max_num_batched_tokens == 2048
