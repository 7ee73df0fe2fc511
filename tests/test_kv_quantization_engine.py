"""The 8-bit KV cache in the engine: its scales (calibrated on the shipped text, or the checkpoint's), the
plan's block counts, the prefix-cache root, refusals at start-up, and SmolLM2's logits and greedy tokens
against a bf16 cache."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from engine_factory import BASE, generate_first_completions, make_engine, shared_engine
from hf_checkpoints import make_hf_llama, write_word_tokenizer
from jaxcb.config import CacheConfig, ConfigError, compose_config
from jaxcb.engine import Engine
from jaxcb.kernels.attention.quantization import quantized_max
from jaxcb.kv_cache import plan_kv_cache
from jaxcb.kv_scales import calibration_token_ids, checkpoint_kv_scales
from jaxcb.model.config import LlamaConfig
from jaxcb.sampling_params import SamplingParams
from test_kv_cache import FakeGpu  # a device that reports memory as a GPU does

INT8 = ("cache.dtype=int8", "attention.impl=cpu")
TINY = LlamaConfig(
    vocab_size=259, hidden_size=96, intermediate_size=200, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
    rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=2048, tie_word_embeddings=False,
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The lighthouse keeper said", "Numbers: 1, 2, 3,", "The lighthouse keeper said that the fog"]




@pytest.mark.parametrize("source", ["cpu", "gpu"])
def test_the_plan_holds_2x_bf16s_blocks_and_4x_f32s_at_8_bits(source):
    f32_block = TINY.kv_bytes_per_token(4) * 16  # a budget of 256 f32 blocks, exactly

    def blocks(dtype):
        cache = CacheConfig(block_size=16, dtype=dtype, cpu_kv_cache_gib=256 * f32_block / 2**30, memory_fraction=0.5)
        device = FakeGpu(limit=256 * f32_block, in_use=0) if source == "gpu" else None
        # max_num_seqs x max_model_len far past what the memory holds: the memory decides
        return plan_kv_cache(cache, TINY, max_model_len=64, max_num_seqs=100_000, device=device,
                             pool_fraction=0.5).num_blocks

    f32, bf16 = blocks("float32"), blocks("bfloat16")
    for dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
        assert blocks(dtype) == 2 * bf16 == 4 * f32, (dtype, blocks(dtype), bf16, f32)


@pytest.fixture(scope="module")
def int8_engine():
    return shared_engine(*INT8)


def test_scales_are_calibrated_on_the_shipped_text_per_layer_and_head_never_1(int8_engine):
    scales = int8_engine.kv_scales
    assert "calibrated on 256 tokens of jaxcb/data/kv_calibration.txt" in scales.source  # max_model_len 256
    assert scales.k.shape == scales.v.shape == (3, 2) and scales.k.dtype == np.float32
    assert np.all(scales.k > 0) and np.all(scales.k != 1.0) and np.all(scales.v != 1.0)
    assert len(np.unique(scales.k)) > 1, "one scale per (layer, KV head), not one for all"
    np.testing.assert_array_equal(np.asarray(int8_engine.runner.kv_cache.k_scale), scales.k)
    assert int8_engine.runner.kv_cache.k.dtype == jnp.int8


def test_int8_engine_generates_shares_prefixes_without_recompiles_or_leaks(int8_engine):
    first = generate_first_completions(int8_engine, PROMPTS, GREEDY)
    again = generate_first_completions(int8_engine, PROMPTS[::-1], GREEDY)[::-1]  # prefix hits this time
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert int8_engine.num_recompiles == 0
    pool = int8_engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "every block free or cached and unreferenced"


def test_swap_preemption_of_an_int8_cache_gives_the_tokens_of_no_preemption(int8_engine):
    """Blocks swapped out and back in are the raw int8 bytes with the same scales: the preempted
    sequences continue as if never preempted (as exact as batching allows: f32 sums in another order)."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    expected = generate_first_completions(int8_engine, prompts, params)
    small = make_engine(*INT8, "cache.num_blocks=17", "scheduler.preemption_mode=swap",
                        "cache.swap_space_gib=0.002", "cache.enable_prefix_caching=false")
    np.testing.assert_array_equal(small.kv_scales.k, int8_engine.kv_scales.k)  # the same calibration, bit for bit
    got = generate_first_completions(small, prompts, params)
    assert small.scheduler.num_swap_outs > 0
    same = sum(g.token_ids == e.token_ids for g, e in zip(got, expected))
    assert same >= len(prompts) - 1, f"only {same} of {len(prompts)} sequences kept their tokens through swap"
    assert small.block_pool.num_free_blocks == small.block_pool.num_blocks - 1
    assert small.scheduler.kv.host_pool.num_free_blocks == small.scheduler.kv.host_pool.num_blocks - 1


def test_the_scales_are_part_of_the_prefix_cache_root(int8_engine):
    def uncompiled(*overrides: str) -> Engine:  # calibrated and hashed at start-up; no step needed here
        return Engine(compose_config(BASE + overrides), compile_buckets=False, progress=False)

    other = uncompiled(*INT8, "cache.kv_calibration_tokens=64")  # other text, other scales
    assert not np.array_equal(other.kv_scales.k, int8_engine.kv_scales.k)
    assert other.prefix_cache_root != int8_engine.prefix_cache_root
    same = uncompiled(*INT8)
    assert same.prefix_cache_root == int8_engine.prefix_cache_root, "stable across restarts"
    assert uncompiled("cache.dtype=float32").prefix_cache_root != int8_engine.prefix_cache_root


