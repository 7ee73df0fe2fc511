"""One sequence at a time, greedy, through the model's paged forward: the simplest correct generator.

The baseline that tests compare batched generation against (one-request-at-a-time output).
It builds the same flat step inputs as the engine (DESIGN.md, "Data flow of one step") for a
batch of one sequence whose blocks are 1..n of its own cache, prefills the prompt (whole, or
in chunks) and then decodes one token per step, through `jaxcb.model.llama.forward` with the
backend given (default: the xla backend with the default attention form).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.backends import Backend
from flax import nnx

from jaxcb.kernels.attention import AttentionForm, AttentionMetadata, KVCache, select_attention
from jaxcb.kv_cache import NULL_BLOCK, allocate_kv_cache
from jaxcb.model.llama import Llama, StepWeights, forward


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def forward_step(backend: Backend, weights: StepWeights, kv_cache: KVCache, token_ids, positions,
                 md: AttentionMetadata, logits_indices):
    """Run the model on one flat batch; return f32[len(logits_indices), vocab] and the updated cache."""
    hidden, kv_cache = forward(backend, weights, token_ids, positions, kv_cache, md)
    return backend.logits(weights, hidden[logits_indices]), kv_cache


def prepare(model: Llama, backend: Backend | None = None, attention: AttentionForm | None = None,
            max_len: int | None = None) -> tuple[Backend, StepWeights]:
    """(backend, its weights) for `model`, which keeps its parameters: `prepare` takes over a copy of
    the module that shares its arrays. Default: the xla backend with the default attention form."""
    backend = backend or Backend(model.cfg, attention or select_attention())
    copy = nnx.merge(*nnx.split(model))
    return backend, backend.prepare(copy, max_len or model.cfg.max_position_embeddings)


def _pad_to_bucket(n: int) -> int:
    """Next power of two (at least 8), so a prompt's length does not force a new compilation."""
    return max(8, 1 << (n - 1).bit_length())


@dataclass
class SingleSequence:
    """The paged cache of one sequence, and the step inputs that extend it."""

    model: Optional[Llama]  # None: run `weights` (prepared by `backend`) as they are
    num_blocks_needed: int
    block_size: int
    cache_dtype: jnp.dtype
    num_cache_blocks: Optional[int] = None  # size of the cache; default: just enough (+ the null block)
    backend: Optional[Backend] = None  # default: the xla backend with the default attention form
    weights: Optional[StepWeights] = None  # already prepared by `backend` (an engine's: `engine.runner.weights`)
    kv_cache: KVCache = field(init=False)
    num_tokens: int = 0  # tokens whose K/V are in the cache

    def __post_init__(self):
        max_len = self.num_blocks_needed * self.block_size
        if self.weights is None:
            self.backend, self.weights = prepare(self.model, self.backend, max_len=max_len)
        num_cache_blocks = self.num_cache_blocks or self.num_blocks_needed + 1
        if num_cache_blocks < self.num_blocks_needed + 1:
            raise ValueError(
                f"the sequence needs {self.num_blocks_needed} blocks but the cache has {num_cache_blocks - 1} "
                f"(plus the null block)"
            )
        self.kv_cache = allocate_kv_cache(self.backend.cfg, num_cache_blocks, self.block_size, self.cache_dtype)
        self.block_table = np.arange(1, self.num_blocks_needed + 1, dtype=np.int32)  # block 0 is the null block

    def extend(self, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to the sequence; f32[n, vocab] logits of every new token, or of the last one."""
        n = len(token_ids)
        if self.num_tokens + n > self.num_blocks_needed * self.block_size:
            raise ValueError(f"sequence would hold {self.num_tokens + n} tokens, more than its cache allows")
        padded = _pad_to_bucket(n) if n > 1 else 1
        positions = np.zeros(padded, np.int32)
        positions[:n] = np.arange(self.num_tokens, self.num_tokens + n)
        slots = np.full(padded, NULL_BLOCK * self.block_size, np.int32)
        slots[:n] = self.block_table[positions[:n] // self.block_size] * self.block_size + positions[:n] % self.block_size
        ids = np.zeros(padded, np.int32)
        ids[:n] = token_ids
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            query_start_loc=jnp.asarray([0, n], jnp.int32),
            kv_lens=jnp.asarray([self.num_tokens + n], jnp.int32),
            block_tables=jnp.asarray(self.block_table[None, :]),
            num_seqs=jnp.asarray(1, jnp.int32),
        )
        logits_indices = np.arange(n, dtype=np.int32) if all_logits else np.asarray([n - 1], np.int32)
        logits, self.kv_cache = forward_step(
            self.backend, self.weights, self.kv_cache, jnp.asarray(ids), jnp.asarray(positions), md,
            jnp.asarray(logits_indices),
        )
        self.num_tokens += n
        return np.asarray(logits)


@dataclass
class GreedyResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS id) or "length" (max_tokens)
    logits: list[np.ndarray]  # f32[vocab] for each generated token


def greedy_generate(
    model: Optional[Llama],
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    block_size: int = 16,
    cache_dtype: jnp.dtype = jnp.float32,
    eos_token_ids: Sequence[int] = (),
    prefill_chunk: Optional[int] = None,
    num_cache_blocks: Optional[int] = None,
    backend: Optional[Backend] = None,
    weights: Optional[StepWeights] = None,
) -> GreedyResult:
    """Greedy tokens of one prompt; `model` (prepared here) or `backend` with its `weights`."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; give at least one token")
    total = len(prompt_ids) + max_tokens
    seq = SingleSequence(model, -(-total // block_size), block_size, cache_dtype, num_cache_blocks, backend, weights)
    chunk = prefill_chunk or len(prompt_ids)
    for start in range(0, len(prompt_ids), chunk):
        logits = seq.extend(prompt_ids[start : start + chunk])[-1]
    out: list[int] = []
    all_logits = []
    while True:
        token = int(np.argmax(logits))
        out.append(token)
        all_logits.append(logits)
        if token in eos_token_ids:
            return GreedyResult(out, "stop", all_logits)
        if len(out) >= max_tokens:
            return GreedyResult(out, "length", all_logits)
        logits = seq.extend([token])[-1]
