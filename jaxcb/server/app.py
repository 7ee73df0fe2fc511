"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models,
/v1/files and /v1/batches (batch_routes.py), /tokenize, /detokenize, /health, /metrics.

Every request is parsed and checked here (protocol.py) before it reaches the engine; the
engine's refusals come back as 400 (can never fit) or 429 with Retry-After (queue full).
Responses, whole or streamed, are written by streaming.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import re
import time
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxcb import __version__ as jaxcb_version
from jaxcb.config import Config
from jaxcb.engine import Engine
from jaxcb.errors import EngineOverloadedError, InvalidRequestError
from jaxcb.server.dashboard import dashboard_html
from jaxcb.server.async_engine import EngineDeadError, RequestStream
from jaxcb.server.batch_routes import add_batch_routes, checked_query
from jaxcb.server.lora_routes import add_lora_routes
from jaxcb.server.batch_runner import BatchRunner
from jaxcb.server.engine_client import EngineClient, make_engine_client
from jaxcb.server.completions import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    check_model,
    is_request_id,
    compile_grammar,
    plan_body,
    request_deadlines,
    response_body,
)
from jaxcb.server.protocol import APIError, served_model_name, parse_request
from jaxcb.server.request_log import log_received
from jaxcb.server.beam_streams import start_planned_beam_search
from jaxcb.server.requests import PlannedRequest
from jaxcb.server.streaming import chat_events, close_streams, collect_final_outputs, completion_events, sse_response
from jaxcb.request_fields import loads_request
from jaxcb.server.reasoning import get_reasoning_parser
from jaxcb.server.response_store import ResponseStore
from jaxcb.server.responses_output import ResponseWriter
from jaxcb.server.responses_serving import (
    RESPONSES,
    cancel_in_background,
    compile_response_grammar,
    plan_responses_body,
    start_in_background,
    store_response,
)
from jaxcb.server.tokenize import DetokenizeRequest, detokenize, parse_tokenize_request, tokenize
from jaxcb.server.tool_parsers import get_tool_parser
from jaxcb.server.tracing import SCOPE_KEY as TRACE_SCOPE_KEY, RequestTracer, TracingMiddleware
from jaxcb.tokenizer import tools_chat_template

log = logging.getLogger(__name__)


class ServerState:
    """What the handlers share: the engine client (one engine here, or replicas behind a Ray router)."""

    def __init__(self, cfg: Config, engine: Optional[Engine] = None, span_exporter: Any = None, batches: bool = True):
        self.cfg = cfg
        self.model_name = served_model_name(cfg)
        self.shutting_down = False
        self.num_in_flight = 0
        self._tool_parser = None
        self.client: EngineClient = make_engine_client(cfg, self.model_name, engine)
        self.reasoning_parser = get_reasoning_parser(cfg.server.reasoning_parser, self.client.tokenizer.chat_template)
        self.responses = ResponseStore(cfg.server.responses_store_size)
        self.background_responses: dict[str, asyncio.Task] = {}  # background: true, still running (by response id)
        self.background_events: dict[str, Any] = {}  # streamed ones' events (responses_serving.EventLog), while stored
        self.background_starting = 0  # background responses being queued (counted against their cap)
        # /v1/batches' runner, reading server.batch_dir; None for an offline batch file (jaxcb.batch_job)
        self.batches = BatchRunner(self, cfg.server.batch_dir) if batches else None
        # server.otlp_endpoint: one span per request (tracing.py); None: off, nothing of OpenTelemetry imported
        self.tracer = RequestTracer(cfg.server.otlp_endpoint, span_exporter) if cfg.server.otlp_endpoint else None

    def tool_parser(self):
        """server.tool_call_parser for this model's chat template (auto: chosen from the template)."""
        if self._tool_parser is None:
            self._tool_parser = get_tool_parser(self.cfg.server.tool_call_parser,
                                                tools_chat_template(self.client.tokenizer))
        return self._tool_parser


