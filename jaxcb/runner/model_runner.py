"""Compile and dispatch: a SchedulerOutput runs as the compiled step of the smallest bucket that fits.

Every bucket (`buckets.py`) is compiled ahead of time (`compiler.py`: the common variants at
start-up, in parallel; the rare ones after, in the background or on first use); serving then
only looks compiled steps up. A step size start-up did not plan, or an executable compiled twice,
is a recompile, which is compiled, counted and logged as an error (tests fail on it).

A step is two executables, dispatched back to back with no wait between them (`run`):

    model    per bucket (T, R, W), KV cache and slot state donated: the model
             (`jaxcb.model.llama.forward`, with the backend's layer operations and weights) over
             all T tokens, the K/V writes, the block-table updates, the tokens' penalty counts;
             it hands on the final hidden state of each row's last token [R, D] (and, in the
             prompt-logprobs variant, every token row's prompt logprobs, which need all T rows)
    sampler  per (R, sampling variant): the LM head over those rows, penalties, masks, filters,
             the draw, logprobs; it returns the sampled tokens with their logprobs, packed into
             two arrays for the host copy, and the tokens the next step reads for its in flight

Sampling compiles once per sequence bucket, not once per token bucket: most of a cold start's
compile time was the full variant's sampling, compiled into every token bucket's step. The
inputs come from `step_inputs.py` (built) and `step_args.py` (their shapes, packed: the
sampler's take no T-shaped input).

Async scheduling: `dispatch` returns at once with a `StepHandle`; `collect` waits for it. The
tokens a step samples stay on the device (`prev_tokens`) so that the next step, dispatched
before they reach the host, reads them for the tokens the scheduler marks in flight
(`ScheduledSequence.in_flight_row`, `jaxcb.core.in_flight`).

Under tensor parallelism both executables are compiled for the mesh: the weights and the cache
with their own shardings, the steps' inputs and outputs replicated, and the updated cache
pinned to the cache's sharding, so a donated step hands the next one a cache it was compiled
for (no resharding, no recompile).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxcb.backends import Backend
from jaxcb.kernels.attention import SWAP_CHUNK, KVCache
from jaxcb.kernels.attention.cache import gather_blocks
from jaxcb.kv_cache import HostBlocks, PendingCopy
from jaxcb.model.llama import StepWeights, forward
from jaxcb.model.lora import lora_row_mask, slots_and_rank, write_slot
from jaxcb.runner.buckets import BucketKey, Buckets, ModelKey, SamplerKey
from jaxcb.runner.compiler import StepCompiler
from jaxcb.kernels.attention import AttentionMetadata
from jaxcb.runner.slots import SlotState, SlotTable, empty_slot_state, write_slots
from jaxcb.runner.step_args import StepArgs, model_inputs, packed_sizes, sampler_inputs, unpack
from jaxcb.runner.step_inputs import WRITE_CHUNK, SlotWrites, StepInputBuilder
from jaxcb.sampling import SAMPLING_LEVELS, DraftRows, PenaltyCounts, StepVariant, record_tokens, sample
from jaxcb.core.step import RunnerOutput, SampledToken, SchedulerOutput
from jaxcb.sharding import TensorParallel, fetch

if TYPE_CHECKING:
    from jaxcb.runner.draft_runner import DraftRunner

log = logging.getLogger(__name__)

LEVELS_BY_LABEL = {level.label: level for level in SAMPLING_LEVELS}  # engine.sampling_variants' names
PROMPT_LOGPROBS_CHUNK = 128  # prompt rows whose logits exist at once: [128, V] f32 bounds the variant's extra memory


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: what was scheduled, and its results, still on the device until `collect`."""

    scheduled: SchedulerOutput
    bucket: BucketKey
    token_ids: jax.Array  # i32[R, 1 + max_logprobs]: the sampled token, then the top ids
    logprobs: jax.Array  # f32[R, 1 + max_logprobs]: their logprobs
    # The prompt-logprobs variant: each token row's prompt token then the top ids, and their logprobs.
    prompt_logprobs: Optional[tuple[jax.Array, jax.Array]] = None  # (i32[T, 1 + n], f32[T, 1 + n])


