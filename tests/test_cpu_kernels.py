"""The C++ CPU kernels: built once per machine and source, chosen by attention.impl=auto on CPU,
and a clear fallback or error where they cannot be built."""

import ctypes
import dataclasses
import logging
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcb.kernels.cpu as cpu_kernels
from attention_batches import dense_attention
from jaxcb.kernels.attention.testing import make_ragged_batch, share_leading_blocks
from jaxcb.kernels.attention.cpu import ragged_paged_attention_cpu
from jaxcb.kernels.batched_lora import batched_lora, pack_lora_group, side_by_side
from jaxcb.kernels.packed_matmul import (
    MlpLora, pack_columns, pack_gate_up, packed_matmul, packed_matmul_argmax, packed_mlp, packed_qkv,
)
from jaxcb.kernels.row_argmax import row_argmax
from jaxcb.config import AttentionConfig, ConfigError
from jaxcb.kernels.attention import select_attention


def test_auto_picks_the_cpu_kernel_on_cpu_and_pallas_on_gpu():
    assert select_attention(AttentionConfig(impl="auto"), platform="cpu").name == "cpu"
    assert select_attention(AttentionConfig(impl="auto"), platform="gpu").name == "pallas"


def test_interpret_under_auto_where_auto_takes_no_pallas_kernel_is_said_to_be_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxcb.kernels.attention"):
        assert select_attention(AttentionConfig(impl="auto", interpret=True), platform="cpu").name == "cpu"
    assert "attention.interpret=true is not used: attention.impl=auto takes the cpu form on cpu" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxcb.kernels.attention"):
        assert select_attention(AttentionConfig(impl="auto", interpret=True), platform="gpu").name == "pallas-interpret"
    assert "not used" not in caplog.text


def test_auto_falls_back_to_xla_when_the_kernel_cannot_be_built(monkeypatch, caplog):
    def no_compiler():
        raise cpu_kernels.CpuKernelUnavailable("no C++ compiler found")

    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", no_compiler)
    with caplog.at_level(logging.INFO, logger="jaxcb.kernels.attention"):
        assert select_attention(AttentionConfig(impl="auto")).name == "xla"
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(ConfigError, match=r"(?s)attention.impl=cpu: no C\+\+ compiler found.*use attention.impl=xla"):
        select_attention(AttentionConfig(impl="cpu"))


def test_a_missing_compiler_is_named_in_the_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("JAXCB_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(cpu_kernels.CpuKernelUnavailable, match="no-such-compiler"):
        cpu_kernels.build_library()


def test_a_failed_build_says_why_and_leaves_no_library_behind(monkeypatch, tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (bad,))
    monkeypatch.setenv("JAXCB_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(cpu_kernels.CpuKernelUnavailable, match="building the CPU kernels failed"):
        cpu_kernels.build_library()
    assert list((tmp_path / "cache").iterdir()) == []


def fake_compiler_runs(monkeypatch) -> list:
    """Replace the compiles and the link (not `--version`) with ones that write empty files: what a test
    of the build's keying needs, without compiling every kernel again. Returns the builds run, each the
    list of its sources."""
    real_run, builds, compiled = subprocess.run, [], []

    def run(cmd, *args, **kwargs):
        if "--version" in cmd:
            return real_run(cmd, *args, **kwargs)
        if "-c" in cmd:
            compiled.append(cmd[cmd.index("-c") + 1])
        else:  # the link: one a build
            builds.append(sorted(compiled))
            compiled.clear()
        open(cmd[cmd.index("-o") + 1], "wb").close()
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cpu_kernels.subprocess, "run", run)
    return builds


def test_the_library_is_built_once_and_rebuilt_when_the_source_changes(monkeypatch, tmp_path):
    """Keyed builds, with the compile faked: every other test of the kernels runs a real build."""
    monkeypatch.setenv("JAXCB_KERNEL_CACHE", str(tmp_path))
    builds = fake_compiler_runs(monkeypatch)
    first = cpu_kernels.build_library()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build_library() == first and first.stat().st_mtime_ns == mtime
    assert builds == [sorted(str(f) for f in cpu_kernels.SOURCES)]  # every source compiled, once
    builds.clear()
    for i, source in enumerate(cpu_kernels.SOURCES):  # each source is part of the key
        changed = tmp_path / f"changed{i}.cc"
        changed.write_text(source.read_text() + "\n// changed\n")
        sources = list(cpu_kernels.SOURCES)
        sources[i] = changed
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "SOURCES", tuple(sources))
            assert cpu_kernels.build_library() != first
    assert len(builds) == len(cpu_kernels.SOURCES) and all(str(tmp_path / f"changed{i}.cc") in builds[i]
                                                           for i in range(len(builds)))
    assert [p.name for p in tmp_path.iterdir() if p.suffix not in (".so", ".cc")] == []  # no objects left behind


