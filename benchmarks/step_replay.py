"""Record the engine's compiled steps with their inputs, and replay them alone: the engine's host
overhead (`bench.task=overhead`) and the kernel A/B of `benchmarks/bench_kernels.py --steps`.

The runner knows nothing of this: `record_steps` wraps one runner's `build_inputs` for the
length of a `with` block.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import jax
import numpy as np


@contextlib.contextmanager
def record_steps(runner) -> Iterator[list]:
    """Within the block, every step's (bucket, packed inputs, slot writes) is appended to the list it yields."""
    recorded: list = []
    build = runner.build_inputs

    def recording(out):
        key, args, writes = build(out)
        recorded.append((key, args, writes))
        return key, args, writes

    runner.build_inputs = recording
    try:
        yield recorded
    finally:
        del runner.build_inputs  # back to the class's method


def replay(runner, recorded: list, executables: Optional[dict] = None,
           on_step: Optional[Callable[[tuple, float], None]] = None, wait_each: bool = False) -> float:
    """Run the recorded steps again on the runner's cache and slot state (donated and carried), with
    the slot writes the engine made before them; seconds it took. `executables`: bucket -> the step's
    compiled (model, sampler) (default: the runner's own); `wait_each`: time each step on its own,
    reporting it to `on_step(bucket, seconds)`."""
    start = time.perf_counter()
    ids = None
    for key, args, writes in recorded:
        t0 = time.perf_counter()
        if writes is not None:
            runner.write_slots(writes)
        ids = runner.run(key, args, (executables or {}).get(key))[0]
        if wait_each:
            jax.block_until_ready(ids)
            if on_step is not None:
                on_step(key, time.perf_counter() - t0)
    if ids is not None:
        jax.block_until_ready(ids)
    return time.perf_counter() - start


def host_overhead(llm, items) -> dict:
    """Engine wall time against a loop that replays the same compiled steps on pre-built inputs."""
    from jaxcb.benchmark import run_offline

    runner = llm.engine.runner
    with record_steps(runner) as recorded:
        result = run_offline(llm, items, llm.engine.cfg.scheduler.policy)
    per_bucket: dict[tuple, list[float]] = {}
    replayed = replay(runner, recorded, wait_each=True,  # each step waited for, so that it can be timed on its own
                      on_step=lambda key, took: per_bucket.setdefault(key, []).append(took))
    replayed = sum(sum(t) for t in per_bucket.values()) or replayed
    host_s = result.seconds - replayed  # scheduling, input building, detokenizing: what the steps alone do not take
    return dict(
        engine_s=result.seconds,
        step_replay_s=replayed,
        num_steps=len(recorded),
        num_output_tokens=result.output_tokens,
        host_overhead_fraction=host_s / result.seconds,
        engine_over_replay=result.seconds / replayed,
        host_us_per_step=1e6 * host_s / len(recorded),
        host_us_per_output_token=1e6 * host_s / result.output_tokens,
        # "tokens x seqs x width" -> where the replayed time went, bucket by bucket
        per_bucket={
            "x".join(map(str, key)): dict(steps=len(t), median_ms=1e3 * float(np.median(t)), total_s=sum(t))
            for key, t in sorted(per_bucket.items())
        },
    )
