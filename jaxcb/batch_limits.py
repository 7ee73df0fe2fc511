"""`scheduler.max_num_seqs` and `scheduler.max_num_batched_tokens`: `auto` sized from the device and
the model; an explicit value always wins.

Where the device reports no memory (the CPU), `auto` is 64 sequences and a 512-token budget:
a CPU step's time grows with its tokens, and more rows only lengthen every step. On an
accelerator a decode step reads the weights once whatever its batch, so throughput grows with
the batch until the cache runs out (an 8B model's output tok/s grows about 2-3x from 64 to 256
sequences): a device of 64 GiB or more (H100, H200, A100-80G) gets 256 sequences and an 8,192-token
budget, a smaller one 128 and 2,048, as vLLM sizes them. The budget is halved while the largest
step's workspace would take more than an eighth of the memory the weights leave; the sequences
are capped, once the cache is planned, so that each can hold `TOKENS_PER_SEQUENCE` tokens of
context (or max_model_len, if shorter) at once. Start-up logs what `auto` chose and why.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from jaxcb.config import ConfigError, SchedulerConfig
from jaxcb.host_memory import available_host_bytes
from jaxcb.kv_cache import GIB, DeviceMemory, KVCachePlan, cache_budget_bytes, format_bytes, step_activation_bytes
from jaxcb.model.config import LlamaConfig

AUTO = "auto"
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS = 64, 512
LARGE_DEVICE_BYTES = 64 * GIB
LARGE_DEVICE_LIMITS = (256, 8192)  # (sequences, tokens) on a device of LARGE_DEVICE_BYTES or more
SMALL_DEVICE_LIMITS = (128, 2048)
MIN_AUTO_TOKENS = 512
WORKSPACE_SHARE = 8  # the largest step's workspace takes at most 1/8 of what the weights leave
TOKENS_PER_SEQUENCE = 2048  # context each of max_num_seqs sequences can hold at once, at least


def is_auto(value: Union[int, str]) -> bool:
    return value == AUTO


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """The step limits in force, and why each `auto` one is what it is."""

    max_num_seqs: int
    max_num_batched_tokens: int
    reasons: tuple[str, ...] = ()  # what each auto value came to, and why; none when both were given
    device: str = ""  # the device the auto values were sized for

    def describe(self) -> str:
        return "; ".join(self.reasons) + (f" (sized for {self.device})" if self.reasons else "")

    def apply(self, sched: SchedulerConfig) -> SchedulerConfig:
        """The scheduler's config with these limits (the user's config object is left as it was)."""
        return dataclasses.replace(sched, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens)


def resolve_batch_limits(
    sched: SchedulerConfig,
    model: LlamaConfig,
    memory: Optional[DeviceMemory],
    *,
    memory_fraction: float,
    block_size: int,
    tensor_parallel_size: int = 1,
    token_buckets: Optional[list[int]] = None,
) -> BatchLimits:
    """The limits before the cache is planned. `memory`: the device's after the weights are prepared
    (None: it reports none, the CPU). `token_buckets`: engine.token_buckets, which an auto budget
    must hold."""
    auto_seqs, auto_tokens = is_auto(sched.max_num_seqs), is_auto(sched.max_num_batched_tokens)
    if memory is None:
        seqs, tokens = CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS
        where = "a device that reports no memory, the CPU: a step's time grows with its tokens"
    else:
        large = memory.total_bytes >= LARGE_DEVICE_BYTES
        seqs, tokens = LARGE_DEVICE_LIMITS if large else SMALL_DEVICE_LIMITS
        where = (f"a {memory.platform} of {memory.total_bytes / GIB:.0f} GiB "
                 f"({'at least' if large else 'under'} {LARGE_DEVICE_BYTES // GIB} GiB)")
    if not auto_seqs:
        seqs = sched.max_num_seqs
    reasons = []
    if auto_tokens:
        floor = max(block_size, seqs if not auto_seqs else 1, max(token_buckets or [0]))
        note = ""
        if memory is not None:
            left = cache_budget_bytes(memory, memory_fraction)[0]
            while tokens > max(MIN_AUTO_TOKENS, floor) and step_activation_bytes(
                    model, tokens, min(seqs, tokens), tensor_parallel_size) * WORKSPACE_SHARE > left:
                tokens //= 2
                note = (f" (halved until the largest step's workspace takes at most 1/{WORKSPACE_SHARE} of the "
                        f"memory the weights leave)")
        if tokens < floor:
            tokens, note = floor, f" (raised to the block size, max_num_seqs and engine.token_buckets)"
        reasons.append(f"scheduler.max_num_batched_tokens=auto: {tokens}{note}")
    else:
        tokens = sched.max_num_batched_tokens
    if auto_seqs:
        if seqs > tokens:
            seqs = tokens
        reasons.append(f"scheduler.max_num_seqs=auto: {seqs}")
    return BatchLimits(seqs, tokens, tuple(reasons), where)


def cap_by_cache(limits: BatchLimits, sched: SchedulerConfig, plan: KVCachePlan) -> BatchLimits:
    """An auto max_num_seqs no larger than the cache holds sequences of TOKENS_PER_SEQUENCE tokens (or
    max_model_len) at once, a multiple of 8 from 8 on."""
    if not is_auto(sched.max_num_seqs):
        return limits
    per_seq = min(plan.max_model_len, TOKENS_PER_SEQUENCE)
    fit = max(1, plan.num_tokens // per_seq)
    if fit >= limits.max_num_seqs:
        return limits
    capped = fit // 8 * 8 if fit >= 8 else fit
    reasons = tuple(
        f"scheduler.max_num_seqs=auto: {capped} (the KV cache's {plan.num_tokens:,} tokens hold {fit} sequences "
        f"of {per_seq} tokens at once)" if r.startswith("scheduler.max_num_seqs=") else r for r in limits.reasons)
    return dataclasses.replace(limits, max_num_seqs=capped, reasons=reasons)


def check_step_fits(limits: BatchLimits, workspace_bytes: int, memory: Optional[DeviceMemory],
                    memory_fraction: float) -> None:
    """Refuse limits whose largest step's workspace alone passes the memory left for it and the cache, by their
    names: the cache, planned from what the workspace leaves, would otherwise take the blame. `memory`: the
    device's after the weights (None: the host's)."""
    if memory is not None:
        room = cache_budget_bytes(memory, memory_fraction)[0]
        where = f"{memory.platform} memory the weights leave (cache.memory_fraction={memory_fraction:g})"
    else:
        room, where = available_host_bytes(), "host memory available"
    if workspace_bytes > room:
        raise ConfigError(
            f"scheduler.max_num_batched_tokens={limits.max_num_batched_tokens} and scheduler.max_num_seqs="
            f"{limits.max_num_seqs}: the largest step's activations take {format_bytes(workspace_bytes)}, more than "
            f"the {format_bytes(max(0, room))} of {where}; lower scheduler.max_num_batched_tokens or "
            f"scheduler.max_num_seqs")


def validate_batch_limits(sched: SchedulerConfig, block_size: int, token_buckets: Optional[list[int]]) -> None:
    """The limits' own ranges and their cross-field checks, each skipped where a value is still auto."""
    seqs, tokens = sched.max_num_seqs, sched.max_num_batched_tokens
    for name, value in (("max_num_seqs", seqs), ("max_num_batched_tokens", tokens)):
        if is_auto(value):
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"scheduler.{name}={value!r} must be a number, or auto (sized from the device and "
                              f"the model)")
        if value < 1:
            raise ConfigError(f"scheduler.{name}={value} must be >= 1, or auto (sized from the device and the model)")
    if is_auto(tokens):
        return
    if tokens < block_size:
        raise ConfigError(f"scheduler.max_num_batched_tokens={tokens} must be >= cache.block_size={block_size}")
    if not is_auto(seqs) and tokens < seqs:
        raise ConfigError(f"scheduler.max_num_batched_tokens={tokens} must be >= scheduler.max_num_seqs={seqs} "
                          f"(every running sequence needs one token per step)")
    if token_buckets and max(token_buckets) > tokens:
        raise ConfigError(f"engine.token_buckets={token_buckets} must not exceed "
                          f"scheduler.max_num_batched_tokens={tokens} (a step never pads past the budget)")