def test_sources_from_another_directory_build_their_own_library(monkeypatch, tmp_path):
    """`build_library(source_dir)` builds another revision's kernels (the A/B of
    `benchmarks/bench_kernels.py --against`): keyed by their content, like this package's."""
    monkeypatch.setenv("JAXCB_KERNEL_CACHE", str(tmp_path / "cache"))
    builds = fake_compiler_runs(monkeypatch)  # keyed builds: the compile itself is faked
    here = cpu_kernels.build_library()
    builds.clear()
    for name, suffix in (("same", ""), ("changed", "\n// changed\n")):
        (tmp_path / name).mkdir()
        for f in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
            (tmp_path / name / f.name).write_text(f.read_text() + (suffix if f.suffix == ".cc" else ""))
    assert cpu_kernels.build_library(tmp_path / "same") == here and builds == []
    assert cpu_kernels.build_library(tmp_path / "changed") != here
    assert builds == [sorted(str(tmp_path / "changed" / f.name) for f in cpu_kernels.SOURCES)]


def test_row_argmax_gives_jnp_argmax_indices_for_ties_infinities_nans_and_ragged_widths():
    """The greedy token on CPU comes from the C++ row argmax: it must pick exactly what
    jnp.argmax picks -- the first of equal maxima, the first NaN of a row that has one --
    for widths below, at and off its 8-wide vectors."""
    rng = np.random.default_rng(0)
    for rows, width in ((1, 1), (3, 7), (2, 8), (4, 9), (5, 33), (64, 32000)):
        x = rng.standard_normal((rows, width)).astype(np.float32)
        np.testing.assert_array_equal(row_argmax(jnp.asarray(x)), np.argmax(x, axis=-1))
    x = np.zeros((7, 40), np.float32)
    x[1, [5, 30]] = 2.0  # a tie: the first
    x[2, :] = -np.inf  # all -inf: index 0
    x[3, [3, 17]] = 5.0, np.nan  # a NaN beats any number
    x[4, [2, 39]] = np.nan  # the first NaN
    x[5, [9, 33]] = np.inf
    x[6, 37] = 1.0  # in the tail past the last full vector
    got = np.asarray(jax.jit(row_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got, [0, 5, 0, 17, 2, 9, 37])
    with pytest.raises(ValueError, match="float32"):
        row_argmax(jnp.zeros((2, 3), jnp.bfloat16))


def test_matmul_argmax_gives_the_product_and_jnp_argmax_of_it_with_or_without_writing_it():
    """The LM head of an all-greedy step takes its argmax inside the matmul and writes no logits:
    the indices must be jnp.argmax's over the product (ties, -inf rows, NaNs, ragged widths and
    row counts that span several work items), with the product written or not."""
    rng = np.random.default_rng(0)
    for m, k, n in ((1, 16, 17), (5, 33, 1000), (3, 8, 16), (130, 64, 300), (64, 768, 32000)):
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        packed = pack_columns(jnp.asarray(rng.standard_normal((k, n), np.float32)))
        product = packed_matmul(x, packed, n)
        for want in (True, False):
            y, idx = jax.jit(lambda x, want: packed_matmul_argmax(x, packed, n, want))(x, want)
            np.testing.assert_array_equal(np.asarray(idx), np.asarray(jnp.argmax(product, axis=-1)))
            if want:
                np.testing.assert_array_equal(np.asarray(y), np.asarray(product))
    # One row at a time, as 1 x row (K = 1): a product that is the row itself, infinities and NaNs kept.
    w = np.zeros((6, 1000), np.float32)
    w[0, [300, 700]] = 1.0  # a tie, in different work items: the first
    w[1, :] = -np.inf  # all -inf: index 0
    w[2, [20, 900, 950]] = 5.0, np.nan, np.nan  # the first NaN beats any number
    w[3, [999, 517]] = np.inf  # +inf twice
    w[4, 999] = 1.0  # the last column
    w[5, :] = -1.0
    w[5, 640] = -0.5
    got = [
        int(packed_matmul_argmax(jnp.ones((1, 1)), pack_columns(jnp.asarray(row[None])), 1000,
                                             want)[1][0])
        for want in (True, False) for row in w
    ]
    assert got == [300, 0, 900, 517, 999, 640] * 2
    with pytest.raises(ValueError, match="n=0"):
        packed_matmul_argmax(jnp.ones((2, 16)), jnp.zeros((0, 16, 16)), 0, True)


def test_greedy_steps_on_cpu_take_their_tokens_from_the_cpu_argmax():
    from jaxcb.backends import _cpu_row_argmax
    from jaxcb.sampling import xla_argmax
    from engine_factory import shared_engine

    assert _cpu_row_argmax("cpu", one_device=False) is xla_argmax
    assert _cpu_row_argmax("gpu", one_device=True) is xla_argmax
    assert _cpu_row_argmax("cpu", one_device=True) is row_argmax
    from jaxcb.runner.buckets import SamplerKey
    from jaxcb.sampling import StepVariant

    compiled = {key: exe for key, exe in shared_engine().runner.compiled.items() if isinstance(key, SamplerKey)}
    assert {key.variant for key in compiled} > {StepVariant.GREEDY}  # both kinds below were compiled
    for key, executable in compiled.items():  # the samplers: the LM head is theirs
        text = executable.as_text()
        assert "jaxcb_packed_matmul_argmax" in text  # the LM head, with the argmax of an all-greedy step
        # a step that reads its logits (sampling, penalties, bans, logprobs) takes their argmax on the CPU
        # kernel too; an all-greedy step has its argmax from the head already and never writes logits
        assert ("jaxcb_row_argmax" in text) == (key.variant != StepVariant.GREEDY)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="needs an x86-64 CPU with AVX2 and FMA")
