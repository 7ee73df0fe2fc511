"""Build a Llama from config: random init, a Hugging Face safetensors directory, a GGUF file, or Orbax.

Every path goes through the abstract model (`nnx.eval_shape`): its parameter tree is the
contract. A checkpoint must fill every parameter exactly once with a float tensor of the
right shape (an integer or fp8 one is a quantized weight, refused by name); otherwise loading
fails with one `CheckpointError` listing every problem, before any weight is read. HF tensors are read from memory maps one parameter at a time, so the
weights are never held twice; a GGUF's tensors come under their HF names from
`jaxcb.model.gguf`, dequantized one at a time, and take the same path. Under tensor
parallelism each parameter goes straight to its shards (`jaxcb.sharding`): a model too big
for one device is never whole on one.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcb.config import ModelConfig
from jaxcb.model.config import LlamaConfig, resolve_llama_config
from jaxcb.model.llama import Llama, build_abstract_model, build_random_model
from jaxcb.model.safetensors_io import FLOAT_DTYPES, CheckpointError, TensorInfo, index_checkpoint, read_tensor
from jaxcb.sharding import TensorParallel

log = logging.getLogger(__name__)

ORBAX_PARAMS_DIR = "params"
# Buffers that some HF checkpoints carry but that are derived from the config, not learnt; and the
# image towers of multimodal checkpoints (Gemma 3 4B and up), whose text tower alone jaxcb serves
# (a request with an image is refused at the door).
IGNORED_HF_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"
                                r"|(model\.)?(vision_tower|multi_modal_projector)\..*")
# An fp8 checkpoint's KV cache scales (per layer, or per KV head): not weights; jaxcb.kv_scales reads
# them for an 8-bit cache.dtype, and an unquantized cache needs none.
KV_SCALE_TENSORS = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)")
# Where a multimodal checkpoint keeps its text tower: transformers 4's and 5's layouts.
TEXT_TOWER_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                       ("language_model.lm_head.", "lm_head."))


def text_tower_name(name: str) -> str:
    """A tensor's name as a text-only checkpoint has it."""
    for prefix, replacement in TEXT_TOWER_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


@dataclass(frozen=True)
class HFTensorRule:
    """How one HF tensor becomes (a slice of) one of our parameters."""

    param: tuple[str, ...]  # path in the parameter tree
    layered: bool  # True: fills index [layer] of a [num_layers, ...] stacked parameter
    hf_shape: Callable[[LlamaConfig], tuple[int, ...]]
    to_param: Callable[[np.ndarray, LlamaConfig], np.ndarray]
    applies: Callable[[LlamaConfig], bool] = lambda c: True  # the architecture has this tensor


def _t(x, c):  # [out, in] -> [in, out]
    return x.T


