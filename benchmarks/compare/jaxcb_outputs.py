"""jaxcb's greedy outputs on a workload file, dumped for compare_outputs.py: untimed, in jaxcb's venv.

    python benchmarks/compare/jaxcb_outputs.py --workload wl_tiny.jsonl --out tiny-jaxcb.outputs.jsonl -- \\
        model=hf model.checkpoint=ckpt/tiny-float32 model.dtype=float32 engine.max_model_len=1024 \\
        scheduler.max_num_seqs=64 scheduler.max_num_batched_tokens=2048

The Hydra overrides after `--` are those of the timed `scripts/bench.py` run (run.sh passes the
same), so the engine, its limits and the batches it forms are the same; every request is its
prompt token ids with SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True), all
handed to one LLM.generate, as `bench.py` does. Writes {id, output_token_ids} a line, in the
format of bench_vllm.py's and bench_hf.py's --dump-outputs.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxcb import LLM, SamplingParams
from jaxcb.config import compose_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # peer_args, beside this file
import peer_args  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True, help="a make_workload.py file")
    parser.add_argument("--out", required=True, help="the JSONL to write")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for scripts/bench.py, after --")
    args = parser.parse_args()
    reqs = peer_args.read_workload(args.workload)
    llm = LLM(compose_config(args.overrides))
    outputs = llm.generate([r["prompt_token_ids"] for r in reqs],
                           [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in reqs],
                           use_tqdm=False)
    peer_args.write_outputs(args.out, reqs, [o.outputs[0].token_ids for o in outputs])
    print(f"wrote {len(reqs)} requests' outputs to {args.out}")


if __name__ == "__main__":
    main()
