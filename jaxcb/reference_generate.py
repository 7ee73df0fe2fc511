"""One sequence at a time, greedy, through the model's paged forward: the simplest correct generator.

This is the baseline that batched generation is compared against (one-request-at-a-time
output) and what `scripts/generate.py` runs until the engine lands. It builds the same
flat step inputs as the engine (DESIGN.md, "Data flow of one step") for a batch of one
sequence whose blocks are 1..n of its own cache, prefills the prompt (whole, or in chunks)
and then decodes one token per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcb.attention import AttentionMetadata
from jaxcb.kv_cache import NULL_BLOCK, KVCache, allocate_kv_cache
from jaxcb.model.llama import Llama


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def forward_step(graphdef, state, kv_cache: KVCache, token_ids, positions, md: AttentionMetadata, logits_indices):
    """Run the model on one flat batch; return f32[len(logits_indices), vocab] and the updated cache."""
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model(token_ids, positions, kv_cache, md)
    return model.compute_logits(hidden[logits_indices]), kv_cache


def _pad_to_bucket(n: int) -> int:
    """Next power of two (at least 8), so a prompt's length does not force a new compilation."""
    return max(8, 1 << (n - 1).bit_length())


@dataclass
class SingleSequence:
    """The paged cache of one sequence, and the step inputs that extend it."""

    model: Llama
    num_blocks_needed: int
    block_size: int
    cache_dtype: jnp.dtype
    num_cache_blocks: Optional[int] = None  # size of the cache; default: just enough (+ the null block)
    kv_cache: KVCache = field(init=False)
    num_tokens: int = 0  # tokens whose K/V are in the cache

    def __post_init__(self):
        self.graphdef, self.state = nnx.split(self.model)
        num_cache_blocks = self.num_cache_blocks or self.num_blocks_needed + 1
        if num_cache_blocks < self.num_blocks_needed + 1:
            raise ValueError(
                f"the sequence needs {self.num_blocks_needed} blocks but the cache has {num_cache_blocks - 1} "
                f"(plus the null block)"
            )
        self.kv_cache = allocate_kv_cache(self.model.cfg, num_cache_blocks, self.block_size, self.cache_dtype)
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
            self.graphdef, self.state, self.kv_cache, jnp.asarray(ids), jnp.asarray(positions), md,
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
    model: Llama,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    block_size: int = 16,
    cache_dtype: jnp.dtype = jnp.float32,
    eos_token_ids: Sequence[int] = (),
    prefill_chunk: Optional[int] = None,
    num_cache_blocks: Optional[int] = None,
) -> GreedyResult:
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; give at least one token")
    total = len(prompt_ids) + max_tokens
    seq = SingleSequence(model, -(-total // block_size), block_size, cache_dtype, num_cache_blocks)
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
