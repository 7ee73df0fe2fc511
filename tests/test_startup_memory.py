"""Start-up's memory, without a GPU: the peak each phase holds on an H200-sized device, modelled with
the engine's own cache planning, fits for llama8b and llama70b at TP 2 and 8; planning the cache
before prepare (the first order jaxcb had) overflows; the engine runs the modelled order; and on
the CPU, prepare's real peak is the one the model assumes."""

import dataclasses

import jax
import pytest

from cuda_variants import preset
from engine_factory import shared_engine
from jaxcb.backends import select_backend
from jaxcb.backends import base as backend_base
from jaxcb.batch_limits import resolve_batch_limits
from jaxcb.config import CacheConfig, ConfigError, SchedulerConfig, compose_config
from jaxcb.kv_cache import GIB, DeviceMemory, plan_kv_cache
from jaxcb.startup_log import MemoryReport, report_memory
from jaxcb.startup_memory import (
    ENGINE_STARTUP_ORDER, PLAN_BEFORE_PREPARE, check_weights_fit, model_startup, weight_bytes,
)

H200_BYTES = 141 * 10**9
POOL_FRACTION = 0.9  # cache.memory_fraction's default, which the engine makes XLA's pool


def gpu_backend(name: str):
    cfg = compose_config([f"model={name}", "model.init=random", "model.dtype=bfloat16"])
    return select_backend(cfg.model, preset(name), cfg.attention, platform="gpu")  # as on a GPU host


def startup(name: str, tp: int, order=ENGINE_STARTUP_ORDER, max_model_len: int = 8192):
    arch, backend = preset(name), gpu_backend(name)
    weights = weight_bytes(arch, tp)
    # The auto limits, sized as start-up sizes them once the weights are in.
    memory = DeviceMemory(int(H200_BYTES * POOL_FRACTION), weights.total, POOL_FRACTION)
    limits = resolve_batch_limits(SchedulerConfig(), arch, memory, memory_fraction=POOL_FRACTION, block_size=16,
                                  tensor_parallel_size=tp)
    # cache.dtype=auto is bf16 on a GPU (f32 on this CPU host): say it.
    return model_startup(arch, CacheConfig(memory_fraction=POOL_FRACTION, dtype="bfloat16"), device_bytes=H200_BYTES,
                         pool_fraction=POOL_FRACTION, prepare_memory=backend.prepare_memory,
                         max_model_len=max_model_len, max_num_seqs=limits.max_num_seqs,
                         max_num_batched_tokens=limits.max_num_batched_tokens, tensor_parallel_size=tp, order=order)


@pytest.mark.parametrize("name, tp", [("llama8b", 1), ("llama70b", 2), ("llama70b", 8)])
def test_start_up_fits_an_h200_with_the_cache_planned_after_prepare(name, tp):
    m = startup(name, tp)
    assert [p.name for p in m.phases] == list(ENGINE_STARTUP_ORDER)
    assert m.fits, m.describe()
    # The cache takes what the weights and the workspace leave of the pool, and that is most of it.
    held = {p.name: p for p in m.phases}
    assert held["allocate"].held_bytes + m.workspace_bytes <= m.pool_bytes
    assert m.pool_bytes - held["compile"].peak_bytes < 0.01 * m.pool_bytes
    assert m.plan.bytes_per_device > 0.25 * m.pool_bytes


@pytest.mark.parametrize("name, tp", [("llama8b", 1), ("llama70b", 2), ("llama70b", 8)])
def test_planning_the_cache_before_prepare_overflows_at_prepare(name, tp):
    m = startup(name, tp, PLAN_BEFORE_PREPARE)
    assert not m.fits
    assert m.overflow.name == "prepare"
    over = m.overflow.peak_bytes - m.pool_bytes
    assert over > 1.5 * GIB  # the fused copy's size: the 8B's gate/up alone is 7 GiB in bf16


