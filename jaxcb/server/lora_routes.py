"""Loading and unloading LoRA adapters at run time, in vLLM's shape (server.allow_runtime_lora=true):

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}  -> 200 once requests may name it
    POST /v1/unload_lora_adapter  {"lora_name": ...}                    -> 200 once it is gone: new
                                  requests naming it are refused at once, running ones finish first

Both sit under /v1, so server.api_key guards them as every other endpoint. The engine does the work
(`Engine.load_lora_adapter`, `Engine.unload_lora_adapter`, on its own thread); this module only maps
the requests to it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fastapi import FastAPI, Request

from jaxcb.errors import InvalidRequestError
from jaxcb.server.protocol import APIError

if TYPE_CHECKING:
    from jaxcb.server.app import ServerState

UNLOAD_POLL_S = 0.02


def _fields(body: Any, required: tuple[str, ...], allowed: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}; this endpoint takes {', '.join(sorted(allowed))}",
                       param=unknown[0])
    for name in required:
        if not isinstance(body.get(name), str) or not body[name]:
            raise APIError(400, f"{name} is required (a non-empty string)", param=name)
    return body


def add_lora_routes(app: FastAPI, state: "ServerState", json_body: Callable[[Request], Awaitable[Any]]) -> None:
    """Register the two routes, when server.allow_runtime_lora is set (otherwise they are 404s)."""
    if not state.cfg.server.allow_runtime_lora:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = _fields(await json_body(request), ("lora_name", "lora_path"), frozenset({"lora_name", "lora_path"}))
        try:
            await state.client.load_lora_adapter(body["lora_name"], body["lora_path"])
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.field) from None
        return {"object": "lora_adapter", "id": body["lora_name"], "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = _fields(await json_body(request), ("lora_name",), frozenset({"lora_name", "lora_int_id"}))
        if "lora_int_id" in body:
            raise APIError(400, "lora_int_id is not taken: name the adapter with lora_name", param="lora_int_id")
        name = body["lora_name"]
        try:
            gone = await state.client.unload_lora_adapter(name)
        except InvalidRequestError as e:
            raise APIError(404, str(e), param="lora_name", type="not_found_error") from None
        while not gone:  # its running requests finish first
            await asyncio.sleep(UNLOAD_POLL_S)
            gone = name not in await state.client.loaded_adapters()
        return {"object": "lora_adapter", "id": name, "status": "unloaded"}
