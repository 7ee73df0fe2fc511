"""HF safetensors and Orbax checkpoints: every tensor maps to one parameter, or loading says why not."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hf_checkpoints import make_hf_llama, write_word_tokenizer
from jaxcb.config import ModelConfig
from jaxcb.model.loader import CheckpointError, convert_hf_to_orbax, load_model, save_orbax_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_config(path, dtype="float32") -> ModelConfig:
    return ModelConfig(name="hf", checkpoint=str(path), init="checkpoint", dtype=dtype)


def params_of(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def rewrite_safetensors(path, edit):
    tensors = load_file(os.path.join(path, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    make_hf_llama(str(path))
    write_word_tokenizer(str(path), 131)
    return path


def test_orbax_round_trip_is_bit_exact(hf_dir, tmp_path):
    model, _ = load_model(hf_config(hf_dir))
    save_orbax_params(model, str(tmp_path))
    shutil.copy(os.path.join(hf_dir, "config.json"), tmp_path)
    restored, _ = load_model(hf_config(tmp_path))
    a, b = params_of(model), params_of(restored)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def test_bf16_orbax_round_trip_is_bit_exact(hf_dir, tmp_path):
    model, _ = load_model(hf_config(hf_dir, dtype="bfloat16"))
    save_orbax_params(model, str(tmp_path))
    shutil.copy(os.path.join(hf_dir, "config.json"), tmp_path)
    restored, _ = load_model(hf_config(tmp_path, dtype="bfloat16"))
    for x, y in zip(jax.tree.leaves(params_of(model)), jax.tree.leaves(params_of(restored))):
        assert str(x.dtype) == "bfloat16" and np.array_equal(x.view(np.uint16), y.view(np.uint16))


def test_convert_script_writes_a_loadable_orbax_checkpoint(hf_dir, tmp_path):
    out = tmp_path / "orbax"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "convert_checkpoint.py"), str(hf_dir), str(out), "--dtype", "float32"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "params"} <= set(os.listdir(out))
    original, _ = load_model(hf_config(hf_dir))
    converted, _ = load_model(hf_config(out))
    for x, y in zip(jax.tree.leaves(params_of(original)), jax.tree.leaves(params_of(converted))):
        assert np.array_equal(x, y)


def test_convert_refuses_to_overwrite_a_non_empty_directory(hf_dir, tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_hf_to_orbax(hf_config(hf_dir), str(tmp_path))
    assert (tmp_path / "keep.txt").read_text() == "precious"


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(hf_dir, tmp_path):
    path = copy_checkpoint(hf_dir, tmp_path / "c")
    rewrite_safetensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(hf_config(path))


def test_extra_tensor_is_named(hf_dir, tmp_path):
    path = copy_checkpoint(hf_dir, tmp_path / "c")
    rewrite_safetensors(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_model(hf_config(path))


def test_misshaped_tensor_is_named_with_both_shapes(hf_dir, tmp_path):
    path = copy_checkpoint(hf_dir, tmp_path / "c")
    rewrite_safetensors(path, lambda t: t.update({"model.norm.weight": np.ones(47, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(47,\), expected \(48,\)"):
        load_model(hf_config(path))


def test_every_problem_is_listed_at_once(hf_dir, tmp_path):
    path = copy_checkpoint(hf_dir, tmp_path / "c")

    def edit(t):
        t.pop("model.embed_tokens.weight")
        t.pop("model.layers.2.input_layernorm.weight")
        t["extra.weight"] = np.ones(3, np.float32)

    rewrite_safetensors(path, edit)
    with pytest.raises(CheckpointError, match=r"3 problems") as info:
        load_model(hf_config(path))
    for name in ("model.embed_tokens.weight", "model.layers.2.input_layernorm.weight", "extra.weight"):
        assert name in str(info.value)


def test_lm_head_in_a_tied_checkpoint_is_reported(tmp_path):
    make_hf_llama(str(tmp_path), tie_word_embeddings=True)
    rewrite_safetensors(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor lm_head\.weight \(the config has tie_word_embeddings=true\)"):
        load_model(hf_config(tmp_path))


def test_orbax_checkpoint_with_wrong_shape_is_named(hf_dir, tmp_path):
    model, _ = load_model(hf_config(hf_dir))
    save_orbax_params(model, str(tmp_path))
    config = json.loads((hf_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers\.gate_proj has shape \(3, 48, 97\), expected \(3, 48, 96\)"):
        load_model(hf_config(tmp_path))


def test_index_file_naming_a_missing_shard_fails(tmp_path):
    make_hf_llama(str(tmp_path), shards=3)
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) >= 2
    os.remove(tmp_path / shards[-1])
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        load_model(hf_config(tmp_path))
