"""The LoRA adapter door: every adapter_config.json form PEFT writes is read as PEFT applies it (the
weight deltas equal PEFT's merge), and every adapter jaxcb cannot serve exactly -- config or
weights that disagree, other methods, unreadable files -- is refused with a LoraAdapterError naming
what to change, at start-up (ConfigError) and at run time (HTTP 400 / 404), leaving nothing behind."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import requests

from engine_factory import BASE
from hf_checkpoints import make_hf_llama, write_word_tokenizer
from lora_adapters import ALL_MODULES, greedy_tokens, make_peft_adapter, merged_from_dir, weight_deltas
from server_harness import running_server
from jaxcb.config import ConfigError, LoraConfig, ModelConfig, compose_config
from jaxcb.engine import Engine, LLM
from jaxcb.errors import InvalidRequestError
from jaxcb.lora.adapter_config import PARENT
from jaxcb.lora.manager import LoraManager
from jaxcb.lora.peft import LoraAdapterError, load_peft_adapter
from jaxcb.model.config import resolve_llama_config
from jaxcb.sampling_params import SamplingParams

A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(the transformers base model, its directory, jaxcb's arch of it, a plain adapter over every projection)."""
    root = tmp_path_factory.mktemp("lora-door")
    base_dir = str(root / "base")
    model = make_hf_llama(base_dir)
    write_word_tokenizer(base_dir, 131)
    arch = resolve_llama_config(ModelConfig(name="hf", checkpoint=base_dir, init="checkpoint", dtype="float32"))
    plain = str(root / "plain")
    make_peft_adapter(model, plain, seed=3, r=4, lora_alpha=8, target_modules=ALL_MODULES)
    return model, base_dir, arch, plain


def jaxcb_deltas(adapter) -> dict:
    """{HF weight name: the f32 delta jaxcb's step adds} of a read adapter."""
    return {f"model.layers.{layer}.{PARENT[m]}.{m}.weight": (a @ b).T for (layer, m), (a, b) in adapter.weights.items()}


def assert_reads_as_peft_merges(base, path: str) -> None:
    model, _, arch, _ = base
    ours = jaxcb_deltas(load_peft_adapter("x", path, arch, max_rank=8))
    peft = weight_deltas(model, merged_from_dir(model, path))
    assert set(ours) == set(peft)
    for name, delta in peft.items():
        np.testing.assert_allclose(ours[name], delta, atol=1e-6, err_msg=name)


