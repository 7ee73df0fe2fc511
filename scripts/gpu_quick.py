"""The quick GPU check: the headline figures in one command of at most 180 s on an H200.

    scripts/gpu_check.sh --quick --out DIR            # DIR/gpu_quick.json and DIR/gpu_quick.log, nothing else
    scripts/gpu_check.sh --quick --dry-run --out DIR  # the plan, then the same stages on the CPU at tiny shapes

Stages, in order, each on what the engine itself runs (docs/gpu.md says what to read):
  preflight   the engine's XLA memory pool set before JAX starts; versions, devices, imports, ptxas
  bandwidth   device copy bandwidth: the roofline below
  kernel      the Pallas kernel against the reference at one mixed batch; registers and spills of
              XLA's own PTX for it (ptxas -v)
  startup     the engine at the GPU defaults (scheduler limits, buckets, cache from
              cache.memory_fraction), llama8b with random bf16 weights, every compile included
  decode      that engine's compiled step at 32 and 128 decoding sequences of 1k and 4k tokens: the
              engine's buckets, table width and split-KV; ms/step against weights + K/V at the copy bandwidth
  serve       that engine on 256 lognormal (ShareGPT-like) requests: output tok/s

Before anything runs, the plan (`h200_plan`: each stage's expected seconds on an H200 and what the
figure is made of) is printed, and a plan past the budget stops the check with a sentence naming
the stage to cut. The watchdog ends the run at the budget, counted from when gpu_check.sh
started, with the results written. XLA's dumps and the compilation cache go to --scratch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_check, gpu_stages, gpu_quick_stages

import gpu_quick_stages as quick_stages  # noqa: E402  (imports no jax: the plan test reads this module without a venv)

BUDGET_S = 180.0  # command time on the H200, gpu_check.sh's wheel install included
DRY_RUN_BUDGET_S = 900.0  # the CPU at tiny shapes: what the watchdog allows a dry run (2 shared cores)
WATCHDOG_RESERVE_S = 3.0  # of the budget, kept for the watchdog to write the results and exit

# What the plan is made of. The first run on an H200 (docs/gpu.md, 2026-12-05) took less than planned
# where it ran: preflight 4.3 s, bandwidth 4.0 s, kernel 6.0 s, start-up 46.3 s (its 20 compiles 31.1 s
# on 8 threads, 10.8 s each on one); the estimates stay until decode and serve have run too. Each says
# whether it is an estimate or read elsewhere, and gpu_quick.json and the log record what replaces it (each
# stage's seconds; the engine's start-up phases and compile seconds; the serve run's steps).
H200_MAX_NUM_BATCHED_TOKENS = 8192  # scheduler.max_num_batched_tokens=auto on a device of >= 64 GiB (256 seqs)
COMPILE_S = 12.0  # estimate: one llama8b step bucket on one thread (XLA's passes, GEMM autotuning, the kernel)
COMPILE_SPEEDUP = 4.0  # estimate: the engine's 8 compile threads on 16 cores, XLA's own threads, one GPU to autotune
WEIGHTS_S = 8.0  # estimate: random 8B init on the device (a compile per parameter shape), the backend's fusing
SERVE_STEP_MS = 5.0  # 15 GiB of weights at the ~4.3 TB/s copy rate seen on an H200 (3.5 ms) + 1.5 ms estimated
DECODE_STEP_MS = 15.0  # the decode batches' roofline steps are 4.5, 7.5, 7.5 and 19.5 ms at 4.3 TB/s: at ~70% of it
PREFILL_TFLOPS = 400.0  # 2 x 8e9 FLOP a prompt token at half the ~790 TFLOP/s bf16 matmul rate seen on an H200
# bench seed 0, 256 lognormal requests at scale 1 (jaxcb.benchmark.make_workload; a test pins them)
WORKLOAD_PROMPT_TOKENS, WORKLOAD_LONGEST_OUTPUT = 53_246, 2_638


@dataclasses.dataclass(frozen=True)
class Estimate:
    stage: str
    seconds: float
    made_of: str  # the parts of the figure and where each comes from


def h200_plan() -> list[Estimate]:
    """Each stage's expected seconds on an H200 (16 cores, a cold compilation cache)."""
    from jaxcb.runner.buckets import default_token_buckets

    num_buckets = len(default_token_buckets(H200_MAX_NUM_BATCHED_TOKENS, "gpu", max_num_seqs=256))
    num_compiles = num_buckets * len(quick_stages.VARIANTS)
    compile_s = num_compiles * COMPILE_S / COMPILE_SPEEDUP
    rows = quick_stages.decode_rows(dry_run=False)
    decode_steps = len(rows) * (1 + quick_stages.DECODE_REPEATS * quick_stages.DECODE_STEPS)
    serve_steps = WORKLOAD_LONGEST_OUTPUT + -(-WORKLOAD_PROMPT_TOKENS // H200_MAX_NUM_BATCHED_TOKENS)
    serve_s = serve_steps * SERVE_STEP_MS / 1e3 + WORKLOAD_PROMPT_TOKENS * 16e9 / (PREFILL_TFLOPS * 1e12)
    return [
        Estimate("setup", 2, "gpu_check.sh: 4 wheels installed (0.6 s measured on a CPU host), Python started"),
        Estimate("preflight", 8, "import jax, flax, jaxcb, triton (1.7 s on a CPU host, triton ~1 s); the CUDA "
                                 "client and its 90% pool (~5 s)"),
        Estimate("bandwidth", 3, "2 buffers: a random fill and a copy compiled (~0.5 s each), 100 copies of 4 GiB "
                                 "(0.2 s)"),
        Estimate("kernel", 10, "1 kernel compile through XLA's Triton (~4 s), the reference op by op (~4 s), "
                               "ptxas -v on the dumped PTX (~1 s)"),
        Estimate("startup", round(WEIGHTS_S + 2 + compile_s),
                 f"random weights {WEIGHTS_S:.0f} s; plan and allocate the cache ~2 s; {num_compiles} step compiles "
                 f"({num_buckets} buckets of a {H200_MAX_NUM_BATCHED_TOKENS}-token budget x "
                 f"{len(quick_stages.VARIANTS)} variants) x {COMPILE_S:.0f} s / {COMPILE_SPEEDUP:.0f} "
                 f"(compile threads)"),
        Estimate("decode", round(1 + decode_steps * DECODE_STEP_MS / 1e3),
                 f"{len(rows)} batches x {decode_steps // len(rows)} steps x ~{DECODE_STEP_MS:.0f} ms (weights + K/V "
                 f"at 4.3 TB/s, 5-20 ms), the block tables written once (~1 s)"),
        Estimate("serve", round(serve_s + 1),
                 f"{serve_steps:,} steps (the longest output, {WORKLOAD_LONGEST_OUTPUT:,} tokens, and the prefill "
                 f"chunks) x {SERVE_STEP_MS:.0f} ms; {WORKLOAD_PROMPT_TOKENS:,} prompt tokens at "
                 f"{PREFILL_TFLOPS:.0f} TFLOP/s"),
    ]


def check_plan(plan: list[Estimate], budget_s: float = BUDGET_S) -> str | None:
    """None if the plan fits the budget; else the sentence that says which stage to cut."""
    total = sum(e.seconds for e in plan)
    if total <= budget_s:
        return None
    excess = total - budget_s
    cuttable = [e for e in plan if e.stage not in ("setup", "preflight")] or plan
    enough = [e for e in cuttable if e.seconds >= excess]
    cut = min(enough, key=lambda e: e.seconds) if enough else max(cuttable, key=lambda e: e.seconds)
    return (f"the quick check's plan takes {total:.0f} s on an H200, {excess:.0f} s past its {budget_s:.0f} s "
            f"budget: cut the {cut.stage} stage ({cut.seconds:.0f} s: {cut.made_of}), or make it cheaper")


def format_plan(plan: list[Estimate], budget_s: float = BUDGET_S) -> str:
    lines = [f"## plan: expected seconds on an H200 (estimates, none measured yet; budget {budget_s:.0f} s)", "",
             "| stage | expected s | made of |", "|---|---|---|"]
    lines += [f"| {e.stage} | {e.seconds:.0f} | {e.made_of} |" for e in plan]
    lines.append(f"| total | {sum(e.seconds for e in plan):.0f} | of the {budget_s:.0f} s budget |")
    return "\n".join(lines)


def budget_left(args: argparse.Namespace) -> float:
    """The watchdog's budget: --budget, or what is left of the command's 180 s since gpu_check.sh started."""
    if args.budget is not None:
        return args.budget
    if args.dry_run:
        return DRY_RUN_BUDGET_S
    started = float(os.environ.get("GPU_CHECK_STARTED", time.time()))
    return BUDGET_S - (time.time() - started) - WATCHDOG_RESERVE_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="gpu_quick.json goes here (gpu_check.sh adds gpu_quick.log)")
    parser.add_argument("--scratch", help="XLA's dumps and the compilation cache (default: a new folder in /tmp)")
    parser.add_argument("--dry-run", action="store_true", help="the plan, then the CPU: interpreter, tiny shapes")
    parser.add_argument("--budget", type=float, help="watchdog seconds (default: 180 s from gpu_check.sh's start)")
    args = parser.parse_args()
    plan = h200_plan()
    print(format_plan(plan), flush=True)
    problem = check_plan(plan)
    if problem:
        sys.exit(f"refused: {problem}")
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import tempfile

    import gpu_check

    os.makedirs(args.out, exist_ok=True)
    scratch = args.scratch or tempfile.mkdtemp(prefix="jaxcb-gpu-quick-")
    handler = logging.StreamHandler(sys.stdout)  # the engine's start-up lines: limits, cache plan, compiles
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    engine_log = logging.getLogger("jaxcb")
    engine_log.addHandler(handler)
    engine_log.setLevel(logging.INFO)
    engine_log.propagate = False  # once, whatever handlers the root logger has
    check_args = argparse.Namespace(dry_run=args.dry_run, json=os.path.join(args.out, "gpu_quick.json"),
                                    out_dir=scratch, budget=budget_left(args))
    check = gpu_check.Check(check_args, stages=quick_stages, keep_previous=False)
    check.report.data["plan"] = [dataclasses.asdict(e) for e in plan]
    gpu_check.log(f"\n# jaxcb quick GPU check{' (dry run: CPU, interpret mode, tiny shapes)' if args.dry_run else ''}, "
                  f"watchdog at {check_args.budget:.0f} s, scratch {scratch}")
    sys.exit(check.run(list(quick_stages.STAGES)))


if __name__ == "__main__":
    main()
