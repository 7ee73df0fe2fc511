"""The C++ packed-weight matmul kernels compute x @ w (and the fused q/k/v, MLP and LM-head forms)
for every shape, in float32 and with bf16 weights on every bf16 path this CPU runs, and refuse what
they cannot multiply. The backend that runs them: test_backends.py."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxcb.model.llama as llama
from jaxcb.kernels.attention.cpu import write_kv_rows
from jaxcb.kernels.packed_matmul import (
    MlpLora, pack_columns, pack_gate_up, packed_matmul, packed_matmul_argmax, packed_mlp, packed_qkv, pair_rows,
)

matmul = jax.jit(packed_matmul, static_argnums=2)
XLA_DEFAULT_OPTIMISATION = {"xla_backend_optimization_level": 3}  # XLA's own default, which the suite lowers
mlp = jax.jit(packed_mlp, static_argnums=3)


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ w.astype(np.float64)).astype(np.float32)


# Rows past one 6-row tile and one 96-row block, K shorter and longer than a panel's prefetch spread, N off the
# 16-column panels.
@pytest.mark.parametrize("m,k,n", [(1, 8, 16), (5, 7, 5), (6, 300, 33), (13, 768, 1280), (97, 513, 47), (200, 64, 17)])
def test_packed_matmul_equals_x_at_w(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), pack_columns(jnp.asarray(w)), n)), reference(x, w),
                               rtol=1e-4, atol=1e-4 * np.sqrt(k))


@settings(deadline=None, max_examples=25)
@given(m=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_packed_matmul_equals_x_at_w_for_any_shape(m, k, n, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), pack_columns(jnp.asarray(w)), n)), reference(x, w),
                               rtol=1e-4, atol=1e-4 * np.sqrt(k))


def mlp_reference(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g, u = x.astype(np.float64) @ gate, x.astype(np.float64) @ up
    with np.errstate(over="ignore"):
        h = g / (1.0 + np.exp(-g)) * u
    return (h @ down).astype(np.float32)


def check_mlp(m: int, k: int, f: int, n: int, seed: int, scale: float = 1.0) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32) * scale
    gate, up = rng.standard_normal((k, f), np.float32), rng.standard_normal((k, f), np.float32)
    down = rng.standard_normal((f, n), np.float32)
    y = mlp(jnp.asarray(x), pack_gate_up(jnp.asarray(gate), jnp.asarray(up)), pack_columns(jnp.asarray(down)), n)
    expected = mlp_reference(x, gate, up, down)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-4 * np.sqrt(k * f) * max(scale, 1.0) ** 2)


# The fused SwiGLU MLP: F off the 16-column panels (a last pair of part-filled panels), rows past
# a tile and a 96-row block, N off the panels; large |gate| exercises both sides of the sigmoid.
@pytest.mark.parametrize("m,k,f,n,scale", [(1, 8, 16, 16, 1.0), (5, 7, 5, 3, 1.0), (13, 64, 40, 33, 1.0),
                                           (97, 96, 24, 47, 1.0), (64, 768, 2048, 768, 0.05), (7, 16, 33, 20, 30.0)])
def test_packed_mlp_equals_silu_gate_times_up_then_down(m, k, f, n, scale):
    check_mlp(m, k, f, n, seed=m + k + f + n, scale=scale)


@settings(deadline=None, max_examples=25)
@given(m=st.integers(1, 30), k=st.integers(1, 80), f=st.integers(1, 70), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_packed_mlp_equals_silu_gate_times_up_then_down_for_any_shape(m, k, f, n, seed):
    check_mlp(m, k, f, n, seed)


def rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight


# Rows in more than one chunk and one 96-row block; K off the pack's 64-wide blocks.
@pytest.mark.parametrize("m,k,n", [(1, 8, 16), (13, 70, 33), (100, 129, 20)])
def test_packed_matmul_normalises_x_and_adds_the_residual_when_asked(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x, w = rng.standard_normal((m, k), np.float32) * 3, rng.standard_normal((k, n), np.float32)
    norm, residual = rng.standard_normal(k, np.float32), rng.standard_normal((m, n), np.float32)
    args = jnp.asarray(x), pack_columns(jnp.asarray(w)), n
    tol = dict(rtol=1e-4, atol=1e-4 * np.sqrt(k))
    normed = rms_norm_reference(x, norm, 1e-5)
    np.testing.assert_allclose(np.asarray(packed_matmul(*args, norm=jnp.asarray(norm), eps=1e-5)), normed @ w, **tol)
    np.testing.assert_allclose(np.asarray(packed_matmul(*args, residual=jnp.asarray(residual))), x @ w + residual,
                               **tol)
    both = packed_matmul(*args, norm=jnp.asarray(norm), eps=1e-5, residual=jnp.asarray(residual))
    np.testing.assert_allclose(np.asarray(both), normed @ w + residual, **tol)
    # The model's own rms_norm, to the float32 rounding of both.
    ours = packed_matmul(*args, norm=jnp.asarray(norm), eps=1e-5)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(llama.rms_norm(jnp.asarray(x), jnp.asarray(norm), 1e-5) @ w),
                               **tol)


def test_packed_mlp_normalises_x_and_adds_the_residual_when_asked():
    rng = np.random.default_rng(7)
    m, k, f, n = 13, 40, 36, 40
    x = rng.standard_normal((m, k), np.float32)
    gate, up = rng.standard_normal((k, f), np.float32), rng.standard_normal((k, f), np.float32)
    down, norm = rng.standard_normal((f, n), np.float32), rng.standard_normal(k, np.float32)
    y = packed_mlp(jnp.asarray(x), pack_gate_up(jnp.asarray(gate), jnp.asarray(up)), pack_columns(jnp.asarray(down)), n,
                   norm=jnp.asarray(norm), eps=1e-6, residual=jnp.asarray(x))
    expected = x + mlp_reference(rms_norm_reference(x, norm, 1e-6).astype(np.float32), gate, up, down)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-3 * np.sqrt(k * f))


# small's heads; more rows than one block of items; heads of one 32-column strip; GQA groups of 3
# with a head_dim off the 16-column panels; one KV head per q head.
@pytest.mark.parametrize("t,k,hq,hkv,d", [(64, 768, 12, 4, 64), (100, 64, 4, 2, 32), (40, 48, 5, 1, 32),
                                          (13, 40, 6, 2, 10), (1, 16, 2, 2, 8)])
@pytest.mark.parametrize("cache_dtype,weight_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                                      (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("with_addend", [False, True])
def test_packed_qkv_is_the_projection_rope_and_cache_write_bit_for_bit(t, k, hq, hkv, d, cache_dtype, weight_dtype,
                                                                       with_addend):
    """With an addend (multi-LoRA's updates), it is added to the projection on the rows it names, before
    rope and the write; the other rows' addend is never read (NaN here)."""
    rng = np.random.default_rng(t + k + d)
    n = (hq + 2 * hkv) * d
    h = jnp.asarray(rng.standard_normal((t, k), np.float32))
    w = jnp.asarray(rng.standard_normal((k, n), np.float32), weight_dtype)
    norm = jnp.asarray(rng.standard_normal(k, np.float32))
    angles = rng.standard_normal((t, d // 2)).astype(np.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    shape = (3, hkv, 40, 4, d)  # slots [0, 160)
    k_cache = jnp.asarray(rng.standard_normal(shape), cache_dtype)
    v_cache = jnp.asarray(rng.standard_normal(shape), cache_dtype)
    slots = rng.permutation(160)[:t].astype(np.int32)
    slots[0] = -1 if t > 1 else slots[0]  # padding: never written
    slots[-1] = 160 if t > 2 else slots[-1]
    slots, layer, packed = jnp.asarray(slots), jnp.int32(1), pack_columns(w)
    rows = np.where(np.arange(t) % 2 == 0, 3, -1).astype(np.int32)
    addend = np.where(rows[:, None] >= 0, rng.standard_normal((t, n)), np.nan).astype(np.float32)
    addend, rows = (jnp.asarray(addend), jnp.asarray(rows)) if with_addend else (None, None)

    def separately(h, k_cache, v_cache):
        y = packed_matmul(h, packed, n, norm=norm, eps=1e-5)
        if with_addend:
            y = jnp.where(rows[:, None] >= 0, y + addend, y)
        q, kk, v = y[:, : hq * d], y[:, hq * d : (hq + hkv) * d], y[:, (hq + hkv) * d :]
        q, kk = llama.apply_rope(q.reshape(t, hq, d), cos, sin), llama.apply_rope(kk.reshape(t, hkv, d), cos, sin)
        return (q, *write_kv_rows(k_cache, v_cache, layer, kk, v.reshape(t, hkv, d), slots))

    def in_one_call(h, k_cache, v_cache):
        return packed_qkv(h, packed, norm, 1e-5, cos, sin, k_cache, v_cache, layer, slots, hq, addend, rows)

    # XLA's rope at its default optimisation, as an engine compiles it (tests/conftest.py lowers it for the
    # suite): the kernel matches the multiply-adds LLVM contracts there.
    want = jax.jit(separately, compiler_options=XLA_DEFAULT_OPTIMISATION)(h, k_cache, v_cache)
    got = jax.jit(in_one_call)(h, k_cache, v_cache)
    assert got[0].shape == (t, hq, d) and got[1].dtype == got[2].dtype == cache_dtype
    for g, e in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))


@pytest.mark.parametrize("weight_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("real", [0, 1, 16, 17, 44])
def test_the_kernels_compute_only_the_real_rows_and_leave_zeros_past_them(weight_dtype, real):
    """With `real_rows` each kernel computes what a call on the real rows alone computes, bit for bit;
    the padding rows after them come out zero, and their K/V rows are not written."""
    m, k, n, f, hq, hkv, d = 44, 64, 40, 48, 4, 2, 16
    rng = np.random.default_rng(real)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    norm = jnp.asarray(rng.standard_normal(k, np.float32))
    residual = jnp.asarray(rng.standard_normal((m, n), np.float32))
    w = pack(jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.1, weight_dtype))
    gate_up = pack_pairs(*(jnp.asarray(rng.standard_normal((k, f), np.float32) * 0.1, weight_dtype) for _ in "gu"))
    down = pack(jnp.asarray(rng.standard_normal((f, n), np.float32) * 0.1, weight_dtype))
    count = jnp.int32(real)

    def check(padded, alone, width):
        padded, alone = np.asarray(padded).reshape(m, width), np.asarray(alone).reshape(real, width)
        np.testing.assert_array_equal(padded[:real], alone)
        assert not padded[real:].any()

    check(packed_matmul(x, w, n, norm=norm, eps=1e-5, residual=residual, real_rows=count),
          packed_matmul(x[:real], w, n, norm=norm, eps=1e-5, residual=residual[:real]), n)
    check(packed_mlp(x, gate_up, down, n, norm=norm, eps=1e-5, residual=residual, real_rows=count),
          packed_mlp(x[:real], gate_up, down, n, norm=norm, eps=1e-5, residual=residual[:real]), n)
    # The LM head: the logits as above, and the padding rows' argmax 0, whether the logits are written or not.
    logits, argmax = packed_matmul_argmax(x, w, n, True, real_rows=count)
    logits_alone, argmax_alone = packed_matmul_argmax(x[:real], w, n, True)
    check(logits, logits_alone, n)
    np.testing.assert_array_equal(np.asarray(argmax), np.pad(np.asarray(argmax_alone), (0, m - real)))
    np.testing.assert_array_equal(np.asarray(packed_matmul_argmax(x, w, n, False, real_rows=count)[1]), argmax)
    qkv_n = (hq + 2 * hkv) * d
    wq = pack(jnp.asarray(rng.standard_normal((k, qkv_n), np.float32) * 0.1, weight_dtype))
    angles = rng.standard_normal((m, d // 2)).astype(np.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    shape = (2, hkv, 30, 2, d)  # 60 slots a layer, each row its own
    caches = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in "kv"]
    slots = jnp.asarray(rng.permutation(60)[:m].astype(np.int32))

    @jax.jit
    def qkv(h, slots, k_cache, v_cache, real_rows=None):
        return packed_qkv(h, wq, norm, 1e-5, cos[: h.shape[0]], sin[: h.shape[0]], k_cache, v_cache, jnp.int32(1),
                          slots, hq, real_rows=real_rows)

    q, *padded_caches = qkv(x, slots, *caches, real_rows=count)
    q_alone, *alone_caches = qkv(x[:real], slots[:real], *caches)
    check(q, q_alone, hq * d)
    for padded, alone in zip(padded_caches, alone_caches):  # the padding rows' slots untouched
        np.testing.assert_array_equal(np.asarray(padded, np.float32), np.asarray(alone, np.float32))


def test_packed_qkv_rejects_what_it_cannot_write():
    h, cos = jnp.ones((2, 8), jnp.float32), jnp.ones((2, 4), jnp.float32)
    cache, slots, packed = jnp.zeros((3, 1, 5, 4, 8)), jnp.zeros(2, jnp.int32), pack_columns(jnp.ones((8, 32)))
    with pytest.raises(ValueError, match="float32"):
        packed_qkv(h.astype(jnp.bfloat16), packed, None, 0.0, cos, cos, cache, cache, jnp.int32(0), slots, 2)
    with pytest.raises(ValueError, match="does not match"):
        # w holds 2 q heads + 2 KV heads' columns, not 3 + 2
        packed_qkv(h, packed, None, 0.0, cos, cos, cache, cache, jnp.int32(0), slots, 3)
    with pytest.raises(ValueError, match=r"must be \[2, 4\]"):
        packed_qkv(h, packed, None, 0.0, cos[:, :3], cos[:, :3], cache, cache, jnp.int32(0), slots, 2)
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        half = cache.astype(jnp.float16)
        packed_qkv(h, packed, None, 0.0, cos, cos, half, half, jnp.int32(0), slots, 2)
    with pytest.raises(Exception, match="layer=3 is outside"):
        jax.block_until_ready(packed_qkv(h, packed, None, 0.0, cos, cos, cache, cache, jnp.int32(3), slots, 2))


def test_the_optional_inputs_must_fit():
    x, packed = jnp.ones((3, 8), jnp.float32), pack_columns(jnp.ones((8, 5), jnp.float32))
    with pytest.raises(ValueError, match="rms-norm weight must be float32 \\[8\\]"):
        packed_matmul(x, packed, 5, norm=jnp.ones(7, jnp.float32))
    with pytest.raises(ValueError, match="residual must be float32"):
        packed_matmul(x, packed, 5, residual=jnp.ones((3, 4), jnp.float32))


def test_pack_gate_up_pairs_each_gate_panel_with_the_same_columns_of_up():
    gate = jnp.arange(3 * 20, dtype=jnp.float32).reshape(3, 20)
    up = -gate
    pairs = np.asarray(pack_gate_up(gate, up))
    assert pairs.shape == (4, 3, 16)
    np.testing.assert_array_equal(pairs[0::2], np.asarray(pack_columns(gate)))
    np.testing.assert_array_equal(pairs[1::2], np.asarray(pack_columns(up)))


def test_packed_mlp_rejects_what_it_cannot_multiply():
    x = jnp.ones((2, 8), jnp.float32)
    gate_up, down = pack_gate_up(jnp.ones((8, 20)), jnp.ones((8, 20))), pack_columns(jnp.ones((20, 5)))
    with pytest.raises(ValueError, match="float32"):
        packed_mlp(x.astype(jnp.bfloat16), gate_up, down, 5)
    with pytest.raises(ValueError, match="do not match"):
        packed_mlp(jnp.ones((2, 9), jnp.float32), gate_up, down, 5)
    with pytest.raises(ValueError, match="do not match"):
        packed_mlp(x, gate_up, pack_columns(jnp.ones((16, 5))), 5)
    with pytest.raises(ValueError, match="same shape"):
        pack_gate_up(jnp.ones((8, 20)), jnp.ones((8, 21)))


def test_packed_matmul_keeps_leading_axes_and_writes_every_output_row():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 24), np.float32))
    w = jnp.asarray(np.random.default_rng(1).standard_normal((24, 40), np.float32))
    # A NaN-filled output buffer would leak through any row or column the kernel skipped.
    y = jax.jit(lambda x, p: packed_matmul(x, p, 40) + jnp.zeros((2, 3, 40)))(x, pack_columns(w))
    np.testing.assert_allclose(np.asarray(y), reference(np.asarray(x).reshape(6, 24), np.asarray(w)).reshape(2, 3, 40),
                               rtol=1e-5, atol=1e-5)


