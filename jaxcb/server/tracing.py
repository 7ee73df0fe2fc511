"""OpenTelemetry tracing of requests (`server.otlp_endpoint`; off by default): one span per request,
`llm_request` of kind SERVER, continuing the caller's W3C `traceparent`, with the attributes vLLM sets
(request id, model, sampling parameters, prompt and completion tokens, queue time, time to first
token, end-to-end latency, finish reasons), exported over OTLP/HTTP.

The span is recorded when the request's response is complete (streamed or whole), from the
engine's own timings of its prompts (`RequestMetrics`), as vLLM records it. `TracingMiddleware`
opens a `RequestTrace` for each generation request; the handler hands it its streams
(`RequestTrace.watch`), whose last outputs carry those timings.

Only `RequestTracer` touches OpenTelemetry, and it imports it when it is built: with tracing off
the server never imports an OpenTelemetry package.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from jaxcb.errors import UserError
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams
from jaxcb.server import openai_format as fmt

TRACED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
SCOPE_KEY = "jaxcb.trace"  # where a request's RequestTrace waits in its ASGI scope
SPAN_NAME = "llm_request"


class Attr:
    """Span attribute names, as vLLM sets them (and OpenTelemetry's GenAI conventions where they exist)."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"


@dataclass
class RequestTrace:
    """What one request's span is made of, gathered while it is served (no OpenTelemetry here)."""

    headers: dict[str, str]  # the incoming headers (traceparent, tracestate)
    start_ns: int = field(default_factory=time.time_ns)
    request_id: Optional[str] = None  # the response's id, once the handler has made it
    params: Optional[SamplingParams] = None
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # prompt index -> its latest output
    deferred: bool = False  # a background response's: its run records the span when it ends, not the middleware

    def watch(self, streams: list, params: SamplingParams) -> list:
        """`streams` as the handler uses them, each output seen here on its way."""
        self.params = params
        return [_WatchedStream(s, self, i) for i, s in enumerate(streams)]

    def attributes(self, model: str) -> dict[str, Any]:
        """The span's attributes. Latencies are per prompt, from one engine's clock each (prompts may run on
        different Ray replicas): the slowest queue, the first token of any, the last to finish."""
        outs = [self.outputs[i] for i in sorted(self.outputs)]
        attrs: dict[str, Any] = {Attr.RESPONSE_MODEL: model,
                                 Attr.USAGE_PROMPT_TOKENS: sum(len(o.prompt_token_ids) for o in outs),
                                 Attr.USAGE_COMPLETION_TOKENS: sum(c.num_generated for o in outs for c in o.outputs),
                                 Attr.USAGE_NUM_SEQUENCES: sum(len(o.outputs) for o in outs)}
        if self.request_id is not None:
            attrs[Attr.REQUEST_ID] = self.request_id
        if self.params is not None:
            p = self.params
            attrs.update({Attr.REQUEST_TEMPERATURE: p.temperature, Attr.REQUEST_TOP_P: p.top_p,
                          Attr.REQUEST_MAX_TOKENS: p.max_tokens, Attr.REQUEST_N: p.n})
        reasons = [fmt.finish_reason(c) for o in outs for c in o.outputs]
        if reasons and all(r is not None for r in reasons):
            attrs[Attr.RESPONSE_FINISH_REASONS] = reasons
        metrics = [o.metrics for o in outs]
        for name, moment, reduce in ((Attr.LATENCY_TIME_IN_QUEUE, lambda m: m.first_scheduled_time, max),
                                     (Attr.LATENCY_TIME_TO_FIRST_TOKEN, lambda m: m.first_token_time, min),
                                     (Attr.LATENCY_E2E, lambda m: m.finished_time, max)):
            moments = [moment(m) for m in metrics]
            if metrics and None not in moments:
                attrs[name] = reduce(t - m.arrival_time for t, m in zip(moments, metrics))
        return attrs


class _WatchedStream:
    """A request stream whose outputs a RequestTrace sees; otherwise the stream itself."""

    def __init__(self, stream, trace: RequestTrace, index: int):
        self._stream, self._trace, self._index = stream, trace, index

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self._stream.__anext__()
        self._trace.outputs[self._index] = out
        return out

    def close(self) -> None:
        self._stream.close()


class RequestTracer:
    """Makes and exports the spans: OTLP/HTTP to `endpoint`, or to `exporter` (tests: an in-memory one)."""

    def __init__(self, endpoint: str, exporter: Any = None):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise UserError(f"server.otlp_endpoint={endpoint} needs OpenTelemetry's SDK and OTLP exporter, which are "
                            f"not installed here ({e}): pip install 'jaxcb[tracing]', or unset server.otlp_endpoint"
                            ) from None

        if exporter is None:
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))  # exports off the serving thread
        else:
            processor = SimpleSpanProcessor(exporter)
        # A provider of the server's own, not the process-wide one: the server's switch alone decides.
        self.provider = TracerProvider(resource=Resource.create({"service.name": "jaxcb"}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("jaxcb")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = SpanKind.SERVER

    def record(self, trace: RequestTrace, model: str, end_ns: int) -> None:
        context = self.propagator.extract(carrier=trace.headers)  # the caller's traceparent, if any
        span = self.tracer.start_span(SPAN_NAME, context=context, kind=self.kind, start_time=trace.start_ns,
                                      attributes=trace.attributes(model))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the batch processor still holds


class TracingMiddleware:
    """Plain ASGI: opens a RequestTrace for each generation request and records its span once the
    response is complete, if the request reached the engine."""

    def __init__(self, app, tracer: RequestTracer, model: str):
        self.app, self.tracer, self.model = app, tracer, model

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        trace = scope[SCOPE_KEY] = RequestTrace(headers)
        try:
            await self.app(scope, receive, send)
        finally:
            if trace.outputs and not trace.deferred:
                self.tracer.record(trace, self.model, time.time_ns())