def test_the_avx2_build_computes_what_the_native_one_does(monkeypatch):
    """The kernels pick their SIMD width at build time (`-march=native`): on a CPU with AVX-512
    the native build never runs the AVX2 tiles and attention rows. A second build for AVX2 only
    (x86-64-v3) runs them here and must agree with the native one, so both paths are checked
    on any machine with AVX2 (on an AVX2-only machine the two builds run the same code)."""

    flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in cpu_kernels.CXX_FLAGS)
    monkeypatch.setattr(cpu_kernels, "CXX_FLAGS", flags)
    lib = ctypes.cdll.LoadLibrary(str(cpu_kernels.build_library()))
    monkeypatch.undo()
    assert lib.JaxcbAttentionPaths() == 1 and lib.JaxcbSelectAttention(1) == 0  # no AMX: the rows path only
    names = {"JaxcbPackedMatmul": "matmul", "JaxcbPackedMlp": "mlp", "JaxcbRaggedPagedAttention": "attention",
             "JaxcbRowArgmax": "argmax", "JaxcbPackedMatmulArgmax": "matmul_argmax", "JaxcbPackedQkv": "qkv",
             "JaxcbBatchedLora": "lora"}
    for symbol, target in names.items():
        jax.ffi.register_ffi_target(f"jaxcb_test_avx2_{target}", jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")

    def avx2(target, shape, dtype, *args, **attrs):
        return jax.ffi.ffi_call(f"jaxcb_test_avx2_{target}", jax.ShapeDtypeStruct(shape, dtype))(*args, **attrs)

    def avx2_mlp(x, gate_up, down, norm, residual, lora=None):  # y, or (y, down's u) with LoRA's operands
        no_lora = (jnp.zeros((0,), jnp.int32), jnp.zeros((0, 0), jnp.float32), jnp.zeros((0, 0, 0, 16), jnp.float32),
                   jnp.zeros((0, 0, 0), jnp.float32))
        cd = 0 if lora is None else lora.down_a.shape[2]
        y, d = jax.ffi.ffi_call("jaxcb_test_avx2_mlp", (jax.ShapeDtypeStruct((m, n), jnp.float32),
                                                        jax.ShapeDtypeStruct((m if cd else 0, cd), jnp.float32)))(
            x, gate_up, down, norm, residual, *(no_lora if lora is None else lora), eps=np.float32(1e-5))
        return y if lora is None else (y, d)

    rng = np.random.default_rng(0)
    m, k, f, n = 29, 70, 36, 33  # rows past two 12-row tiles, F and N off the 16-column panels
    x, w = jnp.asarray(rng.standard_normal((m, k), np.float32)), jnp.asarray(rng.standard_normal((k, n), np.float32))
    norm, residual = jnp.asarray(rng.standard_normal(k, np.float32)), jnp.asarray(rng.standard_normal((m, n), np.float32))
    packed = pack_columns(w)
    native = packed_matmul(x, packed, n, norm=norm, eps=1e-5, residual=residual)
    ours = avx2("matmul", (m, n), jnp.float32, x, packed, norm, residual, eps=np.float32(1e-5))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(native), rtol=1e-5, atol=1e-4)

    # bf16 weights: the AVX2 build widens them (its only bf16 path); the native one takes its chosen
    # path, so both are compared with the float32 sum of the same bf16 products.
    packed16 = pack_columns(w.astype(jnp.bfloat16))
    ours = avx2("matmul", (m, n), jnp.float32, x, packed16, norm, residual, eps=np.float32(1e-5))
    native = packed_matmul(x, packed16, n, norm=norm, eps=1e-5, residual=residual)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(native), rtol=1e-4, atol=1e-3)
    gate16, up16, down16 = (jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16) for s in ((k, f), (k, f), (f, n)))
    ours = avx2_mlp(x, pack_gate_up(gate16, up16), pack_columns(down16), norm, residual)
    native = packed_mlp(x, pack_gate_up(gate16, up16), pack_columns(down16), n, norm=norm, eps=1e-5, residual=residual)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(native), rtol=2e-2, atol=2e-2 * np.abs(native).max())
    # with LoRA inside (bf16 blocks; rows of two slots and base rows)
    num_panels = pack_gate_up(gate16, up16).shape[0]
    lora = MlpLora(jnp.asarray(np.arange(m) % 3 - 1, jnp.int32), jnp.asarray(rng.standard_normal((m, 16)), jnp.float32),
                   jnp.asarray(rng.standard_normal((2, num_panels, 8, 16)), jnp.bfloat16),
                   jnp.asarray(rng.standard_normal((2, f, 16)), jnp.bfloat16))
    ours = avx2_mlp(x, pack_gate_up(gate16, up16), pack_columns(down16), norm, residual, lora)
    native = packed_mlp(x, pack_gate_up(gate16, up16), pack_columns(down16), n, norm=norm, eps=1e-5, residual=residual,
                        lora=lora)
    rows = np.arange(m) % 3 != 0  # down's u: the rows with a slot only
    for got, want in ((ours[0], native[0]), (np.asarray(ours[1])[rows], np.asarray(native[1])[rows])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2 * np.abs(want).max())

    gate_up = pack_gate_up(*(jnp.asarray(rng.standard_normal((k, f), np.float32)) for _ in range(2)))
    down = pack_columns(jnp.asarray(rng.standard_normal((f, n), np.float32)))
    x3 = x * 3  # gates of both signs and beyond the sigmoid's flat ends
    native = packed_mlp(x3, gate_up, down, n, norm=norm, eps=1e-5, residual=residual)
    ours = avx2_mlp(x3, gate_up, down, norm, residual)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(native), rtol=1e-5, atol=1e-3)

    cache = jnp.asarray(rng.standard_normal((2, 1, 8, 4, 16)), jnp.float32)  # 1 KV head of 16 for 2 q heads
    qkv = pack_columns(jnp.asarray(rng.standard_normal((k, 64), np.float32)))
    angles = jnp.asarray(rng.standard_normal((m, 8)), jnp.float32)
    # A slot each (two rows aiming at one slot, from two chunks, may land in either order), and one dropped.
    slots = jnp.asarray(np.r_[rng.permutation(32)[: m - 1], -1], jnp.int32)
    args = (x, qkv, norm, jnp.cos(angles), jnp.sin(angles), cache, cache + 1, slots, jnp.int32(1),
            jnp.zeros((0, 64), jnp.float32), jnp.zeros((0,), jnp.int32))
    native = packed_qkv(*args[:2], norm, 1e-5, *args[3:7], jnp.int32(1), slots, 2)
    call = jax.ffi.ffi_call("jaxcb_test_avx2_qkv", (jax.ShapeDtypeStruct((m, 2, 16), jnp.float32),
                                                    *(jax.ShapeDtypeStruct(cache.shape, jnp.float32),) * 2),
                            input_output_aliases={5: 1, 6: 2})
    for ours_part, native_part in zip(call(*args, eps=np.float32(1e-5)), native):
        np.testing.assert_allclose(np.asarray(ours_part), np.asarray(native_part), rtol=1e-5, atol=1e-4)

    # Blocks of 16 and head_dim 64: the AVX-512 build scores a whole block per pass here; with a logit
    # soft-cap too (q x 4: scores well past the cap of 5), capped by Tanh16 there and by Tanh8 here.
    batch = make_ragged_batch([(1, 37), (5, 80), (1, 16), (17, 17)], block_size=16, num_kv_heads=2, group=3,
                              head_dim=64, seed=1)
    batch.q *= 4
    for dtype in (jnp.float32, jnp.bfloat16):
        for cap in ({}, {"softcap": np.float32(5.0)}):
            args = batch.args(jnp, dtype)
            native = ragged_paged_attention_cpu(*args, sm_scale=0.125, **cap)
            q, kc, vc, kv_lens, tables, qsl, num_seqs, layer = args
            ours = avx2("attention", q.shape, q.dtype, q, kc, vc, kv_lens, tables, qsl, jnp.reshape(num_seqs, ()),
                        jnp.reshape(layer, ()), sm_scale=np.float32(0.125), **cap)
            tol = 1e-5 if dtype == jnp.float32 else 1e-2
            np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(native, np.float32), rtol=tol,
                                       atol=tol)

    # Multi-LoRA's batched kernel: bf16 slots, 5 rows of slot 0 (widened first), 2 of slot 2 (read as
    # bf16), base rows; q/k/v-like widths off the panels.
    widths, lora_slots = (40, 12, 12), np.r_[[0] * 5, [2] * 2, [-1] * (m - 7)].astype(np.int32)
    lora = pack_lora_group([jnp.asarray(rng.standard_normal((k, 3, 8)), jnp.bfloat16) for _ in widths],
                           [jnp.asarray(rng.standard_normal((3, 8, wd)), jnp.bfloat16) for wd in widths],
                           side_by_side(widths))
    base = jnp.asarray(rng.standard_normal((m, 64)), jnp.float32)
    native = batched_lora(x, lora, jnp.asarray(lora_slots), base, norm=norm, eps=1e-5)
    ours = avx2("lora", (m, 64), jnp.float32, x, norm, base, jnp.asarray(lora_slots), lora.a, lora.b, lora.entries,
                eps=np.float32(1e-5), mode=np.int32(0))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(native), rtol=1e-5, atol=1e-4)

    logits = jnp.asarray(rng.standard_normal((5, 1000), np.float32))
    np.testing.assert_array_equal(np.asarray(avx2("argmax", (5,), jnp.int32, logits)), np.asarray(jnp.argmax(logits, -1)))

    head = pack_columns(jnp.asarray(rng.standard_normal((k, 1000), np.float32)))
    for want in (0, 1):
        call = jax.ffi.ffi_call("jaxcb_test_avx2_matmul_argmax",
                                (jax.ShapeDtypeStruct((m, 1000), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.int32)))
        _, ours = call(x, head, jnp.int32(want))
        _, native = packed_matmul_argmax(x, head, 1000, want)
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(native))


