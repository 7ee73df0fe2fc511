"""Every ragged paged-attention implementation equals the reference, and the reference equals dense attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attention_batches import RaggedBatch, blocks_outside_every_window, dense_attention, make_ragged_batch
from jaxcb.kernels.attention import NO_WINDOW
from jaxcb.kernels.attention.cpu import ragged_paged_attention_cpu
from jaxcb.kernels.attention.inputs import check_batch_values
from jaxcb.kernels.attention.pallas import ragged_paged_attention
from jaxcb.kernels.attention.reference import ragged_paged_attention_reference
from jaxcb.kernels.attention.xla import ragged_paged_attention_xla

SM_SCALE = 0.3
IMPLS = {
    "reference": ragged_paged_attention_reference,
    "xla": ragged_paged_attention_xla,
    "xla-pairs": functools.partial(ragged_paged_attention_xla, gather_max_width=0),  # the long-table path
    "pallas-interpret": functools.partial(ragged_paged_attention, interpret=True),
    "cpu": ragged_paged_attention_cpu,
}


@st.composite
def ragged_batches(draw, max_kv=40):
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    num_seqs = draw(st.integers(1, 4))
    seqs = []
    for _ in range(num_seqs):
        kv_len = draw(st.integers(1, max_kv))  # often ends mid-block
        if kind == "decode":
            q_len = 1
        elif kind == "prefill":
            q_len = kv_len
        else:
            q_len = draw(st.integers(1, kv_len))
        seqs.append((q_len, kv_len))
    return dict(
        seqs=seqs,
        block_size=draw(st.sampled_from([8, 16, 32, 64])),
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 3, 4])),
        head_dim=draw(st.sampled_from([16, 64])),
        seed=draw(st.integers(0, 2**16)),
    )


@functools.cache
def compiled(impl, static_kw: tuple):
    """The implementation as one jitted program (op by op, the reference took ~6x as long on each random
    batch, whose shapes compile every op anew); array arguments (a window) traced, the rest static."""
    return jax.jit(lambda *args, **traced: IMPLS[impl](*args, sm_scale=SM_SCALE, **dict(static_kw), **traced))


def run(impl, batch, dtype=jnp.float32, **kw):
    traced = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
    static = tuple(sorted((k, v) for k, v in kw.items() if k not in traced))
    with jax.default_matmul_precision("highest"):
        return np.asarray(compiled(impl, static)(*batch.args(jnp, dtype), **traced).astype(jnp.float32))


def assert_matches(out, expected, batch, rtol, label=""):
    n = batch.num_real_tokens
    scale = np.abs(expected[:n]).max() + 1e-6
    err = np.abs(out[:n] - expected[:n]).max() / scale
    assert err <= rtol, f"{label}relative error {err:.2e} > {rtol} for {batch.seqs}"
    assert np.all(out[n:] == 0), f"{label}padding tokens must come back as 0"


# The random-batch tests check every implementation on each drawn batch: each batch's shapes compile
# every program anew, the reference's once for all the implementations.
OTHER_IMPLS = ["xla", "xla-pairs", "pallas-interpret", "cpu"]


def assert_each_matches(impls, batch, expected, rtol, dtype=jnp.float32, **kw):
    for impl in impls:
        assert_matches(run(impl, batch, dtype, **kw), expected, batch, rtol, label=f"{impl}: ")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_batches())
def test_reference_equals_dense_attention(params):
    batch = make_ragged_batch(**params)
    assert_matches(run("reference", batch), dense_attention(batch, SM_SCALE), batch, 1e-5)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches())
def test_implementation_equals_reference_in_fp32(params):
    batch = make_ragged_batch(**params)
    assert_each_matches(OTHER_IMPLS, batch, run("reference", batch), 1e-5)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches(max_kv=160))
def test_split_kv_kernel_equals_the_reference(params):
    """Split-KV: each (query tile, KV head)'s context in num_splits shares (some empty), merged after."""
    batch = make_ragged_batch(**params)
    expected = run("reference", batch)
    for num_splits in (2, 3, 8):
        assert_matches(run("pallas-interpret", batch, num_splits=num_splits), expected, batch, 1e-5,
                       label=f"{num_splits} splits: ")


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches(max_kv=24))
def test_implementation_equals_reference_in_bf16(params):
    batch = make_ragged_batch(**params)
    assert_each_matches(OTHER_IMPLS, batch, run("reference", batch, jnp.bfloat16), 2e-2, jnp.bfloat16)