# HF name pattern (with {i} for the layer) -> rule. One table is the whole mapping.
HF_RULES: dict[str, HFTensorRule] = {
    "model.embed_tokens.weight": HFTensorRule(
        ("embed",), False, lambda c: (c.vocab_size, c.hidden_size), lambda x, c: x
    ),
    "model.norm.weight": HFTensorRule(("final_norm",), False, lambda c: (c.hidden_size,), lambda x, c: x),
    "lm_head.weight": HFTensorRule(("lm_head",), False, lambda c: (c.vocab_size, c.hidden_size), _t),
    "model.layers.{i}.input_layernorm.weight": HFTensorRule(
        ("layers", "attn_norm"), True, lambda c: (c.hidden_size,), lambda x, c: x
    ),
    "model.layers.{i}.post_attention_layernorm.weight": HFTensorRule(
        ("layers", "mlp_norm"), True, lambda c: (c.hidden_size,), lambda x, c: x
    ),
    "model.layers.{i}.self_attn.q_proj.weight": HFTensorRule(
        ("layers", "q_proj"),
        True,
        lambda c: (c.num_heads * c.head_dim, c.hidden_size),
        lambda x, c: x.T.reshape(c.hidden_size, c.num_heads, c.head_dim),
    ),
    "model.layers.{i}.self_attn.k_proj.weight": HFTensorRule(
        ("layers", "k_proj"),
        True,
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        lambda x, c: x.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
    ),
    "model.layers.{i}.self_attn.v_proj.weight": HFTensorRule(
        ("layers", "v_proj"),
        True,
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        lambda x, c: x.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
    ),
    "model.layers.{i}.self_attn.o_proj.weight": HFTensorRule(
        ("layers", "o_proj"),
        True,
        lambda c: (c.hidden_size, c.num_heads * c.head_dim),
        lambda x, c: x.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
    ),
    "model.layers.{i}.mlp.gate_proj.weight": HFTensorRule(
        ("layers", "gate_proj"), True, lambda c: (c.intermediate_size, c.hidden_size), _t
    ),
    "model.layers.{i}.mlp.up_proj.weight": HFTensorRule(
        ("layers", "up_proj"), True, lambda c: (c.intermediate_size, c.hidden_size), _t
    ),
    "model.layers.{i}.mlp.down_proj.weight": HFTensorRule(
        ("layers", "down_proj"), True, lambda c: (c.hidden_size, c.intermediate_size), _t
    ),
    # The families' own tensors (jaxcb/model/families.py).
    "model.layers.{i}.self_attn.q_proj.bias": HFTensorRule(
        ("layers", "q_bias"), True, lambda c: (c.num_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_heads, c.head_dim), lambda c: c.qkv_bias,
    ),
    "model.layers.{i}.self_attn.k_proj.bias": HFTensorRule(
        ("layers", "k_bias"), True, lambda c: (c.num_kv_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_kv_heads, c.head_dim), lambda c: c.qkv_bias,
    ),
    "model.layers.{i}.self_attn.v_proj.bias": HFTensorRule(
        ("layers", "v_bias"), True, lambda c: (c.num_kv_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_kv_heads, c.head_dim), lambda c: c.qkv_bias,
    ),
    "model.layers.{i}.self_attn.q_norm.weight": HFTensorRule(
        ("layers", "q_norm"), True, lambda c: (c.head_dim,), lambda x, c: x, lambda c: c.qk_norm,
    ),
    "model.layers.{i}.self_attn.k_norm.weight": HFTensorRule(
        ("layers", "k_norm"), True, lambda c: (c.head_dim,), lambda x, c: x, lambda c: c.qk_norm,
    ),
    "model.layers.{i}.pre_feedforward_layernorm.weight": HFTensorRule(
        ("layers", "mlp_norm"), True, lambda c: (c.hidden_size,), lambda x, c: x, lambda c: c.sandwich_norms,
    ),
    "model.layers.{i}.post_feedforward_layernorm.weight": HFTensorRule(
        ("layers", "post_mlp_norm"), True, lambda c: (c.hidden_size,), lambda x, c: x, lambda c: c.sandwich_norms,
    ),
}
# With a norm after attention and after the MLP (Gemma), post_attention_layernorm is the former; the
# MLP's input norm is pre_feedforward_layernorm.
SANDWICH_RULES = {
    "model.layers.{i}.post_attention_layernorm.weight": HFTensorRule(
        ("layers", "post_attn_norm"), True, lambda c: (c.hidden_size,), lambda x, c: x
    ),
}


def _to_pure_dict(state) -> dict:
    # nnx.to_pure_dict replaces State.to_pure_dict in newer Flax; support both.
    return nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()


def _replace_by_pure_dict(state, pure: dict) -> None:
    if hasattr(nnx, "replace_by_pure_dict"):
        nnx.replace_by_pure_dict(state, pure)
    else:
        state.replace_by_pure_dict(pure)


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


def _expand_hf_names(cfg: LlamaConfig) -> dict[str, tuple[HFTensorRule, Optional[int]]]:
    """Every HF tensor name this architecture expects -> (rule, layer)."""
    names = {}
    for pattern, rule in HF_RULES.items():
        rule = SANDWICH_RULES.get(pattern, rule) if cfg.sandwich_norms else rule
        if rule.param == ("lm_head",) and cfg.tie_word_embeddings or not rule.applies(cfg):
            continue
        if rule.layered:
            for i in range(cfg.num_layers):
                names[pattern.format(i=i)] = (rule, i)
        else:
            names[pattern] = (rule, None)
    return names


def hf_checkpoint_problems(
    cfg: LlamaConfig, tensors: Mapping[str, TensorInfo], display: Callable[[str], str] = lambda name: name
) -> list[str]:
    """Every missing, unexpected or mis-shaped tensor, named by `display` (a GGUF's own names)."""
    expected = _expand_hf_names(cfg)
    problems = []
    for name in sorted(expected):
        rule, _ = expected[name]
        if name not in tensors:
            problems.append(f"missing tensor {display(name)}")
        elif tensors[name].shape != rule.hf_shape(cfg):
            problems.append(f"tensor {display(name)} has shape {tensors[name].shape}, expected {rule.hf_shape(cfg)}")
        elif getattr(tensors[name], "dtype_name", "F32") not in FLOAT_DTYPES:  # a GGUF's types: type_problems
            problems.append(f"tensor {display(name)} has dtype {tensors[name].dtype_name}; jaxcb reads weights of "
                            f"{', '.join(FLOAT_DTYPES)} only (a quantized checkpoint needs its unquantized original)")
    files = {getattr(info, "file", None) for info in tensors.values()}
    for name in sorted(set(tensors) - set(expected)):
        if not IGNORED_HF_TENSORS.fullmatch(name) and not KV_SCALE_TENSORS.fullmatch(name):
            hint = " (the config has tie_word_embeddings=true)" if name == "lm_head.weight" else ""
            where = f" in {os.path.basename(tensors[name].file)}" if len(files) > 1 else ""
            problems.append(f"unexpected tensor {display(name)}{where}{hint}")
    return problems


