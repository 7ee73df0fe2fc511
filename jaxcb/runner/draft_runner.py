"""The draft model of speculative decoding (speculative.method=draft): its cache, its steps, its proposals.

The draft is a second, smaller model with the served model's tokenizer. It has paged K/V buffers
of its own, indexed by the same block ids as the served model's (a block costs both models'
bytes in the cache plan), so the block pool, prefix cache and rollback serve both at once. Two
kinds of executable, all compiled at start-up:

    sync     per model bucket, the same packed inputs as the model's step, dispatched just before
             it: the draft's forward over every token the step computes (prefill chunks, decode
             tokens, verify rows), which writes the draft's K/V where the model writes its own.
             Its cache therefore holds what the served model's holds, prefix hits and rolled-back
             drafts alike (a rejected draft's K/V is rewritten when its position is computed again).
    propose  per count of proposing sequences S (powers of two), and whether all of them are greedy
             (then nothing is drawn and no q kept): k decode steps of the draft
             (k + 1 when a last token is in flight: a `fori_loop` over one traced forward whose trip
             count is an operand) from each sequence's last known token,
             each drawing the next token greedily (temperature 0) or from the draft's softmax at the
             request's temperature; the distributions q they were drawn from stay on the device
             (`probs`, f32[P * k, V]) for the verify step's sampler (`jaxcb.sampling.DraftRows`).

Async scheduling: a decoding sequence's last token is usually still in flight when its next step
is scheduled. The draft then drafts that token too, from the tokens known, and proposes the k
tokens after its guess; the verify step reads the real token from the device. Rejection sampling
is exact for any proposal distribution, so a wrong guess only costs acceptance. The drafts come
back to the host before the step is built (the scheduler's rows carry them); that read waits for
the draft's work only.

A proposal's positions past the blocks its sequence holds write their K/V to scratch blocks of
the draft's own (ids from the plan's block count on, `SCRATCH`), which the served model never has.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.backends import Backend
from jaxcb.core.proposers import NO_PROPOSAL, Proposal, ProposalRequest
from jaxcb.kernels.attention import AttentionMetadata, KVCache
from jaxcb.kv_cache import allocate_kv_cache
from jaxcb.model.llama import StepWeights, forward
from jaxcb.runner.buckets import ModelKey
from jaxcb.runner.step_args import model_inputs, unpack

log = logging.getLogger(__name__)

DRAFT_SALT = 2  # the draft's own draws: fold_in(fold_in(key(seed), position), DRAFT_SALT), apart from the target's


def proposal_buckets(max_proposals: int) -> list[int]:
    """The counts of proposing sequences compiled: powers of two up to max_proposals, and it."""
    sizes = {max_proposals}
    n = 1
    while n < max_proposals:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


class DraftRunner:
    def __init__(self, weights: StepWeights, backend: Backend, *, num_blocks: int, block_size: int,
                 cache_dtype: jnp.dtype, num_speculative_tokens: int, max_proposals: int, max_model_len: int,
                 max_prev_rows: int):
        """`weights`: the draft's, prepared by its `backend`; `num_blocks`: the served model's cache blocks
        (the same ids); `max_proposals`: most sequences proposing in one step; `max_prev_rows`: the length
        of the model runner's vector of the previous step's tokens (`StepArgs.prev_tokens`)."""
        self.backend, self.weights = backend, weights
        self.block_size, self.k = block_size, num_speculative_tokens
        self.max_proposals = max_proposals
        self.vocab_size = backend.cfg.vocab_size
        self.max_prev_rows = max_prev_rows
        # Scratch blocks per proposing row: a proposal's k + 1 positions span at most this many blocks.
        self.scratch_per_row = -(-(self.k + 1) // block_size) + 1
        self.scratch_start = num_blocks
        self.table_width = -(-max_model_len // block_size) + self.scratch_per_row
        self.kv_cache: KVCache = allocate_kv_cache(
            backend.cfg, num_blocks + max_proposals * self.scratch_per_row, block_size, cache_dtype,
            None, backend.attention.zeros_fn)
        # q of every proposal's drafts: proposal i's draft j at row i * k + j.
        self.probs = jnp.zeros((max_proposals * self.k, self.vocab_size), jnp.float32)  # f32[P * k, V]
        self.proposal_sizes = proposal_buckets(max_proposals)
        self._sync = jax.jit(self._make_sync(), donate_argnums=(1,), static_argnums=(3,))
        self._propose = jax.jit(self._make_propose(), donate_argnums=(1,), static_argnums=(11,))
        self._compiled_sync: dict[ModelKey, object] = {}
        self._compiled_propose: dict[tuple[int, bool], object] = {}  # (proposing sequences, all greedy)
        self.num_recompiles = 0

    # --- the executables ------------------------------------------------------------------------

    def _make_sync(self):
        backend, block_size = self.backend, self.block_size

        def sync(weights: StepWeights, kv_cache: KVCache, tables: jax.Array, key: ModelKey, ints, prev_tokens):
            """The draft's K/V of the model step's tokens (the same packed inputs) -> its cache.
            `tables` i32[num_slots, W_max]: the slot tables before the step applies its updates."""
            x = unpack(model_inputs(key, block_size=block_size, abstract=True), ints)
            from_prev = prev_tokens[jnp.clip(x.prev_rows, 0, prev_tokens.shape[0] - 1)]
            token_ids = jnp.where(x.prev_rows >= 0, from_prev, x.token_ids)
            slot, col, block = x.table_updates
            tables = tables.at[slot, col].set(block, mode="drop")
            md = AttentionMetadata(x.slot_mapping, x.query_start_loc, x.kv_lens,
                                   tables[x.row_slots, : key.table_width], x.num_seqs)
            _, kv_cache = forward(backend, weights, token_ids, x.positions, kv_cache, md)
            return kv_cache

        return sync

    def _make_propose(self):
        backend, block_size, k = self.backend, self.block_size, self.k

        def propose(weights: StepWeights, kv_cache: KVCache, probs: jax.Array, tokens, positions, tables, seeds,
                    temperature, skip, num, num_steps, greedy_only: bool):
            """`num_steps` (k, or k + 1 when a row's last token is in flight: a traced bound, so one executable
            serves both) draft decode steps from each row's last known token -> (i32[S, k + 1] the tokens
            drawn, the cache, `probs` with rows [0, S * k) the q of each row's drafts skip..skip + k - 1).
            tokens, positions, skip i32[S]; tables i32[S, W]; seeds u32[S]; temperature f32[S]; num, num_steps i32[].
            `greedy_only` (static: the host knows): every row greedy, so no draw and no q (greedy rows'
            verification never reads q); `probs` comes back unchanged."""
            num_rows = tokens.shape[0]
            rows = jnp.arange(num_rows)
            valid = rows < num
            query_start_loc = jnp.minimum(jnp.arange(num_rows + 1), num).astype(jnp.int32)
            greedy = temperature == 0
            scale = jnp.where(greedy, 1.0, temperature)[:, None]

            def draw(seed, position, logits):
                key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), DRAFT_SALT)
                return jax.random.gumbel(key, logits.shape, jnp.float32)

            def one_step(j, carry):
                tok, pos, kv, drawn, q_all = carry
                block = jnp.take_along_axis(tables, (pos // block_size)[:, None], axis=1, mode="clip")[:, 0]
                slots = jnp.where(valid, block * block_size + pos % block_size, 0).astype(jnp.int32)
                md = AttentionMetadata(slots, query_start_loc, jnp.where(valid, pos + 1, 0).astype(jnp.int32),
                                       tables, num)
                hidden, kv = forward(backend, weights, tok, pos, kv, md)
                logits = backend.logits(weights, hidden).astype(jnp.float32)  # f32[S, V]
                if greedy_only:
                    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                    return nxt, pos + 1, kv, drawn.at[:, j].set(nxt), q_all
                scaled = logits / scale
                noise = jax.vmap(draw)(seeds, pos + 1, scaled)
                nxt = jnp.where(greedy, jnp.argmax(logits, axis=-1), jnp.argmax(scaled + noise, axis=-1))
                nxt = nxt.astype(jnp.int32)
                q = jax.nn.softmax(scaled, axis=-1)
                drawn = drawn.at[:, j].set(nxt)
                q_all = q_all.at[:, j].set(q)
                return nxt, pos + 1, kv, drawn, q_all

            q_shape = (num_rows, k + 1, 0 if greedy_only else probs.shape[1])
            init = (tokens, positions, kv_cache, jnp.zeros((num_rows, k + 1), jnp.int32), jnp.zeros(q_shape, jnp.float32))
            _, _, kv_cache, drawn, q_all = jax.lax.fori_loop(0, num_steps, one_step, init)
            if greedy_only:
                return drawn, kv_cache, probs
            q_drafts = jnp.take_along_axis(q_all, (skip[:, None] + jnp.arange(k)[None, :])[:, :, None], axis=1)
            probs = jax.lax.dynamic_update_slice(probs, q_drafts.reshape(num_rows * k, -1), (0, 0))
            return drawn, kv_cache, probs

        return propose

    def _propose_args(self, size: int) -> tuple:
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
        return (abstract(self.weights), abstract(self.kv_cache), abstract(self.probs), i32(size), i32(size),
                i32(size, self.table_width), jax.ShapeDtypeStruct((size,), jnp.uint32),
                jax.ShapeDtypeStruct((size,), jnp.float32), i32(size), i32(), i32())

    def _compile_propose(self, size: int, greedy_only: bool):
        return self._propose.lower(*self._propose_args(size), greedy_only).compile()

    def _sync_args(self, key: ModelKey, tables) -> tuple:
        from jaxcb.runner.step_args import packed_sizes

        abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
        num_ints, _ = packed_sizes(model_inputs(key, block_size=self.block_size, abstract=True))
        return (abstract(self.weights), abstract(self.kv_cache), abstract(tables), key,
                jax.ShapeDtypeStruct((num_ints,), jnp.int32), jax.ShapeDtypeStruct((self.max_prev_rows,), jnp.int32))

    def compile(self, model_keys: set, tables: jax.Array) -> float:
        """Compile a sync step for every model bucket and a propose step for every proposal count; seconds."""
        start = time.perf_counter()
        for key in sorted(model_keys):
            self._compiled_sync[key] = self._sync.lower(*self._sync_args(key, tables)).compile()
        for size in self.proposal_sizes:
            for greedy_only in (True, False):
                self._compiled_propose[size, greedy_only] = self._compile_propose(size, greedy_only)
        elapsed = time.perf_counter() - start
        log.info("draft model: compiled %d sync and %d propose executables (up to %d proposing sequences, k=%d) "
                 "in %.1f s", len(self._compiled_sync), len(self._compiled_propose), self.max_proposals, self.k,
                 elapsed)
        return elapsed

    # --- running them ---------------------------------------------------------------------------

    def sync(self, key: ModelKey, model_ints, prev_tokens: jax.Array, tables: jax.Array) -> None:
        """Dispatch the draft's forward over a model step's tokens (before the step: `tables` as it finds them)."""
        fn = self._compiled_sync.get(key)
        if fn is None:  # a bucket start-up did not plan: compiled now, and counted
            self.num_recompiles += 1
            log.error("draft model: a sync step for %s was not compiled at start-up; compiling it now", key)
            fn = self._compiled_sync[key] = self._sync.lower(*self._sync_args(key, tables)).compile()
        self.kv_cache = fn(self.weights, self.kv_cache, tables, model_ints, prev_tokens)

    def propose(self, rows: list[tuple[int, int, list[int], int, float, int]]) -> np.ndarray:
        """Draft for each row (last known token, its position, the sequence's block ids, seed, temperature,
        1 if its last token is in flight else 0) -> i32[len(rows), k + 1], the tokens drawn after each
        last known token (a row in flight proposes [1 : k + 1]); `probs` holds row i's q from i * k."""
        n = len(rows)
        size = next(s for s in self.proposal_sizes if s >= n)
        tokens = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int32)
        tables = np.zeros((size, self.table_width), np.int32)
        seeds = np.zeros(size, np.uint32)
        temperature = np.zeros(size, np.float32)
        skip = np.zeros(size, np.int32)
        for i, (token, position, block_ids, seed, temp, in_flight) in enumerate(rows):
            tokens[i], positions[i], seeds[i], temperature[i], skip[i] = token, position, seed, temp, in_flight
            held = min(len(block_ids), self.table_width - self.scratch_per_row)
            tables[i, :held] = block_ids[:held]
            first = self.scratch_start + i * self.scratch_per_row
            tables[i, held : held + self.scratch_per_row] = np.arange(first, first + self.scratch_per_row)
        fn = self._compiled_propose[size, not temperature.any()]
        drawn, self.kv_cache, self.probs = fn(self.weights, self.kv_cache, self.probs, tokens, positions, tables,
                                              seeds, temperature, skip, np.int32(n), np.int32(self.k + skip.max()))
        return np.asarray(drawn)[:n]


