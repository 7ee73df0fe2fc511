"""Tensor parallelism: the device mesh, and where each of the engine's arrays lives on it.

One mesh axis, `tp`, over `engine.tensor_parallel_size` devices. Weights are split the
Megatron way, so that the only communication is one all-reduce after attention and one
after the MLP, both inserted by XLA (GSPMD):

    q/k/v_proj  [L, D, H, K]    split H      each device computes its own heads
    o_proj      [L, Hq, K, D]   split Hq     partial sums, all-reduced
    gate/up     [L, D, F]       split F      each device computes its own MLP columns
    down_proj   [L, F, D]       split F      partial sums, all-reduced
    lm_head     [D, V]          split V      when V divides by tp; else replicated
    embed, norms                replicated

Under `model.layer_loop=unrolled` each layer's own weights (the same shapes without L) are
split on the same axes.

The KV cache `[L, Hkv, P, S, D]` is split on Hkv, so a device holds the cache of exactly
the KV heads it computes; attention runs per shard (`AttentionBackend` wraps it in
`shard_map`: a Pallas kernel cannot be partitioned automatically). The step's small
inputs (token ids, metadata, sampling arrays) and its outputs are replicated.

Why lm_head is split and embed is not: lm_head is a [D, V] matmul on every sampling row
(2 GiB in bf16 at 70B), and split over V each device computes exact logits of its share
of the vocabulary, so results do not change; embed is a row gather with no compute to
split, and keeping it whole keeps the residual stream replicated without extra collectives
(its 2 GiB copy per device at 70B is the price).

Several hosts: `initialize_distributed` calls `jax.distributed.initialize` from
`engine.distributed` before anything touches a device; then `jax.devices()` lists every
host's devices and the mesh spans them all.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcb.config import ConfigError, DistributedConfig
from jaxcb.model.config import LlamaConfig

log = logging.getLogger(__name__)

TP_AXIS = "tp"
HEADS_SPEC = PartitionSpec(None, TP_AXIS, None)  # [T, heads, head_dim]: attention's inputs and output
KV_CACHE_SPEC = PartitionSpec(None, TP_AXIS)  # [L, Hkv, num_blocks, block_size, head_dim]: by KV head

# Parameter name -> the axis split over `tp` (None: replicated), counted from the end, so that the
# rule holds for the stacked weights [L, ...] and for each layer's own array (model.layer_loop=unrolled).
PARAM_SHARDED_AXIS: dict[str, Optional[int]] = {
    "q_proj": -2,  # [L, D, Hq, K]
    "k_proj": -2,  # [L, D, Hkv, K]
    "v_proj": -2,  # [L, D, Hkv, K]
    "o_proj": -3,  # [L, Hq, K, D]
    "gate_proj": -1,  # [L, D, F]
    "up_proj": -1,  # [L, D, F]
    "down_proj": -2,  # [L, F, D]
    "lm_head": -1,  # [D, V]; replicated when V does not divide by tp
    "embed": None,  # [V, D]
    "attn_norm": None,  # [L, D]
    "mlp_norm": None,  # [L, D]
    "final_norm": None,  # [D]
    "q_bias": -2,  # [L, Hq, K]: with its heads
    "k_bias": -2,  # [L, Hkv, K]
    "v_bias": -2,  # [L, Hkv, K]
    "q_norm": None,  # [L, K]: one weight shared by every head
    "k_norm": None,  # [L, K]
}


def param_partition_spec(name: str, shape: Sequence[int], tensor_parallel_size: int) -> PartitionSpec:
    """How parameter `name` (its last path component) of `shape` is split over the `tp` axis."""
    if name not in PARAM_SHARDED_AXIS:
        raise KeyError(f"parameter {name!r} has no sharding rule; add it to jaxcb.sharding.PARAM_SHARDED_AXIS")
    axis = PARAM_SHARDED_AXIS[name]
    if axis is None or shape[axis] % tensor_parallel_size:
        return PartitionSpec()
    spec: list[Optional[str]] = [None] * len(shape)
    spec[axis] = TP_AXIS
    return PartitionSpec(*spec)


def check_tensor_parallel(tensor_parallel_size: int, model: LlamaConfig, num_devices: int) -> None:
    """Raise ConfigError, saying what to change, if the model cannot be split over that many devices."""
    tp = tensor_parallel_size
    problems = [
        f"model.{name}={value} is not divisible by engine.tensor_parallel_size={tp}{why}"
        for name, value, why in (
            ("num_kv_heads", model.num_kv_heads, " (the KV cache is split by KV head)"),
            ("num_heads", model.num_heads, ""),
            ("intermediate_size", model.intermediate_size, ""),
        )
        if value % tp
    ]
    if problems:
        sizes = [
            d for d in range(1, model.num_kv_heads + 1)
            if not (model.num_kv_heads % d or model.num_heads % d or model.intermediate_size % d)
        ]
        raise ConfigError("; ".join(problems) + f"; use engine.tensor_parallel_size in {sizes}")
    if tp > num_devices:
        raise ConfigError(
            f"engine.tensor_parallel_size={tp} needs {tp} devices but JAX sees {num_devices} "
            f"({jax.default_backend()}); lower engine.tensor_parallel_size"
        )
    if jax.process_count() > 1 and tp != num_devices:
        raise ConfigError(
            f"engine.tensor_parallel_size={tp} must equal the {num_devices} devices of all "
            f"{jax.process_count()} hosts in a multi-host run (the mesh spans every host)"
        )


def initialize_distributed(cfg: DistributedConfig) -> bool:
    """`jax.distributed.initialize` from `engine.distributed`; False (nothing done) on one host.

    Must run before anything touches a device: JAX fixes its device list at first use."""
    if cfg.coordinator_address is None:
        return False
    if jax.distributed.is_initialized():
        return True
    log.info(
        "jax.distributed: process %d of %d, coordinator %s", cfg.process_id, cfg.num_processes, cfg.coordinator_address
    )
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes, process_id=cfg.process_id
    )
    return True


def _param_name(path: tuple) -> str:
    """The parameter's own name from a pytree path (nnx state: (..., DictKey('q_proj'), GetAttrKey('value')))."""
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]
    return names[-1]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The mesh of one tensor-parallel engine, and the sharding of each of its arrays."""

    mesh: Mesh

    @property
    def size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def kv_cache(self) -> NamedSharding:
        return NamedSharding(self.mesh, KV_CACHE_SPEC)

    def param(self, name: str, shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(self.mesh, param_partition_spec(name, shape, self.size))

    def params(self, state: Any) -> Any:
        """The sharding of every parameter of `state` (an nnx State or a pure dict), as the same tree."""
        return jax.tree_util.tree_map_with_path(lambda path, x: self.param(_param_name(path), x.shape), state)

    def put_params(self, state: Any) -> Any:
        return jax.device_put(state, self.params(state))


def make_tensor_parallel(tensor_parallel_size: int, model: LlamaConfig) -> Optional[TensorParallel]:
    """The mesh for `engine.tensor_parallel_size` devices; None for 1 (one device, nothing sharded)."""
    check_tensor_parallel(tensor_parallel_size, model, jax.device_count())
    if tensor_parallel_size == 1:
        return None
    devices = np.asarray(jax.devices()[:tensor_parallel_size])
    log.info("tensor parallel over %d devices: %s", tensor_parallel_size, ", ".join(str(d) for d in devices))
    return TensorParallel(Mesh(devices, (TP_AXIS,)))


def fetch(x: jax.Array) -> np.ndarray:
    """A replicated array on the host; on several hosts, from this host's own copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))
