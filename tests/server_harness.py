"""A real jaxcb server on a free loopback port, in a background thread, for HTTP tests."""

from __future__ import annotations

import socket
from contextlib import contextmanager

from engine_factory import BASE
from jaxcb.config import compose_config
from jaxcb.engine import Engine
from jaxcb.server.app import build_app
from jaxcb.server.run import serve_app_in_thread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*overrides: str, engine: Engine | None = None, send_buffer_bytes: int | None = None):
    """`send_buffer_bytes` caps the kernel's send buffer of each connection, as a slow network
    does: loopback otherwise buffers megabytes, so a client that stops reading would never
    make the server wait."""
    app = build_app(compose_config(BASE + overrides), engine)
    with serve_app_in_thread(app, send_buffer_bytes=send_buffer_bytes, start_timeout_s=60) as url:
        yield url, app.state.jaxcb


def post_all_at_once(url: str, path: str, bodies: list[dict], timeout: float = 120) -> list:
    """Each body POSTed from its own thread, all at once (a burst); the responses in the bodies' order."""
    import threading

    import httpx

    results: list = [None] * len(bodies)

    def call(i: int) -> None:
        results[i] = httpx.post(url + path, json=bodies[i], timeout=timeout)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
