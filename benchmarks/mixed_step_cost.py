"""What a mixed step (one prefill chunk plus decodes) costs per token against pure prefill and pure
decode steps of the same token count; and, with `--trace`, what steps each policy takes on a workload.

    python benchmarks/mixed_step_cost.py                          # the cost table, the engine bench.py builds
    python benchmarks/mixed_step_cost.py --trace                  # + fcfs and static steps on bench.workload
    python benchmarks/mixed_step_cost.py --trace -- bench.workload=exp-output bench.scale=1 bench.output_cap=32
    python benchmarks/mixed_step_cost.py -- scheduler.max_num_partial_prefills=2   # any Hydra overrides

The cost table: the engine is driven into a known state (D requests of `--context` prompt tokens,
all decoding), then given prompts to prefill; the step the scheduler makes next is recorded with
its inputs (`step_replay.py`'s way). The cases, for each N in `--tokens`:
  decode N        N rows of one decode token (N <= scheduler.max_num_seqs)
  prefill N       one prompt of N tokens (and `prefill N/4x4`: four prompts of N/4)
  mixed N         d = min(N/2, 32) decodes and one prefill chunk of N - d (and `decode d`,
                  `prefill N-d`: the same work as two pure steps)
Every recorded step is then run again alone, `--rounds` times in a shuffled order each round
(the compiled step on the recorded inputs, waited for; its slot writes made first, untimed), and
the medians reported: the bucket (tokens x seqs x width x variant) it ran as (its first number is
the padded token count), ms, us per real token, and the mixed step's time over the pure steps' of
equal tokens and over the two pure steps that do the same work.

`--trace`: one engine per policy (fcfs, static) runs the workload of the `bench.*` settings
(`LLM.generate`, as `bench.task=policies` does); every step is classed as decode, prefill or mixed
(and a mixed step whose prefill tokens finish a prompt started in an earlier step, with nothing
admitted, as a "tail"); then each step is replayed alone and timed, and the steps, tokens,
padded tokens and replayed seconds of each class are printed beside the engine's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxcb.benchmark import make_workload, run_offline, with_policy  # noqa: E402
from jaxcb.config import compose_config  # noqa: E402
from jaxcb.engine import LLM  # noqa: E402
from jaxcb.sampling_params import SamplingParams  # noqa: E402


@contextlib.contextmanager
def record_with_schedule(runner):
    """Like step_replay.record_steps, with each step's SchedulerOutput: (out, key, args, writes)."""
    recorded: list = []
    build = runner.build_inputs

    def recording(out):
        built = build(out)
        # (key, args, writes); revisions before the persistent slot tables built (key, args): copy
        # this file into such a checkout to measure it the same way
        key, args, writes = built if len(built) == 3 else (*built, None)
        recorded.append((out, key, args, writes))
        return built

    runner.build_inputs = recording
    try:
        yield recorded
    finally:
        del runner.build_inputs


def padded_tokens(key) -> int:
    """A recorded step's token bucket (`BucketKey.num_tokens`; in revisions before named bucket keys,
    a plain tuple's first entry)."""
    return key.num_tokens if hasattr(key, "num_tokens") else key[0]


def composition(out) -> tuple[int, int, int]:
    """(decode rows, prefill tokens, prefill rows) of a scheduled step."""
    decodes = sum(1 for s in out.scheduled if s.start_position >= s.num_prompt_tokens)
    prefills = [len(s.token_ids) for s in out.scheduled if s.start_position < s.num_prompt_tokens]
    return decodes, sum(prefills), len(prefills)


