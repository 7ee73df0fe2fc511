import os
import sys

# Tests run on the CPU, in float32 matmul precision, whatever machine they are on.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
