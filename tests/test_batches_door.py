"""The door of the Files and Batch APIs: every form field, query parameter and input-file line is
honoured as OpenAI's API does or refused with a 400 naming it, and a batch the engine stopped can
still be cancelled. One server for the module; its batches are a line or two of one token."""

import json
import time

import httpx
import pytest
from openai import OpenAI

from engine_factory import shared_engine
from server_harness import running_server

FINISHED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    batch_dir = tmp_path_factory.mktemp("batches")
    with running_server(f"server.batch_dir={batch_dir}", engine=shared_engine()) as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def line(custom_id, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "x", "max_tokens": 1, "temperature": 0, **body}}


def jsonl(lines, end="\n") -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + end for x in lines).encode()


def upload(http, content: bytes) -> dict:
    r = http.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()


def create(http, file_id: str) -> dict:
    r = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                       "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return r.json()


def wait_until_finished(http, batch_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (batch := http.get(f"/v1/batches/{batch_id}").json())["status"] not in FINISHED:
        assert time.monotonic() < deadline, f"batch still {batch['status']}"
        time.sleep(0.05)
    return batch


def answered(http, batch: dict) -> list[dict]:
    return [json.loads(x) for fid in (batch["output_file_id"], batch["error_file_id"]) if fid
            for x in http.get(f"/v1/files/{fid}/content").text.splitlines()]


def refused(r: httpx.Response, param: str, status: int = 400) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


ONE_LINE = jsonl([line("a")])


@pytest.mark.parametrize("parts, param, named", [
    # Starlette's form keeps every part of a name; reading one dropped the other silently (the last purpose won).
    ([("file", ("a", ONE_LINE)), ("purpose", (None, "fine-tune")), ("purpose", (None, "batch"))], "purpose",
     "purpose is given more than once"),
    ([("file", ("a", ONE_LINE)), ("file", ("b", ONE_LINE)), ("purpose", (None, "batch"))], "file",
     "file is given more than once"),
    ([("file", ("a", ONE_LINE)), ("purpose", (None, "batch")), ("expires_after[anchor]", (None, "created_at"))],
     "expires_after[anchor]", "expires_after[anchor] is not supported: a file is kept until it is deleted"),
    ([("file", ("a", ONE_LINE)), ("purpose", (None, "batch")), ("colour", (None, "blue"))],
     "colour", "colour is not a field jaxcb takes in an upload"),
    ([("purpose", (None, "batch"))], "file", "file is required"),
    ([("file", (None, "text, not a file")), ("purpose", (None, "batch"))], "file", "file is required"),
    ([("file", ("a", ONE_LINE))], "purpose", "purpose is required"),
    ([("file", ("a", ONE_LINE)), ("purpose", ("p.txt", b"batch"))], "purpose", "purpose must be a plain form field"),
    ([("file", ("a", ONE_LINE)), ("purpose", (None, "fine-tune"))], "purpose", "purpose 'fine-tune' is not taken"),
])
def test_an_upload_form_field_repeated_unknown_or_missing_is_refused_naming_it(http, parts, param, named):
    assert named in refused(http.post("/v1/files", files=parts), param)


def test_an_upload_whose_media_type_is_not_lower_case_is_read_as_multipart(http):
    # Before, "Multipart/Form-Data" was refused as not multipart: a media type's case is free.
    request = http.build_request("POST", "/v1/files", files={"file": ("a", ONE_LINE)}, data={"purpose": "batch"})
    content_type = request.headers["content-type"].replace("multipart/form-data", "Multipart/Form-Data")
    r = http.post("/v1/files", content=request.read(), headers={"content-type": content_type})
    assert r.status_code == 200 and r.json()["bytes"] == len(ONE_LINE)


@pytest.mark.parametrize("content, named", [
    (b"", "needs at least one line"),
    (b"\n \r\n\n", "needs at least one line"),
    (b"\xff" + ONE_LINE, "must be UTF-8 JSONL"),
    (jsonl(["[1, 2]"]), "line 1 is not a JSON object"),
    (jsonl([{**line("a"), "custom_id": 7}]), "custom_id must be a non-empty string"),
    (jsonl([line("a"), line("a")]), "custom_id 'a' is used by an earlier line"),
    (jsonl([{**line("a"), "method": "post"}]), "method 'post' must be 'POST'"),
    (jsonl([{**line("a"), "url": "/v1/embeddings"}]), "url '/v1/embeddings' is not an endpoint batches serve"),
    (jsonl([{**line("a"), "body": "prompt"}]), "body must be a JSON object"),
    # JSON keeps the last of a repeated key: one custom_id (or one prompt) was dropped silently.
    (b'{"custom_id": "a", "custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {}}\n',
     "line 1 is not a JSON object a batch takes (it gives the key 'custom_id' more than once"),
    (jsonl([line("a"), '{"custom_id": "b", "method": "POST", "url": "/v1/completions", '
                       '"body": {"prompt": "x", "prompt": "y"}}']), "it gives the key 'prompt' more than once"),
])
def test_an_input_file_that_could_never_run_is_refused_naming_file_and_its_line(http, content, named):
    r = http.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    assert named in refused(r, "file")


def test_crlf_line_ends_and_blank_lines_are_read_as_lines_and_every_custom_id_is_answered_once(http):
    content = b"\xef\xbb\xbf" + jsonl([line("a"), "", "   ", line("b")], end="\r\n")
    batch = wait_until_finished(http, create(http, upload(http, content)["id"])["id"])
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert sorted(r["custom_id"] for r in answered(http, batch)) == ["a", "b"]


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/files"), ("GET", "/v1/files/{file}"), ("GET", "/v1/files/{file}/content"),
    ("DELETE", "/v1/files/{file}"), ("POST", "/v1/batches"), ("GET", "/v1/batches/{batch}"),
    ("POST", "/v1/batches/{batch}/cancel"), ("GET", "/v1/files"), ("GET", "/v1/batches"),
])
def test_a_query_parameter_a_route_does_not_take_is_refused_naming_it(http, method, path):
    # Before, every route but the two lists ignored its query string (POST /v1/files?purpose=... too).
    file_id = upload(http, ONE_LINE)["id"]
    url = path.format(file=file_id, batch="batch_0") + "?colour=blue"
    assert "colour is not a query parameter jaxcb takes here" in refused(http.request(method, url), "colour")
    assert http.get(f"/v1/files/{file_id}").status_code == 200  # nothing was done


