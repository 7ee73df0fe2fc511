"""The paged KV cache's size and device buffers, and host memory for whole blocks (swap, host tier).

The layout (`[num_layers, num_kv_heads, num_blocks, block_size, head_dim]` for K and for V,
block 0 the null block) and the writes into it belong to the attention forms
(`jaxcb.kernels.attention`); this module decides how many blocks there are, allocates them
once, and copies whole blocks to and from host memory for swap preemption and the prefix cache's
host tier.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from jaxcb.config import CacheConfig, ConfigError
from jaxcb.host_memory import available_host_bytes, physical_host_bytes
from jaxcb.kernels.attention import zeros_buffer
from jaxcb.kernels.attention.cache import NULL_BLOCK, SWAP_CHUNK, KVCache, gather_blocks, scatter_blocks  # noqa: F401
from jaxcb.kernels.attention.quantization import QUANTIZED_CACHE_DTYPES, cache_dtype_name
from jaxcb.model.config import LlamaConfig

log = logging.getLogger(__name__)
GIB = 1 << 30


def kv_cache_shape(model: LlamaConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (model.num_layers, model.num_kv_heads, num_blocks, block_size, model.head_dim)


def default_cache_dtype(requested: str, model_dtype: str = "float32") -> jnp.dtype:
    """`auto` is bf16 on accelerators; on CPU the model's dtype, bf16 for a bf16 model (half the
    bytes attention reads) and f32 otherwise. int8 / fp8_e4m3 / fp8_e5m2: the 8-bit dtypes."""
    if requested in QUANTIZED_CACHE_DTYPES:
        return QUANTIZED_CACHE_DTYPES[requested]
    if requested != "auto":
        return jnp.dtype(requested)
    if jax.default_backend() == "cpu":
        return jnp.dtype(jnp.bfloat16 if model_dtype == "bfloat16" else jnp.float32)
    return jnp.dtype(jnp.bfloat16)


def format_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """How big the cache is and what that buys; measured at start-up, never written into the config."""

    num_blocks: int  # including the null block
    block_size: int
    dtype: jnp.dtype
    bytes_per_block: int  # K and V, all layers, all KV heads (over all devices)
    max_model_len: int
    source: str  # what the size came from
    tensor_parallel_size: int = 1  # devices the cache is split over, by KV head

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_full_length_seqs(self) -> float:
        return self.num_tokens / self.max_model_len

    @property
    def bytes_per_device(self) -> int:
        return self.total_bytes // self.tensor_parallel_size

    def describe(self) -> str:
        split = (
            f" ({format_bytes(self.bytes_per_device)} on each of {self.tensor_parallel_size} devices)"
            if self.tensor_parallel_size > 1 else ""
        )
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens:,} tokens, "
            f"{format_bytes(self.total_bytes)} {cache_dtype_name(self.dtype)}{split} ({self.source}); "
            f"holds {self.max_full_length_seqs:.1f} sequences of max_model_len={self.max_model_len}"
        )


XLA_POOL_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
XLA_DEFAULT_POOL_FRACTION = 0.75  # what JAX's GPU allocator preallocates when the variable is unset


def configure_device_memory(memory_fraction: float) -> float:
    """Make XLA's GPU memory pool `cache.memory_fraction` of the device (JAX preallocates 75% by
    default, which left the cache near two thirds of HBM); returns the pool fraction in effect.
    Must run before JAX first touches a device; a value the user set is kept."""
    if XLA_POOL_FRACTION_VAR not in os.environ:
        if _backends_initialized():
            if not _accelerator_initialized():  # only the CPU, whose memory XLA does not pool: nothing to say
                return xla_pool_fraction()
            log.warning("JAX's devices were in use before the engine started: XLA's memory pool stays at "
                        "%s of each accelerator; set %s=%g before starting to give the cache cache.memory_fraction",
                        XLA_DEFAULT_POOL_FRACTION, XLA_POOL_FRACTION_VAR, memory_fraction)
        else:
            os.environ[XLA_POOL_FRACTION_VAR] = f"{memory_fraction:g}"
    return xla_pool_fraction()


def xla_pool_fraction() -> float:
    try:
        return float(os.environ.get(XLA_POOL_FRACTION_VAR, XLA_DEFAULT_POOL_FRACTION))
    except ValueError:
        return XLA_DEFAULT_POOL_FRACTION


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # a JAX without the private registry: assume the worst
        return True


def _accelerator_initialized() -> bool:
    """Whether a backend JAX has started is an accelerator's (GPU, TPU): called once backends are up."""
    try:
        from jax._src import xla_bridge

        return any(platform != "cpu" for platform in xla_bridge._backends)
    except (ImportError, AttributeError):
        return True


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One accelerator's memory as XLA reports it (`read_device_memory`), or as start-up models it
    (`jaxcb.startup_memory`): XLA's pool and what is in use in it."""

    pool_bytes: int  # XLA's pool: what the process may allocate on the device
    in_use_bytes: int  # allocated now (the weights, after they are loaded and prepared)
    pool_fraction: float  # the pool's share of the device (XLA_PYTHON_CLIENT_MEM_FRACTION)
    platform: str = "gpu"
    # The pool's largest contiguous free block, where the allocator reports it (XLA's BFC allocator
    # does): the cache's K and V are one buffer each, and the weights that prepare replaced (q/k/v and
    # gate/up before fusing) leave holes below them that neither buffer can use.
    largest_free_bytes: Optional[int] = None

    @property
    def total_bytes(self) -> int:
        return int(self.pool_bytes / self.pool_fraction)

    @property
    def free_bytes(self) -> int:
        return self.pool_bytes - self.in_use_bytes


