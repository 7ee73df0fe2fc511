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
    "engine.context_buckets=[16]",
    f"engine.compilation_cache_dir={CACHE_DIR}",
    # Most tests need only two step variants: greedy (what most run, through the backend's fused
    # argmax) and full (serves any sampling). The random level, masks and prompt logprobs (on by
    # default) would more than double every test engine's compiles; tests of them add VARIANTS.
    "engine.sampling_variants=[greedy,full]",
    "engine.masked_sampling=false",
    "engine.prompt_logprobs=false",
    # Moving the weights onto 2 MiB pages took 6 s of a float32 SmolLM2 engine's 12 s start-up here
    # (MADV_COLLAPSE copies them): tests/test_huge_pages.py tests it; the others start without it.
    "engine.huge_pages=off",
)
# The real SmolLM2 behind the servers of the serving tests (masked sampling: tool_choice and JSON schemas);
# the same overrides give the same shared_engine, built once per test process.
SMOLLM2_SERVING = ("engine.masked_sampling=true", "model=smollm2", "model.dtype=float32", "engine.max_model_len=512")
VARIANTS = ("engine.sampling_variants=[greedy,random,full]", "engine.masked_sampling=true",
            "engine.prompt_logprobs=true")  # every step variant, as by default


def make_engine(*overrides: str) -> Engine:
    return Engine(compose_config(BASE + overrides), progress=False)


@functools.lru_cache(maxsize=None)
def shared_engine(*overrides: str) -> Engine:
    """An engine reused across tests; every test must leave it with no unfinished requests."""
    return make_engine(*overrides)


def model_executables(e: Engine) -> list:
    """The engine's compiled model executables (the layers; the samplers hold the LM head only)."""
    from jaxcb.runner.buckets import ModelKey

    return [exe for part, exe in e.runner.compiled.items() if isinstance(part, ModelKey)]


def generate_first_completions(e: Engine, prompts: list, params) -> list:
    """Each prompt's first completion, in prompt order, running the engine until all finish."""
    ids = [e.add_request(p, params) for p in prompts]
    done = {}
    while e.has_unfinished_requests():
        done.update({out.request_id: out.outputs[0] for out in e.step() if out.finished})
    return [done[i] for i in ids]


def assert_same_tokens_and_logprobs(a: list, b: list, tol: float) -> None:
    import numpy as np

    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for x_top, y_top in zip(x.logprobs, y.logprobs, strict=True):
            assert x_top.keys() == y_top.keys()
            np.testing.assert_allclose(list(x_top.values()), [y_top[t] for t in x_top], rtol=tol, atol=tol)
