"""EngineStats: the snapshot delivered with a step's outputs describes that step, under async
scheduling too; metrics and the dashboard read only the snapshot."""

from __future__ import annotations

import os
import random
import re

from engine_factory import shared_engine
from jaxcb.sampling_params import SamplingParams



def fresh_prompt() -> list[int]:
    """20 tokens (one prefill step under the tests' 64-token budget) that no other test's request shared: the
    shared engine's prefix cache must not turn the prefill this test counts into a hit."""
    rng = random.Random(os.urandom(8))
    return [rng.randrange(1, 256) for _ in range(20)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_async_snapshot_describes_the_step_whose_outputs_it_comes_with():
    engine = shared_engine()  # other tests may have stepped it: counts are taken from here
    assert engine.cfg.engine.async_scheduling and not engine.has_unfinished_requests()
    first = engine.last_stats.num_steps + 1  # the number the next step dispatched gets
    rid = engine.add_request(fresh_prompt(), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outputs, stats = engine.step_with_stats()  # the prefill is on the device; nothing came back yet
    assert outputs == [] and stats.step_index == 0 and stats.num_tokens == 0 and stats.num_steps == first
    outputs, stats = engine.step_with_stats()  # the prefill's token comes back while the first decode runs
    [out] = outputs
    assert out.request_id == rid and len(out.outputs[0].token_ids) == 1
    assert (stats.step_index, stats.num_tokens, stats.num_prefill_tokens, stats.num_decode_tokens) == (first, 20, 20, 0)
    assert stats.num_padded_tokens >= 20 and stats.num_steps == first + 1 and stats.num_running == 1
    outputs, stats = engine.step_with_stats()
    assert len(outputs[0].outputs[0].token_ids) == 2
    assert (stats.step_index, stats.num_tokens, stats.num_prefill_tokens, stats.num_decode_tokens) == (first + 1, 1, 0, 1)
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
    assert outputs[0].finished and stats.step_index == stats.num_steps and stats.num_running == 0
    assert stats.kv_usage == 0.0 and engine.last_stats is stats


def test_a_snapshot_names_the_requests_aborted_since_the_last_one():
    engine = shared_engine()
    rid = engine.add_request(fresh_prompt(), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step_with_stats()
    assert engine.abort(rid)
    _, stats = engine.step_with_stats()
    assert stats.aborted_request_ids == (rid,)
    while engine.has_unfinished_requests():  # the step still in flight, if any
        engine.step_with_stats()
    assert engine.step_with_stats()[1].aborted_request_ids == ()  # named once


def test_observers_read_the_snapshot_not_the_engine_parts():
    for path in ("jaxcb/metrics.py", "jaxcb/server/dashboard.py", "jaxcb/benchmark.py", "jaxcb/distributed/ray_server.py"):
        source = open(os.path.join(REPO, path)).read()
        assert not re.search(r"engine\.(runner|scheduler|block_pool|output)\b", source), path
