"""Prometheus metrics of the engine and server (vLLM-compatible names, prefix `jaxcb:`).

`EngineMetrics.on_step` runs in the engine thread after every step: it reads gauges off the
engine and turns each request's output timestamps into latency histograms. The server adds
aborts and rejections. One registry per instance, so several servers (tests) can coexist.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxcb.outputs import RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RATE_WINDOW_S = 10.0


class EngineMetrics:
    def __init__(self, model_name: str, extra_labels: Optional[dict[str, str]] = None, prefix: str = "jaxcb"):
        self.registry = r = CollectorRegistry()
        lbl = {"model_name": model_name, **(extra_labels or {})}  # e.g. {"replica": "0"} behind a Ray router
        self.labels = lbl

        def gauge(name, doc):
            return Gauge(f"jaxcb:{name}", doc, list(lbl), registry=r).labels(**lbl)

        def counter(name, doc, extra=()):
            c = Counter(f"jaxcb:{name}", doc, list(lbl) + list(extra), registry=r)
            return c if extra else c.labels(**lbl)

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(f"jaxcb:{name}", doc, list(lbl), buckets=buckets, registry=r).labels(**lbl)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting (including preempted ones).")
        self.tokens_waiting = gauge("num_tokens_waiting", "Tokens the waiting sequences still have to compute.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.device_busy = gauge("device_busy_ratio", f"Share of the last {RATE_WINDOW_S:.0f} s spent in engine steps.")
        self.prefill_tps = gauge("prefill_tokens_per_second", f"Prefill tokens per second over the last {RATE_WINDOW_S:.0f} s.")
        self.decode_tps = gauge("decode_tokens_per_second", f"Decode tokens per second over the last {RATE_WINDOW_S:.0f} s.")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request.")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode_time = hist("request_decode_time_seconds", "First token to finish.")
        self.iteration_tokens = hist("iteration_tokens", "Real tokens per engine step.", TOKEN_BUCKETS)
        self.padding = hist(
            "step_padding_ratio", "Share of a step's token bucket that is padding.", (0, 0.1, 0.25, 0.5, 0.75, 0.9, 1)
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Finished requests.", ("finished_reason",))
        self.aborts = counter("request_abort", "Aborted requests (client gone, stalled, shutdown).")
        self.rejected = counter("request_rejected", "Refused requests.", ("reason",))
        self.preemptions = counter("num_preemptions", "Preemptions.")
        self.prefix_queries = counter("prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.recompilations = counter("recompilations", "Step compilations after warm-up (should stay 0).")
        self.oom = counter("request_oom", "KV block allocation failures that reached a request (should stay 0).")
        self._last = {"preemptions": 0, "queries": 0, "hits": 0, "recompiles": 0}
        self._token_counts: dict[str, int] = {}
        self._last_token_time: dict[str, float] = {}
        self._window: deque[tuple[float, float, int, int]] = deque()  # (end time, step seconds, prefill, decode)

    def _advance(self, counter, key: str, value: int) -> None:
        if value > self._last[key]:
            counter.inc(value - self._last[key])
            self._last[key] = value

    def on_step(self, engine, outputs: list[RequestOutput], step_seconds: float) -> None:
        now = time.monotonic()
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.tokens_waiting.set(sched.num_waiting_tokens)
        self.kv_usage.set(engine.block_pool.usage().usage)
        self._advance(self.preemptions, "preemptions", sched.num_preemptions)
        self._advance(self.prefix_queries, "queries", sched.prefix_cache_queries)
        self._advance(self.prefix_hits, "hits", sched.prefix_cache_hits)
        self._advance(self.recompilations, "recompiles", engine.num_recompiles)
        stats = engine.runner.last_step
        if stats.num_padded_tokens:
            self.iteration_tokens.observe(stats.num_tokens)
            self.padding.observe(1 - stats.num_tokens / stats.num_padded_tokens)
        self._window.append((now, step_seconds, stats.num_prefill_tokens, stats.num_decode_tokens))
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()
        span = max(1e-6, now - self._window[0][0] + self._window[0][1])
        self.device_busy.set(min(1.0, sum(w[1] for w in self._window) / span))
        self.prefill_tps.set(sum(w[2] for w in self._window) / span)
        self.decode_tps.set(sum(w[3] for w in self._window) / span)
        for out in outputs:
            self._observe_request(out, now)

    def _observe_request(self, out: RequestOutput, now: float) -> None:
        rid = out.request_id
        num_tokens = sum(c.num_generated for c in out.outputs)
        new = num_tokens - self._token_counts.get(rid, 0)
        if new > 0:
            self.generation_tokens.inc(new)
            last = self._last_token_time.get(rid)
            if last is not None:
                self.itl.observe((now - last) / new)
            self._last_token_time[rid] = now
            self._token_counts[rid] = num_tokens
        if out.finished:
            m = out.metrics
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                    self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
                if m.finished_time is not None:
                    self.decode_time.observe(m.finished_time - m.first_token_time)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            reasons = {c.finish_reason for c in out.outputs}
            if reasons != {"abort"}:
                self.success.labels(**self.labels, finished_reason=sorted(reasons - {"abort"})[0]).inc()
            self._token_counts.pop(rid, None)
            self._last_token_time.pop(rid, None)

    def request_aborted(self, request_id: str) -> None:
        self.aborts.inc()
        self._token_counts.pop(request_id, None)
        self._last_token_time.pop(request_id, None)

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(**self.labels, reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
