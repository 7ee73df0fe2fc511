"""The cache's device buffers: sized once from config or memory, written in place inside jit."""

import logging
import os
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_factory import generate_first_completions, make_engine
from jaxcb.config import CacheConfig, ConfigError
from jaxcb.kernels.attention import XLA, KVCache, cpu_form
from jaxcb.kv_cache import allocate_kv_cache, default_cache_dtype, kv_cache_shape, plan_kv_cache
from jaxcb.model.config import LlamaConfig
from jaxcb.sampling_params import SamplingParams

TINY = LlamaConfig(
    vocab_size=259, hidden_size=96, intermediate_size=200, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
    rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=2048, tie_word_embeddings=False,
)


class FakeGpu:
    platform = "gpu"

    def __init__(self, limit, in_use):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def test_explicit_num_blocks_is_used_as_given_and_described():
    plan = plan_kv_cache(CacheConfig(num_blocks=65, block_size=16), TINY, max_model_len=512, max_num_seqs=4)
    assert plan.num_blocks == 65 and plan.num_tokens == 1024
    assert plan.max_full_length_seqs == 2.0
    assert "65 blocks x 16 tokens = 1,024 tokens" in plan.describe()


def test_cpu_default_is_float32_and_capped_at_what_the_sequences_need():
    plan = plan_kv_cache(CacheConfig(block_size=16), TINY, max_model_len=100, max_num_seqs=8)
    assert plan.dtype == jnp.float32  # bf16 scatters are slow on XLA:CPU
    assert plan.num_blocks == 8 * 7 + 1


def test_cpu_size_comes_from_cpu_kv_cache_gib_not_from_a_share_of_host_memory():
    bytes_per_block = TINY.kv_bytes_per_token(4) * 16
    gib = 1000 * bytes_per_block / (1 << 30)
    plan = plan_kv_cache(
        CacheConfig(block_size=16, cpu_kv_cache_gib=gib), TINY, max_model_len=2048, max_num_seqs=64,
    )
    assert plan.num_blocks == 1000 and "cache.cpu_kv_cache_gib" in plan.source
    capped = plan_kv_cache(CacheConfig(block_size=16, cpu_kv_cache_gib=gib), TINY, max_model_len=256, max_num_seqs=4)
    assert capped.num_blocks == 4 * 16 + 1 and "capped at scheduler.max_num_seqs=4" in capped.source


def test_cpu_cache_larger_than_available_host_memory_is_refused_naming_the_knob(monkeypatch):
    import jaxcb.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "_available_host_bytes", lambda: 1 << 28)
    with pytest.raises(ConfigError, match=r"more than the 256.0 MiB of host memory available \(256.0 MiB available, less 0.0 MiB kept"):
        plan_kv_cache(CacheConfig(cpu_kv_cache_gib=2.0), TINY, max_model_len=4096, max_num_seqs=256)


def test_cpu_form_allocates_zeros_without_writing_them():
    form = cpu_form()
    shape = kv_cache_shape(TINY, 4096, 16)  # 48 MiB
    buffer = form.zeros_fn(shape, jnp.float32, None)
    assert buffer.shape == shape and buffer.dtype == jnp.float32
    assert float(jnp.abs(buffer).max()) == 0.0
    # Memory the allocator hands back after a non-zero buffer is freed reads as zeros too.
    jnp.full(shape, 7.0).block_until_ready()
    for dtype in (jnp.float32, jnp.bfloat16):
        again = form.zeros_fn(shape, dtype, None)
        assert float(jnp.abs(again.astype(jnp.float32)).max()) == 0.0
    odd = form.zeros_fn((3, 1001), jnp.bfloat16, None)  # smaller than a page: written
    assert float(jnp.abs(odd.astype(jnp.float32)).max()) == 0.0