def load_bench_kernels():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_kernels_lm_head_table_times_the_three_ways_to_a_greedy_token(capsys):
    module = load_bench_kernels()
    module.lm_head_table(2, rows=4, hidden=16, vocab=100)
    table = capsys.readouterr().out
    for row in ("| matmul, then row_argmax |", "| argmax inside, logits written |", "| argmax inside, no logits |"):
        assert row in table


def test_bench_kernels_lora_table_times_the_decode_calls_over_many_slots_one_layers_and_none(capsys):
    module = load_bench_kernels()
    module.lora_table(1, layers=2, slots=2, rank=4, rows=4)
    table = capsys.readouterr().out
    assert "| SmolLM2's decode LoRA calls (8), 4 rows over 2 slots of rank 4, bf16 | ms |" in table
    for row in ("| 2 layers' slots |", "| one layer's slots, again and again |", "| every row a base row |"):
        assert row in table


def test_bench_kernels_qkv_table_times_the_one_call_against_the_three_steps_for_both_cache_dtypes(capsys):
    module = load_bench_kernels()
    module.qkv_table(2, tokens=4, context=20, layers=2)
    table = capsys.readouterr().out
    assert "| three steps (ms) | packed_qkv (ms) |" in table
    for row in ("| float32 cache |", "| bfloat16 cache |"):
        assert row in table


