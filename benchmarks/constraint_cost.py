"""What structured outputs cost: output tokens/s of one workload with and without a JSON schema, and the
unconstrained rows' tokens/s with one constrained row in their batch against none.

    python benchmarks/constraint_cost.py                 # SmolLM2-135M (its real 49,152-token vocabulary)
    python benchmarks/constraint_cost.py model=tiny      # any Hydra overrides of the engine's config

Three runs on one engine, in order, after a warm-up: (a) `--requests` unconstrained greedy requests;
(b) the same requests, each held to a JSON schema; (c) the same, with only the first request held to
the schema. Every request asks for `--max-tokens`; unconstrained ones ignore EOS so that they all run
that long, constrained ones stop where their JSON is complete. Each line reports output tokens per
second of wall time (and, for (c), of the unconstrained rows alone, until the last of them finished).
"""

from __future__ import annotations

import argparse
import time

from jaxcb import SamplingParams
from jaxcb.config import compose_config
from jaxcb.engine import Engine
from jaxcb.structured import from_structured_outputs

SCHEMA = {  # long enough to keep a row busy, bounded so that it ends
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 12},
        "summary": {"type": "string", "maxLength": 400},
    },
    "required": ["title", "year", "tags", "summary"],
    "additionalProperties": False,
}
PROMPT = "Describe a film you like as JSON with a title, a year, some tags and a summary."


def run(engine: Engine, params: list[SamplingParams]) -> tuple[float, int, float, int]:
    """(wall seconds, output tokens, seconds until the unconstrained rows finished, their tokens)."""
    start = time.perf_counter()
    ids = {engine.add_request(PROMPT, p): p for p in params}
    tokens, free_tokens, free_done = 0, 0, start
    remaining_free = sum(1 for p in params if p.structured_outputs is None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                n = len(out.outputs[0].token_ids)
                tokens += n
                if ids[out.request_id].structured_outputs is None:
                    free_tokens += n
                    remaining_free -= 1
                    if remaining_free == 0:
                        free_done = time.perf_counter()
    return time.perf_counter() - start, tokens, free_done - start, free_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default: model=smollm2)")
    args = parser.parse_args()
    overrides = args.overrides or ["model=smollm2"]
    engine = Engine(compose_config([*overrides, f"scheduler.max_num_seqs={args.requests}"]), progress=False)
    spec = from_structured_outputs({"json": SCHEMA})
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    held = SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=spec)
    run(engine, [free, held])  # warm-up: the grammar compiles, every variant runs once
    n = args.requests
    wall_a, tok_a, _, _ = run(engine, [free] * n)
    wall_b, tok_b, _, _ = run(engine, [held] * n)
    _, _, free_wall_c, free_tok_c = run(engine, [held] + [free] * (n - 1))
    base_free = (tok_a * (n - 1) / n) / wall_a  # (a)'s rate for n - 1 rows' tokens
    print(f"overrides: {' '.join(overrides)}; {n} requests, max_tokens={args.max_tokens}, greedy")
    print(f"(a) no schema:                  {tok_a / wall_a:8.1f} out tok/s  ({tok_a} tokens, {wall_a:.2f} s)")
    print(f"(b) every request held to it:   {tok_b / wall_b:8.1f} out tok/s  ({tok_b} tokens, {wall_b:.2f} s)"
          f"  = {tok_b / wall_b / (tok_a / wall_a):.2f}x (a)")
    print(f"(c) one held, {n - 1} free: the free rows {free_tok_c / free_wall_c:8.1f} out tok/s"
          f"  = {free_tok_c / free_wall_c / base_free:.2f}x their rate in (a)")
    print(f"engine recompiles: {engine.num_recompiles}")


if __name__ == "__main__":
    main()
