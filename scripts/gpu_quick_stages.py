"""The stages of the quick GPU check (scripts/gpu_quick.py), one function each, in the order they run.

One engine serves the last three: `startup` builds it at the GPU defaults (no scheduler limit,
bucket or cache size given: they come from the device, as a user's engine gets them), `decode`
times its compiled step on decode batches made here, `serve` runs a workload through it. Only
what the workload never uses is left out: the random, masked and prompt-logprobs step variants.
Each function takes a `Stage` (scripts/gpu_check.py); rows print as Markdown table lines.
"""

from __future__ import annotations

import os
import statistics
import time

import gpu_stages
from gpu_stages import GIB, log

STAGES = ("preflight", "bandwidth", "kernel", "startup", "decode", "serve")
VARIANTS = ("greedy", "full")  # the step variants compiled: greedy serves the workload, full must be there
DECODE_STEPS, DECODE_REPEATS = 10, 3  # a decode batch's steps dispatched back to back, and how many times
bandwidth = gpu_stages.bandwidth


def decode_rows(dry_run: bool) -> list[tuple[int, int]]:
    """(decoding sequences, tokens of context each) of the decode stage."""
    return [(b, ctx) for ctx in ((16, 48) if dry_run else (1024, 4096)) for b in ((2, 4) if dry_run else (32, 128))]


def engine_overrides(st) -> list[str]:
    """The engine of `startup`: llama8b, random weights, at the defaults but for the variants; a tiny
    model in a dry run, with limits that keep the CPU's interpreter to four compiles."""
    common = [f"engine.sampling_variants=[{','.join(VARIANTS)}]", "engine.masked_sampling=false",
              "engine.prompt_logprobs=false", "bench.workload=lognormal", "bench.seed=0",
              f"engine.compilation_cache_dir={os.path.join(st.check.out_dir, 'xla_cache')}"]  # cold: a new folder
    if st.dry_run:
        return common + ["model=tiny", "model.dtype=float32", "model.backend=xla", "attention.impl=pallas",
                         "attention.interpret=true", "cache.dtype=float32", "scheduler.max_num_seqs=4",
                         "scheduler.max_num_batched_tokens=32", "engine.max_model_len=128",
                         "engine.token_buckets=[8,32]", "bench.num_requests=8", "bench.scale=0.1"]
    return common + ["model=llama8b", "model.init=random", "bench.num_requests=256", "bench.scale=1.0"]


def needs(st, key: str):
    if key not in st.state:
        raise RuntimeError(f"no {key}: an earlier stage (preflight for the config, startup for the engine) failed")
    return st.state[key]


# preflight ---------------------------------------------------------------------------------------
def preflight(st) -> None:
    """The engine's XLA memory pool (cache.memory_fraction), set before anything starts JAX's GPU
    client, so that the engine plans its cache as it would alone; then the full check's preflight."""
    with st.row("config and XLA's memory pool") as r:
        from jaxcb.config import compose_config
        from jaxcb.kv_cache import configure_device_memory

        st.state["cfg"] = cfg = compose_config(engine_overrides(st))
        r["pool_fraction"] = configure_device_memory(cfg.cache.memory_fraction)
        log(f"XLA's pool: {r['pool_fraction']:g} of the device (cache.memory_fraction={cfg.cache.memory_fraction:g})")
    gpu_stages.preflight(st)


# kernel ------------------------------------------------------------------------------------------
def kernel(st) -> None:
    """The kernel against the reference at one batch, and registers and spills of XLA's PTX for it."""
    dump = os.path.join(st.check.out_dir, "kernel_xla_dump")
    fn, args = gpu_stages.kernel_vs_reference(st, dump)
    gpu_stages.xla_ptx_registers(st, dump)
    if not st.dry_run:  # the triton package's compile of the same kernel: shared memory, and a second reading
        gpu_stages.triton_estimate(st, fn, args)


