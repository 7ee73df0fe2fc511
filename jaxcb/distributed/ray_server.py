"""One OpenAI endpoint in front of several engine replicas on Ray (server.backend=ray).

    HTTP handlers (app.py) ──> ReplicaRouter ──┬──> EngineReplica 0 (Ray actor: a LocalEngineClient)   
                                               └──> EngineReplica 1 ...

`ReplicaRouter` is an `EngineClient` (jaxcb.server.engine_client), as the in-process
`LocalEngineClient` is, so the handlers do not know where the engines run. Each replica is
an async Ray actor holding a `LocalEngineClient` (the same engine thread, metrics and
dashboard as a local server); a request is one call of its `generate`, a Ray streaming
generator that yields the request's outputs.

- Routing (routing.py, server.routing): by default each request goes to the live replica with
  the fewest waiting tokens, as the router counts them: for every request it sent there and
  that has not finished, its prompt tokens until the first output, plus the output tokens it
  may still make (n x max_tokens minus those made). Counting in the router costs no call and
  is never stale. `prefix_aware` prefers the replica whose recent prompts share the longest
  prefix of blocks with the request, within an imbalance bound; a replica found down or
  restarted (a new `instance_id`) has its prefix index dropped.
- Abort: closing a stream (client gone, stalled reader, shutdown) cancels the generator
  with `ray.cancel`; the cancellation reaches the replica's coroutine, whose `finally`
  aborts the request in its engine and frees its blocks.
- Health: a replica is live while it answers a load query each POLL_S; /health is 200
  while at least one replica is live (requests go only to live replicas). A replica that
  dies is restarted by Ray (`ray.max_replica_restarts`); its in-flight requests end with
  an error (503), new ones go to the others meanwhile.
- Metrics: each replica keeps its own Prometheus metrics labelled `replica="i"`; /metrics
  fetches and merges them, with the router's own figures (`jaxcb:replica_up`,
  `jaxcb:router_waiting_tokens`, `jaxcb:router_requests`, `jaxcb:router_route_decisions`,
  `jaxcb:router_matched_prefix_tokens`) and rejections.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from jaxcb.config import Config
from jaxcb.distributed.ray_cluster import check_room, connect, import_ray, replica_options, wait_until_ready
from jaxcb.distributed.replica_metrics import QUERY_TIMEOUT_S, ReplicaDashboard, RouterMetrics, await_ref
from jaxcb.distributed.routing import make_chooser
from jaxcb.prompts import PromptType, prompt_text_and_ids, truncated_ids
from jaxcb.errors import InvalidRequestError
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.async_engine import EngineDeadError, StreamAbortedError
from jaxcb.sampling_defaults import SamplingDefaults
from jaxcb.tokenizer import Tokenizer

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often each replica's liveness (and the slow-reader check) is refreshed


class EngineReplica:
    """One engine and its loop thread, in an async Ray actor; every method runs on the actor's event loop."""

    def __init__(self, cfg: Config, index: int, model_name: str):
        from jaxcb.server.engine_client import LocalEngineClient

        self.index = index
        self.instance_id = uuid.uuid4().hex  # new on every (re)start: the router drops its guess of our cache
        # The same engine thread, metrics and dashboard wiring as a local server's.
        self.client = LocalEngineClient(cfg, model_name, extra_labels={"replica": str(index)})
        self.engine = self.client.engine
        self.client.start()

    async def ready(self) -> dict:
        """What the front end needs to parse and check requests as the engine would."""
        engine = self.engine
        return {
            "tokenizer": engine.tokenizer, "max_model_len": engine.max_model_len, "pid": os.getpid(),
            "sampling_defaults": engine.sampling_defaults,
            "instance_id": self.instance_id, "max_num_seqs": engine.scheduler_config.max_num_seqs,
            # What the router's prefix index hashes prompts with (routing=prefix_aware).
            "block_size": engine.cache_plan.block_size, "num_blocks": engine.cache_plan.num_blocks,
            "prefix_cache_root": getattr(engine, "prefix_cache_root", None),  # None: an engine without stable hashes
        }

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
                       deadlines: Optional[dict[str, float]] = None, cache_salt: Optional[str] = None,
                       background: bool = False):
        """Streams None once the request is queued (or raises the engine's refusal), then its outputs."""
        stream = await self.client.add(prompt, params, request_id=request_id, priority=priority,
                                       deadlines=deadlines, cache_salt=cache_salt, background=background)
        try:
            yield None
            async for out in stream:
                yield out
        finally:  # finished, failed, or cancelled by the router: an unfinished request is aborted here
            stream.close()

    async def load(self) -> dict:
        stats = self.engine.last_stats  # the last step's snapshot, read from the router's thread
        return {"alive": self.client.is_alive, "running": stats.num_running, "waiting": stats.num_waiting,
                "instance_id": self.instance_id}

    async def metric_families(self) -> list:
        return list(self.client.metrics.registry.collect())

    async def dashboard_samples(self) -> list[dict]:
        return await self.client.dashboard_samples()


