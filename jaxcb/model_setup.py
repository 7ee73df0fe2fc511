"""Model + tokenizer from `model.*`, as every entry point needs them."""

from __future__ import annotations

import logging

from jaxcb.attention import get_attention_backend
from jaxcb.config import AttentionConfig, ModelConfig
from jaxcb.model.config import LlamaConfig
from jaxcb.model.llama import Llama
from jaxcb.model.loader import load_model
from jaxcb.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


def load_model_and_tokenizer(m: ModelConfig, attention: AttentionConfig) -> tuple[Llama, LlamaConfig, Tokenizer]:
    backend = get_attention_backend(attention)
    model, cfg = load_model(m, backend)
    tokenizer = load_tokenizer(m.tokenizer or m.checkpoint)
    if m.eos_token_ids and not tokenizer.eos_token_ids:
        tokenizer.eos_token_ids = list(m.eos_token_ids)
    log.info(
        "model=%s: %d layers, hidden %d, %d/%d heads, vocab %d, %s; tokenizer %s; attention %s",
        m.name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
        cfg.dtype, type(tokenizer).__name__, backend.name,
    )
    return model, cfg, tokenizer
