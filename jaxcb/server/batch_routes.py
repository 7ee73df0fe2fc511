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

MAX_LIST_LIMIT = 100  # GET /v1/batches: OpenAI's page is 1 to 100 batches, 20 by default
MAX_FILES_LIMIT = 10_000  # GET /v1/files: 1 to 10,000 files, all of them (10,000) by default


class _Download(FileResponse):
    """A file's bytes (Range, ETag and Last-Modified as FileResponse gives them), `done()` called once it has
    ended however it ended: a delete meanwhile removes the bytes only then (FileStore.start_download)."""

    def __init__(self, path: str, done: Callable[[], None], **kwargs):
        super().__init__(path, **kwargs)
        self._done = done

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._done()


def add_batch_routes(app: FastAPI, state: "ServerState", json_body: Callable[[Request], Awaitable[Any]]) -> None:
    """Register the routes; `json_body` reads a request's JSON body as every other endpoint does."""
    runner, srv = state.batches, state.cfg.server

    @app.post("/v1/files")
    async def upload_file(request: Request):
        checked_query(request, ())
        content, filename, purpose = await read_upload(request, srv.max_file_bytes)
        if purpose != "batch":
            raise APIError(400, f"purpose {purpose!r} is not taken: this server keeps files for batches only "
                                "(purpose 'batch')", param="purpose")
        read_batch_lines(content, srv.max_request_bytes)  # a line that could never run is refused now
        return runner.files.create(content, filename, purpose)

    @app.get("/v1/files")
    async def list_files(request: Request):
        query = checked_query(request, ("purpose", "limit", "after", "order"))
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order={order!r} must be 'asc' (oldest first) or 'desc' (newest first)",
                           param="order")
        files = runner.files.list()  # newest first
        files = files[::-1] if order == "asc" else files
        files = _after(files, query.get("after"), "file")
        if "purpose" in query:
            files = [f for f in files if f["purpose"] == query["purpose"]]
        return _page(files, _limit(query.get("limit"), MAX_FILES_LIMIT, MAX_FILES_LIMIT))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str):
        checked_query(request, ())
        return runner.files.get(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str):
        checked_query(request, ())
        path, done = runner.files.start_download(file_id)
        return _Download(path, done, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str):
        checked_query(request, ())
        if runner.uses_file(file_id):
            raise APIError(409, f"file {file_id} is the input of a batch in progress; cancel the batch or wait "
                                "for it to finish", param="file_id")
        runner.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", type="server_error")
        checked_query(request, ())
        return runner.create(parse_batch_create(await json_body(request))).object()

    @app.get("/v1/batches")
    async def list_batches(request: Request):
        query = checked_query(request, ("limit", "after"))
        limit = _limit(query.get("limit"), MAX_LIST_LIMIT, 20)
        batches = _after([b.object() for b in runner.store.newest_first()], query.get("after"), "batch")
        return _page(batches, limit)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str):
        checked_query(request, ())
        return runner.store.get(batch_id).object()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        checked_query(request, ())
        return runner.cancel(batch_id).object()


def checked_query(request: Request, known: tuple[str, ...]) -> dict[str, str]:
    """The query parameters, each one of `known` and given once; an unknown or repeated one is refused by name."""
    for key in request.query_params:
        if key not in known:
            takes = f"known: {', '.join(known)}" if known else "it takes none"
            raise APIError(400, f"{key} is not a query parameter jaxcb takes here ({takes}); remove it", param=key)
        if len(request.query_params.getlist(key)) > 1:
            raise APIError(400, f"{key} is given more than once; give it once", param=key)
    return dict(request.query_params)


def _limit(value: Optional[str], most: int, default: int) -> int:
    if value is None:
        return default  # OpenAI's default page
    if not (value.isascii() and value.isdigit() and len(value) <= 9) or not 1 <= int(value) <= most:
        raise APIError(400, f"limit={value!r} must be a whole number from 1 to {most}", param="limit")
    return int(value)


def _after(objects: list[dict], after: Optional[str], kind: str) -> list[dict]:
    """The objects listed after the one whose id is `after` (OpenAI's cursor), all of them without it."""
    if after is None:
        return objects
    ids = [o["id"] for o in objects]
    if after not in ids:
        raise APIError(400, f"after={after!r} is not a {kind} of this server; give the id of one listed",
                       param="after")
    return objects[ids.index(after) + 1:]


def _page(objects: list[dict], limit: int) -> dict[str, Any]:
    """OpenAI's list object: the first `limit` objects, their first and last ids, and whether more follow."""
    page = objects[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(objects) > limit}
