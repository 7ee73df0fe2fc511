"""Every ragged paged-attention implementation equals the reference, and the reference equals dense attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attention_batches import dense_attention, make_ragged_batch
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


def run(impl, batch, dtype=jnp.float32, **kw):
    with jax.default_matmul_precision("highest"):
        return np.asarray(IMPLS[impl](*batch.args(jnp, dtype), sm_scale=SM_SCALE, **kw).astype(jnp.float32))


def assert_matches(out, expected, batch, rtol):
    n = batch.num_real_tokens
    scale = np.abs(expected[:n]).max() + 1e-6
    err = np.abs(out[:n] - expected[:n]).max() / scale
    assert err <= rtol, f"relative error {err:.2e} > {rtol} for {batch.seqs}"
    assert np.all(out[n:] == 0), "padding tokens must come back as 0"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_batches())
def test_reference_equals_dense_attention(params):
    batch = make_ragged_batch(**params)
    assert_matches(run("reference", batch), dense_attention(batch, SM_SCALE), batch, 1e-5)


@pytest.mark.parametrize("impl", ["xla", "xla-pairs", "pallas-interpret", "cpu"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches())
def test_implementation_equals_reference_in_fp32(impl, params):
    batch = make_ragged_batch(**params)
    assert_matches(run(impl, batch), run("reference", batch), batch, 1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches(max_kv=160))
def test_split_kv_kernel_equals_the_reference(num_splits, params):
    """Split-KV: each (query tile, KV head)'s context in num_splits shares (some empty), merged after."""
    batch = make_ragged_batch(**params)
    assert_matches(run("pallas-interpret", batch, num_splits=num_splits), run("reference", batch), batch, 1e-5)


@pytest.mark.parametrize("impl", ["xla", "xla-pairs", "pallas-interpret", "cpu"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=ragged_batches(max_kv=24))
def test_implementation_equals_reference_in_bf16(impl, params):
    batch = make_ragged_batch(**params)
    expected = run("reference", batch, jnp.bfloat16)
    assert_matches(run(impl, batch, jnp.bfloat16), expected, batch, 2e-2)


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
        expected = np.asarray(ragged_paged_attention_reference(*f32, *rest, sm_scale=SM_SCALE))
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