# startup -----------------------------------------------------------------------------------------
def startup(st) -> None:
    """The engine as a user starts it: weights, limits and cache sized from the device, every bucket compiled."""
    import jax

    from jaxcb.engine import LLM

    with st.row("engine start-up") as r:
        start = time.perf_counter()
        st.state["llm"] = llm = LLM(needs(st, "cfg"), progress=False)
        r["startup_s"] = round(time.perf_counter() - start, 1)
        engine, runner = llm.engine, llm.engine.runner
        buckets = runner.buckets
        r.update(max_num_seqs=buckets.max_num_seqs, max_num_batched_tokens=max(buckets.tokens),
                 token_buckets=list(buckets.tokens), table_widths=list(buckets.widths),
                 step_compiles=len(runner.compiled), attention=runner.backend.attention.name,
                 num_blocks=engine.cache_plan.num_blocks, cache=engine.cache_plan.describe())
        stats = jax.local_devices()[0].memory_stats() or {}
        r.update({f"{k}_gib": round(stats[k] / GIB, 2) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit",
                                                                  "largest_free_block_bytes") if k in stats})
        log(f"start-up {r['startup_s']} s: {r['step_compiles']} step compiles ({len(buckets.all())} buckets x "
            f"{len(VARIANTS)} variants), limits {r['max_num_seqs']} seqs / {r['max_num_batched_tokens']} tokens, "
            f"table width {r['table_widths']} blocks, {r['attention']}")
        log(f"{r['cache']}; device memory in use {r.get('bytes_in_use_gib', '-')} GiB of a "
            f"{r.get('bytes_limit_gib', '-')} GiB pool, largest free block "
            f"{r.get('largest_free_block_bytes_gib', '-')} GiB")


