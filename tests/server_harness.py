"""A real jaxcb server on a free loopback port, in a background thread, for HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from engine_factory import BASE
from jaxcb.config import compose_config
from jaxcb.engine import Engine
from jaxcb.server.app import build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*overrides: str, engine: Engine | None = None, send_buffer_bytes: int | None = None):
    """`send_buffer_bytes` caps the kernel's send buffer of each connection, as a slow network
    does: loopback otherwise buffers megabytes, so a client that stops reading would never
    make the server wait."""
    cfg = compose_config(BASE + overrides)
    app = build_app(cfg, engine)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:  # accepted connections inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app.state.jaxcb
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()
