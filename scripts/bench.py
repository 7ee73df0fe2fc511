"""Engine benchmarks on a seeded workload; results are printed and written as JSON to the Hydra run dir.

    python scripts/bench.py                                   # offline throughput (fcfs)
    python scripts/bench.py bench.task=policies               # fcfs vs static on the same workload
    python scripts/bench.py bench.task=policies bench.repeats=3  # ... 3 pairs, order swapped each pair; the median
    python scripts/bench.py bench.task=overhead               # engine vs a replay of its compiled steps
    python scripts/bench.py bench.task=async                  # engine.async_scheduling on vs off
    python scripts/bench.py bench.task=flops                  # model FLOP/s against a matmul measured here
    python scripts/bench.py bench.task=flops bench.repeats=5  # ... over 5 runs, each between ceiling readings
    python scripts/bench.py bench.mode=serving bench.request_rate=20   # TTFT/TPOT/ITL/E2E, goodput
    python scripts/bench.py bench.mode=serving bench.backend=http      # the same, over HTTP to a real server
    python scripts/bench.py -m scheduler.max_num_seqs=16,32,64 # a sweep (one run per value)
"""

import contextlib
import json
import logging
import os

import httpx
import hydra
from hydra.core.hydra_config import HydraConfig

from jaxcb.benchmark import (
    describe_speculation,
    ideal_static_ratio,
    make_workload,
    median_pair,
    model_flops,
    run_offline,
    run_policy_pairs,
    run_serving,
    with_async,
    with_fresh_prompts,
    with_policy,
)
from jaxcb.bench_http import run_serving_http, serve_in_thread
from jaxcb.cli import checked_overrides, entry_point
from jaxcb.config import Config
from jaxcb.engine import LLM
from jaxcb.model.config import resolve_llama_config


