"""Reading a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`) into host arrays.

Every field PEFT writes is honoured or refused by name: `r`, `lora_alpha`, `use_rslora` (scale
alpha / sqrt(r)), `rank_pattern` / `alpha_pattern` (per-module rank and alpha), `target_modules`,
`layers_to_transform` (the layers the file has weights for) are honoured; `use_dora`, a `bias`
other than none, `modules_to_save`, `fan_in_fan_out`, targets outside q/k/v/o/gate/up/down
(embed_tokens, lm_head) and every other feature PEFT may switch on are refused. Each module's
scale is folded into its B (in float32, then cast to the model's dtype by the slot writer), so the
step computes x @ A @ B. No jax here: the device slots are `jaxcb.model.lora`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from typing import Optional

import numpy as np

from jaxcb.errors import InvalidRequestError
from jaxcb.model.config import LlamaConfig

# The projections an adapter may target, in the order the slots keep them, with their HF parent.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")

# Fields that describe or train an adapter and change nothing at inference.
_INERT_FIELDS = frozenset({
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "lora_dropout", "init_lora_weights", "megatron_core", "loftq_config", "runtime_config",
    "qalora_group_size", "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
})
_HONOURED_FIELDS = frozenset({"r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
                              "layers_to_transform", "layers_pattern"})


class LoraAdapterError(InvalidRequestError):
    """An adapter that cannot be served as it is: the message names the adapter and what does not fit."""


@dataclasses.dataclass
class LoraAdapter:
    """One adapter's weights on the host, as the slots take them."""

    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    # (layer, module) -> (A f32[in, r], B f32[r, out] with the module's scale folded in)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    digest: str  # of the config and weights: the adapter's identity in the prefix cache

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Each targetable projection's (in, out) in the base model."""
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _refusals(config: dict) -> list[str]:
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        problems.append("use_dora=true (DoRA) is not served")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config.get('bias')!r} is not served (only bias='none')")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save={config.get('modules_to_save')} is not served (whole modules replaced)")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out=true is not served (Conv1D-style weights)")
    if config.get("lora_bias"):
        problems.append("lora_bias=true is not served")
    if config.get("layers_pattern") not in (None, "layers", ["layers"]):
        problems.append(f"layers_pattern={config.get('layers_pattern')!r} is not served (Llama's layers are 'layers')")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        outside = sorted(set(targets) - set(LORA_MODULES))
        if outside:
            problems.append(f"target_modules {outside} are not served (only {', '.join(LORA_MODULES)})")
    elif isinstance(targets, str) and targets != "all-linear":
        if re.search(r"embed_tokens|lm_head", targets):
            problems.append(f"target_modules={targets!r} reaches embed_tokens/lm_head, which are not served")
    for name, value in config.items():
        if name in _INERT_FIELDS or name in _HONOURED_FIELDS or name in (
                "use_dora", "bias", "modules_to_save", "fan_in_fan_out", "lora_bias"):
            continue
        if value not in (None, False, [], {}, ""):  # a feature jaxcb does not know is switched on
            problems.append(f"{name}={value!r} is not served")
    return problems


def _fingerprint(config_bytes: bytes, weights_path: str) -> str:
    h = hashlib.sha256(config_bytes)
    with open(weights_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:32]


def load_peft_adapter(name: str, path: str, cfg: LlamaConfig, max_rank: int) -> LoraAdapter:
    """The adapter at `path` checked against the base model `cfg`; LoraAdapterError listing every problem."""
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    missing = [p for p in (config_path, weights_path) if not os.path.isfile(p)]
    if missing:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {', '.join(missing)} not found (a PEFT directory holds "
                               "adapter_config.json and adapter_model.safetensors)", "lora")
    with open(config_path, "rb") as f:
        config_bytes = f.read()
    config = json.loads(config_bytes)
    problems = _refusals(config)
    from safetensors.numpy import load_file

    tensors = load_file(weights_path)
    shapes = module_shapes(cfg)
    r_default, alpha_default = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    layers = config.get("layers_to_transform")
    layers = None if layers is None else {layers} if isinstance(layers, int) else set(layers)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(3) not in LORA_MODULES or _PARENT[m.group(3)] != m.group(2):
            problems.append(f"weight {key} is not a LoRA A/B of a q/k/v/o/gate/up/down projection")
            continue
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if layer >= cfg.num_layers:
            problems.append(f"weight {key}: the base model has {cfg.num_layers} layers")
            continue
        if layers is not None and layer not in layers:
            problems.append(f"weight {key}: layer {layer} is outside layers_to_transform={sorted(layers)}")
            continue
        parts.setdefault((layer, module), {})[which] = value
    weights, top_rank = {}, 0
    for (layer, module), ab in sorted(parts.items()):
        label = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            problems.append(f"{label} has lora_{''.join(ab)} without its pair")
            continue
        a, b = ab["A"], ab["B"]  # PEFT's nn.Linear weights: A [r, in], B [out, r]
        d_in, d_out = shapes[module]
        rank = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, rank):
            problems.append(f"{label}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base's "
                            f"{module} ({d_in} in, {d_out} out): expected [r, {d_in}] and [{d_out}, r]")
            continue
        module_name = f"model.layers.{layer}.{_PARENT[module]}.{module}"
        expected_r = int(_pattern_value(rank_pattern, module_name, r_default))
        if rank != expected_r:
            problems.append(f"{label}: rank {rank} is not the r={expected_r} adapter_config.json gives it")
            continue
        if rank > max_rank:
            problems.append(f"{label}: rank {rank} > lora.max_rank={max_rank}")
            continue
        alpha = float(_pattern_value(alpha_pattern, module_name, alpha_default))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights[(layer, module)] = (np.ascontiguousarray(a.astype(np.float32).T),
                                    np.ascontiguousarray((b.astype(np.float32) * np.float32(scale)).T))
        top_rank = max(top_rank, rank)
    if not weights and not problems:
        problems.append("it has no LoRA weights")
    if problems:
        raise LoraAdapterError(f"LoRA adapter {name!r} ({path}) cannot be served: " + "; ".join(problems), "lora")
    return LoraAdapter(name, path, top_rank, weights, _fingerprint(config_bytes, weights_path))


def check_adapter_name(name: Optional[str], base_name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or name.strip() != name:
        raise InvalidRequestError(f"lora_name={name!r} must be a non-empty word without '/'", "lora_name")
    if name == base_name:
        raise InvalidRequestError(f"lora_name={name!r} is the base model's name; give the adapter another", "lora_name")
