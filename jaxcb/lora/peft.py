"""Reading a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`) into host arrays.

`adapter_config.py` reads the config into the projections the adapter targets, each with its rank
and scale, or the fields it refuses. The weights file must then hold exactly one lora_A [r, in] and
lora_B [out, r] for each targeted projection, under PEFT's names
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`), in a float dtype (F32, F16, BF16,
F64), with finite values and the rank the config gives; a weight for a projection the config does
not target (PEFT would not load it), a missing one, any other tensor, or a pickle
(`adapter_model.bin`) is refused by name. Each module's scale is folded into its B (in float32,
then cast to the model's dtype by the slot writer), so the step computes x @ A @ B. Every problem is
a LoraAdapterError naming the adapter; nothing else escapes. No jax here: the device slots are
`jaxcb.model.lora`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Optional

import numpy as np

from jaxcb.errors import InvalidRequestError
from jaxcb.lora.adapter_config import LORA_MODULES, PARENT, plan_modules
from jaxcb.model.config import LlamaConfig
from jaxcb.model.safetensors_io import FLOAT_DTYPES, CheckpointError, TensorInfo, read_header, read_tensor

__all__ = ["LORA_MODULES", "LoraAdapter", "LoraAdapterError", "check_adapter_name", "load_peft_adapter",
           "module_shapes"]

_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")
_KEY_FORM = "base_model.model.model.layers.<i>.self_attn|mlp.<projection>.lora_A|lora_B.weight"


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
    digest: str  # of the weights as served: the adapter's identity in the prefix cache

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Each targetable projection's (in, out) in the base model."""
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def _refuse(name: str, path, problems: list[str]) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter {name!r} ({path}) cannot be served: " + "; ".join(problems), "lora_path")


def _read_config(name: str, path) -> tuple[bytes, str]:
    """adapter_config.json's bytes and the weights file's path; LoraAdapterError for a path that is
    not a PEFT directory (a file, missing, no safetensors weights)."""
    if not isinstance(path, str) or not path:
        raise _refuse(name, path, ["the adapter's path must be a PEFT directory's path (a non-empty string)"])
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise _refuse(name, path, [f"{path} {what}: name the PEFT directory that holds adapter_config.json and "
                                   "adapter_model.safetensors"])
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    problems = []
    if not os.path.isfile(config_path):
        problems.append("it has no adapter_config.json file (a PEFT directory holds adapter_config.json and "
                        "adapter_model.safetensors)")
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            problems.append("its weights are adapter_model.bin, a PyTorch pickle, which jaxcb does not read "
                            "(loading one runs the code in it): write adapter_model.safetensors with PEFT's "
                            "save_pretrained(OUT_DIR, safe_serialization=True)")
        else:
            problems.append("it has no adapter_model.safetensors file")
    if problems:
        raise _refuse(name, path, problems)
    try:
        with open(config_path, "rb") as f:
            return f.read(), weights_path
    except OSError as e:
        raise _refuse(name, path, [f"adapter_config.json cannot be read ({e.strerror or e})"]) from None


def _parse_config(name: str, path: str, config_bytes: bytes) -> dict:
    try:
        return json.loads(config_bytes)
    except (UnicodeDecodeError, ValueError) as e:
        raise _refuse(name, path, [f"adapter_config.json is not JSON ({e})"]) from None


def _index_weights(infos: dict[str, TensorInfo], plan: dict, num_layers: int, problems: list[str]) -> dict:
    """{(layer, module): {"A"|"B": TensorInfo}} of the targeted projections; every other tensor
    appended to `problems`."""
    parts: dict[tuple[int, str], dict[str, TensorInfo]] = {}
    unexpected, untargeted = [], []
    for key, info in infos.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(3) not in LORA_MODULES or PARENT[m.group(3)] != m.group(2):
            unexpected.append(key)
            continue
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if layer >= num_layers:
            problems.append(f"weight {key}: the base model has {num_layers} layers")
        elif (layer, module) not in plan:
            untargeted.append(f"layers.{layer}.{module}")
        else:
            parts.setdefault((layer, module), {})[which] = info
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
        problems.append(f"{len(unexpected)} tensor{' is' if len(unexpected) == 1 else 's are'} not LoRA weights of "
                        f"the base's q/k/v/o/gate/up/down projections ({_KEY_FORM}): {shown}")
    if untargeted:
        shown = sorted(set(untargeted))
        problems.append(f"weights for {', '.join(shown[:4])}{' and more' if len(shown) > 4 else ''} are of projections "
                        "adapter_config.json does not target (PEFT would not load them): fix target_modules, "
                        "layers_to_transform or exclude_modules")
    return parts


