"""The stages of scripts/gpu_check.py, one function each, in the order they run.

Each takes a `Stage` (gpu_check.py): `st.dry_run` picks tiny shapes on the CPU with the Pallas
interpreter; `with st.row(label) as r:` records one isolated row (fields set on `r`);
`st.state` carries the copy bandwidth and the like to later stages; `st.seconds_left` is the
budget left. Rows print as Markdown table lines, so the log pastes into docs/gpu.md.
"""

from __future__ import annotations

import functools
import gc
import glob
import importlib
import os
import platform
import subprocess
import sys
import time

GIB = 1 << 30
# A stage starts only with this much of the budget left (a twentieth of it in a dry run).
MIN_SECONDS = {"smoke": 10, "correctness": 20, "decode": 30, "step": 60, "engine": 90}


def log(msg: str = "") -> None:
    print(msg, flush=True)


def heads(st) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim): llama8b's, or a tiny stand-in in a dry run."""
    return (8, 2, 64) if st.dry_run else (32, 8, 128)


def kernel_fns(st) -> dict:
    from jaxcb.kernels.attention.pallas import ragged_paged_attention
    from jaxcb.kernels.attention.xla import ragged_paged_attention_xla

    return {"pallas": functools.partial(ragged_paged_attention, interpret=st.dry_run), "xla": ragged_paged_attention_xla}


# preflight ----------------------------------------------------------------------------------------
def preflight(st) -> None:
    """Versions and devices; every import the later stages need; ptxas. No GPU (and no dry run): stop."""
    import jax

    with st.row("python") as r:
        r["version"] = sys.version.split()[0]
        r["platform"] = platform.platform()
        log(f"python {r['version']} on {r['platform']}")
    for module in ("jax", "jaxlib", "flax", "orbax.checkpoint", "numpy", "ml_dtypes", "hydra", "omegaconf", "triton"):
        with st.row(f"import {module}") as r:
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                if module == "triton":  # optional: the shared-memory estimate only
                    r["version"] = f"absent ({e})"
                    log(f"{module}: absent (optional)")
                    continue
                raise
            r["version"] = getattr(mod, "__version__", "?")
            log(f"{module} {r['version']}")
    with st.row("devices") as r:
        devices = jax.devices()
        r["backend"] = jax.default_backend()
        r["devices"] = [f"{d.device_kind} ({d.platform})" for d in devices]
        stats = devices[0].memory_stats() or {}
        r["bytes_limit_gib"] = round(stats.get("bytes_limit", 0) / GIB, 1)
        log(f"backend {r['backend']}: {len(devices)} x {devices[0].device_kind}; XLA may use "
            f"{r['bytes_limit_gib']} GiB; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
        if r["backend"] != "gpu" and not st.dry_run:
            st.check.state["abort"] = f"no GPU (backend {r['backend']}); use --dry-run to exercise the script"
            raise RuntimeError(st.check.state["abort"])
    for module in ("jaxcb.config", "jaxcb.engine", "jaxcb.benchmark", "jaxcb.kernels.triton_calls"):
        with st.row(f"import {module}"):
            importlib.import_module(module)
    with st.row("ptxas") as r:
        from jaxcb.kernels.triton_calls import find_ptxas

        ptxas = find_ptxas()
        r["path"] = ptxas
        r["version"] = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1] if ptxas else None
        log(f"ptxas: {r['version'] or 'not on PATH (register counts will be skipped)'}")
    with st.row("server not imported") as r:
        r["loaded"] = sorted(m for m in ("fastapi", "pydantic", "uvicorn", "jaxcb.server") if m in sys.modules)
        assert not r["loaded"], f"the check imported {r['loaded']}"


# bandwidth ---------------------------------------------------------------------------------------
def bandwidth(st) -> None:
    """Read+write of a buffer of random floats: the bandwidth every roofline below is held against."""
    from benchmarks.timing import copy_bandwidth

    sizes = (4 << 20, 16 << 20) if st.dry_run else (1 * GIB, 4 * GIB)
    log("| buffer | time (ms) | GB/s (read + write) |\n|---|---|---|")
    best = 0.0
    for size in sizes:
        with st.row(f"copy {size / GIB:.3f} GiB") as r:
            bw, t = copy_bandwidth(size, iters=3 if st.dry_run else 20, repeats=3 if st.dry_run else 5)
            r["ms"], r["gbs"] = t.median_ms, bw / 1e9
            best = max(best, bw)
            log(f"| {size / GIB:.3f} GiB | {t.median_ms:.3f} | {r['gbs']:.0f} |")
    st.state["copy_bw"] = best
    st.note("copy_bw_gbs", best / 1e9)