def test_pack_columns_round_trips_and_pads_with_zeros():
    w = jnp.arange(5 * 21, dtype=jnp.float32).reshape(5, 21)
    packed = pack_columns(w)
    assert packed.shape == (2, 5, 16)
    unpacked = np.asarray(packed).transpose(1, 0, 2).reshape(5, 32)[:, :21]
    np.testing.assert_array_equal(unpacked, np.asarray(w))
    assert not np.asarray(packed[1, :, 5:]).any()


def test_packed_matmul_rejects_what_it_cannot_multiply():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="float32.*backend=xla"):
        packed_matmul(x.astype(jnp.bfloat16), pack_columns(jnp.ones((8, 16))), 16)
    with pytest.raises(ValueError, match="does not match"):
        packed_matmul(x, pack_columns(jnp.ones((9, 16))), 16)
    with pytest.raises(ValueError, match="does not match"):
        packed_matmul(x, pack_columns(jnp.ones((8, 16))), 40)


# --- bf16 weights ---------------------------------------------------------------------------------

from jaxcb.kernels import cpu as cpu_kernels  # noqa: E402
from jaxcb.kernels.packed_matmul import packed_matmul_argmax  # noqa: E402


@pytest.fixture(params=list(cpu_kernels.BF16_MATMUL_PATHS.values()))
def bf16_path(request):
    """Each bf16 path in turn, where this CPU's build has it and it runs here (widening: everywhere).
    Where it cannot run (not built for this CPU, or built but its probe fails: it would raise SIGILL),
    nothing is skipped: the fixture checks that the kernels never take it and hands the test the path
    start-up fell back to, which is what a user of this CPU runs. The chosen path is restored after."""
    chosen = cpu_kernels.bf16_matmul_path()
    code = {v: k for k, v in cpu_kernels.BF16_MATMUL_PATHS.items()}[request.param]
    built = request.param in cpu_kernels.bf16_matmul_paths_built()
    if not built or cpu_kernels._time_path(str(cpu_kernels.build_library()), code) is None:
        assert chosen != request.param  # start-up's probe kept it out
        if not built:
            assert cpu_kernels.select_bf16_matmul(request.param) == chosen  # a path not built is never selected
        yield chosen
        return
    assert cpu_kernels.select_bf16_matmul(request.param) == request.param
    yield request.param
    cpu_kernels.select_bf16_matmul(chosen)