def mutated(src: str, dst, config=None, tensors=None, config_bytes=None, weights_bytes=None) -> str:
    """A copy of the adapter at `src` with `config(dict) -> dict` and `tensors(dict of f32 arrays) -> dict`
    applied, or with either file's bytes replaced (None: the file left out)."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst)
    with open(os.path.join(src, "adapter_config.json")) as f:
        fields = json.load(f)
    if config_bytes is None and config is not None:
        config_bytes = json.dumps(config(fields)).encode()
    elif config_bytes is None:
        config_bytes = json.dumps(fields).encode()
    if config_bytes is not False:
        with open(os.path.join(dst, "adapter_config.json"), "wb") as f:
            f.write(config_bytes)
    weights = os.path.join(dst, "adapter_model.safetensors")
    if weights_bytes is not None:
        if weights_bytes is not False:
            with open(weights, "wb") as f:
                f.write(weights_bytes)
    else:
        arrays = load_file(os.path.join(src, "adapter_model.safetensors"))
        save_file(tensors(arrays) if tensors else arrays, weights)
    return str(dst)


# --- honoured: read exactly as PEFT applies it -------------------------------------------------


@pytest.mark.parametrize("fields", [
    dict(target_modules=["self_attn.q_proj", "mlp.down_proj"]),  # a name's tail after a dot
    dict(target_modules=["model.layers.1.self_attn.q_proj", "v_proj"], layers_to_transform=[0]),  # a whole name
    dict(target_modules=r".*layers\.[02]\.self_attn\.(k|o)_proj"),  # a regex
    dict(target_modules=ALL_MODULES, exclude_modules=["q_proj", "up_proj"]),
    dict(target_modules="all-linear", exclude_modules=r".*layers\.1\..*"),
    dict(target_modules=ALL_MODULES, layers_to_transform=2, layers_pattern="model.layers"),
    dict(target_modules=ALL_MODULES, rank_pattern={r"layers\.1\..*q_proj": 2, "model.layers.2.mlp.up_proj": 3},
         alpha_pattern={"v_proj": 2.5}, use_rslora=True),
], ids=["suffix", "whole-name", "regex", "exclude-list", "exclude-regex", "layers-pattern", "patterns"])
def test_target_forms_peft_writes_are_read_as_peft_applies_them(base, tmp_path, fields):
    model = base[0]
    path = str(tmp_path / "adapter")
    make_peft_adapter(model, path, seed=5, **dict(dict(r=4, lora_alpha=8), **fields))
    assert_reads_as_peft_merges(base, path)


def bf16_copy(src: str, dst) -> str:
    """A copy of the adapter at `src` with its weights in bf16 (as PEFT saves a bf16 model's)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = os.path.join(dst, "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
    return str(dst)


def test_a_bf16_adapter_is_read_as_peft_loads_it(base, tmp_path):
    assert_reads_as_peft_merges(base, bf16_copy(base[3], tmp_path / "bf16"))


# --- refused, naming what to change ------------------------------------------------------------


def _without(*keys):
    return lambda t: {k: v for k, v in t.items() if k not in keys}


REFUSED = {
    # the weights and the config disagree: PEFT would leave the extra weights out, or a target unset
    "weights-outside-target_modules": (dict(config=lambda c: {**c, "target_modules": ["q_proj"]}),
                                       "does not target"),
    "weights-outside-layers": (dict(config=lambda c: {**c, "layers_to_transform": [0]}), "does not target"),
    "targeted-without-weights": (dict(tensors=_without(A_KEY, B_KEY)), "layers.0.q_proj has no lora_A / lora_B"),
    "no-target_modules": (dict(config=lambda c: {**c, "target_modules": None}), "target_modules is missing"),
    # other adapters than a causal LM's plain LoRA
    "task_type": (dict(config=lambda c: {**c, "task_type": "SEQ_CLS"}), "task_type='SEQ_CLS'"),
    "pissa": (dict(config=lambda c: {**c, "init_lora_weights": "pissa_niter_4"}), "path_initial_model_for_weight"),
    "olora": (dict(config=lambda c: {**c, "init_lora_weights": "olora"}), "init_lora_weights='olora'"),
    "ia3": (dict(config=lambda c: {**c, "peft_type": "IA3"}), "peft_type='IA3' is not LORA"),
    "no-peft_type": (dict(config=_without("peft_type")), 'there is no peft_type, so the kind of adapter is unknown'),
    "regex-with-layers": (dict(config=lambda c: {**c, "target_modules": ".*q_proj", "layers_to_transform": [0]}),
                          "layers_to_transform / layers_pattern cannot narrow"),
    # values PEFT could not have written
    "config-not-json": (dict(config_bytes=b"{r: 4"), "adapter_config.json is not JSON"),
    "config-a-list": (dict(config_bytes=b"[4]"), "holds list, not a JSON object"),
    "no-config": (dict(config_bytes=False), "no adapter_config.json"),
    "r-a-string": (dict(config=lambda c: {**c, "r": "4"}), "r='4' must be a positive integer"),
    "alpha-a-string": (dict(config=lambda c: {**c, "lora_alpha": "8"}), "lora_alpha='8' must be a number"),
    "rank_pattern-a-list": (dict(config=lambda c: {**c, "rank_pattern": ["q_proj"]}), "rank_pattern=['q_proj'] must"),
    "rank_pattern-bad-regex": (dict(config=lambda c: {**c, "rank_pattern": {"q_proj(": 2}}), "is not a regex"),
    "layers-a-string": (dict(config=lambda c: {**c, "layers_to_transform": "0"}), "layers_to_transform='0' must"),
    # weights that cannot be read as LoRA weights
    "weights-truncated": (dict(weights_bytes=b"\x40\x00\x00\x00\x00\x00\x00\x00{"), "not a complete safetensors"),
    "no-weights": (dict(weights_bytes=False), "no adapter_model.safetensors"),
    "int8": (dict(tensors=lambda t: {**t, A_KEY: (t[A_KEY] * 100).astype(np.int8)}), "lora_A is I8"),
    "nan": (dict(tensors=lambda t: {**t, B_KEY: t[B_KEY] * np.nan}), "NaN or infinite"),
    "adapter-name-in-keys": (dict(tensors=lambda t: {k.replace(".weight", ".default.weight"): v for k, v in t.items()}),
                             "42 tensors are not LoRA weights"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_adapter_jaxcb_cannot_serve_exactly_is_refused_naming_what_to_change(base, tmp_path, case):
    _, _, arch, plain = base
    change, named = REFUSED[case]
    path = mutated(plain, tmp_path / case, **change)
    with pytest.raises(LoraAdapterError) as e:
        load_peft_adapter("bad", path, arch, max_rank=8)
    assert named in str(e.value) and "'bad'" in str(e.value) and e.value.field == "lora_path"


def test_a_pickle_a_file_or_no_path_is_refused_naming_it(base, tmp_path):
    _, _, arch, plain = base
    pickled = tmp_path / "pickled"
    shutil.copytree(plain, pickled)
    os.rename(pickled / "adapter_model.safetensors", pickled / "adapter_model.bin")
    for path, named in ((str(pickled), "adapter_model.bin, a PyTorch pickle"),
                        (os.path.join(plain, "adapter_config.json"), "is a file"),
                        (str(tmp_path / "nowhere"), "does not exist"), (None, "must be a PEFT directory's path")):
        with pytest.raises(LoraAdapterError, match=named):
            load_peft_adapter("bad", path, arch, max_rank=8)


def test_a_refused_load_leaves_nothing_behind_and_a_name_being_unloaded_is_said_so(base, tmp_path):
    _, _, arch, plain = base
    manager = LoraManager(LoraConfig(max_loras=1, max_rank=8), arch, "base")
    manager.load("good", plain)
    bad = mutated(plain, tmp_path / "bad", config_bytes=b"{")
    with pytest.raises(LoraAdapterError):
        manager.load("bad", bad)
    assert set(manager.adapters) == {"good"} and list(manager.resident) == ["good"] and not manager.slots.slot_of
    with pytest.raises(InvalidRequestError, match=r"no LoRA adapter named 'bad' is loaded \(loaded: 'good'\)"):
        manager.unload("bad")
    manager.in_use = lambda name: True  # a request runs on it: the unload waits
    assert not manager.unload("good")
    with pytest.raises(InvalidRequestError, match="'good' is being unloaded"):
        manager.load("good", plain)
    with pytest.raises(InvalidRequestError, match="'good' is being unloaded already"):
        manager.unload("good")


def test_an_unreadable_start_up_adapter_stops_start_up_with_a_config_error(base, tmp_path):
    _, base_dir, _, plain = base
    bad = mutated(plain, tmp_path / "bad", weights_bytes=b"")
    with pytest.raises(ConfigError, match="lora.adapters: LoRA adapter 'bad'.*not a complete safetensors file"):
        LLM(compose_config(BASE + ("model=hf", f"model.checkpoint={base_dir}", f"lora.adapters={{bad: '{bad}'}}")),
            progress=False)


# --- at run time -------------------------------------------------------------------------------


def test_run_time_loads_refuse_with_400s_naming_the_problem_and_serve_what_they_load(base, tmp_path):
    """Over HTTP: an unreadable adapter is a 400 in OpenAI's error shape naming the file (not a 500),
    a bf16 adapter loads and serves transformers' tokens with it merged, and nothing is left behind."""
    model, base_dir, _, plain = base
    bf16 = bf16_copy(plain, tmp_path / "bf16")
    overrides = ("model=hf", f"model.checkpoint={base_dir}", "model.dtype=float32", "lora.enable=true",
                 "lora.max_loras=1", "lora.max_rank=8", "server.allow_runtime_lora=true",
                 "server.served_model_name=base")
    engine = Engine(compose_config(BASE + overrides), progress=False)
    bad = {"truncated": mutated(plain, tmp_path / "t", weights_bytes=b"\x01"),
           "not-json": mutated(plain, tmp_path / "j", config_bytes=b"{"),
           "int8": mutated(plain, tmp_path / "i", tensors=lambda t: {**t, A_KEY: t[A_KEY].astype(np.int8)})}
    with running_server(*overrides, engine=engine) as (url, _):
        def load(name, path):
            return requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

        for name, path in bad.items():
            r = load(name, path)
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error["param"] == "lora_path" and f"'{name}'" in error["message"], error
        assert load("base", bf16).json()["error"]["param"] == "lora_name"  # the base's name
        assert load("org/b", bf16).status_code == 200  # a Hub-style name, as vLLM takes it
        assert load("org/b", bf16).status_code == 400  # loaded already
        r = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert r.status_code == 404 and "(loaded: 'org/b')" in r.json()["error"]["message"]
        prompt = [1, 5, 9, 77, 3, 8]
        reply = requests.post(f"{url}/v1/completions", json={"model": "org/b", "prompt": prompt, "max_tokens": 6,
                                                               "temperature": 0, "ignore_eos": True}).json()
        ids = engine.tokenizer.encode(reply["choices"][0]["text"], add_special_tokens=False)
        assert ids == greedy_tokens(merged_from_dir(model, bf16), prompt, 6)
        assert requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "org/b"}).status_code == 200
    assert not engine.lora.adapters and not engine.lora.resident and engine.lora.slots.num_held == 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1


def test_an_adapters_identity_follows_the_weights_it_serves(base, tmp_path):
    """The digest in the prefix cache's root: the same weights wherever they lie give the same one, any
    changed weight another (it is taken of the arrays read, not of the file read again)."""
    _, _, arch, plain = base
    same = mutated(plain, tmp_path / "same")
    changed = mutated(plain, tmp_path / "changed", tensors=lambda t: {**t, A_KEY: t[A_KEY] * 1.5})
    digest = {p: load_peft_adapter("x", p, arch, max_rank=8).digest for p in (plain, same, changed)}
    assert digest[plain] == digest[same] != digest[changed]