def check_hf_checkpoint(cfg: LlamaConfig, tensors: dict[str, TensorInfo]) -> None:
    """Raise CheckpointError listing every missing, unexpected or mis-shaped tensor."""
    problems = hf_checkpoint_problems(cfg, tensors)
    if problems:
        raise CheckpointError(f"checkpoint does not match the model ({len(problems)} problems): " + "; ".join(problems))


def load_hf_params(
    cfg: LlamaConfig, directory: str, abstract_state: dict, tp: Optional[TensorParallel] = None
) -> dict:
    """Pure-dict parameters filled from a HF safetensors directory (split over `tp`'s mesh if given)."""
    tensors = {text_tower_name(name): info for name, info in index_checkpoint(directory).items()}
    check_hf_checkpoint(cfg, tensors)
    return _fill_params(cfg, lambda name: read_tensor(tensors[name]), abstract_state, tp)


def open_gguf_checkpoint(cfg: LlamaConfig, path: str, check_tokenizer: bool = True):
    """The GGUF's tensors (a `GGUFCheckpoint`), checked before any is read as an HF directory's are,
    and their types and (unless model.tokenizer replaces it) its tokenizer too: one CheckpointError
    lists every problem."""
    from jaxcb.model.gguf import GGUFCheckpoint
    from jaxcb.tokenizer import gguf_tokenizer_problems

    checkpoint = GGUFCheckpoint(path, cfg.num_heads, cfg.num_kv_heads)
    problems = checkpoint.type_problems() + hf_checkpoint_problems(cfg, checkpoint.tensors, display=checkpoint.gguf_name)
    if check_tokenizer:
        problems += gguf_tokenizer_problems(path)
    if problems:
        raise CheckpointError(f"{path} does not match the model ({len(problems)} problems): " + "; ".join(problems))
    return checkpoint


def load_gguf_params(
    cfg: LlamaConfig, path: str, abstract_state: dict, tp: Optional[TensorParallel] = None, check_tokenizer: bool = True
) -> dict:
    """Pure-dict parameters filled from a GGUF file, dequantized tensor by tensor (split over `tp`'s mesh if given)."""
    checkpoint = open_gguf_checkpoint(cfg, path, check_tokenizer)
    return _fill_params(cfg, checkpoint.read, abstract_state, tp)


def _fill_params(
    cfg: LlamaConfig, read: Callable[[str], np.ndarray], abstract_state: dict, tp: Optional[TensorParallel]
) -> dict:
    """Each parameter of `abstract_state` filled from the HF tensors that `read(name)` returns."""
    by_param: dict[tuple[str, ...], list[tuple[str, HFTensorRule, Optional[int]]]] = {}
    for name, (rule, layer) in _expand_hf_names(cfg).items():
        by_param.setdefault(rule.param, []).append((name, rule, layer))
    flat_abstract = _flatten(abstract_state)
    unfilled = sorted(".".join(p) for p in set(flat_abstract) - set(by_param))
    if unfilled:
        raise CheckpointError(f"no checkpoint tensor fills parameter(s) {', '.join(unfilled)}")
    loaded = {}
    for path, target in flat_abstract.items():
        # One host buffer per parameter, filled slice by slice, then moved to the device and dropped.
        host = np.empty(target.shape, dtype=target.dtype)
        for name, rule, layer in by_param[path]:
            value = rule.to_param(read(name), cfg)
            if layer is None:
                host[...] = value
            else:
                host[layer] = value
        loaded[path] = jnp.asarray(host) if tp is None else jax.device_put(host, tp.param(path[-1], host.shape))
        del host
    return _unflatten(loaded)


def is_gguf_file(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def is_orbax_checkpoint(directory: str) -> bool:
    return os.path.isdir(os.path.join(directory, ORBAX_PARAMS_DIR))


def _orbax_tree_metadata(path: str) -> dict:
    import orbax.checkpoint as ocp

    md = ocp.StandardCheckpointer().metadata(path)
    item = getattr(md, "item_metadata", md)
    return getattr(item, "tree", item)


def load_orbax_params(directory: str, abstract_state: dict, tp: Optional[TensorParallel] = None) -> dict:
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.join(directory, ORBAX_PARAMS_DIR))
    saved = _flatten(_orbax_tree_metadata(path))
    expected = _flatten(abstract_state)
    problems = []
    for p in sorted(expected):
        name = ".".join(p)
        if p not in saved:
            problems.append(f"missing parameter {name}")
        elif tuple(saved[p].shape) != tuple(expected[p].shape):
            problems.append(f"parameter {name} has shape {tuple(saved[p].shape)}, expected {expected[p].shape}")
    problems += [f"unexpected parameter {'.'.join(p)}" for p in sorted(set(saved) - set(expected))]
    if problems:
        raise CheckpointError(f"Orbax checkpoint {path} does not match the model: " + "; ".join(problems))
    if tp is not None:  # Orbax restores each array straight into the shardings it is given
        abstract_state = jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            abstract_state, tp.params(abstract_state),
        )
    return ocp.StandardCheckpointer().restore(path, abstract_state)


