"""Stable block hashes: the same in every process, rooted in the model's identity, split by tenant."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from jaxcb.config import ModelConfig
from jaxcb.core.block_hash import block_hashes, chain_hash, model_root, salted_root
from jaxcb.model_setup import weights_fingerprint

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

# Builds engines (nothing compiled) and prints what a router needs: each one's root, and the hashes of
# one prompt's blocks as the scheduler registers them.
ENGINE_HASHES = """
import json, sys
from jaxcb.config import compose_config
from jaxcb.engine import Engine
from jaxcb.sampling_params import SamplingParams
from engine_factory import BASE

def engine(*overrides):
    return Engine(compose_config(BASE + overrides), compile_buckets=False, progress=False)

base = engine()
prompt = list(range(3, 60))
base.add_request(prompt, SamplingParams(max_tokens=1), request_id="p")
base.scheduler.schedule()  # registers the prompt's full blocks as the step is built
[seq] = base.scheduler.running
print(json.dumps({
    "root": base.prefix_cache_root.hex(),
    "registered": [h.hex() for h in seq.block_hashes],
    "in_pool": [base.block_pool.hash_of(b).hex() for b in seq.block_ids[: len(seq.block_hashes)]],
    "seed_1": engine("model.seed=1").prefix_cache_root.hex(),
    "bf16_cache": engine("cache.dtype=bfloat16").prefix_cache_root.hex(),
    "block_size_32": engine("cache.block_size=32", "engine.context_buckets=[8]").prefix_cache_root.hex(),
}))
"""


def run_with_hash_seed(seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([TESTS, REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", ENGINE_HASHES], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_with_different_hash_seeds_agree_on_every_block_hash():
    a, b = run_with_hash_seed("1"), run_with_hash_seed("4242")
    assert a == b
    assert len(a["registered"]) == 57 // 16 and a["in_pool"] == a["registered"]
    # A router computes them from the token ids and the root alone.
    assert [h.hex() for h in block_hashes(list(range(3, 60)), 16, bytes.fromhex(a["root"]))] == a["registered"]
    # The root changes with the weights, the cache's dtype and the block size.
    assert len({a["root"], a["seed_1"], a["bf16_cache"], a["block_size_32"]}) == 4


def test_a_block_hash_depends_on_every_token_before_it_and_on_the_root():
    root = model_root({"architecture": "x"})
    tokens = list(range(40))
    hashes = block_hashes(tokens, 8, root)
    assert len(hashes) == 5 and all(len(h) == 16 for h in hashes)
    changed = block_hashes([99] + tokens[1:], 8, root)
    assert all(x != y for x, y in zip(hashes, changed))  # the first token reaches every later block
    assert block_hashes(tokens[:39], 8, root) == hashes[:4]  # a partial block has no hash
    assert block_hashes(tokens, 8, model_root({"architecture": "y"}))[0] != hashes[0]
    assert chain_hash(hashes[0], tokens[8:16]) == hashes[1]
    assert model_root({"a": 1, "b": 2}) == model_root({"b": 2, "a": 1})  # key order does not matter


def test_tenant_salts_give_separate_chains_and_no_salt_is_the_models_own():
    root = model_root({"architecture": "x"})
    tokens = list(range(16))
    plain = block_hashes(tokens, 8, root)
    assert block_hashes(tokens, 8, root, None) == block_hashes(tokens, 8, root, "") == plain
    a, b = block_hashes(tokens, 8, root, "tenant-a"), block_hashes(tokens, 8, root, "tenant-b")
    assert len({plain[0], a[0], b[0]}) == 3
    assert salted_root(root, "tenant-a") != root


def write_safetensors(directory: str, seed: int) -> None:
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({"model.embed_tokens.weight": rng.standard_normal((300, 700)).astype(np.float32)},
              os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "README.md"), "w") as f:
        f.write(f"seed {seed}")


def test_weights_fingerprint_reads_the_files_cheaply_and_follows_their_contents(tmp_path):
    write_safetensors(tmp_path / "a", seed=0)
    write_safetensors(tmp_path / "b", seed=1)  # same header and size, other values
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "a")
    with open(tmp_path / "elsewhere" / "a" / "README.md", "a") as f:
        f.write("edited")  # not a weight file

    def fingerprint(path) -> dict:
        return weights_fingerprint(ModelConfig(name="hf", checkpoint=str(path), init="checkpoint"))

    assert fingerprint(tmp_path / "a") == fingerprint(tmp_path / "elsewhere" / "a")
    assert fingerprint(tmp_path / "a") != fingerprint(tmp_path / "b")
    single = tmp_path / "model.gguf"
    shutil.copy(tmp_path / "a" / "model.safetensors", single)
    assert fingerprint(single)["files"][""] == fingerprint(tmp_path / "a")["files"]["model.safetensors"]
    random_init = weights_fingerprint(ModelConfig(name="tiny", init="random", seed=3))
    assert random_init == {"init": "random", "preset": "tiny", "seed": 3}