def test_bench_kernels_bf16_attention_table_times_the_cascade_where_sequences_share_blocks(capsys):
    module = load_bench_kernels()
    module.BF16_PATH_WORKLOADS = {"decode": ([(1, 80)] * 4, jnp.float32),
                                  "decode, shared": ([(1, 80)] * 4, jnp.float32)}
    module.SHARED_PREFIX_GROUPS = {"decode, shared": [([0, 1, 2, 3], 4)]}
    module.bf16_attention_paths_table(1)
    table = capsys.readouterr().out
    if cpu_kernels.attention_path() != "amx":
        assert "no AMX attention path" in table
        return
    assert "| rows + cascade (ms / layer) | amx + cascade (ms / layer) | rows / amx + cascade |" in table
    assert "| decode | " in table and table.split("| decode | ")[1].splitlines()[0].endswith("| - | - | - |")
    shared = table.split("| decode, shared | ")[1].splitlines()[0]
    assert not shared.endswith("| - |") and shared.endswith("x |")


def test_bench_kernels_steps_against_replays_the_recorded_run_with_each_revisions_kernels(capsys):
    module = load_bench_kernels()
    *_, targets = module.register_kernels_at("HEAD")
    assert set(targets) == set(module.KERNEL_SYMBOLS)
    overrides = ["model=tiny", "bench.workload=random", "bench.num_requests=3", "bench.input_mean=24",
                 "bench.output_mean=8", "engine.max_model_len=64", "scheduler.max_num_seqs=4",
                 "scheduler.max_num_batched_tokens=64"]
    ms = module.steps_against("HEAD", targets, 2, overrides)
    assert set(ms) == {"this checkout", "HEAD"} and min(ms.values()) > 0
    assert "steps, replayed | this checkout (s) | HEAD (s) | HEAD / this |" in capsys.readouterr().out


