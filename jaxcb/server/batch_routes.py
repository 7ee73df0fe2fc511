"""The HTTP face of OpenAI's Files and Batch APIs: `/v1/files` (upload, list, retrieve, content,
delete) and `/v1/batches` (create, list, retrieve, cancel). Checking and running batches is
batches.py's and batch_runner.py's; this module only maps requests to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from jaxcb.server.batches import parse_batch_create, read_batch_lines
from jaxcb.server.files import read_upload
from jaxcb.server.protocol import APIError

if TYPE_CHECKING:
    from jaxcb.server.app import ServerState

MAX_LIST_LIMIT = 100


def add_batch_routes(app: FastAPI, state: "ServerState", json_body: Callable[[Request], Awaitable[Any]]) -> None:
    """Register the routes; `json_body` reads a request's JSON body as every other endpoint does."""
    runner, srv = state.batches, state.cfg.server

    @app.post("/v1/files")
    async def upload_file(request: Request):
        content, filename, purpose = await read_upload(request, srv.max_file_bytes)
        if purpose != "batch":
            raise APIError(400, f"purpose {purpose!r} is not taken: this server keeps files for batches only "
                                "(purpose 'batch')", param="purpose")
        read_batch_lines(content, srv.max_request_bytes)  # a line that could never run is refused now
        return runner.files.create(content, filename, purpose)

    @app.get("/v1/files")
    async def list_files(request: Request):
        purpose = _query(request, ("purpose",)).get("purpose")
        return {"object": "list", "data": runner.files.list(purpose), "has_more": False}

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str):
        return runner.files.get(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        return FileResponse(runner.files.content_path(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        if runner.uses_file(file_id):
            raise APIError(409, f"file {file_id} is the input of a batch in progress; cancel the batch or wait "
                                "for it to finish", param="file_id")
        runner.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", type="server_error")
        return runner.create(parse_batch_create(await json_body(request))).object()

    @app.get("/v1/batches")
    async def list_batches(request: Request):
        query = _query(request, ("limit", "after"))
        limit = _limit(query.get("limit"))
        batches = runner.store.newest_first()
        if "after" in query:
            ids = [b.id for b in batches]
            if query["after"] not in ids:
                raise APIError(400, f"after={query['after']!r} is not a batch of this server", param="after")
            batches = batches[ids.index(query["after"]) + 1:]
        page = [b.object() for b in batches[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit}

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str):
        return runner.store.get(batch_id).object()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        return runner.cancel(batch_id).object()


def _query(request: Request, known: tuple[str, ...]) -> dict[str, str]:
    """The query parameters, each one of `known`; an unknown one is refused by name."""
    for key in request.query_params:
        if key not in known:
            raise APIError(400, f"{key} is not a query parameter jaxcb takes here (known: {', '.join(known)})",
                           param=key)
    return dict(request.query_params)


def _limit(value: Optional[str]) -> int:
    if value is None:
        return 20  # OpenAI's default page
    if not (value.isascii() and value.isdigit() and len(value) <= 9) or not 1 <= int(value) <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit={value!r} must be a whole number from 1 to {MAX_LIST_LIMIT}", param="limit")
    return int(value)
