"""What start-up took: each phase's seconds, and one line of where the device's memory went."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Iterable, Iterator, Optional

import jax

from jaxcb.config import ConfigError
from jaxcb.kv_cache import DeviceMemory, KVCachePlan, format_bytes


class StartupLog:
    """The phases start-up ran, in order, with their seconds (`Engine.startup`)."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases.append((name, time.perf_counter() - t0))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.phases)

    def describe(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.phases) + (
            f"; {time.perf_counter() - self._start:.1f} s in all")


def bytes_per_device(tree) -> int:
    """Bytes the arrays of `tree` take on one device (a sharded array counts its shard)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if isinstance(a, jax.Array) else a.shape
        total += int(a.dtype.itemsize) * math.prod(shape)
    return total


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Where one device's memory went at the end of start-up."""

    weights_bytes: int  # the prepared weights
    cache_bytes: int  # the KV cache, on this device
    workspace_reserved_bytes: int  # what the cache plan left for the largest step
    workspace_compiled_bytes: Optional[int]  # the largest compiled step's scratch (None: nothing compiled yet)
    memory: Optional[DeviceMemory]  # the device's statistics now (None: it reports none)

    @property
    def headroom_bytes(self) -> Optional[int]:
        """What is left in XLA's pool once the largest step runs; None where the device reports no memory."""
        if self.memory is None:
            return None
        workspace = self.workspace_compiled_bytes
        return self.memory.free_bytes - (workspace if workspace is not None else self.workspace_reserved_bytes)

    def __str__(self) -> str:
        compiled = ("" if self.workspace_compiled_bytes is None
                    else f"{format_bytes(self.workspace_compiled_bytes)} for the largest compiled step, ")
        text = (f"memory per device: weights {format_bytes(self.weights_bytes)}, KV cache "
                f"{format_bytes(self.cache_bytes)}, step workspace {compiled}"
                f"{format_bytes(self.workspace_reserved_bytes)} reserved")
        if self.memory is None:
            return text + "; headroom: the device reports no memory statistics (host memory)"
        return text + (f", headroom {format_bytes(self.headroom_bytes)} of XLA's "
                       f"{format_bytes(self.memory.pool_bytes)} pool")


def report_memory(weights, plan: KVCachePlan, workspace_reserved: int, executables: Iterable,
                  memory: Optional[DeviceMemory]) -> MemoryReport:
    """The start-up memory line; refuses (ConfigError) a start-up whose largest step would not fit in
    what the weights and the cache leave of the device."""
    temps = [exe.memory_analysis().temp_size_in_bytes for exe in executables]
    report = MemoryReport(bytes_per_device(weights), plan.bytes_per_device, workspace_reserved,
                          max(temps) if temps else None, memory)
    if report.headroom_bytes is not None and report.headroom_bytes < 0:
        raise ConfigError(
            f"the largest compiled step needs {format_bytes(report.workspace_compiled_bytes or 0)} of workspace and "
            f"{format_bytes(report.memory.free_bytes)} are free after the weights and the KV cache ({report}); lower "
            f"cache.memory_fraction or scheduler.max_num_batched_tokens, or set cache.num_blocks"
        )
    return report