pack = jax.jit(pack_columns)  # one compiled program a shape, not an executable an op
pack_pairs = jax.jit(pack_gate_up)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """a rounded to bf16 (to nearest even, by ml_dtypes on the host), as float64."""
    return np.asarray(a).astype(jnp.bfloat16).astype(np.float64)


def bf16_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What float32 accumulation may lose on x @ w of bf16 values (exact products): a few float32
    roundings of the sum of the products' magnitudes."""
    return 2.0 ** -20 * (np.abs(x) @ np.abs(w)) * max(8, np.sqrt(x.shape[-1])) + 1e-30


# Rows past one 12-row tile (AMX: 16) and one 96-row block (AMX: 384, so 400 rows make a block of
# 24 chunks and one of 1; from 8 chunks on x's AMX tiles load with the streaming hint), in pairs of
# AMX chunks and one left over (33: 11 + 11 and 11; 64: two pairs of 16), K off the 32 rows of a pair
# panel (odd too), N off the panels (a last strip of one panel). 64 and 400 rows make whole 16-row AMX
# tiles: stored straight into the output, and with a residual starting from it; 400's last strip is
# not whole and takes the buffered store and the residual pass.
@pytest.mark.parametrize("m,k,n", [(1, 8, 16), (5, 7, 5), (13, 70, 33), (29, 576, 130), (33, 64, 48), (64, 96, 160),
                                   (100, 129, 20), (400, 40, 50)])
