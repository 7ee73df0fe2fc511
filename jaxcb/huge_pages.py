"""The prepared weights on 2 MiB pages, on a CPU host (`engine.huge_pages`).

A decode step on CPU streams every weight once, and at a few dozen rows the packed matmul is
bound by how fast one core pulls a weight strip in. On 4 KiB pages each strip crosses a page
every 64 lines: a TLB miss, and the hardware prefetcher, which never crosses a page, starts
over. On 2 MiB pages small's chain of packed matmuls ran 1.03-1.12x faster at 1-64 tokens
(`benchmarks/bench_kernels.py --kernels huge-pages`; docs/perf-notes.md).

XLA allocates the buffers, so they cannot be asked for on huge pages; Linux 6.1+ can move pages
already in use onto them: madvise(MADV_COLLAPSE), synchronous, and whatever the transparent
huge page setting says (short of `never`). Each 2 MiB region that lies within the weights (a
buffer, or buffers side by side) is collapsed on its own: a region that fails (an older kernel, no
free huge page) stays as it was. A weight's head and tail outside whole regions stay on 4 KiB
pages. Nothing changes from the caller's view: the arrays keep their addresses and contents.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import sys
import time
from typing import Callable, Iterable, Optional

import jax

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1


@dataclasses.dataclass(frozen=True)
class HugePageResult:
    """What `collapse_onto_huge_pages` did: regions of 2 MiB that hold weights, how many are now
    on a huge page, the weights' bytes, and why the first region that failed did (None: none did)."""

    regions: int
    collapsed: int
    weight_bytes: int
    failure: Optional[str] = None


def buffer_ranges(arrays: Iterable[jax.Array]) -> list[tuple[int, int]]:
    """(address, bytes) of each host buffer behind the arrays: every addressable shard's."""
    ranges = []
    for a in arrays:
        for shard in a.addressable_shards:
            if shard.data.nbytes:
                ranges.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return ranges


def huge_page_regions(ranges: Iterable[tuple[int, int]], gap: int = 4096) -> list[int]:
    """The start of each 2 MiB-aligned region that lies within the ranges, ascending: ranges less
    than `gap` bytes apart (an allocator's headers and padding between buffers) count as one.
    Regions the weights share with other memory are left alone: nothing else moves, and a region
    reaching past a mapping's end could not move anyway."""
    merged: list[list[int]] = []
    for address, size in sorted(ranges):
        if merged and address <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], address + size)
        else:
            merged.append([address, address + size])
    starts = []
    for begin, end in merged:
        first, last = -(-begin // HUGE_PAGE), end // HUGE_PAGE  # whole regions only
        starts.extend(range(first * HUGE_PAGE, last * HUGE_PAGE, HUGE_PAGE))
    return starts


def _libc_madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int

    def call(address: int, size: int, advice: int) -> int:
        return 0 if madvise(address, size, advice) == 0 else ctypes.get_errno()

    return call


def collapse_regions(regions: list[int], madvise: Optional[Callable[[int, int, int], int]] = None,
                     seconds: float = float("inf"), clock: Callable[[], float] = time.perf_counter
                     ) -> tuple[int, Optional[str], int]:
    """madvise(MADV_COLLAPSE) on each region in turn until `seconds` have passed: (how many
    succeeded, the first failure's errno name, how many were tried)."""
    madvise = madvise or _libc_madvise()
    collapsed, failure, tried = 0, None, 0
    deadline = clock() + seconds
    for start in regions:
        if clock() >= deadline:
            break
        tried += 1
        code = madvise(start, HUGE_PAGE, MADV_COLLAPSE)
        if code == 0:
            collapsed += 1
        elif failure is None:
            failure = f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"
    return collapsed, failure, tried


def collapse_onto_huge_pages(arrays: Iterable[jax.Array], setting: str,
                             madvise: Optional[Callable[[int, int, int], int]] = None, seconds: float = float("inf"),
                             clock: Callable[[], float] = time.perf_counter) -> Optional[HugePageResult]:
    """Moves the arrays' host buffers onto 2 MiB pages where `setting` (engine.huge_pages) is auto
    and this is Linux on a CPU device, for at most `seconds` (engine.huge_pages_seconds: a region
    took from 0.05 to 20 ms on one VM, by the state of the host's memory); None where it does not
    try. Logs one line either way it tries."""
    if setting == "off" or not sys.platform.startswith("linux"):
        return None
    arrays = [a for a in arrays if isinstance(a, jax.Array) and all(d.platform == "cpu" for d in a.devices())]
    ranges = buffer_ranges(arrays)
    if not ranges:
        return None
    regions = huge_page_regions(ranges)
    start = clock()  # synchronous: on a host short of free huge pages it compacts memory first
    collapsed, failure, tried = collapse_regions(regions, madvise, seconds, clock)
    budget, seconds = seconds, clock() - start
    result = HugePageResult(len(regions), collapsed, sum(size for _, size in ranges), failure)
    mib = result.weight_bytes / 2**20
    if not regions:
        log.info("weights: %.1f MiB, in no whole 2 MiB region: left on 4 KiB pages", mib)
    elif tried < len(regions):
        log.info("weights: %.0f MiB, %d of %d 2 MiB regions on huge pages in %.2f s: engine.huge_pages_seconds=%g "
                 "ran out, the other %d stay on 4 KiB pages%s", mib, collapsed, len(regions), seconds, budget,
                 len(regions) - tried, f" (a failure: {failure})" if failure else "")
    elif collapsed == len(regions):
        log.info("weights: %.0f MiB on 2 MiB pages (%d regions in %.2f s; engine.huge_pages=auto)", mib, collapsed,
                 seconds)
    elif collapsed:
        log.info("weights: %.0f MiB, %d of %d 2 MiB regions on huge pages in %.2f s (the others: %s; "
                 "engine.huge_pages=auto)", mib, collapsed, len(regions), seconds, failure)
    else:
        log.info("weights: %.0f MiB stay on 4 KiB pages: madvise(MADV_COLLAPSE) failed with %s (it needs Linux 6.1+ "
                 "and transparent huge pages not 'never'; engine.huge_pages=off skips the attempt)", mib, failure)
    return result
