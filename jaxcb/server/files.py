"""The files of /v1/files: uploads (a batch's input) and the files a batch writes (its output and
errors), kept on disk under `server.batch_dir`/files so that they outlive the server.

Each file is two entries: `<id>` (the bytes) and `<id>.json` (OpenAI's file object). Both are
written to a temporary name and renamed into place, object last: a file is listed only once its
bytes are whole, and a crash leaves no half-written file behind. What a file must hold (a batch's
lines) is checked by its user (batches.py), not here. No jax.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from jaxcb.server.protocol import APIError

if TYPE_CHECKING:
    from fastapi import Request

_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,64}$")


def write_atomically(path: str, chunks: Iterable[bytes]) -> None:
    """`path` holds all of `chunks` or is left as it was: written beside it, synced, renamed over it."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomically(path: str, data: Any) -> None:
    write_atomically(path, [json.dumps(data, ensure_ascii=False).encode("utf-8")])


def sortable_id(prefix: str) -> str:
    """A new id whose order is the order of creation (created_at has only seconds): time, then randomness."""
    return f"{prefix}{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


class FileStore:
    """Files by id, on disk in `folder` (made on the first upload)."""

    def __init__(self, folder: str):
        self.folder = folder
        self._reading: dict[str, int] = {}  # downloads in progress, by file id
        self._deleted_while_read: set[str] = set()  # deleted, their bytes kept until their last download ends

    def _path(self, file_id: str) -> str:
        if not _ID.match(file_id):  # never a path outside the folder
            raise self._not_found(file_id)
        return os.path.join(self.folder, file_id)

    @staticmethod
    def _not_found(file_id: str, param: str = "file_id") -> APIError:
        return APIError(404, f"no file with id {file_id!r}", param=param, type="not_found_error")

    def create(self, content: bytes, filename: str, purpose: str, file_id: Optional[str] = None) -> dict:
        """Store `content`; return its file object. `file_id`: the id to store it under (a batch's
        output, named before it is written), else a new one."""
        file_id = file_id or sortable_id("file-")
        path = self._path(file_id)
        os.makedirs(self.folder, exist_ok=True)
        write_atomically(path, [content])
        obj = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "status_details": None}
        write_json_atomically(path + ".json", obj)
        return obj

    def get(self, file_id: str, param: str = "file_id") -> dict:
        """The file object; 404 naming `param` if there is no such file."""
        try:
            with open(self._path(file_id) + ".json", encoding="utf-8") as f:
                return json.load(f)
        except (FileNotFoundError, APIError):
            raise self._not_found(file_id, param) from None

    def exists(self, file_id: str) -> bool:
        return bool(_ID.match(file_id)) and os.path.exists(os.path.join(self.folder, file_id + ".json"))

    def start_download(self, file_id: str) -> tuple[str, Callable[[], None]]:
        """(the path of the file's bytes, `done`, to call once when its download has ended): a delete meanwhile
        unlists the file at once and removes its bytes after the last download (never cut short, never a
        500); one before is the same 404 as an unknown id."""
        self.get(file_id)
        self._reading[file_id] = self._reading.get(file_id, 0) + 1

        def done() -> None:
            self._reading[file_id] -= 1
            if not self._reading[file_id]:
                del self._reading[file_id]
                if file_id in self._deleted_while_read:
                    self._deleted_while_read.discard(file_id)
                    os.remove(self._path(file_id))

        return self._path(file_id), done

    def read(self, file_id: str, param: str = "file_id") -> bytes:
        self.get(file_id, param)
        with open(self._path(file_id), "rb") as f:
            return f.read()

    def list(self, purpose: Optional[str] = None) -> list[dict]:
        """Every file object (of `purpose`, if given), newest first."""
        objects = []
        for name in os.listdir(self.folder) if os.path.isdir(self.folder) else ():
            if name.endswith(".json") and _ID.match(name[: -len(".json")]):
                obj = self.get(name[: -len(".json")])
                if purpose is None or obj["purpose"] == purpose:
                    objects.append(obj)
        return sorted(objects, key=lambda o: (o["created_at"], o["id"]), reverse=True)  # ids sort by creation

    def delete(self, file_id: str) -> None:
        path = self._path(file_id)
        self.get(file_id)
        os.remove(path + ".json")  # unlisted first: a crash in between leaves bytes no one sees, never a broken file
        if self._reading.get(file_id):
            self._deleted_while_read.add(file_id)  # (removed when its downloads end)
        else:
            os.remove(path)


UPLOAD_FIELDS = ("file", "purpose")


async def read_upload(request: "Request", max_bytes: int) -> tuple[bytes, str, str]:
    """(content, filename, purpose) of a multipart `POST /v1/files`, as OpenAI's clients send it; a 400
    naming what is missing or not taken, a 413 past `max_bytes` (server.max_file_bytes)."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):  # any case, as RFC 9110
        raise APIError(400, "POST /v1/files takes multipart/form-data with the fields file and purpose")
    try:
        form = await request.form(max_files=2, max_fields=16)  # more than it takes: the extra one is named below
    except Exception as e:  # the multipart parser's errors: too many parts, a malformed body
        reason = getattr(e, "detail", e)  # an HTTPException's detail, without its status
        raise APIError(400, f"the upload is not a form of the fields file and purpose: {reason}") from None
    try:
        seen = set()
        for key, _ in form.multi_items():
            if key.startswith("expires_after"):  # OpenAI's expires_after[anchor] and expires_after[seconds]
                raise APIError(400, f"{key} is not supported: a file is kept until it is deleted; remove it",
                               param=key)
            if key not in UPLOAD_FIELDS:
                raise APIError(400, f"{key} is not a field jaxcb takes in an upload; remove it (known: "
                                    f"{', '.join(UPLOAD_FIELDS)})", param=key)
            if key in seen:  # a form keeps every part of a name; reading one would drop the others silently
                raise APIError(400, f"{key} is given more than once; an upload is one file with one purpose",
                               param=key)
            seen.add(key)
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "file is required: the file's content, as a form file", param="file")
        if purpose is None:
            raise APIError(400, "purpose is required ('batch')", param="purpose")
        if not isinstance(purpose, str):
            raise APIError(400, "purpose must be a plain form field ('batch'), not a file", param="purpose")
        content = await upload.read(max_bytes + 1)
        if len(content) > max_bytes:
            raise APIError(413, f"the file is larger than server.max_file_bytes={max_bytes}", param="file")
        return content, upload.filename or "upload.jsonl", purpose
    finally:
        await form.close()
