"""Compiling the step buckets: in parallel at start-up, the rarely used variants later.

A step (`BucketKey`) runs several executables, its parts (`BucketKey.parts`: the model's and
the sampler's), and steps share parts: every token bucket's steps of one sequence bucket and
variant run the same sampler. Each part compiles once, whichever step first needs it.

What start-up compiles before serving (`compile_startup`): the parts of every bucket's greedy
and full variants, traced and lowered one after another on the calling thread and compiled on
`workers` threads at once (XLA's compile releases the GIL). The other variants a config asks
for (random, masked, prompt-logprobs) are deferred unless `when` is `startup`:

    background  compiled after start-up, one bucket at a time, on one thread of their own
    first_use   compiled, on that thread, when a step first needs the variant

`inline` (XLA:CPU): no compile ever runs beside other work. A variant a step needs is compiled on
the engine's own thread when its next step begins (`compile_wanted`), so the whole engine waits
for it. XLA:CPU's JIT does not survive a compile on one thread while another walks its stack (a
C++ exception, a backtrace): the process dies with SIGSEGV in the unwinder, seen in the test
suite when a variant compiled in the background while steps ran.

Until a variant is ready, `serving` says which variant serves a step that needs it: full serves
random rows (slower sampling, nobody waits); a masked or prompt-logprobs row has nothing to
stand in for it, so the engine holds such requests back (`Engine`) and the other rows run. A
variant is ready when every part of every bucket of it is compiled. A part compiled a second
time, or one that no planned step runs, is a recompile (`num_recompiles`); a deferred part's
first compile is not.

Nothing here knows what a step computes: `lower(part)` traces and lowers one executable, and a
part's `label` names its kind in the log.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import queue
import threading
import time
import weakref
from collections import Counter
from typing import Callable, Hashable, Iterable, Optional

from tqdm import tqdm

from jaxcb.runner.buckets import BucketKey
from jaxcb.sampling import StepVariant

log = logging.getLogger(__name__)

EAGER_VARIANTS = frozenset({StepVariant.GREEDY, StepVariant.FULL})
WHEN = ("startup", "background", "first_use")
MAX_AUTO_WORKERS = 8
# Below this, one compile thread: an XLA:CPU compile already keeps ~1.6 of 2 cores busy, and a second
# thread gained 1.09x there (docs/benchmarks.md, start-up's compile phase), within the noise.
MIN_CORES_FOR_PARALLEL = 4
MIN_CORES_FOR_BACKGROUND = 8  # below this, a background compile would take the cores a running step needs

_LIVE: "weakref.WeakSet[StepCompiler]" = weakref.WeakSet()


@atexit.register
def _stop_background_compiles() -> None:
    """At interpreter exit, let each background compile finish its current bucket and stop. A daemon
    thread still inside XLA's compiler while the process tears down its C++ state crashes the process
    (a job that wrote all its output then exits with SIGSEGV)."""
    for compiler in list(_LIVE):
        compiler.stop()


def compile_plan(engine_cfg, num_cores: Optional[int] = None, platform: Optional[str] = None) -> tuple[int, str]:
    """(threads compiling at start-up, when the rare variants compile) from engine.compile_workers and
    engine.compile_rare_variants, `auto` resolved from the host's cores; on the CPU platform the rare
    variants compile on first use, inline (module docstring)."""
    if platform == "cpu" and engine_cfg.compile_rare_variants == "background":
        from jaxcb.config import ConfigError

        raise ConfigError("engine.compile_rare_variants=background compiles beside running steps, which XLA:CPU does "
                          "not survive; on CPU use first_use (what auto picks) or startup")
    if platform == "cpu" and engine_cfg.compile_workers != "auto" and int(engine_cfg.compile_workers) > 1:
        log.info("engine.compile_workers=%s: 1 used: on CPU the steps compile one at a time, on the engine's thread "
                 "(XLA:CPU does not survive a compile beside other work)", engine_cfg.compile_workers)
    if platform == "cpu" and engine_cfg.compile_rare_variants == "auto":
        return compile_plan(engine_cfg, num_cores)[0], "first_use"
    cores = num_cores or os.cpu_count() or 1
    workers = engine_cfg.compile_workers
    if workers == "auto":
        workers = min(MAX_AUTO_WORKERS, cores) if cores >= MIN_CORES_FOR_PARALLEL else 1
    workers = int(workers)
    when = engine_cfg.compile_rare_variants
    if when == "auto":
        when = "background" if cores >= MIN_CORES_FOR_BACKGROUND else "first_use"
    return workers, when


class StepCompiler:
    def __init__(self, lower: Callable[[Hashable], object], keys: Iterable[BucketKey], *, workers: int = 1,
                 when: str = "startup", inline: bool = False):
        """`lower(part)`: one of a step's executables, lowered; `keys`: every bucket and variant the
        engine may run; `workers`: threads compiling at start-up;
        `when`: when the deferred variants compile; `inline`: on the engine's thread, never beside a
        step, and start-up's compiles one at a time (module docstring)."""
        if inline and when == "background":
            raise ValueError("a background compile runs beside the steps, which inline compiles never do")
        if when not in WHEN:
            raise ValueError(f"when={when!r} must be one of {', '.join(WHEN)}")
        self.lower = lower
        self.keys = list(keys)
        self._planned = frozenset(part for key in self.keys for part in key.parts)
        self.variants: tuple[StepVariant, ...] = tuple(sorted({key.variant for key in self.keys}))
        self.workers = 1 if inline else max(1, workers)
        self.inline = inline
        self._wanted: set[StepVariant] = set()  # inline: variants to compile when the next step begins
        self.when = when
        deferred = set(self.variants) - (EAGER_VARIANTS if when != "startup" else set(self.variants))
        self.deferred: tuple[StepVariant, ...] = tuple(sorted(deferred))
        self.compiled: dict[Hashable, object] = {}  # by part
        self.num_compiles: Counter[Hashable] = Counter()
        self.num_recompiles = 0
        self._ready: tuple[StepVariant, ...] = ()
        self._started = False  # compile_startup ran
        self._lock = threading.Lock()
        self._queue: "queue.Queue[Optional[tuple[StepVariant, concurrent.futures.Future]]]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._pending: dict[StepVariant, concurrent.futures.Future] = {}
        self.seconds: Counter[str] = Counter()  # compile seconds per kind of part (its label), for the log
        self._stopping = threading.Event()
        _LIVE.add(self)

    # --- what is ready ------------------------------------------------------------------------

    @property
    def ready(self) -> tuple[StepVariant, ...]:
        """The variants every bucket of which is compiled, ascending."""
        return self._ready

    def serving(self, needed: StepVariant) -> Optional[StepVariant]:
        """The least ready variant at or above `needed` (each serves the ones below it), or None. Before
        `compile_startup` (an engine built without compiling) every variant counts: each bucket then
        compiles when a step first runs it."""
        return next((v for v in (self._ready if self._started else self.variants) if v >= needed), None)

    def serve(self, needed: StepVariant) -> Optional[StepVariant]:
        """`serving(needed)`, and the compile of `needed` started (once) when it is deferred and not ready:
        the first step that needs the random level runs full and sets random compiling."""
        variant = self.serving(needed)
        if variant != needed and needed in self.deferred and self._started:
            self.request(needed)
        return variant

    def _mark_ready(self, variant: StepVariant) -> None:
        with self._lock:
            self._ready = tuple(sorted(set(self._ready) | {variant}))

    # --- compiling ----------------------------------------------------------------------------

    def _compile_one(self, part: Hashable) -> object:
        t0 = time.perf_counter()
        exe = self.lower(part).compile()
        self._record(part, exe, time.perf_counter() - t0)
        return exe

    def _record(self, part: Hashable, exe: object, seconds: float) -> None:
        with self._lock:
            self.num_compiles[part] += 1
            if self.num_compiles[part] > 1:
                self.num_recompiles += 1
            self.compiled[part] = exe
            self.seconds[part.label] += seconds

    def parts_of(self, variants: Iterable[StepVariant]) -> list[Hashable]:
        """The parts the steps of these variants run, each once, in the order of the keys."""
        variants = set(variants)
        return list(dict.fromkeys(part for key in self.keys if key.variant in variants for part in key.parts))

    def compile_startup(self, progress: bool = True) -> float:
        """Compile every part of the variants not deferred, `workers` at a time; then start the
        background compiles (when="background"). Returns the seconds it took."""
        start = time.perf_counter()
        self._started = True
        parts = self.parts_of(v for v in self.variants if v not in self.deferred)
        bar = tqdm(total=len(parts), desc="compiling step executables", disable=not progress, unit="executable")
        if self.workers == 1:
            for part in parts:
                self._compile_one(part)
                bar.update(1)
        else:
            with concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="jaxcb-compile") as pool:
                futures = []
                for part in parts:  # tracing and lowering hold the GIL: one at a time, here
                    t0 = time.perf_counter()
                    lowered = self.lower(part)
                    lower_s = time.perf_counter() - t0
                    futures.append(pool.submit(self._compile_lowered, part, lowered, lower_s))
                for future in concurrent.futures.as_completed(futures):
                    future.result()
                    bar.update(1)
        bar.close()
        for variant in self.variants:
            if variant not in self.deferred:
                self._mark_ready(variant)
        if self.when == "background":
            for variant in self.deferred:
                self.request(variant)
        return time.perf_counter() - start

    def _compile_lowered(self, part: Hashable, lowered, lower_s: float) -> None:
        t0 = time.perf_counter()
        exe = lowered.compile()
        self._record(part, exe, lower_s + time.perf_counter() - t0)

    def request(self, variant: StepVariant) -> None:
        """Start compiling a deferred variant's buckets in the background, once; a no-op if it is ready
        or under way. Inline: note it for `compile_wanted`."""
        if self.inline:
            if variant not in self._ready and variant not in self._wanted:
                self._wanted.add(variant)
                log.info("the %s step variant compiles before the next step (engine.compile_rare_variants=first_use; "
                         "on CPU the engine waits for it)", variant.label)
            return
        with self._lock:
            pending = self._pending.get(variant)
            if variant in self._ready or (pending is not None and not pending.cancelled()):
                return
            if self._stopping.is_set():
                return
            if self._worker is None:
                # A daemon, so that it never holds the process open by itself; `stop` (at exit) ends it
                # between two buckets.
                self._worker = threading.Thread(target=self._work, name="jaxcb-compile-later", daemon=True)
                self._worker.start()
            self._pending[variant] = future = concurrent.futures.Future()
            self._queue.put((variant, future))
        log.info("compiling the %s step variant in the background (%s)", variant.label,
                 "engine.compile_rare_variants=first_use: a request needs it" if self.when == "first_use"
                 else "engine.compile_rare_variants=background")

    def stop(self, timeout: float = 600.0) -> None:
        """Cancel the queued background compiles and wait (up to `timeout` s) for the bucket under way."""
        self._stopping.set()
        with self._lock:
            worker = self._worker
            for future in self._pending.values():
                future.cancel()
        if worker is not None:
            self._queue.put(None)
            worker.join(timeout)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._stopping.is_set():
                return
            variant, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self._compile_variant(variant)
            except BaseException as e:  # the engine sees it in wait()
                future.set_exception(e)
            else:
                future.set_result(None)

    def _compile_variant(self, variant: StepVariant) -> None:
        t0 = time.perf_counter()
        compiled = 0
        for part in self.parts_of([variant]):
            if self._stopping.is_set():
                return
            if part not in self.compiled:
                self._compile_one(part)
                compiled += 1
        self._mark_ready(variant)
        log.info("the %s step variant is ready: %d executables compiled in %.1f s", variant.label, compiled,
                 time.perf_counter() - t0)

    def compile_wanted(self) -> None:
        """Inline: compile, here and now, the variants a request or a step asked for (the engine calls
        this on its own thread before each step). A no-op otherwise, and when nothing is wanted."""
        while self._wanted:
            variant = min(self._wanted)
            self._compile_variant(variant)
            self._wanted.discard(variant)

    def wait(self, variants: Iterable[StepVariant], timeout: float) -> None:
        """Wait up to `timeout` seconds for any of these variants' background compiles to finish
        (the engine, when nothing else can run); raises what a compile raised. Inline: compile them."""
        if self.inline:
            self.compile_wanted()
            return
        futures = [self._pending[v] for v in variants if v in self._pending]
        done, _ = concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            future.result()

    def executable(self, key: BucketKey) -> tuple:
        """The compiled parts of a bucket's step; each compiled now (and logged) if it is not yet."""
        return tuple(self._part(part) for part in key.parts)

    def _part(self, part: Hashable) -> object:
        exe = self.compiled.get(part)
        if exe is None:
            if part in self._planned and not self._started:
                log.debug("compiling %s on first use", part)
            elif part in self._planned:
                log.warning("%s is not compiled yet: compiling it now, the step waits", part)
            else:  # a step size start-up did not plan: the buckets are wrong
                with self._lock:
                    self.num_recompiles += 1
                log.error("%s is not part of any planned step: compiling it now (recompile #%d)",
                          part, self.num_recompiles)
            exe = self._compile_one(part)
        return exe