@dataclass
class RoutedReplica:
    index: int
    actor: Any
    alive: bool = True
    instance_id: Optional[str] = None  # EngineReplica.instance_id last seen: another one means it restarted
    waiting_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens still to compute
    num_served: int = 0  # requests sent here since start-up

    @property
    def load(self) -> int:
        return sum(self.waiting_tokens.values())


class RemoteRequestStream:
    """The outputs of one request on a replica; the same face as async_engine.RequestStream."""

    def __init__(self, router: "ReplicaRouter", replica: RoutedReplica, request_id: str, generator, cost: "_Cost"):
        self.router, self.replica, self.request_id = router, replica, request_id
        self._generator, self._cost = generator, cost
        self.finished = False
        self.aborted = False
        self.reading = False  # awaiting the next output now (a reader that is not is checked for stalling)
        self.last_read = time.monotonic()
        self._abort_reason: Optional[str] = None  # why the request was aborted here: client, shutdown, slow_reader

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            if self._abort_reason not in (None, "client"):  # the server ended it: tell the reader, as AsyncEngine does
                raise StreamAbortedError(f"request aborted: {self._abort_reason}")
            raise StopAsyncIteration
        ray = self.router.ray
        self.reading = True
        try:
            out = await (await self._generator.__anext__())
        except StopAsyncIteration:  # the replica ended the stream without a final output
            self._end(aborted=True)
            raise StreamAbortedError(f"replica {self.replica.index} ended the request early") from None
        except ray.exceptions.RayTaskError as e:
            if self._abort_reason is not None:  # cancelled by close() or abort() while this read waited
                raise StreamAbortedError(f"request aborted: {self._abort_reason}") from None
            self._end(aborted=True)
            cause = e.cause
            if isinstance(cause, (StreamAbortedError, EngineDeadError)):
                raise cause from None
            raise StreamAbortedError(f"replica {self.replica.index} failed: {cause!r}") from None
        except ray.exceptions.RayActorError:
            self._end(aborted=True)
            self.router.mark_down(self.replica)
            raise StreamAbortedError(f"replica {self.replica.index} died while serving the request") from None
        finally:
            self.reading = False
            self.last_read = time.monotonic()
        self.finished = out.finished
        if self.finished:
            self._end(aborted=False)
        else:
            self.replica.waiting_tokens[self.request_id] = self._cost.remaining(out)
        return out

    def close(self) -> None:
        """Abort the request on its replica unless it finished (what a reader that leaves calls)."""
        self.abort("client")

    def abort(self, reason: str) -> None:
        """Cancel the replica's generator; the cancellation reaches its coroutine, which aborts the request."""
        if not self.finished:
            self._abort_reason = reason
            self.router.ray.cancel(self._generator)
            self._end(aborted=True)

    def _end(self, aborted: bool) -> None:
        self.finished = True
        self.aborted = self.aborted or aborted
        self.replica.waiting_tokens.pop(self.request_id, None)
        self.router.streams.pop(self.request_id, None)


@dataclass
class _Cost:
    """Tokens a request makes its replica compute: prompt (until the first output) + outputs still to come."""

    prompt_tokens: int
    max_output_tokens: int  # n x max_tokens

    @property
    def initial(self) -> int:
        return self.prompt_tokens + self.max_output_tokens

    def remaining(self, out: RequestOutput) -> int:
        return max(0, self.max_output_tokens - sum(c.num_generated for c in out.outputs))


