"""Run the app with uvicorn until SIGTERM/SIGINT, then shut down gracefully and exit 0 (or, with
server.exit_on_engine_death, exit 1 once the engine is dead)."""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import threading
import time
from typing import Callable, Iterator, Optional

import uvicorn

from fastapi import FastAPI

from jaxcb.config import Config, ConfigError
from jaxcb.server.app import build_app

log = logging.getLogger(__name__)


class _GracefulServer(uvicorn.Server):
    ready_line = ""  # logged once serving: uvicorn logs its own "running on" line only for sockets it binds

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.ready_line:
            log.info("%s (ready)", self.ready_line)

    @contextlib.contextmanager
    def capture_signals(self):
        """Stop serving on SIGTERM/SIGINT. uvicorn's own handler re-raises the signal after shutting
        down, so the process would die of it; a clean shutdown here exits 0."""

        def handle(signum, frame):
            log.info("received signal %d: shutting down", signum)
            self.should_exit = True

        previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, one per address server.host resolves to (a name such as localhost may give IPv6's
    and IPv4's), bound and listening on server.port before anything is loaded or compiled (as vLLM binds
    first): a port in use or a host that is not this machine's is said at once, in a sentence, not after
    minutes of start-up, and a second server started on the port at the same moment fails too. A client
    that connects while the model loads waits in the backlog. ConfigError naming the knob otherwise."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"server.host={host!r} does not resolve ({e.strerror}): give an address of this machine "
                          "(127.0.0.1 for this machine only, 0.0.0.0 for every interface) or a name that resolves "
                          "to one") from None
    listeners: list[socket.socket] = []
    for family, kind, proto, _, address in dict.fromkeys((f, k, p, "", a) for f, k, p, _, a in found):
        listener = socket.socket(family, kind, proto)
        listeners.append(listener)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port this server just left: TIME_WAIT
            if family == socket.AF_INET6:  # IPv6 only, as asyncio binds it: IPv4's address is a socket of its own
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen(2048)
        except OSError as e:
            for opened in listeners:
                opened.close()
            raise _bind_error(e, host, port) from None
    return listeners


def _bind_error(e: OSError, host: str, port: int) -> ConfigError:
    if e.errno == errno.EADDRINUSE:
        return ConfigError(f"server.port={port} on server.host={host!r} is in use by another process: stop it or "
                           "give another server.port")
    if e.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"server.host={host!r} is not an address of this machine: give one of its addresses "
                           "(127.0.0.1, 0.0.0.0 for every interface)")
    if e.errno == errno.EACCES:
        return ConfigError(f"server.port={port} needs privileges to bind on this machine: give a port from 1024 up")
    return ConfigError(f"server.host={host!r}, server.port={port}: cannot bind ({e.strerror})")


def serve(cfg: Config) -> None:
    """Serve until SIGTERM/SIGINT (exit 0) or, with server.exit_on_engine_death, until the engine dies (exit 1)."""
    listeners = bind_listeners(cfg.server.host, cfg.server.port)
    app = build_app(cfg)
    config = uvicorn.Config(
        app,
        host=cfg.server.host,
        port=cfg.server.port,
        log_level="info",
        timeout_graceful_shutdown=int(cfg.server.shutdown_timeout_s) + 1,
    )
    server = _GracefulServer(config)
    host = f"[{cfg.server.host}]" if ":" in cfg.server.host else cfg.server.host
    server.ready_line = f"serving {app.state.jaxcb.model_name} on http://{host}:{cfg.server.port}"
    died = threading.Event()
    if cfg.server.exit_on_engine_death:
        # Ray restarts a replica that dies (minutes, to load the model): the router is dead only when none comes
        # back within the start-up time a replica has.
        grace_s = cfg.ray.replica_start_timeout_s if cfg.server.backend == "ray" else 0.0
        watch_engine(server, lambda: app.state.jaxcb.client.is_alive, died, grace_s=grace_s)
    server.run(sockets=listeners)
    if died.is_set():
        raise SystemExit(1)


def watch_engine(server: uvicorn.Server, is_alive: Callable[[], bool], died: threading.Event,
                 interval_s: float = 1.0, grace_s: float = 0.0) -> threading.Thread:
    """Stop `server` once its engine has been dead for `grace_s`, counted from when the server has started
    (its lifespan starts the engine), setting `died`: a supervisor restarts the process, where a server left
    up would answer every request with a 503."""
    def watch() -> None:
        dead_since: Optional[float] = None
        while not server.should_exit:
            if server.started and not is_alive():
                dead_since = time.monotonic() if dead_since is None else dead_since
                if time.monotonic() - dead_since >= grace_s and not server.should_exit:  # (not a SIGTERM's stop)
                    log.error("the engine loop stopped (its error is logged above): shutting the server down to "
                              "exit 1 (server.exit_on_engine_death=false keeps it up, answering 503)")
                    died.set()
                    server.should_exit = True
                    return
            else:
                dead_since = None
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, daemon=True, name="jaxcb-engine-watch")
    thread.start()
    return thread


@contextlib.contextmanager
def serve_app_in_thread(
    app: FastAPI, *, send_buffer_bytes: Optional[int] = None, start_timeout_s: float = 600.0
) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port in a background thread; yields its URL.

    For benchmarks and tests that drive the real HTTP path from the same process.
    `send_buffer_bytes` caps each connection's kernel send buffer (accepted sockets inherit
    the listener's), as a slow network does: loopback otherwise buffers megabytes.
    """
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        listener.close()