def prompt_logprobs(backend: Backend, weights: StepWeights, hidden: jax.Array, targets: jax.Array, n: int
                    ) -> tuple[jax.Array, jax.Array]:
    """Each token row's logprob of the prompt token after it, and its top-n: (i32[T, 1 + n] the target then
    the top ids, f32[T, 1 + n] their logprobs). The logits are formed PROMPT_LOGPROBS_CHUNK rows at a time
    (a loop, not one [T, V] array), so the variant costs at most [chunk, V] f32 more memory."""
    num_rows, dim = hidden.shape
    chunk = min(num_rows, PROMPT_LOGPROBS_CHUNK)
    pad = -num_rows % chunk
    hidden_chunks = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, dim)
    target_chunks = jnp.pad(jnp.maximum(targets, 0), (0, pad)).reshape(-1, chunk)

    def one_chunk(args):
        h, t = args
        logits = backend.logits(weights, h).astype(jnp.float32)  # f32[chunk, V]
        row_max = logits.max(axis=-1, keepdims=True)
        log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))
        top_logits, top_ids = jax.lax.top_k(logits, n)
        ids = jnp.concatenate([t[:, None], top_ids.astype(jnp.int32)], axis=1)
        chosen = jnp.concatenate([jnp.take_along_axis(logits, t[:, None], axis=-1), top_logits], axis=1)
        return ids, (chosen - row_max) - log_norm

    ids, lps = jax.lax.map(one_chunk, (hidden_chunks, target_chunks))
    return ids.reshape(-1, 1 + n)[:num_rows], lps.reshape(-1, 1 + n)[:num_rows]