def test_fp8_engine_on_cpu_through_the_xla_form_and_refused_by_the_cpu_kernel_by_name():
    engine = make_engine("cache.dtype=fp8_e4m3", "attention.impl=xla")
    out = generate_first_completions(engine, PROMPTS[:2], GREEDY)
    assert all(len(o.token_ids) == 12 for o in out) and engine.num_recompiles == 0
    with pytest.raises(ConfigError, match=r"cache\.dtype=fp8_e4m3 cannot be read by attention\.impl=cpu \(it reads "
                                          r"float32, bfloat16, int8\): .*attention\.impl=xla"):
        make_engine("cache.dtype=fp8_e4m3", "attention.impl=cpu")


def test_more_calibration_tokens_than_the_text_has_is_refused_naming_the_field(int8_engine):
    with pytest.raises(ConfigError, match=r"cache\.kv_calibration_tokens=100000 is more than the \d+ tokens"):
        calibration_token_ids(int8_engine.tokenizer, 100_000)
    ids = calibration_token_ids(int8_engine.tokenizer, 300)
    assert len(ids) == 300 and len(set(ids)) > 20, "real text, not random or repeated ids"


@pytest.fixture(scope="module")
def hf_dir_with_kv_scales(tmp_path_factory):
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("hf_kv_scales")
    make_hf_llama(str(path))
    write_word_tokenizer(str(path), 131)
    import json

    num_layers = json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
    save_file({**{f"model.layers.{i}.self_attn.k_scale": np.asarray(0.01 * (i + 1), np.float32)
                  for i in range(num_layers)},
               **{f"model.layers.{i}.self_attn.v_scale": np.asarray([0.02 * (i + 1)], np.float32)
                  for i in range(num_layers)}},
              os.path.join(path, "kv_scales.safetensors"))
    return path


def test_the_checkpoints_k_and_v_scales_are_used_broadcast_per_head(hf_dir_with_kv_scales):
    engine = make_engine("model=hf", f"model.checkpoint={hf_dir_with_kv_scales}", "model.dtype=float32", *INT8)
    scales = engine.kv_scales
    assert "from the checkpoint's k_scale/v_scale" in scales.source
    num_layers, num_kv_heads = scales.k.shape
    # fp8-e4m3 scales: the range they cover (x 448) in int8's units (/ 127)
    expected_k = np.repeat((0.01 * np.arange(1, num_layers + 1) * 448 / 127)[:, None], num_kv_heads, 1)
    np.testing.assert_allclose(scales.k, expected_k, rtol=1e-6)
    np.testing.assert_allclose(scales.v, 2 * expected_k, rtol=1e-6)
    out = generate_first_completions(engine, ["hello world"], GREEDY)
    assert len(out[0].token_ids) == 12


def test_checkpoint_scales_missing_for_a_layer_are_refused_naming_it(hf_dir_with_kv_scales, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    for f in os.listdir(hf_dir_with_kv_scales):
        shutil.copy(os.path.join(hf_dir_with_kv_scales, f), tmp_path)
    tensors = load_file(os.path.join(tmp_path, "kv_scales.safetensors"))
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, os.path.join(tmp_path, "kv_scales.safetensors"))
    cfg = LlamaConfig(**{**TINY.__dict__, "num_layers": len(tensors) // 2 + 1})
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.v_scale"):
        checkpoint_kv_scales(str(tmp_path), cfg, jnp.int8)


# --- SmolLM2: logits and greedy tokens against a bf16 cache -------------------------------------------

# The bounds docs/benchmarks.md states: max |delta logit| over 128 teacher-forced positions x the whole
# vocabulary, against the same model with a bf16 cache (measured: int8 2.2, fp8_e4m3 3.0 on 256 positions).
LOGIT_BOUNDS = {"int8": 3.0, "fp8_e4m3": 4.0}


@pytest.fixture(scope="module")
def smollm2_int8():
    return make_engine("model=smollm2", "model.dtype=float32", "engine.max_model_len=512", *INT8)


def test_smollm2_logits_with_an_8_bit_cache_stay_within_the_stated_bound_of_a_bf16_caches(smollm2_int8):
    from benchmarks.kv_quant import teacher_forced_logits, text_token_ids

    ids = text_token_ids(smollm2_int8, 128, offset=600)  # text the calibration did not see
    base = teacher_forced_logits(smollm2_int8, ids, "bfloat16")
    for dtype, bound in LOGIT_BOUNDS.items():
        logits = teacher_forced_logits(smollm2_int8, ids, dtype)
        delta = np.abs(logits - base).max()
        assert delta <= bound, f"{dtype}: max |delta logit| {delta:.3f} > {bound}"
        agree = np.mean(logits.argmax(-1) == base.argmax(-1))
        assert agree >= 0.9, f"{dtype}: the top token agrees at only {agree:.0%} of positions"
    assert np.abs(teacher_forced_logits(smollm2_int8, ids, "float32") - base).max() < 0.5


def test_smollm2_with_an_int8_cache_decodes_without_recompiles_and_calibrates_once(smollm2_int8):
    assert quantized_max(jnp.int8) * smollm2_int8.kv_scales.k.max() > 1.0, "real K ranges, not unit scales"
    out = generate_first_completions(smollm2_int8, ["What is the capital of France?", "Count to five:"],
                                     SamplingParams(max_tokens=16, temperature=0.0))
    assert all(o.token_ids for o in out) and smollm2_int8.num_recompiles == 0
