"""Lower for an NVIDIA GPU without one, and read what the Pallas Triton kernels were lowered to.

On jax >= 0.11 the Pallas Triton backend asks the device for its compute capability while
lowering; with no GPU present, it reads it from an abstract device of an abstract mesh
(`jax.sharding.AbstractDevice`). `gpu_mesh()` builds that mesh (of any size, so a
tensor-parallel step lowers against it too), and `triton_calls()` finds each Triton custom
call in the lowered module with the launch parameters XLA will use: the grid, warps and
stages, and the kernel's Triton IR.

`ptxas_resources()` compiles that IR to PTX for sm_90a with the `triton` package (when it is
installed and can read this jax's IR) and runs `ptxas -v` on it: registers, spills and shared
memory per kernel. That is open-source Triton's pipeline, not XLA's own (which compiles the
same IR at run time on the GPU), so its figures are an estimate; scripts/gpu_check.py reads
the real ones from XLA's PTX on the device.

Used by tests/test_cuda_lowering.py, tests/test_triton_resources.py and scripts/gpu_check.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, Callable

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
H200 = "NVIDIA H200"
H200_NUM_SMS = 132
# sm_90's limits: 255 registers a thread, 227 KiB of shared memory a block.
MAX_REGISTERS = 255
MAX_SHARED_BYTES = 227 * 1024


def gpu_mesh(
    num_devices: int = 1, axis_name: str = "tp", device_kind: str = H200, num_sms: int = H200_NUM_SMS
) -> AbstractMesh:
    """An abstract mesh of `num_devices` NVIDIA GPUs of `device_kind`: lowering needs no real one."""
    device = AbstractDevice(device_kind=device_kind, num_cores=num_sms, platform="cuda")
    # Auto axes: the engine's shardings are hints for XLA's partitioner, not sharding in types.
    return AbstractMesh((num_devices,), (axis_name,), axis_types=(AxisType.Auto,), abstract_device=device)


def lower_for_gpu(fn: Callable, *args: Any, mesh: AbstractMesh | None = None) -> jax.stages.Lowered:
    """`jax.jit(fn)` lowered for CUDA at the shapes of `args` (ShapeDtypeStructs), on `mesh`.

    At jax's default matmul precision, as the engine runs, whatever the caller's setting (the
    test suite's "highest" turns a float32 dot into several and changes the kernel).
    """
    mesh = mesh or gpu_mesh()
    with jax.sharding.use_abstract_mesh(mesh), jax.default_matmul_precision("default"):
        traced = fn.trace(*args) if hasattr(fn, "trace") else jax.jit(fn).trace(*args)
        return traced.lower(lowering_platforms=("cuda",))


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Pallas Triton kernel launch as XLA will run it."""

    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    operand_types: tuple[str, ...]  # MLIR tensor types of the operands, e.g. "tensor<4x1040x128xbf16>"
    ir: bytes  # the kernel's Triton IR as MLIR bytecode

    def ir_text(self) -> str:
        """The Triton IR as text (the `tt` dialect)."""
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as tt_dialect

        ctx = ir.Context()
        tt_dialect.register_dialect(ctx)
        with ctx:
            return str(ir.Module.parse(self.ir))


def triton_calls(lowered: jax.stages.Lowered) -> list[TritonCall]:
    """Every Triton custom call in the lowered module, in program order."""
    from jax._src.lib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    calls: list[TritonCall] = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_CALL_TARGET:
            cfg = ir.DictAttr(op.attributes["mhlo.backend_config"])
            value = lambda key: ir.IntegerAttr(cfg[key]).value  # noqa: E731
            calls.append(TritonCall(
                name=ir.StringAttr(cfg["name"]).value,
                grid=(value("grid_x"), value("grid_y"), value("grid_z")),
                num_warps=value("num_warps"),
                num_stages=value("num_stages"),
                operand_types=tuple(str(operand.type) for operand in op.operands),
                ir=ir.StringAttr(cfg["ir"]).value_bytes,
            ))
        return ir.WalkResult.ADVANCE

    with module.context:
        module.operation.walk(visit)
    return calls


@dataclasses.dataclass(frozen=True)
class PtxasResources:
    """What `ptxas -v` reports for one kernel, plus Triton's dynamic shared memory."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int  # Triton's dynamic shared memory (ptxas sees none of it) + any static
    toolchain: str  # which Triton and ptxas produced the figures


class TritonUnavailable(RuntimeError):
    """The `triton` package (or its ptxas) is not installed here, or cannot read this jax's IR."""


def parse_ptxas_verbose(text: str) -> dict[str, int]:
    """Registers, spills, stack and static shared memory from `ptxas -v` output."""
    def grab(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return dict(
        registers=grab(r"Used (\d+) registers"),
        stack_bytes=grab(r"(\d+) bytes stack frame"),
        spill_store_bytes=grab(r"(\d+) bytes spill stores"),
        spill_load_bytes=grab(r"(\d+) bytes spill loads"),
        static_shared_bytes=grab(r"(\d+) bytes smem"),
    )


def find_ptxas() -> str | None:
    """The CUDA toolkit's ptxas: on PATH, under $CUDA_HOME, /usr/local/cuda, or beside nvcc."""
    candidates = [shutil.which("ptxas")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "ptxas"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "ptxas"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def parse_ptxas_functions(text: str) -> dict[str, dict[str, int]]:
    """`ptxas -v` output of a PTX file with several entry functions, by function name."""
    out = {}
    for chunk in re.split(r"(?=ptxas info\s*: Compiling entry function)", text):
        m = re.search(r"Compiling entry function '([^']+)'", chunk)
        if m:
            out[m.group(1)] = parse_ptxas_verbose(chunk)
    return out


def ptxas_resources(call: TritonCall, arch: int = 90) -> PtxasResources:
    """Compile the call's Triton IR to PTX for sm_{arch}a with the `triton` package, then `ptxas -v`."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as e:
        raise TritonUnavailable(f"the triton package is not installed ({e})") from None
    try:  # the signature differs between Triton releases
        ptxas = get_ptxas(arch).path
    except TypeError:
        ptxas = get_ptxas().path
    if not (ptxas and os.path.exists(ptxas)):
        ptxas = shutil.which("ptxas")
    if not ptxas:
        raise TritonUnavailable("no ptxas: neither triton's own nor one on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        ttir = os.path.join(tmp, f"{call.name}.ttir")
        with open(ttir, "w") as f:
            f.write(call.ir_text())
        try:
            # Only the stages up to PTX: ptxas runs below, verbose, with the same binary.
            kernel = triton.compile(
                ttir, target=GPUTarget("cuda", arch, 32),
                options=dict(num_warps=call.num_warps, num_stages=call.num_stages),
            )
        except Exception as e:  # the package's Triton may not read this jax's dialect
            raise TritonUnavailable(f"triton {triton.__version__} could not compile the kernel: {e}") from e
        ptx = os.path.join(tmp, f"{call.name}.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch}a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True, check=True,
        )
        version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    report = parse_ptxas_verbose(out.stdout + out.stderr)
    release = re.search(r"release ([\d.]+)", version)
    return PtxasResources(
        registers=report["registers"],
        spill_store_bytes=report["spill_store_bytes"],
        spill_load_bytes=report["spill_load_bytes"],
        stack_bytes=report["stack_bytes"],
        shared_bytes=int(kernel.metadata.shared) + report["static_shared_bytes"],
        toolchain=f"triton {triton.__version__}, ptxas {release.group(1) if release else '?'}",
    )