def build_app(cfg: Config, engine: Optional[Engine] = None, span_exporter: Any = None) -> FastAPI:
    """The app over `engine` (built from cfg when not given, or Ray replicas when server.backend=ray);
    the engine loop runs for the app's lifespan. An engine built here gets server.admission_control;
    one passed in keeps the limits it has (call `engine.enable_admission_control()` for the default).
    `span_exporter`: where spans go instead of server.otlp_endpoint's OTLP exporter (tests)."""
    if span_exporter is not None and cfg.server.otlp_endpoint is None:
        raise ValueError("a span_exporter is used only with tracing on: set server.otlp_endpoint")
    state = ServerState(cfg, engine, span_exporter)
    tracer = state.tracer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.client.start()
        state.batches.start()
        yield
        # Graceful shutdown: admit nothing, give in-flight requests their time, abort the rest. Batch
        # lines in flight are aborted at once: their batches resume when the server starts again.
        state.shutting_down = True
        await state.batches.stop()
        deadline = time.monotonic() + cfg.server.shutdown_timeout_s
        while state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        state.client.abort_all("shutdown")
        for task in list(state.background_responses.values()):  # background responses: stored "cancelled"
            task.cancel()
        await asyncio.sleep(0.1)
        state.client.stop()
        if tracer is not None:
            tracer.shutdown()

    app = FastAPI(title="jaxcb", lifespan=lifespan, **_without_framework_telemetry())
    app.state.jaxcb = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, e: InvalidRequestError):
        return JSONResponse(APIError(400, str(e), param=e.field).body(), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):  # a request in flight when the engine loop died
        return JSONResponse(APIError(503, str(e), type="server_error").body(), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    app.add_middleware(GuardMiddleware, api_key=cfg.server.api_key, max_request_bytes=cfg.server.max_request_bytes,
                       max_file_bytes=cfg.server.max_file_bytes)
    app.add_middleware(RequestIdMiddleware)  # (added after the guard: outside it, so that its refusals carry it too)
    if cfg.server.allowed_origins:  # outside the guard too: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.server.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id", "Retry-After"])
    add_batch_routes(app, state, lambda request: _json_body(request, cfg))
    add_lora_routes(app, state, lambda request: _json_body(request, cfg))
    if tracer is not None:
        app.add_middleware(TracingMiddleware, tracer=tracer, model=state.model_name)

    @app.get("/health")
    async def health():
        if not state.client.is_alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(await state.client.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/dashboard")
    async def dashboard():
        return HTMLResponse(dashboard_html(state.model_name))

    @app.get("/dashboard/data")
    async def dashboard_data():
        return {"model": state.model_name, "samples": await state.client.dashboard_samples()}

    @app.get("/ping")
    @app.post("/ping")
    async def ping():  # vLLM's (SageMaker's) liveness probe: /health's answer
        return await health()

    @app.get("/version")
    async def version():
        return {"version": jaxcb_version}

    def served_models() -> list[dict[str, Any]]:
        created = int(time.time())
        base = {"id": state.model_name, "object": "model", "created": created, "owned_by": "jaxcb",
                "root": state.model_name, "parent": None, "max_model_len": state.client.max_model_len}
        # LoRA adapters as vLLM lists them: their own id, the base as parent
        adapters = [dict(base, id=name, root=name, parent=state.model_name) for name in state.client.served_adapters()]
        return [base, *adapters]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": served_models()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):  # OpenAI's retrieve (client.models.retrieve); a name may hold '/'
        if not model:  # /v1/models/ : the list, as /v1/models
            return {"object": "list", "data": served_models()}
        check_model(state, model)
        found = next((m for m in served_models() if m["id"] == model), None)
        if found is None:  # an adapter unloaded between the two looks
            check_model(state, model)
        return found

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request):
        req = parse_tokenize_request(await _json_body(request, cfg))
        if req.model is not None:
            check_model(state, req.model)
        return tokenize(req, state.client.tokenizer, state.tool_parser(), state.client.max_model_len,
                        cfg.server.tool_prompt_fallback)

    @app.post("/detokenize")
    async def detokenize_tokens(request: Request):
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await _json_body(request, cfg))
        if req.model is not None:
            check_model(state, req.model)
        return detokenize(req, state.client.tokenizer)

    async def serve(request: Request, endpoint: str):
        header = request.headers.get("x-request-id")
        if header is not None and not is_request_id(header):  # a gateway's id no response can be named by: ignored
            header = None
        body = plan_body(state, endpoint, await _json_body(request, cfg))
        await compile_grammar(state, body.planned)
        req, (rid, base) = body.req, body.response_id(header)
        log_received(state, rid, endpoint, body.planned, header)
        streams = await _start(state, body.planned)
        streams = _traced(request, streams, body.planned, rid)
        headers = {"X-Request-Id": base}  # the id the response is known by, for the client's logs (vLLM's header)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            if body.is_chat:
                events = chat_events(state, rid, req, streams, include_usage, req.top_logprobs or 0, body.planned.chat)
            else:
                events = completion_events(state, rid, req, streams, include_usage)
            return sse_response(state, streams, events, headers=headers)
        finals = await collect_final_outputs(state, request, streams)
        return JSONResponse(response_body(state, rid, body, finals), headers=headers)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await serve(request, COMPLETIONS)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(request: Request):
        return await serve(request, CHAT_COMPLETIONS)

    @app.post(RESPONSES)
    async def responses(request: Request):
        planned = plan_responses_body(state, await _json_body(request, cfg))
        await compile_response_grammar(state, planned)
        req = planned.req
        writer = ResponseWriter(req, planned.planned.chat, req.model, state.client.tokenizer)
        log_received(state, writer.id, RESPONSES, planned.planned, request.headers.get("x-request-id"))
        if req.background and state.cfg.server.responses_store_size == 0:
            raise APIError(400, "background: a background response is fetched from the response store, which "
                                "server.responses_store_size=0 turns off", param="background")
        if req.background:
            limit = state.cfg.server.responses_store_size  # (a running one is never dropped from the store)
            if len(state.background_responses) + state.background_starting >= limit:
                raise APIError(429, f"{limit} background responses are running, as many as the response store "
                                    f"holds (server.responses_store_size={limit}); retry when one has ended",
                               type="rate_limit_error", headers={"Retry-After": "1"})
            state.background_starting += 1  # its place held while it is queued
            try:
                streams = _traced(request, await _start(state, planned.planned), planned.planned, writer.id)
                events = start_in_background(state, planned, writer, streams, request.scope.get(TRACE_SCOPE_KEY))
            finally:
                state.background_starting -= 1
            if req.stream:  # its events as they come; a client that leaves stops reading, not the response
                return StreamingResponse(events.read(), media_type="text/event-stream")
            return writer.response("queued", [])
        streams = await _start(state, planned.planned)
        streams = _traced(request, streams, planned.planned, writer.id)
        if req.stream:
            return sse_response(state, streams, writer.events(streams, lambda r: store_response(state, planned, r)),
                                writer.error_event, done="")
        [out] = await collect_final_outputs(state, request, streams)
        response = writer.whole(out)
        store_response(state, planned, response)
        return response

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request):
        query = checked_query(request, ("stream", "starting_after"))  # (OpenAI's include[] too: refused by name)
        stored = state.responses.get(response_id)
        stream = query.get("stream", "false")
        if stream not in ("true", "false"):
            raise APIError(400, f"stream={stream!r} must be true or false", param="stream")
        if stream == "false":
            if "starting_after" in query:
                raise APIError(400, "starting_after picks where a stream resumes: give stream=true too",
                               param="starting_after")
            return stored.response
        events = state.background_events.get(response_id)
        if events is None:
            raise APIError(400, f"stream: response {response_id!r} was not created with background and stream, so "
                                "it has no events to stream again (as OpenAI's); GET it without stream", param="stream")
        after = query.get("starting_after", "-1")
        if re.fullmatch(r"-1|0|[1-9][0-9]{0,17}", after) is None:
            raise APIError(400, f"starting_after={after[:40]!r} must be an event's sequence_number (an integer >= 0)",
                           param="starting_after")
        return StreamingResponse(events.read(int(after)), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}/input_items")
    async def unserved_response_route(response_id: str, request: Request):
        raise APIError(404, "GET /v1/responses/{id}/input_items is not served by jaxcb: a response's input is the "
                            "conversation you sent (previous_response_id carries it on)",
                       type="not_found_error", code="unsupported_route")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request):
        checked_query(request, ())
        stored = state.responses.get(response_id)
        if not await cancel_in_background(state, response_id):
            raise APIError(400, f"response {response_id!r} is {stored.response['status']}: only a background "
                                "response still queued or in progress can be cancelled", param="response_id")
        return state.responses.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        state.responses.get(response_id)  # (a 404 first)
        await cancel_in_background(state, response_id)  # a background one still running stops too
        state.responses.delete(response_id)
        state.background_events.pop(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    return app


# --- request handling helpers ------------------------------------------------------------------


class RequestIdMiddleware:
    """A request's X-Request-Id header comes back on its response, whatever the response (an error, a
    /v1/responses answer), unless the handler set the header itself (completions and chat: the id their
    response is named by, which the header gives). And an exception no handler took is logged and answered
    here, as a 500 in OpenAI's error shape (with the header, and CORS's outside), not a bare text 500."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"), None)
        started = False

        async def with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if given is not None and not any(k.lower() == b"x-request-id" for k, _ in message.get("headers", ())):
                    message = dict(message, headers=[*message.get("headers", ()), (b"x-request-id", given)])
            await send(message)

        try:
            await self.app(scope, receive, with_id)
        except Exception as e:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            error = APIError(500, f"the server failed on this request ({type(e).__name__}); it is logged",
                             type="server_error")
            await JSONResponse(error.body(), status_code=500)(scope, receive, with_id)


class GuardMiddleware:
    """API key and body-size checks for /v1/*, as plain ASGI (so that disconnects still reach handlers).
    An upload (POST /v1/files) may be up to max_file_bytes, any other body up to max_request_bytes."""

    def __init__(self, app, api_key: Optional[str], max_request_bytes: int, max_file_bytes: int):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes
        self.max_file_bytes = max_file_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            error = None
            if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
                error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 type="authentication_error")
            length = headers.get("content-length", "")
            upload = scope["path"] == "/v1/files"
            limit, knob = (self.max_file_bytes, "max_file_bytes") if upload else (self.max_request_bytes,
                                                                                  "max_request_bytes")
            if error is None and length.isascii() and length.isdigit() and (len(length) > 18 or int(length) > limit):
                error = APIError(413, f"request body of {length} bytes exceeds server.{knob}={limit}")
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
            if not length:  # a body without Content-Length (chunked): counted as it is read, stopped at the limit
                await self._bounded(scope, receive, send, limit, knob)
                return
        await self.app(scope, receive, send)

    async def _bounded(self, scope, receive, send, limit: int, knob: str) -> None:
        """The app, its body read no further than `limit` bytes (a handler, or the multipart parser spooling to
        disk, would take all of it before its own check): a 413 there, if no response has started."""
        size, started = 0, False

        async def counted():
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    raise _BodyTooLarge
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _BodyTooLarge:
            if started:
                raise
            error = APIError(413, f"request body of more than {limit} bytes exceeds server.{knob}={limit}")
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


class _BodyTooLarge(BaseException):
    """Raised out of a receive past the body limit: a BaseException, so that no handler's `except Exception`
    (the multipart parser's errors) takes it for a bad body."""


async def _json_body(request: Request, cfg: Config) -> Any:
    raw = await request.body()
    if len(raw) > cfg.server.max_request_bytes:
        raise APIError(413, f"request body of {len(raw)} bytes exceeds server.max_request_bytes={cfg.server.max_request_bytes}")
    try:
        return loads_request(raw)
    except InvalidRequestError as e:  # not JSON, NaN, a lone surrogate, ...
        raise APIError(400, f"the request body is not valid: {e}", param=e.field) from None


def _without_framework_telemetry() -> dict[str, Any]:
    """FastAPI(...)'s arguments that turn off its own OpenTelemetry (its releases that have it): the
    server's spans are jaxcb's, one per request, and server.otlp_endpoint alone turns them on."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False,
                          "auto_configure": False}}


def _traced(request: Request, streams: list, planned: PlannedRequest, request_id: str) -> list:
    """The request's streams as its trace sees them (server.otlp_endpoint set), else as they are."""
    trace = request.scope.get(TRACE_SCOPE_KEY)
    if trace is None:
        return streams
    trace.request_id = request_id
    # a beam search's span says what its ranking read: the model's log-probabilities, as at temperature 0
    params = planned.params if planned.beam is None else dataclasses.replace(planned.params, temperature=0.0,
                                                                              top_p=1.0)
    return trace.watch(streams, params)


async def _start(state: ServerState, planned: PlannedRequest) -> list[RequestStream]:
    """Queue every prompt; if one is refused, abort those already queued and answer with the refusal."""
    if state.shutting_down:
        raise APIError(503, "the server is shutting down", type="server_error")
    deadlines = request_deadlines(state, planned.timeout)
    streams: list[RequestStream] = []
    try:
        if planned.beam is not None:
            return await start_planned_beam_search(state.client, planned, deadlines)
        for prompt in planned.prompts:
            streams.append(await state.client.add(prompt, planned.params, priority=planned.priority,
                                                        deadlines=deadlines, cache_salt=planned.cache_salt,
                                                        lora=planned.model))
    except InvalidRequestError as e:
        close_streams(streams)
        state.client.request_rejected("invalid")
        raise planned.refusal(e) from None
    except EngineOverloadedError as e:
        close_streams(streams)
        state.client.request_rejected("overloaded")
        raise APIError(429, str(e), type="rate_limit_error", headers={"Retry-After": str(int(e.retry_after_s))}) from None
    except EngineDeadError as e:
        close_streams(streams)
        raise APIError(503, str(e), type="server_error") from None
    return streams
