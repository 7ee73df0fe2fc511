import gc
import os
import sys

# Tests run on the CPU, in float32 matmul precision, whatever machine they are on.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # One OpenMP thread for transformers' reference runs (torch reads this when imported): beside another
    # worker's XLA threads, torch's spinning ones ran SmolLM2's greedy reference 4x slower (53 s against 13).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite compiles thousands of small step executables, and LLVM's optimisation of XLA:CPU's generated
# code was about a fifth of its CPU time while buying nothing at these shapes (the matmuls are library
# calls and the C++ kernels are built apart). The semantics are the same (fast-math stays off);
# scripts and benchmarks outside the tests compile as a user's run does. Subprocesses inherit it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def no_persistent_compilation_cache():
    """No test process reads JAX's persistent compilation cache. Deserializing a cached XLA:CPU
    executable, in a process that has built and dropped many engines, crashed test workers with
    SIGSEGV in libgcc's unwinder (jax/_src/compilation_cache.py, get_executable_and_time), three
    times in four full runs; a server, which keeps its engine, does not drop executables so."""
    import jaxcb.engine

    saved = jaxcb.engine.enable_compilation_cache
    jaxcb.engine.enable_compilation_cache = lambda directory: directory or ""
    yield
    jaxcb.engine.enable_compilation_cache = saved


# The files with the longest tests, in the order they run first. Under pytest-xdist the tests
# handed out last decide when the run ends: a 70-second test drawn in the last minute leaves the
# other worker idle. Sent first, they run while both workers still have short tests behind them.
LONGEST_FIRST = ("test_gpu_check.py", "test_tensor_parallel.py", "test_smollm2.py", "test_lora_smollm2.py",
                 "test_draft_speculation.py", "test_gguf.py", "test_ray_jobs.py", "test_prefix_routing_ray.py")


def pytest_configure(config):
    """Under pytest-xdist the controller builds the C++ kernels before it starts the workers: each
    worker would otherwise build them itself on a fresh machine (both at once, the same library)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    from jaxcb.kernels import cpu as cpu_kernels

    try:
        cpu_kernels.build_library()
    except cpu_kernels.CpuKernelUnavailable:
        pass  # the tests that need the kernels say why


def pytest_sessionstart(session):
    """JAXCB_FAULT_LOG=DIR: each test process writes the Python stacks of all its threads to
    DIR/<worker>-<pid>.log on a fatal signal. Under pytest-xdist a crashed worker's own stderr is
    lost ("node down: Not properly terminated"); this keeps where it died."""
    directory = os.environ.get("JAXCB_FAULT_LOG")
    if directory:
        import faulthandler

        os.makedirs(directory, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        session.config._jaxcb_fault_log = open(os.path.join(directory, f"{worker}-{os.getpid()}.log"), "w")
        faulthandler.enable(file=session.config._jaxcb_fault_log, all_threads=True)


def memory_maps() -> tuple[int, int]:
    """(this process's memory maps, the kernel's limit on them); (0, 0) where /proc does not say."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


def pytest_runtest_teardown(item, nextitem):
    """At the end of a test file, a worker past half the kernel's limit on memory maps drops JAX's
    caches and the shared engines (tests/engine_factory.py): every compiled executable holds a few
    maps of JIT code, and a worker that kept thousands reached the limit (65,530 by default), where
    XLA:CPU's JIT fails to allocate ("LLVM compilation error: Cannot allocate memory") and throwing
    that error crashed the worker in libgcc's unwinder (docs/architecture.md)."""
    if nextitem is not None and nextitem.path == item.path:
        return
    maps, limit = memory_maps()
    if limit and maps > limit // 2:
        from engine_factory import shared_engine

        shared_engine.cache_clear()
        jax.clear_caches()
        gc.collect()


def pytest_runtest_setup(item):
    """Re-installed before every test, in case a library imported since installed a handler of its
    own. (A crash inside native code, like the memory-map one `pytest_runtest_teardown` prevents,
    can still leave an empty log; `dmesg` names the faulting library and offset, and with core dumps
    on, `py-spy dump --core CORE` shows the Python stack.)"""
    log = getattr(item.config, "_jaxcb_fault_log", None)
    if log is not None:
        import faulthandler

        faulthandler.enable(file=log, all_threads=True)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: every other order kept