def load_peft_adapter(name: str, path: str, cfg: LlamaConfig, max_rank: int) -> LoraAdapter:
    """The adapter at `path` checked against the base model `cfg`; LoraAdapterError listing every problem."""
    config_bytes, weights_path = _read_config(name, path)
    plan, problems = plan_modules(_parse_config(name, path, config_bytes), cfg.num_layers)
    if problems:
        raise _refuse(name, path, problems)
    try:
        infos = read_header(weights_path)
    except (CheckpointError, OSError) as e:
        raise _refuse(name, path, [f"adapter_model.safetensors cannot be read ({e})"]) from None
    parts = _index_weights(infos, plan, cfg.num_layers, problems)
    shapes = module_shapes(cfg)
    weights, top_rank = {}, 0
    for (layer, module), want in sorted(plan.items()):
        label, ab = f"layers.{layer}.{module}", parts.get((layer, module), {})
        if not ab:
            problems.append(f"{label} has no lora_A / lora_B weights, though adapter_config.json targets it")
            continue
        if set(ab) != {"A", "B"}:
            problems.append(f"{label} has lora_{''.join(ab)} without its pair")
            continue
        not_float = [f"lora_{w} is {ab[w].dtype_name}" for w in "AB" if ab[w].dtype_name not in FLOAT_DTYPES]
        if not_float:
            problems.append(f"{label}: {' and '.join(not_float)}; LoRA weights must be F32, F16, BF16 or F64")
            continue
        a_shape, b_shape = ab["A"].shape, ab["B"].shape  # PEFT's nn.Linear weights: A [r, in], B [out, r]
        d_in, d_out = shapes[module]
        rank = a_shape[0] if a_shape else 0
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != d_in or b_shape != (d_out, rank):
            problems.append(f"{label}: lora_A {a_shape} and lora_B {b_shape} do not fit the base's "
                            f"{module} ({d_in} in, {d_out} out): expected [r, {d_in}] and [{d_out}, r]")
            continue
        if rank != want.rank:
            problems.append(f"{label}: rank {rank} is not the r={want.rank} adapter_config.json gives it")
            continue
        if rank > max_rank:
            problems.append(f"{label}: rank {rank} > lora.max_rank={max_rank}")
            continue
        a, b = (read_tensor(ab[w]).astype(np.float32) for w in "AB")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            problems.append(f"{label}: its lora_A or lora_B holds NaN or infinite values")
            continue
        weights[(layer, module)] = (np.ascontiguousarray(a.T), np.ascontiguousarray((b * np.float32(want.scale)).T))
        top_rank = max(top_rank, rank)
    if problems:
        raise _refuse(name, path, problems)
    return LoraAdapter(name, path, top_rank, weights, _fingerprint(weights))


def _fingerprint(weights: dict) -> str:
    """The adapter's identity (in the prefix cache's root): of the weights as served -- each module's A and
    B with its scale folded in, which is all the config decides -- so that a file rewritten while it loads
    can never give the digest of other weights, and two copies of one adapter share their cached prefixes."""
    h = hashlib.sha256()
    for key in sorted(weights):
        h.update(repr(key).encode())
        for array in weights[key]:
            h.update(repr(array.shape).encode())
            h.update(array.tobytes())
    return h.hexdigest()[:32]


def check_adapter_name(name: Optional[str], base_name: str) -> None:
    # '/' is allowed, as vLLM allows it: Hub-style names (org/adapter) are what a request's `model` often says.
    if not isinstance(name, str) or not name or name.strip() != name or not name.isprintable():
        raise InvalidRequestError(f"lora_name={name!r} must be a non-empty name without surrounding spaces or "
                                  "control characters", "lora_name")
    if name == base_name:
        raise InvalidRequestError(f"lora_name={name!r} is the base model's name; give the adapter another", "lora_name")