# The attention kernel's AMX path (bf16 caches, tiles of >= 8 query rows) and its rows path.
# Ragged prefills: 37 tokens (on AMX a tile of 32 and one of 5: 5, 15 or 20 rows, not multiples of
# 16; 5 rows stay on the rows path), contexts that end mid-block, a chunk of 21 new tokens after 32
# of prior context, decodes (<= 4 rows: the rows path either way), a sequence with no new tokens.
# Every slot no sequence owns (past each kv_len too) holds NaN.
AMX_SEQS = [(37, 37), (21, 53), (1, 40), (0, 9), (16, 16), (1, 1)]


@pytest.fixture
def restore_attention_path():
    chosen = cpu_kernels.attention_path()
    yield
    cpu_kernels.select_attention_path(chosen)


def bf16_cache_run(batch, path, q_dtype=jnp.float32, **kw):
    """The kernel on `path` with the batch's caches and q rounded to bf16 (q then passed as q_dtype),
    and dense float64 attention over the same rounded values."""
    rounded = dataclasses.replace(batch, **{name: np.asarray(jnp.asarray(getattr(batch, name), jnp.bfloat16), np.float32)
                                            for name in ("q", "k_cache", "v_cache")})
    q, k, v, *rest = rounded.args(jnp)
    cpu_kernels.select_attention_path(path)
    window = kw.get("window")
    out = ragged_paged_attention_cpu(q.astype(q_dtype), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), *rest,
                                     sm_scale=0.3, window=None if window is None else jnp.int32(window),
                                     softcap=kw.get("softcap"))
    return np.asarray(out.astype(jnp.float32)), dense_attention(rounded, 0.3, window=window, softcap=kw.get("softcap"))