def drain(engine) -> None:
    for request_id in list(engine.output.groups):
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def record_case(engine, num_decodes: int, prefill_lens: list[int], context: int, rng: random.Random):
    """The step the scheduler makes when `num_decodes` requests decode and `prefill_lens` prompts arrive."""
    vocab = engine.model_config.vocab_size
    draw = lambda n: [rng.randrange(0, 256 if vocab > 256 else vocab) for _ in range(n)]  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - context - 1, ignore_eos=True)
    drain(engine)
    for _ in range(num_decodes):
        engine.add_request(draw(context), params)
    while any(r.is_prefilling for r in engine.scheduler.sequences.values()):
        engine.step()
    engine.step()  # one decode step more: every decoder now has a token in flight, as in a busy engine
    for n in prefill_lens:
        engine.add_request(draw(n), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with record_with_schedule(engine.runner) as recorded:
        engine.step()
    drain(engine)
    out, key, args, writes = recorded[0]
    got = composition(out)
    want = (num_decodes, sum(prefill_lens), len(prefill_lens))
    if got != want:
        raise RuntimeError(f"expected (decodes, prefill tokens, prefill rows) {want}, the scheduler made {got}")
    return dict(key=key, args=args, writes=writes, tokens=out.num_scheduled_tokens)


def run_step(runner, key, args, writes) -> float:
    """Seconds of one compiled step on its recorded inputs (the slot writes made first, not timed)."""
    if hasattr(runner, "run"):  # the step as two executables (model, sampler)
        if writes is not None:
            runner.write_slots(writes)
            jax.block_until_ready(runner.slot_state)
        t0 = time.perf_counter()
        jax.block_until_ready(runner.run(key, args)[0])
        return time.perf_counter() - t0
    exe = runner.executable(key)
    if not hasattr(runner, "slot_state"):  # an older revision: no slot state
        t0 = time.perf_counter()
        ids, _, _, runner.kv_cache = exe(runner.weights, runner.kv_cache, *args)
        jax.block_until_ready(ids)
        return time.perf_counter() - t0
    if writes is not None:
        runner.write_slots(writes)
        jax.block_until_ready(runner.slot_state)
    t0 = time.perf_counter()
    ids, _, _, runner.kv_cache, runner.slot_state = exe(runner.weights, runner.kv_cache, runner.slot_state, *args)
    jax.block_until_ready(ids)
    return time.perf_counter() - t0


def mixed_decodes(n: int, max_seqs: int) -> int:
    return min(n // 2, 32, max_seqs - 1)


def cost_table(engine, token_counts: list[int], context: int, rounds: int, seed: int) -> None:
    rng = random.Random(seed)
    sched = getattr(engine, "scheduler_config", engine.cfg.scheduler)  # limits in force (older trees: the config)
    max_seqs = sched.max_num_seqs
    budget = sched.max_num_batched_tokens
    shapes: dict[str, tuple[int, list[int]]] = {}  # name -> (decodes, prefill lengths)
    for n in sorted(token_counts):
        if n > budget:
            continue
        if n <= max_seqs:
            shapes[f"decode {n}"] = (n, [])
        shapes[f"prefill {n}"] = (0, [n])
        if n >= 8:
            shapes[f"prefill {n // 4}x4"] = (0, [n // 4] * 4)
        d = mixed_decodes(n, max_seqs)
        shapes[f"mixed {n}"] = (d, [n - d])
        # the same work as two pure steps: what running decodes and prefills apart would cost
        shapes.setdefault(f"decode {d}", (d, []))
        shapes.setdefault(f"prefill {n - d}", (0, [n - d]))
    cases = {name: record_case(engine, d, lens, context, rng) for name, (d, lens) in shapes.items()}
    runner = engine.runner
    times: dict[str, list[float]] = defaultdict(list)
    names = list(cases)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            c = cases[name]
            times[name].append(run_step(runner, c["key"], c["args"], c["writes"]))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\n{rounds} rounds, medians; decoders' context {context} tokens; "
          f"budget {budget}, max_num_seqs {max_seqs}")
    print("| case | decodes + prefill tokens | bucket (T x R x W x variant) | ms | us / token "
          "| mixed / prefill N | mixed / decode N | mixed / (decode d + prefill N-d, two steps) |")
    print("|---|---|---|---|---|---|---|---|")
    order = sorted(cases, key=lambda k: (cases[k]["tokens"], ("decode", "prefill", "mixed").index(k.split()[0]), k))
    for name in order:
        c, (d, lens) = cases[name], shapes[name]
        n, ms = c["tokens"], 1e3 * med[name]
        ratios = ["", "", ""]
        if name.startswith("mixed"):
            ratios = [f"{med[name] / med[pure]:.2f}x" if pure in med else "-"
                      for pure in (f"prefill {n}", f"decode {n}")]
            ratios.append(f"{med[name] / (med[f'decode {d}'] + med[f'prefill {n - d}']):.2f}x")
        print(f"| {name} | {d} + {n - d} | {'x'.join(map(str, c['key']))} | {ms:.2f} | {1e3 * ms / n:.1f} | "
              + " | ".join(ratios) + " |")


def _seq_id(s):
    """A scheduled sequence's id in this tree (`seq_id`) or in older ones (`request_id`)."""
    return s.seq_id if hasattr(s, "seq_id") else s.request_id


def classify(out, started: set) -> str:
    """decode / prefill / mixed, and "tail": a step whose only prefill finishes a prompt begun earlier."""
    decodes, prefill_tokens, _ = composition(out)
    prefilling = [s for s in out.scheduled if s.start_position < s.num_prompt_tokens]
    tail = bool(prefilling) and all(_seq_id(s) in started for s in prefilling)
    started.update(_seq_id(s) for s in prefilling)
    if not prefill_tokens:
        return "decode"
    if tail:
        return "mixed, prefill tail only" if decodes else "prefill tail only"
    return "mixed" if decodes else "prefill"


def trace(overrides: list[str]) -> None:
    cfg = compose_config(overrides)
    engines = {p: LLM(with_policy(cfg, p)) for p in ("fcfs", "static")}
    first = engines["fcfs"].engine
    items = make_workload(cfg.bench, first.model_config.vocab_size, first.max_model_len)
    print(f"\nworkload {cfg.bench.workload}: {len(items)} requests, {sum(len(w.prompt_token_ids) for w in items)} "
          f"prompt and {sum(w.output_len for w in items)} output tokens")
    for policy, llm in engines.items():
        runner = llm.engine.runner
        with record_with_schedule(runner) as recorded:
            result = run_offline(llm, items, policy)
        rows: dict[str, list] = defaultdict(lambda: [0, 0, 0, 0, 0.0])  # steps, decodes, prefill, padded, s
        buckets: dict[str, dict] = defaultdict(lambda: defaultdict(int))
        started: set = set()
        for out, key, args, writes in recorded:
            name = classify(out, started)
            decodes, prefill_tokens, _ = composition(out)
            took = run_step(runner, key, args, writes)
            row = rows[name]
            row[0] += 1
            row[1] += decodes
            row[2] += prefill_tokens
            row[3] += padded_tokens(key)
            row[4] += took
            buckets[name][padded_tokens(key)] += 1
        replayed = sum(r[4] for r in rows.values())
        print(f"\n{policy}: engine {result.seconds:.2f} s, {len(recorded)} steps; replayed alone {replayed:.2f} s "
              f"(host share {1 - replayed / result.seconds:.0%}); {result.output_tokens_per_s:,.0f} out tok/s")
        print("| steps of kind | steps | decode rows | prefill tokens | padded tokens | padding | replayed s "
              "| ms / step | us / real token | token buckets (T: steps) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, (steps, dec, pre, padded, secs) in sorted(rows.items()):
            real = dec + pre
            bucket_text = ", ".join(f"{t}: {k}" for t, k in sorted(buckets[name].items()))
            print(f"| {name} | {steps} | {dec} | {pre} | {padded} | {1 - real / padded:.0%} | {secs:.2f} | "
                  f"{1e3 * secs / steps:.2f} | {1e6 * secs / real:.1f} | {bucket_text} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512],
                        help="step sizes N in tokens (those past the budget are skipped)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding request")
    parser.add_argument("--rounds", type=int, default=30, help="timed runs of each step, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true", help="also: each policy's steps on the bench workload")
    parser.add_argument("--no-table", action="store_true", help="skip the cost table")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the engine and bench config (after --)")
    a = parser.parse_args()
    if not a.no_table:
        llm = LLM(compose_config(a.overrides))
        cost_table(llm.engine, a.tokens, a.context, a.rounds, a.seed)
        del llm
    if a.trace:
        trace(a.overrides)


if __name__ == "__main__":
    main()
