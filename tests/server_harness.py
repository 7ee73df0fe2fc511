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
def running_server(*overrides: str, engine: Engine | None = None):
    cfg = compose_config(BASE + overrides)
    app = build_app(cfg, engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
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