@pytest.mark.parametrize("path", ["amx", "rows"])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16], ids=["f32-q", "bf16-q"])
@pytest.mark.parametrize("group, head_dim, block_size", [(1, 64, 16), (3, 64, 16), (4, 128, 8), (3, 128, 64), (1, 32, 32)])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (20, 5.0)])
def test_bf16_cache_attention_equals_the_float_reference_on_each_path(restore_attention_path, path, q_dtype, group,
                                                                      head_dim, block_size, window, softcap):
    """Both paths against float64 attention. A float32 q keeps float32 precision on either path (AMX
    splits q and P in two bf16 terms each); with a bf16 q, AMX rounds P to bf16 and the output is
    bf16. Where this CPU or build has no AMX, select_attention_path("amx") keeps the rows path."""
    batch = make_ragged_batch(AMX_SEQS, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim,
                              seed=group + head_dim + block_size)
    batch.q *= 3  # peaked softmaxes: scores well past the cap of 5
    out, expected = bf16_cache_run(batch, path, q_dtype, window=window, softcap=softcap)
    n = batch.num_real_tokens
    assert np.isfinite(out).all(), "a stale (NaN) slot reached the output"
    assert np.all(out[n:] == 0), "padding tokens must come back as 0"
    tol = 1e-5 if q_dtype == jnp.float32 else 5e-3
    err = np.abs(out[:n] - expected[:n]).max() / np.abs(expected[:n]).max()
    assert err <= tol, f"relative error {err:.2e} > {tol}"


# Decoding sequences whose block tables start with the same blocks (prefix caching's shared prompts),
# beside a prefill chunk and decodes that share nothing: (group, head_dim, block_size, groups of
# (sequences, shared blocks)). A cascade needs 2 members sharing >= 64 keys before each member's new
# token; its shared phase runs on AMX (bf16 cache, AMX path) once it has >= 8 rows, else row by row.
# The first case's second and third groups have 6 rows; its last group, like the group-1 case's
# second, shares too few keys.
CASCADE_SEQS = [(1, 100), (1, 77), (20, 60), (1, 130), (1, 65), (1, 90), (1, 200), (1, 150), (1, 97), (1, 40),
                (1, 120), (1, 50), (1, 49)]
CASCADE_CASES = {  # id: (group, head_dim, block_size, groups, cascades with >= 8 rows, cascades with fewer)
    "g3": (3, 64, 16, [([0, 1, 3, 4, 5], 4), ([6, 7], 6), ([8, 10], 5), ([9, 11, 12], 2)], 1, 2),
    "g1": (1, 64, 16, [([0, 1, 3, 4, 5, 6, 7, 8, 10], 4), ([11, 12], 3)], 1, 0),
    "g4-d128-bs8": (4, 128, 8, [([0, 1, 3, 5], 8), ([6, 7, 8, 10], 11)], 2, 0),
}


def cascade_items(lib) -> tuple[int, int]:
    """(cascade items whose shared phase ran on AMX, row by row) so far."""
    return lib.JaxcbCascadeItems(1), lib.JaxcbCascadeItems(0)


