"""The one prepared GPU check: kernel correctness and speed against the bandwidth roofline, and the 8B step.

    python scripts/gpu_check.py                 # on an H100/H200: a few minutes
    python scripts/gpu_check.py --dry-run       # anywhere: CPU, Pallas interpreter, tiny shapes

Sections (each reports and goes on if another fails; the exit code says whether all passed):
  1. device and measured copy bandwidth (elementwise read+write of a large buffer)
  2. correctness on the device: Pallas kernel and XLA path vs the reference, fp32 and bf16,
     random ragged batches (decode, prefill, mixed) at llama8b attention shapes
  3. decode attention: batches of 1, 32, 128, 256 sequences at 1k and 4k context; device time
     per call and achieved HBM bandwidth (K/V bytes read / time) against the copy bandwidth
  4. the full jitted step of an 8B-shaped Llama with random bf16 weights: decode batches and a
     prefill chunk; ms/step, tokens/s, and the bandwidth roofline (weights + K/V read / copy bw)
Record what it prints in docs/gpu.md, with the command.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

GIB = 1 << 30


def log(msg: str = "") -> None:
    print(msg, flush=True)


class Check:
    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.interpret = dry_run
        self.failures: list[str] = []
        self.results: dict = {}
        self.copy_bw = None

    def section(self, title, fn):
        log(f"\n## {title}\n")
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # report and continue: one run must say as much as it can
            self.failures.append(f"{title}: {type(e).__name__}: {e}")
            log(f"FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(limit=3)
        log(f"\n({time.perf_counter() - start:.1f} s)")

    # 1 ------------------------------------------------------------------------------------------
    def device(self):
        from jaxcb.timing import copy_bandwidth

        dev = jax.devices()[0]
        log(f"jax {jax.__version__}, backend {jax.default_backend()}, device {dev.device_kind}, {jax.device_count()} device(s)")
        size = (16 << 20) if self.dry_run else 4 * GIB
        bw, t = copy_bandwidth(size, iters=3 if self.dry_run else 20)
        self.copy_bw = bw
        log(f"copy bandwidth: {bw / 1e9:.0f} GB/s (read+write of {size / GIB:.2f} GiB, {t.median_ms:.3f} ms)")
        self.results["device"] = dict(kind=dev.device_kind, jax=jax.__version__, copy_bw_gbs=bw / 1e9)

    # 2 ------------------------------------------------------------------------------------------
    def heads(self):
        # llama8b attention: 32 query heads, 8 KV heads, head dim 128, block size 16
        return (8, 2, 64, 16) if self.dry_run else (32, 8, 128, 16)

    def impls(self):
        from pallas_kernels import ragged_paged_attention, ragged_paged_attention_xla

        return {
            "pallas": functools.partial(ragged_paged_attention, interpret=self.interpret),
            "xla": ragged_paged_attention_xla,
        }

    def correctness(self):
        from pallas_kernels import ragged_paged_attention_reference
        from pallas_kernels.testing import make_ragged_batch

        hq, hkv, d, bs = self.heads()
        rng = np.random.default_rng(0)
        cases = {
            "decode": [(1, int(n)) for n in rng.integers(1, 300, 8)],
            "prefill": [(n, n) for n in (37, 100, 16)],
            "mixed": [(1, 250), (1, 17), (64, 64), (33, 140), (1, 1)],
        }
        if self.dry_run:
            cases = {k: [(min(q, 20), min(kv, 20)) for q, kv in v[:3]] for k, v in cases.items()}
        log("| batch | dtype | impl | max rel err | limit | ok |\n|---|---|---|---|---|---|")
        rows = []
        for name, seqs in cases.items():
            batch = make_ragged_batch(seqs, block_size=bs, num_kv_heads=hkv, group=hq // hkv, head_dim=d, seed=1)
            for dtype, limit in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
                args = batch.args(jnp, dtype)
                with jax.default_matmul_precision("highest"):
                    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=d**-0.5).astype(jnp.float32))
                    n = batch.num_real_tokens
                    for impl, fn in self.impls().items():
                        out = np.asarray(fn(*args, sm_scale=d**-0.5).astype(jnp.float32))
                        err = float(np.abs(out[:n] - ref[:n]).max() / (np.abs(ref[:n]).max() + 1e-6))
                        ok = err <= limit and bool(np.all(out[n:] == 0))
                        rows.append(dict(batch=name, dtype=jnp.dtype(dtype).name, impl=impl, err=err, ok=ok))
                        log(f"| {name} | {jnp.dtype(dtype).name} | {impl} | {err:.2e} | {limit:g} | {'yes' if ok else 'NO'} |")
        self.results["correctness"] = rows
        bad = [r for r in rows if not r["ok"]]
        if bad:
            raise AssertionError(f"{len(bad)} implementation(s) disagree with the reference: {bad}")

    # 3 ------------------------------------------------------------------------------------------
    def decode_bandwidth(self):
        from jaxcb.timing import time_in_loop
        from pallas_kernels.testing import random_decode_batch

        hq, hkv, d, bs = self.heads()
        batches, contexts = ((1, 4), (64, 128)) if self.dry_run else ((1, 32, 128, 256), (1024, 4096))
        iters = 2 if self.dry_run else 50
        dtype = jnp.float32 if self.dry_run else jnp.bfloat16
        log("| seqs | context | impl | time (us) | K/V read (MiB) | GB/s | % of copy bw |\n|---|---|---|---|---|---|---|")
        rows = []
        for ctx in contexts:
            for num_seqs in batches:
                args = random_decode_batch(
                    jax.random.key(num_seqs), num_seqs=num_seqs, context_len=ctx, num_kv_heads=hkv,
                    num_q_heads=hq, head_dim=d, block_size=bs, dtype=dtype,
                )
                kv_bytes = 2 * num_seqs * ctx * hkv * d * jnp.dtype(dtype).itemsize
                for impl, fn in self.impls().items():
                    attend = functools.partial(fn, sm_scale=d**-0.5)
                    t = time_in_loop(attend, *args, iters=iters, repeats=3 if self.dry_run else 7)
                    bw = kv_bytes / t.median_s
                    pct = 100 * bw / self.copy_bw if self.copy_bw else float("nan")
                    rows.append(dict(seqs=num_seqs, context=ctx, impl=impl, us=t.median_s * 1e6, gbs=bw / 1e9, pct=pct))
                    log(f"| {num_seqs} | {ctx} | {impl} | {t.median_s * 1e6:.1f} | {kv_bytes / (1 << 20):.1f} | "
                        f"{bw / 1e9:.0f} | {pct:.0f}% |")
                del args
        self.results["decode_attention"] = rows

    # 4 ------------------------------------------------------------------------------------------
    def full_step(self):
        from flax import nnx

        from jaxcb.attention import AttentionBackend
        from jaxcb.kv_cache import allocate_kv_cache, default_cache_dtype
        from jaxcb.model.config import LlamaConfig, RopeScaling
        from jaxcb.model.llama import build_random_model, count_params
        from jaxcb.reference_generate import forward_step
        from jaxcb.timing import time_calls
        from pallas_kernels import ragged_paged_attention

        if self.dry_run:
            cfg = LlamaConfig(
                vocab_size=259, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=512,
                tie_word_embeddings=False, dtype="float32",
            )
            batches, ctx, prefill, calls = (1, 4), 64, 64, 2
        else:  # Llama-3.1-8B shapes
            cfg = LlamaConfig(
                vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=131072,
                tie_word_embeddings=False, dtype="bfloat16",
                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
            )
            batches, ctx, prefill, calls = (1, 32, 128, 256), 1024, 2048, 20
        backend = AttentionBackend("pallas", functools.partial(ragged_paged_attention, interpret=self.interpret))
        start = time.perf_counter()
        model = build_random_model(cfg, seed=0, attention=backend)
        graphdef, state = nnx.split(model)
        jax.block_until_ready(state)
        n_params = count_params(model)
        param_bytes = n_params * jnp.dtype(cfg.dtype).itemsize
        log(f"model: {n_params:,} parameters ({param_bytes / GIB:.1f} GiB {cfg.dtype}), "
            f"random init {time.perf_counter() - start:.1f} s")
        bs = 16
        blocks_per_seq = -(-ctx // bs)
        max_seqs = max(batches)
        cache_dtype = jnp.float32 if self.dry_run else default_cache_dtype("auto")
        cache = allocate_kv_cache(cfg, max_seqs * blocks_per_seq + 1 + -(-prefill // bs), bs, cache_dtype)
        log(f"KV cache: {cache.k.nbytes * 2 / GIB:.1f} GiB {jnp.dtype(cache_dtype).name}")
        kv_token_bytes = cfg.kv_bytes_per_token(jnp.dtype(cache_dtype).itemsize)

        def step_inputs(num_seqs, q_len, kv_len):
            from jaxcb.attention import AttentionMetadata

            tables = 1 + np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
            if q_len > 1:
                tables = 1 + np.arange(-(-kv_len // bs), dtype=np.int32)[None, :]
            n_tok = num_seqs * q_len
            positions = np.tile(np.arange(kv_len - q_len, kv_len, dtype=np.int32), num_seqs)
            seq_of = np.repeat(np.arange(num_seqs), q_len)
            slots = tables[seq_of, positions // bs] * bs + positions % bs
            md = AttentionMetadata(
                slot_mapping=jnp.asarray(slots, jnp.int32),
                query_start_loc=jnp.asarray(np.arange(num_seqs + 1) * q_len, jnp.int32),
                kv_lens=jnp.full((num_seqs,), kv_len, jnp.int32),
                block_tables=jnp.asarray(tables),
                num_seqs=jnp.int32(num_seqs),
            )
            ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, n_tok), jnp.int32)
            logits_idx = jnp.asarray(np.arange(1, num_seqs + 1) * q_len - 1, jnp.int32)
            return ids, jnp.asarray(positions), md, logits_idx

        log("| step | tokens | ms/step | tokens/s | roofline ms (weights + K/V at copy bw) | % of roofline |")
        log("|---|---|---|---|---|---|")
        rows = []
        shapes = [(f"decode x{b} @ {ctx} ctx", b, 1, ctx) for b in batches] + [(f"prefill {prefill}", 1, prefill, prefill)]
        for name, num_seqs, q_len, kv_len in shapes:
            ids, pos, md, logits_idx = step_inputs(num_seqs, q_len, kv_len)
            holder = {"cache": cache}

            def run_step():
                logits, holder["cache"] = forward_step(graphdef, state, holder["cache"], ids, pos, md, logits_idx)
                return jnp.argmax(logits, axis=-1)

            t = time_calls(run_step, calls=calls, warmup=1)
            cache = holder["cache"]
            tokens = num_seqs * q_len
            read_bytes = param_bytes + num_seqs * kv_len * kv_token_bytes
            roof = read_bytes / self.copy_bw if self.copy_bw else float("nan")
            rows.append(dict(step=name, tokens=tokens, ms=t.median_ms, tok_s=tokens / t.median_s, roofline_ms=roof * 1e3))
            log(f"| {name} | {tokens} | {t.median_ms:.2f} | {tokens / t.median_s:,.0f} | {roof * 1e3:.2f} | "
                f"{100 * roof / t.median_s:.0f}% |")
        self.results["full_step"] = rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Pallas interpreter, tiny shapes")
    parser.add_argument("--json", help="also write the results as JSON to this path")
    args = parser.parse_args()
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "gpu":
        sys.exit(f"error: no GPU found (backend {jax.default_backend()}); run with --dry-run to exercise the script")
    check = Check(args.dry_run)
    log(f"# jaxcb GPU check{' (dry run: CPU, interpret mode, tiny shapes)' if args.dry_run else ''}")
    check.section("1. Device and copy bandwidth", check.device)
    check.section("2. Kernel correctness on the device", check.correctness)
    check.section("3. Decode attention: achieved bandwidth", check.decode_bandwidth)
    check.section("4. Full jitted step, 8B-shaped model, random weights", check.full_step)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(check.results, failures=check.failures), f, indent=2)
    log("\n" + ("ALL CHECKS PASSED" if not check.failures else "FAILURES:\n" + "\n".join(check.failures)))
    sys.exit(1 if check.failures else 0)


if __name__ == "__main__":
    main()
