"""Backends: the layer operations the model calls, chosen once at start-up.

    xla   XLA's dot everywhere (`base.Backend`): any platform, any dtype, any mesh
    cpu   the packed C++ matmul (`cpu.CpuBackend`): CPU, float32 or bfloat16 weights, one device
    auto  cpu where it applies and its C++ kernels build; xla elsewhere

Only this package and `jaxcb.kernels` know which backend runs or import the C++ kernels;
the model calls the layer operations a backend provides (`jaxcb.model.llama.LayerOps`), and the
runner hands the backend to the step.
"""

from __future__ import annotations

import logging
from typing import Optional

import jax

from jaxcb.backends.base import Argmax, Backend, xla_argmax
from jaxcb.config import AttentionConfig, ConfigError, ModelConfig
from jaxcb.kernels.attention import select_attention
from jaxcb.model.config import LlamaConfig

log = logging.getLogger(__name__)
BACKENDS = ("auto", "cpu", "xla")
LAYER_LOOPS = ("auto", "scan", "unrolled")

__all__ = ["Backend", "BACKENDS", "bf16_matmul_speedup", "resolve_layer_loop", "select_backend"]


def resolve_layer_loop(layer_loop: str, platform: str | None = None) -> str:
    """`scan` or `unrolled`: `auto` unrolls on CPU (XLA:CPU copies every layer's slice of a stacked
    weight before each use) and scans elsewhere, where tracing one layer keeps compile time low."""
    if layer_loop == "auto":
        return "unrolled" if (platform or jax.default_backend()) == "cpu" else "scan"
    return layer_loop


def _cpu_kernels_error() -> Optional[str]:
    """None when the C++ kernels build and load here; else why not."""
    from jaxcb.kernels.cpu import CpuKernelUnavailable, load_cpu_kernels

    try:
        load_cpu_kernels()
    except CpuKernelUnavailable as e:
        return str(e)
    return None


def bf16_matmul_speedup() -> Optional[float]:
    """How many times float32's speed the `cpu` backend multiplies bf16 weights at on this CPU
    (`jaxcb.kernels.cpu.bf16_speedup`); None where its C++ kernels do not build."""
    from jaxcb.kernels.cpu import CpuKernelUnavailable, bf16_speedup

    try:
        return bf16_speedup()
    except CpuKernelUnavailable:
        return None


def _cpu_row_argmax(platform: str, one_device: bool, kernels_error: Optional[str] = None) -> Argmax:
    """XLA:CPU's argmax runs one element at a time (~1.2 ms over 64 rows of a 32k vocab): on one CPU
    device sampling takes the C++ row argmax, which gives the same indices."""
    if platform != "cpu" or not one_device or kernels_error is not None:
        return xla_argmax
    from jaxcb.kernels.row_argmax import row_argmax

    return row_argmax


def select_backend(
    model: ModelConfig,
    arch: LlamaConfig,
    attention: AttentionConfig,
    *,
    mesh: Optional[jax.sharding.Mesh] = None,
    platform: str | None = None,
) -> Backend:
    """The backend `model.backend` names, with its attention form and layer loop, for `platform`.

    `cpu` where it cannot run is a ConfigError that says why and what to change; `auto` then
    takes `xla`, and says so in one log line when the reason is that the C++ kernels do not build."""
    platform = platform or jax.default_backend()
    if model.backend not in BACKENDS:
        raise ConfigError(f"model.backend={model.backend!r} must be one of {', '.join(BACKENDS)}")
    layer_loop = resolve_layer_loop(model.layer_loop, platform)
    kernels_error = _cpu_kernels_error() if platform == "cpu" else None
    if kernels_error is not None and "auto" in (model.backend, attention.impl):
        log.warning("the C++ CPU kernels are unavailable, so XLA computes what they would (slower): %s", kernels_error)
    form = select_attention(attention, mesh, platform)
    why_not = []
    if model.backend != "xla":
        if platform != "cpu":
            why_not.append(f"it runs on CPU only (this is {platform})")
        if arch.dtype not in ("float32", "bfloat16"):
            why_not.append(f"it takes float32 or bfloat16 weights (model.dtype={arch.dtype})")
        if layer_loop != "unrolled":
            why_not.append("it needs model.layer_loop=unrolled")
        if mesh is not None:
            why_not.append(f"it runs on one device (engine.tensor_parallel_size={mesh.size})")
        if not arch.llama_layers:
            why_not.append(f"its fused norms, SwiGLU MLP and LM head are Llama's, not {arch.architecture}'s")
        if not why_not and kernels_error is not None:
            why_not.append(kernels_error)
    if model.backend == "cpu" and why_not:
        raise ConfigError(f"model.backend=cpu: {'; '.join(why_not)}. Use model.backend=auto or xla")
    argmax = _cpu_row_argmax(platform, mesh is None, kernels_error)
    if model.backend != "xla" and not why_not:
        from jaxcb.backends.cpu import CpuBackend

        return CpuBackend(arch, form, unroll_layers=True, argmax=argmax)
    return Backend(arch, form, unroll_layers=layer_loop == "unrolled", argmax=argmax)