def read_device_memory(device: Optional[jax.Device] = None, pool_fraction: Optional[float] = None
                       ) -> Optional[DeviceMemory]:
    """The device's memory now; None where it reports no memory statistics (CPU)."""
    device = device or jax.local_devices()[0]  # on several hosts, one this process can query
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    largest = stats.get("largest_free_block_bytes")
    return DeviceMemory(int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)),
                        pool_fraction if pool_fraction is not None else xla_pool_fraction(), device.platform,
                        int(largest) if largest else None)


def cache_budget_bytes(memory: DeviceMemory, memory_fraction: float) -> tuple[int, str]:
    """Bytes the cache may take on an accelerator, and where that comes from: `memory_fraction` of the
    device's total memory, never more than XLA's pool, minus what is in use (the prepared weights)."""
    total = memory.total_bytes
    usable = min(int(total * memory_fraction), memory.pool_bytes)
    source = f"cache.memory_fraction={memory_fraction} of {total / GIB:.1f} GiB on {memory.platform}"
    if usable < int(total * memory_fraction):
        source += (f", capped by XLA's pool of {memory.pool_bytes / GIB:.1f} GiB "
                   f"({XLA_POOL_FRACTION_VAR}={memory.pool_fraction:g})")
    return usable - memory.in_use_bytes, source


def step_activation_bytes(model: LlamaConfig, max_num_tokens: int, max_num_seqs: int, tensor_parallel_size: int = 1
                          ) -> int:
    """What the largest step needs beside the weights and the cache, on each device, overestimated: the
    residual stream and a layer's q/k/v, MLP and attention intermediates for every token (float32),
    [rows, vocabulary] logits a few times over for sampling, the prompt-logprobs variant's
    [128, vocabulary] chunk, the penalty counts kept per slot (2 x max_num_seqs slots x vocabulary x 5
    bytes, runner/slots.py; their block tables fit in the scratch), and 256 MiB for XLA's own scratch.
    The cache is sized after it, so that the first big step does not run out of memory where the cache
    took everything."""
    per_token = 4 * model.hidden_size + 3 * model.intermediate_size // tensor_parallel_size + 3 * (
        model.num_heads + 2 * model.num_kv_heads) * model.head_dim // tensor_parallel_size
    logits = (4 * max_num_seqs + 128) * model.vocab_size
    slot_counts = 2 * max_num_seqs * 5 * model.vocab_size
    return 4 * (max_num_tokens * per_token + logits) + slot_counts + 256 * 2**20


def _available_host_bytes() -> int:
    return available_host_bytes()


def check_host_bytes(what: str, nbytes: int, fix: str) -> None:
    """Refuse, before it is allocated, a host buffer larger than the machine's physical memory: it could
    only end in a MemoryError or the OOM killer. `what` names the field and its value, `fix` what to change."""
    total = physical_host_bytes()
    if total is not None and nbytes > total:
        raise ConfigError(f"{what} takes {format_bytes(nbytes)} of host memory, more than the {format_bytes(total)} "
                          f"this machine has; {fix}")