def test_bf16_weights_multiply_as_a_float32_sum_of_bf16_products_on_every_path(bf16_path, m, k, n):
    rng = np.random.default_rng(m + k + n)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    residual = rng.standard_normal((m, n), np.float32)
    packed = pack(w.astype(jnp.bfloat16))
    assert packed.dtype == jnp.uint32 and packed.shape == (-(-n // 16), -(-k // 32) * 16, 16)
    got = np.asarray(matmul(jnp.asarray(x), packed, n))  # x is rounded to bf16 on its way in
    xb, wb = to_bf16(x), to_bf16(w)
    assert np.all(np.abs(got - xb @ wb) <= bf16_bound(xb, wb))
    got = np.asarray(packed_matmul(jnp.asarray(x), packed, n, residual=jnp.asarray(residual)))
    assert np.all(np.abs(got - (xb @ wb + residual)) <= bf16_bound(xb, wb) + 2.0 ** -22 * np.abs(residual))
    y, argmax = packed_matmul_argmax(jnp.asarray(x), packed, n, True)  # the LM head in bf16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(matmul(jnp.asarray(x), packed, n)))
    np.testing.assert_array_equal(np.asarray(argmax), np.asarray(y).argmax(-1))


@pytest.mark.parametrize("m,k,f,n", [(1, 8, 16, 16), (5, 7, 5, 3), (13, 64, 40, 33), (30, 100, 70, 40),
                                     (100, 64, 48, 40), (400, 32, 40, 24)])
def test_bf16_mlp_is_silu_gate_times_up_rounded_to_bf16_then_down_on_every_path(bf16_path, m, k, f, n):
    rng = np.random.default_rng(m + k + f + n)
    x = rng.standard_normal((m, k), np.float32)
    gate, up, down = (rng.standard_normal(shape, np.float32) for shape in ((k, f), (k, f), (f, n)))
    got = np.asarray(mlp(jnp.asarray(x), pack_pairs(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)),
                         pack(down.astype(jnp.bfloat16)), n))
    xb, gb, ub, db = map(to_bf16, (x, gate, up, down))
    g, u = xb @ gb, xb @ ub
    h = g / (1.0 + np.exp(-g)) * u  # the kernel rounds h to bf16 for down: a bf16 step's worth of freedom
    bound = bf16_bound(np.abs(h), np.abs(db)) + 2.0 ** -8 * (np.abs(h) @ np.abs(db))
    assert np.all(np.abs(got - h @ db) <= bound)
    assert np.abs(got - to_bf16(h) @ db).max() < np.abs(got - h @ db).max() + 1e-6  # it is h's bf16 that is used


def test_a_bf16_path_that_does_not_run_here_falls_back_with_a_log_line(monkeypatch, caplog):
    chosen = cpu_kernels.bf16_matmul_path()
    times = {1: 5000.0, 2: None, 3: None}  # dot products and AMX built but killed or wrong in the child
    monkeypatch.setattr(cpu_kernels, "_time_path", lambda library, code: times.get(code, 1000.0))
    monkeypatch.setattr(cpu_kernels.load_cpu_kernels(), "JaxcbBf16MatmulPaths", lambda: 0b1110)
    cpu_kernels.bf16_matmul_path.cache_clear()
    try:
        with caplog.at_level("INFO", logger="jaxcb.kernels.cpu"):
            assert cpu_kernels.bf16_matmul_path() == "widen"
        assert "the avx512-bf16 bf16 matmul is built for this CPU but does not run right here" in caplog.text
        assert "the amx bf16 matmul is built" in caplog.text and "CPU bf16 matmul: bf16 weights widened" in caplog.text
    finally:
        cpu_kernels.bf16_matmul_path.cache_clear()
        monkeypatch.undo()
        cpu_kernels.select_bf16_matmul(chosen)


def test_widening_runs_on_any_cpu_and_is_timed_in_a_child_process():
    library = str(cpu_kernels.build_library())
    assert "widen" in cpu_kernels.bf16_matmul_paths_built()
    assert cpu_kernels._time_path(library, 1) > 0 and cpu_kernels._time_path(library, 0) > 0  # 0: float32's tile
    assert cpu_kernels._time_path(library, 7) is None  # no such path: the child says so, the parent carries on


def panel_blocks(b_side: np.ndarray, num_pairs: int) -> np.ndarray:
    """[S, R, f] -> [S, num_pairs, R, 16]: a gate or up B side cut into its panels, zero past f."""
    s, r, f = b_side.shape
    padded = np.zeros((s, r, num_pairs * 16), b_side.dtype)
    padded[:, :, :f] = b_side
    return padded.reshape(s, r, num_pairs, 16).transpose(0, 2, 1, 3)


# Multi-LoRA inside the MLP: each row's gate/up update before the activation (its own slot's B blocks
# from its shrink u), down's shrink taken from the float32 activation. F off the panels; rows past a
# tile and an AMX chunk; rows of several slots in one tile (4-row runs of float32 FMAs), and runs of
# one slot with base rows among them (bf16 at rank 16 or 32 on AMX: one tile multiply a chunk, u in
# bf16); an odd rank; base rows exactly the plain call's.
@pytest.mark.parametrize("m,k,f,n,rank", [(1, 8, 16, 16, 5), (13, 64, 40, 33, 5), (100, 70, 48, 20, 5),
                                          (100, 70, 48, 20, 16), (70, 40, 40, 24, 32)])
def test_the_mlp_adds_each_rows_lora_update_before_its_activation_and_shrinks_it_for_down(bf16_path, m, k, f, n,
                                                                                           rank):
    rng = np.random.default_rng(m + k + f + rank)
    slots = 3
    x = rng.standard_normal((m, k), np.float32)
    gate, up, down = (rng.standard_normal(shape, np.float32) for shape in ((k, f), (k, f), (f, n)))
    residual = rng.standard_normal((m, n), np.float32)
    b_gate, b_up = (rng.standard_normal((slots, rank, f)).astype(np.float32) * 0.5 for _ in range(2))
    a_down = rng.standard_normal((slots, f, 16)).astype(np.float32) * 0.3
    u = rng.standard_normal((m, max(16, 2 * rank))).astype(np.float32)  # gate's shrink in [:R], up's in [R:2R]
    mixed = np.where(np.arange(m) % 3 == 1, -1, rng.integers(0, slots, m))
    runs = np.where(np.arange(m) % 7 == 3, -1, np.arange(m) // 20 % slots)  # 20 rows a slot
    row_slots = np.where(np.arange(m) < m // 2, runs, mixed).astype(np.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        gate_up, packed_down = pack_pairs(gate.astype(dtype), up.astype(dtype)), pack(down.astype(dtype))
        q = gate_up.shape[0] // 2
        blocks = np.stack([panel_blocks(b_gate, q), panel_blocks(b_up, q)], axis=2)
        blocks = blocks.reshape(slots, 2 * q, rank, 16)  # gate's panel q at 2q, up's at 2q + 1
        lora_b = jnp.asarray(blocks, dtype)
        if dtype == jnp.bfloat16:  # rank rows in pairs, as the cpu backend packs bf16 slots
            lora_b = pair_rows(lora_b)
        lora = MlpLora(jnp.asarray(row_slots), jnp.asarray(u), lora_b, jnp.asarray(a_down, dtype))
        y, down_u = packed_mlp(jnp.asarray(x), gate_up, packed_down, n, residual=jnp.asarray(residual), lora=lora)
        assert down_u.shape == (m, 16)
        round_ = to_bf16 if dtype == jnp.bfloat16 else (lambda a: np.asarray(a, np.float64))  # noqa: E731
        xb, gb, ub, db = map(round_, (x, gate, up, down))
        bg, bu, ad = round_(b_gate), round_(b_up), round_(a_down)
        mine = row_slots >= 0
        s_ = np.maximum(row_slots, 0)
        add_g = np.einsum("tr,trf->tf", u[:, :rank], bg[s_]) * mine[:, None]
        add_u = np.einsum("tr,trf->tf", u[:, rank : 2 * rank], bu[s_]) * mine[:, None]
        g, v = xb @ gb + add_g, xb @ ub + add_u
        h = g / (1.0 + np.exp(-g)) * v
        tol = 1e-4 * (np.abs(xb) @ (np.abs(gb) + np.abs(ub)) + 1) * (1 + np.abs(g))
        if dtype == jnp.bfloat16:  # u rounded to bf16 (AMX): each update term moves by up to 2^-9 of it
            tol = tol + 2.0 ** -8 * (np.abs(u[:, :rank]) @ np.abs(bg).max(0) + np.abs(u[:, rank:2 * rank]) @
                                     np.abs(bu).max(0)) * (1 + np.abs(g))
        want_d = np.einsum("tf,tfc->tc", h, ad[s_])
        bound = (np.abs(tol) + 1e-4 * np.abs(v)) @ np.abs(ad).max(0) + 1e-4 * np.abs(h) @ np.abs(ad).max(0)
        assert np.all(np.asarray(down_u)[~mine] == 0)  # rows without a slot: zeros, never undefined
        assert np.all(np.abs(np.asarray(down_u) - want_d)[mine] <= bound[mine] + 1e-4)
        # y from the activation as down reads it (bf16: rounded), the residual added
        expected = round_(h if dtype == jnp.float32 else to_bf16(h)) @ db + residual
        np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-3, atol=2e-3 * np.sqrt(f) * np.abs(h).max())
        # a base row gets the plain call's result, bit for bit
        plain = np.asarray(packed_mlp(jnp.asarray(x), gate_up, packed_down, n, residual=jnp.asarray(residual)))
        np.testing.assert_array_equal(np.asarray(y)[~mine], plain[~mine])


# A prefill's rows: 32 of one slot, then 32 of another, base rows among them, so that every chunk's
# rows share one slot: bf16 at rank 16 or 32 on AMX adds gate/up's update as one tile multiply a
# chunk (u in bf16), elsewhere in float32 runs.
@pytest.mark.parametrize("rank", [16, 32])
def test_the_mlps_lora_on_chunks_of_one_slot_is_within_bf16_rounding_of_the_reference(bf16_path, rank):
    rng = np.random.default_rng(rank)
    m, k, f, n, slots = 64, 64, 96, 32, 2
    x = rng.standard_normal((m, k), np.float32)
    gate, up = (rng.standard_normal((k, f), np.float32) * 0.2 for _ in range(2))
    down = rng.standard_normal((f, n), np.float32)
    b_gate, b_up = (rng.standard_normal((slots, rank, f)).astype(np.float32) * 0.3 for _ in range(2))
    a_down = rng.standard_normal((slots, f, 16)).astype(np.float32) * 0.3
    u = rng.standard_normal((m, 2 * rank)).astype(np.float32)
    row_slots = np.where(np.arange(m) % 5 == 2, -1, np.arange(m) // 32).astype(np.int32)
    gate_up, packed_down = pack_pairs(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)), pack(down.astype(jnp.bfloat16))
    q = gate_up.shape[0] // 2
    blocks = np.stack([panel_blocks(b_gate, q), panel_blocks(b_up, q)], axis=2).reshape(slots, 2 * q, rank, 16)
    lora = MlpLora(jnp.asarray(row_slots), jnp.asarray(u), pair_rows(jnp.asarray(blocks, jnp.bfloat16)),
                   jnp.asarray(a_down, jnp.bfloat16))
    y, down_u = packed_mlp(jnp.asarray(x), gate_up, packed_down, n, lora=lora)
    xb, gb, ub, db, bg, bu, ad = map(to_bf16, (x, gate, up, down, b_gate, b_up, a_down))
    mine, s_ = row_slots >= 0, np.maximum(row_slots, 0)
    g = xb @ gb + np.einsum("tr,trf->tf", u[:, :rank], bg[s_]) * mine[:, None]
    v = xb @ ub + np.einsum("tr,trf->tf", u[:, rank:], bu[s_]) * mine[:, None]
    h = g / (1.0 + np.exp(-g)) * v
    # bf16 rounding of x, u and the activation moves each product by ~2^-8 of it at most: 2% of the sum
    # of their magnitudes is room for that, and far less than a lost or misplaced tile's share.
    want_d = np.einsum("tf,tfc->tc", h, ad[s_])
    scale_d = np.einsum("tf,tfc->tc", np.abs(h), np.abs(ad[s_]))
    assert np.all(np.abs(np.asarray(down_u) - want_d)[mine] <= 0.02 * scale_d[mine])
    want_y = h @ db
    assert np.all(np.abs(np.asarray(y) - want_y) <= 0.02 * (np.abs(h) @ np.abs(db)))


def test_the_mlp_refuses_lora_operands_that_do_not_fit():
    x = jnp.ones((3, 8), jnp.float32)
    gate_up, down = pack_pairs(jnp.ones((8, 20)), jnp.ones((8, 20))), pack(jnp.ones((20, 4)))
    ok = MlpLora(jnp.zeros((3,), jnp.int32), jnp.zeros((3, 16)), jnp.zeros((2, 4, 5, 16)), jnp.zeros((2, 20, 16)))
    assert packed_mlp(x, gate_up, down, 4, lora=ok)[1].shape == (3, 16)
    with pytest.raises(ValueError, match="do not fit 3 rows, 4 gate/up panels and F=20"):
        packed_mlp(x, gate_up, down, 4, lora=ok._replace(gate_up_b=jnp.zeros((2, 6, 5, 16))))
    with pytest.raises(ValueError, match="do not fit"):
        packed_mlp(x, gate_up, down, 4, lora=ok._replace(down_a=jnp.zeros((2, 24, 16))))
    with pytest.raises(ValueError, match="do not fit"):
        packed_mlp(x, gate_up, down, 4, lora=ok._replace(gate_up_u=jnp.zeros((3, 8))))
    with pytest.raises(Exception, match="names LoRA slot 2 of 2"):
        jax.block_until_ready(packed_mlp(x, gate_up, down, 4, lora=ok._replace(slots=jnp.asarray([0, 2, -1]))))
