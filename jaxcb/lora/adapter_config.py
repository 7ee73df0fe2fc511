"""Reading a PEFT LoRA adapter's `adapter_config.json`: the projections of the base it adapts, each
with its rank and scale, or every field jaxcb does not honour, named.

Targets are matched as PEFT matches them (`check_target_module_exists`) against the names of a HF
Llama's modules (`model.embed_tokens`, `model.layers.3.self_attn.q_proj`, ..., `lm_head`):
`target_modules` as a list (a name equal to a module's or ending it after a dot, narrowed by
`layers_to_transform` / `layers_pattern` unless the whole name is listed), as a regex the whole
name matches, or "all-linear"; then `exclude_modules` (a list or a regex) takes names out. Each
targeted projection's rank and alpha come from `rank_pattern` / `alpha_pattern` (the first key that
ends its name), else `r` / `lora_alpha`; its scale is alpha / r, or alpha / sqrt(r) with
`use_rslora`. A target outside q/k/v/o/gate/up/down (embed_tokens, lm_head, a norm) is refused, as
are DoRA, biases, whole modules saved, fan_in_fan_out, an initialisation that changed the base's
weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA), another task's or another PEFT method's adapter, and
every other feature switched on. No tensors here (`peft.py` reads the weights), and no jax.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

# The projections an adapter may target, in the order the slots keep them, with their HF parent.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# Fields that describe or train an adapter and change nothing at inference.
_INERT_FIELDS = frozenset({
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "lora_dropout", "init_lora_weights", "megatron_core", "loftq_config", "runtime_config",
    "qalora_group_size", "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
})
_HONOURED_FIELDS = frozenset({"r", "lora_alpha", "target_modules", "exclude_modules", "use_rslora", "rank_pattern",
                              "alpha_pattern", "layers_to_transform", "layers_pattern"})
_REFUSED_FIELDS = frozenset({"use_dora", "bias", "modules_to_save", "fan_in_fan_out", "lora_bias"})
# Initialisations that take the adapter's starting product out of the base's weights: the adapter
# only fits that changed base, which is not the checkpoint served.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """What adapter_config.json says of one targeted projection."""

    rank: int
    scale: float  # folded into its B


def base_module_names(num_layers: int) -> list[str]:
    """Every module name of a HF Llama with `num_layers` layers, as PEFT sees them."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names += [layer, f"{layer}.self_attn", f"{layer}.mlp", f"{layer}.mlp.act_fn", f"{layer}.input_layernorm",
                  f"{layer}.post_attention_layernorm"]
        names += [f"{layer}.{PARENT[m]}.{m}" for m in LORA_MODULES]
    return names


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad_regex(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as e:
        return str(e)
    return None


def _type_problems(config: dict) -> list[str]:
    """Fields whose values PEFT could not have written: each named with what it must be."""
    problems = []
    if not _is_int(config.get("r", 8)) or config.get("r", 8) <= 0:
        problems.append(f"r={config.get('r')!r} must be a positive integer")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        problems.append(f"lora_alpha={alpha!r} must be a number")
    if not isinstance(config.get("use_rslora", False), bool):
        problems.append(f"use_rslora={config.get('use_rslora')!r} must be true or false")
    for field, check, what in (("rank_pattern", lambda v: _is_int(v) and v > 0, "a positive integer"),
                               ("alpha_pattern", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                                "a number")):
        patterns = config.get(field) or {}
        if not isinstance(patterns, dict):
            problems.append(f"{field}={patterns!r} must be a mapping {{module name or regex: value}}")
            continue
        for key, value in patterns.items():
            if not check(value):
                problems.append(f"{field}[{key!r}]={value!r} must be {what}")
            elif (error := _bad_regex(key)) is not None:
                problems.append(f"{field} key {key!r} is not a regex ({error})")
    targets = config.get("target_modules")
    if targets is None:
        problems.append("target_modules is missing: name the projections the adapter adapts (PEFT writes them)")
    elif not (isinstance(targets, str) or _is_str_list(targets)):
        problems.append(f"target_modules={targets!r} must be a list of module names, a regex or 'all-linear'")
    exclude = config.get("exclude_modules")
    if exclude is not None and not (isinstance(exclude, str) or _is_str_list(exclude)):
        problems.append(f"exclude_modules={exclude!r} must be a list of module names or a regex")
    for field in ("target_modules", "exclude_modules"):
        if isinstance(config.get(field), str) and (error := _bad_regex(config[field])) is not None:
            problems.append(f"{field}={config[field]!r} is not a regex ({error})")
    layers = config.get("layers_to_transform")
    if layers is not None and not (_is_int(layers) or (isinstance(layers, list) and all(map(_is_int, layers)))):
        problems.append(f"layers_to_transform={layers!r} must be a layer index or a list of them")
    pattern = config.get("layers_pattern")
    if pattern is not None and not (isinstance(pattern, str) or _is_str_list(pattern)):
        problems.append(f"layers_pattern={pattern!r} must be a name or a list of names")
    # PEFT's own LoraConfig refuses these combinations.
    if isinstance(targets, str) and (layers is not None or pattern is not None):
        problems.append("layers_to_transform / layers_pattern cannot narrow target_modules given as a regex "
                        f"({targets!r}); PEFT refuses it too")
    if pattern and layers is None:
        problems.append(f"layers_pattern={pattern!r} needs layers_to_transform; PEFT refuses it too")
    return problems


def _refusals(config: dict) -> list[str]:
    problems = []
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        problems.append(f"task_type={config['task_type']!r} is an adapter for another head than a causal LM's "
                        "(only CAUSAL_LM adapters are served)")
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
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        problems.append(f"init_lora_weights={init!r} trained the adapter over a base with its starting product taken "
                        "out of the weights, not over this checkpoint; convert it to a plain LoRA with PEFT's "
                        "save_pretrained(..., path_initial_model_for_weight_conversion=...)")
    for name, value in config.items():
        if name in _INERT_FIELDS or name in _HONOURED_FIELDS or name in _REFUSED_FIELDS:
            continue
        if value not in (None, False, [], {}, ""):  # a feature jaxcb does not know is switched on
            problems.append(f"{name}={value!r} is not served")
    return problems


def _layer_index(config: dict, key: str) -> int | None:
    """The layer index PEFT reads off a module name for layers_to_transform."""
    patterns = config.get("layers_pattern")
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    return int(match.group("idx")) if match else None


def is_targeted(config: dict, key: str) -> bool:
    """Whether PEFT puts a LoRA layer on the module named `key` (peft's check_target_module_exists)."""
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, key):
        return False
    if isinstance(exclude, list) and (key in exclude or any(key.endswith(f".{e}") for e in exclude)):
        return False
    targets = config["target_modules"]
    if targets == "all-linear":  # PEFT's expansion: every linear layer but the output embedding
        return key.rsplit(".", 1)[-1] in LORA_MODULES
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:  # a whole name listed: layers_to_transform does not narrow it
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    index = _layer_index(config, key)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def plan_modules(config: Any, num_layers: int) -> tuple[dict[tuple[int, str], ModulePlan], list[str]]:
    """{(layer, projection): its rank and scale} for every projection the adapter targets, and the
    problems (fields not honoured, targets not served): the plan is only good when there are none."""
    if not isinstance(config, dict):
        return {}, [f"adapter_config.json holds {type(config).__name__}, not a JSON object"]
    if "peft_type" not in config:  # PeftModel.from_pretrained reads the adapter's kind from it, and fails without
        return {}, ['there is no peft_type, so the kind of adapter is unknown (PEFT cannot load it either); add '
                    '"peft_type": "LORA" if it is a LoRA adapter']
    if config["peft_type"] != "LORA":
        return {}, [f"peft_type={config['peft_type']!r} is not LORA (only LoRA adapters are served)"]
    problems = _type_problems(config)
    if problems:
        return {}, problems
    problems = _refusals(config)
    targeted = [key for key in base_module_names(num_layers) if is_targeted(config, key)]
    outside = [key for key in targeted if key.rsplit(".", 1)[-1] not in LORA_MODULES]
    if outside:
        shown = ", ".join(outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
        problems.append(f"target_modules={config['target_modules']!r} reaches {shown}, which jaxcb does not adapt "
                        f"(only {', '.join(LORA_MODULES)})")
    if not targeted:
        problems.append(f"target_modules={config['target_modules']!r} matches none of the base's projections")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    plan = {}
    for key in targeted:
        if key in outside:
            continue
        _, _, layer, _, module = key.split(".")
        rank = int(_pattern_value(rank_pattern, key, r))
        module_alpha = float(_pattern_value(alpha_pattern, key, alpha))
        scale = module_alpha / math.sqrt(rank) if config.get("use_rslora") else module_alpha / rank
        plan[(int(layer), module)] = ModulePlan(rank, scale)
    return plan, problems