def save_orbax_params(model: Llama, directory: str) -> None:
    """Write the model's parameters under DIR/params (Orbax)."""
    import orbax.checkpoint as ocp

    state = _to_pure_dict(nnx.state(model, nnx.Param))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(directory, ORBAX_PARAMS_DIR)), state)
    checkpointer.wait_until_finished()


@functools.lru_cache(maxsize=8)
def _sharded_random_init(cfg: LlamaConfig, seed: int, tp: TensorParallel) -> tuple[nnx.GraphDef, Callable]:
    """The model's graph and a jitted function that creates its random state in shards. Cached, so
    that engines built alike (a sweep, a test session) compile the initialisation once: each call
    of the function still returns fresh buffers."""
    graphdef, abstract_state = nnx.split(build_abstract_model(cfg))
    init = jax.jit(
        lambda: nnx.split(build_random_model(cfg, seed))[1], out_shardings=tp.params(abstract_state)
    )
    return graphdef, init


def build_sharded_random_model(cfg: LlamaConfig, seed: int, tp: TensorParallel) -> Llama:
    """The random model, each parameter created in its shards (the same values as `build_random_model`:
    JAX's random bits do not depend on how the output is split)."""
    graphdef, init = _sharded_random_init(cfg, seed, tp)
    return nnx.merge(graphdef, init())


def load_model(m: ModelConfig, tp: Optional[TensorParallel] = None) -> tuple[Llama, LlamaConfig]:
    """The model that `model.*` describes, with its weights on the default device, or split over `tp`'s mesh."""
    cfg = resolve_llama_config(m)
    if m.init == "random":
        log.info("model=%s: random weights (seed %d)", m.name, m.seed)
        if tp is not None:
            return build_sharded_random_model(cfg, m.seed, tp), cfg
        return build_random_model(cfg, m.seed), cfg
    assert m.checkpoint is not None  # validate_model_config guarantees it
    abstract = build_abstract_model(cfg)
    graphdef, abstract_state = nnx.split(abstract)
    pure = _to_pure_dict(abstract_state)
    if is_orbax_checkpoint(m.checkpoint):
        params = load_orbax_params(m.checkpoint, pure, tp)
    elif is_gguf_file(m.checkpoint):
        params = load_gguf_params(cfg, m.checkpoint, pure, tp, check_tokenizer=m.tokenizer is None)
    else:
        params = load_hf_params(cfg, m.checkpoint, pure, tp)
    _replace_by_pure_dict(abstract_state, params)
    log.info("model=%s: loaded %s", m.name, m.checkpoint)
    return nnx.merge(graphdef, abstract_state), cfg


CHECKPOINT_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
CHECKPOINT_SIDE_DIRS = ("additional_chat_templates",)  # a tokenizer's other named chat templates


def convert_hf_to_orbax(m: ModelConfig, out_dir: str) -> str:
    """Write an Orbax checkpoint of the HF checkpoint or GGUF file `m.checkpoint` to out_dir
    (self-describing: config.json and tokenizer files are copied, or written, beside params/)."""
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new output directory")
    model, cfg = load_model(m)
    os.makedirs(out_dir, exist_ok=True)
    if is_gguf_file(m.checkpoint):  # config.json and the tokenizer files, written from its metadata
        from jaxcb.model.gguf_to_hf import write_hf_side_files

        write_hf_side_files(m.checkpoint, out_dir, cfg.dtype)
    for name in CHECKPOINT_SIDE_FILES if os.path.isdir(m.checkpoint) else ():
        src = os.path.join(m.checkpoint, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, name))
    for name in CHECKPOINT_SIDE_DIRS if os.path.isdir(m.checkpoint) else ():
        if os.path.isdir(os.path.join(m.checkpoint, name)):
            shutil.copytree(os.path.join(m.checkpoint, name), os.path.join(out_dir, name))
    save_orbax_params(model, out_dir)
    with open(os.path.join(out_dir, "jaxcb_checkpoint.json"), "w") as f:
        json.dump({"format": "orbax", "source": os.path.abspath(m.checkpoint), "dtype": cfg.dtype}, f, indent=2)
    return out_dir
