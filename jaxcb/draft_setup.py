"""Start-up of speculative decoding's draft model (speculative.method=draft): load it, check that it
shares the served model's tokenizer, and say what each cache block costs it.

The draft runs beside the served model (`jaxcb.runner.draft_runner`), proposing token ids the
served model verifies, so both must mean the same thing by every id: the same vocabulary size
and the same tokens (a tokenizer's vocabulary compared entry by entry). Anything else is refused
at start-up, naming both models.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import jax.numpy as jnp

from jaxcb.backends import Backend
from jaxcb.config import Config, ConfigError, ModelConfig, resolve_draft_model
from jaxcb.kv_cache import default_cache_dtype, step_activation_bytes
from jaxcb.model.config import LlamaConfig
from jaxcb.model.llama import StepWeights
from jaxcb.model_setup import load_model_and_tokenizer
from jaxcb.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DraftModel:
    config: ModelConfig
    backend: Backend
    weights: StepWeights
    cache_dtype: jnp.dtype

    def bytes_per_block(self, block_size: int) -> int:
        """The draft's K/V bytes in one cache block (every block id has one in each model's buffers)."""
        return self.backend.cfg.kv_bytes_per_token(jnp.dtype(self.cache_dtype).itemsize) * block_size

    def reserve_bytes(self, block_size: int, *, max_proposals: int, num_speculative_tokens: int,
                      max_num_batched_tokens: int) -> int:
        """What the draft's runner takes on the device besides the weights and its K/V for the cache's
        blocks, for the cache plan to leave room for (`jaxcb.runner.draft_runner.DraftRunner`): each
        proposing row's scratch blocks, the q of every draft (f32[P * k, V]), and its steps' workspace
        (the sync step over a whole token budget, the propose loop over P rows)."""
        k = num_speculative_tokens
        scratch_blocks = max_proposals * (-(-(k + 1) // block_size) + 1)
        q_bytes = 4 * max_proposals * k * self.backend.cfg.vocab_size
        return (scratch_blocks * self.bytes_per_block(block_size) + q_bytes
                + step_activation_bytes(self.backend.cfg, max_num_batched_tokens, max_proposals))


def tokenizer_vocabulary(tokenizer: Tokenizer) -> Any:
    """What a tokenizer means by each id: an HF tokenizer's token -> id map (added tokens included), or a
    byte-level tokenizer's bytes per id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.get_vocab(with_added_tokens=True)
    if hasattr(tokenizer, "token_bytes"):
        return list(tokenizer.token_bytes)
    return type(tokenizer).__name__


def load_draft_model(cfg: Config, target: LlamaConfig, target_tokenizer: Tokenizer, max_model_len: int) -> DraftModel:
    """The draft model of `speculative.draft_model`, prepared for its backend; ConfigError when its
    vocabulary is not the served model's."""
    m = resolve_draft_model(cfg.speculative.draft_model)
    model, backend, tokenizer = load_model_and_tokenizer(m, cfg.attention)
    problems = []
    if backend.cfg.vocab_size != target.vocab_size:
        problems.append(f"its vocabulary has {backend.cfg.vocab_size} ids, model={cfg.model.name}'s {target.vocab_size}")
    if tokenizer_vocabulary(tokenizer) != tokenizer_vocabulary(target_tokenizer):
        problems.append(f"its tokenizer ({type(tokenizer).__name__}) maps tokens to ids differently from "
                        f"model={cfg.model.name}'s ({type(target_tokenizer).__name__})")
    if problems:
        raise ConfigError(f"speculative.draft_model={m.name} must share model={cfg.model.name}'s tokenizer: "
                          + "; ".join(problems))
    if max_model_len > backend.cfg.max_position_embeddings:
        log.warning("speculative.draft_model=%s was trained for %d positions, fewer than max_model_len=%d: its "
                    "proposals past them are poorer (never wrong: the served model verifies them)",
                    m.name, backend.cfg.max_position_embeddings, max_model_len)
    # Its rotary table reaches past max_model_len by a proposal's length (a proposal near the end runs
    # k + 1 steps whatever the drafts it may keep).
    weights = backend.prepare(model, max_model_len + cfg.speculative.num_speculative_tokens + 1, None)
    del model
    gc.collect()
    cache_dtype = default_cache_dtype(cfg.cache.dtype, backend.cfg.dtype)
    return DraftModel(m, backend, weights, cache_dtype)
