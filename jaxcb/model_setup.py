"""Model + tokenizer from `model.*`, as every entry point needs them."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from typing import Any, Optional

from jaxcb.backends import Backend, select_backend
from jaxcb.config import AttentionConfig, ModelConfig
from jaxcb.model.config import choose_model_dtype, read_checkpoint_config
from jaxcb.model.families import describe
from jaxcb.model.llama import Llama
from jaxcb.model.loader import ORBAX_PARAMS_DIR, is_orbax_checkpoint, load_model
from jaxcb.sharding import TensorParallel
from jaxcb.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


def checkpoint_eos_token_ids(directory: str) -> set[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
            ids |= {value} if isinstance(value, int) else set(value or ())
    return ids


def check_tokenizer_fits(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Warn where the tokenizer and the model's vocabulary disagree: a tokenizer larger than the
    embeddings writes ids no request may carry (each such prompt is refused by name), and an
    end-of-sequence id past the vocabulary is one the model can never draw."""
    if tokenizer.vocab_size > vocab_size:
        log.warning("the tokenizer has %d tokens but the model's vocabulary is %d: a prompt holding a token id "
                    "from %d on is refused; check that model.tokenizer belongs to this checkpoint",
                    tokenizer.vocab_size, vocab_size, vocab_size)
    unreachable = [t for t in tokenizer.eos_token_ids if t >= vocab_size]
    if unreachable:
        reachable = [t for t in tokenizer.eos_token_ids if t < vocab_size]
        log.warning("end-of-sequence ids %s lie past the model's vocabulary of %d: the model never draws them%s",
                    unreachable, vocab_size, f" (it ends replies with {reachable})" if reachable else
                    "; no reply ends but by max_tokens or a stop string")


def weights_fingerprint(m: ModelConfig) -> dict[str, Any]:
    """What the weights are, cheaply (part of the prefix cache's root, `Engine.prefix_cache_root`):
    random init by preset, seed and init; a checkpoint by each weight file's size, first MiB (the
    safetensors header, the GGUF's metadata) and 16 windows of 4 KiB spread over it -- no full
    read, and the same on every host that holds the same files, wherever they lie."""
    if m.init == "random":
        return {"init": "random", "preset": m.name, "seed": m.seed}
    path = m.checkpoint
    if os.path.isfile(path):  # GGUF
        return {"init": m.init, "files": {"": _file_fingerprint(path)}}
    if is_orbax_checkpoint(path):
        root = os.path.join(path, ORBAX_PARAMS_DIR)
        files = [f for f in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(f)]
    else:  # HF directory
        root, files = path, glob.glob(os.path.join(path, "*.safetensors"))
    return {"init": m.init, "files": {os.path.relpath(f, root): _file_fingerprint(f) for f in sorted(files)}}


def _file_fingerprint(path: str, head: int = 1 << 20, num_windows: int = 16, window: int = 4096) -> str:
    size = os.path.getsize(path)
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(head))
        for i in range(num_windows):
            f.seek(size * i // num_windows)
            h.update(f.read(window))
    return h.hexdigest()


def load_model_and_tokenizer(
    m: ModelConfig, attention: AttentionConfig, tp: Optional[TensorParallel] = None
) -> tuple[Llama, Backend, Tokenizer]:
    """The model (split over `tp`'s mesh if given), the backend that will run it, and its tokenizer
    with every end-of-sequence id."""
    model, cfg = load_model(m, tp)
    backend = select_backend(m, cfg, attention, mesh=tp.mesh if tp is not None else None)
    tokenizer = load_tokenizer(m.tokenizer or m.checkpoint)
    # End-of-sequence ids: the tokenizer's, the preset's and the checkpoint's (config.json and
    # generation_config.json list the end-of-turn ids of chat models).
    eos = set(tokenizer.eos_token_ids) | set(m.eos_token_ids or ())
    if m.checkpoint:
        eos |= checkpoint_eos_token_ids(m.checkpoint)
    tokenizer.eos_token_ids = sorted(eos)
    check_tokenizer_fits(tokenizer, cfg.vocab_size)
    checkpoint_dtype = read_checkpoint_config(m.checkpoint).get("checkpoint_dtype") if m.checkpoint else None
    _, dtype_reason = choose_model_dtype(m.dtype, checkpoint_dtype,
                                         packed_cpu_backend=m.backend != "xla" and cfg.llama_layers)
    log.info(
        "model=%s: %s, %d layers, hidden %d, %d/%d heads, vocab %d, %s (%s); tokenizer %s; %s; attention %s",
        m.name, describe(cfg.architecture, cfg.qkv_bias, cfg.qk_norm, cfg.layer_windows),
        cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
        cfg.dtype, dtype_reason, type(tokenizer).__name__, backend.describe(), backend.attention.name,
    )
    return model, backend, tokenizer
