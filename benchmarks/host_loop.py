"""The engine's host work alone, without a model: the scheduler, the step input builder and the
output processor run the steps of `bench.task=overhead`'s workload in the engine's async order,
the sampled tokens drawn from a seeded generator. CPU time (this thread's) of each part, a step
and an output token, the best of `--rounds`; no device step competes with it, so it reads the
same from one minute to the next where the engine's wall time does not.

    python benchmarks/host_loop.py                       # this checkout
    python benchmarks/host_loop.py --against /tmp/base   # and another one (git worktree add /tmp/base REV), in turns

The sizes are what `model=tiny` resolves to on CPU (64 sequences, a 512-token budget, 16-token
blocks, runs of 4, max_model_len 2,048) and the byte tokenizer; `--rounds` runs of the whole
workload. Not timed: turning the sampled tokens into the runner's output (the device's copy).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import time

MAX_NUM_SEQS, BUDGET, BLOCK_SIZE, BLOCK_GROWTH, MAX_MODEL_LEN, NUM_BLOCKS = 64, 512, 16, 4, 2048, 8193
PARTS = ("schedule", "build", "commit", "update", "process", "finish")


def run_workload() -> tuple[int, int, collections.Counter]:
    """(steps, output tokens, CPU seconds by part) of one run of the workload."""
    from jaxcb.benchmark import make_workload
    from jaxcb.config import BenchConfig, SchedulerConfig
    from jaxcb.core.block_pool import BlockPool
    from jaxcb.core.scheduler import Scheduler
    from jaxcb.core.sequence import Sequence, SequenceId
    from jaxcb.core.step import RunnerOutput, SampledToken
    from jaxcb.output import OutputKind, OutputProcessor, RequestGroup
    from jaxcb.runner.buckets import Buckets, default_token_buckets
    from jaxcb.runner.slots import SlotTable
    from jaxcb.runner.step_inputs import StepInputBuilder
    from jaxcb.sampling_params import SamplingParams
    from jaxcb.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    items = make_workload(BenchConfig(), tokenizer.vocab_size, MAX_MODEL_LEN)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET),
                          BlockPool(NUM_BLOCKS), BLOCK_SIZE, MAX_MODEL_LEN, block_growth=BLOCK_GROWTH)
    output = OutputProcessor(tokenizer, tuple(tokenizer.eos_token_ids), MAX_MODEL_LEN)
    buckets = Buckets(tuple(default_token_buckets(BUDGET, "cpu", MAX_NUM_SEQS)), (), (MAX_MODEL_LEN // BLOCK_SIZE,),
                      MAX_NUM_SEQS)
    builder = StepInputBuilder(buckets, BLOCK_SIZE, tokenizer.vocab_size, 8, 4, lambda variant: variant,
                               SlotTable(2 * MAX_NUM_SEQS))
    for i, item in enumerate(items):  # as Engine.add_request and bench's run_offline make them
        rid, params = str(i), SamplingParams(temperature=0, max_tokens=item.output_len, ignore_eos=True)
        group = RequestGroup(rid, None, list(item.prompt_token_ids), params, OutputKind.FINAL_ONLY)
        group.seqs.append(Sequence(seq_id=SequenceId(rid, 0), prompt_token_ids=list(item.prompt_token_ids),
                                   sampling_params=params, eos_token_ids=tuple(tokenizer.eos_token_ids), seed=i,
                                   group_id=rid))
        output.add(group)
        scheduler.add_request(group.seqs[0])
    rng, seconds, num_steps, in_flight = random.Random(0), collections.Counter(), 0, None
    clock = time.thread_time

    def timed(part, f, *args):
        t0 = clock()
        result = f(*args)
        seconds[part] += clock() - t0
        return result

    while output.groups or in_flight is not None:  # Engine.step_with_stats, async scheduling
        out = timed("schedule", scheduler.schedule)
        dispatched = None
        if out.scheduled:
            timed("build", builder.build, out, None)
            timed("commit", scheduler.commit, out)
            dispatched, num_steps = out, num_steps + 1
        done, in_flight = in_flight, dispatched
        if done is not None:  # the previous step's tokens reach the host
            runner_out = RunnerOutput({s.seq_id: SampledToken(rng.randrange(32, 127)) for s in done.scheduled
                                       if s.samples})
            new_tokens = timed("update", scheduler.update, done, runner_out)
            _, stops = timed("process", output.process, new_tokens)
            for seq, status in stops:
                timed("finish", scheduler.finish, seq.seq_id, status)
    return num_steps, sum(item.output_len for item in items), seconds


def best_of(rounds: int) -> dict:
    runs = [run_workload() for _ in range(rounds)]
    num_steps, num_tokens, seconds = min(runs, key=lambda r: sum(r[2].values()))
    us = {part: 1e6 * seconds[part] / num_steps for part in PARTS}
    return dict(num_steps=num_steps, num_output_tokens=num_tokens, us_per_step=us,
                host_us_per_step=sum(us.values()), host_us_per_output_token=1e6 * sum(seconds.values()) / num_tokens)


def describe(name: str, r: dict) -> str:
    parts = ", ".join(f"{part} {r['us_per_step'][part]:.0f}" for part in PARTS)
    return (f"{name}: {r['host_us_per_step']:.0f} us a step, {r['host_us_per_output_token']:.2f} us an output token "
            f"({r['num_steps']} steps; us a step: {parts})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="runs of the workload; the least CPU time is kept")
    parser.add_argument("--against", help="another checkout, measured in its own process in turns with this one")
    parser.add_argument("--json", action="store_true", help="print one JSON line (what --against reads)")
    args = parser.parse_args()
    if args.against is None:
        r = best_of(args.rounds)
        print(json.dumps(r) if args.json else describe("this checkout", r))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results: dict[str, list[dict]] = {"base": [], "this": []}
    for i in range(2):  # base, this, this, base: a slow spell hurts both
        order = [("base", args.against), ("this", here)]
        for name, tree in order if i == 0 else order[::-1]:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--rounds", str(args.rounds), "--json"],
                                  env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)), cwd=tree,
                                  check=True, capture_output=True, text=True)
            results[name].append(json.loads(proc.stdout.splitlines()[-1]))
    best = {name: min(rs, key=lambda r: r["host_us_per_step"]) for name, rs in results.items()}
    for name, tree in (("base", args.against), ("this", here)):
        print(describe(f"{name} ({tree})", best[name]))
    print(f"this / base host time a step: {best['this']['host_us_per_step'] / best['base']['host_us_per_step']:.2f}")


if __name__ == "__main__":
    main()