@pytest.mark.parametrize("path, query", [("/v1/files", "purpose=batch&purpose=batch_output"),
                                         ("/v1/batches", "limit=1&limit=2"), ("/v1/files", "order=asc&order=desc")])
def test_a_query_parameter_given_twice_is_refused_naming_it(http, path, query):
    name = query.split("=")[0]
    assert f"{name} is given more than once" in refused(http.get(f"{path}?{query}"), name)


def test_files_are_listed_and_paged_with_openais_limit_order_after_and_purpose(http, client):
    # Before, limit, order and after were refused as unknown and the list had no first_id or last_id.
    ids = [upload(http, ONE_LINE)["id"] for _ in range(3)]
    newest = [f["id"] for f in http.get("/v1/files").json()["data"]]
    assert newest[:3] == ids[::-1]
    page = http.get("/v1/files?limit=2").json()
    assert [f["id"] for f in page["data"]] == newest[:2] and page["has_more"]
    assert (page["first_id"], page["last_id"]) == (newest[0], newest[1])
    page = http.get(f"/v1/files?limit=2&after={page['last_id']}").json()
    assert [f["id"] for f in page["data"]] == newest[2:4]
    oldest = http.get("/v1/files?order=asc").json()
    assert [f["id"] for f in oldest["data"]] == newest[::-1] and not oldest["has_more"]
    assert [f["id"] for f in http.get(f"/v1/files?order=asc&after={ids[0]}&limit=1").json()["data"]] == [ids[1]]
    assert all(f["purpose"] == "batch" for f in http.get("/v1/files?purpose=batch").json()["data"])
    assert [f.id for f in client.files.list(limit=1)] == newest  # the client pages with after to the end


@pytest.mark.parametrize("query, param, named", [
    ("limit=0", "limit", "limit='0' must be a whole number from 1 to 10000"),
    ("limit=10001", "limit", "limit='10001' must be a whole number from 1 to 10000"),
    ("order=newest", "order", "order='newest' must be 'asc' (oldest first) or 'desc' (newest first)"),
    ("after=file-nothere", "after", "after='file-nothere' is not a file of this server"),
])
def test_a_files_list_query_out_of_range_is_refused_naming_it(http, query, param, named):
    assert named in refused(http.get(f"/v1/files?{query}"), param)


def test_an_input_file_reads_back_as_uploaded_and_the_output_as_result_lines(http):
    content = jsonl([line("a")], end="\r\n")
    file = upload(http, content)
    assert http.get(f"/v1/files/{file['id']}/content").content == content and file["bytes"] == len(content)
    batch = wait_until_finished(http, create(http, file["id"])["id"])
    [result] = answered(http, batch)
    assert result["custom_id"] == "a" and result["response"]["status_code"] == 200
    assert http.get(f"/v1/files/{batch['output_file_id']}").json()["purpose"] == "batch_output"