def host_overhead():
    """`benchmarks.step_replay.host_overhead`: lab code that lives beside the package, in this repository."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.step_replay import host_overhead

    return host_overhead

log = logging.getLogger("jaxcb.bench")


def describe_serving(name: str, r: dict) -> str:
    return (
        f"{name}: {r['output_tokens_per_s']:,.0f} out tok/s, {r['requests_per_s']:.2f} req/s, goodput "
        f"{r['goodput_requests_per_s']:.2f} req/s; TTFT p50/p99 {1e3 * r['ttft_s']['p50']:.0f}/"
        f"{1e3 * r['ttft_s']['p99']:.0f} ms, TPOT mean {1e3 * r['tpot_s']['mean']:.1f} ms"
    ) + describe_speculation(r)


def as_json(r) -> dict:
    return dict(vars(r), output_tokens_per_s=r.output_tokens_per_s)


def describe(r) -> str:
    return (
        f"{r.policy}: {r.output_tokens} output tokens in {r.seconds:.2f} s = {r.output_tokens_per_s:,.0f} out tok/s "
        f"({r.total_tokens_per_s:,.0f} total tok/s), {r.num_steps} steps, {r.num_preemptions} preemptions, "
        f"{r.num_recompiles} recompiles"
    ) + describe_speculation(vars(r))


@checked_overrides
@hydra.main(version_base=None, config_path="../conf", config_name="config")
@entry_point
def main(cfg: Config) -> None:
    b = cfg.bench
    result: dict = {"task": b.task, "workload": b.workload, "num_requests": b.num_requests, "scale": b.scale}
    if b.backend == "http":
        result["serving"] = {"http": serve_over_http(cfg)}
        write_result(result)
        return
    if b.task == "policies":
        engines = {p: LLM(with_policy(cfg, p)) for p in ("fcfs", "static")}  # compile first: timing starts after
    elif b.task == "async":
        engines = {name: LLM(with_async(cfg, on)) for name, on in (("async", True), ("sync", False))}
    else:
        engines = {cfg.scheduler.policy: LLM(cfg)}
    first = next(iter(engines.values())).engine
    items = make_workload(b, first.model_config.vocab_size, first.max_model_len)
    print(f"workload: {len(items)} requests, {sum(len(w.prompt_token_ids) for w in items)} prompt tokens, "
          f"{sum(w.output_len for w in items)} output tokens")
    if b.mode == "serving" and b.task in ("offline", "policies", "async"):
        runs = {name: run_serving(llm, items, b) for name, llm in engines.items()}
        for name, r in runs.items():
            print(describe_serving(name, r))
        result["serving"] = runs
    elif b.task == "flops":
        # Repeats get fresh prompts of the same lengths: no cached prefix skips their prefill.
        workloads = [items] + [with_fresh_prompts(items, first.model_config.vocab_size, b.seed + i)
                               for i in range(1, b.repeats)]
        result["flops"] = f = model_flops(next(iter(engines.values())), workloads)
        if b.repeats > 1:
            print(f"model / ceiling of the {b.repeats} runs: "
                  + ", ".join(f"{r['model_over_ceiling']:.2f}" for r in f["runs"]) + "; model / sustained matmul: "
                  + ", ".join(f"{r['model_over_sustained_matmul']:.2f}" for r in f["runs"]) + "; the median run:")
        ceilings = ", ".join(f"{shape}: {v / 1e9:.1f}" for shape, v in f["matmul_ceiling_flops_per_s"].items())
        print(f"{f['output_tokens_per_s']:,.0f} out tok/s; model {f['model_flops_per_s'] / 1e9:.1f} GFLOP/s "
              f"({f['attention_flops'] / (f['linear_flops'] + f['attention_flops']):.0%} of it attention); "
              f"matmul ceiling GFLOP/s {ceilings} (the first: best of before/after the run, "
              f"{' / '.join(f'{v / 1e9:.1f}' for v in f['ceiling_before_and_after_flops_per_s'])}); "
              f"model / ceiling {f['model_over_ceiling']:.2f}; the matmul's mean rate over as long right after "
              f"the run {f['sustained_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, model / that "
              f"{f['model_over_sustained_matmul']:.2f}")
    elif b.task == "overhead":
        result["overhead"] = o = host_overhead()(next(iter(engines.values())), items)
        print(f"engine {o['engine_s']:.2f} s vs replayed steps {o['step_replay_s']:.2f} s over {o['num_steps']} steps: "
              f"host overhead {100 * o['host_overhead_fraction']:.0f}% of engine time, {o['host_us_per_step']:.0f} us "
              f"a step, {o['host_us_per_output_token']:.1f} us an output token")
        print("replayed time by bucket (tokens x seqs x width): " + "; ".join(
            f"{key}: {v['steps']} steps, median {v['median_ms']:.1f} ms, {v['total_s']:.1f} s"
            for key, v in o["per_bucket"].items()))
    elif b.task == "policies":
        pairs = run_policy_pairs(engines, items, b.repeats, first.model_config.vocab_size, b.seed)
        for i, pair in enumerate(pairs):
            for p in pair.order:
                print(("" if b.repeats == 1 else f"pair {i + 1}, ") + describe(pair.runs[p]))
        middle = median_pair(pairs)
        result["runs"] = {p: as_json(r) for p, r in middle.runs.items()}
        result["pairs"] = [{"order": list(pair.order), "fcfs_over_static": pair.fcfs_over_static,
                            "runs": {p: as_json(r) for p, r in pair.runs.items()}} for pair in pairs]
        ideal = ideal_static_ratio(items, first.scheduler_config.max_num_seqs)
        result.update(fcfs_over_static=middle.fcfs_over_static, ideal_ratio=ideal)
        each = "" if b.repeats == 1 else (f", the median of {b.repeats} pairs: "
                                          + ", ".join(f"{pair.fcfs_over_static:.2f}x" for pair in pairs))
        print(f"fcfs / static throughput: {middle.fcfs_over_static:.2f}x{each} "
              f"(ideal ratio the lengths allow: {ideal:.2f}x)")
    else:
        runs = {p: run_offline(llm, items, p) for p, llm in engines.items()}
        for r in runs.values():
            print(describe(r))
        result["runs"] = {p: as_json(r) for p, r in runs.items()}
        if b.task == "async":
            ratio = runs["async"].output_tokens_per_s / runs["sync"].output_tokens_per_s
            result["async_over_sync"] = ratio
            print(f"async / sync throughput: {ratio:.2f}x")
    write_result(result)


def serve_over_http(cfg: Config) -> dict:
    """bench.backend=http: the workload as streaming OpenAI calls, to bench.url or to a server started here."""
    b = cfg.bench
    with contextlib.ExitStack() as stack:
        url = b.url or stack.enter_context(serve_in_thread(cfg))
        r = httpx.get(url + "/v1/models", timeout=30).json()
        # Prompt token ids must fit the served model: the same model.* overrides as the server's.
        model = resolve_llama_config(cfg.model)
        items = make_workload(b, model.vocab_size, cfg.engine.max_model_len or model.max_position_embeddings)
        print(f"workload: {len(items)} requests to {url} ({r['data'][0]['id']})")
        result = run_serving_http(url, items, b)
    print(describe_serving("http", result) + f"; {result['num_errors']} errors")
    return result


def write_result(result: dict) -> None:
    out_dir = HydraConfig.get().runtime.output_dir
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"results: {os.path.join(out_dir, 'bench.json')}")


if __name__ == "__main__":
    main()
