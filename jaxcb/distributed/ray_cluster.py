"""Joining the Ray cluster and starting engine replicas on it: what jobs and the server share.

Replicas are Ray actors. They must run exactly the jaxcb the driver runs (the checkout it was
started from, not some other install), so each actor gets the driver's jaxcb directory in
front of its PYTHONPATH, and the driver's JAX platform choice.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jaxcb
from jaxcb.errors import UserError
from jaxcb.config import RayConfig

log = logging.getLogger(__name__)


def import_ray() -> Any:
    """The `ray` module, or a UserError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(
            "backend=ray needs Ray, which is not installed here: pip install 'jaxcb[dist]' (or use backend=local)"
        ) from None
    return ray


def connect(cfg: RayConfig) -> bool:
    """Start a local cluster or join cfg.address, unless this process is already connected.

    Returns True if this call connected, so the caller should disconnect when done."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    if cfg.address is None:
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=cfg.address, logging_level=logging.WARNING)
    return True


def worker_runtime_env() -> dict:
    """Environment of replica processes: import the driver's jaxcb, use the driver's JAX platform."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(jaxcb.__file__)))
    path = [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env_vars = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
    for name in ("JAX_PLATFORMS", "JAX_DEFAULT_MATMUL_PRECISION", "XLA_FLAGS"):
        if name in os.environ:
            env_vars[name] = os.environ[name]
    return {"env_vars": env_vars}


def replica_options(cfg: RayConfig, *, max_restarts: int) -> dict:
    """Ray actor options of one engine replica."""
    return {
        "num_cpus": cfg.cpus_per_replica,
        "num_gpus": cfg.gpus_per_replica,
        "max_restarts": max_restarts,
        "max_task_retries": 0,  # a lost call is retried (or failed) by jaxcb, which knows what is safe to repeat
        "runtime_env": worker_runtime_env(),
    }


def check_room(cfg: RayConfig, num_replicas: int, group: str) -> None:
    """Fail at once, not after a timeout, when a local cluster cannot hold the replicas asked for.

    A cluster joined by address may grow (an autoscaler adds nodes for pending replicas), so
    there only ray.replica_start_timeout_s applies."""
    if cfg.address is not None:
        return
    ray = import_ray()
    total = ray.cluster_resources()
    for resource, per_replica, knob in (("CPU", cfg.cpus_per_replica, "cpus_per_replica"),
                                        ("GPU", cfg.gpus_per_replica, "gpus_per_replica")):
        needed = num_replicas * per_replica
        if needed > total.get(resource, 0.0) + 1e-9:
            raise UserError(
                f"{group}.num_replicas={num_replicas} x ray.{knob}={per_replica:g} needs {needed:g} {resource}s but the "
                f"Ray cluster has {total.get(resource, 0.0):g}; lower ray.{knob} or {group}.num_replicas"
            )


def wait_until_ready(ray: Any, refs: list, cfg: RayConfig) -> list:
    """Results of the replicas' `ready` calls; a UserError if they take longer than the start timeout."""
    start = time.monotonic()
    ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=cfg.replica_start_timeout_s)
    if not_ready:
        raise UserError(
            f"{len(not_ready)} of {len(refs)} replicas were not ready after ray.replica_start_timeout_s="
            f"{cfg.replica_start_timeout_s:g}; is there room for them on the cluster (ray.cpus_per_replica, "
            f"ray.gpus_per_replica)?"
        )
    results = ray.get(refs)
    log.info("%d replicas ready in %.1f s", len(refs), time.monotonic() - start)
    return results
