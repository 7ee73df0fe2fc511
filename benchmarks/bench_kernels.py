"""Micro-benchmark of the CPU kernels on this machine (CPU by default).

    python benchmarks/bench_kernels.py                    # both markdown tables; see docs/benchmarks.md
    python benchmarks/bench_kernels.py --kernels matmul   # attention, bf16-matmul, cache-dtype, huge-pages, matmul, lm-head, qkv

attention: on the same random ragged batches, the C++ CPU kernel (`attention.impl=cpu`, the
CPU default) against the plain-XLA path, the reference, and the Pallas kernel run in the
interpreter.

cache-dtype: the C++ attention kernel over `small`'s heads (12 query / 4 KV heads of 64, all
12 layers of a stacked cache per call) with a float32 cache against a bfloat16 one
(`cache.dtype=bfloat16` under a float32 model), the two timed alternately. Then, with a bf16 cache
and a float32 q (a bf16 model's) over SmolLM2-135M's heads (9 query / 3 KV heads of 64), the path
this CPU takes for a bf16 cache (AMX prefill tiles where it has AMX) against every tile row by row.

--against REV: the kernels of this checkout against those of git revision REV, built side by
side from REV's C++ sources (`jaxcb/kernels/cpu/`) and timed alternately in one process: small's matmul
chain by step size, with float32 and with bf16 weights (both on the bf16 path this CPU chose), and
attention over small's heads (both on this CPU's bf16-cache path; among the cases, 64 decodes whose
first 384 keys are shared in groups of 8, which prefix caching's cascade items take). The A/B
behind a kernel change. With --steps ROUNDS, also the engine's own compiled steps: the full-batch
run of docs/benchmarks.md (64 requests, 40 prompt + 100 output tokens each, on `small`), or the
run the Hydra overrides after the options describe, recorded once and replayed whole with each
revision's kernels in turn, the time also split by the steps' token bucket (prefill chunks against
decode steps; REV's kernels must take this checkout's arguments; a REV from before `real_rows` is
traced without it):

    python benchmarks/bench_kernels.py --against REV --calls 5 --steps 6 model=hf model.checkpoint=DIR
        model.dtype=bfloat16 bench.workload=file bench.file=WORKLOAD.jsonl   (one command)

bf16-matmul: the same chain with bf16 weights, on each bf16 path this CPU runs (AMX tiles,
AVX512-BF16 dot products, widening to float32; `jaxcb.kernels.cpu.bf16_matmul_path`), against
XLA's own bf16 dot (jaxlib's default library, YNNPACK, which takes AMX where the CPU has it; x in
bf16, float32 accumulation) and the packed float32 chain. The rule the hand-written path keeps
its place by: >= 1.2x the best library at the step sizes a decode runs.

huge-pages: small's chain with bf16 weights and with float32 weights, each in two copies: one left
on the pages it was allocated on (4 KiB), one moved onto 2 MiB pages as the engine does at start-up
(`engine.huge_pages=auto`, jaxcb/huge_pages.py), the two copies timed alternately.

lora: multi-LoRA's batched-kernel calls of a SmolLM2 decode step (30 layers x q/k/v's addend, o's
update, gate/up's shrink and down's expand; 8 slots of rank 16 in bf16; 16 rows, 2 a slot) as one
chain, over 30 layers' slots and over one layer's 30 times (mostly in cache), and with every row a
base row (the calls' fixed cost). The LoRA work inside the MLP kernel's tiles is not in it.

lm-head: small's LM head (768 -> 32,000) at 64 rows and the greedy tokens of a step: the packed
matmul followed by the row argmax (the logits written, then read back), against the matmul with
the argmax taken inside it (`packed_matmul_argmax`), with the logits written or not (a step
whose every row is greedy writes none), the three timed alternately.

matmul: the linear layers of the `small` preset (12 x q/k/v, o, gate/up, down, then the
32000-row LM head; 498 MB of float32 weights) as one jitted chain, through the packed C++
matmul (`model.backend=cpu`) and through XLA's dot, for steps of 1 to 2048 tokens.

qkv: small's q/k/v projection and attention, 12 layers deep, at a decode step of 64 sequences
with 100 tokens of context: `packed_qkv` (rope and the cache write inside the call) against the
packed matmul, XLA's rope and `write_kv_rows`, each followed by the attention call, with an f32
and a bf16 cache; the caches donated and carried from call to call, as in the engine's step.

Everything is timed side by side in one run (median wall time per jitted call), so the ratios
are what to quote; absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/bench_kernels.py`: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.freed_memory import keep_freed_memory  # noqa: E402

# Run as a script: before jax starts its threads (benchmarks/freed_memory.py). Not when a test loads this file.
KEPT_FREED_MEMORY = keep_freed_memory() if __name__ == "__main__" else False

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import numpy as np  # noqa: E402

import jaxcb.kernels.cpu as cpu_kernels  # noqa: E402
from benchmarks.step_replay import record_steps, replay
from benchmarks.timing import time_calls
from jaxcb.huge_pages import collapse_onto_huge_pages
from jaxcb.kernels import packed_matmul as pm
from jaxcb.kernels.attention.cpu import ragged_paged_attention_cpu, write_kv_rows
from jaxcb.kernels.attention.pallas import ragged_paged_attention
from jaxcb.kernels.attention.reference import ragged_paged_attention_reference
from jaxcb.kernels.attention.testing import make_ragged_batch, share_leading_blocks
from jaxcb.kernels.attention.xla import ragged_paged_attention_xla
from jaxcb.kernels.packed_matmul import pack_columns, packed_matmul
from jaxcb.kernels.row_argmax import row_argmax

# The peers' tiny Llama attention (4 query heads, 2 KV heads, head dim 32), blocks of 16, a 4-layer cache.
HEADS = dict(num_kv_heads=2, group=2, head_dim=32, block_size=16, num_layers=4, layer=2, pad_tokens=0, pad_seqs=0)
WORKLOADS = {
    "decode 64 seqs @ 256 ctx": [(1, 256)] * 64,
    # 64 blocks: past the XLA path's gather width, so it walks (tile, block) pairs
    "decode 32 seqs @ 1024 ctx": [(1, 1024)] * 32,
    "decode 1 seq @ 1024 + 63 @ 64": [(1, 1024)] + [(1, 64)] * 63,
    "prefill 1 x 512": [(512, 512)],
    "mixed 32 decodes @ 256 + 224-token chunk": [(1, 256)] * 32 + [(224, 480)],
}
IMPLS = {
    "cpu": ragged_paged_attention_cpu,
    "xla": ragged_paged_attention_xla,
    "reference": ragged_paged_attention_reference,
    "pallas (interpret)": functools.partial(ragged_paged_attention, interpret=True),
}


# (in, out) of each matmul of the `small` preset's step: hidden 768, MLP 2048, 12/4 heads of 64.
SMALL_LINEARS = [(768, 1280), (768, 768), (768, 4096), (2048, 768)] * 12 + [(768, 32000)]
MATMUL_TOKENS = (1, 4, 16, 64, 256, 2048)


def small_matmul_chain(matmul):  # jitted (x, weights) -> the sum of every linear's output
    def run(x, ws):  # each matmul's input is the step's x cut or tiled to its width
        total = jnp.float32(0)
        for (k, n), w in zip(SMALL_LINEARS, ws):
            total += matmul(jnp.tile(x, (1, -(-k // x.shape[1])))[:, :k], w, n).sum()
        return total

    return jax.jit(run)


def matmul_table(calls: int) -> None:
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02) for shape in SMALL_LINEARS]
    packed = [jax.block_until_ready(pack_columns(w)) for w in weights]
    flops_per_token = 2 * sum(k * n for k, n in SMALL_LINEARS)

    packed_chain, xla_chain = small_matmul_chain(packed_matmul), small_matmul_chain(lambda x, w, n: x @ w)
    print("| tokens in the step | packed C++ (ms) | XLA dot (ms) | XLA / packed | packed GFLOP/s | packed weight GB/s |")
    print("|---|---|---|---|---|---|")
    for m in MATMUL_TOKENS:
        x = jnp.asarray(rng.standard_normal((m, 768), np.float32))
        n = max(3, calls // 5) if m >= 256 else calls
        cpu_ms = time_calls(packed_chain, x, packed, calls=n).median_ms
        xla_ms = time_calls(xla_chain, x, weights, calls=n).median_ms
        gbs = 4 * sum(k * n for k, n in SMALL_LINEARS) / cpu_ms / 1e6
        print(f"| {m} | {cpu_ms:.1f} | {xla_ms:.1f} | {xla_ms / cpu_ms:.2f}x | "
              f"{flops_per_token * m / cpu_ms / 1e6:.1f} | {gbs:.1f} |")


def bf16_matmul_table(calls: int) -> None:
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02) for shape in SMALL_LINEARS]
    weights16 = [w.astype(jnp.bfloat16) for w in weights]
    packed32 = [jax.block_until_ready(pack_columns(w)) for w in weights]
    packed16 = [jax.block_until_ready(pack_columns(w)) for w in weights16]
    chosen = cpu_kernels.bf16_matmul_path()
    library = str(cpu_kernels.build_library())
    codes = {v: k for k, v in cpu_kernels.BF16_MATMUL_PATHS.items()}
    paths = [p for p in cpu_kernels.bf16_matmul_paths_built() if cpu_kernels._time_path(library, codes[p]) is not None]
    packed_chain = small_matmul_chain(packed_matmul)
    xla16 = small_matmul_chain(lambda x, w, n: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
    print(f"bf16 paths that run here: {', '.join(paths)} (start-up chooses {chosen})")
    print("| tokens in the step | " + " | ".join(f"bf16 {p} (ms)" for p in paths)
          + f" | XLA bf16 dot (ms) | packed float32 (ms) | XLA bf16 / {chosen} | float32 / {chosen} |")
    print("|---|" + "---|" * (len(paths) + 4))
    for m in MATMUL_TOKENS:
        x = jnp.asarray(rng.standard_normal((m, 768), np.float32))
        n = max(3, calls // 5) if m >= 256 else calls
        ms = {}
        for p in paths:  # the path is read at each call: one compiled chain serves them all
            cpu_kernels.select_bf16_matmul(p)
            ms[p] = time_calls(packed_chain, x, packed16, calls=n).median_ms
        cpu_kernels.select_bf16_matmul(chosen)
        xla_ms = time_calls(xla16, x, weights16, calls=n).median_ms
        f32_ms = time_calls(packed_chain, x, packed32, calls=n).median_ms
        print(f"| {m} | " + " | ".join(f"{ms[p]:.1f}" for p in paths)
              + f" | {xla_ms:.1f} | {f32_ms:.1f} | {xla_ms / ms[chosen]:.2f}x | {f32_ms / ms[chosen]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--kernels", default="attention,matmul",
                        help="comma-separated: attention, bf16-matmul, cache-dtype, huge-pages, matmul, lm-head, lora, "
                             "qkv")
    parser.add_argument("--against", metavar="REV", help="A/B this checkout's kernels against git revision REV's")
    parser.add_argument("--steps", type=int, default=0, metavar="ROUNDS",
                        help="with --against: also replay the engine's whole full-batch run with each, ROUNDS times")
    parser.add_argument("overrides", nargs="*",
                        help="with --steps: Hydra overrides of the run replayed (default: the full-batch run on small)")
    args = parser.parse_args()
    kept = "glibc keeps freed memory" if KEPT_FREED_MEMORY else "the allocator's defaults (freed memory may fault in again)"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; median of {args.calls} calls; {kept}\n")
    if args.against:
        against_table(args.against, args.calls, args.steps, args.overrides or FULL_BATCH)
        return
    kernels = set(args.kernels.split(","))
    if kernels - {"attention", "bf16-matmul", "cache-dtype", "huge-pages", "matmul", "lm-head", "lora", "qkv"}:
        parser.error(f"--kernels {args.kernels}: each must be attention, bf16-matmul, cache-dtype, huge-pages, matmul, "
                     f"lm-head, lora or qkv")
    if "attention" in kernels:
        attention_table(args.calls)
    if "cache-dtype" in kernels:
        print()
        cache_dtype_table(args.calls)
    if "matmul" in kernels:
        print()
        matmul_table(args.calls)
    if "bf16-matmul" in kernels:
        print()
        bf16_matmul_table(args.calls)
    if "huge-pages" in kernels:
        print()
        huge_pages_table(args.calls)
    if "lm-head" in kernels:
        print()
        lm_head_table(args.calls)
    if "lora" in kernels:
        print()
        lora_table(args.calls)
    if "qkv" in kernels:
        print()
        qkv_table(args.calls)


def qkv_table(calls: int, tokens: int = 64, context: int = 100, layers: int = 12) -> None:
    """small's q/k/v projection and attention, `layers` deep, at a decode step of `tokens` sequences:
    `packed_qkv` (rope and the cache write in the call) against the matmul, XLA's rope and
    `write_kv_rows`, each followed by the attention call, with both cache dtypes."""
    from jaxcb.model.llama import apply_rope

    hq, hkv, d, k = 12, 4, 64, 768
    n, rng = (hq + 2 * hkv) * d, np.random.default_rng(0)
    heads = dict(SMALL_HEADS, num_layers=layers)
    _, k_cache, v_cache, kv_lens, tables, qsl, num_seqs, _ = make_ragged_batch([(1, context)] * tokens, seed=0,
                                                                               **heads).args(jnp)
    last = context - 1  # each sequence's new token: the last slot of its context
    slots = jnp.asarray(np.asarray(tables)[np.arange(tokens), last // 16] * 16 + last % 16, jnp.int32)
    h = jnp.asarray(rng.standard_normal((tokens, k), np.float32))
    weights = [pack_columns(jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02)) for _ in range(layers)]
    norm, angles = jnp.ones(k, jnp.float32), rng.standard_normal((tokens, d // 2)).astype(np.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)

    def attend(h, q, kc, vc, i):
        out = ragged_paged_attention_cpu(q, kc, vc, kv_lens, tables, qsl, num_seqs, jnp.int32(i), sm_scale=d**-0.5)
        return h + out.reshape(tokens, -1)[:, :k]

    def three_steps(h, kc, vc):
        for i, w in enumerate(weights):
            y = packed_matmul(h, w, n, norm=norm, eps=1e-5)
            q, kk, v = (part.reshape(tokens, -1, d) for part in jnp.split(y, [hq * d, (hq + hkv) * d], axis=1))
            kc, vc = write_kv_rows(kc, vc, jnp.int32(i), apply_rope(kk, cos, sin), v, slots)
            h = attend(h, apply_rope(q, cos, sin), kc, vc, i)
        return h, kc, vc

    def one_call(h, kc, vc):
        for i, w in enumerate(weights):
            q, kc, vc = pm.packed_qkv(h, w, norm, 1e-5, cos, sin, kc, vc, jnp.int32(i), slots, hq)
            h = attend(h, q, kc, vc, i)
        return h, kc, vc

    print(f"| small's q/k/v + attention, {layers} layers, {tokens} seqs @ {context} ctx | three steps (ms) | "
          "packed_qkv (ms) | three steps / packed_qkv |")
    print("|---|---|---|---|")
    for dtype in (jnp.float32, jnp.bfloat16):
        # The caches are donated and carried from call to call, as the engine's step does: no copy of them.
        caches = [jnp.nan_to_num(k_cache).astype(dtype), jnp.nan_to_num(v_cache).astype(dtype)]
        fns = {"three": jax.jit(three_steps, donate_argnums=(1, 2)), "one": jax.jit(one_call, donate_argnums=(1, 2))}

        def timed(name):
            start = time.perf_counter()
            out = fns[name](h, *caches)
            jax.block_until_ready(out)
            caches[:] = out[1:]
            return time.perf_counter() - start

        for name in fns:
            timed(name)
        times = {name: [] for name in fns}
        for i in range(calls):  # alternated, the order flipped every round
            for name in (("three", "one") if i % 2 else ("one", "three")):
                times[name].append(timed(name))
        three, one = (1e3 * float(np.median(times[name])) for name in ("three", "one"))
        print(f"| {jnp.dtype(dtype).name} cache | {three:.2f} | {one:.2f} | {three / one:.3f}x |")



def lora_table(calls: int, layers: int = 30, slots: int = 8, rank: int = 16, rows: int = 16) -> None:
    """The batched-LoRA calls of a SmolLM2 decode step (the `cpu` backend's, but the MLP kernel's own)."""
    from jaxcb.kernels.batched_lora import (
        batched_lora, gate_up_pairs, lora_expand, lora_shrink, pack_lora_group, side_by_side,
    )

    hidden, f, q, kv = 576, 1536, 576, 192
    rng = np.random.default_rng(0)

    def group(k, widths, columns, every_panel=False):
        a = [jnp.asarray(rng.standard_normal((k, slots, rank)) * 0.02, jnp.bfloat16) for _ in widths]
        b = [jnp.asarray(rng.standard_normal((slots, rank, w)) * 0.02, jnp.bfloat16) for w in widths]
        return pack_lora_group(a, b, columns, every_panel=every_panel)

    def layer():
        return (group(hidden, (q, kv, kv), side_by_side((q, kv, kv))), group(hidden, (hidden,), side_by_side((hidden,))),
                group(hidden, (f, f), gate_up_pairs(f, f // 16), every_panel=True),
                group(f, (hidden,), side_by_side((hidden,))))

    distinct = [layer() for _ in range(layers)]
    one = [distinct[0]] * layers

    @jax.jit
    def chain(x, ws, row_slots):
        y = x
        for qkv_w, o_w, gu_w, down_w in ws:
            addend = batched_lora(y, qkv_w, row_slots, None, width=q + 2 * kv, norm=jnp.ones(hidden), eps=1e-5)
            y = batched_lora(y + addend[:, :hidden] * 1e-3, o_w, row_slots, y)
            u = lora_shrink(y, gu_w, row_slots, norm=jnp.ones(hidden), eps=1e-5)
            y = lora_expand(u[:, :16] * 1e-3, down_w, row_slots, y)
        return y

    x = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)
    mixed = jnp.asarray(np.arange(rows) % slots, jnp.int32)
    base = jnp.full((rows,), -1, jnp.int32)
    ms = alternate({f"{layers} layers' slots": (chain, (x, distinct, mixed)),
                    "one layer's slots, again and again": (chain, (x, one, mixed)),
                    "every row a base row": (chain, (x, distinct, base))}, calls)
    print(f"| SmolLM2's decode LoRA calls ({4 * layers}), {rows} rows over {slots} slots of rank {rank}, bf16 | ms |")
    print("|---|---|")
    for name, value in ms.items():
        print(f"| {name} | {value * 1e3:.2f} |")

def lm_head_table(calls: int, rows: int = 64, hidden: int = 768, vocab: int = 32000) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32))
    packed = pack_columns(jnp.asarray(rng.standard_normal((hidden, vocab), np.float32) * 0.02))
    runs = {
        "matmul, then row_argmax": (jax.jit(lambda x: row_argmax(packed_matmul(x, packed, vocab))), (x,)),
        "argmax inside, logits written": (
            jax.jit(lambda x: pm.packed_matmul_argmax(x, packed, vocab, True)[1]), (x,)),
        "argmax inside, no logits": (
            jax.jit(lambda x: pm.packed_matmul_argmax(x, packed, vocab, False)[1]), (x,)),
    }
    seconds = alternate(runs, calls)
    base = seconds["matmul, then row_argmax"]
    print(f"| small's LM head, {rows} rows, greedy tokens | ms | matmul, then row_argmax / this |")
    print("|---|---|---|")
    for name, t in seconds.items():
        print(f"| {name} | {1e3 * t:.2f} | {base / t:.2f}x |")


def attention_table(calls_per_impl: int) -> None:
    others = [name for name in IMPLS if name != "cpu"]
    print("| workload | tokens | " + " | ".join(f"{name} (ms)" for name in IMPLS) + " | "
          + " | ".join(f"{name} / cpu" for name in others) + " |")
    print("|---|---|" + "---|" * (len(IMPLS) + len(others)))
    for name, seqs in WORKLOADS.items():
        batch = make_ragged_batch(seqs, seed=0, **HEADS)
        batch.k_cache[batch.k_cache != batch.k_cache] = 0  # no NaN: timing only
        batch.v_cache[batch.v_cache != batch.v_cache] = 0
        inputs = batch.args(jnp)
        ms = {}
        for impl, fn in IMPLS.items():
            jitted = jax.jit(functools.partial(fn, sm_scale=HEADS["head_dim"] ** -0.5))
            calls = max(2, calls_per_impl // 5) if impl == "pallas (interpret)" else calls_per_impl
            ms[impl] = time_calls(jitted, *inputs, calls=calls).median_ms
        cells = " | ".join(f"{ms[i]:.2f}" for i in IMPLS)
        ratios = " | ".join(f"{ms[i] / ms['cpu']:.1f}x" for i in others)
        print(f"| {name} | {batch.num_real_tokens} | {cells} | {ratios} |")


# `small`'s attention: 12 query heads over 4 KV heads of 64, a 12-layer cache, all layers per call.
SMALL_HEADS = dict(num_kv_heads=4, group=3, head_dim=64, block_size=16, num_layers=12, layer=0, pad_tokens=0, pad_seqs=0)
CACHE_DTYPE_WORKLOADS = {
    "decode 64 seqs @ 100 ctx": [(1, 100)] * 64,
    "decode 64 seqs @ 400 ctx": [(1, 400)] * 64,
    "decode 8 seqs @ 1000 ctx": [(1, 1000)] * 8,
    "prefill 1 x 512": [(512, 512)],
}


def small_attention_all_layers(attention):  # jitted batch args -> attention at every layer of the cache
    def run(q, k, v, kv_lens, tables, qsl, num_seqs, _):
        return jnp.stack([attention(q, k, v, kv_lens, tables, qsl, num_seqs, jnp.int32(i),
                                    sm_scale=SMALL_HEADS["head_dim"] ** -0.5)
                          for i in range(SMALL_HEADS["num_layers"])])

    return jax.jit(run)


def cache_dtype_table(calls: int) -> None:
    layers = SMALL_HEADS["num_layers"]
    all_layers = small_attention_all_layers(ragged_paged_attention_cpu)

    print("| workload (small's heads) | f32 cache (ms / layer) | bf16 cache (ms / layer) | f32 / bf16 |")
    print("|---|---|---|---|")
    for name, seqs in CACHE_DTYPE_WORKLOADS.items():
        f32 = make_ragged_batch(seqs, seed=0, **SMALL_HEADS).args(jnp)
        bf16 = (f32[0], f32[1].astype(jnp.bfloat16), f32[2].astype(jnp.bfloat16), *f32[3:])
        seconds = alternate({"f32": (all_layers, f32), "bf16": (all_layers, bf16)}, calls)
        a, b = (1e3 * seconds[k] / layers for k in ("f32", "bf16"))
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    bf16_attention_paths_table(calls)


# SmolLM2-135M's attention (9 query heads over 3 KV heads of 64), blocks of 16, a 4-layer bf16 cache.
SMOLLM2_HEADS = dict(num_kv_heads=3, group=3, head_dim=64, block_size=16, num_layers=4, layer=0, pad_tokens=0,
                     pad_seqs=0)
BF16_PATH_WORKLOADS = {  # name: (sequences as (new tokens, kv_len), q's dtype)
    "prefill 16 x 128 new @ 384 prior": ([(128, 512)] * 16, jnp.float32),
    "the same, bf16 q": ([(128, 512)] * 16, jnp.bfloat16),
    "prefill 1 x 512": ([(512, 512)], jnp.float32),
    "chunk 2 x 16 new @ 1000 prior": ([(16, 1016)] * 2, jnp.float32),
    "chunk 16 x 6 new @ 400 prior": ([(6, 406)] * 16, jnp.float32),
    "decode 64 seqs @ 400 ctx": ([(1, 400)] * 64, jnp.float32),
    # Eight groups of 8 whose first 384 keys are the same blocks (prefix caching's shared prompts):
    # cascade items attend those once per group, on AMX tiles on the AMX path (JaxcbSetCascade turns
    # them off for the "rows" and "amx" columns).
    "decode 64 seqs @ 400 ctx, groups of 8 sharing 384": ([(1, 400)] * 64, jnp.float32),
}
SHARED_PREFIX_GROUPS = {"decode 64 seqs @ 400 ctx, groups of 8 sharing 384": [(list(range(g, g + 8)), 24)
                                                                              for g in range(0, 64, 8)]}


def bf16_attention_paths_table(calls: int) -> None:
    """The attention kernel on a bf16 cache over SmolLM2's heads, q in float32 (a bf16 model's
    activations are float32) unless told: the path this CPU takes (AMX prefill tiles where it has
    AMX: `jaxcb.kernels.cpu.attention_path`) against every tile row by row, timed alternately."""
    chosen = cpu_kernels.attention_path()
    if chosen == "rows":
        print("\n(no AMX attention path on this CPU: every bf16 tile runs row by row)")
        return
    layers = SMOLLM2_HEADS["num_layers"]
    heads = dict(SMOLLM2_HEADS)
    all_layers = jax.jit(lambda q, k, v, kv_lens, tables, qsl, num_seqs, _: jnp.stack([
        ragged_paged_attention_cpu(q, k, v, kv_lens, tables, qsl, num_seqs, jnp.int32(i),
                                   sm_scale=heads["head_dim"] ** -0.5) for i in range(layers)]))

    lib = cpu_kernels.load_cpu_kernels()

    def on_path(name, cascade=False):
        def run(*args):
            cpu_kernels.select_attention_path(name)
            lib.JaxcbSetCascade(int(cascade))
            return all_layers(*args)
        return run

    print(f"\n| workload (SmolLM2's heads, bf16 cache) | rows (ms / layer) | {chosen} (ms / layer) | "
          f"rows / {chosen} | rows + cascade (ms / layer) | {chosen} + cascade (ms / layer) | rows / {chosen} + cascade |")
    print("|---|---|---|---|---|---|---|")
    try:
        for name, (seqs, q_dtype) in BF16_PATH_WORKLOADS.items():
            batch = make_ragged_batch(seqs, seed=0, **heads)
            if name in SHARED_PREFIX_GROUPS:
                batch = share_leading_blocks(batch, SHARED_PREFIX_GROUPS[name])
            f32 = batch.args(jnp)
            args = (f32[0].astype(q_dtype), f32[1].astype(jnp.bfloat16), f32[2].astype(jnp.bfloat16), *f32[3:])
            runs = {"rows": (on_path("rows"), args), chosen: (on_path(chosen), args)}
            if name in SHARED_PREFIX_GROUPS:
                runs["rows cascade"] = (on_path("rows", cascade=True), args)
                runs["cascade"] = (on_path(chosen, cascade=True), args)
            seconds = alternate(runs, calls)
            a, b = (1e3 * seconds[k] / layers for k in ("rows", chosen))
            cascade = (f"{1e3 * seconds['rows cascade'] / layers:.2f} | {1e3 * seconds['cascade'] / layers:.2f} | "
                       f"{a / (1e3 * seconds['cascade'] / layers):.2f}x" if "cascade" in seconds else "- | - | -")
            print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {cascade} |")
    finally:
        cpu_kernels.select_attention_path(chosen)
        lib.JaxcbSetCascade(1)


# Every kernel of the library: the module constant naming its FFI target, and its symbol.
KERNEL_SYMBOLS = {
    "ATTENTION_TARGET": "JaxcbRaggedPagedAttention", "MATMUL_TARGET": "JaxcbPackedMatmul",
    "MATMUL_ARGMAX_TARGET": "JaxcbPackedMatmulArgmax", "MLP_TARGET": "JaxcbPackedMlp", "QKV_TARGET": "JaxcbPackedQkv",
    "ARGMAX_TARGET": "JaxcbRowArgmax", "KV_WRITE_TARGET": "JaxcbKvCacheWrite",
}


REV_LIBRARIES: dict[str, ctypes.CDLL] = {}  # revision -> its kernels, loaded by register_kernels_at
REV_TAKES_REAL_ROWS: dict[str, bool] = {}  # revision -> whether its matmuls take `real_rows` (skip the padding)
REV_ARGMAX_TAKES_REAL_ROWS: dict[str, bool] = {}  # revision -> whether its LM head (matmul + argmax) takes it


def register_kernels_at(rev: str) -> tuple[str, str, bool, dict[str, str]]:
    """Builds revision `rev`'s CPU kernels and registers them under their own names: (attention
    target, matmul target, whether that matmul takes the optional norm and residual, and every
    kernel `rev` has: module constant -> its target name there)."""
    with tempfile.TemporaryDirectory() as tmp:
        needed = {"ragged_paged_attention.cc", "packed_matmul.cc", "parallel_for.h"}  # in every revision
        for f in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
            for folder in ("jaxcb/kernels/cpu", "cpu_kernels"):  # where the sources lived before the kernels package
                done = subprocess.run(["git", "show", f"{rev}:{folder}/{f.name}"], capture_output=True, text=True,
                                      cwd=cpu_kernels.HERE)
                if done.returncode == 0:
                    break
            if done.returncode != 0 and f.name in needed:
                raise SystemExit(f"--against {rev}: cannot read {f.name} there: {done.stderr.strip()}")
            if done.returncode == 0:  # a kernel or header added since `rev` is left out of its build
                (Path(tmp) / f.name).write_text(done.stdout)
        lib = REV_LIBRARIES[rev] = ctypes.cdll.LoadLibrary(str(cpu_kernels.build_library(Path(tmp))))
        source = (Path(tmp) / "packed_matmul.cc").read_text()
        fused = '.Attr<float>("eps")' in source
        REV_TAKES_REAL_ROWS[rev] = "RealRows" in source
        head = source[source.find("ffi::Error PackedMatmulArgmaxImpl("):]
        REV_ARGMAX_TAKES_REAL_ROWS[rev] = "RealRowsArg" in head[:head.find("{")]
    targets = {}
    for const, symbol in KERNEL_SYMBOLS.items():
        if hasattr(lib, symbol):
            targets[const] = f"{getattr(cpu_kernels, const)}_{rev}"
            jax.ffi.register_ffi_target(targets[const], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return targets["ATTENTION_TARGET"], targets["MATMUL_TARGET"], fused, targets


def huge_pages_table(calls: int) -> None:
    rng = np.random.default_rng(0)
    chain = small_matmul_chain(packed_matmul)
    print("| weights, tokens | 4 KiB pages (ms) | 2 MiB pages (ms) | 4 KiB / 2 MiB |")
    print("|---|---|---|---|")
    for dtype in (jnp.bfloat16, jnp.float32):
        def weights():
            return [jax.block_until_ready(pack_columns(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)))
                    for shape in SMALL_LINEARS]

        small_pages, huge = weights(), weights()
        moved = collapse_onto_huge_pages(huge, "auto")
        if moved is None or not moved.collapsed:
            print(f"\n(no weights moved onto 2 MiB pages here: {moved.failure if moved else 'not Linux'})")
            return
        for m in (1, 16, 32, 64, 256):
            x = jnp.asarray(rng.standard_normal((m, 768), np.float32))
            ms = alternate({"4k": (chain, (x, small_pages)), "2m": (chain, (x, huge))},
                           calls if m <= 64 else max(3, calls // 5))
            print(f"| {jnp.dtype(dtype).name} ({moved.collapsed} of {moved.regions} regions moved), {m} | "
                  f"{1e3 * ms['4k']:.1f} | {1e3 * ms['2m']:.1f} | {ms['4k'] / ms['2m']:.2f}x |")
        del small_pages, huge


def alternate(runs: dict[str, tuple], calls: int) -> dict[str, float]:
    """Median seconds of each run (a jitted fn, its args), the runs called in turn with the order
    flipped every round, so that all of them see the same spells of the machine."""
    for fn, args in runs.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in runs}
    for i in range(calls):
        for name in (list(runs) if i % 2 else list(runs)[::-1]):
            fn, args = runs[name]
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def bf16_against(rev: str, fns: dict, calls: int, lacking: dict[str, str]) -> None:
    """The same chain with bf16 weights, both revisions on the bf16 path this CPU chose (where `rev`
    has that path; `lacking`: what select_rev_paths could not select there)."""
    chosen = cpu_kernels.bf16_matmul_path()
    if "matmul" in lacking:
        print(f"\n({rev} has no {chosen} bf16 matmul: no bf16 A/B)")
        return
    print()
    chain_against(rev, fns, jnp.bfloat16, calls, f"small's chain, bf16 weights ({chosen})")


def chain_against(rev: str, fns: dict, dtype, calls: int, title: str) -> None:
    """A row per step size: small's chain with random weights in `dtype`, this checkout's kernels
    and `rev`'s (`fns`) called in turns."""
    rng = np.random.default_rng(0)
    packed = [pack_columns(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)) for shape in SMALL_LINEARS]
    print(f"| {title}, tokens | this checkout (ms) | {rev} (ms) | {rev} / this |")
    print("|---|---|---|---|")
    for m in MATMUL_TOKENS:
        x = jnp.asarray(rng.standard_normal((m, 768), np.float32))
        ms = alternate({k: (fn, (x, packed)) for k, fn in fns.items()}, calls if m <= 64 else max(3, calls // 5))
        print(f"| {m} | {1e3 * ms['this checkout']:.1f} | {1e3 * ms[rev]:.1f} | {ms[rev] / ms['this checkout']:.2f}x |")


def select_rev_paths(rev: str) -> dict[str, str]:
    """`rev`'s library on the bf16 matmul and bf16-cache attention paths this checkout chose: a
    library starts on its paths without AMX until told, so a step replayed with `rev`'s kernels
    ran ~1.2x slower on SmolLM2 bf16 with identical sources (a comment apart). Returns what `rev`
    lacks: "matmul" and/or "attention" -> which path."""
    lib, lacking = REV_LIBRARIES[rev], {}
    matmul = {v: k for k, v in cpu_kernels.BF16_MATMUL_PATHS.items()}[cpu_kernels.bf16_matmul_path()]
    if not hasattr(lib, "JaxcbSelectBf16Matmul") or lib.JaxcbSelectBf16Matmul(matmul) != matmul:
        lacking["matmul"] = f"the {cpu_kernels.bf16_matmul_path()} bf16 matmul"
    attention = {v: k for k, v in cpu_kernels.ATTENTION_PATHS.items()}[cpu_kernels.attention_path()]
    if hasattr(lib, "JaxcbSelectAttention") and lib.JaxcbSelectAttention(attention) != attention:
        lacking["attention"] = f"the {cpu_kernels.attention_path()} attention path (its bf16-cache rows take the rows path)"
    return lacking


def against_table(rev: str, calls: int, step_rounds: int, overrides: list[str]) -> None:
    attention_target, matmul_target, fused, targets = register_kernels_at(rev)
    cpu_kernels.load_cpu_kernels()

    def matmul_at_rev(x, packed, n):
        call = jax.ffi.ffi_call(matmul_target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
        if fused:  # no norm, no residual
            return call(x, packed, jnp.zeros((0,), jnp.float32), jnp.zeros((0, n), jnp.float32), eps=np.float32(0))
        return call(x, packed)

    fns = {"this checkout": small_matmul_chain(packed_matmul), rev: small_matmul_chain(matmul_at_rev)}
    lacking = select_rev_paths(rev)
    chain_against(rev, fns, jnp.float32, calls, "small's matmul chain")
    bf16_against(rev, fns, calls, lacking)

    layers = SMALL_HEADS["num_layers"]

    def attention_at_rev(q, k, v, kv_lens, tables, qsl, n, layer, *, sm_scale):
        call = jax.ffi.ffi_call(attention_target, jax.ShapeDtypeStruct(q.shape, q.dtype))
        return call(q, k, v, kv_lens, tables, qsl, jnp.reshape(n, ()), jnp.reshape(layer, ()),
                    sm_scale=np.float32(sm_scale))

    fns = {"this checkout": small_attention_all_layers(ragged_paged_attention_cpu),
           rev: small_attention_all_layers(attention_at_rev)}
    if "attention" in lacking:  # else select_rev_paths put both on this CPU's bf16-cache path
        print(f"({rev} has no {lacking['attention']})")
    print(f"\n| attention, small's heads | this checkout (ms / layer) | {rev} (ms / layer) | {rev} / this |")
    print("|---|---|---|---|")
    cases = []
    for name, seqs in {**CACHE_DTYPE_WORKLOADS, "mixed 32 decodes @ 256 + 224-token chunk": WORKLOADS[
            "mixed 32 decodes @ 256 + 224-token chunk"]}.items():
        cases.append((name, make_ragged_batch(seqs, seed=0, **SMALL_HEADS).args(jnp)))
    over_bf16 = {name: make_ragged_batch(seqs, seed=0, **SMALL_HEADS) for name, seqs in CACHE_DTYPE_WORKLOADS.items()}
    for name, groups in SHARED_PREFIX_GROUPS.items():  # prefix caching's shared blocks: cascade items
        over_bf16[name] = share_leading_blocks(make_ragged_batch(BF16_PATH_WORKLOADS[name][0], seed=0, **SMALL_HEADS),
                                               groups)
    for name, batch in over_bf16.items():  # a float32 model over a bf16 cache
        f32 = batch.args(jnp)
        cases.append((f"{name}, bf16 cache", (f32[0], f32[1].astype(jnp.bfloat16), f32[2].astype(jnp.bfloat16), *f32[3:])))
    for name, inputs in cases:
        ms = alternate({k: (fn, inputs) for k, fn in fns.items()}, calls)
        print(f"| {name} | {1e3 * ms['this checkout'] / layers:.2f} | {1e3 * ms[rev] / layers:.2f} | "
              f"{ms[rev] / ms['this checkout']:.2f}x |")
    if step_rounds > 0:
        print()
        steps_against(rev, targets, step_rounds, overrides)


# The full-batch workload of docs/benchmarks.md: 64 requests of 40 prompt and 100 output tokens,
# all decode steps at 64 rows, on the `small` preset (random weights: the same work).
FULL_BATCH = ["model=small", "model.dtype=float32", "bench.workload=random", "bench.num_requests=64",
              "bench.input_mean=160", "bench.output_mean=400", "bench.scale=0.25", "engine.max_model_len=1024",
              "scheduler.max_num_seqs=64", "scheduler.max_num_batched_tokens=2048"]


def steps_against(rev: str, targets: dict[str, str], rounds: int, overrides: list[str] = FULL_BATCH) -> dict[str, float]:
    """The engine's compiled steps with this checkout's kernels against the same steps with `rev`'s:
    the full-batch run is recorded once, each of its step shapes compiled both ways (this checkout's
    model code calling `rev`'s FFI targets, so their arguments must not have changed since), then
    the whole recorded run is replayed with each, in turn, `rounds` times."""
    from jaxcb.benchmark import make_workload, run_offline
    from jaxcb.config import compose_config
    from jaxcb.engine import LLM

    if missing := set(KERNEL_SYMBOLS) - set(targets):
        raise SystemExit(f"--against {rev} --steps: {rev} lacks kernels this checkout's step calls: {sorted(missing)}")
    cfg = compose_config(overrides)
    llm = LLM(cfg)
    if lacking := select_rev_paths(rev):  # after the engine chose this checkout's; the CLI selected them already
        print(f"({rev} lacks {' and '.join(lacking.values())}: its steps run without them)")
    runner = llm.engine.runner
    with record_steps(runner) as recorded:
        run_offline(llm, make_workload(cfg.bench, llm.engine.model_config.vocab_size, cfg.engine.max_model_len),
                    cfg.scheduler.policy)
    keys = sorted({key for key, _, _ in recorded})
    ours = {key: runner.executable(key) for key in keys}
    # Traced again, through new functions (no trace cached from ours), with the targets renamed.
    traced, names = (runner._model_step, runner._sampler_step), {const: getattr(cpu_kernels, const)
                                                                  for const in KERNEL_SYMBOLS}
    model, sampler = (jitted.__wrapped__ for jitted in traced)
    runner._model_step = jax.jit(lambda *args: model(*args), donate_argnums=(1, 2), static_argnums=(3,))
    runner._sampler_step = jax.jit(lambda *args: sampler(*args), static_argnums=(3,))
    import jaxcb.kernels.attention.cpu as attention_cpu
    import jaxcb.kernels.row_argmax as argmax_module

    users = [m for m in (cpu_kernels, pm, attention_cpu, argmax_module)]  # each imported the target names
    takes_real_rows, argmax_takes_real_rows = pm.TAKES_REAL_ROWS, pm.ARGMAX_TAKES_REAL_ROWS
    if not REV_TAKES_REAL_ROWS[rev]:
        print(f"({rev}'s matmuls compute the padding rows too)")
    # Every trace cached so far is dropped before REV's steps are traced and again after: the nested jit of
    # the decoder layer (`llama._decoder_layer_traced_once`) would otherwise hand REV's steps the layer
    # it traced with this checkout's kernels (and later traces of this checkout REV's). Compiled
    # executables, ours among them, stay valid.
    jax.clear_caches()
    try:
        pm.TAKES_REAL_ROWS = REV_TAKES_REAL_ROWS[rev]  # an older build's handlers take one operand fewer
        pm.ARGMAX_TAKES_REAL_ROWS = REV_ARGMAX_TAKES_REAL_ROWS[rev]
        for const in KERNEL_SYMBOLS:
            for m in users:
                if hasattr(m, const):
                    setattr(m, const, targets[const])
        theirs = {key: tuple(runner._lower(part).compile() for part in key.parts) for key in keys}
    finally:
        jax.clear_caches()
        pm.TAKES_REAL_ROWS, pm.ARGMAX_TAKES_REAL_ROWS = takes_real_rows, argmax_takes_real_rows
        runner._model_step, runner._sampler_step = traced
        for const, name in names.items():
            for m in users:
                if hasattr(m, const):
                    setattr(m, const, name)
    for key, exes in theirs.items():  # a trace reused from ours would compare this checkout with itself
        text, our_text = "".join(e.as_text() for e in exes), "".join(e.as_text() for e in ours[key])
        if mixed := [names[c] for c in KERNEL_SYMBOLS if f'"{names[c]}"' in text or
                     (f'"{names[c]}"' in our_text and f'"{targets[c]}"' not in text)]:
            raise RuntimeError(f"the step {key} compiled for {rev} calls this checkout's {sorted(mixed)}, not {rev}'s")
    times = {"this checkout": [], rev: []}
    # Each round also split by the steps' token bucket (each step waited for, to be timed alone): where a
    # kernel change gains or loses, prefill chunks against decode steps.
    by_bucket: dict[str, dict[int, list[float]]] = {"this checkout": {}, rev: {}}
    for i in range(rounds):  # the order flipped every round
        for name in (("this checkout", rev) if i % 2 else (rev, "this checkout")):
            per_step: dict[int, float] = {}
            times[name].append(replay(runner, recorded, ours if name == "this checkout" else theirs, wait_each=True,
                                      on_step=lambda key, took: per_step.__setitem__(
                                          key.num_tokens, per_step.get(key.num_tokens, 0.0) + took)))
            for tokens, took in per_step.items():
                by_bucket[name].setdefault(tokens, []).append(took)
    ms = {name: float(np.median(t)) for name, t in times.items()}
    print(f"| the full-batch run's {len(recorded)} steps, replayed | this checkout (s) | {rev} (s) | {rev} / this |")
    print("|---|---|---|---|")
    print(f"| median of {rounds} | {ms['this checkout']:.3f} | {ms[rev]:.3f} | {ms[rev] / ms['this checkout']:.3f}x |")
    counts = {tokens: sum(1 for key, _, _ in recorded if key.num_tokens == tokens) for tokens in by_bucket[rev]}
    for tokens in sorted(by_bucket[rev]):
        ours_s, theirs_s = (float(np.median(by_bucket[name][tokens])) for name in ("this checkout", rev))
        print(f"| {counts[tokens]} steps of the {tokens}-token bucket | {ours_s:.3f} | {theirs_s:.3f} | "
              f"{theirs_s / ours_s:.3f}x |")
    return ms


if __name__ == "__main__":
    main()
