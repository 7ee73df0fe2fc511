"""`EngineClient`: all the server asks of an engine, whether the engine runs in this process or as
replicas behind a Ray router -- and all a job needs to run over a serving engine.

Two implementations, built by one factory (`make_engine_client`): `LocalEngineClient` (one
`Engine` in its own thread, its metrics and dashboard history, wired here once; each Ray replica
uses one too) and `jaxcb.distributed.ray_server.ReplicaRouter`. The server holds only a client
and never reaches into an engine. No jax of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Optional, Protocol, runtime_checkable

from jaxcb.config import Config
from jaxcb.engine import Engine
from jaxcb.prompts import PromptType
from jaxcb.metrics import EngineMetrics
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_defaults import SamplingDefaults
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.async_engine import AsyncEngine
from jaxcb.server.dashboard import DashboardHistory
from jaxcb.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxcb.structured import GrammarCompiler


class OutputStream(Protocol):
    """One queued request's outputs (deltas) as they come; `close` aborts it if it is unfinished."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Tokenizer
    max_model_len: int
    sampling_defaults: SamplingDefaults  # the model's, for the sampling fields a request leaves out
    max_num_seqs: int  # sequences the engines run at once, all replicas together (how much batch work keeps them busy)
    max_n: int  # server.max_n: the most completions, or beams, one request asks for
    # Compiles a request's grammar off the engine thread before it is queued (cached for the engine);
    # None where the engines compile their own (Ray replicas).
    grammars: Optional["GrammarCompiler"]

    def start(self) -> None:
        """Start serving; called inside the running asyncio loop."""

    def stop(self, timeout: float = 10.0) -> None: ...

    @property
    def is_alive(self) -> bool: ...

    async def add(self, prompt: PromptType, params: SamplingParams, *, request_id: Optional[str] = None,
                  priority: int = 0, deadlines: Optional[dict[str, float]] = None,
                  cache_salt: Optional[str] = None, background: bool = False, lora: Optional[str] = None
                  ) -> OutputStream:
        """Queue a request; the engine's refusal (InvalidRequestError, EngineOverloadedError) is raised here.
        `deadlines`: Engine.add_request's timeout_s / queue_timeout_s; `background`: batch work, which
        yields to every other request (Engine.add_request); `lora`: the body's `model` (base or adapter)."""

    def served_adapters(self) -> list[str]:
        """The LoRA adapters requests may name in `model` (/v1/models lists them)."""

    def abort_all(self, reason: str) -> None: ...

    def request_rejected(self, reason: str) -> None:
        """Count a request refused before it was queued ("invalid", "overloaded")."""

    async def render_metrics(self) -> bytes:
        """The Prometheus text of /metrics."""

    async def dashboard_samples(self) -> list[dict]: ...


class LocalEngineClient:
    """One Engine in this process, stepped in its own thread, with its metrics and dashboard history."""

    def __init__(self, cfg: Config, model_name: str, engine: Optional[Engine] = None,
                 extra_labels: Optional[dict[str, str]] = None):
        if engine is None:
            engine = Engine(cfg, progress=False)
            if cfg.server.admission_control:
                engine.enable_admission_control()
        self.engine = engine
        self.tokenizer, self.max_model_len, self.grammars = engine.tokenizer, engine.max_model_len, engine.grammars
        self.sampling_defaults = engine.sampling_defaults
        self.max_num_seqs: int = engine.scheduler_config.max_num_seqs
        self.max_n: int = engine.limits.max_n
        self.metrics = EngineMetrics(model_name, extra_labels=extra_labels, prefix=cfg.server.metrics_prefix)
        self.history = DashboardHistory()
        self.async_engine = AsyncEngine(
            engine,
            on_step=self._on_step,
            on_abort=lambda rid, reason: self.metrics.request_aborted(rid),
            stream_buffer_tokens=cfg.server.stream_buffer_tokens,
            stream_stall_timeout_s=cfg.server.stream_stall_timeout_s,
        )

    def _on_step(self, stats, outputs, step_seconds) -> None:
        self.metrics.on_step(stats, outputs, step_seconds)
        self.history.on_step(stats, outputs, step_seconds)

    def start(self) -> None:
        self.async_engine.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.async_engine.stop(timeout)

    @property
    def is_alive(self) -> bool:
        return self.async_engine.is_alive

    async def add(self, prompt: PromptType, params: SamplingParams, *, request_id: Optional[str] = None,
                  priority: int = 0, deadlines: Optional[dict[str, float]] = None,
                  cache_salt: Optional[str] = None, background: bool = False, lora: Optional[str] = None
                  ) -> OutputStream:
        return await self.async_engine.add(prompt, params, request_id=request_id, priority=priority,
                                           deadlines=deadlines, cache_salt=cache_salt, background=background,
                                           lora=lora)

    def served_adapters(self) -> list[str]:
        return self.engine.lora.served() if self.engine.lora is not None else []

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self.async_engine.run_in_engine_thread(self.engine.load_lora_adapter, name, path)

    async def unload_lora_adapter(self, name: str) -> bool:
        """True when it is gone at once; else it goes when its running requests finish."""
        return await self.async_engine.run_in_engine_thread(self.engine.unload_lora_adapter, name)

    async def loaded_adapters(self) -> list[str]:
        return await self.async_engine.run_in_engine_thread(lambda: list(self.engine.lora.adapters))

    def abort_all(self, reason: str) -> None:
        self.async_engine.abort_all(reason)

    def request_rejected(self, reason: str) -> None:
        self.metrics.request_rejected(reason)

    async def render_metrics(self) -> bytes:
        return self.metrics.render()

    async def dashboard_samples(self) -> list[dict]:
        return self.history.snapshot()


def make_engine_client(cfg: Config, model_name: str, engine: Optional[Engine] = None) -> EngineClient:
    """server.backend=local: `engine` (built from cfg when not given) in this process; ray: replicas."""
    if cfg.server.backend == "ray":
        if engine is not None:
            raise ValueError("server.backend=ray builds its engines on the replicas; pass no engine")
        from jaxcb.distributed.ray_server import ReplicaRouter

        return ReplicaRouter(cfg, model_name)
    return LocalEngineClient(cfg, model_name, engine)