def test_gpu_size_comes_from_memory_fraction_of_total_memory_minus_memory_in_use():
    bytes_per_block = TINY.kv_bytes_per_token(2) * 16
    # XLA's pool set to memory_fraction (configure_device_memory): 1000 blocks' worth is half the device
    device = FakeGpu(limit=1000 * bytes_per_block, in_use=100 * bytes_per_block)
    plan = plan_kv_cache(
        CacheConfig(block_size=16, memory_fraction=0.5, dtype="bfloat16"), TINY, max_model_len=64, max_num_seqs=4,
        device=device, pool_fraction=0.5,
    )
    assert plan.num_blocks == 900 and "memory_fraction=0.5 of" in plan.source
    # A pool left at JAX's 75% default: 0.9 of the device would be 1,200 blocks, the pool holds 1,000
    plan = plan_kv_cache(
        CacheConfig(block_size=16, memory_fraction=0.9, dtype="bfloat16"), TINY, max_model_len=64, max_num_seqs=4,
        device=FakeGpu(limit=1000 * bytes_per_block, in_use=100 * bytes_per_block), pool_fraction=0.75,
    )
    assert plan.num_blocks == 900 and "capped by XLA's pool" in plan.source
    # memory_fraction below the pool: the cache takes memory_fraction of the whole device
    plan = plan_kv_cache(
        CacheConfig(block_size=16, memory_fraction=0.6, dtype="bfloat16"), TINY, max_model_len=64, max_num_seqs=4,
        device=FakeGpu(limit=1000 * bytes_per_block, in_use=100 * bytes_per_block), pool_fraction=0.75,
    )
    assert plan.num_blocks == 800 - 100


def test_the_engine_sets_xlas_pool_to_memory_fraction_unless_the_user_did(monkeypatch):
    import jaxcb.kv_cache as kv

    monkeypatch.delenv(kv.XLA_POOL_FRACTION_VAR, raising=False)
    monkeypatch.setattr(kv, "_backends_initialized", lambda: False)
    assert kv.configure_device_memory(0.92) == 0.92 and os.environ[kv.XLA_POOL_FRACTION_VAR] == "0.92"
    monkeypatch.setenv(kv.XLA_POOL_FRACTION_VAR, "0.8")
    assert kv.configure_device_memory(0.92) == 0.8  # the user's value stays
    monkeypatch.delenv(kv.XLA_POOL_FRACTION_VAR)
    monkeypatch.setattr(kv, "_backends_initialized", lambda: True)  # too late to change it: left alone
    assert kv.configure_device_memory(0.92) == kv.XLA_DEFAULT_POOL_FRACTION
    assert kv.XLA_POOL_FRACTION_VAR not in os.environ


