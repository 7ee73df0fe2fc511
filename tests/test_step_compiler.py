"""The step compiler: parallel compiles build the same executables as serial ones; a step is two
executables, the model's per bucket and the sampler's per sequence bucket and variant, shared by
every token bucket; the rare variants compile later (only their samplers, where the model is
compiled already), and only the requests that need one wait for it; a first-use compile is not a
recompile, a step size start-up did not plan is."""

import threading

import pytest

from engine_factory import BASE, VARIANTS, make_engine
from jaxcb.config import compose_config
from jaxcb.engine import Engine
from jaxcb.runner.buckets import BucketKey, ModelKey, SamplerKey
from jaxcb.runner.compiler import StepCompiler, compile_plan
from jaxcb.config import EngineConfig
from jaxcb.sampling import StepVariant
from jaxcb.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def lazy_engine():
    """Every variant configured, none compiled at start-up (the compiler is driven by each test)."""
    return Engine(compose_config(BASE + VARIANTS), compile_buckets=False, progress=False)


def fresh_compiler(engine, workers: int, when: str = "startup", variants=(StepVariant.GREEDY, StepVariant.FULL)):
    keys = [key for key in engine.runner.compiler.keys if key.variant in variants]
    return StepCompiler(engine.runner._lower, keys, workers=workers, when=when)


def test_parallel_compiles_build_the_same_executables_as_serial_ones(lazy_engine):
    serial, parallel = fresh_compiler(lazy_engine, 1), fresh_compiler(lazy_engine, 2)
    serial.compile_startup(progress=False)
    parallel.compile_startup(progress=False)
    assert serial.compiled.keys() == parallel.compiled.keys() and len(serial.compiled) >= 4
    for key, exe in serial.compiled.items():
        assert exe.as_text() == parallel.compiled[key].as_text(), key
    assert serial.num_recompiles == parallel.num_recompiles == 0
    assert set(parallel.num_compiles.values()) == {1}


def test_rare_variants_wait_for_first_use_and_full_serves_random_rows_meanwhile(lazy_engine):
    c = fresh_compiler(lazy_engine, 2, "first_use", variants=tuple(StepVariant))
    c.compile_startup(progress=False)
    assert c.ready == (StepVariant.GREEDY, StepVariant.FULL)
    assert c.deferred == (StepVariant.RANDOM, StepVariant.MASKED, StepVariant.PROMPT_LOGPROBS)
    assert set(c.compiled) == set(c.parts_of([StepVariant.GREEDY, StepVariant.FULL]))
    assert c.serving(StepVariant.RANDOM) == StepVariant.FULL
    assert c.serving(StepVariant.MASKED) is None
    startup = set(c.compiled)
    assert c.serve(StepVariant.RANDOM) == StepVariant.FULL  # ... and random starts compiling
    c.wait([StepVariant.RANDOM], timeout=300)
    assert c.serving(StepVariant.RANDOM) == StepVariant.RANDOM
    # The random variant's first use compiled its samplers, one per sequence bucket, and no model.
    assert set(c.compiled) - startup == {SamplerKey(r, StepVariant.RANDOM) for r in lazy_engine.runner.buckets.seqs_for(
        max(lazy_engine.runner.buckets.tokens))}
    assert c.num_recompiles == 0 and set(c.num_compiles.values()) == {1}  # first compiles, not recompiles
    assert SamplerKey(8, StepVariant.MASKED) not in c.compiled  # nobody asked for it


def test_a_step_size_start_up_did_not_plan_is_a_recompile(lazy_engine):
    c = fresh_compiler(lazy_engine, 1)
    c.compile_startup(progress=False)
    planned = c.keys[0]
    assert c.executable(planned) == tuple(c.compiled[part] for part in planned.parts) and c.num_recompiles == 0
    unplanned = BucketKey(planned.num_tokens, planned.num_seqs, planned.table_width + 1, planned.variant)
    c.executable(unplanned)
    assert c.num_recompiles == 1  # its model; its sampler (the sequence bucket's) was compiled already


def test_a_cpu_engine_starts_up_with_one_model_a_bucket_and_greedy_and_full_samplers_a_sequence_bucket():
    """What a cold start on CPU pays for by default: one model executable a bucket (whatever the
    variant), and a greedy and a full sampler a sequence bucket; the random, masked and
    prompt-logprobs variants (configured, as by default) wait for a request that needs one."""
    engine = make_engine(*VARIANTS, "engine.token_buckets=[4,16,64]", "engine.seq_buckets=[4,8]")
    runner = engine.runner
    eager = (StepVariant.GREEDY, StepVariant.FULL)
    buckets = runner.buckets.all()
    seq_buckets = {b.num_seqs for b in buckets}
    assert len(buckets) > len(seq_buckets) == 2
    assert set(runner.compiled) == ({ModelKey(*bucket, False) for bucket in buckets}
                                    | {SamplerKey(r, v) for r in seq_buckets for v in eager})
    assert runner.compiler.ready == eager and set(runner.compiler.num_compiles.values()) == {1}
    assert len(runner.compiler.keys) == 5 * len(buckets)  # planned, for first use


def test_every_token_bucket_of_a_sequence_bucket_runs_the_same_sampler_executable():
    runner = make_engine().runner
    steps = [BucketKey(*bucket, StepVariant.FULL) for bucket in runner.buckets.all()]
    assert len({key.num_tokens for key in steps}) == 2 and len({key.num_seqs for key in steps}) == 1
    models, samplers = zip(*(runner.executable(key) for key in steps))
    assert len(set(map(id, models))) == 2 and len(set(map(id, samplers))) == 1


