"""Write a GGUF file out as a Hugging Face directory that jaxcb and transformers both load.

config.json (the family's model_type and keys: `jaxcb.model.families`; Gemma's caps, query scale, RoPE
bases and each layer's type) and generation_config.json
from its metadata, model.safetensors with its tensors dequantized (q/k rows in HF order) and cast
to the chosen dtype, tokenizer.json and tokenizer_config.json (with the chat template) from its
tokenizer. The GGUF is checked as loading checks it before anything is written, and tensors are
written one at a time, so the model is never whole in memory. `scripts/convert_checkpoint.py` is
the command line.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np

from jaxcb.model.config import LlamaConfig, RopeScaling
from jaxcb.model.families import FAMILIES, FULL_ATTENTION, SLIDING_ATTENTION, layer_windows
from jaxcb.model.gguf import GEMMA_WINDOW_PATTERN, read_gguf_config
from jaxcb.model.loader import open_gguf_checkpoint

SAFETENSORS_DTYPES = {"float32": ("F32", np.float32), "float16": ("F16", np.float16), "bfloat16": ("BF16", ml_dtypes.bfloat16)}


def gguf_llama_config(path: str, dtype: str) -> LlamaConfig:
    """The GGUF's architecture; the fields a family leaves unsaid (Gemma's, for the others) are Llama's."""
    values = read_gguf_config(path)
    return LlamaConfig(**{f.name: values[f.name] for f in fields(LlamaConfig) if f.name in values}, dtype=dtype)


def hf_config_json(path: str, dtype: str) -> dict[str, Any]:
    """config.json of the transformers model of the GGUF's family (LlamaForCausalLM, Qwen2ForCausalLM, ...)."""
    c = read_gguf_config(path)
    family = FAMILIES[c["architecture"]]
    rope = c["rope_scaling"]
    eos = c["eos_token_ids"] or []
    return {
        "architectures": list(family.architectures),
        "model_type": family.name,
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"],
        "num_key_value_heads": c["num_kv_heads"],
        "head_dim": c["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": _rope_scaling_json(rope),
        "max_position_embeddings": c["max_position_embeddings"],
        "tie_word_embeddings": c["tie_word_embeddings"],
        **_family_keys(family.name, c),
        "bos_token_id": c["bos_token_id"],
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype,
    }


def _rope_scaling_json(rope: Optional[RopeScaling]) -> Optional[dict[str, Any]]:
    if rope is None:
        return None
    if rope.rope_type == "linear":  # Gemma 3's full layers
        return {"rope_type": "linear", "factor": rope.factor}
    return {
        "rope_type": "llama3",
        "factor": rope.factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings,
    }


def _family_keys(family: str, c: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys by which the family differs from Llama, in the 4.x form that every
    transformers reads: a llama/qwen GGUF's window is on every layer; Gemma's layers are listed."""
    window = c["sliding_window"]
    if FAMILIES[family].gemma:
        return _gemma_keys(family, c)
    if family == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    if family == "mistral":
        return {"sliding_window": window or None}
    qwen = {"use_sliding_window": bool(window), "sliding_window": window or None, "max_window_layers": 0}
    return dict(qwen, attention_bias=False) if family == "qwen3" else qwen


def _gemma_keys(family: str, c: dict[str, Any]) -> dict[str, Any]:
    """Gemma2Config's / Gemma3TextConfig's keys, each layer's type written out (and the pattern it
    follows, for the transformers 4.x that read only that)."""
    windows = layer_windows(c["num_layers"], c["sliding_window"], c["layer_types"])
    keys = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(c["query_pre_attn_scalar"]),  # transformers 5 takes an int; a GGUF gives one
        "attn_logit_softcapping": c["attn_logit_softcap"] or None,
        "final_logit_softcapping": c["final_logit_softcap"] or None,
        "sliding_window": c["sliding_window"] or None,
        "layer_types": [SLIDING_ATTENTION if w else FULL_ATTENTION for w in windows],
        "attention_bias": False,
    }
    if family == "gemma3_text":
        keys.update(rope_local_base_freq=c["rope_local_theta"], sliding_window_pattern=GEMMA_WINDOW_PATTERN["gemma3"])
    return keys


def write_hf_side_files(path: str, out_dir: str, dtype: str = "float32") -> None:
    """config.json, generation_config.json, tokenizer.json and tokenizer_config.json from the GGUF's metadata."""
    from jaxcb.tokenizer import HFTokenizer

    config = hf_config_json(path, dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    HFTokenizer.from_gguf(path).save(out_dir)


def write_safetensors(
    out_path: str, shapes: dict[str, tuple[int, ...]], read: Callable[[str], np.ndarray], dtype: str
) -> None:
    """One .safetensors file holding `read(name)` cast to `dtype` for every name, read and written one at a time."""
    code, np_dtype = SAFETENSORS_DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        size = int(np.prod(shapes[name], dtype=np.int64)) * itemsize
        header[name] = {"dtype": code, "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(out_path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in sorted(shapes):
            value = np.ascontiguousarray(read(name), dtype=np_dtype)
            assert value.shape == tuple(shapes[name]), (name, value.shape, shapes[name])
            f.write(value.tobytes())


def convert_gguf_to_hf(path: str, out_dir: str, dtype: str = "float32") -> str:
    """Write the GGUF at `path` as an HF directory at out_dir (which must be new or empty)."""
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(SAFETENSORS_DTYPES)}")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new output directory")
    cfg = gguf_llama_config(path, dtype)
    checkpoint = open_gguf_checkpoint(cfg, path, check_tokenizer=True)  # every problem, before writing anything
    os.makedirs(out_dir, exist_ok=True)
    write_hf_side_files(path, out_dir, dtype)
    shapes = {name: info.shape for name, info in checkpoint.tensors.items()}
    write_safetensors(os.path.join(out_dir, "model.safetensors"), shapes, checkpoint.read, dtype)
    return out_dir

