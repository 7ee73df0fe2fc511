"""Greedy outputs of the engines token for token: one markdown row per pair of dumps.

    python benchmarks/compare/compare_outputs.py runs/smollm2-float32-jaxcb.outputs.jsonl \\
        runs/smollm2-float32-vllm.outputs.jsonl runs/smollm2-float32-hf.outputs.jsonl

Each file is a {id, output_token_ids} JSONL (jaxcb_outputs.py, or bench_vllm.py / bench_hf.py
--dump-outputs) for the same workload; each is named after its file, less `.outputs.jsonl`.
The first file is compared with each of the others (--all-pairs: every pair). A row gives the
requests both hold, how many of them are identical token for token, the share of all output
tokens that come before each request's first difference, and where the first differences fall
(the earliest and the median position, 0 = the first output token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from itertools import combinations


def load(path: str) -> dict[int, list[int]]:
    with open(path) as f:
        return {r["id"]: r["output_token_ids"] for r in map(json.loads, f) if r}


def label(path: str) -> str:
    name = os.path.basename(path)
    return name[: -len(".outputs.jsonl")] if name.endswith(".outputs.jsonl") else name


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (a length difference counts); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict:
    ids = sorted(a.keys() & b.keys())
    firsts = {i: first_difference(a[i], b[i]) for i in ids}
    diverged = sorted(k for k in firsts.values() if k is not None)
    total = sum(max(len(a[i]), len(b[i])) for i in ids)
    common = sum(max(len(a[i]), len(b[i])) if k is None else k for i, k in firsts.items())
    return {"requests": len(ids), "identical": len(ids) - len(diverged),
            "common_prefix_share": common / total if total else 1.0,
            "earliest": diverged[0] if diverged else None,
            "median": statistics.median(diverged) if diverged else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dumps", nargs="+", help="{id, output_token_ids} JSONL files of one workload")
    parser.add_argument("--all-pairs", action="store_true", help="every pair, not the first against the others")
    args = parser.parse_args()
    paths = args.dumps
    if len(paths) < 2:
        parser.error("needs two dumps at least")
    dumps = {p: load(p) for p in paths}
    pairs = combinations(paths, 2) if args.all_pairs else [(paths[0], q) for q in paths[1:]]
    print("| outputs | against | requests | identical | tokens before the first difference | "
          "first difference: earliest / median |")
    print("|---|---|---|---|---|---|")
    for p, q in pairs:
        c = compare(dumps[p], dumps[q])
        where = f"{c['earliest']} / {c['median']:g}" if c["earliest"] is not None else "-"
        print(f"| {label(p)} | {label(q)} | {c['requests']} | **{c['identical']}/{c['requests']}** | "
              f"{100 * c['common_prefix_share']:.1f}% | {where} |")


if __name__ == "__main__":
    main()
