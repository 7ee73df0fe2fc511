"""What bench_vllm.py and bench_hf.py share: their common arguments, the workload file, the output dump.

Both run in the peers' venv, which has no jaxcb: they import this module from their own folder
(they put it first on `sys.path`), so it needs nothing beyond the standard library.
jaxcb_outputs.py writes its dump with it too, in the same format.
"""

from __future__ import annotations

import argparse
import json


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every peer script takes; each adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--workload", required=True, help="a make_workload.py file")
    p.add_argument("--dtype", required=True, choices=["float32", "bfloat16"])
    p.add_argument("--dump-outputs", metavar="JSONL",
                   help="write each request's generated token ids here, {id, output_token_ids} a line "
                        "(compare_outputs.py reads them)")
    return p


def read_workload(path: str) -> list[dict]:
    """The requests of a make_workload.py file, in file order (its {"_meta": ...} line left out)."""
    with open(path) as f:
        return [r for r in map(json.loads, f) if "_meta" not in r]


def write_outputs(path: str | None, reqs: list[dict], token_ids: list[list[int]]) -> None:
    """Dump the generated token ids of each request (token_ids in the order of reqs); nothing if no path."""
    if not path:
        return
    with open(path, "w") as f:
        for r, ids in zip(reqs, token_ids, strict=True):
            f.write(json.dumps({"id": r["id"], "output_token_ids": [int(t) for t in ids]}, separators=(",", ":")) + "\n")