class ModelRunner:
    def __init__(
        self,
        weights: StepWeights,
        backend: Backend,
        kv_cache: KVCache,
        buckets: Buckets,
        *,
        max_model_len: int,
        max_logprobs: int,
        max_stop_token_ids: int,
        max_logit_bias: int = 1,
        sampling_variants: tuple[str, ...] = ("greedy", "random", "full"),
        masked_sampling: bool = False,
        prompt_logprobs: bool = False,
        swap_space: Optional[HostBlocks] = None,
        host_tier: Optional[HostBlocks] = None,
        tp: Optional[TensorParallel] = None,
        compile_workers: int = 1,
        compile_rare_variants: str = "startup",
        compile_inline: bool = False,
        max_drafts: int = 0,
        lora_buffers=None,
        draft: Optional["DraftRunner"] = None,
    ):
        """`weights`: the model's, as `backend.prepare` made them.
        `sampling_variants`: the sampling levels compiled for every bucket (full among them);
        `masked_sampling`: also compile every bucket's masked variant (token bitmask and logit bias);
        `prompt_logprobs`: and its prompt-logprobs variant (logprobs of every prompt row, chunk by chunk);
        `compile_workers`, `compile_rare_variants`, `compile_inline`: how and when they compile (`compiler.StepCompiler`);
        `max_drafts`: speculative decoding's k (0: off), for the rows' drafts that penalties count;
        `lora_buffers`: LoRA's slot buffers (`jaxcb.model.lora.empty_lora_weights`; None: no LoRA compiled in):
        the step reads them as the backend prepares them (`weights.lora`), and each token row carries its slot;
        `draft`: the draft model's runner (speculative.method=draft): its cache follows every step's tokens
        (`DraftRunner.sync`, dispatched before the model's step), and the sampler verifies its drafts
        against the distributions it drew them from (`DraftRunner.probs`)."""
        self.backend = backend
        self.draft = draft
        self.weights = weights
        self.tp = tp
        self.lora = lora_buffers is not None
        self.lora_buffers = lora_buffers
        self.lora_shape = slots_and_rank(lora_buffers) if self.lora else None  # (slots, rank)
        self.kv_cache = kv_cache
        self.buckets = buckets
        self.max_logprobs = max_logprobs
        levels = sorted(LEVELS_BY_LABEL[name] for name in set(sampling_variants))
        self.variants: list[StepVariant] = levels + ([StepVariant.MASKED] if masked_sampling else []) + (
            [StepVariant.PROMPT_LOGPROBS] if prompt_logprobs else [])
        self.compiler = StepCompiler(
            self._lower, [BucketKey(*bucket, variant) for variant in self.variants for bucket in buckets.all()],
            workers=compile_workers, when=compile_rare_variants, inline=compile_inline,
        )
        self.num_steps = 0
        self.swap_space = swap_space
        self.host_tier = host_tier  # the prefix cache's host tier (cache.host_prefix_cache_gib)
        self.max_rows = max(bucket.num_seqs for bucket in buckets.all())
        # Twice the most rows a step has: a sequence keeps its slot while it runs, and the least
        # recently scheduled is never one of the step's own (slots.py).
        self.num_slots = 2 * self.max_rows
        replicated = tp.replicated if tp is not None else None
        self.inputs = StepInputBuilder(
            buckets, kv_cache.block_size, backend.cfg.vocab_size, max_stop_token_ids, max_logit_bias,
            self.compiler.serve, SlotTable(self.num_slots), replicated, max_drafts, lora=self.lora,
            draft_probs=draft is not None,
        )
        self.slot_state: SlotState = empty_slot_state(self.num_slots, max(buckets.widths), backend.cfg.vocab_size,
                                                      replicated)
        self._sampler_sizes = dict(max_banned=max_stop_token_ids, vocab_size=backend.cfg.vocab_size,
                                   max_logit_bias=max_logit_bias, max_drafts=max_drafts,
                                   draft_probs=draft is not None)
        self._hidden_rows_dtype: Optional[jnp.dtype] = None  # `_hidden_dtype`
        self._head_weights = backend.head_weights(weights)  # what the sampler reads of the weights
        model_step, sampler_step = self._make_model_step(), self._make_sampler_step()
        if tp is None:
            self._model_step = jax.jit(model_step, donate_argnums=(1, 2), static_argnums=(3,))
            self._sampler_step = jax.jit(sampler_step, static_argnums=(3,))
            self._write_slots = jax.jit(write_slots, donate_argnums=(0,))
        else:
            self._model_step = jax.jit(model_step, donate_argnums=(1, 2), static_argnums=(3,),
                                       out_shardings=(replicated, replicated, tp.kv_cache, replicated))
            self._sampler_step = jax.jit(sampler_step, static_argnums=(3,), out_shardings=replicated)
            self._write_slots = jax.jit(write_slots, donate_argnums=(0,), out_shardings=replicated)
        # The last dispatched step's hidden state of each row's last token [R, D], on the device: what a
        # proposer that reads the target's hidden states (an EAGLE-style head) starts from.
        self.last_hidden: Optional[jax.Array] = None
        # The last dispatched step's sampled tokens, left on the device for the next step's tokens in flight.
        self._prev_tokens = jnp.zeros((self.max_rows,), jnp.int32, device=self.inputs.sharding)

    def _make_model_step(self):
        backend, num_logprobs, max_rows, num_slots = self.backend, self.max_logprobs, self.max_rows, self.num_slots
        block_size, lora, lora_shape = self.kv_cache.block_size, self.lora, self.lora_shape

        def model_step(weights: StepWeights, kv_cache: KVCache, state: SlotState, key: ModelKey, ints, prev_tokens):
            """-> (the hidden state of each row's last token [R, D], each token row's prompt logprobs
            (i32[T, 1 + n], f32[T, 1 + n]) or None, the cache, the slot state)."""
            x = unpack(model_inputs(key, block_size=block_size, abstract=True, lora=lora), ints)
            from_prev = prev_tokens[jnp.clip(x.prev_rows, 0, max_rows - 1)]
            token_ids = jnp.where(x.prev_rows >= 0, from_prev, x.token_ids)
            slot, col, block = x.table_updates
            tables = state.block_tables.at[slot, col].set(block, mode="drop")
            block_tables = tables[x.row_slots, : key.table_width]  # i32[R, W]
            md = AttentionMetadata(x.slot_mapping, x.query_start_loc, x.kv_lens, block_tables, x.num_seqs)
            lora_mask = lora_row_mask(x.lora_ids, *lora_shape) if lora else None  # f32[T, S R]
            hidden, kv_cache = forward(backend, weights, token_ids, x.positions, kv_cache, md, lora_mask, x.lora_ids)
            # The penalties' counts: this step's tokens recorded (padding tokens dropped), whatever the
            # variant, so that one model executable serves them all (`BucketKey.model`).
            pad = jnp.array([num_slots], jnp.int32)
            token_slots = jnp.concatenate([x.row_slots, pad])[x.token_rows]
            is_output = x.positions >= jnp.concatenate([x.num_prompt, pad])[x.token_rows]
            counts = record_tokens(state.counts, token_slots, token_ids, is_output)
            prompt = None
            if x.prompt_targets is not None:
                prompt = prompt_logprobs(backend, weights, hidden, x.prompt_targets, num_logprobs)
            return hidden[x.logits_indices], prompt, kv_cache, SlotState(tables, counts)

        return model_step

    def _make_sampler_step(self):
        backend, num_logprobs, max_rows, sizes = self.backend, self.max_logprobs, self.max_rows, self._sampler_sizes

        def sampler_step(head: StepWeights, counts: Optional[PenaltyCounts], hidden: jax.Array, key: SamplerKey,
                         ints, floats, draft_probs: Optional[jax.Array] = None):
            """-> (i32[R, 1 + n] the sampled token then the top ids, f32[R, 1 + n] their logprobs, the
            sampled tokens as the next step reads them, i32[max_rows])."""
            x = unpack(sampler_inputs(key, **sizes, abstract=True), ints, floats)
            level = key.variant.sampling_level
            row_counts = None
            if level >= StepVariant.FULL:  # each row's counts, and a verify row's drafts before its token
                row_counts = PenaltyCounts(counts.seen[x.penalty_slots], counts.output_counts[x.penalty_slots])
                if x.row_drafts is not None:
                    rows = jnp.arange(x.row_drafts.shape[0])[:, None]
                    row_counts = PenaltyCounts(row_counts.seen.at[rows, x.row_drafts].set(True, mode="drop"),
                                               row_counts.output_counts.at[rows, x.row_drafts].add(1, mode="drop"))
            drafts = None
            if x.verify_draft_ids is not None:  # f32[P, V]: the draft model's distributions, a row per draft
                drafts = DraftRows(x.verify_draft_ids, draft_probs[jnp.clip(x.verify_probs_rows, 0,
                                                                            draft_probs.shape[0] - 1)])
            greedy = level == StepVariant.GREEDY
            logits, logits_argmax = backend.logits_and_argmax(head, hidden, not greedy, x.sample_rows)
            token, token_lp, top_ids, top_lp = sample(
                logits, x.sampling, level, num_logprobs, backend.argmax,
                logits_argmax if greedy else None, counts=row_counts, masks=x.masks, drafts=drafts,
            )
            ids = jnp.concatenate([token[:, None], top_ids], axis=1)  # i32[R, 1 + n]
            lps = jnp.concatenate([token_lp[:, None], top_lp], axis=1)  # f32[R, 1 + n]
            next_prev = jnp.zeros((max_rows,), jnp.int32).at[: token.shape[0]].set(token)
            return ids, lps, next_prev

        return sampler_step

    # --- compilation ---------------------------------------------------------------------------

    @property
    def compiled(self) -> dict[BucketKey, object]:
        return self.compiler.compiled

    @property
    def num_recompiles(self) -> int:
        return self.compiler.num_recompiles + (self.draft.num_recompiles if self.draft is not None else 0)

    def traceable(self, part: Union[ModelKey, SamplerKey]) -> tuple:
        """(the jitted function, its abstract arguments) of one executable of a step: shaped (and, under
        TP, sharded) like the real ones, for `.trace(*args)` or `.lower(*args)`."""
        sharding = (lambda a: a.sharding) if self.tp is not None else (lambda a: None)
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding(a)), tree)
        vector = lambda n, dtype: jax.ShapeDtypeStruct((n,), dtype, sharding=self.inputs.sharding)  # noqa: E731
        if isinstance(part, ModelKey):
            num_ints, _ = packed_sizes(model_inputs(part, block_size=self.kv_cache.block_size, abstract=True,
                                                    lora=self.lora))
            return self._model_step, (abstract(self.weights), abstract(self.kv_cache), abstract(self.slot_state), part,
                                      vector(num_ints, jnp.int32), vector(self.max_rows, jnp.int32))
        num_ints, num_floats = packed_sizes(sampler_inputs(part, **self._sampler_sizes, abstract=True))
        counts = abstract(self.slot_state.counts) if part.variant >= StepVariant.FULL else None
        hidden = jax.ShapeDtypeStruct((part.num_seqs, self.backend.cfg.hidden_size), self._hidden_dtype(),
                                      sharding=self.inputs.sharding)
        probs = None
        if self.draft is not None and part.variant >= StepVariant.RANDOM:
            probs = abstract(self.draft.probs)
        return self._sampler_step, (abstract(self._head_weights), counts, hidden, part, vector(num_ints, jnp.int32),
                                    vector(num_floats, jnp.float32), probs)

    def _lower(self, part: Union[ModelKey, SamplerKey]):
        fn, args = self.traceable(part)
        return fn.lower(*args)

    def _hidden_dtype(self) -> jnp.dtype:
        """The dtype of the hidden rows the model step hands the sampler (the activations': float32 on
        the cpu backend, the weights' dtype or float32 under XLA), from the smallest model step's trace."""
        if self._hidden_rows_dtype is None:
            fn, args = self.traceable(BucketKey(*self.buckets.all()[0], StepVariant.GREEDY).model)
            self._hidden_rows_dtype = fn.trace(*args).out_info[0].dtype
        return self._hidden_rows_dtype

    def compile_all(self, progress: bool = True) -> float:
        """Compile what start-up compiles (`StepCompiler.compile_startup`); return the seconds it took."""
        start = time.perf_counter()
        self.compiler.compile_startup(progress)
        self._write_slots_compiled = self._compile_slot_writer()
        if self.draft is not None:  # the draft's cache follows every model bucket's steps
            self.draft.compile({BucketKey(*b, v).model for v in self.variants for b in self.buckets.all()},
                               self.slot_state.block_tables)
        for host in (self.swap_space, self.host_tier):  # the block-copy shapes, so that a copy never compiles
            if host is None:
                continue
            null = jnp.zeros(SWAP_CHUNK, jnp.int32)
            k, v = gather_blocks(self.kv_cache, null)
            self.kv_cache = host.write_blocks(self.kv_cache, null, k, v)
            self.kv_cache = host.write_blocks(self.kv_cache, null, k[:, :, null], v[:, :, null])  # restore in flight
        elapsed = time.perf_counter() - start
        c = self.compiler
        startup = [v for v in self.variants if v not in c.deferred]
        log.info("compiled %d step executables on %d threads for %d buckets x %s (tokens x seqs: %s; widths in "
                 "blocks: %s; compile seconds over all threads: %s; %s; %s) in %.1f s", len(c.compiled), c.workers,
                 len(self.buckets.all()), "/".join(v.label for v in startup),
                 sorted({(b.num_tokens, b.num_seqs) for b in self.buckets.all()}), list(self.buckets.widths),
                 ", ".join(f"{label} {seconds:.1f} s" for label, seconds in c.seconds.items()),
                 f"{', '.join(v.label for v in c.deferred)} later ({c.when})" if c.deferred else "nothing deferred",
                 self.backend.describe(), elapsed)
        return elapsed

    def _compile_slot_writer(self):
        sharding = self.inputs.sharding
        abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if sharding else None)  # noqa: E731
        chunk = jax.ShapeDtypeStruct((3, WRITE_CHUNK), jnp.int32, sharding=sharding)
        resets = jax.ShapeDtypeStruct((self.buckets.max_num_seqs,), jnp.int32, sharding=sharding)
        return self._write_slots.lower(jax.tree.map(abstract, self.slot_state), chunk, resets, chunk).compile()

    def write_slots(self, writes: SlotWrites) -> None:
        """Put on the device what a step's own updates could not carry (slots.write_slots), in chunks."""
        writer = getattr(self, "_write_slots_compiled", None) or self._compile_slot_writer()
        self._write_slots_compiled = writer
        empty = np.full((3, WRITE_CHUNK), self.num_slots, np.int32)
        no_resets = np.full_like(writes.reset_slots, self.num_slots)
        for i in range(max(1, len(writes.table_updates), len(writes.counted))):
            table = writes.table_updates[i] if i < len(writes.table_updates) else empty
            counted = writes.counted[i] if i < len(writes.counted) else empty
            args = (table, writes.reset_slots if i == 0 else no_resets, counted)
            if self.inputs.sharding is not None:
                args = jax.device_put(args, self.inputs.sharding)
            self.slot_state = writer(self.slot_state, *args)

    def write_lora_slot(self, slot: int, values) -> None:
        """Put one LoRA slot's contents (`jaxcb.model.lora.slot_values`) into the slot buffers: new arrays
        (the step in flight keeps the ones it was dispatched with), the same compiled writer every time."""
        self.lora_buffers = write_slot(self.lora_buffers, jnp.int32(slot), values)
        self.weights = self.weights._replace(lora=self.backend.prepare_lora(self.lora_buffers))

    def executable(self, key: BucketKey) -> tuple:
        """The compiled executables of a bucket's step: (the model's, the sampler's); `run` calls them."""
        return self.compiler.executable(key)

    def run(self, key: BucketKey, args: StepArgs, executables: Optional[tuple] = None
            ) -> tuple[jax.Array, jax.Array, Optional[tuple[jax.Array, jax.Array]]]:
        """Dispatch one step's two executables back to back, with no wait between them (the sampler
        reads the model's hidden rows and the slot state's counts on the device): (ids i32[R, 1 + n],
        logprobs f32[R, 1 + n], each token row's prompt logprobs or None), still on the device.
        `executables`: (model, sampler) to run instead of the compiled ones (benchmarks)."""
        model, sampler = executables or self.executable(key)
        if self.draft is not None:  # before the step takes the slot state: the tables as the step finds them
            self.draft.sync(key.model, args.model_ints, args.prev_tokens, self.slot_state.block_tables)
        hidden, prompt, self.kv_cache, self.slot_state = model(self.weights, self.kv_cache, self.slot_state,
                                                               args.model_ints, args.prev_tokens)
        counts = self.slot_state.counts if key.sampler.variant >= StepVariant.FULL else None
        probs = self.draft.probs if self.draft is not None and key.sampler.variant >= StepVariant.RANDOM else None
        ids, lps, self._prev_tokens = sampler(self._head_weights, counts, hidden, args.sampler_ints,
                                              args.sampler_floats, probs)
        self.last_hidden = hidden
        return ids, lps, prompt

    # --- one step ------------------------------------------------------------------------------

    def build_inputs(self, out: SchedulerOutput) -> tuple[BucketKey, StepArgs, Optional[SlotWrites]]:
        return self.inputs.build(out, self._prev_tokens)

    def copy_blocks(self, out: SchedulerOutput) -> tuple[tuple[HostBlocks, list[PendingCopy]], ...]:
        """The step's block copies (SchedulerOutput's order: device blocks read first, then written), none
        waiting: the copies out land in host memory when the step is collected (`land_copies`)."""
        copies = []
        for host, pairs in ((self.swap_space, out.swap_out), (self.host_tier, out.offload)):
            if pairs:
                copies.append((host, host.offload(self.kv_cache, pairs)))
        written = False
        for host, pairs in ((self.swap_space, out.swap_in), (self.host_tier, out.restore)):
            if pairs:
                self.kv_cache, written = host.restore(self.kv_cache, pairs), True
        if written and self.tp is not None:  # keep the sharding the steps were compiled for (a no-op if unchanged)
            self.kv_cache = jax.device_put(self.kv_cache, self.tp.kv_cache)
        return tuple(copies)

    def land_copies(self) -> None:
        """The copies out that have finished, into host memory (those still on their way stay pending)."""
        for host in (self.swap_space, self.host_tier):
            if host is not None:
                host.land_finished()

    def dispatch(self, out: SchedulerOutput) -> StepHandle:
        """Start the step on the device and return at once (JAX dispatch is asynchronous)."""
        self.copy_blocks(out)
        key, args, writes = self.build_inputs(out)
        if writes is not None:
            self.write_slots(writes)
        ids, lps, prompt = self.run(key, args)
        self.num_steps += 1
        return StepHandle(out, key, ids, lps, prompt)

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a dispatched step and bring its sampled tokens to the host (and the blocks copied out
        before it to host memory: done by now, since the step ran after the copies read its cache)."""
        ids, lps = fetch(handle.token_ids), fetch(handle.logprobs)
        self.land_copies()
        seqs = handle.scheduled.scheduled
        num_rows = handle.scheduled.num_rows
        # Each row's token and logprob as Python numbers in one conversion each, not two per row.
        tokens, token_lps = ids[:num_rows, 0].tolist(), lps[:num_rows, 0].tolist()

        def row_token(row: int, n: Optional[int]) -> SampledToken:
            top = None
            if n:
                n = min(n, self.max_logprobs)
                top = dict(zip(ids[row, 1 : 1 + n].tolist(), lps[row, 1 : 1 + n].tolist()))
            return SampledToken(tokens[row], token_lps[row], top)

        sampled, verified = {}, {}
        row = 0
        for s in seqs:
            if s.samples:
                n = s.sampling_params.logprobs
                sampled[s.seq_id] = row_token(row, n)
                if s.draft_token_ids:  # one row per token: the target's token after each
                    verified[s.seq_id] = [sampled[s.seq_id]] + [row_token(row + j, n) for j in range(1, s.num_rows)]
            row += s.num_rows if s.draft_token_ids else 1
        prompt = {}
        if handle.prompt_logprobs is not None:
            ids, lps = fetch(handle.prompt_logprobs[0]), fetch(handle.prompt_logprobs[1])
            begin = 0
            for s in handle.scheduled.scheduled:
                if s.prompt_logprob_targets:
                    n = min(s.sampling_params.prompt_logprobs or 0, self.max_logprobs)
                    rows = range(begin, begin + len(s.prompt_logprob_targets))
                    prompt[s.seq_id] = [
                        (s.start_position + 1 + k, {int(ids[row, 0]): float(lps[row, 0]),
                                                    **{int(t): float(lp) for t, lp in zip(ids[row, 1 : 1 + n],
                                                                                          lps[row, 1 : 1 + n])}})
                        for k, row in enumerate(rows)
                    ]
                begin += len(s.token_ids)
        return RunnerOutput(sampled, prompt, verified)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.dispatch(out))
