"""Offline throughput of Hugging Face transformers (torch, CPU) on a workload file: request-level batches.

    $PEERS/bin/python benchmarks/compare/bench_hf.py --model ckpt/tiny-float32 --workload wl_tiny.jsonl \\
        --dtype float32 --batch-size 16

The requests in file order, --batch-size at a time, left-padded, each batch one greedy
`model.generate` as long as its longest output, with EOS disabled (generation_config.eos_token_id
= None; `min_new_tokens` would mask EOS and change the argmax). Only each request's own
output_len tokens count: the padding a batch spends on its shorter requests is the cost of
request-level batching that continuous batching removes. Prints one JSON line (the fields of
summarize.py); --dump-outputs also writes each request's own tokens (compare_outputs.py). Run
in a venv of its own with torch and transformers, never jaxcb's.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # peer_args, beside this file
import peer_args  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    parser = peer_args.parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa | eager")
    a = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    reqs = peer_args.read_workload(a.workload)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype), attn_implementation=a.attn)
    model.eval()
    # EOS off: a GenerationConfig's eos_token_id=None alone is filled in from the checkpoint's
    # generation_config.json (transformers 5), which stops a request at EOS and pads the rest
    model.generation_config.eos_token_id = None
    startup = time.perf_counter() - start
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(batch: list[dict], max_new_tokens: int) -> torch.Tensor:
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r["prompt_token_ids"])
            ids[row, width - n:] = torch.tensor(r["prompt_token_ids"])
            mask[row, width - n:] = 1
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=pad, use_cache=True)
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]

    batches = [reqs[i: i + a.batch_size] for i in range(0, len(reqs), a.batch_size)]
    generate(batches[0], 4)  # warm-up, untimed
    out_tokens = generated = 0
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for batch in batches:
        new = generate(batch, max(r["output_len"] for r in batch))
        generated += new.numel()
        out_tokens += sum(min(r["output_len"], new.shape[1]) for r in batch)
        outputs += [row[: r["output_len"]].tolist() for r, row in zip(batch, new)]
    seconds = time.perf_counter() - start
    peer_args.write_outputs(a.dump_outputs, reqs, outputs)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    print(json.dumps({
        "engine": "transformers", "mode": f"static batches of {a.batch_size}", "model": a.model,
        "workload": a.workload, "num_requests": len(reqs), "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens, "generated_tokens_with_padding": generated, "seconds": round(seconds, 3),
        "output_tokens_per_s": round(out_tokens / seconds, 1),
        "total_tokens_per_s": round((prompt_tokens + out_tokens) / seconds, 1), "startup_s": round(startup, 1),
        "config": {"dtype": a.dtype, "batch_size": a.batch_size, "attn": a.attn, "threads": torch.get_num_threads()},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    }), flush=True)


if __name__ == "__main__":
    main()
