"""Backends: the model's layer operations chosen once at start-up. The `cpu` backend (the packed
C++ matmul) and the `xla` one give the same tokens; `auto` picks cpu only where it applies and
falls back to xla, with one log line, where the C++ kernels do not build; and nothing outside the
backends and kernels knows which one runs."""

import ast
import logging
import pathlib

import pytest
from jax.sharding import AbstractMesh, AxisType

import jaxcb.kernels.cpu as cpu_kernels
from engine_factory import (
    assert_same_tokens_and_logprobs, generate_first_completions, make_engine, model_executables, shared_engine,
)
from jaxcb.backends import select_backend
from jaxcb.backends.cpu import PackedLayerWeights
from jaxcb.config import AttentionConfig, ConfigError, ModelConfig, compose_config
from jaxcb.model.config import resolve_llama_config
from jaxcb.backends.base import FusedLayerWeights
from jaxcb.model.llama import LayerWeights
from jaxcb.runner.buckets import ModelKey
from jaxcb.sampling_params import SamplingParams

PROMPTS = [[72, 105], list(b"Once upon a time there was a fox who"), list(b"The quick brown fox jumps over it")]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cpu_and_xla_backends_give_the_same_greedy_tokens_through_the_engine():
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    engines = (shared_engine(f"model.backend={name}") for name in ("xla", "cpu"))
    xla, cpu = (generate_first_completions(e, PROMPTS, params) for e in engines)
    assert_same_tokens_and_logprobs(xla, cpu, tol=1e-5)


def test_an_attention_softcap_on_a_llama_preset_is_applied_by_the_cpu_backend_as_by_xla():
    # The cpu backend's fused q/k/v-and-attend path took no cap: model.attn_logit_softcap was ignored there.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    capped = [generate_first_completions(shared_engine(f"model.backend={name}", "model.attn_logit_softcap=0.05"),
                                         PROMPTS[:2], params) for name in ("xla", "cpu")]
    assert_same_tokens_and_logprobs(*capped, tol=1e-4)
    plain = generate_first_completions(shared_engine("model.backend=cpu"), PROMPTS[:2], params)
    assert any(c.logprobs != p.logprobs for c, p in zip(capped[1], plain))  # the cap does change them


