"""`model.layer_loop`: scanned and unrolled decoder layers compute the same thing, and an unrolled
step takes each layer's weights as arrays of their own, with no stacked weight left to slice."""

import gc
import weakref

import jax
import numpy as np

from engine_factory import assert_same_tokens_and_logprobs, generate_first_completions, model_executables, shared_engine
from jaxcb.config import compose_config
from jaxcb.model.config import resolve_llama_config
from benchmarks.hlo_weights import layer_weight_copies
from benchmarks.reference_generate import greedy_generate
from jaxcb.backends import resolve_layer_loop
from jaxcb.kernels.attention import select_attention
from jaxcb.backends.base import Backend
from jaxcb.model.llama import build_random_model
from jaxcb.sampling_params import SamplingParams

PROMPTS = [[72, 105], list(b"Once upon a time there was a fox who"), list(b"The quick brown fox jumps over it")]


def engine(layer_loop: str):
    # XLA's dot in both, so that only the loop differs (the packed CPU matmul: test_backends.py).
    return shared_engine(f"model.layer_loop={layer_loop}", "model.backend=xla")



def layer_weight_shapes(e) -> set[tuple[int, ...]]:
    """The shapes of one layer's weights as the xla backend prepares them (q/k/v and gate/up fused),
    without the layer axis."""
    cfg = e.model_config
    D, F, Hq, Hkv, K = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {(D,), (D, 1, Hq + 2 * Hkv, K), (Hq, K, D), (D, 1, 2, F), (F, D)}


def test_auto_unrolls_on_cpu_and_scans_on_accelerators():
    assert resolve_layer_loop("auto", "cpu") == "unrolled"
    assert resolve_layer_loop("auto", "gpu") == "scan" and resolve_layer_loop("auto", "tpu") == "scan"
    assert resolve_layer_loop("scan", "cpu") == "scan" and resolve_layer_loop("unrolled", "gpu") == "unrolled"


def test_scanned_and_unrolled_layers_give_the_same_greedy_tokens_and_logprobs_through_the_engine():
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    scanned, unrolled = (generate_first_completions(engine(mode), PROMPTS, params) for mode in ("scan", "unrolled"))
    assert_same_tokens_and_logprobs(scanned, unrolled, tol=1e-6)


def test_scanned_and_unrolled_weights_give_the_same_logits():
    cfg = resolve_llama_config(compose_config(["model=tiny"]).model)
    model, attention = build_random_model(cfg, seed=0), select_attention()
    scanned, unrolled = (greedy_generate(model, PROMPTS[1], 8, prefill_chunk=5,
                                         backend=Backend(cfg, attention, unroll_layers=unroll))
                         for unroll in (False, True))
    assert scanned.token_ids == unrolled.token_ids
    np.testing.assert_allclose(np.stack(scanned.logits), np.stack(unrolled.logits), rtol=1e-6, atol=1e-6)


def test_unrolled_step_takes_one_array_per_layer_and_slices_no_weight():
    e, cfg = engine("unrolled"), engine("unrolled").model_config
    layers = e.runner.weights.layers
    assert isinstance(layers, list) and len(layers) == cfg.num_layers
    shapes = [leaf.shape for leaf in jax.tree.leaves(layers)]
    # Every field this (Llama) architecture has; the families' own weights are None here.
    assert len(shapes) == cfg.num_layers * sum(getattr(layers[0], name) is not None for name in type(layers[0])._fields)
    assert set(shapes) == layer_weight_shapes(e)
    assert e.runner.compiled
    for executable in e.runner.compiled.values():
        assert layer_weight_copies(executable.as_text(), layer_weight_shapes(e)).num_copies == 0


def test_the_default_cpu_step_copies_no_layer_weight():
    """The engine as a CPU user gets it (model.backend=auto: packed matmuls, layers unrolled): no
    step of any bucket or sampling variant writes a copy of any layer's weights."""
    e = shared_engine()
    shapes = {leaf.shape for leaf in jax.tree.leaves(e.runner.weights.layers)}
    assert shapes and len(e.runner.compiled) > 1
    for key, executable in e.runner.compiled.items():
        assert layer_weight_copies(executable.as_text(), shapes).num_copies == 0, key


def test_scanned_step_slices_each_layer_out_of_stacked_weights():
    """The other side of the test above: the pattern it looks for is there under scan."""
    e, cfg = engine("scan"), engine("scan").model_config
    shapes = {leaf.shape for leaf in jax.tree.leaves(e.runner.weights.layers)}
    assert shapes == {(cfg.num_layers, *s) for s in layer_weight_shapes(e)}
    assert model_executables(e)
    for executable in model_executables(e):
        copies = layer_weight_copies(executable.as_text(), layer_weight_shapes(e))
        assert {shape for op, shape in copies.top_level if op == "dynamic-slice"} >= (
            layer_weight_shapes(e) - {(cfg.hidden_size,)})


def test_unrolling_frees_the_stacked_weights_and_keeps_every_value():
    cfg = resolve_llama_config(compose_config(["model=tiny"]).model)
    model = build_random_model(cfg, seed=0)
    stacked = model.layers.weights()
    expected = {name: np.array(w, copy=True) for name, w in stacked._asdict().items() if w is not None}
    refs = [weakref.ref(w) for w in stacked if w is not None]
    del stacked
    class Unfused(Backend):  # the layers as they come, to compare value for value
        def prepare_layers(self, layers):
            return layers

    weights = Unfused(cfg, select_attention(), unroll_layers=True).prepare(model, max_len=64)
    gc.collect()
    assert all(ref() is None for ref in refs)
    for i, layer in enumerate(weights.layers):
        for name, w in layer._asdict().items():
            assert (w is None) == (name not in expected), name
            if w is not None:
                np.testing.assert_array_equal(np.asarray(w), expected[name][i])
