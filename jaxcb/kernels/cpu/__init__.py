"""The C++ kernels for CPU: sources here, compiled on first use and registered with the XLA FFI.

The sources (`*.cc`, `*.h`) are compiled into one library with the system C++ compiler for
this machine's CPU (`-march=native`) and cached, keyed by the sources, the flags, the
compiler, the CPU and jaxlib, so a changed kernel or a different machine rebuilds.
`load_cpu_kernels()` raises `CpuKernelUnavailable` with the compiler's message when there
is no compiler or the build fails; the backends then fall back to XLA.

The jax-facing wrappers live by concept: `jaxcb.kernels.attention.cpu` (attention and the
K/V write), `jaxcb.kernels.packed_matmul` (the linear layers and the LM head), `jaxcb.kernels.batched_lora`
(multi-LoRA's updates) and `jaxcb.kernels.row_argmax`. Only those modules and `jaxcb.backends.cpu` import this package.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = (
    HERE / "ragged_paged_attention.cc", HERE / "packed_matmul.cc", HERE / "row_argmax.cc", HERE / "kv_cache_write.cc",
    HERE / "batched_lora.cc",
)
HEADERS = (HERE / "amx.h", HERE / "bf16.h", HERE / "parallel_for.h", HERE / "vector_exp.h", HERE / "vector_tanh.h",
           HERE / "vec16.h")
ATTENTION_TARGET = "jaxcb_ragged_paged_attention"
MATMUL_TARGET = "jaxcb_packed_matmul"
MATMUL_ARGMAX_TARGET = "jaxcb_packed_matmul_argmax"
MLP_TARGET = "jaxcb_packed_mlp"
QKV_TARGET = "jaxcb_packed_qkv"
ARGMAX_TARGET = "jaxcb_row_argmax"
KV_WRITE_TARGET = "jaxcb_kv_cache_write"
LAZY_ZEROS_TARGET = "jaxcb_lazy_zeros"
BATCHED_LORA_TARGET = "jaxcb_batched_lora"
PANEL = 16  # columns per packed panel (packed_matmul.cc)
ATTENTION_DTYPES = ("float32", "bfloat16")  # of q and of an unquantized cache, each (ragged_paged_attention.cc)
CACHE_DTYPES = (*ATTENTION_DTYPES, "int8")  # the caches the attention kernel reads (int8: scaled outside it)
CXX_FLAGS = (
    "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=fast",
    # Lets GCC vectorise the dot-product reductions; no -ffinite-math-only (masks rely on it not).
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
)


class CpuKernelUnavailable(RuntimeError):
    """The C++ kernel could not be built or loaded here (no compiler, or the build failed)."""


def cache_dir() -> Path:
    root = os.environ.get("JAXCB_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxcb", "cpu_kernels"
    )
    return Path(root)


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise CpuKernelUnavailable("no C++ compiler found (install g++ or set CXX); attention.impl=xla needs none")
    return cxx


def build_library(source_dir: Path = HERE) -> Path:
    """Path of the compiled library, building it if these sources/flags/CPU have not been built yet.
    `source_dir` holds this package's file names, or some of them (another revision's, for an A/B)."""
    sources, headers = SOURCES, HEADERS
    if source_dir != HERE:  # an older revision may lack a kernel added since: build what it has
        sources, headers = (tuple(source_dir / f.name for f in files if (source_dir / f.name).exists())
                            for files in (SOURCES, HEADERS))
    cxx = _compiler()
    include = jax.ffi.include_dir()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuKernelUnavailable(f"C++ compiler {cxx} does not run: {e}") from e
    # The headers' folder is not part of the key, jax's version is: every environment with this jax (another
    # venv, the GPU check's) shares one build.
    key = hashlib.sha256(
        "\0".join([*(f.read_text() for f in (*sources, *headers)), " ".join(CXX_FLAGS), version, _cpu_signature(),
                   jax.__version__]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / f"jaxcb_cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built in a private folder, then renamed: concurrent builders never see a half-written library.
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as tmp:
        # One compiler a source, side by side, the longest sources first: a first start-up waited 26 s
        # for them one after another on a 2-core Xeon, 17 s side by side.
        ordered = sorted(sources, key=lambda f: -f.stat().st_size)
        objects = [os.path.join(tmp, f"{i}-{source.stem}.o") for i, source in enumerate(ordered)]
        compile_flags = [f for f in CXX_FLAGS if f != "-shared"]
        commands = [[cxx, *compile_flags, "-I", str(source_dir), "-isystem", include, "-c", str(source), "-o", obj]
                    for source, obj in zip(ordered, objects)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            failed = [(cmd, done) for cmd, done in zip(commands, pool.map(_run_compiler, commands))
                      if done.returncode != 0]
        library = os.path.join(tmp, out.name)
        link = [cxx, *CXX_FLAGS, *objects, "-o", library]
        if not failed:
            done = _run_compiler(link)
            if done.returncode != 0:
                failed = [(link, done)]
        if failed:
            cmd, done = failed[0]
            raise CpuKernelUnavailable(f"building the CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        os.replace(library, out)
    return out


def _run_compiler(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        return subprocess.CompletedProcess(cmd, 1, "", str(e))


@functools.cache
def load_cpu_kernels() -> ctypes.CDLL:
    """Builds (once per machine) and registers the kernels with XLA; raises CpuKernelUnavailable."""
    path = build_library()
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        raise CpuKernelUnavailable(f"cannot load {path}: {e}") from e
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.JaxcbRaggedPagedAttention), platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxcbPackedMatmul), platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_ARGMAX_TARGET, jax.ffi.pycapsule(lib.JaxcbPackedMatmulArgmax), platform="cpu")
    jax.ffi.register_ffi_target(MLP_TARGET, jax.ffi.pycapsule(lib.JaxcbPackedMlp), platform="cpu")
    jax.ffi.register_ffi_target(QKV_TARGET, jax.ffi.pycapsule(lib.JaxcbPackedQkv), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(lib.JaxcbRowArgmax), platform="cpu")
    jax.ffi.register_ffi_target(KV_WRITE_TARGET, jax.ffi.pycapsule(lib.JaxcbKvCacheWrite), platform="cpu")
    jax.ffi.register_ffi_target(LAZY_ZEROS_TARGET, jax.ffi.pycapsule(lib.JaxcbLazyZeros), platform="cpu")
    jax.ffi.register_ffi_target(BATCHED_LORA_TARGET, jax.ffi.pycapsule(lib.JaxcbBatchedLora), platform="cpu")
    return lib


# The bf16 matmul's paths (packed_matmul.cc's Bf16Matmul), best last.
BF16_MATMUL_PATHS = {1: "widen", 2: "avx512-bf16", 3: "amx"}
BF16_MATMUL_DESCRIPTIONS = {
    "widen": "bf16 weights widened to float32 for float FMAs",
    "avx512-bf16": "AVX512-BF16 dot products (vdpbf16ps), accumulating in float32",
    "amx": "AMX tiles (tdpbf16ps), accumulating in float32",
}
_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.JaxcbTimeBf16Matmul.restype = ctypes.c_double
path = int(sys.argv[2])
if path and lib.JaxcbProbeBf16Matmul(path) != 1:
    sys.exit(3)
print(lib.JaxcbTimeBf16Matmul(path))
"""