# smoke -------------------------------------------------------------------------------------------
def smoke(st) -> None:
    """One call of the kernel at llama8b heads; then XLA's own PTX for it through `ptxas -v`."""
    dump = os.path.join(st.check.out_dir, "smoke_xla_dump")
    fn, args = kernel_vs_reference(st, dump)
    if xla_ptx_registers(st, dump):
        triton_estimate(st, fn, args)


def kernel_vs_reference(st, dump: str):
    """The kernel jitted at llama8b heads on a mixed batch (two decodes, a 7-token chunk), compiled with
    XLA's dump (its PTX) into `dump`, against the reference in bf16; returns (the jitted fn, its args)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxcb.kernels.attention.pallas import ragged_paged_attention
    from jaxcb.kernels.attention.reference import ragged_paged_attention_reference
    from jaxcb.kernels.attention.testing import make_ragged_batch

    hq, hkv, d = heads(st)
    batch = make_ragged_batch([(1, 40), (7, 30), (1, 1)], block_size=16, num_kv_heads=hkv, group=hq // hkv,
                              head_dim=d, seed=3)
    args = batch.args(jnp, jnp.bfloat16)
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d**-0.5, interpret=st.dry_run))
    with st.row("compile and run") as r:
        start = time.perf_counter()
        options = {} if st.dry_run else {"xla_dump_to": dump}
        compiled = fn.lower(*args).compile(compiler_options=options)
        r["compile_s"] = round(time.perf_counter() - start, 2)
        out = np.asarray(compiled(*args).astype(jnp.float32))
        ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=d**-0.5).astype(jnp.float32))
        n = batch.num_real_tokens
        r["max_abs_err"] = float(np.abs(out[:n] - ref[:n]).max())
        assert np.isfinite(out).all(), "the kernel wrote a non-finite value"
        assert r["max_abs_err"] < 5e-2, f"max abs error {r['max_abs_err']} against the reference"
        log(f"compiled in {r['compile_s']} s; max abs error vs the reference {r['max_abs_err']:.2e} (bf16)")
    return fn, args


def xla_ptx_registers(st, dump: str) -> bool:
    """Registers, spills and stack of the kernel's functions in the PTX XLA dumped (`ptxas -v`, sm_90a);
    False in a dry run (no PTX on the CPU)."""
    with st.row("ptxas -v on XLA's PTX") as r:
        if st.dry_run:
            r["skipped"] = "no PTX on the CPU"
            log("ptxas: skipped in a dry run (no PTX on the CPU)")
            return False
        from jaxcb.kernels.triton_calls import find_ptxas, parse_ptxas_functions

        ptxas = find_ptxas()
        ptx_files = sorted(glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True))
        r["ptx_files"] = [os.path.basename(p) for p in ptx_files]
        if not ptx_files:  # say what XLA did write, for the next run to look for
            names = sorted(os.path.relpath(p, dump) for p in glob.glob(os.path.join(dump, "**", "*"), recursive=True))
            r["dump_files"] = names[:200]
            log(f"XLA's dump ({len(names)} files): " + ", ".join(names[:60]))
        assert ptx_files, f"XLA dumped no .ptx into {dump}"
        assert ptxas, "no ptxas (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, beside nvcc)"
        for ptx in ptx_files:
            out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull],
                                 capture_output=True, text=True)
            for name, res in parse_ptxas_functions(out.stdout + out.stderr).items():
                if "ragged_paged_attention" in name or "triton" in name:
                    r.setdefault("functions", {})[name] = res
                    log(f"{name}: {res['registers']} registers, spills {res['spill_store_bytes']}/"
                        f"{res['spill_load_bytes']} B, stack {res['stack_bytes']} B")
        assert r.get("functions"), "no kernel function found in the dumped PTX"
    return True


def triton_estimate(st, fn, args) -> None:
    """The triton package's compile of the same kernel: its shared memory, which XLA's PTX does not say."""
    import jax

    with st.row("triton-package estimate (shared memory)") as r:
        from jaxcb.kernels.triton_calls import TritonUnavailable, lower_for_gpu, ptxas_resources, triton_calls

        try:
            [call] = triton_calls(lower_for_gpu(fn, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]))
            res = ptxas_resources(call)
        except TritonUnavailable as e:
            r["skipped"] = str(e)
            log(f"skipped: {e}")
            return
        r.update(res.__dict__)
        log(f"{res.toolchain}: {res.registers} registers, {res.shared_bytes / 1024:.0f} KiB shared")


# correctness -------------------------------------------------------------------------------------
def correctness(st) -> None:
    """Both paths against the reference: decode, prefill and mixed ragged batches, block sizes 16
    and 32, fp32 and bf16; then a cache over 4 GiB read at its last blocks (64-bit offsets)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxcb.kernels.attention.reference import ragged_paged_attention_reference
    from jaxcb.kernels.attention.testing import make_ragged_batch

    hq, hkv, d = heads(st)
    rng = np.random.default_rng(0)
    cases = {
        "decode": [(1, int(n)) for n in rng.integers(1, 300, 8)],
        "prefill": [(n, n) for n in (37, 100, 16)],
        "mixed": [(1, 250), (1, 17), (64, 64), (33, 140), (1, 1)],
    }
    if st.dry_run:  # one batch that has decode and prefill rows: the code path, at tiny shapes
        cases = {"mixed": [(min(q, 20), min(kv, 20)) for q, kv in cases["mixed"][:3]]}
    log("| batch | block | dtype | impl | max rel err | limit | ok |\n|---|---|---|---|---|---|---|")
    # A dry run walks every path on one mixed batch at one block size: interpret mode's parity on
    # every form is the test suite's (tests/test_attention.py), and each call here compiles anew.
    for block_size in (16,) if st.dry_run else (16, 32):
        for name, seqs in cases.items():
            batch = make_ragged_batch(seqs, block_size=block_size, num_kv_heads=hkv, group=hq // hkv, head_dim=d,
                                      seed=block_size)
            for dtype, limit in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
                args = batch.args(jnp, dtype)
                with jax.default_matmul_precision("highest"):
                    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=d**-0.5).astype(jnp.float32))
                n = batch.num_real_tokens
                fns = dict(kernel_fns(st), **{"pallas 4 splits": functools.partial(kernel_fns(st)["pallas"],
                                                                                      num_splits=4)})
                for impl, fn in fns.items():
                    label = f"{name} block {block_size} {jnp.dtype(dtype).name} {impl}"
                    with st.row(label) as r, jax.default_matmul_precision("highest"):
                        out = np.asarray(fn(*args, sm_scale=d**-0.5).astype(jnp.float32))
                        r["err"] = float(np.abs(out[:n] - ref[:n]).max() / (np.abs(ref[:n]).max() + 1e-6))
                        r["ok"] = bool(r["err"] <= limit and np.all(out[n:] == 0))
                        log(f"| {name} | {block_size} | {jnp.dtype(dtype).name} | {impl} | {r['err']:.2e} | {limit:g} "
                            f"| {'yes' if r['ok'] else 'NO'} |")
                        assert r["ok"], f"error {r['err']:.2e} over {limit:g}, or padding rows not zero"
    large_cache(st)