def test_on_cpu_rare_variants_compile_on_first_use_and_never_in_the_background():
    from jaxcb.config import ConfigError

    assert compile_plan(EngineConfig(), num_cores=16, platform="cpu") == (8, "first_use")
    with pytest.raises(ConfigError, match="compile_rare_variants=background .* XLA:CPU"):
        compile_plan(EngineConfig(compile_rare_variants="background"), platform="cpu")


def test_compile_workers_the_cpu_cannot_use_are_logged_with_the_number_used(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="jaxcb.runner.compiler"):
        compile_plan(EngineConfig(compile_workers=6), num_cores=16, platform="cpu")
    assert "engine.compile_workers=6: 1 used: on CPU the steps compile one at a time" in caplog.text


def test_auto_compiles_on_first_use_with_few_cores_and_in_the_background_with_many():
    assert compile_plan(EngineConfig(), num_cores=2) == (1, "first_use")  # a second thread gains ~nothing there
    assert compile_plan(EngineConfig(), num_cores=4) == (4, "first_use")
    assert compile_plan(EngineConfig(), num_cores=16) == (8, "background")
    assert compile_plan(EngineConfig(compile_workers=3, compile_rare_variants="startup"), num_cores=16) == (3, "startup")


def test_a_request_whose_variant_is_compiling_waits_while_the_others_run():
    """The background path (a GPU host's): the held requests wait, the others run. The compile is a
    stand-in that holds until told: XLA:CPU must never compile beside a step (the next test)."""
    engine = make_engine(*VARIANTS, "engine.compile_rare_variants=first_use")
    compiler = engine.runner.compiler
    compiler.inline = False  # as on a GPU host
    assert StepVariant.MASKED not in compiler.ready
    gate = threading.Event()
    masked = [part for part in compiler.parts_of([StepVariant.MASKED]) if part not in compiler.compiled]
    assert masked and all(isinstance(part, SamplerKey) for part in masked)  # the models are there already
    ready_made = {part: compiler.lower(part).compile() for part in masked}  # here, before any step runs

    def held_then_ready(variant):  # what a background compile ends with, after the gate opens
        gate.wait(300)
        compiler.compiled.update(ready_made)
        compiler._mark_ready(variant)

    compiler._compile_variant = held_then_ready
    free_blocks = engine.block_pool.num_free_blocks
    plain = engine.add_request([72, 105, 33], SamplingParams(max_tokens=4))
    masked = engine.add_request([72, 105, 33], SamplingParams(max_tokens=4, allowed_token_ids=[5, 7]))
    aborted = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, allowed_token_ids=[9]))
    assert engine.last_stats.num_waiting == 0 and engine.num_held_sequences == 2
    done = {}
    for _ in range(20):  # the plain request runs to the end while the masked ones are held
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if plain in done:
            break
    assert plain in done and masked not in done
    assert engine.last_stats.num_waiting == 2  # the held ones count as waiting
    assert engine.abort(aborted)
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done[masked].outputs[0].token_ids) <= {5, 7} and len(done[masked].outputs[0].token_ids) == 4
    assert aborted not in done and engine.num_held_sequences == 0
    assert engine.block_pool.num_free_blocks == free_blocks  # nothing held back leaked a block
    assert engine.num_recompiles == 0


EXIT_DURING_A_BACKGROUND_COMPILE = """
import pathlib, sys, time
from jaxcb.runner.buckets import BucketKey, ModelKey, SamplerKey
from jaxcb.runner.compiler import StepCompiler
from jaxcb.sampling import StepVariant

done = pathlib.Path(sys.argv[1])

class SlowLowered:
    def __init__(self, key):
        self.key = key
    def compile(self):
        if getattr(self.key, "variant", None) == StepVariant.RANDOM:  # the random variant's sampler
            time.sleep(1.0)  # still compiling when the main thread returns
            done.write_text("finished")
        return object()

keys = [BucketKey(16, 4, 8, v) for v in (StepVariant.GREEDY, StepVariant.RANDOM, StepVariant.FULL)]
compiler = StepCompiler(SlowLowered, keys, workers=1, when="first_use")
compiler.compile_startup(progress=False)
compiler.request(StepVariant.RANDOM)
time.sleep(0.2)  # the compile is under way
"""


def test_the_process_exits_after_the_background_compile_under_way_not_in_the_middle_of_it(tmp_path):
    """A process that returns while a deferred variant compiles lets that bucket finish before the
    interpreter tears down: a thread still inside XLA's compiler at teardown crashes the process
    (a job that wrote every result then exited with SIGSEGV)."""
    import subprocess
    import sys

    done = tmp_path / "done"
    proc = subprocess.run([sys.executable, "-c", EXIT_DURING_A_BACKGROUND_COMPILE, str(done)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert done.read_text() == "finished"


def test_on_cpu_a_rare_variant_compiles_on_the_engine_thread_before_the_next_step():
    engine = make_engine(*VARIANTS, "engine.compile_rare_variants=first_use")
    compiler = engine.runner.compiler
    assert compiler.inline and StepVariant.MASKED not in compiler.ready
    threads = set()
    real = compiler._compile_one
    compiler._compile_one = lambda key: (threads.add(threading.get_ident()), real(key))[1]
    masked = engine.add_request([72, 105, 33], SamplingParams(max_tokens=4, allowed_token_ids=[5, 7]))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done[masked].outputs[0].token_ids) <= {5, 7}
    assert threads == {threading.get_ident()}  # every compile on this (the engine's) thread
    assert StepVariant.MASKED in compiler.ready and engine.num_recompiles == 0