def _time_path(library: str, path: int) -> float | None:
    """Nanoseconds per decode-sized tile of `path`, or None when it does not run and compute
    right here. Tried in a child process: a CPU whose flags list an instruction it cannot run
    (some VMs) kills the child, not the engine."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, library, str(path)], capture_output=True, text=True,
                              timeout=120)
        return float(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


@functools.cache
def bf16_matmul_path() -> str:
    """The bf16 matmul path the kernels take on this machine (a name of BF16_MATMUL_PATHS): of the
    paths built for this CPU, the fastest that runs and computes right, timed once per process
    (by what runs, not by /proc/cpuinfo alone), and logged once."""
    lib = load_cpu_kernels()
    built = lib.JaxcbBf16MatmulPaths()
    library = str(build_library())
    times = {}
    for code, name in BF16_MATMUL_PATHS.items():
        if built & (1 << code):
            times[code] = _time_path(library, code)
            if times[code] is None:
                log.warning("the %s bf16 matmul is built for this CPU but does not run right here; falling back", name)
    ran = {code: t for code, t in times.items() if t is not None}
    chosen = min(ran, key=ran.get) if ran else 1
    name = BF16_MATMUL_PATHS[lib.JaxcbSelectBf16Matmul(chosen)]
    timings = ", ".join(f"{BF16_MATMUL_PATHS[c]} {t / 1000:.2f} us" for c, t in ran.items())
    log.info("CPU bf16 matmul: %s (a decode tile: %s)", BF16_MATMUL_DESCRIPTIONS[name], timings or "not timed")
    _BF16_TILE_NS[name] = ran.get(chosen)
    return name


_BF16_TILE_NS: dict[str, float | None] = {}


@functools.cache
def bf16_speedup() -> float | None:
    """How many times faster this CPU multiplies bf16 weights than float32 ones, on the path it
    takes (a decode tile, compute-bound: the bytes saved come on top); None when not measured."""
    name = bf16_matmul_path()
    f32 = _time_path(str(build_library()), 0)
    bf16 = _BF16_TILE_NS.get(name)
    return None if not f32 or not bf16 else f32 / bf16


def select_bf16_matmul(name: str) -> str:
    """Makes every later bf16 kernel call take path `name` (tests and benchmarks compare paths);
    returns the path in use, the current one when this build lacks `name`."""
    code = {v: k for k, v in BF16_MATMUL_PATHS.items()}[name]
    return BF16_MATMUL_PATHS[load_cpu_kernels().JaxcbSelectBf16Matmul(code)]


def bf16_matmul_paths_built() -> list[str]:
    """The bf16 paths this machine's build of the kernels has (what runs is another matter)."""
    built = load_cpu_kernels().JaxcbBf16MatmulPaths()
    return [name for code, name in BF16_MATMUL_PATHS.items() if built & (1 << code)]


