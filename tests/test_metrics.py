"""Engine metrics on a real tiny engine, fed its step outputs as the server feeds them (DELTA):
what a first token settles is counted at that token, streams are forgotten at their end, and
with metrics_prefix=vllm /metrics serves every series vLLM's Grafana dashboard queries."""

import asyncio
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine_factory import shared_engine
from jaxcb.config import compose_config
from jaxcb.distributed.replica_metrics import RouterMetrics
from jaxcb.metrics import EngineMetrics
from jaxcb.output import OutputKind
from jaxcb.sampling_params import SamplingParams
from server_harness import running_server
from vllm_grafana_series import DASHBOARD_SERIES, SWAP_PANEL_SERIES

PROMPT = [1, 2, 3, 4, 5]
LONG_PROMPT = list(range(1, 101))  # over scheduler.max_num_batched_tokens=64: its prefill takes two steps
SMALL_SWAP_CACHE = ("cache.num_blocks=24", "scheduler.policy=fcfs", "scheduler.preemption_mode=swap",
                    "cache.swap_space_gib=0.002")  # as tests/test_engine.py: far too small, so it swaps


def add_stream(engine, request_id, prompt=PROMPT, max_tokens=8, n=1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return engine.add_request(prompt, params, request_id=request_id, output_kind=OutputKind.DELTA)


def step(engine, metrics):
    outputs, stats = engine.step_with_stats()
    metrics.on_step(stats, outputs, 0.001)
    return outputs


def step_until_first_token(engine, metrics, request_id):
    for _ in range(100):
        for out in step(engine, metrics):
            if out.request_id == request_id and any(c.num_generated for c in out.outputs):
                assert not out.finished
                return
    raise AssertionError(f"{request_id} got no token")


def run_to_end(engine, metrics):
    while engine.has_unfinished_requests():
        step(engine, metrics)


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(f"jaxcb:{name}", {**metrics.labels, **labels}) or 0.0


def test_ttft_queue_and_prefill_time_are_counted_at_the_first_token_while_the_stream_runs():
    engine, metrics = shared_engine(), EngineMetrics("tiny")
    add_stream(engine, "a", max_tokens=8)
    step_until_first_token(engine, metrics, "a")
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_prompt_tokens"):
        assert value(metrics, f"{name}_count") == 1, name
    assert value(metrics, "prompt_tokens_total") == len(PROMPT)
    assert value(metrics, "e2e_request_latency_seconds_count") == 0
    run_to_end(engine, metrics)
    assert value(metrics, "time_to_first_token_seconds_count") == 1  # not once more at the end
    assert value(metrics, "prompt_tokens_total") == len(PROMPT)
    assert value(metrics, "e2e_request_latency_seconds_count") == 1
    assert value(metrics, "request_decode_time_seconds_count") == 1
    assert value(metrics, "inter_token_latency_seconds_count") == 7  # one per token after the first
    assert value(metrics, "generation_tokens_total") == 8
    assert value(metrics, "request_generation_tokens_sum") == 8
    assert value(metrics, "request_success_total", finished_reason="length") == 1


def test_a_stream_aborted_after_its_first_token_is_counted_in_ttft():
    engine, metrics = shared_engine(), EngineMetrics("tiny")
    add_stream(engine, "a", max_tokens=50)
    step_until_first_token(engine, metrics, "a")
    assert engine.abort("a")
    metrics.request_aborted("a")
    assert value(metrics, "time_to_first_token_seconds_count") == 1
    assert value(metrics, "request_abort_total") == 1
    assert value(metrics, "e2e_request_latency_seconds_count") == 0
    assert value(metrics, "request_success_total", finished_reason="length") == 0
    assert metrics.num_tracked_requests == 0


def test_a_request_aborted_before_its_first_token_is_counted_only_as_an_abort():
    engine, metrics = shared_engine(), EngineMetrics("tiny")
    add_stream(engine, "queued")
    assert engine.abort("queued")
    metrics.request_aborted("queued")
    add_stream(engine, "mid-prefill", prompt=LONG_PROMPT)
    assert step(engine, metrics) == []  # its prefill is not done yet
    assert engine.abort("mid-prefill")
    metrics.request_aborted("mid-prefill")
    run_to_end(engine, metrics)
    assert value(metrics, "request_abort_total") == 2
    assert value(metrics, "time_to_first_token_seconds_count") == 0
    assert value(metrics, "prompt_tokens_total") == 0
    assert metrics.num_tracked_requests == 0


def test_n_completions_make_one_request_with_one_token_interval_per_output():
    engine, metrics = shared_engine(), EngineMetrics("tiny")
    add_stream(engine, "pair", max_tokens=4, n=2)
    num_outputs = 0
    while engine.has_unfinished_requests():
        num_outputs += len(step(engine, metrics))
    assert value(metrics, "time_to_first_token_seconds_count") == 1
    assert value(metrics, "generation_tokens_total") == 8
    assert value(metrics, "request_generation_tokens_sum") == 8
    assert value(metrics, "request_max_num_generation_tokens_sum") == 4
    # The completions advance side by side (the second one a step behind, as it shares the first's
    # prompt blocks): each output after the first is one interval, a step's time, not a share of it.
    assert value(metrics, "inter_token_latency_seconds_count") == num_outputs - 1


def test_a_request_timed_out_in_the_queue_is_a_rejection_not_a_success():
    engine, metrics = shared_engine(), EngineMetrics("tiny")
    engine.add_request(PROMPT, SamplingParams(max_tokens=4), request_id="late", output_kind=OutputKind.DELTA,
                       queue_timeout_s=0)
    run_to_end(engine, metrics)
    assert value(metrics, "request_rejected_total", reason="queue_timeout") == 1
    assert sum(value(metrics, "request_success_total", finished_reason=r) for r in ("stop", "length", "timeout")) == 0
    assert value(metrics, "e2e_request_latency_seconds_count") == 0
    assert value(metrics, "time_to_first_token_seconds_count") == 0


def test_streams_are_forgotten_after_many_finished_and_aborted_requests():
    engine, metrics = shared_engine(), EngineMetrics("tiny")
    for wave in range(10):
        ids = [f"w{wave}-{i}" for i in range(4)]
        for request_id in ids:
            add_stream(engine, request_id, max_tokens=6)
        step_until_first_token(engine, metrics, ids[-1])
        assert metrics.num_tracked_requests <= len(engine.output.groups)
        for request_id in ids[:2]:
            if engine.abort(request_id):
                metrics.request_aborted(request_id)
        run_to_end(engine, metrics)
        assert metrics.num_tracked_requests == 0
    assert value(metrics, "time_to_first_token_seconds_count") == 40
    # An abort made on the engine directly, which nobody reports, is forgotten at the next step.
    add_stream(engine, "unreported", max_tokens=50)
    step_until_first_token(engine, metrics, "unreported")
    assert metrics.num_tracked_requests == 1
    engine.abort("unreported")
    step(engine, metrics)  # the next step's snapshot names the abort
    assert metrics.num_tracked_requests == 0


def test_swap_gauges_show_what_is_in_host_memory():
    engine, metrics = shared_engine(*SMALL_SWAP_CACHE), EngineMetrics("tiny", prefix="vllm")
    for i in range(16):
        add_stream(engine, f"s{i}", prompt=[(7 * i + j) % 256 for j in range(40)], max_tokens=40)
    swapped, host_usage = [], []
    while engine.has_unfinished_requests():
        step(engine, metrics)
        swapped.append(metrics.registry.get_sample_value("vllm:num_requests_swapped", metrics.labels))
        host_usage.append(metrics.registry.get_sample_value("vllm:cpu_cache_usage_perc", metrics.labels))
    assert engine.scheduler.num_swap_outs > 0
    assert max(swapped) > 0 and max(host_usage) > 0
    assert swapped[-1] == 0 and host_usage[-1] == 0


def parse(text: str) -> dict[str, list[dict]]:
    """Sample name -> the label sets it has."""
    samples: dict[str, list[dict]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s.labels)
    return samples


def test_the_vllm_prefix_serves_every_series_the_vllm_grafana_dashboard_queries():
    with running_server("server.metrics_prefix=vllm", engine=shared_engine()) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(url + "/metrics").text
    samples = parse(text)
    for name, labels in DASHBOARD_SERIES + SWAP_PANEL_SERIES:
        assert name in samples, name
        assert any(set(labels) <= set(s) and s["model_name"] == "tiny" for s in samples[name]), (name, samples[name])
    assert not [name for name in samples if not name.startswith("vllm:")]
    successes = [s for s in samples["vllm:request_success_total"] if s["finished_reason"] == "length"]
    assert successes and "vllm:time_to_first_token_seconds_count" in samples


def test_the_jaxcb_prefix_keeps_jaxcb_names():
    assert all(name.startswith("jaxcb:") for name in parse(EngineMetrics("tiny").render().decode()))


def test_the_routers_own_series_take_the_configured_prefix():
    router = SimpleNamespace(cfg=compose_config(("server.metrics_prefix=vllm",)), replicas=[])
    metrics = RouterMetrics(router, "tiny")
    metrics.request_rejected("overloaded")
    names = parse(asyncio.run(metrics.render()).decode())
    assert "vllm:request_rejected_total" in names
    assert all(name.startswith("vllm:") for name in names)
