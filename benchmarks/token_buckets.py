"""Offline throughput with two lists of token buckets: two engines in one process, the same workload
in turns (fresh prompts each round, the order flipped every round), so that both see the same spells
of other work on the machine.

    python benchmarks/token_buckets.py --rounds 4 --a "[1,2,3,4,6,8,12,16,24,32,48,64]" \\
        --b "[1,2,4,8,16,32,64]" -- model=smollm2 bench.num_requests=64

Prints each run's output tokens/s and the median of B / A over the rounds. What a bucket list costs
at start-up is the other half of the choice: `benchmarks/startup_time.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxcb.benchmark import make_workload, run_offline, with_fresh_prompts  # noqa: E402
from jaxcb.config import compose_config  # noqa: E402
from jaxcb.engine import LLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="engine.token_buckets of engine A, e.g. [1,2,4]")
    parser.add_argument("--b", required=True, help="engine.token_buckets of engine B")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both engines and the bench workload")
    args = parser.parse_args()
    cfgs = {name: compose_config([*args.overrides, f"engine.token_buckets={buckets}"])
            for name, buckets in (("A", args.a), ("B", args.b))}
    llms = {name: LLM(cfg) for name, cfg in cfgs.items()}
    engine = llms["A"].engine
    items = make_workload(cfgs["A"].bench, engine.model_config.vocab_size, engine.max_model_len)
    rates: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(args.rounds):
        round_items = with_fresh_prompts(items, engine.model_config.vocab_size, i)
        for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
            result = run_offline(llms[name], round_items, "fcfs")
            rates[name].append(result.output_tokens_per_s)
            print(f"round {i + 1}, {name}: {result.output_tokens_per_s:,.1f} out tok/s", flush=True)
    ratios = [b / a for a, b in zip(rates["A"], rates["B"])]
    print(f"B / A: median {statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