# The attention kernel's paths for a bf16 cache (ragged_paged_attention.cc's JaxcbSelectAttention).
ATTENTION_PATHS = {0: "rows", 1: "amx"}
ATTENTION_DESCRIPTIONS = {
    "rows": "every tile row by row in float32",
    "amx": "tiles of 8 or more query rows (prefill) on AMX tiles (tdpbf16ps, float32 sums and softmax), "
           "and decoding sequences' shared leading blocks for all of them at once (cascade items); "
           "other tiles of fewer rows (decode) row by row in float32",
}
_ATTENTION_PROBE = """
import ctypes, sys
sys.exit(0 if ctypes.CDLL(sys.argv[1]).JaxcbProbeAttentionAmx() == 1 else 3)
"""


@functools.cache
def attention_path() -> str:
    """The path the attention kernel takes for a bf16 cache here (a name of ATTENTION_PATHS): AMX
    where this build has it and a prefill tile on it runs and matches the rows path in a child
    process (a CPU whose flags list an instruction it cannot run kills the child, not the
    engine); else rows. Chosen once per process, and logged."""
    lib = load_cpu_kernels()
    chosen = 0
    if lib.JaxcbAttentionPaths() & (1 << 1):
        try:
            done = subprocess.run([sys.executable, "-c", _ATTENTION_PROBE, str(build_library())], capture_output=True,
                                  timeout=120)
            ok = done.returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            chosen = 1
        else:
            log.warning("the AMX attention is built for this CPU but does not run right here; falling back")
    name = ATTENTION_PATHS[lib.JaxcbSelectAttention(chosen)]
    log.info("CPU attention on a bf16 cache: %s", ATTENTION_DESCRIPTIONS[name])
    return name


def select_attention_path(name: str) -> str:
    """Makes every later attention call on a bf16 cache take path `name` (tests and benchmarks
    compare paths); returns the path in use, the current one when this build lacks `name`."""
    attention_path()  # probed first: the first call of the kernel must not undo this choice
    code = {v: k for k, v in ATTENTION_PATHS.items()}[name]
    return ATTENTION_PATHS[load_cpu_kernels().JaxcbSelectAttention(code)]