def large_cache(st) -> None:
    """A K and a V cache of over 4 GiB each (64 MiB in a dry run), sequences in its last blocks."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxcb.kernels.attention.reference import ragged_paged_attention_reference

    hq, hkv, d = heads(st)
    bs, layers = 16, 2
    target = (64 << 20) if st.dry_run else (4 * GIB + (256 << 20))
    num_blocks = target // (layers * hkv * bs * d * 2)
    shape = (layers, hkv, num_blocks, bs, d)
    seqs = [(1, 300), (1, 40), (20, 70)] if not st.dry_run else [(1, 30), (5, 20)]
    with st.row(f"cache of {2 * layers * hkv * num_blocks * bs * d * 2 / GIB:.2f} GiB (K + V), last blocks") as r:
        k_key, v_key, q_key = jax.random.split(jax.random.key(7), 3)
        k = jax.random.normal(k_key, shape, jnp.bfloat16)
        v = jax.random.normal(v_key, shape, jnp.bfloat16)
        width = max(-(-kv // bs) for _, kv in seqs)
        tables = np.zeros((len(seqs), width), np.int32)
        top = num_blocks - 1
        for i, (_, kv) in enumerate(seqs):  # the highest block ids: byte offsets past 2^32 in layer 1
            for b in range(-(-kv // bs)):
                tables[i, b] = top
                top -= 1
        num_tokens = sum(q for q, _ in seqs)
        q = jax.random.normal(q_key, (num_tokens, hq, d), jnp.bfloat16)
        qsl = np.concatenate([[0], np.cumsum([q_len for q_len, _ in seqs])]).astype(np.int32)
        args = (q, k, v, jnp.asarray([kv for _, kv in seqs], jnp.int32), jnp.asarray(tables), jnp.asarray(qsl),
                jnp.int32(len(seqs)), jnp.int32(layers - 1))
        ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=d**-0.5).astype(jnp.float32))
        for impl, fn in kernel_fns(st).items():
            out = np.asarray(fn(*args, sm_scale=d**-0.5).astype(jnp.float32))
            err = float(np.abs(out - ref).max() / (np.abs(ref).max() + 1e-6))
            r[f"{impl}_err"] = err
            log(f"| large cache | {bs} | bfloat16 | {impl} | {err:.2e} | 0.02 | {'yes' if err <= 2e-2 else 'NO'} |")
        assert all(r[f"{impl}_err"] <= 2e-2 for impl in kernel_fns(st)), "a path disagrees on the large cache"
        del k, v


# decode ------------------------------------------------------------------------------------------
def decode(st) -> None:
    """Decode attention at batches 1-256 and 1k/4k contexts: device time per call and K/V bytes read
    per second against the copy bandwidth; JAX's own Pallas paged_attention on the same cache; the
    pallas kernel on the same batch from an fp8_e4m3 cache (cache.dtype=fp8_e4m3's bandwidth)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import time_in_loop
    from jaxcb.kernels.attention.testing import random_decode_batch

    hq, hkv, d = heads(st)
    batches, contexts = ((4,), (128,)) if st.dry_run else ((1, 16, 32, 128, 256), (1024, 4096))
    iters, repeats = (2, 2) if st.dry_run else (30, 5)
    dtype = jnp.float32 if st.dry_run else jnp.bfloat16
    copy_bw = st.state.get("copy_bw")
    # "pallas" splits the context where a small batch would leave SMs idle (split-KV); "pallas 1 split" is the
    # same kernel without, to read what the split buys.
    unsplit = functools.partial(kernel_fns(st)["pallas"], num_splits=1)
    impls = dict(kernel_fns(st), **{"pallas 1 split": unsplit},
                 jax_paged_attention=functools.partial(jax_paged_attention, interpret=st.dry_run))
    log("| seqs | context | impl | time (us) | K/V read (MiB) | GB/s | % of copy bw |\n|---|---|---|---|---|---|---|")
    for ctx in contexts:
        for num_seqs in batches:
            args = random_decode_batch(jax.random.key(num_seqs), num_seqs=num_seqs, context_len=ctx, num_kv_heads=hkv,
                                       num_q_heads=hq, head_dim=d, block_size=16, dtype=dtype)
            kv_bytes = 2 * num_seqs * ctx * hkv * d * jnp.dtype(dtype).itemsize
            for impl, fn in impls.items():
                with st.row(f"decode x{num_seqs} @ {ctx} {impl}", seqs=num_seqs, context=ctx, impl=impl) as r:
                    t = time_in_loop(functools.partial(fn, sm_scale=d**-0.5), *args, iters=iters, repeats=repeats)
                    r["us"], r["gbs"] = t.median_s * 1e6, kv_bytes / t.median_s / 1e9
                    r["pct_of_copy_bw"] = 100 * kv_bytes / t.median_s / copy_bw if copy_bw else None
                    pct = f"{r['pct_of_copy_bw']:.0f}%" if copy_bw else "-"
                    log(f"| {num_seqs} | {ctx} | {impl} | {r['us']:.1f} | {kv_bytes / (1 << 20):.1f} | {r['gbs']:.0f} | {pct} |")
            # The same batch from an fp8 (e4m3) cache, as the engine reads it with cache.dtype=fp8_e4m3: the kernel
            # widens the 8-bit tiles in registers, the form scales q and the output. Half the bytes of bf16.
            impl = "pallas fp8_e4m3"
            with st.row(f"decode x{num_seqs} @ {ctx} {impl}", seqs=num_seqs, context=ctx, impl=impl) as r:
                fn, fp8_args = fp8_decode(st, args)
                fp8_bytes = 2 * num_seqs * ctx * hkv * d  # one byte an element
                t = time_in_loop(functools.partial(fn, sm_scale=d**-0.5), *fp8_args, iters=iters, repeats=repeats)
                r["us"], r["gbs"] = t.median_s * 1e6, fp8_bytes / t.median_s / 1e9
                r["pct_of_copy_bw"] = 100 * fp8_bytes / t.median_s / copy_bw if copy_bw else None
                pct = f"{r['pct_of_copy_bw']:.0f}%" if copy_bw else "-"
                log(f"| {num_seqs} | {ctx} | {impl} | {r['us']:.1f} | {fp8_bytes / (1 << 20):.1f} | {r['gbs']:.0f} | {pct} |")
                del fp8_args
            del args


def fp8_decode(st, args):
    """(attend(q, k8, v8, ...) through the pallas form with per-(layer, KV head) scales, the batch's
    arguments with its cache quantized to float8_e4m3fn at a scale that spans the random values)."""
    import jax.numpy as jnp

    from jaxcb.kernels.attention import AttentionMetadata, KVCache, pallas_form
    from jaxcb.kernels.attention.quantization import QUANTIZED_CACHE_DTYPES, quantized_max

    q, k_cache, v_cache, kv_lens, tables, qsl, num_seqs, layer = args
    fp8 = QUANTIZED_CACHE_DTYPES["fp8_e4m3"]
    scale = jnp.full(k_cache.shape[:2], 6.0 / quantized_max(fp8), jnp.float32)  # |N(0, 1)| < 6
    k8, v8 = ((x.astype(jnp.float32) / scale[:, :, None, None, None]).astype(fp8) for x in (k_cache, v_cache))
    form = pallas_form(interpret=st.dry_run)

    def attend(q, k8, v8, kv_lens, tables, qsl, num_seqs, layer, *, sm_scale):
        md = AttentionMetadata(jnp.zeros(q.shape[0], jnp.int32), qsl, kv_lens, tables, num_seqs)
        return form.attend(q, KVCache(k8, v8, scale, scale), layer, md, sm_scale)

    return attend, (q, k8, v8, kv_lens, tables, qsl, num_seqs, layer)


def jax_paged_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer, *, sm_scale,
                        interpret=False):
    """JAX's own Pallas paged_attention (jax.experimental.pallas.ops.gpu) with our kernels' arguments,
    for a decode batch (one token per sequence) over a one-layer cache."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    assert k_cache.shape[0] == 1, f"{k_cache.shape=}: one layer, so that dropping the axis copies nothing"
    pages_per_seq = block_tables.shape[1]
    pages_per_block = min(8, pages_per_seq)
    k_splits = max(1, min(16, pages_per_seq // pages_per_block))
    return paged_attention(
        q * sm_scale, k_cache.reshape(k_cache.shape[1:]), v_cache.reshape(v_cache.shape[1:]), block_tables, kv_lens,
        pages_per_compute_block=pages_per_block, k_splits=k_splits, interpret=interpret,
    )


# step --------------------------------------------------------------------------------------------
def llama8b_or_tiny(st):
    from jaxcb.config import compose_config
    from jaxcb.model.config import resolve_llama_config

    name = "tiny" if st.dry_run else "llama8b"
    return resolve_llama_config(compose_config([f"model={name}", "model.init=random"]).model)


def step(st) -> None:
    """The whole jitted step (embed, 32 scanned layers with the kernel, logits) of an 8B-shaped Llama
    with random bf16 weights: compile time, ms/step, tokens/s, dispatch latency, against the roofline
    of reading the weights and the context's K/V once at the copy bandwidth."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.hlo_weights import layer_shapes_of, layer_weight_copies
    from benchmarks.reference_generate import forward_step
    from benchmarks.timing import time_calls
    from jaxcb.backends import Backend
    from jaxcb.kernels.attention import AttentionMetadata, pallas_form
    from jaxcb.kv_cache import allocate_kv_cache
    from jaxcb.model.llama import build_random_model

    cfg = llama8b_or_tiny(st)
    if st.dry_run:
        cfg = dataclasses.replace(cfg, dtype="float32")
    batches, ctx, prefill, calls = ((1, 4), 64, 64, 2) if st.dry_run else ((16, 32, 64, 128, 256), 1024, 2048, 20)
    backend = Backend(cfg, pallas_form(interpret=st.dry_run))  # the xla backend, layers scanned, as the engine on GPU
    with st.row("random weights") as r:
        start = time.perf_counter()
        weights = backend.prepare(build_random_model(cfg, seed=0), max_len=max(ctx, prefill))
        jax.block_until_ready(weights)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(weights._replace(rope_table=None)))
        param_bytes = n_params * jnp.dtype(cfg.dtype).itemsize
        r.update(params=n_params, gib=param_bytes / GIB, init_s=time.perf_counter() - start)
        log(f"model: {n_params:,} parameters ({param_bytes / GIB:.1f} GiB {cfg.dtype}), init {r['init_s']:.1f} s")
    if not r["ok"]:
        return
    bs = 16
    blocks_per_seq = -(-ctx // bs)
    cache_dtype = jnp.dtype(cfg.dtype)
    cache = allocate_kv_cache(cfg, max(batches) * blocks_per_seq + 1 + -(-prefill // bs), bs, cache_dtype)
    kv_token_bytes = cfg.kv_bytes_per_token(cache_dtype.itemsize)
    copy_bw = st.state.get("copy_bw")
    holder = {"cache": cache}
    del cache

    def inputs(num_seqs, q_len, kv_len):
        tables = 1 + np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
        if q_len > 1:
            tables = 1 + np.arange(-(-kv_len // bs), dtype=np.int32)[None, :]
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
        ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, num_seqs * q_len), jnp.int32)
        return ids, jnp.asarray(positions), md, jnp.asarray(np.arange(1, num_seqs + 1) * q_len - 1, jnp.int32)

    log("| step | tokens | compile (s) | ms/step | tokens/s | dispatch (ms) | roofline ms | % of roofline |")
    log("|---|---|---|---|---|---|---|---|")
    shapes = [(f"decode x{b} @ {ctx}", b, 1, ctx) for b in batches] + [(f"prefill {prefill}", 1, prefill, prefill)]
    notes: list[str] = []  # what the dumped HLO shows, printed after the table
    for i, (name, num_seqs, q_len, kv_len) in enumerate(shapes):
        with st.row(name) as r:
            ids, pos, md, logits_idx = inputs(num_seqs, q_len, kv_len)
            start = time.perf_counter()
            compiled = forward_step.lower(backend, weights, holder["cache"], ids, pos, md, logits_idx).compile()
            r["compile_s"] = round(time.perf_counter() - start, 2)
            if i == 0 or q_len > 1:  # the optimised HLO of one decode and one prefill step
                path = os.path.join(st.check.out_dir, f"step_{name.split()[0]}_hlo.txt")
                text = compiled.as_text()
                with open(path, "w") as f:
                    f.write(text)
                r["hlo"] = path
                # the scanned layers read their weights in place: no layer-shaped buffer written outside a fusion
                copies = layer_weight_copies(text, layer_shapes_of(weights.layers))
                r.update(layer_weight_copies=copies.num_copies,
                         copied=sorted(f"{op} {shape}" for op, shape in copies.top_level),
                         sliced_in_fusions=sorted(f"{op} {shape}" for op, shape in copies.in_fusions))
                notes.append(f"{name}: layer-weight copies outside fusions {copies.num_copies} {r['copied']}; "
                             f"layer-weight-shaped values inside fusions {sum(copies.in_fusions.values())}")

            def run_step():
                # the backend is static: compiled in, not an argument of the compiled step
                logits, holder["cache"] = compiled(weights, holder["cache"], ids, pos, md, logits_idx)
                return logits

            jax.block_until_ready(run_step())
            start = time.perf_counter()  # dispatch: the call returns before the device is done
            out = run_step()
            r["dispatch_ms"] = (time.perf_counter() - start) * 1e3
            jax.block_until_ready(out)
            t = time_calls(run_step, calls=calls, warmup=1)
            tokens = num_seqs * q_len
            roof_s = (param_bytes + num_seqs * kv_len * kv_token_bytes) / copy_bw if copy_bw else float("nan")
            r.update(tokens=tokens, ms=t.median_ms, tok_s=tokens / t.median_s, roofline_ms=roof_s * 1e3,
                     pct_of_roofline=100 * roof_s / t.median_s)
            log(f"| {name} | {tokens} | {r['compile_s']} | {t.median_ms:.2f} | {tokens / t.median_s:,.0f} | "
                f"{r['dispatch_ms']:.2f} | {roof_s * 1e3:.2f} | {r['pct_of_roofline']:.0f}% |")
    for note in notes:
        log(note)
    holder.clear()
    gc.collect()
    projection_rows(st, cfg, weights.layers, copy_bw)


def projection_rows(st, cfg, layers, copy_bw) -> None:
    """The engine's fused projections (q/k/v one matmul, gate/up one) against the five separate ones
    they replace, over all layers (scanned, as the step runs them) with o_proj and down_proj, and no
    attention: each layer adds every output of q, k and v into its input, so none can be dropped and
    the two forms compute the same function. Device time per stack, against reading its weights once."""
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import time_in_loop

    num_q, num_kv = cfg.num_heads, cfg.num_kv_heads
    qkv = layers.qkv_proj[:, :, 0]  # [L, D, Hq + 2 Hkv, K] (one device group)
    gate_up = layers.gate_up_proj[:, :, 0]  # [L, D, 2, F]
    fused = (qkv, layers.o_proj, gate_up, layers.down_proj)
    separate = (qkv[:, :, :num_q], qkv[:, :, num_q:num_q + num_kv], qkv[:, :, num_q + num_kv:], layers.o_proj,
                gate_up[:, :, 0], gate_up[:, :, 1], layers.down_proj)
    separate = jax.block_until_ready(jax.tree.map(jnp.copy, separate))  # arrays of their own, as loaded unfused
    weight_bytes = sum(x.nbytes for x in fused)

    def attend_mlp(h, q, k, v, o, gate, up, down):
        # every q/k/v output feeds the next layer: k + v joins each query head of its group
        kv = jnp.repeat(k + v, num_q // num_kv, axis=1)
        h = h + jnp.einsum("thk,hkd->td", q + kv, o)
        return h + jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, down)

    def stack_fused(h, w):
        def layer(h, lw):
            wqkv, o, wgu, down = lw
            y = jnp.einsum("td,dnk->tnk", h, wqkv)
            gu = jnp.einsum("td,dcf->tcf", h, wgu)
            return attend_mlp(h, y[:, :num_q], y[:, num_q:num_q + num_kv], y[:, num_q + num_kv:], o,
                              gu[:, 0], gu[:, 1], down), None
        return jax.lax.scan(layer, h, w)[0]

    def stack_separate(h, w):
        def layer(h, lw):
            wq, wk, wv, o, wg, wu, down = lw
            proj = lambda p: jnp.einsum("td,dnk->tnk", h, p)  # noqa: E731
            return attend_mlp(h, proj(wq), proj(wk), proj(wv), o, h @ wg, h @ wu, down), None
        return jax.lax.scan(layer, h, w)[0]

    log("| projections (all layers, no attention) | tokens | separate ms | fused ms | separate / fused "
        "| fused % of weight-read roofline |")
    log("|---|---|---|---|---|---|")
    for tokens in ((4, 16) if st.dry_run else (32, 128, 2048)):
        with st.row(f"projections x{tokens}") as r:
            h = jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size), qkv.dtype) * 0.01
            iters, repeats = (2, 2) if st.dry_run else (10, 5)
            t_sep = time_in_loop(stack_separate, h, separate, iters=iters, repeats=repeats)
            t_fused = time_in_loop(stack_fused, h, fused, iters=iters, repeats=repeats)
            roof_s = weight_bytes / copy_bw if copy_bw else float("nan")
            r.update(tokens=tokens, separate_ms=t_sep.median_ms, fused_ms=t_fused.median_ms,
                     separate_over_fused=t_sep.median_s / t_fused.median_s,
                     pct_of_roofline=100 * roof_s / t_fused.median_s)
            log(f"| x{tokens} | {tokens} | {t_sep.median_ms:.2f} | {t_fused.median_ms:.2f} | "
                f"{r['separate_over_fused']:.2f}x | {r['pct_of_roofline']:.0f}% |")
    del separate
    gc.collect()


# engine ------------------------------------------------------------------------------------------
def engine(st) -> None:
    """The engine on 8B shapes with random weights: continuous (fcfs) vs request-level (static)
    batching on the same ShareGPT-like lengths, output tokens/s of each beside the ratio of decode
    slot-steps an ideal scheduler saves (what continuous batching can win at most)."""
    from jaxcb.benchmark import ideal_static_ratio, make_workload, run_offline, with_policy
    from jaxcb.config import compose_config
    from jaxcb.engine import LLM

    if st.dry_run:
        overrides = ["model=tiny", "model.dtype=float32", "model.backend=xla", "attention.impl=pallas",
                     "attention.interpret=true", "cache.dtype=float32", "cache.num_blocks=160",
                     "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=32", "engine.max_model_len=128",
                     "engine.token_buckets=[8,32]", "bench.num_requests=8", "bench.scale=0.1",
                     # The interpreter's compiles are most of a dry run: the step variants the workload
                     # takes (full serves any sampling), not every one.
                     "engine.sampling_variants=[greedy,full]", "engine.masked_sampling=false",
                     "engine.prompt_logprobs=false"]
    else:
        overrides = ["model=llama8b", "model.init=random", "cache.num_blocks=8200", "scheduler.max_num_seqs=64",
                     "scheduler.max_num_batched_tokens=512", "engine.max_model_len=2048",
                     "engine.token_buckets=[64,512]", "bench.num_requests=128", "bench.scale=1.0"]
    cache_dir = os.path.join(st.check.out_dir, "xla_cache")  # the second engine loads the first's compiles
    cfg = compose_config(overrides + ["bench.workload=lognormal", f"engine.compilation_cache_dir={cache_dir}"])
    results = {}
    items = None
    for policy in ("fcfs", "static"):
        with st.row(f"engine {policy}") as r:
            start = time.perf_counter()
            llm = LLM(with_policy(cfg, policy), progress=False)
            r["startup_s"] = round(time.perf_counter() - start, 1)
            if items is None:
                items = make_workload(cfg.bench, llm.engine.model_config.vocab_size, llm.engine.max_model_len)
                st.note("workload", dict(requests=len(items), prompt_tokens=sum(len(w.prompt_token_ids) for w in items),
                                         output_tokens=sum(w.output_len for w in items)))
            res = run_offline(llm, items, policy)
            results[policy] = res
            r.update(out_tok_s=res.output_tokens_per_s, seconds=res.seconds, steps=res.num_steps,
                     recompiles=res.num_recompiles)
            log(f"{policy}: start-up {r['startup_s']} s, {res.output_tokens_per_s:,.0f} output tok/s "
                f"({res.num_steps} steps, {res.seconds:.1f} s, {res.num_recompiles} recompiles)")
            del llm
            gc.collect()
    with st.row("continuous / static") as r:
        ratio = results["fcfs"].output_tokens_per_s / results["static"].output_tokens_per_s
        ideal = ideal_static_ratio(items, cfg.scheduler.max_num_seqs)
        r.update(ratio=ratio, ideal_step_ratio=ideal)
        log(f"continuous / static output tok/s: {ratio:.2f}x (ideal step ratio {ideal:.2f}x)")