def test_weights_and_their_fused_parts_are_counted_per_device():
    llama8b = weight_bytes(preset("llama8b"))
    assert 14.5 * GIB < llama8b.total < 15.5 * GIB  # 8.0B parameters in bf16
    assert 6.5 * GIB < llama8b.gate_up < 7.5 * GIB
    tp8 = weight_bytes(preset("llama70b"), 8)
    assert 17.5 * GIB < tp8.total < 18.5 * GIB  # 68.5B layer weights / 8 in bf16, plus the replicated 2 GB embedding


def test_the_engine_starts_up_in_the_modelled_order():
    engine = shared_engine()
    assert engine.startup.names == ENGINE_STARTUP_ORDER
    assert "memory per device: weights" in str(engine.memory_report)


def test_prepare_holds_at_most_what_the_memory_model_says_on_the_cpu(monkeypatch):
    """The scanned xla backend's prepare, measured on the CPU: the live bytes after each fusion never
    pass the loaded weights by more than `Backend.prepare_memory` says, and the originals are gone after."""
    from jaxcb.model.llama import build_random_model

    cfg = compose_config(["model=tiny", "model.layer_loop=scan", "model.backend=xla"])
    arch = preset("tiny")
    arch = dataclasses.replace(arch, dtype="float32")
    backend = select_backend(cfg.model, arch, cfg.attention, platform="cpu")
    assert not backend.unroll_layers and backend.name == "xla"
    model = build_random_model(arch, seed=0)

    def live() -> int:
        return sum(a.nbytes for a in jax.live_arrays())

    peaks = []
    for name in ("fuse_qkv", "fuse_gate_up"):
        real = getattr(backend_base, name)

        def measured(*args, _real=real, **kw):
            out = _real(*args, **kw)
            peaks.append(live())  # the originals are still arguments here: the fusion's peak
            return out

        monkeypatch.setattr(backend_base, name, measured)
    before = live()
    weights = backend.prepare(model, max_len=64)
    after = live()
    transient, prepared = backend.prepare_memory(weight_bytes(arch), 64)
    assert len(peaks) == 2
    assert max(peaks) - before <= transient  # one fused copy at a time, not both
    assert max(peaks) - before >= min(weight_bytes(arch).qkv, weight_bytes(arch).gate_up)
    assert after - before == prepared - weight_bytes(arch).total  # fusing rewrites without adding (+ rope table)
    del weights


def test_weights_that_cannot_be_loaded_and_prepared_are_refused_before_loading():
    arch, backend = preset("llama8b"), gpu_backend("llama8b")
    small = DeviceMemory(int(24 * 10**9 * POOL_FRACTION), 0, POOL_FRACTION)  # a 24 GB card
    with pytest.raises(ConfigError, match=r"model=llama8b's weights take .* preparing them .* raise cache\.memory_fraction"):
        check_weights_fit(arch, small, backend.prepare_memory, 8192, 1, "llama8b")
    h200 = DeviceMemory(int(H200_BYTES * POOL_FRACTION), 0, POOL_FRACTION)
    check_weights_fit(arch, h200, backend.prepare_memory, 8192, 1, "llama8b")
    check_weights_fit(arch, h200, backend.prepare_memory, 8192, 1, "llama8b", (50 * GIB, "lora.max_loras=64"))
    with pytest.raises(ConfigError, match=r"LoRA adapters' slots \(lora.max_loras=512\) take 200.00 GiB beside "
                                          r"model=llama8b's .* lower lora.max_loras or lora.max_rank"):
        check_weights_fit(arch, h200, backend.prepare_memory, 8192, 1, "llama8b", (200 * GIB, "lora.max_loras=512"))


