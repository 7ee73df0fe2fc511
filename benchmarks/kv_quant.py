"""How much an 8-bit KV cache changes a model's output, and what it costs, against a 16-bit cache.

Two measures, both on one model (SmolLM2 by default):

  logits     teacher-forced: a text prefilled through the model into a cache of each dtype, every
             position's logits compared with the bf16 cache's (max |delta logit| over positions and
             vocabulary). A prefill reads, at every position, the K/V the write just quantized: what
             decoding from that cache reads.
  agreement  greedy generation of N requests with the bf16 cache and with each 8-bit cache, in two
             engines of one process, side by side: requests whose tokens are identical; requests whose
             first differing token came where the bf16 run's top two candidates were within `tie`
             logprob of each other (a tie: either token is the model's answer); the rest. With the
             wall time of each run (the throughput ratio, the same requests and engine settings).

    python -m benchmarks.kv_quant [--requests 200] [--max-tokens 32] [--dtypes int8,fp8_e4m3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.config import compose_config
from jaxcb.engine import Engine
from jaxcb.kernels.attention import XLA, AttentionMetadata
from jaxcb.kernels.attention.quantization import QUANTIZED_CACHE_DTYPES, is_quantized
from jaxcb.kv_cache import allocate_kv_cache, default_cache_dtype
from jaxcb.kv_scales import calibrated_kv_scales, calibration_text
from jaxcb.model.llama import forward
from jaxcb.sampling_params import SamplingParams

SMOLLM2 = ("model=smollm2", "model.dtype=float32")
TOPICS = ("the sea", "a library", "winter", "bicycles", "volcanoes", "coffee", "a small town", "rain", "chess",
          "the moon", "bees", "bread", "trains", "music", "a forest", "mathematics", "a lighthouse", "snow",
          "gardens", "the desert")
FORMS = ("Write one sentence about {}.", "Give three facts about {}.", "What is the best thing about {}?",
         "Describe {} to a child.", "Write a short poem about {}.", "Explain why people like {}.",
         "List two questions someone might ask about {}.", "Tell me a story that begins with {}.",
         "Summarise what you know about {} in two sentences.", "What would a scientist say about {}?")


def workload(num_requests: int) -> list[str]:
    """`num_requests` distinct prompts: each template over each topic, then with a number appended."""
    prompts = [f.format(t) for f in FORMS for t in TOPICS]
    return [p if i < len(prompts) else f"{p} ({i // len(prompts)})"
            for i, p in ((i, prompts[i % len(prompts)]) for i in range(num_requests))]


def teacher_forced_logits(engine: Engine, token_ids: list[int], cache_dtype: str) -> np.ndarray:
    """f32[T, V]: every position's logits for `token_ids` prefilled in one step into a fresh cache of
    `cache_dtype` (8-bit: calibrated as the engine would), through the engine's backend and weights
    (fp8 through the xla attention form where the engine's cannot read it)."""
    backend, weights, cfg = engine.runner.backend, engine.runner.weights, engine.model_config
    dtype = default_cache_dtype(cache_dtype, cfg.dtype)
    if backend.attention.cache_dtypes is not None and not set(backend.attention.cache_dtypes) >= {
            cache_dtype if is_quantized(cache_dtype) else dtype.name}:
        backend = dataclasses.replace(backend, attention=XLA)
    block_size = engine.cache_plan.block_size
    scales = None
    if is_quantized(dtype):
        s = calibrated_kv_scales(backend, weights, cfg, engine.tokenizer, engine.cfg.cache.kv_calibration_tokens,
                                 block_size, dtype, default_cache_dtype("auto", cfg.dtype))
        scales = (s.k, s.v)
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    cache = allocate_kv_cache(cfg, num_blocks + 1, block_size, dtype, None, backend.attention.zeros_fn, scales)
    md = AttentionMetadata(jnp.arange(n, dtype=jnp.int32) + block_size, jnp.asarray([0, n], jnp.int32),
                           jnp.asarray([n], jnp.int32), jnp.arange(1, num_blocks + 1, dtype=jnp.int32)[None],
                           jnp.int32(1))

    @jax.jit
    def logits(weights, ids, cache, md):
        hidden, _ = forward(backend, weights, ids, jnp.arange(ids.shape[0], dtype=jnp.int32), cache, md)
        return backend.logits(weights, hidden)

    return np.asarray(logits(weights, jnp.asarray(token_ids, jnp.int32), cache, md))


def text_token_ids(engine: Engine, num_tokens: int, offset: int = 0) -> list[int]:
    """Tokens of the shipped text from `offset` on (not the calibration's first tokens when offset > 0)."""
    ids = engine.tokenizer.encode(calibration_text())
    return ids[offset : offset + num_tokens]


def max_logit_delta(engine: Engine, dtypes, num_tokens: int = 256, offset: int = 512) -> dict[str, float]:
    base = teacher_forced_logits(engine, text_token_ids(engine, num_tokens, offset), "bfloat16")
    return {d: float(np.abs(teacher_forced_logits(engine, text_token_ids(engine, num_tokens, offset), d)
                            - base).max()) for d in dtypes}


@dataclasses.dataclass
class Agreement:
    identical: int
    ties: int  # the first difference came where the bf16 run's top two were within `tie` logprob
    differ: int
    wall_s: float
    tokens: int


def run_greedy(engine: Engine, prompts: list[str], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    wall = time.perf_counter() - t0
    return [done[i] for i in ids], wall


def compare(base, other, tie: float) -> tuple[int, int, int]:
    identical = ties = differ = 0
    for a, b in zip(base, other):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is None:
            identical += 1
            continue
        top = sorted(a.logprobs[first].values(), reverse=True)
        if len(top) >= 2 and top[0] - top[1] <= tie:
            ties += 1
        else:
            differ += 1
    return identical, ties, differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="int8,fp8_e4m3")
    ap.add_argument("--tie", type=float, default=None, help="logprob gap counted as a tie; default: the largest "
                    "measured |delta logit| of that dtype")
    ap.add_argument("overrides", nargs="*", default=list(SMOLLM2))
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        assert d in QUANTIZED_CACHE_DTYPES, d
    common = ("scheduler.max_num_seqs=32", "scheduler.max_num_batched_tokens=512", "engine.max_model_len=256",
              "engine.sampling_variants=[greedy,full]", "engine.masked_sampling=false",
              "engine.prompt_logprobs=false", *args.overrides)
    prompts = workload(args.requests)
    results = {}
    base_engine = Engine(compose_config(("cache.dtype=bfloat16", *common)), progress=False)
    deltas = max_logit_delta(base_engine, dtypes)
    print(json.dumps({"max_abs_delta_logit": deltas}), flush=True)  # as it goes: a long run keeps what it has
    run_greedy(base_engine, prompts[:16], args.max_tokens)  # warm-up: whatever compiles on first use
    base, base_wall = run_greedy(base_engine, prompts, args.max_tokens)
    tokens = sum(len(o.token_ids) for o in base)
    results["bfloat16"] = {"wall_s": round(base_wall, 2), "tokens": tokens}
    print(json.dumps({"bfloat16": results["bfloat16"]}), flush=True)
    del base_engine
    for d in dtypes:
        attention = () if d == "int8" or jax.default_backend() != "cpu" else ("attention.impl=xla",)
        engine = Engine(compose_config((f"cache.dtype={d}", *common, *attention)), progress=False)
        run_greedy(engine, prompts[:16], args.max_tokens)
        out, wall = run_greedy(engine, prompts, args.max_tokens)
        tie = args.tie if args.tie is not None else deltas[d]
        identical, ties, differ = compare(base, out, tie)
        results[d] = {"max_abs_delta_logit": round(deltas[d], 4), "tie_logprob_gap": round(tie, 4),
                      "identical": identical, "ties": ties, "differ": differ, "wall_s": round(wall, 2),
                      "throughput_vs_bf16": round(base_wall / wall, 3), "attention": engine.runner.backend.attention.name}
        print(json.dumps({d: results[d]}), flush=True)
        del engine
    print(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens, "platform": jax.default_backend(),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