def stopped_batch(server, http, monkeypatch, content: bytes) -> tuple[str, dict]:
    """(input file id, batch) of a batch whose lines met a dead engine: it stopped, in progress, with no task."""
    from jaxcb.server import batch_runner
    from jaxcb.server.async_engine import EngineDeadError

    async def dead(*args, **kwargs):
        raise EngineDeadError("the engine loop is not running")

    monkeypatch.setattr(batch_runner, "serve_planned", dead)
    file_id = upload(http, content)["id"]
    batch = create(http, file_id)
    deadline = time.monotonic() + 30
    while batch["id"] in server[1].batches._tasks:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    monkeypatch.undo()
    assert http.get(f"/v1/batches/{batch['id']}").json()["status"] == "in_progress"
    return file_id, batch


def cancel_until_cancelled(http, batch: dict, custom_ids: list[str]) -> None:
    assert http.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] in ("cancelling", "cancelled")
    batch = wait_until_finished(http, batch["id"])
    n = len(custom_ids)
    assert batch["status"] == "cancelled" and batch["request_counts"] == {"total": n, "completed": 0, "failed": n}
    results = answered(http, batch)
    assert sorted(r["custom_id"] for r in results) == sorted(custom_ids)  # each exactly once
    assert all(r["error"]["code"] == "batch_cancelled" for r in results)


def test_a_batch_the_engine_stopped_is_cancelled_with_every_custom_id_answered_once(server, http, monkeypatch):
    # Before, a batch whose lines met a dead engine had no task left: cancelling it left it "cancelling" until a
    # restart. Its input is kept while it is unfinished; once cancelled it can be deleted.
    ids = [f"c{i}" for i in range(5)]
    file_id, batch = stopped_batch(server, http, monkeypatch, jsonl([line(i) for i in ids]))
    assert refused(http.delete(f"/v1/files/{file_id}"), "file_id", 409)
    cancel_until_cancelled(http, batch, ids)
    assert http.delete(f"/v1/files/{file_id}").json()["deleted"] is True
    assert not server[1].client.engine.has_unfinished_requests()


def test_a_batch_is_run_and_finalized_from_its_file_as_taken_whatever_was_refused_since(server, http, monkeypatch):
    # A file taken by a server that allowed a repeated key, or a longer line (a larger server.max_request_bytes),
    # once failed every later reading: the batch stayed in progress, or cancelling, through every restart.
    file_id, batch = stopped_batch(server, http, monkeypatch, jsonl([line("t0"), line("t1")]))
    as_taken = jsonl([line("t0"), '{"custom_id": "t1", "method": "POST", "url": "/v1/completions", '
                                  '"body": {"prompt": "x", "prompt": "' + "y" * (1 << 20) + '"}}'])
    server[1].batches.files.create(as_taken, "in.jsonl", "batch", file_id)
    cancel_until_cancelled(http, batch, ["t0", "t1"])


def test_a_file_deleted_while_it_downloads_still_downloads_whole(tmp_path, http):
    """The content is read from the file opened before the response starts: a delete in between (the bytes'
    name goes) neither cuts the download nor turns it into a 500; a delete before it is a 404."""
    from jaxcb.server.files import FileStore

    store = FileStore(str(tmp_path))
    obj = store.create(b"x" * 10, "in.jsonl", "batch")
    path, done = store.start_download(obj["id"])
    store.delete(obj["id"])  # unlisted at once; its bytes stay for the download in progress, then go
    with pytest.raises(Exception, match="no file with id"):
        store.start_download(obj["id"])
    with open(path, "rb") as f:
        assert f.read() == b"x" * 10
    done()
    assert not (tmp_path / obj["id"]).exists()
    content = jsonl([line(str(i), prompt="y" * 200) for i in range(6000)])  # > 1 MiB: several blocks
    file = upload(http, content)
    with http.stream("GET", f"/v1/files/{file['id']}/content") as r:
        assert r.status_code == 200 and int(r.headers["content-length"]) == len(content)
        assert http.delete(f"/v1/files/{file['id']}").json()["deleted"]
        assert r.read() == content
    assert http.get(f"/v1/files/{file['id']}/content").status_code == 404
    kept = upload(http, content)  # and a download resumes where it stopped: Range, as OpenAI's Files API serves
    part = http.get(f"/v1/files/{kept['id']}/content", headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == content[10:20] and "etag" in part.headers
