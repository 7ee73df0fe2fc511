"""What multi-LoRA costs, as ratios measured side by side in one run:

    base          no LoRA compiled in (the plain engine)
    lora-base     LoRA compiled in (lora.max_loras slots), every request on the base model
    lora-mixed    LoRA compiled in, the requests spread round-robin over `--adapters` random adapters

Each runs the same requests (random token prompts, greedy, ignore_eos) through `LLM.generate`, after
a warm-up batch, in `--rounds` rounds that take the three in turn (the order rotated each round): the
figures are each run's median over the rounds of its mean engine step time (wall time over steps)
and output tokens/s, so that other work on a shared machine weighs on all three alike.
The adapters are random PEFT directories (rank `--rank`, every q/k/v/o/gate/up/down projection).

    python benchmarks/lora.py --model small --adapters 8
    python benchmarks/lora.py --model smollm2 --adapters 8

`--runs` picks some of the three: the A/B of two checkouts takes one run of each in turn (each copy of
the script imports its own checkout), e.g. decode-heavy steps with 8 adapters mixed:

    git worktree add /tmp/before <rev>
    for i in 1 2 3 4 5; do for tree in /tmp/before .; do
      python $tree/benchmarks/lora.py --model smollm2 --runs lora-mixed --tokens 64 --rounds 1; done; done
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxcb.config import compose_config  # noqa: E402
from jaxcb.engine import LLM  # noqa: E402
from jaxcb.model.config import resolve_llama_config  # noqa: E402
from jaxcb.model.lora import MODULES, module_dims  # noqa: E402
from jaxcb.sampling_params import SamplingParams  # noqa: E402


def write_random_adapter(path: str, arch, rank: int, seed: int) -> None:
    """A PEFT LoRA directory with random A and B for every projection of every layer."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for m, (d_in, d_out) in module_dims(arch).items():
            parent = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * 0.02).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * 0.02).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(MODULES), "bias": "none"}, f)


def run(llm: LLM, prompts: list[list[int]], lora: list, num_tokens: int) -> tuple[float, float]:
    """(mean step seconds, output tokens per second) of one batch."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    steps = llm.engine.last_stats.num_steps
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora=lora)
    seconds = time.perf_counter() - start
    return seconds / (llm.engine.last_stats.num_steps - steps), len(prompts) * num_tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", default="base,lora-base,lora-mixed",
                    help="which runs, comma-separated (one alone: the A/B of two checkouts, each run in turn)")
    ap.add_argument("overrides", nargs="*", help="more config overrides, e.g. model.dtype=float32")
    args = ap.parse_args()
    common = [f"model={args.model}", f"scheduler.max_num_seqs={args.requests}", "engine.max_model_len=512",
              "cache.enable_prefix_caching=false", "cache.cpu_kv_cache_gib=1", *args.overrides]
    arch = resolve_llama_config(compose_config(common).model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, arch.vocab_size - 10, args.prompt_len).tolist() for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {f"a{i}": os.path.join(tmp, f"a{i}") for i in range(args.adapters)}
        for i, path in enumerate(adapters.values()):
            write_random_adapter(path, arch, args.rank, i)
        listed = ", ".join(f"{n}: '{p}'" for n, p in adapters.items())
        lora_cfg = [f"lora.adapters={{{listed}}}", f"lora.max_loras={args.adapters}", f"lora.max_rank={args.rank}"]
        wanted = args.runs.split(",")
        unknown = set(wanted) - {"base", "lora-base", "lora-mixed"}
        if unknown:
            ap.error(f"--runs: no run named {sorted(unknown)}; the runs are base, lora-base and lora-mixed")
        base = LLM(compose_config(common), progress=False) if "base" in wanted else None
        lora = LLM(compose_config(common + lora_cfg), progress=False) if set(wanted) - {"base"} else None
        names = list(adapters)
        runs = {"base": (base, [None] * len(prompts)), "lora-base": (lora, [None] * len(prompts)),
                "lora-mixed": (lora, [names[i % len(names)] for i in range(len(prompts))])}
        runs = {name: run_ for name, run_ in runs.items() if name in wanted}
        for llm, which in runs.values():  # warm-up: slots loaded, caches touched
            run(llm, prompts, which, args.tokens)
        samples: dict[str, list] = {name: [] for name in runs}
        order = list(runs)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[: r % len(order)]:
                samples[name].append(run(*runs[name][:1], prompts, runs[name][1], args.tokens))
        results = {name: (float(np.median([s for s, _ in xs])), float(np.median([t for _, t in xs])))
                   for name, xs in samples.items()}
    flags = sorted(set(open("/proc/cpuinfo").read().split()) & {"amx_bf16", "avx512_bf16", "avx512f"})
    print(f"model={args.model} {' '.join(args.overrides)}: {args.requests} requests x {args.prompt_len} prompt + "
          f"{args.tokens} output tokens, {args.adapters} adapters of rank {args.rank}, medians of {args.rounds} rounds; "
          f"CPU flags {', '.join(flags)}")
    print("| run | step ms | output tok/s | step time vs base |")
    print("|---|---|---|---|")
    for name, (step_s, tps) in results.items():
        ratio = f"{step_s / results['base'][0]:.2f}x" if "base" in results else "-"
        print(f"| {name} | {step_s * 1e3:.1f} | {tps:.0f} | {ratio} |")
    if "lora-mixed" in results and "lora-base" in results:
        print(f"{args.adapters} adapters mixed vs all base (LoRA compiled in): "
              f"{results['lora-mixed'][0] / results['lora-base'][0]:.2f}x")


if __name__ == "__main__":
    main()
