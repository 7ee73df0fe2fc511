"""Prometheus metrics of the engine and server, named `jaxcb:*` or `vllm:*` (server.metrics_prefix).

`EngineMetrics.on_step` runs in the engine thread after every step: it reads gauges off the
step's `EngineStats` snapshot (never the engine's parts) and turns each request's outputs into histograms. What a request's first token settles
-- TTFT, queue and prefill time, its prompt tokens -- is observed at that first token, not at
the end: a stream aborted later is still counted, so TTFT does not read low under overload,
when aborts are most common. e2e and decode time need the end and are observed at the finish.
The server adds aborts and rejections. One registry per instance, so several servers (tests)
can coexist.

With prefix "vllm" every series carries vLLM's name and its label `model_name`, so dashboards
written for vLLM (its published Grafana dashboard among them) work unchanged: VLLM_NAMES and
VLLM_ALIASES say where vLLM's names differ from jaxcb's; the others are the same after the prefix.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxcb.engine_stats import EngineStats
from jaxcb.outputs import RequestOutput

PREFIXES = ("jaxcb", "vllm")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# A request's prompt or output length: 1-2-5 steps, as vLLM's, up to a million tokens (any max_model_len).
REQUEST_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
RATE_WINDOW_S = 10.0
# Finish reasons of a served request (jaxcb.core.sequence.RequestStatus). Their series exist from the
# start, so a dashboard's `sum by(finished_reason)` has them before the first request ends.
SERVED_FINISH_REASONS = ("stop", "length", "timeout")
# A request that waited past server.max_queue_time_s with nothing generated is answered 503: a rejection.
QUEUE_TIMEOUT = "queue_timeout"

# vLLM's name where it differs from jaxcb's (after the prefix).
VLLM_NAMES = {
    "iteration_tokens": "iteration_tokens_total",  # vLLM's histogram has _total in its name
    "host_kv_cache_usage_perc": "cpu_cache_usage_perc",  # vLLM's gauge of its swap space in host memory
}
# Older vLLM names of the same series, still queried by vLLM's published Grafana dashboard: the
# series is published under both, with the same values.
VLLM_ALIASES = {
    "kv_cache_usage_perc": ("gpu_cache_usage_perc",),
    "inter_token_latency_seconds": ("time_per_output_token_seconds",),
}


def series_names(prefix: str, name: str) -> list[str]:
    """The full names one jaxcb series is published under with `prefix` (the first is the main one)."""
    if prefix == "jaxcb":
        return [f"jaxcb:{name}"]
    return [f"vllm:{n}" for n in (VLLM_NAMES.get(name, name), *VLLM_ALIASES.get(name, ()))]


class _Fanout:
    """One series published under several names: every update goes to each."""

    def __init__(self, children: list):
        self.children = children

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


@dataclass
class _Stream:
    """A request between its first token and its end: what its next output is compared with."""

    num_generated: list[int]  # per completion, as of its last output with new tokens
    last_token_time: float  # when that output was seen


class EngineMetrics:
    def __init__(self, model_name: str, extra_labels: Optional[dict[str, str]] = None, prefix: str = "jaxcb"):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix {prefix!r} must be one of {PREFIXES}")
        self.prefix = prefix
        self.registry = r = CollectorRegistry()
        lbl = {"model_name": model_name, **(extra_labels or {})}  # e.g. {"replica": "0"} behind a Ray router
        self.labels = lbl

        def series(kind, name, doc, **kwargs):
            main, *aliases = series_names(prefix, name)
            children = [kind(main, doc, list(lbl), registry=r, **kwargs).labels(**lbl)]
            children += [kind(alias, f"{doc} The same as {main} (an older vLLM name).", list(lbl), registry=r,
                              **kwargs).labels(**lbl) for alias in aliases]
            return children[0] if len(children) == 1 else _Fanout(children)

        def gauge(name, doc):
            return series(Gauge, name, doc)

        def counter(name, doc):
            return series(Counter, name, doc)

        def labelled_counter(name, doc, label):  # one child per value of `label`, made on first use
            return Counter(series_names(prefix, name)[0], doc, list(lbl) + [label], registry=r)

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return series(Histogram, name, doc, buckets=buckets)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting (including preempted ones).")
        self.swapped = gauge(
            "num_requests_swapped",
            "Waiting sequences whose KV blocks were swapped to host memory (a subset of the waiting ones); "
            "always 0 without swap (scheduler.preemption_mode=recompute), as nothing is ever swapped then.",
        )
        self.tokens_waiting = gauge("num_tokens_waiting", "Tokens the waiting sequences still have to compute.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.host_kv_usage = gauge(
            "host_kv_cache_usage_perc",
            "Fraction of the host swap space's KV blocks in use (0..1); always 0 without swap, as nothing is "
            "held there.",
        )
        window = f"the last {RATE_WINDOW_S:.0f} s"
        self.device_busy = gauge("device_busy_ratio", f"Share of {window} spent in engine steps.")
        self.prefill_tps = gauge("prefill_tokens_per_second", f"Prefill tokens per second over {window}.")
        self.decode_tps = gauge("decode_tokens_per_second", f"Decode tokens per second over {window}.")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token (observed at the first token).")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request.")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled (observed at first token).")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish of a served request.")
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token (observed then).")
        self.decode_time = hist("request_decode_time_seconds", "First token to finish of a served request.")
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Prompt length of each request (observed at its first token).",
            REQUEST_TOKEN_BUCKETS,
        )
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Tokens a served request generated, all its completions together.",
            REQUEST_TOKEN_BUCKETS,
        )
        self.max_generation_tokens = hist(
            "request_max_num_generation_tokens", "Tokens generated by a served request's longest completion.",
            REQUEST_TOKEN_BUCKETS,
        )
        self.iteration_tokens = hist("iteration_tokens", "Real tokens per engine step.", TOKEN_BUCKETS)
        self.padding = hist(
            "step_padding_ratio", "Share of a step's token bucket that is padding.", (0, 0.1, 0.25, 0.5, 0.75, 0.9, 1)
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got their first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = labelled_counter("request_success", "Served requests, by finish reason.", "finished_reason")
        for reason in SERVED_FINISH_REASONS:
            self.success.labels(**lbl, finished_reason=reason)
        self.aborts = counter("request_abort", "Aborted requests (client gone, stalled, shutdown).")
        self.rejected = labelled_counter("request_rejected", "Refused requests, by reason.", "reason")
        self.preemptions = counter("num_preemptions", "Preemptions.")
        self.prefix_queries = counter("prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.recompilations = counter("recompilations", "Step compilations after warm-up (should stay 0).")
        # The prefix cache's host tier (cache.host_prefix_cache_gib; all 0 when off).
        self.host_prefix_hits = counter(
            "host_prefix_cache_hits", "Tokens found in the prefix cache's host tier (a part of prefix_cache_hits).")
        self.host_tier_bytes = labelled_counter(
            "host_prefix_cache_bytes", "Bytes of KV blocks copied between the device cache and the prefix cache's "
            "host tier, by direction (to_host: evicted blocks kept; to_device: host hits brought back).", "direction")
        self.host_tier_evictions = counter(
            "host_prefix_cache_evictions", "Blocks the prefix cache's host tier dropped for newer ones.")
        self.host_tier_usage = gauge(
            "host_prefix_cache_usage_perc", "Fraction of the prefix cache's host tier blocks holding contents (0..1).")
        # Speculative decoding, under vLLM's names (acceptance rate: accepted / draft tokens; mean accepted
        # length: 1 + accepted tokens / drafts).
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify steps: a sequence bringing drafts to a step.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed (draft) tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = labelled_counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their position among the drafts.",
            "position")
        self.spec_unspeculated = counter(
            "spec_decode_num_unspeculated_requests",
            "Requests decoded without speculation (token constraints, prompt_logprobs) while it is on.")
        # LoRA: vLLM's info gauge (its labels name the running and waiting adapters; its value the time
        # it was set) and, per adapter, requests and generated tokens.
        self.lora_info = Gauge(series_names(prefix, "lora_requests_info")[0], "Running and waiting LoRA adapters.",
                               list(lbl) + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self._lora_info_labels: Optional[tuple] = None
        self.lora_requests = labelled_counter("lora_requests", "Requests added, by LoRA adapter.", "lora_name")
        self.lora_tokens = labelled_counter("lora_generation_tokens", "Generated tokens, by LoRA adapter.",
                                            "lora_name")
        self._lora_last: dict[str, tuple[int, int]] = {}
        # No counter of failed KV block allocations: the scheduler answers one by preempting
        # (num_preemptions), and requests that could never fit are refused up front (request_rejected).
        self._last = {"preemptions": 0, "queries": 0, "hits": 0, "recompiles": 0, "drafts": 0, "draft_tokens": 0,
                      "accepted": 0, "unspeculated": 0, "host_hits": 0, "host_evictions": 0}
        self._last_bytes = {"to_host": 0, "to_device": 0}
        self._last_per_pos: list[int] = []
        self._streams: dict[str, _Stream] = {}  # request id -> its stream, from its first token to its end
        self._window: deque[tuple[float, float, int, int]] = deque()  # (end time, step seconds, prefill, decode)

    @property
    def num_tracked_requests(self) -> int:
        """Requests whose stream is remembered (between first token and end): bounded by the unfinished ones."""
        return len(self._streams)

    def _advance(self, counter, key: str, value: int) -> None:
        if value > self._last[key]:
            counter.inc(value - self._last[key])
            self._last[key] = value

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput], step_seconds: float) -> None:
        """After every step, in the engine thread: `stats` and `outputs` are of the same step."""
        now = time.monotonic()
        self._read_stats(stats)
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
        for rid in stats.aborted_request_ids:  # aborts made on the engine directly, which no one reports
            self._streams.pop(rid, None)

    def _read_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.host_kv_usage.set(stats.host_kv_usage)
        self.tokens_waiting.set(stats.num_waiting_tokens)
        self.kv_usage.set(stats.kv_usage)
        self._advance(self.preemptions, "preemptions", stats.num_preemptions)
        self._advance(self.prefix_queries, "queries", stats.prefix_cache_queries)
        self._advance(self.prefix_hits, "hits", stats.prefix_cache_hits)
        self._advance(self.recompilations, "recompiles", stats.num_recompiles)
        self._advance(self.host_prefix_hits, "host_hits", stats.host_prefix_cache_hits)
        self._advance(self.host_tier_evictions, "host_evictions", stats.host_tier_evictions)
        self.host_tier_usage.set(stats.host_tier_usage)
        for direction, value in (("to_host", stats.host_tier_bytes_to_host),
                                 ("to_device", stats.host_tier_bytes_to_device)):
            if value > self._last_bytes[direction]:
                self.host_tier_bytes.labels(**self.labels, direction=direction).inc(value - self._last_bytes[direction])
                self._last_bytes[direction] = value
        self._advance(self.spec_drafts, "drafts", stats.spec_num_drafts)
        self._advance(self.spec_draft_tokens, "draft_tokens", stats.spec_num_draft_tokens)
        self._advance(self.spec_accepted, "accepted", stats.spec_num_accepted_tokens)
        self._advance(self.spec_unspeculated, "unspeculated", stats.spec_num_unspeculated_requests)
        if stats.max_lora:
            self._read_lora(stats)
        per_pos = stats.spec_accepted_per_position
        if per_pos != tuple(self._last_per_pos):
            self._last_per_pos += [0] * (len(per_pos) - len(self._last_per_pos))
            for i, n in enumerate(per_pos):
                if n > self._last_per_pos[i]:
                    self.spec_accepted_per_pos.labels(**self.labels, position=str(i)).inc(n - self._last_per_pos[i])
                    self._last_per_pos[i] = n

    def _read_lora(self, stats: EngineStats) -> None:
        values = (*self.labels.values(), str(stats.max_lora), ",".join(stats.lora_running_adapters),
                  ",".join(stats.lora_waiting_adapters))
        if values != self._lora_info_labels:  # one series at a time: the previous label set goes
            if self._lora_info_labels is not None:
                self.lora_info.remove(*self._lora_info_labels)
            self._lora_info_labels = values
        self.lora_info.labels(*values).set(time.time())
        for name, requests, tokens in stats.lora_totals:
            last_requests, last_tokens = self._lora_last.get(name, (0, 0))
            if requests > last_requests:
                self.lora_requests.labels(**self.labels, lora_name=name).inc(requests - last_requests)
            if tokens > last_tokens:
                self.lora_tokens.labels(**self.labels, lora_name=name).inc(tokens - last_tokens)
            self._lora_last[name] = (max(requests, last_requests), max(tokens, last_tokens))

    def _observe_request(self, out: RequestOutput, now: float) -> None:
        rid = out.request_id
        counts = [c.num_generated for c in out.outputs]
        stream = self._streams.get(rid)
        before = stream.num_generated if stream is not None else [0] * len(counts)
        new = [n - b for n, b in zip(counts, before)]
        most_new = max(new, default=0)
        if sum(new) > 0:
            self.generation_tokens.inc(sum(new))
        if stream is None and sum(counts) > 0:
            self._first_token(out, now)
        elif stream is not None and most_new > 0:
            # The n completions advance side by side: the interval is per token of one completion.
            self.itl.observe((now - stream.last_token_time) / most_new)
        if out.finished:
            self._streams.pop(rid, None)
            self._finished(out)
        elif stream is None and sum(counts) > 0:
            self._streams[rid] = _Stream(counts, now)
        elif stream is not None and most_new > 0:
            stream.num_generated, stream.last_token_time = counts, now

    def _first_token(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        # The engine stamps its first sequence; with n > 1 another one may have been first: then it is now.
        first_token = m.first_token_time if m.first_token_time is not None else now
        self.ttft.observe(first_token - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            self.prefill_time.observe(first_token - m.first_scheduled_time)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))

    def _finished(self, out: RequestOutput) -> None:
        reasons = {c.finish_reason for c in out.outputs} - {None, "abort"}
        if not reasons:
            return  # aborted: request_aborted counts it
        if reasons == {QUEUE_TIMEOUT}:
            self.request_rejected(QUEUE_TIMEOUT)
            return
        m = out.metrics
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_token_time is not None:
                self.decode_time.observe(m.finished_time - m.first_token_time)
        counts = [c.num_generated for c in out.outputs]
        self.request_generation_tokens.observe(sum(counts))
        self.max_generation_tokens.observe(max(counts, default=0))
        self.success.labels(**self.labels, finished_reason=sorted(reasons)[0]).inc()

    def request_aborted(self, request_id: str) -> None:
        self.aborts.inc()
        self._streams.pop(request_id, None)

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(**self.labels, reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
