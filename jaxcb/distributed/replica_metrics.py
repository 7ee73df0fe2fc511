"""What /metrics and /dashboard show for a Ray-backed server: every replica's figures, merged.

Each replica keeps its own `EngineMetrics` (label `replica="i"`) and `DashboardHistory`; the
front end fetches them when asked, so what it shows is never older than the request.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from jaxcb.distributed.ray_server import ReplicaRouter, RoutedReplica
    from jaxcb.distributed.routing import RoutingChoice

# Matched prefix lengths (tokens): 0 is its own bucket (a request no replica's index shared a block with).
MATCHED_TOKENS_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
QUERY_TIMEOUT_S = 5.0  # a replica that takes longer to answer is left out (and the router's poll marks it down)


class RouterMetrics:
    """/metrics of a Ray-backed server: every replica's metrics (label `replica`) plus the router's."""

    def __init__(self, router: ReplicaRouter, model_name: str):
        self.router = router
        self.registry = r = CollectorRegistry()
        names = ["model_name", "replica"]
        self.labels = {"model_name": model_name}
        prefix = router.cfg.server.metrics_prefix  # the replicas' series have it too: one naming at /metrics
        self.rejected = Counter(f"{prefix}:request_rejected", "Refused requests.", ["model_name", "reason"], registry=r)
        self.up = Gauge(f"{prefix}:replica_up", "1 while the replica answers the router.", names, registry=r)
        self.waiting_tokens = Gauge(
            f"{prefix}:router_waiting_tokens", "Tokens the router counts as still to compute per replica.", names,
            registry=r,
        )
        self.requests = Gauge(f"{prefix}:router_requests", "Unfinished requests the router sent to each replica.",
                              names, registry=r)
        self.served = Gauge(f"{prefix}:router_requests_routed", "Requests the router has sent to each replica.", names,
                            registry=r)
        self.route_decisions = Counter(
            f"{prefix}:router_route_decisions",
            "Requests routed, by replica and why: prefix (longest tracked prefix), imbalance (a prefix's replica "
            "was too busy), load (no tracked prefix, or routing=least_loaded), only_replica.",
            [*names, "reason"], registry=r,
        )
        self.matched_prefix_tokens = Histogram(
            f"{prefix}:router_matched_prefix_tokens",
            "Leading prompt tokens (whole blocks) the chosen replica's prefix index held (routing=prefix_aware).",
            ["model_name"], buckets=MATCHED_TOKENS_BUCKETS, registry=r,
        )

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(**self.labels, reason=reason).inc()

    def request_routed(self, choice: RoutingChoice) -> None:
        self.route_decisions.labels(**self.labels, replica=str(choice.replica.index), reason=choice.reason).inc()
        if self.router.chooser.prefix_aware:
            self.matched_prefix_tokens.labels(**self.labels).observe(choice.matched_tokens)

    def request_aborted(self, request_id: str) -> None:
        pass  # counted by the replica that ran the request

    async def render(self) -> bytes:
        for replica in self.router.replicas:
            labels = {**self.labels, "replica": str(replica.index)}
            self.up.labels(**labels).set(1 if replica.alive else 0)
            self.waiting_tokens.labels(**labels).set(replica.load)
            self.requests.labels(**labels).set(len(replica.waiting_tokens))
            self.served.labels(**labels).set(replica.num_served)
        families = list(self.registry.collect())
        for replica_families in await _gather_live(self.router, "metric_families"):
            families.extend(replica_families)
        return generate_latest(_MergedFamilies(families))


class _MergedFamilies:
    """A registry-like collector: families of the same name (one per replica) merged into one."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        merged: dict[str, Any] = {}
        for family in self.families:
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
        return merged.values()


class ReplicaDashboard:
    """The dashboard's history over all replicas: counts summed, KV usage averaged, latencies the worst."""

    def __init__(self, router: ReplicaRouter):
        self.router = router

    async def snapshot(self) -> list[dict]:
        per_replica = await _gather_live(self.router, "dashboard_samples")
        if not per_replica:
            return []
        length = min(len(samples) for samples in per_replica)
        merged = []
        for row in zip(*(samples[len(samples) - length:] for samples in per_replica)):
            sample = {"t": max(s["t"] for s in row), "kv_usage": sum(s["kv_usage"] for s in row) / len(row)}
            for key in ("running", "waiting", "tokens_per_s"):
                sample[key] = sum(s[key] for s in row)
            for key in ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95"):
                values = [s[key] for s in row if s[key] is not None]
                sample[key] = max(values) if values else None
            merged.append(sample)
        return merged


async def _gather_live(router: ReplicaRouter, method: str) -> list:
    """`method`'s answers from every live replica that answers in time."""

    async def ask(replica: RoutedReplica):
        try:
            return await asyncio.wait_for(await_ref(getattr(replica.actor, method).remote()), QUERY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 -- a replica that cannot answer is left out, and the poller marks it down
            return None

    answers = await asyncio.gather(*(ask(r) for r in router.replicas if r.alive))
    return [a for a in answers if a is not None]


async def await_ref(ref) -> Any:
    """A Ray ObjectRef as a coroutine (asyncio.wait_for wants one)."""
    return await ref
