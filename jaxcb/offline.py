"""Offline generation of a single prompt (greedy), used by scripts/generate.py and scripts/serve.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from jaxcb.cli import UserError
from jaxcb.config import Config
from jaxcb.kv_cache import plan_kv_cache
from jaxcb.model_setup import load_model_and_tokenizer
from jaxcb.reference_generate import greedy_generate


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    tokens_per_s: float


def generate_one(cfg: Config, prompt: str, max_tokens: int) -> GenerationResult:
    model, model_cfg, tokenizer = load_model_and_tokenizer(cfg.model, cfg.attention)
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise UserError("generate.prompt is empty; give some text to complete")
    max_model_len = cfg.engine.max_model_len or model_cfg.max_position_embeddings
    if len(prompt_ids) + max_tokens > max_model_len:
        raise UserError(
            f"the prompt ({len(prompt_ids)} tokens) + generate.max_tokens={max_tokens} exceeds "
            f"engine.max_model_len={max_model_len}; shorten the prompt or lower generate.max_tokens"
        )
    plan = plan_kv_cache(cfg.cache, model_cfg, max_model_len=max_model_len, max_num_seqs=1)
    logging.getLogger(__name__).info(plan.describe())
    start = time.perf_counter()
    result = greedy_generate(
        model,
        prompt_ids,
        max_tokens,
        block_size=plan.block_size,
        cache_dtype=plan.dtype,
        eos_token_ids=tokenizer.eos_token_ids,
        num_cache_blocks=plan.num_blocks,
    )
    elapsed = time.perf_counter() - start
    return GenerationResult(
        text=tokenizer.decode(result.token_ids),
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        tokens_per_s=len(result.token_ids) / elapsed,
    )
