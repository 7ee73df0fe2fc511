"""A seeded offline workload as JSONL, for every engine of the comparison to run the same requests.

    python benchmarks/compare/make_workload.py --model ckpt/tiny-float32 --num-requests 200 --scale 0.5 \\
        --out wl_tiny.jsonl

The requests are jaxcb's own (`jaxcb.benchmark.make_workload`, the `bench.workload` generators
with the same fields and defaults), drawn over the ids past the checkpoint's leading special
tokens (its tokenizer.json's special added tokens from id 0 on: 4 for make_checkpoint.py's, 17
for SmolLM2's), so that no prompt holds one. The file: a {"_meta": {...}} line (the arguments and a summary),
then one {"id", "prompt_token_ids", "output_len"} line per request. jaxcb reads it with
`bench.workload=file bench.file=...`; bench_vllm.py and bench_hf.py read it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from jaxcb.benchmark import make_workload
from jaxcb.config import BenchConfig

FIRST_USABLE_TOKEN_ID = 4  # <unk>, <s>, </s>, <pad> (make_checkpoint.py): without a tokenizer.json
GENERATOR_FIELDS = ("num_requests", "input_mean", "output_mean", "input_sigma", "output_sigma", "scale", "seed",
                    "output_cap")  # of BenchConfig


def first_usable_token_id(model_dir: str) -> int:
    """The first id past the run of special added tokens that starts at 0 in model_dir's tokenizer.json."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return FIRST_USABLE_TOKEN_ID
    with open(path) as f:
        specials = {t["id"] for t in json.load(f).get("added_tokens", []) if t.get("special")}
    first = 0
    while first in specials:
        first += 1
    return first


def main() -> None:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", help="a checkpoint directory: its config.json gives the vocab size")
    parser.add_argument("--vocab-size", type=int, help="instead of --model")
    parser.add_argument("--first-token-id", type=int,
                        help="prompts use ids from here up (default: past --model's leading special tokens, else 4)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="prompt <= half of it, prompt + output <= it")
    parser.add_argument("--workload", choices=["lognormal", "random", "exp-output"], default="lognormal")
    for name in GENERATOR_FIELDS:
        default = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                            help=f"bench.{name} (default {default})")
    args = parser.parse_args()
    if (args.model is None) == (args.vocab_size is None):
        parser.error("give exactly one of --model and --vocab-size")
    vocab_size, first_id = args.vocab_size, FIRST_USABLE_TOKEN_ID
    if args.model is not None:
        with open(f"{args.model}/config.json") as f:
            vocab_size = json.load(f)["vocab_size"]
        first_id = first_usable_token_id(args.model)
    if args.first_token_id is not None:
        first_id = args.first_token_id

    fields = {name: getattr(args, name) for name in GENERATOR_FIELDS}
    b = dataclasses.replace(defaults, workload=args.workload, **fields)
    items = make_workload(b, vocab_size - first_id, args.max_model_len)
    prompts = [[t + first_id for t in w.prompt_token_ids] for w in items]
    summary = dict(
        num_requests=len(items), prompt_tokens=sum(map(len, prompts)), output_tokens=sum(w.output_len for w in items),
        max_prompt=max(map(len, prompts)), max_output=max(w.output_len for w in items),
        max_total=max(len(p) + w.output_len for p, w in zip(prompts, items)),
    )
    meta = dict(workload=args.workload, **fields, vocab_size=vocab_size, max_model_len=args.max_model_len,
                first_token_id=first_id, summary=summary)
    with open(args.out, "w") as f:
        f.write(json.dumps({"_meta": meta}) + "\n")
        for i, (p, w) in enumerate(zip(prompts, items)):
            f.write(json.dumps({"id": i, "prompt_token_ids": p, "output_len": w.output_len},
                               separators=(",", ":")) + "\n")
    print(json.dumps({"out": args.out, **summary}))


if __name__ == "__main__":
    main()