def test_a_compiled_step_larger_than_what_the_cache_leaves_is_refused_at_start_up():
    class Executable:
        def __init__(self, temp):
            self.temp = temp

        def memory_analysis(self):
            return type("Stats", (), {"temp_size_in_bytes": self.temp})()

    plan = startup("llama8b", 1).plan
    memory = DeviceMemory(pool_bytes=100 * GIB, in_use_bytes=98 * GIB, pool_fraction=POOL_FRACTION)
    report = report_memory({}, plan, GIB, [Executable(GIB), Executable(GIB // 2)], memory)
    assert isinstance(report, MemoryReport) and report.headroom_bytes == GIB
    assert "headroom 1.00 GiB" in str(report)
    with pytest.raises(ConfigError, match=r"largest compiled step needs 3.00 GiB .* lower cache\.memory_fraction"):
        report_memory({}, plan, GIB, [Executable(3 * GIB)], memory)


def test_the_cache_fits_the_pools_largest_free_block_where_prepare_left_holes():
    # As measured on an H200 with llama8b: prepare's replaced q/k/v and gate/up left ~9 GiB of holes
    # below the fused weights, so the free bytes (110.8 GiB) held K but not V (53.66 GiB each).
    arch = preset("llama8b")
    cache = CacheConfig(memory_fraction=POOL_FRACTION, dtype="bfloat16")
    pool, weights, reserve = int(125.82 * GIB), int(15.02 * GIB), int(3.48 * GIB)
    whole = DeviceMemory(pool, weights, POOL_FRACTION)
    holed = dataclasses.replace(whole, largest_free_bytes=int(101.8 * GIB))
    plan = lambda memory: plan_kv_cache(cache, arch, max_model_len=8192, max_num_seqs=256,  # noqa: E731
                                        reserve_bytes=reserve, memory=memory)
    assert plan(whole).total_bytes > holed.largest_free_bytes  # what failed its second allocation
    capped = plan(holed)
    assert capped.total_bytes <= holed.largest_free_bytes - reserve
    assert capped.total_bytes > holed.largest_free_bytes - reserve - capped.bytes_per_block
    assert "largest free block of 101.80 GiB" in capped.describe()
    roomy = dataclasses.replace(whole, largest_free_bytes=pool - weights)  # no holes: nothing changes
    assert plan(roomy) == plan(whole)


def test_a_kv_cache_the_device_cannot_allocate_is_refused_at_start_up_with_what_to_change(monkeypatch):
    from jaxcb import kv_cache

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 53.66GiB")

    monkeypatch.setattr(kv_cache, "allocate_kv_cache", out_of_memory)
    plan = startup("llama8b", 1).plan
    with pytest.raises(ConfigError, match=r"could not be allocated: RESOURCE_EXHAUSTED.*lower cache\.memory_fraction"):
        kv_cache.allocate_planned_kv_cache(preset("llama8b"), plan)


def test_a_cache_num_blocks_past_the_devices_free_memory_is_refused_naming_it_before_allocation(caplog):
    arch = preset("llama8b")
    cache = CacheConfig(num_blocks=10_000, dtype="bfloat16")  # 2 MiB a block: ~19.5 GiB
    memory = DeviceMemory(pool_bytes=40 * GIB, in_use_bytes=16 * GIB, pool_fraction=POOL_FRACTION)
    fits = plan_kv_cache(cache, arch, max_model_len=8192, max_num_seqs=8, reserve_bytes=2 * GIB, memory=memory)
    assert fits.num_blocks == 10_000 and fits.source == "cache.num_blocks"
    small = dataclasses.replace(memory, pool_bytes=36 * GIB)  # 20 GiB free
    with caplog.at_level("WARNING", logger="jaxcb.kv_cache"):  # the workspace's estimate does not fit beside it
        plan_kv_cache(cache, arch, max_model_len=8192, max_num_seqs=8, reserve_bytes=2 * GIB, memory=small)
    assert "less than the 2.00 GiB the largest step may need" in caplog.text
    with pytest.raises(ConfigError, match=r"cache\.num_blocks=10000 needs 19\.53 GiB of gpu memory a device, more than "
                                          r"the 4\.00 GiB free .* at most 1024 blocks fit .*; lower cache\.num_blocks"):
        plan_kv_cache(cache, arch, max_model_len=8192, max_num_seqs=8, reserve_bytes=2 * GIB,
                      memory=dataclasses.replace(memory, pool_bytes=20 * GIB))
    # Under tensor parallelism each device holds its share of every block.
    plan_kv_cache(cache, arch, max_model_len=8192, max_num_seqs=8, reserve_bytes=2 * GIB,
                  memory=dataclasses.replace(memory, pool_bytes=20 * GIB), tensor_parallel_size=8)