def test_a_late_start_warns_about_xlas_pool_only_where_an_accelerator_was_started(monkeypatch, caplog):
    import jaxcb.kv_cache as kv

    assert kv._accelerator_initialized() is (jax.default_backend() != "cpu")  # the real registry, read
    monkeypatch.delenv(kv.XLA_POOL_FRACTION_VAR, raising=False)
    monkeypatch.setattr(kv, "_backends_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger="jaxcb.kv_cache"):
        monkeypatch.setattr(kv, "_accelerator_initialized", lambda: False)  # the CPU alone: no pool to size
        kv.configure_device_memory(0.92)
        assert caplog.records == []
        monkeypatch.setattr(kv, "_accelerator_initialized", lambda: True)
        kv.configure_device_memory(0.92)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 before starting" in caplog.text
    assert kv.XLA_POOL_FRACTION_VAR not in os.environ


def test_tensor_parallel_cache_holds_tp_times_the_blocks_in_the_same_memory_per_device():
    # Each of 2 devices holds 1 of TINY's 2 KV heads: a block costs it half as much.
    bytes_per_block = TINY.kv_bytes_per_token(2) * 16
    device = FakeGpu(limit=1000 * bytes_per_block, in_use=100 * bytes_per_block)
    plan = plan_kv_cache(
        CacheConfig(block_size=16, memory_fraction=0.5, dtype="bfloat16"), TINY, max_model_len=64, max_num_seqs=4,
        device=device, tensor_parallel_size=2, pool_fraction=1.0,
    )
    assert plan.num_blocks == 800
    assert plan.bytes_per_device == 400 * bytes_per_block
    assert "on each of 2 devices" in plan.describe()


def test_a_host_cache_of_more_blocks_than_the_machines_memory_is_refused_before_it_is_allocated():
    # 10**9 blocks of 12 KiB: terabytes, more than any machine this runs on has
    with pytest.raises(ConfigError, match=r"cache\.num_blocks=1000000000 \(the KV cache, 12,288 bytes a block\) takes "
                                          r"11444\.09 GiB of host memory, more than the .* this machine has"):
        plan_kv_cache(CacheConfig(num_blocks=10**9), TINY, max_model_len=256, max_num_seqs=8)


def test_cache_that_cannot_hold_one_max_length_sequence_is_refused():
    with pytest.raises(ConfigError, match=r"fewer than one sequence of max_model_len=2048.*lower engine\.max_model_len"):
        plan_kv_cache(CacheConfig(num_blocks=10), TINY, max_model_len=2048, max_num_seqs=1)


FORMS = {"xla": lambda: XLA, "cpu": cpu_form}


def test_cache_layout_puts_one_block_of_one_head_contiguous():
    assert kv_cache_shape(TINY, 7, 16) == (3, 2, 7, 16, 16)
    assert default_cache_dtype("bfloat16") == jnp.bfloat16


def test_auto_cache_dtype_on_cpu_follows_the_model_dtype():
    assert default_cache_dtype("auto", "bfloat16") == jnp.bfloat16  # this is a CPU
    assert default_cache_dtype("auto", "float32") == jnp.float32
    assert default_cache_dtype("float32", "bfloat16") == jnp.float32  # an explicit value wins


@pytest.mark.parametrize("form", ["xla", "cpu"])
def test_write_kv_scatters_tokens_to_their_slots_and_drops_nothing_else(form):
    write_kv = FORMS[form]().write
    cache = allocate_kv_cache(TINY, num_blocks=4, block_size=8, dtype=jnp.float32)
    k = jnp.arange(3 * 2 * 16, dtype=jnp.float32).reshape(3, 2, 16) + 1
    slots = jnp.asarray([8 + 5, 24 + 0, 0], jnp.int32)  # block 1 offset 5, block 3 offset 0, padding -> null
    out = write_kv(cache, jnp.int32(2), k, -k, slots)
    np.testing.assert_array_equal(out.k[2, :, 1, 5], k[0])
    np.testing.assert_array_equal(out.v[2, :, 3, 0], -k[1])
    assert float(jnp.abs(out.k[:2]).sum()) == 0  # other layers untouched
    touched = np.zeros(out.k.shape[2:4], bool)
    touched[1, 5] = touched[3, 0] = touched[0, 0] = True
    assert float(jnp.abs(out.k[2][:, ~touched]).sum()) == 0


@pytest.mark.parametrize("form", ["xla", "cpu"])
def test_write_kv_updates_a_donated_cache_in_place(form):
    write_kv = FORMS[form]().write
    cache = allocate_kv_cache(TINY, num_blocks=4, block_size=8, dtype=jnp.float32)
    step = jax.jit(lambda c, k, s: write_kv(c, jnp.int32(0), k, k, s), donate_argnums=0)
    k = jnp.ones((1, 2, 16))
    before = cache.k.unsafe_buffer_pointer()
    out = step(cache, k, jnp.asarray([9], jnp.int32))
    assert isinstance(out, KVCache) and cache.k.is_deleted()
    assert out.k.unsafe_buffer_pointer() == before


@pytest.mark.parametrize("form", ["xla", "cpu"])
@pytest.mark.parametrize("num_tokens", [1, 2, 5])
def test_write_kv_never_copies_the_cache_whatever_the_number_of_tokens(num_tokens, form):
    write_kv = FORMS[form]().write
    # A one-token step once copied the whole cache for every layer's write (XLA turned the
    # one-row scatter into a dynamic-update-slice that it did not do in place).
    cache = allocate_kv_cache(TINY, num_blocks=4, block_size=8, dtype=jnp.float32)

    def every_layer(c, k, s):
        for layer in range(TINY.num_layers):
            c = write_kv(c, jnp.int32(layer), k * layer, -k, s)
        return c

    k = jnp.ones((num_tokens, 2, 16))
    slots = jnp.arange(num_tokens, dtype=jnp.int32) + 3
    step = jax.jit(every_layer, donate_argnums=0)
    text = step.lower(cache, k, slots).compile().as_text()
    flat = "f32[3,2,32,16]"
    copies = [line for line in text.splitlines() if " copy(" in line and (flat in line or "f32[3,2,4,8,16]" in line)]
    assert copies == []
    out = step(cache, k, slots)
    for layer in range(TINY.num_layers):
        np.testing.assert_array_equal(out.k[layer, :, 0, 3], np.full((2, 16), layer, np.float32))
    np.testing.assert_array_equal(out.v[1, :, 0, 3], -np.ones((2, 16), np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cpu_write_into_a_16_bit_cache_neither_converts_nor_copies_the_cache(dtype):
    write_kv = cpu_form().write
    # XLA:CPU scattered into a bf16 cache by converting all of it to f32 and back, for every
    # layer's K and V: a bf16 cache made each step ~14x slower than an f32 one.
    cache = allocate_kv_cache(TINY, num_blocks=4, block_size=8, dtype=dtype)

    def every_layer(c, k, s):
        for layer in range(TINY.num_layers):
            c = write_kv(c, jnp.int32(layer), k * (layer + 1), -k, s)
        return c

    k = jnp.full((2, 2, 16), 1.5, jnp.float32)
    slots = jnp.asarray([3, 17], jnp.int32)
    step = jax.jit(every_layer, donate_argnums=0)
    text = step.lower(cache, k, slots).compile().as_text()
    whole_cache = [line for line in text.splitlines()
                   if any(f"{t}[3,2,32,16]" in line or f"{t}[3,2,4,8,16]" in line for t in ("f32", "u16", "bf16", "f16"))
                   and (" convert(" in line or " copy(" in line)]
    assert whole_cache == []
    out = step(cache, k, slots)
    assert out.k.dtype == dtype and out.v.dtype == dtype
    want_k, want_v = np.zeros(cache.k.shape, np.float32), np.zeros(cache.v.shape, np.float32)
    for layer in range(TINY.num_layers):
        for block, offset in ((0, 3), (2, 1)):  # slots 3 and 17, blocks of 8
            want_k[layer, :, block, offset] = 1.5 * (layer + 1)
            want_v[layer, :, block, offset] = -1.5
    np.testing.assert_array_equal(np.asarray(out.k, np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(out.v, np.float32), want_v)


@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_an_f32_model_serves_from_a_bf16_cache(impl):
    """`cache.dtype=bfloat16` under a float32 model: K/V are stored in bf16, attention takes
    the f32 queries (the CPU kernel reads the cache as f32; the XLA path computes in bf16)."""
    e = make_engine("cache.dtype=bfloat16", f"attention.impl={impl}")
    assert e.runner.kv_cache.k.dtype == jnp.bfloat16
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [out] = generate_first_completions(e, [list(b"Once upon a time")], params)
    assert len(out.token_ids) == 6


def test_a_cache_dtype_the_cpu_kernel_cannot_read_is_a_config_error_at_start_up():
    with pytest.raises(ConfigError, match="cache.dtype=float16 cannot be read by attention.impl=cpu .it reads float32, "
                                          "bfloat16, int8.: use cache.dtype=float32 or bfloat16 or int8, or "
                                          "attention.impl=xla"):
        make_engine("cache.dtype=float16", "attention.impl=cpu")


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_the_cpu_kv_write_matches_xlas_scatter_and_drops_slots_outside_the_cache(cache_dtype, num_tokens):
    from jaxcb.kernels.attention.cpu import write_kv_rows

    rng = np.random.default_rng(num_tokens)
    shape = (3, 2, 5, 4, 16)  # 5 blocks of 4 slots: slots [0, 20)
    k_cache = jnp.asarray(rng.standard_normal(shape), cache_dtype)
    v_cache = jnp.asarray(rng.standard_normal(shape), cache_dtype)
    k = jnp.asarray(rng.standard_normal((num_tokens, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_tokens, 2, 16)), jnp.float32)
    slots = jnp.asarray([7, 20, -1, 0, 19, 12][:num_tokens], jnp.int32)  # 20 and -1 are outside: dropped
    got_k, got_v = jax.jit(write_kv_rows)(k_cache, v_cache, jnp.int32(1), k, v, slots)
    flat = (3, 2, 20, 16)
    for got, cache, rows in ((got_k, k_cache, k), (got_v, v_cache, v)):
        want = np.array(cache.astype(jnp.float32)).reshape(flat)
        for t, s in enumerate(np.asarray(slots)):
            if 0 <= s < 20:
                want[1, :, s] = np.asarray(rows[t].astype(cache_dtype).astype(jnp.float32))
        assert got.dtype == cache_dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)).reshape(flat), want)


def test_the_cpu_kv_write_rejects_rows_that_do_not_fit_the_cache():
    from jaxcb.kernels.attention.cpu import write_kv_rows

    cache = jnp.zeros((3, 2, 5, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="do not match"):
        write_kv_rows(cache, cache, jnp.int32(0), jnp.zeros((2, 3, 16)), jnp.zeros((2, 3, 16)), jnp.zeros(2, jnp.int32))
    with pytest.raises(Exception, match="layer=3 is outside"):
        jax.block_until_ready(write_kv_rows(cache, cache, jnp.int32(3), jnp.zeros((2, 2, 16)), jnp.zeros((2, 2, 16)),
                                            jnp.zeros(2, jnp.int32)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swapping_blocks_in_writes_only_those_blocks_and_never_converts_the_cache(dtype):
    # The swap-in path (`scatter_blocks`) had the bf16 scatter's whole-cache convert too: the cpu form's
    # block write goes row by row through the C++ write.
    from jaxcb.kernels.attention.cache import SWAP_CHUNK, gather_blocks

    scatter_blocks = cpu_form().write_blocks_fn

    rng = np.random.default_rng(0)
    shape = (3, 2, 40, 8, 16)
    cache = KVCache(jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape), dtype))
    before_k, before_v = np.asarray(cache.k, np.float32), np.asarray(cache.v, np.float32)
    src = jnp.arange(1, SWAP_CHUNK + 1, dtype=jnp.int32)  # blocks 1..16 out, back into 21..35 and the null block
    dst = jnp.concatenate([jnp.arange(21, 21 + SWAP_CHUNK - 1, dtype=jnp.int32), jnp.zeros(1, jnp.int32)])
    k, v = gather_blocks(cache, src)
    text = scatter_blocks.lower(cache, dst, k, v).compile().as_text()
    whole = [line for line in text.splitlines() if "[3,2,40,8,16]" in line and (" convert(" in line or " copy(" in line)]
    assert whole == []
    out = scatter_blocks(cache, dst, k, v)
    want_k, want_v = before_k.copy(), before_v.copy()
    for s, d in zip(np.asarray(src), np.asarray(dst)):
        want_k[:, :, d], want_v[:, :, d] = before_k[:, :, s], before_v[:, :, s]
    np.testing.assert_array_equal(np.asarray(out.k, np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(out.v, np.float32), want_v)


def test_the_cache_leaves_room_for_the_largest_steps_activations():
    from cuda_variants import preset
    from jaxcb.kv_cache import step_activation_bytes

    llama8b = preset("llama8b")
    reserve = step_activation_bytes(llama8b, max_num_tokens=2048, max_num_seqs=256)
    assert 1 * 2**30 < reserve < 3 * 2**30  # a few percent of an H200's 141 GB, never zero
    assert step_activation_bytes(llama8b, 2048, 256, tensor_parallel_size=8) < reserve
    bytes_per_block = TINY.kv_bytes_per_token(2) * 16
    plan = plan_kv_cache(
        CacheConfig(block_size=16, memory_fraction=0.5, dtype="bfloat16"), TINY, max_model_len=64, max_num_seqs=4,
        device=FakeGpu(limit=1000 * bytes_per_block, in_use=100 * bytes_per_block), pool_fraction=0.5,
        reserve_bytes=300 * bytes_per_block,
    )
    assert plan.num_blocks == 600