@pytest.mark.parametrize("path", ["amx", "rows"])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16], ids=["f32-q", "bf16-q"])
@pytest.mark.parametrize("case", list(CASCADE_CASES))
@pytest.mark.parametrize("window, softcap", [(None, None), (None, 5.0), (7, None)])
def test_cascade_items_attend_shared_blocks_for_all_their_sequences_and_equal_the_float_reference(
        restore_attention_path, path, q_dtype, case, window, softcap):
    """Decoding sequences that share leading blocks are attended over those blocks together (one
    cascade item per group and KV head: on AMX tiles where the path has them and the item has 8 rows,
    else row by row), then each over its own blocks from that state; with cascades turned off, one by
    one. Both equal float64 attention; a sliding window takes no cascade."""
    group, head_dim, block_size, groups, big, small = CASCADE_CASES[case]
    lib = cpu_kernels.load_cpu_kernels()
    batch = make_ragged_batch(CASCADE_SEQS, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim,
                              seed=group + head_dim)
    batch.q *= 3
    batch = share_leading_blocks(batch, groups)
    n = batch.num_real_tokens
    tol = 1e-5 if q_dtype == jnp.float32 else 5e-3
    on_amx = path == "amx" and cpu_kernels.attention_path() == "amx"
    try:
        for cascade in (1, 0):
            lib.JaxcbSetCascade(cascade)
            before = cascade_items(lib)
            out, expected = bf16_cache_run(batch, path, q_dtype, window=window, softcap=softcap)
            ran = tuple(after - b for after, b in zip(cascade_items(lib), before))
            heads = 2 if cascade and window is None else 0  # an item per cascade and KV head
            assert ran == ((heads * big, heads * small) if on_amx else (0, heads * (big + small)))
            assert np.isfinite(out).all() and np.all(out[n:] == 0)
            err = np.abs(out[:n] - expected[:n]).max() / np.abs(expected[:n]).max()
            assert err <= tol, f"cascade={cascade}: relative error {err:.2e} > {tol}"
    finally:
        lib.JaxcbSetCascade(1)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.int8], ids=["f32-cache", "int8-cache"])
@pytest.mark.parametrize("case", list(CASCADE_CASES))
def test_cascade_items_over_float32_and_int8_caches_run_row_by_row_and_equal_the_float_reference(case, cache_dtype):
    """An int8 cache is read as its integer values (the caller scales q and the output): here the
    reference attends the same integers as floats."""
    group, head_dim, block_size, groups, big, small = CASCADE_CASES[case]
    lib = cpu_kernels.load_cpu_kernels()
    batch = share_leading_blocks(make_ragged_batch(CASCADE_SEQS, block_size=block_size, num_kv_heads=2, group=group,
                                                   head_dim=head_dim, seed=7), groups)
    if cache_dtype == jnp.int8:  # small integers; the slots no sequence owns hold stale values, not NaN
        batch = dataclasses.replace(batch, **{name: np.nan_to_num(np.clip(np.round(getattr(batch, name) * 8), -127, 127),
                                                                  nan=100.0) for name in ("k_cache", "v_cache")})
        batch.q /= 8
    n = batch.num_real_tokens
    q, k, v, *rest = batch.args(jnp)[:7]
    before = cascade_items(lib)
    out = np.asarray(ragged_paged_attention_cpu(q, k.astype(cache_dtype), v.astype(cache_dtype), *rest,
                                                jnp.int32(batch.layer), sm_scale=0.3))
    assert tuple(after - b for after, b in zip(cascade_items(lib), before)) == (0, 2 * (big + small))
    expected = dense_attention(batch, 0.3)
    assert np.isfinite(out).all()
    assert np.abs(out[:n] - expected[:n]).max() <= 1e-5 * np.abs(expected[:n]).max()


@pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="AMX only: elsewhere both names select the rows path")
def test_the_amx_path_is_selected_where_the_cpu_has_amx_and_runs_prefill_tiles_only(restore_attention_path):
    """On a CPU with AMX-BF16 the probe selects AMX; prefill tiles then differ from the rows path in
    the last bits, and a decode-only batch (3 rows a tile) stays on the rows path, bit for bit. Where
    the flags list AMX but the kernel refuses it (the matmul's own AMX path, probed apart, does not
    run), the attention falls back to the rows path instead."""
    amx_code = {v: k for k, v in cpu_kernels.BF16_MATMUL_PATHS.items()}["amx"]
    if cpu_kernels._time_path(str(cpu_kernels.build_library()), amx_code) is None:
        assert cpu_kernels.attention_path() == "rows"  # the fallback is what this CPU must show
        return
    assert cpu_kernels.attention_path() == "amx"
    for seqs, same in (([(40, 40), (17, 50)], False), ([(1, 40), (1, 77), (1, 3)], True)):
        batch = make_ragged_batch(seqs, block_size=16, num_kv_heads=1, group=3, head_dim=64, seed=3)
        amx, _ = bf16_cache_run(batch, "amx")
        rows, _ = bf16_cache_run(batch, "rows")
        assert np.array_equal(amx, rows) == same
