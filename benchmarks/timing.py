"""Timing jitted work on a device, for benchmarks and the GPU check (never for assertions in tests).

`time_in_loop` measures device time per call: the function runs `iters` times back to back
inside one jitted `fori_loop`, each iteration fed by the previous one's output so that XLA
can neither hoist nor drop it, and the wall time of the whole loop (after
`block_until_ready`) is divided by `iters`. Host dispatch costs one launch per loop, not
per call. `time_calls` measures what a caller sees: wall time per dispatched call.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    num_samples: int

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3


def _summarise(samples: list[float]) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


def time_in_loop(
    fn: Callable[..., jax.Array],
    x: jax.Array,  # the argument that carries the dependency; fn(x, *rest) must have x's shape
    *rest,
    iters: int = 20,
    repeats: int = 5,
) -> Timing:
    """Device time of one `fn(x, *rest)`, the median over `repeats` loops of `iters` calls."""

    @jax.jit
    def loop(x, *rest):
        def body(_, x):
            y = fn(x, *rest)
            # A tiny feedback term keeps every iteration live and ordered.
            return x + (y * 1e-6).astype(x.dtype)

        return jax.lax.fori_loop(0, iters, body, x)

    jax.block_until_ready(loop(x, *rest))  # compile and warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(loop(x, *rest))
        samples.append((time.perf_counter() - start) / iters)
    return _summarise(samples)


def time_calls(fn: Callable, *args, calls: int = 20, warmup: int = 2) -> Timing:
    """Wall time per call of an already-jitted `fn`, each waited for (dispatch included)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return _summarise(samples)


def copy_bandwidth(num_bytes: int, *, iters: int = 20, repeats: int = 5) -> tuple[float, Timing]:
    """Achievable memory bandwidth (bytes/s) of an elementwise read+write pass over `num_bytes`
    of random floats (constant data could be compressed or short-cut on some devices)."""
    x = jax.random.uniform(jax.random.key(0), (num_bytes // 4,), jnp.float32)
    timing = time_in_loop(lambda v: v * 0.999 + 0.001, x, iters=iters, repeats=repeats)
    return 2 * x.nbytes / timing.median_s, timing
