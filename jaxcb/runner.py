"""SchedulerOutput -> padded step arrays -> the compiled step of the smallest bucket that fits.

Only the runner turns host lists into device arrays. A step has three static sizes: tokens
T, sequences R and block-table width W. Each comes from a short list of buckets (config, or
`default_token_buckets` -- denser on CPU, where padding costs compute -- up to the limits;
the token budget is always a bucket, so a step never pads past it), and every (T, R, W)
combination is compiled ahead of time at start-up.
Serving then only looks compiled steps up; a miss is a recompile, which is compiled,
counted and logged as an error (tests fail on it).

The step (one `jax.jit`, KV cache donated): the model over all T tokens, logits of each
sequence's last token, sampling with per-row parameters; it returns the sampled tokens
with their logprobs, packed into two arrays for the host copy. Its host-built inputs come
packed the same way, into one int32 and one float32 vector (`StepArgs`), and are cut back
into `StepInputs` inside the step.

With `unroll_layers` (`model.layer_loop=unrolled`) the runner first splits the model's stacked
decoder weights into one array per layer, in place, so that the step takes each layer's
weights as inputs of their own and runs the layers in a Python loop. With `pack_linear`
(`model.linear_impl=cpu`) it then packs those weights for the C++ matmul.

Under tensor parallelism (`tp`) every bucket is compiled for the mesh: the parameters and
the cache with their own shardings, the step's inputs and outputs replicated, and the
updated cache pinned to the cache's sharding, so a donated step hands the next one a cache
it was compiled for (no resharding, no recompile).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxcb.attention import AttentionMetadata
from jaxcb.config import EngineConfig, SchedulerConfig
from jaxcb.kv_cache import SWAP_CHUNK, HostSwapSpace, KVCache, gather_blocks, scatter_blocks
from jaxcb.model.llama import Llama
from jaxcb.sampling import SamplingArrays, needs_logits, resolve_argmax, sample
from jaxcb.scheduler import PLACEHOLDER, RunnerOutput, SampledToken, SchedulerOutput
from jaxcb.sharding import TensorParallel, fetch
from pallas_kernels.ragged_paged_attention_xla import GATHER_MAX_WIDTH

log = logging.getLogger(__name__)


def powers_up_to(limit: int, base: int, start: int) -> list[int]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= base
    return out + [limit]


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]
    seqs: tuple[int, ...]  # () -> one sequence bucket per token bucket: min(tokens, max_num_seqs)
    widths: tuple[int, ...]
    max_num_seqs: int

    def seqs_for(self, num_tokens_bucket: int) -> list[int]:
        if not self.seqs:
            return [min(num_tokens_bucket, self.max_num_seqs)]
        return sorted({min(r, num_tokens_bucket) for r in self.seqs})

    def all(self) -> list[tuple[int, int, int]]:
        return [(t, r, w) for t in self.tokens for r in self.seqs_for(t) for w in self.widths]

    def pick(self, num_tokens: int, num_seqs: int, width: int) -> tuple[int, int, int]:
        t = next(b for b in self.tokens if b >= num_tokens)
        r = next(b for b in self.seqs_for(t) if b >= num_seqs)
        w = next(b for b in self.widths if b >= width)
        return t, r, w


def default_token_buckets(budget: int, platform: str) -> list[int]:
    """On an accelerator a small step costs what reading the weights costs, padded or not, so
    powers of two from 16 keep the compile count low. On CPU a step's time grows with its
    padded tokens (its matmuls are compute-bound from a few rows on), so the buckets start at
    1 and add the midpoints (x1.5) of every power of two: a padded token costs up to a third
    of a step instead of a half, in decode steps and in the last chunk of a prefill alike.
    Even where the weights' reads bound a step (a few rows), padding 1 token to 4 costs ~15%
    on `small`."""
    if platform != "cpu":
        return powers_up_to(budget, 2, min(16, budget))
    powers = powers_up_to(budget, 2, 1)
    mids = [p * 3 // 2 for p in powers if p * 3 // 2 < budget]
    return sorted(set(powers) | set(mids))


def make_buckets(
    engine: EngineConfig, sched: SchedulerConfig, max_blocks_per_seq: int, attention: str, platform: str | None = None
) -> Buckets:
    budget, max_seqs = sched.max_num_batched_tokens, sched.max_num_seqs
    default = default_token_buckets(budget, platform or jax.default_backend())
    tokens = sorted(set(engine.token_buckets or default) | {budget})
    seqs = sorted(set(engine.seq_buckets) | {max_seqs}) if engine.seq_buckets else []
    if engine.context_buckets:
        widths = sorted(set(min(w, max_blocks_per_seq) for w in engine.context_buckets) | {max_blocks_per_seq})
    elif attention == "xla":
        # Tables up to GATHER_MAX_WIDTH blocks are gathered whole (cost follows the width); wider
        # ones are read pair by pair (cost follows the real context), so one more width is enough.
        widths = sorted({min(GATHER_MAX_WIDTH, max_blocks_per_seq), max_blocks_per_seq})
    else:  # the kernel and the reference read only up to each kv_len: no need to bucket
        widths = [max_blocks_per_seq]
    return Buckets(tuple(tokens), tuple(s for s in seqs if s <= max_seqs), tuple(widths), max_seqs)


@dataclasses.dataclass(frozen=True)
class StepStats:
    num_tokens: int  # real tokens in the step
    num_padded_tokens: int  # its token bucket
    num_prefill_tokens: int
    num_decode_tokens: int


@dataclasses.dataclass
class StepInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    md: AttentionMetadata
    logits_indices: jax.Array  # i32[R]: each sequence's last new token
    sampling: SamplingArrays
    history: jax.Array  # i32[R, max_model_len] (zeros unless a row uses penalties)
    num_prompt: jax.Array  # i32[R]
    num_known: jax.Array  # i32[R]
    # Async scheduling: tokens the previous step drew, still on the device, fill placeholders.
    prev_tokens: jax.Array  # i32[max_rows]: the previous step's sampled token of each of its rows
    prev_rows: jax.Array  # i32[T]: for a placeholder input token, its row in the previous step; else -1
    history_fix: jax.Array  # i32[R, 2]: (position, previous row) of a placeholder in the history; -1: none


jax.tree_util.register_dataclass(
    StepInputs,
    data_fields=[f.name for f in dataclasses.fields(StepInputs)],
    meta_fields=[],
)


class StepArgs(NamedTuple):
    """A step's inputs as the executable takes them: the host-built arrays packed into one int32
    and one float32 vector (each argument is a separate copy into the runtime, ~10 us apiece
    on CPU, and a step has ~30 of them), then the two that may already be device arrays."""

    ints: np.ndarray  # i32[N]: every int32, uint32 (bit for bit) and bool (0/1) field, flattened
    floats: np.ndarray  # f32[M]: every float32 field, flattened
    history: jax.Array
    prev_tokens: jax.Array


def _packed_fields(x: StepInputs) -> list:
    """The fields that travel packed, in a fixed order (the pytree's, without the two apart)."""
    return jax.tree_util.tree_leaves(dataclasses.replace(x, history=None, prev_tokens=None))


def packed_sizes(x: StepInputs) -> tuple[int, int]:
    """(ints, floats) lengths of StepArgs for inputs of x's shapes."""
    sizes = [(a.dtype == np.float32, math.prod(a.shape)) for a in _packed_fields(x)]
    return sum(n for f, n in sizes if not f), sum(n for f, n in sizes if f)


def pack_step_inputs(x: StepInputs) -> StepArgs:
    fields = _packed_fields(x)
    ints = [a.reshape(-1).view(np.int32) if a.dtype == np.uint32 else a.reshape(-1).astype(np.int32, copy=False)
            for a in fields if a.dtype != np.float32]
    floats = [a.reshape(-1) for a in fields if a.dtype == np.float32]
    return StepArgs(np.concatenate(ints), np.concatenate(floats), x.history, x.prev_tokens)


def unpack_step_inputs(like: StepInputs, ints: jax.Array, floats: jax.Array, history, prev_tokens) -> StepInputs:
    """Inside the step: StepInputs shaped as `like` (abstract), cut back out of the packed vectors."""
    skeleton = dataclasses.replace(like, history=None, prev_tokens=None)
    fields, treedef = jax.tree_util.tree_flatten(skeleton)
    out, at_int, at_float = [], 0, 0
    for a in fields:
        n = math.prod(a.shape)
        if a.dtype == jnp.float32:
            v, at_float = floats[at_float : at_float + n], at_float + n
        else:
            v, at_int = ints[at_int : at_int + n], at_int + n
            if a.dtype == jnp.uint32:
                v = jax.lax.bitcast_convert_type(v, jnp.uint32)
            elif a.dtype == jnp.bool_:
                v = v != 0
        out.append(v.reshape(a.shape))
    x = jax.tree_util.tree_unflatten(treedef, out)
    return dataclasses.replace(x, history=history, prev_tokens=prev_tokens)


class ModelRunner:
    def __init__(
        self,
        model: Llama,
        kv_cache: KVCache,
        buckets: Buckets,
        *,
        max_model_len: int,
        max_logprobs: int,
        max_stop_token_ids: int,
        swap_space: Optional[HostSwapSpace] = None,
        tp: Optional[TensorParallel] = None,
        unroll_layers: bool = False,
        pack_linear: bool = False,
    ):
        if unroll_layers:  # before the split, so that the step's inputs are the per-layer arrays
            model.unstack_layers()
        if pack_linear:
            model.pack_linear_weights()
        model.build_rope_table(max_model_len, tp.replicated if tp is not None else None)
        self.graphdef, self.state = nnx.split(model)  # once; the step takes the state as an argument
        self.tp = tp
        self.unroll_layers = unroll_layers
        self.pack_linear = pack_linear
        self.kv_cache = kv_cache
        self.buckets = buckets
        self.block_size = kv_cache.block_size
        self.vocab_size = model.cfg.vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.max_banned = max_stop_token_ids
        self.compiled: dict[tuple[int, int, int], object] = {}
        self.num_recompiles = 0
        self.num_steps = 0
        self.last_step = StepStats(0, 0, 0, 0)
        self.recorded: Optional[list] = None  # benchmarks: (bucket, inputs) of every step, for replay
        self.swap_space = swap_space
        graphdef, logprobs = self.graphdef, max_logprobs
        argmax = resolve_argmax(one_device=tp is None)

        max_rows = self.max_rows = max(r for _, r, _ in buckets.all())

        def step(state, kv_cache: KVCache, key: tuple[int, int, int], ints, floats, history, prev_tokens):
            x = unpack_step_inputs(self._abstract_inputs(*key), ints, floats, history, prev_tokens)
            model = nnx.merge(graphdef, state)
            from_prev = x.prev_tokens[jnp.clip(x.prev_rows, 0, max_rows - 1)]
            token_ids = jnp.where(x.prev_rows >= 0, from_prev, x.token_ids)
            fix_pos, fix_row = x.history_fix[:, 0], x.history_fix[:, 1]
            history_fix = (fix_pos, x.prev_tokens[jnp.clip(fix_row, 0, max_rows - 1)])  # -1: none
            hidden, kv_cache = model(token_ids, x.positions, kv_cache, x.md)
            want_logits = needs_logits(x.sampling, model.cfg.vocab_size)
            logits, logits_argmax = model.logits_and_argmax(hidden[x.logits_indices], want_logits)
            token, token_lp, top_ids, top_lp = sample(
                logits, x.sampling, x.history, x.num_prompt, x.num_known, logprobs, argmax, logits_argmax,
                history_fix=history_fix,
            )
            ids = jnp.concatenate([token[:, None], top_ids], axis=1)  # i32[R, 1 + n]
            lps = jnp.concatenate([token_lp[:, None], top_lp], axis=1)  # f32[R, 1 + n]
            next_prev = jnp.zeros((max_rows,), jnp.int32).at[: token.shape[0]].set(token)
            return ids, lps, next_prev, kv_cache

        if tp is None:
            self._step = jax.jit(step, donate_argnums=(1,), static_argnums=(2,))
        else:
            replicated = tp.replicated
            self._step = jax.jit(
                step, donate_argnums=(1,), static_argnums=(2,),
                out_shardings=(replicated, replicated, replicated, tp.kv_cache),
            )
        self._inputs_sharding = tp.replicated if tp is not None else None
        self._prev_tokens = jnp.zeros((max_rows,), jnp.int32, device=self._inputs_sharding)
        self._prev_row_of: dict[str, int] = {}  # request id -> its row in the last dispatched step

    # --- compilation ---------------------------------------------------------------------------

    def _abstract_inputs(self, t: int, r: int, w: int) -> StepInputs:
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
        inputs = StepInputs(
            token_ids=i32(t),
            positions=i32(t),
            md=AttentionMetadata(i32(t), i32(r + 1), i32(r), i32(r, w), i32()),
            logits_indices=i32(r),
            sampling=SamplingArrays(
                f32(r), i32(r), f32(r), f32(r), f32(r), f32(r), f32(r),
                jax.ShapeDtypeStruct((r,), jnp.uint32), i32(r), i32(r, self.max_banned),
                *(jax.ShapeDtypeStruct((), jnp.bool_) for _ in range(5)),
            ),
            history=i32(r, self.max_model_len),
            num_prompt=i32(r),
            num_known=i32(r),
            prev_tokens=i32(self.max_rows),
            prev_rows=i32(t),
            history_fix=i32(r, 2),
        )
        if self.tp is None:
            return inputs
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.tp.replicated), inputs)

    def _compile(self, key: tuple[int, int, int]):
        # Under TP the abstract state and cache carry the shardings of the real arrays.
        sharding = (lambda a: a.sharding) if self.tp is not None else (lambda a: None)
        abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding(a))  # noqa: E731
        abstract_cache = jax.tree.map(abstract, self.kv_cache)
        abstract_state = jax.tree.map(abstract, self.state)
        x = self._abstract_inputs(*key)
        num_ints, num_floats = packed_sizes(x)
        shard = self.tp.replicated if self.tp is not None else None
        ints = jax.ShapeDtypeStruct((num_ints,), jnp.int32, sharding=shard)
        floats = jax.ShapeDtypeStruct((num_floats,), jnp.float32, sharding=shard)
        return self._step.lower(abstract_state, abstract_cache, key, ints, floats, x.history, x.prev_tokens).compile()

    def compile_all(self, progress: bool = True) -> float:
        """Compile every bucket now; return the seconds it took."""
        start = time.perf_counter()
        keys = self.buckets.all()
        for key in tqdm(keys, desc="compiling step buckets", disable=not progress, unit="bucket"):
            self.compiled[key] = self._compile(key)
        if self.swap_space is not None:  # the two block-copy shapes, so that a swap never compiles
            null = jnp.zeros(SWAP_CHUNK, jnp.int32)
            k, v = gather_blocks(self.kv_cache, null)
            self.kv_cache = scatter_blocks(self.kv_cache, null, k, v)
        elapsed = time.perf_counter() - start
        log.info(
            "compiled %d step variants (tokens x seqs: %s; widths in blocks: %s; layers %s; matmul %s) in %.1f s",
            len(keys), sorted({(t, r) for t, r, _ in keys}), list(self.buckets.widths),
            "unrolled" if self.unroll_layers else "scanned", "cpu (packed)" if self.pack_linear else "xla", elapsed,
        )
        return elapsed

    def _executable(self, key: tuple[int, int, int]):
        exe = self.compiled.get(key)
        if exe is None:
            self.num_recompiles += 1
            log.error("step bucket %s was not compiled at start-up: compiling now (recompile #%d)", key, self.num_recompiles)
            exe = self.compiled[key] = self._compile(key)
        return exe

    # --- one step ------------------------------------------------------------------------------

    def build_inputs(self, out: SchedulerOutput) -> tuple[tuple[int, int, int], StepArgs]:
        # Built with whole-array numpy operations over per-sequence columns gathered in one pass:
        # with async scheduling this host work shares the CPU with the step it overlaps, so every
        # Python operation per sequence and step costs device time (a loop of ~25 numpy element
        # writes per sequence took ~0.8 ms a 64-sequence step).
        seqs = out.scheduled
        n = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        num_blocks = np.fromiter((len(s.block_ids) for s in seqs), np.int64, n)
        num_tokens = int(lens.sum())
        t, r, w = key = self.buckets.pick(num_tokens, n, int(num_blocks.max()))
        bs = self.block_size
        ends = np.cumsum(lens)
        begins = ends - lens
        starts = np.fromiter((s.start_position for s in seqs), np.int64, n)
        flat = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int32, num_tokens)
        row_of_token = np.repeat(np.arange(n), lens)
        pos = np.arange(num_tokens) - np.repeat(begins - starts, lens)

        tables = np.zeros((r, w), np.int32)
        block_rows = np.repeat(np.arange(n), num_blocks)
        block_cols = np.arange(len(block_rows)) - np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)
        tables[block_rows, block_cols] = np.fromiter(
            itertools.chain.from_iterable(s.block_ids for s in seqs), np.int32, len(block_rows)
        )
        token_ids = np.zeros(t, np.int32)
        token_ids[:num_tokens] = np.maximum(flat, 0)
        positions = np.zeros(t, np.int32)
        positions[:num_tokens] = pos
        slots = np.zeros(t, np.int32)  # padding writes go to the null block
        slots[:num_tokens] = tables[row_of_token, pos // bs] * bs + pos % bs
        qsl = np.full(r + 1, num_tokens, np.int32)
        qsl[:n] = begins
        kv_lens = np.zeros(r, np.int32)
        kv_lens[:n] = starts + lens
        logits_idx = np.zeros(r, np.int32)
        logits_idx[:n] = ends - 1
        # A sampling sequence's last token may be a placeholder drawn by the step in flight: the
        # step takes it from the device (its row there), never from these ids.
        prev_rows = np.full(t, -1, np.int32)
        waiting = flat[ends - 1] == PLACEHOLDER
        if waiting.any():
            row_of = self._prev_row_of  # a placeholder always comes from the step before
            prev_rows[(ends - 1)[waiting]] = [row_of[seqs[i].request_id] for i in np.flatnonzero(waiting)]

        params = [s.sampling_params for s in seqs]
        # Padding rows: temperature 0, top_p 1, min_p 0, repetition 1, presence 0, frequency 0.
        row_floats = np.array([[0.0, 1.0, 0.0, 1.0, 0.0, 0.0]] * r, np.float32)
        row_floats[:n] = [
            (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
            for p in params
        ]
        temperature, top_p, min_p, rep, presence, frequency = (np.ascontiguousarray(row_floats[:, j]) for j in range(6))
        row_ints = np.zeros((r, 4), np.int64)
        row_ints[:n] = [(p.top_k, s.seed & 0xFFFFFFFF, s.num_output_tokens, s.num_prompt_tokens)
                        for p, s in zip(params, seqs)]
        top_k, counters, num_prompt = (row_ints[:, j].astype(np.int32) for j in (0, 2, 3))
        seeds = row_ints[:, 1].astype(np.uint32)
        banned = np.full((r, self.max_banned), self.vocab_size, np.int32)
        num_known = np.zeros(r, np.int32)
        history_fix = np.full((r, 2), -1, np.int32)
        history = None
        for i, s in enumerate(seqs):
            if s.banned_token_ids:
                ids = s.banned_token_ids[: self.max_banned]
                banned[i, : len(ids)] = ids
            if s.history is not None:
                if history is None:
                    history = np.zeros((r, self.max_model_len), np.int32)
                history[i, : len(s.history)] = [max(0, tok) for tok in s.history]
                num_known[i] = len(s.history)
                if s.history[-1] == PLACEHOLDER:
                    history_fix[i] = (len(s.history) - 1, self._prev_row_of[s.request_id])
        any_filter = bool(np.any(top_k > 0) or np.any(top_p < 1))
        # Host arrays go to the executable as they are (packed into two, `StepArgs`): its C++ call
        # path copies them in, where a jnp.asarray or device_put per array (tens a step) cost ~4 ms
        # of Python a step on CPU. Under TP one device_put replicates them on every device (on
        # several hosts, each process supplies its own identical copy).
        sampling = SamplingArrays(
            temperature, top_k, top_p, min_p, rep, presence, frequency, seeds, counters, banned,
            any_penalty=np.asarray(history is not None),
            any_filter=np.asarray(any_filter),
            any_random=np.asarray(bool(np.any(temperature > 0))),
            any_logprobs=np.asarray(any(s.sampling_params.logprobs for s in seqs)),
            any_token_logprob=np.asarray(any(s.sampling_params.logprobs is not None for s in seqs)),
        )
        inputs = StepInputs(
            token_ids=token_ids,
            positions=positions,
            md=AttentionMetadata(
                slots, qsl, kv_lens, tables,
                np.asarray(len(seqs), np.int32),
            ),
            logits_indices=logits_idx,
            sampling=sampling,
            history=history if history is not None else self._zero_history(r),
            num_prompt=num_prompt,
            num_known=num_known,
            prev_tokens=self._prev_tokens,
            prev_rows=prev_rows,
            history_fix=history_fix,
        )
        args = pack_step_inputs(inputs)
        if self._inputs_sharding is not None:  # arrays already there (prev_tokens) are not copied
            args = jax.device_put(args, self._inputs_sharding)
        return key, args

    def _zero_history(self, r: int) -> jax.Array:
        cache = self.__dict__.setdefault("_zero_histories", {})
        if r not in cache:
            cache[r] = jnp.zeros((r, self.max_model_len), jnp.int32, device=self._inputs_sharding)
        return cache[r]

    def dispatch(self, out: SchedulerOutput) -> tuple:
        """Start the step on the device and return at once (JAX dispatch is asynchronous)."""
        if out.swap_in:
            self.kv_cache = self.swap_space.swap_in(self.kv_cache, out.swap_in)
            if self.tp is not None:  # keep the sharding the steps were compiled for (a no-op if unchanged)
                self.kv_cache = jax.device_put(self.kv_cache, self.tp.kv_cache)
        if out.swap_out:
            self.swap_space.swap_out(self.kv_cache, out.swap_out)
        key, inputs = self.build_inputs(out)
        if self.recorded is not None:
            self.recorded.append((key, inputs))
        ids, lps, self._prev_tokens, self.kv_cache = self._executable(key)(self.state, self.kv_cache, *inputs)
        num_prefill = sum(len(s.token_ids) for s in out.scheduled if s.start_position < s.num_prompt_tokens)
        self.last_step = StepStats(out.num_scheduled_tokens, key[0], num_prefill, out.num_scheduled_tokens - num_prefill)
        self._prev_row_of = {s.request_id: i for i, s in enumerate(out.scheduled)}
        self.num_steps += 1
        return out, ids, lps

    def collect(self, handle: tuple) -> RunnerOutput:
        """Wait for a dispatched step and bring its sampled tokens to the host."""
        out, ids, lps = handle
        ids, lps = fetch(ids), fetch(lps)
        sampled = {}
        for i, s in enumerate(out.scheduled):
            if not s.samples:
                continue
            n = s.sampling_params.logprobs
            top = None
            if n:
                n = min(n, self.max_logprobs)
                top = {int(tok): float(lp) for tok, lp in zip(ids[i, 1 : 1 + n], lps[i, 1 : 1 + n])}
            sampled[s.request_id] = SampledToken(int(ids[i, 0]), float(lps[i, 0]), top)
        return RunnerOutput(sampled)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.dispatch(out))
