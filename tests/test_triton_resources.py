"""Every kernel variant compiles to sm_90a machine code within the H200's registers and shared memory.

The Triton IR that jax lowers (tests/test_cuda_lowering.py) goes through the `triton`
package's compiler to PTX and through `ptxas -v` (jaxcb/kernels/triton_calls.py): no spills,
at most 255 registers a thread, at most 227 KiB of shared memory a block. Skipped where the
`triton` package is not installed (it comes with the test extra's torch on Linux x86-64),
except where JAXCB_REQUIRE_TRITON=1: CI sets it, so there the test cannot pass as skipped.

The table in docs/gpu.md comes from this test:

    JAXCB_TRITON_REPORT=triton.md .venv/bin/python -m pytest tests/test_triton_resources.py
"""

import dataclasses
import os
import re
import tempfile

import pytest

from cuda_variants import ENGINE_LLAMA8B, GEMMA2_9B, KERNEL_VARIANTS, PREFILL_TILE_VARIANTS
from jaxcb.kernels.triton_calls import MAX_REGISTERS, MAX_SHARED_BYTES, lower_for_gpu, ptxas_resources, triton_calls
from pallas_kernels.query_tiles import MEASURED_RESOURCES, ProgramResources

if os.environ.get("JAXCB_REQUIRE_TRITON") != "1":
    pytest.importorskip("triton")

# (variant, bucket of T tokens and R sequences): a bucket of 64 tokens and 16 sequences compiles both
# tile classes; one of 4 tokens cannot hold a prefill and compiles the decode tiles alone.
BUCKET = (64, 16)
DECODE_ONLY_BUCKET = (4, 4)
VARIANTS = [(v, BUCKET) for v in KERNEL_VARIANTS + PREFILL_TILE_VARIANTS] + [
    (ENGINE_LLAMA8B, DECODE_ONLY_BUCKET),
    (GEMMA2_9B, DECODE_ONLY_BUCKET),
]


def launches(variant, bucket):
    """The kernel's launches for a bucket: the decode tiles', then (if it can hold a prefill) the prefill tiles'."""
    return triton_calls(lower_for_gpu(variant.kernel(), *variant.args(*bucket, 16)))


def test_every_kernel_variant_fits_the_h200_without_spills(tmp_path):
    lines = [
        "| variant | dtype | head dim | block | group | launch: rows x kv_tile | bucket T/R | warps | stages "
        "| registers | spills (store/load B) | shared KiB | programs / SM |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    problems = []
    toolchain = ""
    for v, bucket in VARIANTS:
        plan = v.tile_plan(*bucket)
        for call, rows in zip(launches(v, bucket), plan.classes):
            r = ptxas_resources(call)
            toolchain = r.toolchain
            per_sm = ProgramResources(r.registers, r.shared_bytes, call.num_warps).programs_per_sm
            kind = "decode" if rows == plan.block_m else "prefill"
            lines.append(
                f"| {v.name} | {v.dtype} | {v.head_dim} | {v.block_size} | {v.group} | "
                f"{kind}: {rows} x {plan.pages_per_tile * v.block_size} | {bucket[0]}/{bucket[1]} | {call.num_warps} | "
                f"{v.num_stages} | {r.registers} | {r.spill_store_bytes}/{r.spill_load_bytes} | "
                f"{r.shared_bytes / 1024:.0f} | {per_sm} |"
            )
            name = f"{v.name} ({kind})"
            if r.spill_store_bytes or r.spill_load_bytes:
                problems.append(f"{name}: spills {r.spill_store_bytes}/{r.spill_load_bytes} bytes")
            if not 0 < r.registers <= MAX_REGISTERS:
                problems.append(f"{name}: {r.registers} registers")
            if r.shared_bytes > MAX_SHARED_BYTES:
                problems.append(f"{name}: {r.shared_bytes} bytes of shared memory")
    report = "\n".join(lines + ["", f"Compiled for sm_90a by {toolchain}."]) + "\n"
    out = os.environ.get("JAXCB_TRITON_REPORT") or str(tmp_path / "triton.md")
    with open(out, "w") as f:
        f.write(report)
    print(report)
    assert not problems, "\n".join(problems) + "\n" + report


def kv_loops(call) -> list[str]:
    """The K/V loops of the kernel after Triton's software pipeliner: the TTGIR of each scf.for body."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(call.ir_text())
        kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=call.num_warps, num_stages=call.num_stages))
    ttgir = kernel.asm["ttgir"]
    return [body.split("scf.yield")[0] for body in ttgir.split("scf.for ")[1:]]


@pytest.mark.parametrize("variant", [ENGINE_LLAMA8B, dataclasses.replace(ENGINE_LLAMA8B, window=True), GEMMA2_9B],
                         ids=["no window", "window", "gemma2_9b"])
@pytest.mark.parametrize("bucket", [BUCKET, DECODE_ONLY_BUCKET], ids=["both classes", "decode only"])
def test_each_kv_loop_loads_the_next_tile_while_it_computes_this_one(bucket, variant):
    """The engine's kernel, pipelined by Triton at num_stages=3: in every tile class's loop the K and V
    copies are asynchronous, and the wait at the top of an iteration leaves the 2 newest copy groups (the
    next tile's K and V) in flight while this tile's dots run; with a sliding window too (its loop starts
    at the window's first tile), and at Gemma 2's head dim 256 with its soft-cap."""
    calls = launches(variant, bucket)
    assert len(calls) == (2 if bucket == BUCKET else 1)
    for body in (loop for call in calls for loop in kv_loops(call)):
        assert body.count("ttg.async_copy_global_to_local") == 2  # the next tile's K and V
        assert re.search(r"ttg\.async_wait .*\{num = 2 : i32\}", body), "the next tile's copies must stay in flight"
        assert "dot" in body.split("async_copy_global_to_local")[0]  # this tile's dots before the next copies


@pytest.mark.parametrize("v", [ENGINE_LLAMA8B, GEMMA2_9B], ids=lambda v: v.name)
def test_the_split_choice_reads_the_occupancy_ptxas_reports_for_each_engine_launch(v):
    """MEASURED_RESOURCES, which choose_num_splits reads, holds what ptxas reports for the engine's decode
    and prefill launches (llama8b, and Gemma 2 at head dim 256; bf16), to the programs an SM runs."""
    plan = v.tile_plan(*BUCKET)
    for call, rows in zip(launches(v, BUCKET), plan.classes):
        r = ptxas_resources(call)
        key = (rows, v.head_dim, 2, plan.pages_per_tile * v.block_size, call.num_warps, v.num_stages)
        table = MEASURED_RESOURCES[key]
        measured = ProgramResources(r.registers, r.shared_bytes, call.num_warps)
        assert (table.programs_per_sm, abs(table.registers - r.registers) <= 8) == (measured.programs_per_sm, True), (
            key, r.registers, r.shared_bytes)
