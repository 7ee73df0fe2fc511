"""Every kernel variant compiles to sm_90a machine code within the H200's registers and shared memory.

The Triton IR that jax lowers (tests/test_cuda_lowering.py) goes through the `triton`
package's compiler to PTX and through `ptxas -v` (jaxcb/kernels/triton_calls.py): no spills,
at most 255 registers a thread, at most 227 KiB of shared memory a block. Skipped where the
`triton` package is not installed (it comes with the test extra's torch on Linux x86-64),
except where JAXCB_REQUIRE_TRITON=1: CI sets it, so there the test cannot pass as skipped.

The table in docs/gpu.md comes from this test:

    JAXCB_TRITON_REPORT=triton.md .venv/bin/python -m pytest tests/test_triton_resources.py
"""

import os

import pytest

from cuda_variants import KERNEL_VARIANTS
from jaxcb.kernels.triton_calls import MAX_REGISTERS, MAX_SHARED_BYTES, lower_for_gpu, ptxas_resources, triton_calls

if os.environ.get("JAXCB_REQUIRE_TRITON") != "1":
    pytest.importorskip("triton")


def resources_of(variant):
    [call] = triton_calls(lower_for_gpu(variant.kernel(), *variant.args(64, 16, 16)))
    return ptxas_resources(call, arch=90)


def test_every_kernel_variant_fits_the_h200_without_spills(tmp_path):
    lines = [
        "| variant | dtype | head dim | block | group | block_m x kv_tile | warps | stages | registers | spills "
        "(store/load B) | shared KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    problems = []
    toolchain = ""
    for v in KERNEL_VARIANTS:
        r = resources_of(v)
        toolchain = r.toolchain
        block_m = max(v.block_m, v.group)
        lines.append(
            f"| {v.name} | {v.dtype} | {v.head_dim} | {v.block_size} | {v.group} | {block_m} x {v.kv_tile} | "
            f"{v.num_warps} | {v.num_stages} | {r.registers} | {r.spill_store_bytes}/{r.spill_load_bytes} | "
            f"{r.shared_bytes / 1024:.0f} |"
        )
        if r.spill_store_bytes or r.spill_load_bytes:
            problems.append(f"{v.name}: spills {r.spill_store_bytes}/{r.spill_load_bytes} bytes")
        if not 0 < r.registers <= MAX_REGISTERS:
            problems.append(f"{v.name}: {r.registers} registers")
        if r.shared_bytes > MAX_SHARED_BYTES:
            problems.append(f"{v.name}: {r.shared_bytes} bytes of shared memory")
    report = "\n".join(lines + ["", f"Compiled for sm_90a by {toolchain}."]) + "\n"
    out = os.environ.get("JAXCB_TRITON_REPORT") or str(tmp_path / "triton.md")
    with open(out, "w") as f:
        f.write(report)
    print(report)
    assert not problems, "\n".join(problems) + "\n" + report
