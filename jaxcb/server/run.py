"""Run the app with uvicorn until SIGTERM/SIGINT, then shut down gracefully and exit 0."""

from __future__ import annotations

import contextlib
import logging
import signal

import uvicorn

from jaxcb.config import Config
from jaxcb.server.app import build_app

log = logging.getLogger(__name__)


class _GracefulServer(uvicorn.Server):
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


def serve(cfg: Config) -> None:
    app = build_app(cfg)
    log.info("serving %s on http://%s:%d", app.state.jaxcb.model_name, cfg.server.host, cfg.server.port)
    config = uvicorn.Config(
        app,
        host=cfg.server.host,
        port=cfg.server.port,
        log_level="info",
        timeout_graceful_shutdown=int(cfg.server.shutdown_timeout_s) + 1,
    )
    _GracefulServer(config).run()