class ReplicaRouter:
    """N engine replicas on Ray behind one EngineClient; see the module docstring."""

    def __init__(self, cfg: Config, model_name: str):
        self.cfg = cfg
        self.model_name = model_name
        self.ray = ray = import_ray()
        self._owns_connection = connect(cfg.ray)
        self._poller: Optional[asyncio.Task] = None
        self._stopped = False
        self.replicas: list[RoutedReplica] = []
        replica_class = ray.remote(EngineReplica).options(
            **replica_options(cfg.ray, max_restarts=cfg.ray.max_replica_restarts), max_concurrency=10_000
        )
        try:
            check_room(cfg.ray, cfg.server.num_replicas, "server")
            self.replicas = [RoutedReplica(i, replica_class.remote(cfg, i, model_name))
                             for i in range(cfg.server.num_replicas)]
            infos = wait_until_ready(ray, [r.actor.ready.remote() for r in self.replicas], cfg.ray)
        except BaseException:
            self.stop()
            raise
        log.info("engine replicas up, process ids %s", [info["pid"] for info in infos])
        self.tokenizer: Tokenizer = infos[0]["tokenizer"]
        self.max_model_len: int = infos[0]["max_model_len"]
        self.sampling_defaults: SamplingDefaults = infos[0]["sampling_defaults"]
        self.max_num_seqs: int = sum(info["max_num_seqs"] for info in infos)
        self.max_n: int = cfg.server.max_n
        self.grammars = None  # each replica's engine compiles its own
        for replica, info in zip(self.replicas, infos, strict=True):
            replica.instance_id = info["instance_id"]
        self.chooser = make_chooser(cfg.server, model_name, infos)
        self.streams: dict[str, RemoteRequestStream] = {}
        self.metrics = RouterMetrics(self, model_name)
        self.history = ReplicaDashboard(self)

    # --- the EngineClient interface (jaxcb.server.engine_client) ----------------------------------

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    def stop(self, timeout: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._poller is not None:
            self._poller.cancel()
        for replica in self.replicas:
            self.ray.kill(replica.actor, no_restart=True)
        if self._owns_connection:
            self.ray.shutdown()

    @property
    def is_alive(self) -> bool:
        return not self._stopped and any(r.alive for r in self.replicas)

    def served_adapters(self) -> list[str]:
        return []

    async def add(
        self, prompt: PromptType, params: SamplingParams, *, request_id: Optional[str] = None, priority: int = 0,
        deadlines: Optional[dict[str, float]] = None, cache_salt: Optional[str] = None, background: bool = False,
        lora: Optional[str] = None,
    ) -> RemoteRequestStream:
        """Queue a request on the replica server.routing picks; raises its refusal (InvalidRequestError, ...) here.
        `cache_salt`: the tenant's, passed on to the engine and folded into the router's block hashes.
        `lora`: the body's `model`, which must name the base model (LoRA is not served over Ray replicas)."""
        if lora is not None and lora != self.model_name:
            raise InvalidRequestError(f"model {lora!r} is not served here: LoRA adapters are not served with "
                                      "server.backend=ray", "model")
        request_id = request_id or uuid.uuid4().hex
        _, prompt_ids = prompt_text_and_ids(prompt, self.tokenizer)
        _, prompt_ids = truncated_ids(prompt, None, prompt_ids, params.truncate_prompt_tokens,  # as the replica will
                                      self.max_model_len, self.tokenizer)
        cost = _Cost(len(prompt_ids), params.n * params.max_tokens)
        tried: set[int] = set()
        while True:  # a replica found dead here has generated nothing yet: the next one may take the request
            live = [r for r in self.replicas if r.alive and r.index not in tried]
            choice = self.chooser.choose(live, prompt_ids, cache_salt)
            if choice is None:
                raise EngineDeadError("no engine replica is alive")
            replica = choice.replica
            tried.add(replica.index)
            generator = replica.actor.generate.options(num_returns="streaming").remote(
                request_id, prompt, params, priority, deadlines, cache_salt, background
            )
            replica.waiting_tokens[request_id] = cost.initial
            try:
                await (await generator.__anext__())  # None: queued in the replica's engine
            except self.ray.exceptions.RayTaskError as e:
                replica.waiting_tokens.pop(request_id, None)
                raise e.cause from None  # InvalidRequestError, EngineOverloadedError: the app answers 400/429
            except self.ray.exceptions.RayActorError:
                replica.waiting_tokens.pop(request_id, None)
                self.mark_down(replica)
                continue
            except BaseException:  # cancelled while waiting (client gone): do not leave it running
                replica.waiting_tokens.pop(request_id, None)
                self.ray.cancel(generator)
                raise
            replica.num_served += 1
            self.chooser.record(choice)
            self.metrics.request_routed(choice)
            stream = RemoteRequestStream(self, replica, request_id, generator, cost)
            self.streams[request_id] = stream
            return stream

    def abort_all(self, reason: str) -> None:
        for stream in list(self.streams.values()):
            log.info("aborting %s: %s", stream.request_id, reason)
            stream.abort(reason)

    def request_rejected(self, reason: str) -> None:
        self.metrics.request_rejected(reason)

    async def render_metrics(self) -> bytes:
        return await self.metrics.render()

    async def dashboard_samples(self) -> list[dict]:
        return await self.history.snapshot()

    # --- routing and liveness --------------------------------------------------------------------

    def mark_down(self, replica: RoutedReplica) -> None:
        if replica.alive:
            log.warning("replica %d is down; routing around it until it answers again", replica.index)
        replica.alive = False
        # Dropped even when the replica was only slow to answer: a guess of its cache that is
        # too small costs a few misses, one that outlives a restart sends requests to an empty cache.
        self.chooser.forget(replica.index)

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            self._abort_stalled_readers()
            await asyncio.sleep(POLL_S)

    async def _check(self, replica: RoutedReplica) -> None:
        try:
            load = await asyncio.wait_for(await_ref(replica.actor.load.remote()), QUERY_TIMEOUT_S)
            alive = bool(load["alive"])
        except Exception:  # noqa: BLE001 -- dead, restarting or stuck: all mean "send nothing there"
            alive = False
        else:
            if load["instance_id"] != replica.instance_id:  # restarted between two polls: its cache is empty
                if replica.instance_id is not None:
                    self.chooser.forget(replica.index)
                replica.instance_id = load["instance_id"]
        if alive and not replica.alive:
            log.info("replica %d is up again", replica.index)
        if not alive:
            self.mark_down(replica)
        replica.alive = alive

    def _abort_stalled_readers(self) -> None:
        """A client that stops reading its stream must not hold a replica's KV blocks forever."""
        now = time.monotonic()
        for stream in list(self.streams.values()):
            if not stream.reading and now - stream.last_read > self.cfg.server.stream_stall_timeout_s:
                log.warning("aborting %s: its reader stalled", stream.request_id)
                stream.abort("slow_reader")
