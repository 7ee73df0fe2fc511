"""The 8-bit KV cache's kernels: every form that reads an int8 / fp8 cache equals the reference run on
the dequantized cache, on random ragged batches whose unused slots hold garbage (NaN where the dtype has
one), with sliding windows, soft-caps and head_dim 256; the write quantizes with saturation; swap copies
the raw bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attention_batches import make_ragged_batch
from jaxcb.config import ConfigError
from jaxcb.kernels.attention import REFERENCE, XLA, AttentionMetadata, KVCache, cpu_form, pallas_form
from jaxcb.kernels.attention.quantization import (
    QUANTIZED_CACHE_DTYPES, dequantize, quantize, quantized_max, scales_from_amax,
)
from jaxcb.kernels.attention.reference import ragged_paged_attention_reference
from jaxcb.kernels.attention.xla import ragged_paged_attention_xla
from jaxcb.kernels.attention import AttentionForm

SM_SCALE = 0.3
DTYPES = sorted(QUANTIZED_CACHE_DTYPES)  # fp8_e4m3, fp8_e5m2, int8
XLA_PAIRS = AttentionForm("xla-pairs", lambda *a, **kw: ragged_paged_attention_xla(*a, gather_max_width=0, **kw))
FORMS = {
    "reference": lambda: REFERENCE,
    "xla": lambda: XLA,
    "xla-pairs": lambda: XLA_PAIRS,  # the long-table path
    "pallas-interpret": lambda: pallas_form(interpret=True),
    "cpu": cpu_form,
}
# The pairs each form reads: the C++ kernel reads int8 (fp8 on CPU goes through xla, refused by name for cpu).
PAIRS = [(form, dtype) for form in FORMS for dtype in DTYPES if form != "cpu" or dtype == "int8"]


def quantized_cache(batch, dtype_name: str, seed: int = 0) -> tuple[KVCache, jnp.ndarray, jnp.ndarray]:
    """(the batch's K/V quantized with per-(layer, head) scales from their own range, the dequantized
    f32 K and V for the reference). Unused slots (NaN in the batch) hold NaN in fp8 and random bytes in
    int8, which has no NaN: no form may read either."""
    dtype = QUANTIZED_CACHE_DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    caches, scales = [], []
    for x in (batch.k_cache, batch.v_cache):
        amax = np.nanmax(np.abs(x), axis=(2, 3, 4))  # [L, Hkv]
        # A scale a little under the range: the largest values saturate, as they may in serving.
        scale = scales_from_amax(jnp.asarray(amax * 0.9), dtype)
        layers = [quantize(jnp.moveaxis(jnp.asarray(x[layer]), 0, -2), scale[layer], dtype) for layer in range(len(x))]
        q8 = np.array(jnp.moveaxis(jnp.stack(layers), -2, 1))
        unused = np.isnan(x)
        if dtype == jnp.int8:
            q8[unused] = rng.integers(-128, 128, unused.sum()).astype(np.int8)
        else:
            q8[unused] = np.asarray(np.nan, dtype)
        caches.append(jnp.asarray(q8))
        scales.append(scale)
    cache = KVCache(caches[0], caches[1], scales[0], scales[1])
    return cache, dequantize(cache.k, cache.k_scale), dequantize(cache.v, cache.v_scale)


# Each side as one jitted program, cached: op by op, every random batch's shapes compiled each op anew.
@functools.cache
def compiled_attend(form_name: str, static_kw: tuple):
    form = FORMS[form_name]()
    return jax.jit(lambda q, cache, layer, md, **traced: form.attend(q, cache, layer, md, SM_SCALE, **dict(static_kw),
                                                                     **traced))


@functools.cache
def compiled_reference(static_kw: tuple):
    return jax.jit(lambda *args, **traced: ragged_paged_attention_reference(*args, sm_scale=SM_SCALE,
                                                                            **dict(static_kw), **traced))


def attend_both(form_name, batch, dtype_name, q_dtype=jnp.float32, **kw):
    """(the form on the quantized cache, the reference on the dequantized one), f32 numpy."""
    [out], expected = attend_each([form_name], batch, dtype_name, q_dtype, **kw)
    return out, expected


def attend_each(form_names, batch, dtype_name, q_dtype=jnp.float32, **kw):
    """([each form on the quantized cache], the reference on the dequantized one), f32 numpy: the cache
    quantized and the reference run once for all the forms."""
    cache, k_ref, v_ref = quantized_cache(batch, dtype_name)
    q, _, _, kv_lens, tables, qsl, num_seqs, layer = batch.args(jnp)
    md = AttentionMetadata(jnp.zeros(q.shape[0], jnp.int32), qsl, kv_lens, tables, num_seqs)
    traced = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}  # a window; a softcap stays static
    static = tuple(sorted((k, v) for k, v in kw.items() if k not in traced))
    with jax.default_matmul_precision("highest"):
        outs = [compiled_attend(name, static)(q.astype(q_dtype), cache, layer, md, **traced) for name in form_names]
        expected = compiled_reference(static)(q, k_ref, v_ref, kv_lens, tables, qsl, num_seqs, layer, **traced)
    return [np.asarray(out.astype(jnp.float32)) for out in outs], np.asarray(expected)


def assert_matches(out, expected, batch, rtol, label=""):
    n = batch.num_real_tokens
    scale = np.abs(expected[:n]).max() + 1e-6
    err = np.abs(out[:n] - expected[:n]).max() / scale
    assert np.isfinite(out).all(), f"{label}garbage in unused slots reached the output"
    assert err <= rtol, f"{label}relative error {err:.2e} > {rtol} for {batch.seqs}"
    assert np.all(out[n:] == 0), f"{label}padding tokens must come back as 0"


@st.composite
def ragged_batches(draw, max_kv=40):
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        kv_len = draw(st.integers(1, max_kv))
        q_len = {"decode": 1, "prefill": kv_len}.get(kind) or draw(st.integers(1, kv_len))
        seqs.append((q_len, kv_len))
    return dict(seqs=seqs, block_size=draw(st.sampled_from([8, 16, 32])), num_kv_heads=draw(st.sampled_from([1, 2])),
                group=draw(st.sampled_from([1, 3])), head_dim=draw(st.sampled_from([16, 64])),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches())
def test_form_on_a_quantized_cache_equals_the_reference_on_the_dequantized_cache(dtype, params):
    """Every form that reads the dtype (PAIRS) on each drawn batch: the batch's shapes compile every program
    anew, the quantization's and the reference's once for all the forms."""
    batch = make_ragged_batch(**params)
    forms = [form for form, d in PAIRS if d == dtype]
    outs, expected = attend_each(forms, batch, dtype)
    for form, out in zip(forms, outs, strict=True):
        assert_matches(out, expected, batch, 1e-5, label=f"{form}: ")


MIXED = [(5, 5), (1, 23), (7, 30), (1, 9)]


@pytest.mark.parametrize("form, dtype", PAIRS)
# A window shorter than a block, a cap that bites, and Gemma 2's cap under a window that ends mid-block.
@pytest.mark.parametrize("window, softcap", [(3, None), (None, 5.0), (13, 50.0)])
def test_windowed_and_soft_capped_forms_read_a_quantized_cache(form, dtype, window, softcap):
    batch = make_ragged_batch(MIXED, block_size=8, num_kv_heads=2, group=3, head_dim=16, seed=3)
    batch.q *= 3  # scores of a few units: a cap of 5 bites
    kw = {"softcap": softcap} if softcap is not None else {}
    if window is not None:
        kw["window"] = jnp.int32(window)
    out, expected = attend_both(form, batch, dtype, **kw)
    assert_matches(out, expected, batch, 1e-5)


@pytest.mark.parametrize("form, dtype", [p for p in PAIRS if p[0] != "reference"])
def test_head_dim_256_forms_read_a_quantized_cache(form, dtype):
    batch = make_ragged_batch([(4, 4), (1, 19)], block_size=16, num_kv_heads=1, group=2, head_dim=256, seed=5)
    out, expected = attend_both(form, batch, dtype)
    assert_matches(out, expected, batch, 1e-5)


@pytest.mark.parametrize("form, dtype", [("xla", "int8"), ("pallas-interpret", "fp8_e4m3"), ("cpu", "int8")])
def test_a_bf16_model_reads_a_quantized_cache_within_bf16_rounding(form, dtype):
    batch = make_ragged_batch(MIXED, block_size=8, num_kv_heads=2, group=3, head_dim=16, seed=4)
    out, expected = attend_both(form, batch, dtype, q_dtype=jnp.bfloat16)
    assert_matches(out, expected, batch, 3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_write_saturates_to_the_dtypes_range_and_rounds(dtype):
    d = QUANTIZED_CACHE_DTYPES[dtype]
    top = quantized_max(d)
    scale = jnp.asarray([0.5, 2.0], jnp.float32)  # per KV head
    x = jnp.asarray([[[1e9, -1e9, 0.25 * top, 0.0], [1e9, -1e9, top * 0.5, -0.3]]], jnp.float32)  # [1, Hkv=2, D=4]
    y = np.asarray(quantize(x, scale, d).astype(jnp.float32))
    assert np.isfinite(y).all(), "saturation, never inf or NaN"
    np.testing.assert_array_equal(y[0, :, :2], [[top, -top], [top, -top]])
    back = np.asarray(dequantize(quantize(x, scale, d)[None].swapaxes(1, 2), scale[None]).swapaxes(1, 2))[0]
    # In range: the round trip is within half a step (int8: half the scale; fp8: half an ulp of 3 or 2 mantissa bits).
    x_in, err = 0.25 * top, abs(back[0, 0, 2] - 0.25 * top)
    assert err <= (0.5 * 0.5 if dtype == "int8" else x_in * (2.0**-4 if dtype == "fp8_e4m3" else 2.0**-3))
    if dtype == "int8":  # rounding to nearest: -0.3 / 2 = -0.15 -> 0
        assert y[0, 1, 3] == 0


@pytest.mark.parametrize("form, dtype", PAIRS)
def test_the_forms_write_quantizes_each_layers_rows_with_that_layers_scales(form, dtype):
    d = QUANTIZED_CACHE_DTYPES[dtype]
    rng = np.random.default_rng(0)
    shape = (2, 2, 4, 8, 16)  # [L, Hkv, NB, BS, D]
    k_scale = jnp.asarray([[0.01, 0.02], [0.03, 0.04]], jnp.float32)
    cache = KVCache(jnp.zeros(shape, d), jnp.zeros(shape, d), k_scale, k_scale * 2)
    k = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32)
    v = -k
    slots = jnp.asarray([8, 9, 10, 17, 40], jnp.int32)  # 40 is outside the cache: dropped
    out = FORMS[form]().write(cache, jnp.int32(1), k, v, slots)
    assert out.k_scale is cache.k_scale and out.v_scale is cache.v_scale, "the write keeps the scales"
    for got, x, scale in ((out.k, k, k_scale[1]), (out.v, v, k_scale[1] * 2)):
        rows = np.asarray(got[1].reshape(2, -1, 16)[:, [8, 9, 10, 17]].swapaxes(0, 1))  # [4, Hkv, D]
        np.testing.assert_array_equal(rows, np.asarray(quantize(x[:4], scale, d)))
        assert not np.asarray(got[0].astype(jnp.float32)).any(), "layer 0 is untouched"


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_out_and_in_copy_the_raw_bytes_and_keep_the_scales(dtype):
    from jaxcb.kv_cache import HostBlocks

    d = QUANTIZED_CACHE_DTYPES[dtype]
    rng = np.random.default_rng(1)
    shape = (2, 2, 6, 8, 16)
    raw = rng.integers(-100, 100, shape).astype(np.int8)
    data = raw if d == jnp.int8 else raw.view(np.uint8).astype(np.uint8) % 0x78  # finite fp8 bit patterns
    k = jnp.asarray(data).view(d) if d != jnp.int8 else jnp.asarray(data)
    scales = np.full((2, 2), 0.5, np.float32)
    for write_blocks in [None] + ([cpu_form().write_blocks_fn] if dtype == "int8" else []):
        cache = KVCache(k, k, jnp.asarray(scales), jnp.asarray(scales * 3))
        space = HostBlocks(cache, 4, *([write_blocks] if write_blocks else []))
        space.swap_out(cache, [(2, 1), (5, 3)])
        # The swap-in donates the cache it writes into, scales and all: they come back in its result.
        empty = KVCache(jnp.zeros(shape, d), jnp.zeros(shape, d), jnp.asarray(scales), jnp.asarray(scales * 3))
        back = space.swap_in(empty, [(1, 4), (3, 1)])
        assert back.k.dtype == d and back.k_scale is not None
        got, want = np.asarray(back.k).view(np.uint8), np.asarray(k).view(np.uint8)
        np.testing.assert_array_equal(got[:, :, 4], want[:, :, 2])
        np.testing.assert_array_equal(got[:, :, 1], want[:, :, 5])
        np.testing.assert_array_equal(np.asarray(back.v_scale), scales * 3)


def test_an_fp8_cache_is_refused_by_the_cpu_kernel_naming_what_works():
    with pytest.raises(ConfigError, match=r"cache\.dtype=fp8_e4m3 cannot be read by attention\.impl=cpu .*int8.*"
                                          r"attention\.impl=xla"):
        cpu_form().check_cache_dtype(QUANTIZED_CACHE_DTYPES["fp8_e4m3"])
    cpu_form().check_cache_dtype(jnp.int8)  # int8 it reads


@pytest.mark.parametrize("form", ["xla", "cpu", "pallas-interpret"])
def test_write_and_attend_under_shard_map_in_a_layer_scan_carries_the_scales(form):
    """As the model calls it under tensor parallelism: a jitted scan over layers, the cache (buffers and
    scales, split by KV head) carried by the scan through shard_map."""
    from jax.sharding import Mesh

    from jaxcb.sharding import TP_AXIS

    attention = FORMS[form]().with_mesh(Mesh(np.array(jax.devices()[:1]), (TP_AXIS,)))
    batch = make_ragged_batch(MIXED, block_size=8, num_kv_heads=2, group=3, head_dim=16, seed=6, num_layers=3)
    cache, k_ref, v_ref = quantized_cache(batch, "int8")
    q, _, _, kv_lens, tables, qsl, num_seqs, _ = batch.args(jnp)
    md = AttentionMetadata(jnp.zeros(q.shape[0], jnp.int32), qsl, kv_lens, tables, num_seqs)  # writes: null block
    new_kv = jnp.zeros((q.shape[0], 2, 16), jnp.float32)

    @jax.jit
    def layers(cache):
        def layer_step(cache, layer):
            out, cache = attention.write_and_attend(q, new_kv, new_kv, cache, layer, md, SM_SCALE)
            return cache, out

        return jax.lax.scan(layer_step, cache, jnp.arange(3, dtype=jnp.int32))

    with jax.default_matmul_precision("highest"):
        cache_out, out = layers(cache)
        for layer in range(3):
            expected = ragged_paged_attention_reference(q, k_ref, v_ref, kv_lens, tables, qsl, num_seqs,
                                                        jnp.int32(layer), sm_scale=SM_SCALE)
            assert_matches(np.asarray(out[layer]), np.asarray(expected), batch, 1e-5)
    np.testing.assert_array_equal(np.asarray(cache_out.k_scale), np.asarray(cache.k_scale))


def quantized_kernel_calls(variant: str, dtype: str):
    """The Triton launches of the pallas form attending over an 8-bit cache, lowered for an abstract H200."""
    from cuda_variants import ENGINE_LLAMA8B, GEMMA2_9B
    from jaxcb.kernels.triton_calls import lower_for_gpu, triton_calls

    v = {"llama8b": ENGINE_LLAMA8B, "gemma2_9b": GEMMA2_9B}[variant]
    d = QUANTIZED_CACHE_DTYPES[dtype]
    q, cache, _, *rest = v.args(64, 16, 64)
    cache8 = jax.ShapeDtypeStruct(cache.shape, d)
    scales = jax.ShapeDtypeStruct(cache.shape[:2], jnp.float32)
    form = pallas_form()

    def attend(q, k8, v8, k_scale, v_scale, kv_lens, tables, qsl, num_seqs, layer, *window):
        md = AttentionMetadata(jnp.zeros(q.shape[0], jnp.int32), qsl, kv_lens, tables, num_seqs)
        md = form.prepare_step(md, q.shape[0], v.group, v.block_size)
        return form.attend(q, KVCache(k8, v8, k_scale, v_scale), layer, md, v.head_dim**-0.5,
                           *(window or (None,)), softcap=v.softcap)

    return v, triton_calls(lower_for_gpu(attend, q, cache8, cache8, scales, scales, *rest))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["llama8b", "gemma2_9b"])
def test_the_pallas_kernel_lowers_for_an_h200_reading_an_8_bit_cache(variant, dtype):
    """On a GPU the kernel's K/V operands are the 8-bit cache itself (no widened copy before the launch):
    lowered for an abstract H200, with the engine's launches (and Gemma 2's window, soft-cap, head dim 256)."""
    v, calls = quantized_kernel_calls(variant, dtype)
    assert [c.name for c in calls] == ["ragged_paged_attention_decode", "ragged_paged_attention_prefill"]
    element = {"int8": "i8", "fp8_e4m3": "f8E4M3FN", "fp8_e5m2": "f8E5M2"}[dtype]
    for call in calls:
        assert call.operand_types[5].endswith(f"x{v.head_dim}x{element}>"), call.operand_types
        assert call.operand_types[4].endswith("xbf16>"), "q stays in the model's dtype"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["llama8b", "gemma2_9b"])
def test_the_8_bit_cache_kernel_compiles_for_sm90a_without_spills(variant, dtype):
    """Through Triton's compiler and ptxas (tests/test_triton_resources.py's toolchain): the widening in
    registers costs no spill and stays within the H200's registers and shared memory."""
    import os

    if os.environ.get("JAXCB_REQUIRE_TRITON") != "1":
        pytest.importorskip("triton")
    from jaxcb.kernels.triton_calls import MAX_REGISTERS, MAX_SHARED_BYTES, ptxas_resources

    _, calls = quantized_kernel_calls(variant, dtype)
    for call in calls:
        r = ptxas_resources(call)
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (call.name, r)
        assert 0 < r.registers <= MAX_REGISTERS and r.shared_bytes <= MAX_SHARED_BYTES, (call.name, r)
        print(variant, dtype, call.name, r.registers, r.shared_bytes)
