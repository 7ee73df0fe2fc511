"""Small engines for tests: the tiny model, a small budget and few buckets, compiled once per config."""

from __future__ import annotations

import functools
import os
import tempfile

from jaxcb.config import compose_config
from jaxcb.engine import Engine

CACHE_DIR = os.path.join(tempfile.gettempdir(), "jaxcb-test-xla-cache")
BASE = (
    "scheduler.max_num_batched_tokens=64",
    "scheduler.max_num_seqs=8",
    "engine.max_model_len=256",
    "engine.token_buckets=[16,64]",
    "engine.seq_buckets=[8]",
    "engine.context_buckets=[16]",
    f"engine.compilation_cache_dir={CACHE_DIR}",
)


def make_engine(*overrides: str) -> Engine:
    return Engine(compose_config(BASE + overrides), progress=False)


@functools.lru_cache(maxsize=None)
def shared_engine(*overrides: str) -> Engine:
    """An engine reused across tests; every test must leave it with no unfinished requests."""
    return make_engine(*overrides)
