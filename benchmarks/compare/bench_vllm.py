"""Offline throughput of vLLM's CPU build on a workload file: run in vLLM's own venv, never jaxcb's.

    $PEERS/bin/python benchmarks/compare/bench_vllm.py --model ckpt/tiny-float32 --workload wl_tiny.jsonl \\
        --dtype float32 --max-num-seqs 64 --max-num-batched-tokens 2048

Every request is its prompt token ids with SamplingParams(max_tokens=output_len, ignore_eos=True,
temperature=0), all handed to one LLM.generate (vLLM batches them continuously), after a few
untimed warm-up requests. Prints one JSON line (the fields of summarize.py); --dump-outputs
also writes the generated token ids (compare_outputs.py).

Settings that matter on a small CPU machine, set here before vllm is imported (it spawns its
engine and worker processes, which inherit the environment):
- VLLM_CPU_OMP_THREADS_BIND=0-N (--bind): vLLM's `auto` keeps one core for itself, which on a
  2-core machine leaves the model one thread;
- LD_PRELOAD of tcmalloc and the venv's libiomp5 (--preload): with vLLM's default (torch's
  libgomp) it ran ~3x slower here; tcmalloc comes from Debian's libtcmalloc-minimal4;
- VLLM_CPU_KVCACHE_SPACE (--kv-cache-gib): otherwise vLLM sizes the cache from total RAM;
- --dtype explicitly: `auto` turns a float32 checkpoint into bfloat16 on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # peer_args, beside this file
import peer_args  # noqa: E402

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def set_environment(a: argparse.Namespace) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                      VLLM_CPU_KVCACHE_SPACE=str(a.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=a.bind)
    if a.preload == "tcmalloc+iomp":
        libs = [TCMALLOC, os.path.join(sys.prefix, "lib", "libiomp5.so")]
        missing = [p for p in libs if not os.path.exists(p)]
        if missing:
            sys.exit(f"error: --preload tcmalloc+iomp needs {' and '.join(missing)} (apt-get install "
                     "libtcmalloc-minimal4; pip install intel-openmp), or pass --preload default")
        os.environ["LD_PRELOAD"] = ":".join(libs + [p for p in [os.environ.get("LD_PRELOAD")] if p])


def main() -> None:
    parser = peer_args.parser(__doc__)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--bind", default=f"0-{os.cpu_count() - 1}", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--preload", choices=["tcmalloc+iomp", "default"], default="tcmalloc+iomp")
    parser.add_argument("--compile", action="store_true", help="torch.compile (vLLM's CPU default; slow start-up)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests first")
    a = parser.parse_args()
    set_environment(a)
    reqs = peer_args.read_workload(a.workload)

    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=a.model, skip_tokenizer_init=True, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
              enforce_eager=not a.compile, enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - start

    def batch(rs: list[dict]) -> tuple[list, list]:
        return ([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rs],
                [SamplingParams(max_tokens=r["output_len"], ignore_eos=True, temperature=0.0, detokenize=False)
                 for r in rs])

    if a.warmup:
        llm.generate(*batch(reqs[: a.warmup]), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(*batch(reqs), use_tqdm=False)
    seconds = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if out_tokens != sum(r["output_len"] for r in reqs):
        sys.exit(f"error: vLLM generated {out_tokens} tokens, the workload asks for {sum(r['output_len'] for r in reqs)}")
    peer_args.write_outputs(a.dump_outputs, reqs, [o.outputs[0].token_ids for o in outputs])
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    print(json.dumps({
        "engine": "vllm-cpu", "mode": "continuous (LLM.generate)", "model": a.model, "workload": a.workload,
        "num_requests": len(reqs), "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "seconds": round(seconds, 3), "output_tokens_per_s": round(out_tokens / seconds, 1),
        "total_tokens_per_s": round((prompt_tokens + out_tokens) / seconds, 1), "startup_s": round(startup, 1),
        "config": {k: v for k, v in vars(a).items() if k not in ("model", "workload", "dump_outputs")},
        "versions": {"vllm": vllm.__version__},
    }), flush=True)


if __name__ == "__main__":
    main()
