"""Keep what a benchmark's jitted calls free in this process, so that no call pays for first touches.

A chain of matmuls at 2,048 tokens frees outputs of 33-262 MB every call. glibc hands blocks that
large back to the kernel (mmap'd blocks, the arenas of XLA's pool threads trimmed), and the next call
faults them in again, page by page: a third of the chain's time at 256 and 2,048 rows went to the
kernel's page-fault path (`perf record`), for jaxcb's matmul and XLA's dot alike. The engine's step
buffers stay under glibc's mmap threshold and are reused from step to step, so a kernel table that
includes those faults measures the allocator, not the kernels.

Call `keep_freed_memory()` before jax starts its threads (before `import jax` in a script): later
threads then share the main arena, which neither unmaps nor trims.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # mallopt(3) parameters


def keep_freed_memory() -> bool:
    """True where glibc took all three settings (elsewhere, e.g. musl, nothing changes)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_ARENA_MAX, 1)))
