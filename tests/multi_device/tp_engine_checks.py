"""Tensor parallelism on fake CPU devices: TP=2 and TP=4 give TP=1's logits and greedy tokens,
and every array is split as jaxcb.sharding says.

Run by tests/test_tensor_parallel.py in a subprocess with 8 fake CPU devices; a plain
`pytest` run does not collect this file (it would see one device).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from engine_factory import BASE, VARIANTS
from jaxcb.kernels.attention import AttentionMetadata
from jaxcb.config import compose_config
from jaxcb.engine import LLM, Engine
from jaxcb.kv_cache import allocate_kv_cache
from jaxcb.model.config import resolve_llama_config
from jaxcb.model.loader import _sharded_random_init, build_sharded_random_model
from jaxcb.sharding import make_tensor_parallel
from benchmarks.reference_generate import forward_step
from jaxcb.runner.buckets import ModelKey, SamplerKey
from jaxcb.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

# The tiny model with head counts that divide by 2 and 4 (head_dim stays 16), and a vocabulary
# of 264 = 8 x 33 so that lm_head is split too. One token bucket keeps compile time down.
TP_MODEL = ("model.num_heads=8", "model.num_kv_heads=4", "model.vocab_size=264", "engine.token_buckets=[64]")
PROMPTS = ["Hello", "Once upon a time there was a fox who", "The quick brown fox jumps over the lazy dog, twice."]


def tp_config(tp: int, *overrides: str):
    return compose_config(BASE + TP_MODEL + (f"engine.tensor_parallel_size={tp}",) + overrides)


@functools.lru_cache(maxsize=None)
def llm(tp: int) -> LLM:
    """A served engine: every bucket compiled at start-up, with every step variant (masks and prompt
    logprobs compile when first used)."""
    return LLM(tp_config(tp, *VARIANTS), progress=False)


def engine(tp: int) -> Engine:
    return llm(tp).engine


@functools.lru_cache(maxsize=None)
def uncompiled_engine(tp: int, *overrides: str) -> Engine:
    """Parameters and cache only, for forward passes (no step buckets compiled)."""
    return Engine(tp_config(tp, *overrides), compile_buckets=False, progress=False)


@functools.lru_cache(maxsize=None)
def greedy_tokens(tp: int) -> tuple[tuple[int, ...], ...]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm(tp).generate(PROMPTS, params, use_tqdm=False)
    return tuple(tuple(o.outputs[0].token_ids) for o in outputs)


def forward_logits(e: Engine) -> np.ndarray:
    """f32[28, vocab]: logits of every token of a ragged prefill of two sequences (7 and 21 tokens),
    through the engine's parameters and a fresh cache with the engine's cache sharding."""
    lens, block_size = (7, 21), e.cache_plan.block_size
    tables = np.array([[1, 0], [2, 3]], np.int32)
    num_tokens, padded = sum(lens), 32
    rng = np.random.default_rng(0)
    token_ids = np.zeros(padded, np.int32)
    token_ids[:num_tokens] = rng.integers(0, 256, num_tokens)
    positions = np.zeros(padded, np.int32)
    slots = np.zeros(padded, np.int32)  # padding writes to the null block
    offset = 0
    for r, n in enumerate(lens):
        pos = np.arange(n)
        positions[offset : offset + n] = pos
        slots[offset : offset + n] = tables[r, pos // block_size] * block_size + pos % block_size
        offset += n
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        query_start_loc=jnp.asarray([0, lens[0], num_tokens], jnp.int32),
        kv_lens=jnp.asarray(lens, jnp.int32),
        block_tables=jnp.asarray(tables),
        num_seqs=jnp.asarray(2, jnp.int32),
    )
    sharding = e.tp.kv_cache if e.tp is not None else None
    cache = allocate_kv_cache(e.model_config, 4, block_size, jnp.float32, sharding)
    runner = e.runner
    logits, cache = forward_step(
        runner.backend, runner.weights, cache, jnp.asarray(token_ids), jnp.asarray(positions), md,
        jnp.arange(num_tokens, dtype=jnp.int32),
    )
    if sharding is not None:
        assert cache.k.sharding.spec == P(None, "tp"), "the cache left the step with another sharding"
    return np.asarray(logits)


@pytest.mark.parametrize("tp", [2, 4])
def test_logits_under_tensor_parallelism_equal_one_device(tp):
    # attention.impl=auto picks the C++ kernel's form on CPU: this is attention.impl=cpu's case.
    assert engine(tp).runner.backend.attention.name == "cpu"
    np.testing.assert_allclose(forward_logits(engine(tp)), forward_logits(engine(1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_outputs_under_tensor_parallelism_equal_one_device_with_no_recompile(tp):
    assert greedy_tokens(tp) == greedy_tokens(1)
    assert engine(tp).num_recompiles == 0 and engine(1).num_recompiles == 0


LAYER_SPECS = {  # one layer's weights as the xla backend prepares them (fused), without the layer axis
    "qkv_proj": P(None, "tp"),  # [D, G, (Hq + 2 Hkv) / G, K]: each device's q, k and v heads
    "o_proj": P("tp", None, None),  # [Hq, K, D]: heads
    "gate_up_proj": P(None, "tp"),  # [D, G, 2, F / G]: each device's gate and up columns
    "down_proj": P("tp", None),  # [F, D]: MLP rows
    "attn_norm": P(),
    "mlp_norm": P(),
}


def test_models_built_alike_compile_their_sharded_init_once_and_own_their_buffers():
    cfg = resolve_llama_config(tp_config(2).model)
    tp = make_tensor_parallel(2, cfg)
    first = build_sharded_random_model(cfg, 7, tp)
    before = _sharded_random_init.cache_info()
    second = build_sharded_random_model(cfg, 7, tp)
    after = _sharded_random_init.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    firsts, seconds = jax.tree.leaves(nnx.state(first)), jax.tree.leaves(nnx.state(second))
    expected = [np.asarray(x) for x in firsts]
    for x in firsts:
        x.delete()  # the second model's arrays are its own, not views of the first's
    for x, y in zip(expected, seconds, strict=True):
        np.testing.assert_array_equal(np.asarray(y), x)


@pytest.mark.parametrize("tp", [2, 4])
def test_parameters_are_split_megatron_style(tp):
    runner = engine(tp).runner
    assert runner.backend.unroll_layers, "model.layer_loop=auto unrolls on CPU"
    layers = runner.weights.layers
    for i in range(engine(tp).model_config.num_layers):  # each layer's own arrays
        for name, spec in LAYER_SPECS.items():
            assert getattr(layers[i], name).sharding.spec == spec, (i, name)
    w = runner.weights
    assert w.head.sharding.spec == P(None, "tp")  # [D, V]: vocabulary
    assert w.embed.sharding.spec == P() and w.final_norm.sharding.spec == P()
    # Each device holds its share of the heads, not a copy.
    assert layers[0].qkv_proj.addressable_shards[0].data.shape == (96, 1, (8 + 2 * 4) // tp, 16)
    assert layers[1].gate_up_proj.addressable_shards[0].data.shape == (96, 1, 2, 200 // tp)
    assert layers[2].down_proj.addressable_shards[0].data.shape == (200 // tp, 96)


@pytest.mark.parametrize("tp", [2, 4])
def test_stacked_parameters_of_scanned_layers_are_split_on_the_same_axes(tp):
    layers = uncompiled_engine(tp, "model.layer_loop=scan").runner.weights.layers
    for name, spec in LAYER_SPECS.items():
        stacked_spec = P(None, *spec) if spec else P()  # [L, ...]
        assert getattr(layers, name).sharding.spec == stacked_spec, name
    assert layers.qkv_proj.addressable_shards[0].data.shape == (3, 96, 1, (8 + 2 * 4) // tp, 16)


def test_scanned_layers_under_tp2_give_one_device_logits():
    tp2 = uncompiled_engine(2, "model.layer_loop=scan")
    np.testing.assert_allclose(forward_logits(tp2), forward_logits(engine(1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_kv_cache_is_split_by_kv_head_and_keeps_its_sharding_across_steps(tp):
    greedy_tokens(tp)  # the engine has run donated steps
    cache = engine(tp).runner.kv_cache
    for buffer in (cache.k, cache.v):
        assert buffer.sharding.spec == P(None, "tp")  # [L, Hkv, num_blocks, block_size, head_dim]
        assert len(buffer.sharding.device_set) == tp
        assert buffer.addressable_shards[0].data.shape[1] == 4 // tp


# The cpu impl is what auto picks here: test_logits_under_tensor_parallelism_equal_one_device[2] checks it.
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_every_xla_attention_impl_gives_one_device_logits_under_tp2(impl):
    tp2 = uncompiled_engine(2, f"attention.impl={impl}")
    np.testing.assert_allclose(forward_logits(tp2), forward_logits(engine(1)), rtol=1e-5, atol=1e-5)


def test_pallas_kernel_runs_per_shard_under_tp2_in_the_interpreter():
    tp2 = uncompiled_engine(2, "attention.impl=pallas", "attention.interpret=true")
    np.testing.assert_allclose(forward_logits(tp2), forward_logits(engine(1)), rtol=1e-4, atol=1e-5)


# Qwen's pieces on the tiny model: q/k/v biases (split with their heads), q/k norms (one weight, on
# every device) and a sliding window shorter than forward_logits' 21-token sequence.
QWEN_PIECES = ("model.qkv_bias=true", "model.qk_norm=true", "model.sliding_window=5")


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_qwen_biases_qk_norms_and_a_window_under_tp2_give_one_device_logits(layer_loop):
    one, tp2 = (uncompiled_engine(tp, *QWEN_PIECES, f"model.layer_loop={layer_loop}") for tp in (1, 2))
    assert one.model_config.qk_norm and one.model_config.layer_windows == (5, 5, 5)
    layers = tp2.runner.weights.layers
    first = layers[0] if isinstance(layers, list) else layers
    assert first.q_norm.sharding.spec == P() and first.qkv_bias.sharding.spec in (P("tp"), P(None, "tp"))
    np.testing.assert_allclose(forward_logits(tp2), forward_logits(one), rtol=1e-5, atol=1e-5)
    # The pieces are in play: without them the tiny model's logits differ.
    assert np.abs(forward_logits(one) - forward_logits(engine(1))).max() > 1e-3


COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)")


def test_step_communicates_two_activation_all_reduces_per_layer_and_never_gathers_cache_or_weights():
    e = engine(2)
    [((tokens, rows, _, _), model)] = [(k, v) for k, v in e.runner.compiled.items()
                                       if isinstance(k, ModelKey) and not k.prompt_logprobs]
    samplers = [v for k, v in e.runner.compiled.items() if isinstance(k, SamplerKey)]
    assert samplers
    collectives = [
        (kind, tuple(int(d) for d in dims.split(",") if d))
        for executable in (model, *samplers) for _, dims, kind in COLLECTIVE.findall(executable.as_text())
    ]
    hidden, vocab = e.model_config.hidden_size, e.model_config.vocab_size
    # In each of the (unrolled) layers: after attention's o_proj and after the MLP's down_proj.
    activation_all_reduces = [c for c in collectives if c == ("all-reduce", (tokens, hidden))]
    assert len(activation_all_reduces) == 2 * e.model_config.num_layers, collectives
    # Everything else is per sampling row: the vocabulary-split logits and the sampler's reductions.
    largest = max(math.prod(shape) for _, shape in collectives)
    assert largest <= max(tokens * hidden, rows * vocab), collectives


def test_swapped_blocks_come_back_into_the_split_cache():
    from jaxcb.kv_cache import HostBlocks

    tp = engine(2).tp
    cache = allocate_kv_cache(engine(2).model_config, 6, 16, jnp.float32, tp.kv_cache)
    values = jax.random.normal(jax.random.key(0), cache.k.shape)
    cache = jax.device_put(type(cache)(k=values, v=-values), tp.kv_cache)
    swap = HostBlocks(cache, 4)
    swap.swap_out(cache, [(2, 1), (3, 2)])
    cache = jax.device_put(swap.swap_in(cache, [(1, 4), (2, 5)]), tp.kv_cache)
    assert cache.k.sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(np.asarray(cache.k[:, :, 4:6]), np.asarray(values[:, :, 2:4]))
    np.testing.assert_array_equal(np.asarray(cache.v[:, :, 4:6]), -np.asarray(values[:, :, 2:4]))


def test_masked_and_prompt_logprobs_variants_under_tp2_match_one_device():
    from jaxcb.structured import from_structured_outputs

    params = [
        SamplingParams(temperature=0.0, max_tokens=8, logit_bias={ord("q"): 5.0, ord("z"): -100.0}, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=from_structured_outputs({"regex": "[a-f]{6}"})),
        SamplingParams(temperature=0.0, max_tokens=8, bad_words=["e"]),
    ]
    results = []
    for tp in (1, 2):
        outs = llm(tp).generate(PROMPTS, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs])
    one, two = results
    for (ids1, p1), (ids2, p2) in zip(one, two, strict=True):
        assert ids1 == ids2
        if p1 is not None:
            for a, b in zip(p1[1:], p2[1:], strict=True):
                assert a.keys() == b.keys() and np.allclose(list(a.values()), [b[t] for t in a], atol=1e-4)