# decode ------------------------------------------------------------------------------------------
def decode(st) -> None:
    """The engine's compiled step on decode batches made here (each sequence on blocks of its own), so
    that the bucket, table width and split-KV are the engine's own: ms/step, steps dispatched back to
    back as async scheduling runs them, against reading the weights and every context's K/V once."""
    import numpy as np

    engine = needs(st, "llm").engine
    runner, plan, model = engine.runner, engine.cache_plan, engine.model_config
    copy_bw = st.state.get("copy_bw")
    weight_bytes = weight_read_bytes(runner.weights)
    kv_token_bytes = model.kv_bytes_per_token(np.dtype(plan.dtype).itemsize)
    recompiles = runner.num_recompiles
    log("| seqs | context | bucket T x R x W | decode launch KV splits | ms/step | tok/s | roofline ms | % of roofline |")
    log("|---|---|---|---|---|---|---|---|")
    for num_seqs, context in decode_rows(st.dry_run):
        with st.row(f"decode x{num_seqs} @ {context}", seqs=num_seqs, context=context) as r:
            blocks_per_seq = -(-context // plan.block_size)
            skip = (f"the engine's max_num_seqs={runner.buckets.max_num_seqs} < {num_seqs}"
                    if num_seqs > runner.buckets.max_num_seqs else
                    f"the cache's {plan.num_blocks - 1} blocks < {num_seqs * blocks_per_seq}"
                    if num_seqs * blocks_per_seq > plan.num_blocks - 1 else None)
            if skip:
                r["skipped"] = skip
                log(f"| {num_seqs} | {context} | skipped: {skip} |")
                continue
            bucket = runner.buckets.pick(num_seqs, num_seqs, blocks_per_seq)
            step_s = time_steps(runner, decode_batch(num_seqs, context, plan.block_size, model.vocab_size))
            roof_s = (weight_bytes + num_seqs * context * kv_token_bytes) / copy_bw if copy_bw else float("nan")
            r.update(bucket="x".join(map(str, bucket)), num_splits=kv_splits(engine, bucket), ms=step_s * 1e3,
                     tok_s=num_seqs / step_s, roofline_ms=roof_s * 1e3, pct_of_roofline=100 * roof_s / step_s)
            log(f"| {num_seqs} | {context} | {r['bucket']} | {r['num_splits']} | {r['ms']:.2f} | {r['tok_s']:,.0f} | "
                f"{r['roofline_ms']:.2f} | {r['pct_of_roofline']:.0f}% |")
    with st.row("no recompiles") as r:
        r["num_recompiles"] = runner.num_recompiles - recompiles
        assert r["num_recompiles"] == 0, f"{r['num_recompiles']} decode steps ran a bucket start-up did not compile"


def decode_batch(num_seqs: int, context: int, block_size: int, vocab_size: int):
    """A SchedulerOutput of `num_seqs` greedy sequences each computing its token at position context - 1,
    on blocks of its own (1.. in order: block 0 is the null block)."""
    from jaxcb.core.sequence import SequenceId
    from jaxcb.core.step import ScheduledSequence, SchedulerOutput
    from jaxcb.sampling_params import SamplingParams

    per_seq, params = -(-context // block_size), SamplingParams(temperature=0.0)
    return SchedulerOutput([
        ScheduledSequence(
            seq_id=SequenceId(f"quick-decode-{num_seqs}x{context}", i), start_position=context - 1,
            token_ids=[(7919 * i + 1) % vocab_size], block_ids=list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
            block_epoch=0, samples=True, num_prompt_tokens=context - 1, num_output_tokens=1, sampling_params=params,
            seed=i,
        )
        for i in range(num_seqs)
    ])


def time_steps(runner, out) -> float:
    """Seconds a step: DECODE_STEPS dispatched back to back (the next built while one runs), waited for
    at the end; the median of DECODE_REPEATS. The first step, which writes the block tables, is not timed."""
    import jax

    jax.block_until_ready(runner.dispatch(out).token_ids)
    samples = []
    for _ in range(DECODE_REPEATS):
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            handle = runner.dispatch(out)
        jax.block_until_ready(handle.token_ids)
        samples.append((time.perf_counter() - start) / DECODE_STEPS)
    return statistics.median(samples)


def weight_read_bytes(weights) -> int:
    """Bytes of weights a step reads: every layer's, the final norm and the LM head (of the embedding
    table only the step's rows, left out)."""
    import jax

    return sum(x.nbytes for x in jax.tree.leaves((weights.layers, weights.final_norm, weights.head)))


def kv_splits(engine, bucket):
    """The split-KV of the kernel's decode launch for the bucket's shapes (`kernel_launches`); None off the kernel."""
    from jaxcb.kernels.attention.pallas import kernel_launches

    if not engine.runner.backend.attention.name.startswith("pallas"):
        return None
    m, plan = engine.model_config, engine.cache_plan
    decode = kernel_launches(bucket.num_tokens, bucket.num_seqs, bucket.table_width,
                             group=m.num_heads // m.num_kv_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                             block_size=plan.block_size, dtype=plan.dtype)[0]
    return decode.num_splits


# serve -------------------------------------------------------------------------------------------
def serve(st) -> None:
    """The engine on bench.num_requests lognormal requests, all at once: output tokens/s."""
    from jaxcb.benchmark import make_workload, run_offline

    llm, cfg = needs(st, "llm"), needs(st, "cfg")
    engine = llm.engine
    with st.row(f"serve {cfg.bench.num_requests} lognormal requests") as r:
        items = make_workload(cfg.bench, engine.model_config.vocab_size, engine.max_model_len)
        recompiles = engine.runner.num_recompiles
        res = run_offline(llm, items, cfg.scheduler.policy)
        r.update(requests=len(items), prompt_tokens=res.prompt_tokens, output_tokens=res.output_tokens,
                 longest_output=max(w.output_len for w in items), seconds=res.seconds,
                 out_tok_s=res.output_tokens_per_s, steps=res.num_steps, preemptions=res.num_preemptions,
                 recompiles=engine.runner.num_recompiles - recompiles)
        log(f"{len(items)} requests ({res.prompt_tokens:,} prompt, {res.output_tokens:,} output tokens, the longest "
            f"{r['longest_output']:,}): {res.output_tokens_per_s:,.0f} output tok/s, {res.seconds:.1f} s, "
            f"{res.num_steps:,} steps, {res.num_preemptions} preemptions, {r['recompiles']} recompiles")
        assert r["recompiles"] == 0, f"{r['recompiles']} steps ran a bucket start-up did not compile"