@pytest.mark.parametrize("impl", ["pallas-interpret", "cpu"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_kernel_covers_every_block_size_and_head_dim(impl, block_size, head_dim):
    seqs = [(1, 37), (9, 9), (4, 70)]
    batch = make_ragged_batch(seqs, block_size=block_size, num_kv_heads=2, group=4, head_dim=head_dim, seed=block_size)
    assert_matches(run(impl, batch), dense_attention(batch, SM_SCALE), batch, 1e-5)


@pytest.mark.parametrize("head_dim", [12, 20])
def test_cpu_kernel_handles_head_dims_off_its_8_wide_vectors(head_dim):
    seqs = [(1, 37), (9, 9), (4, 70)]
    batch = make_ragged_batch(seqs, block_size=16, num_kv_heads=2, group=3, head_dim=head_dim, seed=head_dim)
    assert_matches(run("cpu", batch), dense_attention(batch, SM_SCALE), batch, 1e-5)


@pytest.mark.parametrize("q_dtype,cache_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
def test_cpu_kernel_reads_a_cache_whose_dtype_differs_from_q(q_dtype, cache_dtype):
    """An f32 model may keep a bf16 cache (`cache.dtype=bfloat16`): the kernel reads the cache's
    values as f32 and answers in q's dtype, as the reference does with the same values in f32."""
    batch = make_ragged_batch([(1, 37), (9, 9), (4, 70)], block_size=16, num_kv_heads=2, group=3, head_dim=64, seed=5)
    q, k, v, *rest = batch.args(jnp)
    q, k, v = q.astype(q_dtype), k.astype(cache_dtype), v.astype(cache_dtype)
    out = ragged_paged_attention_cpu(q, k, v, *rest, sm_scale=SM_SCALE)
    assert out.dtype == q_dtype
    with jax.default_matmul_precision("highest"):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        expected = np.asarray(compiled("reference", ())(*f32, *rest))
    assert_matches(np.asarray(out.astype(jnp.float32)), expected, batch, 1e-5 if q_dtype == jnp.float32 else 1e-2)


def test_cpu_kernel_tiles_long_prefills_and_skips_empty_sequences():
    """Prefills longer than one 16-token tile, a chunk in the middle of a long context, and a
    sequence with no new tokens this step (it must neither attend nor write)."""
    seqs = [(40, 40), (1, 130), (0, 12), (33, 100), (1, 1)]
    batch = make_ragged_batch(seqs, block_size=16, num_kv_heads=2, group=3, head_dim=64, seed=7)
    assert_matches(run("cpu", batch), dense_attention(batch, SM_SCALE), batch, 1e-5)


def test_cpu_kernel_rejects_metadata_that_points_outside_the_cache():
    """Inside jit nothing checks block ids; the kernel refuses them instead of reading out of bounds."""
    batch = make_ragged_batch([(2, 20)], block_size=8, num_kv_heads=1, group=1, head_dim=16)
    q, k, v, kv_lens, tables, qsl, n, layer = batch.args(jnp)
    bad_tables = tables.at[0, 1].set(k.shape[2] + 5)
    with pytest.raises(Exception, match="block id .* is outside the cache"):
        jax.block_until_ready(ragged_paged_attention_cpu(q, k, v, kv_lens, bad_tables, qsl, n, layer, sm_scale=1.0))
    with pytest.raises(Exception, match="must be >= its new tokens and fit its block table"):
        jax.block_until_ready(
            ragged_paged_attention_cpu(q, k, v, kv_lens.at[0].set(10_000), tables, qsl, n, layer, sm_scale=1.0)
        )


@pytest.mark.parametrize("impl", ["xla", "xla-pairs"])
@pytest.mark.parametrize("tokens_per_tile", [1, 2, 16])
def test_xla_path_is_exact_for_any_query_tile(impl, tokens_per_tile):
    batch = make_ragged_batch([(1, 5), (17, 40), (3, 3)], block_size=8, num_kv_heads=2, group=3, head_dim=16)
    assert_matches(run(impl, batch, tokens_per_tile=tokens_per_tile), dense_attention(batch, SM_SCALE), batch, 1e-5)


def test_xla_pairs_path_reads_only_the_context_each_sequence_has():
    """One long sequence among short ones, in chunks smaller than the real pairs: every chunk
    boundary and every tile's partial softmax must combine exactly."""
    seqs = [(1, 300)] + [(1, n) for n in (3, 17, 40, 9, 64, 1, 33)] + [(24, 50)]
    batch = make_ragged_batch(seqs, block_size=8, num_kv_heads=2, group=2, head_dim=16, seed=3)
    for chunk in (None, 5, 16):  # one chunk, and chunk boundaries inside a tile's pairs
        assert_matches(run("xla-pairs", batch, pairs_per_chunk=chunk), dense_attention(batch, SM_SCALE), batch, 1e-5)


def test_validation_names_the_bad_argument():
    batch = make_ragged_batch([(2, 5)], block_size=8, num_kv_heads=2, group=2, head_dim=16)
    q, k, v, kv_lens, tables, qsl, n, layer = batch.args(jnp)
    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="num_q_heads=3 must be a multiple of num_kv_heads=2"):
            impl(q[:, :3], k, v, kv_lens, tables, qsl, n, layer, sm_scale=1.0)
        with pytest.raises(ValueError, match="kv_lens must be int32"):
            impl(q, k, v, kv_lens.astype(jnp.float32), tables, qsl, n, layer, sm_scale=1.0)
        with pytest.raises(ValueError, match=r"query_start_loc must be \[3\]"):
            impl(q, k, v, kv_lens, tables, qsl[:2], n, layer, sm_scale=1.0)
        if impl is not ragged_paged_attention_cpu:  # the CPU kernel reads either cache dtype with either q
            with pytest.raises(ValueError, match="q dtype bfloat16 must equal the cache dtype float32"):
                impl(q.astype(jnp.bfloat16), k, v, kv_lens, tables, qsl, n, layer, sm_scale=1.0)
        with pytest.raises(ValueError, match="k_cache dtype bfloat16 must equal v_cache dtype float32"):
            impl(q, k.astype(jnp.bfloat16), v, kv_lens, tables, qsl, n, layer, sm_scale=1.0)


def test_batch_value_checks_catch_what_jit_cannot():
    batch = make_ragged_batch([(2, 20)], block_size=8, num_kv_heads=1, group=1, head_dim=16)
    kw = dict(num_tokens=batch.q.shape[0], num_blocks=batch.k_cache.shape[2], block_size=8)
    check_batch_values(batch.kv_lens, batch.block_tables, batch.query_start_loc, batch.num_seqs, **kw)
    too_long = batch.kv_lens.copy()
    too_long[0] = 8 * batch.block_tables.shape[1] + 1
    with pytest.raises(ValueError, match="do not fit a block table"):
        check_batch_values(too_long, batch.block_tables, batch.query_start_loc, batch.num_seqs, **kw)
    bad_table = batch.block_tables.copy()
    bad_table[0, 0] = 999
    with pytest.raises(ValueError, match="block_tables entries"):
        check_batch_values(batch.kv_lens, bad_table, batch.query_start_loc, batch.num_seqs, **kw)


def _form(name: str):
    from jaxcb.kernels.attention import REFERENCE, XLA, cpu_form, pallas_form

    if name == "cpu":  # built with the system compiler, as every other cpu test here builds it
        return cpu_form()
    return {"reference": REFERENCE, "xla": XLA, "pallas-interpret": pallas_form(interpret=True)}[name]


@pytest.mark.parametrize("b_first", [False, True], ids=["writer-first", "reader-first"])
@pytest.mark.parametrize("form", ["reference", "xla", "cpu", "pallas-interpret"])
def test_a_sequence_attends_to_blocks_another_sequence_writes_in_the_same_step(form, b_first):
    """The attention protocol's invariant (prefix hits within a step rely on it): in each layer every
    row's K/V write lands before any row reads the cache. Sequence A prefills 20 tokens into blocks
    1, 2, 3; sequence B's table starts with A's blocks 1 and 2 (a prefix it found in the cache while
    A's step was being built) and B computes its own 5 tokens after them, into block 4. Before the
    step those blocks hold NaN; B must attend to A's fresh K/V, in either row order."""
    from jaxcb.kernels.attention import REFERENCE, AttentionMetadata, KVCache
    from jaxcb.kernels.attention.cache import scatter_kv_rows

    bs, num_kv_heads, group, head_dim, num_layers, layer = 8, 2, 3, 16, 2, 1
    rng = np.random.default_rng(11)
    seqs = {"a": dict(table=[1, 2, 3], start=0, q_len=20), "b": dict(table=[1, 2, 4], start=16, q_len=5)}
    order = ["b", "a"] if b_first else ["a", "b"]
    slots, tables, kv_lens, qsl = [], [], [], [0]
    for name in order:
        s = seqs[name]
        pos = np.arange(s["start"], s["start"] + s["q_len"])
        slots += list(np.asarray(s["table"])[pos // bs] * bs + pos % bs)
        tables.append(s["table"] + [0])
        kv_lens.append(s["start"] + s["q_len"])
        qsl.append(qsl[-1] + s["q_len"])
    num_tokens, pad = qsl[-1], 3
    slots += [0] * pad  # padding writes go to the null block
    tables.append([0] * 4)
    kv_lens.append(0)
    qsl.append(num_tokens)
    shape = (num_layers, num_kv_heads, 6, bs, head_dim)
    cache = KVCache(jnp.full(shape, jnp.nan, jnp.float32), jnp.full(shape, jnp.nan, jnp.float32))
    q = jnp.asarray(rng.standard_normal((num_tokens + pad, num_kv_heads * group, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((num_tokens + pad, num_kv_heads, head_dim)), jnp.float32) for _ in "kv")
    md = AttentionMetadata(jnp.asarray(slots, jnp.int32), jnp.asarray(qsl, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                           jnp.asarray(tables, jnp.int32), jnp.int32(2))
    with jax.default_matmul_precision("highest"):
        # The ground truth: the reference attending over a cache that already holds every new K/V.
        filled = scatter_kv_rows(cache, jnp.int32(layer), k, v, md.slot_mapping)
        expected = np.asarray(REFERENCE.attend(q, filled, jnp.int32(layer), md, SM_SCALE))
        out, new_cache = _form(form).write_and_attend(q, k, v, cache, jnp.int32(layer), md, SM_SCALE)
    out = np.asarray(out)
    assert np.isfinite(out[:num_tokens]).all(), "a row read a slot that was not written yet"
    scale = np.abs(expected[:num_tokens]).max()
    assert np.abs(out[:num_tokens] - expected[:num_tokens]).max() / scale <= 1e-5
    for c, f in ((new_cache.k, filled.k), (new_cache.v, filled.v)):  # the step's writes, in every block
        np.testing.assert_array_equal(np.asarray(c)[layer, :, 1:], np.asarray(f)[layer, :, 1:])


# --- sliding window ------------------------------------------------------------------------------

WINDOWED_BATCHES = {
    "decode": [(1, 5), (1, 40), (1, 77), (1, 130), (1, 2)],
    "prefill": [(70, 70), (33, 33), (5, 5), (17, 17)],
    # long prefills, a chunk in the middle of a context, decodes, a sequence with no new tokens
    "mixed": [(70, 70), (1, 130), (0, 12), (33, 100), (1, 1), (4, 64), (5, 31), (1, 96)],
}
# (window, block size): shorter than a block, not a multiple of the block size, longer than every context
WINDOWS = [(3, 8), (3, 16), (37, 8), (37, 16), (1000, 16)]


def windowed_batch(kind: str, block_size: int, seed: int = 0, **kw):
    return make_ragged_batch(WINDOWED_BATCHES[kind], block_size=block_size, num_kv_heads=2, group=3, head_dim=16,
                             seed=seed, **kw)


@pytest.mark.parametrize("window, block_size", WINDOWS)
@pytest.mark.parametrize("kind", sorted(WINDOWED_BATCHES))
def test_reference_with_a_window_equals_dense_attention(kind, window, block_size):
    batch = windowed_batch(kind, block_size)
    expected = dense_attention(batch, SM_SCALE, window=window)
    assert_matches(run("reference", batch, window=jnp.int32(window)), expected, batch, 1e-5)


@pytest.mark.parametrize("window, block_size", WINDOWS)
@pytest.mark.parametrize("kind", sorted(WINDOWED_BATCHES))
@pytest.mark.parametrize("impl", ["xla", "xla-pairs", "pallas-interpret", "cpu"])
def test_implementation_with_a_window_equals_the_reference(impl, kind, window, block_size):
    batch = windowed_batch(kind, block_size, seed=window)
    expected = run("reference", batch, window=jnp.int32(window))
    assert_matches(run(impl, batch, window=jnp.int32(window)), expected, batch, 1e-5)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches(max_kv=100), window=st.integers(1, 120))
def test_implementation_with_a_window_equals_the_reference_on_random_batches(params, window):
    batch = make_ragged_batch(**params)
    expected = run("reference", batch, window=jnp.int32(window))
    assert_each_matches(OTHER_IMPLS, batch, expected, 1e-5, window=jnp.int32(window))


@pytest.mark.parametrize("window", [3, 37])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_kernel_shares_the_windows_range_and_equals_the_reference(num_splits, window):
    """Split-KV shares divide the KV tiles in the window (some shares empty), merged after the call."""
    batch = windowed_batch("mixed", 8, seed=num_splits)
    expected = run("reference", batch, window=jnp.int32(window))
    assert_matches(run("pallas-interpret", batch, num_splits=num_splits, window=jnp.int32(window)), expected, batch,
                   1e-5)


@pytest.mark.parametrize("impl", ["xla", "xla-pairs", "pallas-interpret", "cpu"])
def test_implementation_with_a_window_in_bf16_equals_the_reference(impl):
    batch = windowed_batch("mixed", 16, seed=4)
    expected = run("reference", batch, jnp.bfloat16, window=jnp.int32(37))
    assert_matches(run(impl, batch, jnp.bfloat16, window=jnp.int32(37)), expected, batch, 2e-2)


@pytest.mark.parametrize("block_size, head_dim", [(8, 64), (16, 64), (64, 128), (16, 12)],
                         ids=["avx2-8-keys", "avx512-16-keys", "avx512-block-64", "scalar"])
@pytest.mark.parametrize("window", [1, 3, 37])
def test_cpu_kernel_windows_on_each_of_its_vector_paths(block_size, head_dim, window):
    """The C++ kernel scores keys 8 or 16 at a time (or one by one where head_dim is off its vectors): a
    window that starts inside such a group masks the keys before it and never reads their values."""
    batch = make_ragged_batch(WINDOWED_BATCHES["mixed"], block_size=block_size, num_kv_heads=2, group=3,
                              head_dim=head_dim, seed=head_dim)
    assert_matches(run("cpu", batch, window=jnp.int32(window)), dense_attention(batch, SM_SCALE, window=window),
                   batch, 1e-5)


@pytest.mark.parametrize("impl", ["reference", "xla", "xla-pairs", "pallas-interpret", "cpu"])
def test_a_window_of_no_window_equals_no_window(impl):
    """NO_WINDOW, what a model that mixes window and full layers passes to its full layers, is no window."""
    batch = windowed_batch("mixed", 8, seed=2)
    np.testing.assert_allclose(run(impl, batch, window=jnp.int32(NO_WINDOW)), run(impl, batch), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window, block_size", [(3, 8), (37, 8), (3, 16), (37, 16)])
@pytest.mark.parametrize("impl", ["reference", "xla", "xla-pairs", "pallas-interpret", "cpu"])
def test_blocks_wholly_outside_every_window_never_reach_the_output(impl, window, block_size):
    """The blocks before the window of each sequence's first new token hold NaN in K and V (as stale
    blocks never freed may hold anything): whole KV tiles of them are skipped, and where one shares a
    KV tile with keys in the window (the Pallas kernel reads 32 keys a tile), it is masked like the
    slots past kv_len. The output is finite and the reference's over the same cache without NaN."""
    batch = windowed_batch("mixed", block_size, seed=window)
    expected = run("reference", batch, window=jnp.int32(window))
    outside = blocks_outside_every_window(batch, window)
    assert len(outside) >= 10  # whole KV tiles of the long sequences, for every block size here
    batch.k_cache[:, :, outside] = np.nan
    batch.v_cache[:, :, outside] = np.nan
    out = run(impl, batch, window=jnp.int32(window))
    assert np.isfinite(out).all(), "a block outside every window reached the output"
    assert_matches(out, expected, batch, 1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["no softcap", "softcap"])
@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["one-device", "shard_map"])
@pytest.mark.parametrize("form", ["reference", "xla", "cpu", "pallas-interpret"])
def test_write_and_attend_takes_a_traced_window_per_layer_in_a_layer_scan(form, tensor_parallel, softcap):
    """As a model with sliding-window layers calls it: a jitted scan over layers, each layer's window an
    i32[] carried by the scan (NO_WINDOW for a full layer), under shard_map replicated like the layer; and as
    Gemma 2 calls it, with one static softcap for every layer."""
    from jax.sharding import Mesh

    from jaxcb.kernels.attention import REFERENCE, AttentionMetadata, KVCache
    from jaxcb.sharding import TP_AXIS

    attention = _form(form)
    if tensor_parallel:  # one device: the shard_map's specs, not a split, are what this checks
        attention = attention.with_mesh(Mesh(np.array(jax.devices()[:1]), (TP_AXIS,)))
    batch = windowed_batch("mixed", 8, seed=6, num_layers=3)
    q, k_cache, v_cache, kv_lens, tables, qsl, num_seqs, _ = batch.args(jnp)
    k_cache, v_cache = jnp.nan_to_num(k_cache), jnp.nan_to_num(v_cache)  # the write below fills no slot
    md = AttentionMetadata(jnp.zeros(q.shape[0], jnp.int32), qsl, kv_lens, tables, num_seqs)
    windows = jnp.asarray([5, NO_WINDOW, 37], jnp.int32)
    rng = np.random.default_rng(0)
    new_k, new_v = (jnp.asarray(rng.standard_normal((q.shape[0], 2, 16)), jnp.float32) for _ in "kv")

    @jax.jit
    def layers(cache):
        def layer_step(cache, x):
            layer, window = x
            out, cache = attention.write_and_attend(q, new_k, new_v, cache, layer, md, SM_SCALE, window=window,
                                                    softcap=softcap)
            return cache, out

        return jax.lax.scan(layer_step, cache, (jnp.arange(3, dtype=jnp.int32), windows))[1]

    with jax.default_matmul_precision("highest"):
        out = np.asarray(layers(KVCache(k_cache, v_cache)))  # new K/V go to the null block: the cache is unchanged
        for layer, window in enumerate([5, NO_WINDOW, 37]):
            expected = np.asarray(REFERENCE.attend(q, KVCache(k_cache, v_cache), jnp.int32(layer), md, SM_SCALE,
                                                   window=jnp.int32(window), softcap=softcap))
            assert_matches(out[layer], expected, batch, 1e-5)


# --- logit soft-capping (Gemma 2) ----------------------------------------------------------------

# Gemma 2's cap, and one that bites: q scaled so that scores reach +-10 (`capped_batch`).
SOFTCAPS = [50.0, 5.0]


def capped_batch(kind: str, block_size: int = 8, seed: int = 0, head_dim: int = 16, **kw):
    """A windowed-test batch with q x 3: scores of a few units, some past 5, so that a cap of 5 bites."""
    batch = make_ragged_batch(WINDOWED_BATCHES[kind], block_size=block_size, num_kv_heads=2, group=3,
                              head_dim=head_dim, seed=seed, **kw)
    batch.q *= 3
    return batch


def window_arg(window):
    return {} if window is None else {"window": jnp.int32(window)}


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("kind", sorted(WINDOWED_BATCHES))
def test_reference_with_a_softcap_equals_dense_attention(kind, softcap, window):
    batch = capped_batch(kind)
    expected = dense_attention(batch, SM_SCALE, window=window, softcap=softcap)
    assert_matches(run("reference", batch, softcap=softcap, **window_arg(window)), expected, batch, 1e-5)


def test_a_softcap_of_5_bites_and_one_of_50_barely_does():
    """The capped batches really exercise the cap: at 5 the output moves by a good part of its scale, at 50
    (Gemma 2's) by far less, but by more than the tests' tolerance."""
    batch = capped_batch("mixed", seed=1)
    n = batch.num_real_tokens
    plain = run("reference", batch)
    scale = np.abs(plain[:n]).max()
    moved = {c: np.abs(run("reference", batch, softcap=c)[:n] - plain[:n]).max() / scale for c in SOFTCAPS}
    assert moved[5.0] > 0.2 and 1e-3 < moved[50.0] < moved[5.0], moved


# The cap is a static float: each value compiles each form anew. 5 bites on every batch kind, with and
# without a window; Gemma 2's 50 (barely biting, the same code) on the mixed batch.
CAPPED_CASES = [(kind, 5.0, window) for kind in sorted(WINDOWED_BATCHES) for window in (None, 37)] + [("mixed", 50.0, None)]


@pytest.mark.parametrize("kind, softcap, window", CAPPED_CASES)
@pytest.mark.parametrize("impl", ["xla", "xla-pairs", "pallas-interpret", "cpu"])
def test_implementation_with_a_softcap_equals_the_reference(impl, kind, softcap, window):
    batch = capped_batch(kind, seed=int(softcap))
    expected = run("reference", batch, softcap=softcap, **window_arg(window))
    assert_matches(run(impl, batch, softcap=softcap, **window_arg(window)), expected, batch, 1e-5)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches(max_kv=100), softcap=st.sampled_from([1.0, 5.0, 50.0]),
       window=st.one_of(st.none(), st.integers(1, 120)))
def test_implementation_with_a_softcap_equals_the_reference_on_random_batches(params, softcap, window):
    batch = make_ragged_batch(**params)
    batch.q *= 3
    expected = run("reference", batch, softcap=softcap, **window_arg(window))
    assert_each_matches(OTHER_IMPLS, batch, expected, 1e-5, softcap=softcap, **window_arg(window))


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_kernel_merges_capped_scores_and_equals_the_reference(num_splits, window):
    """Each split's running max is over capped scores, and the merge weighs the splits by them."""
    batch = capped_batch("mixed", seed=num_splits)
    expected = run("reference", batch, softcap=5.0, **window_arg(window))
    out = run("pallas-interpret", batch, num_splits=num_splits, softcap=5.0, **window_arg(window))
    assert_matches(out, expected, batch, 1e-5)


@pytest.mark.parametrize("impl", ["xla", "xla-pairs", "pallas-interpret", "cpu"])
def test_implementation_with_a_softcap_in_bf16_equals_the_reference(impl):
    batch = capped_batch("mixed", block_size=16, seed=4)
    expected = run("reference", batch, jnp.bfloat16, softcap=5.0, window=jnp.int32(37))
    assert_matches(run(impl, batch, jnp.bfloat16, softcap=5.0, window=jnp.int32(37)), expected, batch, 2e-2)


@pytest.mark.parametrize("impl", ["xla", "pallas-interpret", "cpu"])
def test_head_dim_256_with_a_softcap_and_a_window_equals_the_reference(impl):
    """Gemma 2's shapes in small: head dim 256, two query heads a KV head, its cap and a window."""
    batch = make_ragged_batch(WINDOWED_BATCHES["mixed"], block_size=16, num_kv_heads=2, group=2, head_dim=256,
                              seed=256)
    expected = dense_attention(batch, SM_SCALE, window=37, softcap=5.0)
    assert_matches(run(impl, batch, softcap=5.0, window=jnp.int32(37)), expected, batch, 1e-5)


@pytest.mark.parametrize("block_size, head_dim", [(8, 64), (16, 64), (64, 128), (16, 12)],
                         ids=["avx2-8-keys", "avx512-16-keys", "avx512-block-64", "scalar"])
@pytest.mark.parametrize("window", [None, 3])
def test_cpu_kernel_caps_on_each_of_its_vector_paths(block_size, head_dim, window):
    """The C++ kernel caps the scores where it scores them, 8 or 16 keys at a time or one by one, before
    it masks the keys outside the context or the window (NaN there, capped or not, never reaches the output)."""
    batch = make_ragged_batch(WINDOWED_BATCHES["mixed"], block_size=block_size, num_kv_heads=2, group=3,
                              head_dim=head_dim, seed=head_dim)
    batch.q *= 3
    expected = dense_attention(batch, SM_SCALE, window=window, softcap=5.0)
    assert_matches(run("cpu", batch, softcap=5.0, **window_arg(window)), expected, batch, 1e-5)


def softcap_probe(block_size: int, head_dim: int, scores: np.ndarray) -> RaggedBatch:
    """One decode sequence per score s, each seeing two keys of one shared block: key 0 scores 0 with value
    e1, key 1 scores s with value e2 (q = s / SM_SCALE e0, K1 = e0). Its output is then softmax([0, cap(s)])
    over [e1, e2], so log(out[2] / out[1]) = cap(s): the cap itself, read back through the kernel."""
    num = len(scores)
    shape = (1, 1, 2, block_size, head_dim)
    k_cache, v_cache = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    k_cache[0, 0, 1, :2] = 0.0
    k_cache[0, 0, 1, 1, 0] = 1.0
    v_cache[0, 0, 1, :2] = 0.0
    v_cache[0, 0, 1, 0, 1] = v_cache[0, 0, 1, 1, 2] = 1.0
    q = np.zeros((num, 1, head_dim), np.float32)
    q[:, 0, 0] = scores / SM_SCALE
    tables = np.ones((num, 1), np.int32)
    kv_lens = np.full(num, 2, np.int32)
    qsl = np.arange(num + 1, dtype=np.int32)
    return RaggedBatch(q, k_cache, v_cache, kv_lens, tables, qsl, num, 0, [(1, 2)] * num)


@pytest.mark.parametrize("block_size, head_dim", [(8, 64), (16, 64), (16, 12)],
                         ids=["avx2-8-keys", "avx512-16-keys", "scalar"])
@pytest.mark.parametrize("softcap", [5.0, 50.0])
def test_cpu_kernels_tanh_is_exact_to_a_millionth_on_each_vector_path(block_size, head_dim, softcap):
    """The C++ kernel's tanh is a rational approximation (vector_tanh.h), the same on every path: the cap
    it applies, read back through the kernel (`softcap_probe`), is within 1e-6 of softcap * tanh(s / softcap)
    (f64), relative to the larger of it and 1, from scores near 0 to far past the cap, of either sign."""
    magnitudes = np.geomspace(1e-3, 40 * softcap, 400)
    scores = np.concatenate([magnitudes, -magnitudes]).astype(np.float32)
    batch = softcap_probe(block_size, head_dim, scores)
    out = run("cpu", batch, softcap=softcap)[:, 0].astype(np.float64)
    capped = np.log(out[:, 2] / out[:, 1])
    expected = softcap * np.tanh(scores.astype(np.float64) / softcap)
    # The readback itself (two exps, a division, a log in f32) adds ~1e-7 of the larger of the two logits.
    err = np.abs(capped - expected) / np.maximum(np.abs(expected), 1.0)
    assert err.max() <= 1e-6, f"max error {err.max():.2e} at s={scores[err.argmax()]}"


@pytest.mark.parametrize("impl", ["reference", "xla", "xla-pairs", "pallas-interpret", "cpu"])
def test_softcap_none_lowers_exactly_the_program_without_it(impl):
    """No cap is no code: a model without one compiles what it compiled before soft-capping existed (the C++
    kernel's call carries no softcap attribute); a cap changes the program."""
    args = capped_batch("mixed").args(jnp)

    def lowered(**kw):
        return jax.jit(lambda *a: IMPLS[impl](*a, sm_scale=SM_SCALE, **kw)).lower(*args).as_text()

    plain = lowered()
    assert lowered(softcap=None) == plain
    assert lowered(softcap=5.0) != plain
    assert "softcap" not in plain


def test_softcap_is_refused_unless_a_positive_python_float():
    """A static number, never an array: a jitted form would refuse an array as an unhashable static argument,
    the others say what they take."""
    batch = make_ragged_batch([(2, 5)], block_size=8, num_kv_heads=2, group=2, head_dim=16)
    for impl in IMPLS.values():
        for bad in (0.0, -5.0, float("inf"), float("nan"), True):
            with pytest.raises(ValueError, match="softcap must be a positive Python float"):
                impl(*batch.args(jnp), sm_scale=1.0, softcap=bad)
        with pytest.raises((TypeError, ValueError), match="softcap|static"):
            impl(*batch.args(jnp), sm_scale=1.0, softcap=jnp.asarray(50.0))


def test_the_cpu_kernel_refuses_a_bad_softcap_or_an_unknown_attribute():
    """The FFI call's attributes: what jit-level checks never see (another caller of the target)."""
    from jaxcb.kernels.cpu import ATTENTION_TARGET

    batch = make_ragged_batch([(2, 5)], block_size=8, num_kv_heads=1, group=1, head_dim=16)
    q, k, v, kv_lens, tables, qsl, n, layer = batch.args(jnp)
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    args = (q, k, v, kv_lens, tables, qsl, jnp.reshape(n, ()), jnp.reshape(layer, ()))
    with pytest.raises(Exception, match="softcap=-1.0+ must be a positive float"):
        jax.block_until_ready(call(*args, sm_scale=np.float32(1.0), softcap=np.float32(-1.0)))
    with pytest.raises(Exception, match="unknown attribute soft_cap"):
        jax.block_until_ready(call(*args, sm_scale=np.float32(1.0), soft_cap=np.float32(5.0)))