def test_the_cpu_backend_steps_on_packed_panels_and_run_no_xla_dot():
    e = shared_engine("model.backend=cpu")
    cfg = e.model_config
    D, F, Hq, Hkv, K, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.vocab_size)
    panels = lambda n: -(-n // 16)  # noqa: E731
    layers = e.runner.weights.layers
    assert len(layers) == cfg.num_layers
    for layer in layers:
        assert isinstance(layer, PackedLayerWeights)
        assert layer.qkv_proj.shape == (panels((Hq + 2 * Hkv) * K), D, 16)
        assert layer.o_proj.shape == (panels(D), Hq * K, 16)
        assert layer.gate_up_proj.shape == (2 * panels(F), D, 16)  # gate and up panels in pairs
        assert layer.down_proj.shape == (panels(D), F, 16)
    assert e.runner.weights.head.shape == (panels(V), D, 16)  # untied head: only the packed copy is kept
    for part, executable in e.runner.compiled.items():
        text = executable.as_text()
        assert " dot(" not in text and "jaxcb_packed_matmul" in text  # the layers', or the LM head's
        if isinstance(part, ModelKey):
            assert "jaxcb_packed_mlp" in text
            # q/k/v, rope and the cache write in one call a layer: no cache write of its own.
            assert text.count("jaxcb_packed_qkv") >= cfg.num_layers and "jaxcb_kv_cache_write" not in text


def test_the_xla_backend_fuses_qkv_and_gate_up_at_load_and_runs_two_fewer_matmuls_a_layer():
    e = shared_engine("model.backend=xla")
    cfg = e.model_config
    D, F, Hq, Hkv, K = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for layer in e.runner.weights.layers:
        assert isinstance(layer, FusedLayerWeights)
        assert layer.qkv_proj.shape == (D, 1, Hq + 2 * Hkv, K) and layer.gate_up_proj.shape == (D, 1, 2, F)
    assert e.runner.weights.head.shape == (cfg.hidden_size, cfg.vocab_size)
    # The projections' dots read the fused weights: no dot has q_proj's, k_proj's or gate_proj's own width.
    for executable in model_executables(e):
        text = executable.as_text()
        assert f"f32[{D},1,{Hq + 2 * Hkv},{K}]" in text and f"f32[{D},1,2,{F}]" in text
        assert f"f32[{D},{Hq},{K}]" not in text and f"f32[{D},{F}]" not in text


def test_fused_and_separate_projections_give_the_same_logits():
    import numpy as np

    from benchmarks.reference_generate import greedy_generate
    from jaxcb.backends import Backend
    from jaxcb.kernels.attention import select_attention
    from jaxcb.model.llama import build_random_model

    cfg = resolve_llama_config(compose_config(["model=tiny"]).model)
    fused = greedy_generate(build_random_model(cfg, seed=0), PROMPTS[1], 6, backend=Backend(cfg, select_attention()))

    class SeparateProjections(Backend):
        def prepare_layers(self, layers):  # stacked weights come as a dict of arrays (Backend.prepare_layers)
            return LayerWeights(**layers) if isinstance(layers, dict) else layers

    separate = greedy_generate(build_random_model(cfg, seed=0), PROMPTS[1], 6,
                               backend=SeparateProjections(cfg, select_attention()))
    assert fused.token_ids == separate.token_ids
    np.testing.assert_allclose(np.stack(fused.logits), np.stack(separate.logits), rtol=1e-5, atol=1e-5)


def select(backend="auto", platform="cpu", dtype="float32", layer_loop="auto", mesh=None):
    m = ModelConfig(name="tiny", init="random", dtype=dtype, backend=backend, layer_loop=layer_loop)
    arch = resolve_llama_config(compose_config(["model=tiny", f"model.dtype={dtype}"]).model)
    return select_backend(m, arch, AttentionConfig(impl="xla"), mesh=mesh, platform=platform)


TWO_DEVICES = AbstractMesh((2,), ("tp",), axis_types=(AxisType.Auto,))


def test_auto_picks_the_cpu_backend_only_where_it_applies():
    assert select().name == "cpu" and select("xla").name == "xla" and select(dtype="bfloat16").name == "cpu"
    for change in (dict(platform="gpu"), dict(dtype="float16"), dict(layer_loop="scan"), dict(mesh=TWO_DEVICES)):
        assert select(**change).name == "xla"
    assert select(platform="gpu").unroll_layers is False and select("xla").unroll_layers is True


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(platform="gpu"), "runs on CPU only"),
        (dict(dtype="float16"), r"takes float32 or bfloat16 weights \(model.dtype=float16\)"),
        (dict(layer_loop="scan"), "needs model.layer_loop=unrolled"),
        (dict(mesh=TWO_DEVICES), r"one device \(engine.tensor_parallel_size=2\)"),
    ],
)
def test_the_cpu_backend_where_it_cannot_run_says_why_and_what_to_use(change, reason):
    with pytest.raises(ConfigError, match=f"model.backend=cpu: .*{reason}.*Use model.backend=auto or xla"):
        select("cpu", **change)


def test_without_the_cpu_kernels_the_xla_backend_runs_the_model_and_says_so_once(monkeypatch, caplog):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    with_kernels = generate_first_completions(shared_engine("model.backend=cpu"), PROMPTS, params)

    def no_compiler():
        raise cpu_kernels.CpuKernelUnavailable("no C++ compiler found")

    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", no_compiler)
    with caplog.at_level(logging.WARNING):
        e = make_engine()
    assert [r.levelname for r in caplog.records if "C++" in r.getMessage()] == ["WARNING"]
    assert "no C++ compiler found" in caplog.text
    assert e.runner.backend.name == "xla" and e.runner.backend.attention.name == "xla"
    for executable in e.runner.compiled.values():
        assert "jaxcb_" not in executable.as_text()  # no C++ kernel anywhere in the step
    without = generate_first_completions(e, PROMPTS, params)
    assert_same_tokens_and_logprobs(without, with_kernels, tol=1e-5)
    with pytest.raises(ConfigError, match=r"model.backend=cpu: .*no C\+\+ compiler found"):
        make_engine("model.backend=cpu")


def test_an_unknown_backend_and_the_old_linear_impl_key_are_config_errors():
    with pytest.raises(ConfigError, match="model.backend='blas' must be one of auto, cpu, xla"):
        compose_config(["model.backend=blas"])
    with pytest.raises(ConfigError, match="model.linear_impl=xla was renamed: use model.backend=xla"):
        compose_config(["model.linear_impl=xla"])


# What only the backends and the kernels may import: the C++ kernels and the cpu backend itself.
CPU_ONLY_MODULES = ("jaxcb.kernels.cpu", "jaxcb.kernels.packed_matmul", "jaxcb.kernels.row_argmax",
                    "jaxcb.kernels.attention.cpu", "jaxcb.backends.cpu")