class DraftProposer:
    """The draft model behind the proposer protocol (`jaxcb.core.proposers.Proposer`)."""

    def __init__(self, runner: DraftRunner, last_hidden: Optional[Callable[[], Optional[jax.Array]]] = None):
        """`last_hidden`: the target's hidden rows of its last dispatched step (`ModelRunner.last_hidden`),
        which `ProposalRequest.hidden_row` indexes; this proposer reads the tokens only."""
        self.runner = runner
        self.last_hidden = last_hidden

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """The first max_proposals requests propose (the scheduler asks for no more: speculation stops
        past speculative.disable_by_batch_size decoding sequences); q of request i from row i * k."""
        k = self.runner.k
        chunk = requests[: self.runner.max_proposals]
        rows = []
        for r in chunk:
            in_flight = len(r.token_ids) - r.num_known
            assert in_flight <= 1, (r.seq.seq_id, in_flight)
            # The draft's draws take 32 bits (its proposals change how many tokens a step keeps, never
            # their distribution): the 64-bit seed's halves folded together, the seed itself below 2**32.
            draft_seed = (r.seq.seed ^ (r.seq.seed >> 32)) & 0xFFFFFFFF
            rows.append((r.token_ids[r.num_known - 1], r.num_known - 1, r.seq.block_ids, draft_seed,
                         r.seq.sampling_params.temperature, in_flight))
        drawn = self.runner.propose(rows)
        out = [Proposal(drawn[i, row[5] : row[5] + min(k, r.num_drafts)].tolist(), i * k)
               for i, (r, row) in enumerate(zip(chunk, rows))]
        return out + [NO_PROPOSAL] * (len(requests) - len(chunk))
