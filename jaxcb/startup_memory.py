"""What start-up holds on each device, phase by phase, worked out before anything is allocated.

The engine starts in this order (`ENGINE_STARTUP_ORDER`; `Engine.startup` records the phases it
ran, and a test holds the two equal):

    load      the weights, in the checkpoint's layout
    prepare   the backend rewrites them (fused q/k/v and gate/up): for a while a second copy of
              what it rewrites exists beside the original (`Backend.prepare_memory`)
    plan      the KV cache is sized from what is free after the prepared weights, less the
              largest step's workspace (`kv_cache.plan_kv_cache`)
    allocate  the cache's buffers
    compile   the steps; serving then needs the workspace on top of everything else

`model_startup` walks an order over a device of a given size with the bytes each phase adds,
planning the cache with the same `plan_kv_cache` the engine calls, and says what each phase
holds at its peak. The engine checks its own start-up with it before it loads a weight (on a
device that reports its memory), so that a model that cannot fit fails in a sentence, not in
an allocator's error minutes later. Planning the cache before prepare (jaxcb's first order)
leaves the prepare copy no room: the model reports that overflow.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from jaxcb.config import CacheConfig
from jaxcb.kv_cache import DeviceMemory, KVCachePlan, format_bytes, plan_kv_cache, step_activation_bytes
from jaxcb.model.config import LlamaConfig

ENGINE_STARTUP_ORDER = ("load", "prepare", "plan", "allocate", "compile")
PLAN_BEFORE_PREPARE = ("load", "plan", "allocate", "prepare", "compile")  # the order that ran out of memory


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """The model's weights on each device, and the parts a backend's prepare rewrites."""

    total: int  # every weight, in the checkpoint's layout
    qkv: int  # q, k and v projections of every layer
    gate_up: int  # gate and up projections of every layer
    num_layers: int


def weight_bytes(cfg: LlamaConfig, tensor_parallel_size: int = 1) -> WeightBytes:
    """Bytes of the weights on each device of a tensor-parallel mesh (`jaxcb.sharding`: attention
    heads and MLP columns split; the LM head split by vocabulary when it divides; embedding and
    norms replicated)."""
    tp, item = tensor_parallel_size, _itemsize(cfg.dtype)
    d, f, k, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    qkv = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * k // tp
    gate_up = 2 * d * f // tp
    qkv_bias = (cfg.num_heads + 2 * cfg.num_kv_heads) * k // tp if cfg.qkv_bias else 0
    qk_norm = (2 * k if cfg.qk_norm else 0) + (2 * d if cfg.sandwich_norms else 0)  # per-head q/k; post-attn/MLP
    per_layer = qkv + gate_up + cfg.num_heads * k * d // tp + f * d // tp + 2 * d + qkv_bias + qk_norm
    head = 0 if cfg.tie_word_embeddings else d * v // (tp if v % tp == 0 else 1)
    total = cfg.num_layers * per_layer + v * d + d + head
    return WeightBytes(total * item, cfg.num_layers * qkv * item, cfg.num_layers * gate_up * item, cfg.num_layers)


def _itemsize(dtype: str) -> int:
    import numpy as np

    return 2 if dtype in ("bfloat16", "float16") else np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
    name: str
    peak_bytes: int  # the most held at once during the phase
    held_bytes: int  # held when it ends


@dataclasses.dataclass(frozen=True)
class StartupMemory:
    """One modelled start-up on one device."""

    phases: tuple[PhaseMemory, ...]
    pool_bytes: int  # what the process may allocate on the device
    plan: Optional[KVCachePlan]
    weights_bytes: int  # the prepared weights
    workspace_bytes: int  # the largest step's, as reserved

    @property
    def peak_bytes(self) -> int:
        return max(p.peak_bytes for p in self.phases)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.pool_bytes

    @property
    def overflow(self) -> Optional[PhaseMemory]:
        """The first phase whose peak passes the pool, or None."""
        return next((p for p in self.phases if p.peak_bytes > self.pool_bytes), None)

    def describe(self) -> str:
        return ", ".join(f"{p.name} {format_bytes(p.peak_bytes)}" for p in self.phases) + (
            f" of {format_bytes(self.pool_bytes)}")


def model_startup(
    cfg: LlamaConfig,
    cache: CacheConfig,
    *,
    device_bytes: int,
    pool_fraction: float,
    prepare_memory: Callable[[WeightBytes, int], tuple[int, int]],
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    tensor_parallel_size: int = 1,
    order: Sequence[str] = ENGINE_STARTUP_ORDER,
) -> StartupMemory:
    """Start-up on one device of `device_bytes` (XLA's pool `pool_fraction` of it), phase by phase in
    `order`. `prepare_memory`: the backend's (`Backend.prepare_memory`): (the most prepare holds beyond
    the loaded weights, the prepared weights' bytes). The cache is planned, wherever `order` plans it,
    from what is held then, exactly as the engine plans it from the device's statistics."""
    weights = weight_bytes(cfg, tensor_parallel_size)
    transient, prepared = prepare_memory(weights, max_model_len)
    workspace = step_activation_bytes(cfg, max_num_batched_tokens, max_num_seqs, tensor_parallel_size)
    pool = int(device_bytes * pool_fraction)
    held, plan, phases = 0, None, []
    for name in order:
        peak = held
        if name == "load":
            held = peak = weights.total
        elif name == "prepare":
            peak = held + transient
            held += prepared - weights.total
        elif name == "plan":
            memory = DeviceMemory(pool, held, pool_fraction)
            plan = plan_kv_cache(cache, cfg, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 reserve_bytes=workspace, tensor_parallel_size=tensor_parallel_size, memory=memory)
        elif name == "allocate":
            held = peak = held + (plan.bytes_per_device if plan is not None else 0)
        elif name == "compile":
            peak = held + workspace
        else:
            raise ValueError(f"unknown start-up phase {name!r}; the phases are {', '.join(ENGINE_STARTUP_ORDER)}")
        phases.append(PhaseMemory(name, peak, held))
    return StartupMemory(tuple(phases), pool, plan, prepared, workspace)


def check_weights_fit(cfg: LlamaConfig, memory: DeviceMemory, prepare_memory, max_model_len: int,
                      tensor_parallel_size: int, model_name: str, lora_slots: Optional[tuple[int, str]] = None) -> None:
    """Before loading: refuse, in a sentence, weights that cannot be loaded and prepared in XLA's pool.
    `lora_slots`: (the adapters' slot bytes on each device, the knobs that size them), allocated beside
    the prepared weights."""
    from jaxcb.config import ConfigError

    weights = weight_bytes(cfg, tensor_parallel_size)
    transient, _ = prepare_memory(weights, max_model_len)
    need = memory.in_use_bytes + weights.total + transient
    slot_bytes, slot_knobs = lora_slots or (0, "")
    if need <= memory.pool_bytes < memory.in_use_bytes + weights.total + slot_bytes:
        raise ConfigError(
            f"the LoRA adapters' slots ({slot_knobs}) take {format_bytes(slot_bytes)} beside model={model_name}'s "
            f"{format_bytes(weights.total)} of weights, past the {format_bytes(memory.pool_bytes)} XLA may allocate "
            f"(cache.memory_fraction sets it); lower lora.max_loras or lora.max_rank"
        )
    if need > memory.pool_bytes:
        per = f" on each of {tensor_parallel_size} devices" if tensor_parallel_size > 1 else ""
        raise ConfigError(
            f"model={model_name}'s weights take {format_bytes(weights.total)}{per} and preparing them "
            f"{format_bytes(transient)} more at once, past the {format_bytes(memory.pool_bytes)} XLA may allocate "
            f"(cache.memory_fraction sets it); raise cache.memory_fraction, or split the model over more devices "
            f"with engine.tensor_parallel_size"
        )