BACKEND_CLASSES = ("CpuBackend", "PackedLayerWeights")


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def backend_name_tests(tree: ast.AST) -> list[str]:
    """Comparisons of something's `.name` with a backend's name: `backend.name == "cpu"`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "name":
            for c in node.comparators:
                if isinstance(c, ast.Constant) and c.value in ("cpu", "xla"):
                    found.append(ast.unparse(node))
    return found


def test_nothing_outside_the_backends_and_kernels_imports_the_cpu_kernels_or_names_a_backend():
    offences = []
    for path in sorted((ROOT / "jaxcb").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("jaxcb/backends/", "jaxcb/kernels/")):
            continue
        tree = ast.parse(path.read_text())
        offences += [f"{rel} imports {m}" for m in imported_modules(tree) if m.startswith(CPU_ONLY_MODULES)]
        offences += [f"{rel} names {n.id}" for n in ast.walk(tree)
                     if isinstance(n, ast.Name) and n.id in BACKEND_CLASSES]
        offences += [f"{rel} tests {t}" for t in backend_name_tests(tree)]
    assert offences == []


def test_the_model_package_imports_nothing_from_the_cpu_kernels():
    for path in (ROOT / "jaxcb" / "model").rglob("*.py"):
        assert not any(m.startswith(CPU_ONLY_MODULES) for m in imported_modules(ast.parse(path.read_text()))), path


def test_the_cpu_backend_in_bf16_computes_what_float32_does_on_the_same_bf16_weights():
    """bf16 weights multiply with float32 accumulation and a float32 residual stream: against the xla
    backend in float32 on the same (bf16-valued) weights, only x's rounding to bf16 at each product
    and the bf16 cache differ."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.reference_generate import greedy_generate
    from jaxcb.backends import Backend
    from jaxcb.backends.cpu import CpuBackend
    from jaxcb.kernels.attention import select_attention
    from jaxcb.model.llama import build_random_model

    bf16 = resolve_llama_config(compose_config(["model=tiny", "model.dtype=bfloat16"]).model)
    f32 = dataclasses.replace(bf16, dtype="float32")
    ours = greedy_generate(build_random_model(bf16, seed=0), PROMPTS[1], 8, cache_dtype=jnp.bfloat16,
                           backend=CpuBackend(bf16, select_attention(AttentionConfig(impl="cpu")), unroll_layers=True))
    widened = build_random_model(f32, seed=0)
    nnx.update(widened, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(build_random_model(bf16, seed=0))))
    reference = greedy_generate(widened, PROMPTS[1], 8, backend=Backend(f32, select_attention(), unroll_layers=True))
    assert ours.token_ids == reference.token_ids
    got, want = np.stack(ours.logits), np.stack(reference.logits)
    assert got.dtype == np.float32  # the LM head accumulates and writes float32
    np.testing.assert_allclose(got, want, atol=0.01 * np.abs(want).max())  # measured: 0.003


def test_the_cpu_backend_skips_a_steps_padding_rows_and_its_real_rows_stay_the_same():
    """The rows past the step's last sequence (the padding up to the bucket's size) are not multiplied
    on the cpu backend: they come out of the layers zero, and the real rows equal those of the same
    tokens with no padding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.reference_generate import prepare
    from jaxcb.kernels.attention import AttentionMetadata
    from jaxcb.kv_cache import allocate_kv_cache
    from jaxcb.model.llama import build_random_model, forward

    cfg = resolve_llama_config(compose_config(["model=tiny"]).model)
    backend, weights = prepare(build_random_model(cfg, seed=0), select("cpu"), max_len=64)
    step = jax.jit(forward, static_argnums=0)
    n = 5

    def hidden(num_rows: int) -> np.ndarray:
        ids, positions, slots = (np.zeros(num_rows, np.int32) for _ in range(3))
        ids[:n], positions[:n], slots[:n] = PROMPTS[1][:n], np.arange(n), 16 + np.arange(n)  # block 1; padding: 0
        md = AttentionMetadata(jnp.asarray(slots), jnp.asarray([0, n], jnp.int32), jnp.asarray([n], jnp.int32),
                               jnp.asarray([[1, 2]], jnp.int32), jnp.asarray(1, jnp.int32))
        cache = allocate_kv_cache(cfg, 3, 16, jnp.float32)
        h, _ = step(backend, weights, jnp.asarray(ids), jnp.asarray(positions), cache, md)
        return np.asarray(h)

    padded, alone = hidden(32), hidden(n)
    assert not padded[n:].any()
    np.testing.assert_allclose(padded[:n], alone, rtol=1e-6, atol=1e-6)