def plan_kv_cache(
    cache: CacheConfig,
    model: LlamaConfig,
    *,
    max_model_len: int,
    max_num_seqs: int,
    reserve_bytes: int = 0,
    device: Optional[jax.Device] = None,
    tensor_parallel_size: int = 1,
    pool_fraction: Optional[float] = None,
    memory: Optional[DeviceMemory] = None,
    extra_bytes_per_block: int = 0,
) -> KVCachePlan:
    """Size the cache from `cache.num_blocks`, or from the memory it may take.

    On a GPU/TPU the cache takes `memory_fraction` of the device's total memory minus what is in
    use (load the weights first) and `reserve_bytes` (step activations); XLA's memory pool is
    `pool_fraction` of the device (default: what `configure_device_memory` set); `memory`, when
    given, is the device's memory as read (or modelled) already, and `device` is not read. Under tensor
    parallelism every device holds 1/tensor_parallel_size of each block (its KV heads), so
    one device's free memory holds tensor_parallel_size times more blocks. On CPU, where JAX
    reports no memory statistics, it takes `cpu_kv_cache_gib` (as vLLM's CPU backend does),
    never more than `max_num_seqs` sequences of `max_model_len` can use -- a CPU run should
    not pin gigabytes it cannot use -- and refuses a size the host's available memory cannot
    hold. Fails if one sequence of max_model_len would not fit. `extra_bytes_per_block`: what each
    block costs besides the model's K/V (a draft model's own K/V for the same block id).
    """
    dtype = default_cache_dtype(cache.dtype, model.dtype)
    bytes_per_block = model.kv_bytes_per_token(jnp.dtype(dtype).itemsize) * cache.block_size + extra_bytes_per_block
    blocks_per_seq = -(-max_model_len // cache.block_size)
    memory = memory or read_device_memory(device, pool_fraction)
    if cache.num_blocks is not None:
        num_blocks, source = cache.num_blocks, "cache.num_blocks"
        if memory is None:  # the cache is host memory
            check_host_bytes(f"cache.num_blocks={num_blocks} (the KV cache, {bytes_per_block:,} bytes a block)",
                             num_blocks * bytes_per_block, "lower cache.num_blocks, or set it to null to size the "
                             "cache from cache.cpu_kv_cache_gib")
        else:  # refused here, in a sentence, rather than by the allocator's out-of-memory error
            per_device, free = bytes_per_block // tensor_parallel_size, memory.free_bytes
            need = num_blocks * per_device
            if need > free:
                raise ConfigError(
                    f"cache.num_blocks={num_blocks} needs {format_bytes(need)} of {memory.platform} memory a device, "
                    f"more than the {format_bytes(max(0, free))} free there after the weights: at most "
                    f"{max(0, free - reserve_bytes) // per_device} blocks fit beside the largest step's workspace "
                    f"({format_bytes(reserve_bytes)}); lower cache.num_blocks, or set it to null to size the cache "
                    f"from cache.memory_fraction")
            if need > free - reserve_bytes:  # the estimate is generous: a tuned value may still run
                log.warning("cache.num_blocks=%d leaves %s of %s memory beside the cache, less than the %s the "
                            "largest step may need: a large step may run out of memory", num_blocks,
                            format_bytes(free - need), memory.platform, format_bytes(reserve_bytes))
    else:
        if memory is not None:
            budget, source = cache_budget_bytes(memory, cache.memory_fraction)
            budget -= reserve_bytes
            if memory.largest_free_bytes is not None and budget > memory.largest_free_bytes - reserve_bytes:
                # K and V are allocated one after the other from the largest free block: a cache sized
                # from the free bytes alone fails its second allocation in a fragmented pool.
                budget = memory.largest_free_bytes - reserve_bytes
                source += (f", capped by the pool's largest free block of {format_bytes(memory.largest_free_bytes)} "
                           f"(the rest of the free memory is in holes the step's workspace may use)")
            num_blocks = max(0, budget // (bytes_per_block // tensor_parallel_size))
        else:  # host memory (fake CPU devices share it: the whole cache counts against it)
            needed = max_num_seqs * blocks_per_seq + 1
            num_blocks = min(int(cache.cpu_kv_cache_gib * GIB) // bytes_per_block, needed)
            source = (
                f"capped at scheduler.max_num_seqs={max_num_seqs} x max_model_len={max_model_len}, "
                f"within cache.cpu_kv_cache_gib={cache.cpu_kv_cache_gib:g}"
                if num_blocks == needed
                else f"cache.cpu_kv_cache_gib={cache.cpu_kv_cache_gib:g}"
            )
            host = _available_host_bytes()
            if num_blocks * bytes_per_block > host - reserve_bytes:
                raise ConfigError(
                    f"the KV cache ({source}) needs {format_bytes(num_blocks * bytes_per_block)}, more than the "
                    f"{format_bytes(max(0, host - reserve_bytes))} of host memory available ({format_bytes(host)} "
                    f"available, less {format_bytes(reserve_bytes)} kept for the largest step's activations); lower "
                    f"cache.cpu_kv_cache_gib, scheduler.max_num_seqs or engine.max_model_len"
                )
    plan = KVCachePlan(
        int(num_blocks), cache.block_size, dtype, bytes_per_block, max_model_len, source, tensor_parallel_size
    )
    if plan.num_blocks - 1 < blocks_per_seq:
        raise ConfigError(
            f"the KV cache ({source}) holds {max(0, plan.num_tokens)} tokens, fewer than one sequence of "
            f"max_model_len={max_model_len} needs ({blocks_per_seq * cache.block_size}); lower engine.max_model_len "
            f"or give the cache more memory (cache.num_blocks, cache.memory_fraction on GPU/TPU, "
            f"cache.cpu_kv_cache_gib on CPU)"
        )
    return plan


def allocate_kv_cache(
    model: LlamaConfig,
    num_blocks: int,
    block_size: int,
    dtype: jnp.dtype,
    sharding: Optional[Sharding] = None,
    zeros: Callable[..., jax.Array] = zeros_buffer,
    scales: Optional[tuple[np.ndarray, np.ndarray]] = None,
) -> KVCache:
    """The device buffers, allocated once (each device allocates only its shard, if `sharding` splits
    them); the step updates them in place (donated). `zeros` is the attention form's allocator
    (`AttentionForm.zeros_fn`: on CPU, pages the OS zeroes when first touched). An 8-bit dtype needs
    `scales`, (K, V) f32[num_layers, num_kv_heads] (`jaxcb.kv_scales`), placed like the buffers."""
    shape = kv_cache_shape(model, num_blocks, block_size)
    quantized = jnp.dtype(dtype) in QUANTIZED_CACHE_DTYPES.values()
    if quantized != (scales is not None):
        raise ValueError(f"a {cache_dtype_name(dtype)} cache takes scales iff it is 8-bit (scales given: "
                         f"{scales is not None})")
    k_scale = v_scale = None
    if scales is not None:
        want = (model.num_layers, model.num_kv_heads)
        if any(np.shape(s) != want for s in scales):
            raise ValueError(f"KV scales {[np.shape(s) for s in scales]} must be [num_layers, num_kv_heads] = {want}")
        k_scale, v_scale = (jax.device_put(np.asarray(s, np.float32), sharding) for s in scales)
    return KVCache(k=zeros(shape, dtype, sharding), v=zeros(shape, dtype, sharding), k_scale=k_scale, v_scale=v_scale)


def allocate_planned_kv_cache(
    model: LlamaConfig, plan: KVCachePlan, sharding: Optional[Sharding] = None,
    zeros: Callable[..., jax.Array] = zeros_buffer, scales: Optional[tuple[np.ndarray, np.ndarray]] = None,
) -> KVCache:
    log.info(plan.describe())
    try:
        # Waited for here: an allocation that fails is reported when the buffer is first used, which
        # would otherwise be the first step, with every later step failing the same way.
        return jax.block_until_ready(
            allocate_kv_cache(model, plan.num_blocks, plan.block_size, plan.dtype, sharding, zeros, scales))
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        lower = ("lower cache.num_blocks" if plan.source == "cache.num_blocks"
                 else "lower cache.memory_fraction or set cache.num_blocks")
        raise ConfigError(
            f"the KV cache ({plan.describe()}) could not be allocated: {str(e).splitlines()[0]}; {lower}") from e


@dataclasses.dataclass(eq=False)  # compared by identity: its fields are arrays
class PendingCopy:
    """Device blocks gathered for host blocks, on their way to host memory (`HostBlocks.offload`)."""

    host_ids: list[int]
    k: jax.Array  # [num_layers, num_kv_heads, SWAP_CHUNK, block_size, head_dim], on the device
    v: jax.Array
    # The same blocks on their way to host memory: `k`/`v` themselves (copy_to_host_async), or their
    # copies in pinned host memory (device_put to memory_kind="pinned_host": the accelerator's DMA).
    host_k: Optional[jax.Array] = None
    host_v: Optional[jax.Array] = None

    def landing(self) -> tuple[jax.Array, jax.Array]:
        return (self.k, self.v) if self.host_k is None else (self.host_k, self.host_v)

    def is_ready(self) -> bool:
        return all(x.is_ready() for x in self.landing())


HOST_TRANSFERS = ("pinned_host", "copy_to_host")
# Copies out still on their way that a step's collection leaves pending (each holds its gathered blocks
# on the device, SWAP_CHUNK of them) before the oldest are landed, waiting for them.
MAX_PENDING_COPIES = 8


def default_host_transfer(device: Optional[jax.Device] = None) -> str:
    """How blocks go to host memory: into pinned host buffers on an accelerator that has them (a DMA the
    step does not wait for), else `copy_to_host_async` (the CPU, whose device memory is host memory)."""
    device = device or jax.local_devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if device.platform != "cpu" and "pinned_host" in kinds else "copy_to_host"


class HostBlocks:
    """Preallocated host memory for whole KV blocks, indexed by host block id (0 unused): the swap space of
    preempted sequences, or the prefix cache's host tier.

    Copies out (`offload`) never wait: the device gathers the blocks and starts their transfer to host
    memory (on an accelerator into pinned host buffers, `memory_kind="pinned_host"`), and the step that
    follows is dispatched at once; the bytes land (`land_finished`) when a later step is collected, once
    their transfer has finished (usually that very step's collection: the step overwrites the blocks
    the gather read, so it normally runs after it; on a loaded CPU the gather was once seen to finish
    later). A copy back (`restore`) of a host block whose bytes have not landed takes them from the
    gathered device arrays instead, so it never waits either. `num_blocking_lands` counts landings that
    found a transfer unfinished (the engine thread waited): it stays 0 unless more than
    `MAX_PENDING_COPIES` copies are on their way at once.
    """

    def __init__(self, cache: KVCache, num_blocks: int, write_blocks: Callable[..., KVCache] = scatter_blocks,
                 transfer: Optional[str] = None):
        """`transfer`: "pinned_host" or "copy_to_host" (`default_host_transfer`: by the device)."""
        num_layers, num_kv_heads, _, block_size, head_dim = cache.k.shape
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        self.k = np.zeros(shape, cache.k.dtype)
        self.v = np.zeros(shape, cache.v.dtype)
        self.num_blocks = num_blocks
        self.bytes_per_block = 2 * self.k[:, :, 0].nbytes
        self.write_blocks = write_blocks  # the attention form's: (cache, block_ids, k, v) -> cache, donated
        self._pending: list[PendingCopy] = []  # in the order dispatched
        self.num_blocking_lands = 0
        self.transfer = transfer or default_host_transfer(next(iter(cache.k.devices())))
        if self.transfer not in HOST_TRANSFERS:
            raise ValueError(f"transfer={self.transfer!r}: one of {HOST_TRANSFERS}")

    def offload(self, cache: KVCache, pairs: list[tuple[int, int]]) -> list[PendingCopy]:
        """Start copying device blocks to host blocks: pairs of (device block, host block). Returns the
        copies, which `land` finishes."""
        copies = []
        for i in range(0, len(pairs), SWAP_CHUNK):
            chunk = pairs[i : i + SWAP_CHUNK]
            dev = np.zeros(SWAP_CHUNK, np.int32)
            dev[: len(chunk)] = [d for d, _ in chunk]
            k, v = gather_blocks(cache, jnp.asarray(dev))
            host_k = host_v = None
            if self.transfer == "pinned_host":
                host_k, host_v = (jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) for x in (k, v))
            else:
                for x in (k, v):
                    x.copy_to_host_async()
            copies.append(PendingCopy([h for _, h in chunk], k, v, host_k, host_v))
        self._pending += copies
        return copies

    def land(self, copies: Optional[list[PendingCopy]] = None) -> None:
        """Write finished copies (default: all pending) into host memory, oldest first."""
        copies = list(self._pending) if copies is None else copies
        for copy in copies:
            if copy not in self._pending:
                continue  # landed already (by an earlier call)
            if not copy.is_ready():
                self.num_blocking_lands += 1
            n = len(copy.host_ids)
            k, v = copy.landing()
            self.k[:, :, copy.host_ids] = np.asarray(k)[:, :, :n]
            self.v[:, :, copy.host_ids] = np.asarray(v)[:, :, :n]
            self._pending.remove(copy)

    def land_finished(self) -> None:
        """Land the copies that have finished, oldest first, up to the first that has not (a later copy to
        the same host block must never land before an earlier one). What is still on its way stays
        pending -- `restore` reads such blocks from the device arrays -- unless more than
        `MAX_PENDING_COPIES` are: the oldest of those land now, waiting if they must (counted)."""
        self.land(self._pending[: max(self._num_finished(), len(self._pending) - MAX_PENDING_COPIES)])

    def _num_finished(self) -> int:
        """How many pending copies, from the oldest, have finished (up to the first that has not)."""
        done = 0
        while done < len(self._pending) and self._pending[done].is_ready():
            done += 1
        return done

    # The name swap preemption knows these by.
    swap_out = offload

    def restore(self, cache: KVCache, pairs: list[tuple[int, int]]) -> KVCache:
        """Copy host blocks back into device blocks: pairs of (host block, device block). A host block whose
        bytes are still on their way (a copy that has not finished) is read from the device arrays they are
        coming from; the finished copies land first, oldest first up to the first unfinished one (a newer
        copy of a host block landing before an older one still on its way would let the older win)."""
        self.land(self._pending[: self._num_finished()])
        in_flight = {}  # host block -> (pending copy, its row), the latest copy winning
        for copy in self._pending:
            for row, host in enumerate(copy.host_ids):
                in_flight[host] = (copy, row)
        landed = [(h, d) for h, d in pairs if h not in in_flight]
        for i in range(0, len(landed), SWAP_CHUNK):
            chunk = landed[i : i + SWAP_CHUNK]
            dev = np.zeros(SWAP_CHUNK, np.int32)  # padding rows land in the null block
            dev[: len(chunk)] = [d for _, d in chunk]
            host = np.zeros(SWAP_CHUNK, np.int64)
            host[: len(chunk)] = [h for h, _ in chunk]
            cache = self.write_blocks(cache, jnp.asarray(dev), jnp.asarray(self.k[:, :, host]), jnp.asarray(self.v[:, :, host]))
        by_copy: dict[int, tuple[PendingCopy, list[tuple[int, int]]]] = {}
        for host, dev_block in pairs:
            if host in in_flight:
                copy, row = in_flight[host]
                by_copy.setdefault(id(copy), (copy, []))[1].append((row, dev_block))
        for copy, rows in by_copy.values():  # a copy holds at most SWAP_CHUNK blocks: one write each
            dev = np.zeros(SWAP_CHUNK, np.int32)
            src = np.zeros(SWAP_CHUNK, np.int32)
            dev[: len(rows)] = [d for _, d in rows]
            src[: len(rows)] = [r for r, _ in rows]
            src = jnp.asarray(src)
            cache = self.write_blocks(cache, jnp.asarray(dev), copy.k[:, :, src], copy.v[:, :, src])
        return cache

    swap_in = restore


CPU_BLOCK_GROWTH = 4  # cache.block_growth's default with the CPU attention kernel


def cache_block_growth(cache_cfg: CacheConfig, attention_impl: str) -> int:
    """Blocks a decoding sequence takes at once (cache.block_growth; null: 4 for the CPU kernel,
    which reads runs of consecutive blocks faster, and 1 where a kernel reads whole blocks anyway)."""
    if cache_cfg.block_growth is not None:
        return cache_cfg.block_growth
    return CPU_BLOCK_GROWTH if attention_impl == "cpu" else 1


def num_swap_blocks(cache_cfg: CacheConfig, plan: "KVCachePlan") -> int:
    return int(cache_cfg.swap_space_gib * GIB // plan.bytes_per_block)
