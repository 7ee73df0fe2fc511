"""The model families jaxcb serves, and how each differs from Llama: the one file to read (and to
extend) for a new family.

Every family runs the one forward in `llama.py`. What differs is a property of the
architecture (`LlamaConfig`), read here from a checkpoint's config.json, in transformers 5's
schema (`layer_types`, `rope_parameters`) or the 4.x keys most Hub checkpoints carry
(`use_sliding_window`, `max_window_layers`, `rope_theta`):

    family   model_type  differs from Llama by
    llama    llama       (Llama 2 / 3 / 3.1 / 3.2, SmolLM2)
    mistral  mistral     a sliding window on every layer (`sliding_window`: 4096 in the 7B v0.1,
                         null from v0.2 on)
    qwen2    qwen2       bias on the q, k and v projections (not on o); tied embeddings in the small
                         sizes; with `use_sliding_window`, a window on the layers from
                         `max_window_layers` on
    qwen3    qwen3       RMSNorm over each head's q and k before RoPE (`qk_norm`); an explicit
                         `head_dim`; the window as qwen2's
    gemma2   gemma2      embeddings scaled by sqrt(hidden); RMSNorm by (1 + w) in float32; GeGLU
                         (tanh GELU); norms after attention and after the MLP too; attention
                         scores and final logits soft-capped (50, 30); queries scaled by
                         `query_pre_attn_scalar`; a window on every other layer (from the first)
    gemma3   gemma3_text Gemma 2's layout with q/k norms, no soft-caps, five windowed layers to one
                         full (`sliding_window_pattern`), the windowed layers' own RoPE base
                         (`rope_local_base_freq`), the full layers' linear RoPE scaling; `gemma3`
                         (Gemma3ForConditionalGeneration, 4B and up) is its text tower
                         (`text_config`; images are refused)

What a family's config may say that jaxcb does not compute is refused by name here (a bias on
o_proj or the MLP, an unknown layer type, an activation other than the family's, quantized weights,
a head other than a causal LM's), never dropped. The GGUF metadata of each family maps
onto the same fields (`jaxcb.model.gguf`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from jaxcb.config import ConfigError

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json "architectures" that name it
    qkv_bias: bool = False  # bias on q, k, v (and only there)
    qk_norm: bool = False  # RMSNorm over each head's q and k, before RoPE
    # How the window is written in the 4.x keys: "every_layer" (mistral: `sliding_window` alone),
    # "from_max_window_layers" (qwen: `use_sliding_window`, from layer `max_window_layers` on), None: no window.
    window_keys: Optional[str] = None
    # config.json keys that are true (or not null) for an architecture jaxcb does not compute, with
    # what they mean: refused by name.
    refused_keys: tuple[tuple[str, str], ...] = ()
    gemma: bool = False  # Gemma's layout: scaled embeddings, (1 + w) norms, GeGLU, sandwich norms
    # Values config.json may leave out, as transformers' config class defaults them.
    defaults: tuple[tuple[str, Any], ...] = ()


GEMMA3_TEXT_DEFAULTS = (  # Gemma3TextConfig's, for the text_config of a Gemma3ForConditionalGeneration
    ("vocab_size", 262208), ("head_dim", 256), ("num_attention_heads", 8), ("num_key_value_heads", 4),
    ("rms_norm_eps", 1e-6), ("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10_000.0),
    ("max_position_embeddings", 131072), ("sliding_window", 4096), ("sliding_window_pattern", 6),
    ("query_pre_attn_scalar", 256), ("hidden_activation", "gelu_pytorch_tanh"), ("tie_word_embeddings", True),
)
GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
MISTRAL_DEFAULT_WINDOW = 4096  # MistralConfig's sliding_window where config.json leaves the key out
LLAMA_ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN computes both as x * sigmoid(x)
# Keys a family's config.json must carry (transformers' defaults for them are a 7B's, never a checkpoint's).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",),
           refused_keys=(("attention_bias", "a bias on q/k/v/o"), ("mlp_bias", "a bias on the MLP"))),
    Family("mistral", ("MistralForCausalLM",), window_keys="every_layer",
           defaults=(("max_position_embeddings", 4096 * 32),)),
    Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, window_keys="from_max_window_layers",
           defaults=(("max_position_embeddings", 32768),)),
    Family("qwen3", ("Qwen3ForCausalLM",), qk_norm=True, window_keys="from_max_window_layers",
           refused_keys=(("attention_bias", "a bias on q/k/v/o"),), defaults=(("max_position_embeddings", 32768),)),
    Family("gemma2", ("Gemma2ForCausalLM",), window_keys="every_other_layer", gemma=True,
           refused_keys=(("attention_bias", "a bias on q/k/v/o"),),
           defaults=(("hidden_activation", "gelu_pytorch_tanh"), ("query_pre_attn_scalar", 256),
                     ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("sliding_window", 4096),
                     ("tie_word_embeddings", True), ("max_position_embeddings", 8192))),
    Family("gemma3_text", ("Gemma3ForCausalLM",), qk_norm=True, window_keys="sliding_window_pattern", gemma=True,
           refused_keys=(("attention_bias", "a bias on q/k/v/o"),), defaults=GEMMA3_TEXT_DEFAULTS),
)}
# Gemma3ForConditionalGeneration: config.json's text_config describes the tower jaxcb serves.
MULTIMODAL_TEXT_TOWERS = {"gemma3": "gemma3_text"}
# The heads jaxcb computes: a causal LM's next-token logits (a classifier's or reward model's `score`
# head, or a bare `*Model`, is refused by its class name).
CAUSAL_LM_ARCHITECTURES = {a for f in FAMILIES.values() for a in f.architectures} | {"Gemma3ForConditionalGeneration"}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config of the language model: config.json itself, or the text_config of a multimodal
    checkpoint (Gemma 3 4B and up), with its family's defaults for what it leaves out."""
    if hf.get("model_type") in MULTIMODAL_TEXT_TOWERS:
        text = dict(hf.get("text_config") or {})
        text["model_type"] = MULTIMODAL_TEXT_TOWERS[hf["model_type"]]
        for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "quantization_config"):
            text.setdefault(key, hf.get(key))
        hf = text
    family = FAMILIES.get(hf.get("model_type"))
    if family is not None and family.defaults:
        defaults = dict(family.defaults)
        if "rope_parameters" in hf:  # transformers 5 keeps the bases there
            defaults.pop("rope_theta", None), defaults.pop("rope_local_base_freq", None)
        hf = {**defaults, **{k: v for k, v in hf.items() if v is not None or k not in defaults}}
    return hf


def family_of(hf: dict[str, Any], path: str = "config.json") -> Family:
    """The family a config.json describes, by `model_type` (or `architectures` without one); a
    ConfigError naming what it says otherwise."""
    model_type = hf.get("model_type")
    if model_type is None:
        archs = hf.get("architectures")
        if not archs:
            raise ConfigError(f"{path} has neither model_type nor architectures, so its family is unknown; add "
                              f"model_type (one of {', '.join(FAMILIES)})")
        match = [f for f in FAMILIES.values() if set(archs) & set(f.architectures)]
        if match:
            return match[0]
        model_type = "/".join(archs)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    raise ConfigError(
        f"{path} describes model_type={model_type!r}; jaxcb serves the families {', '.join(FAMILIES)} "
        f"(jaxcb/model/families.py says how each differs from Llama)"
    )


def read_architecture(hf: dict[str, Any], path: str = "config.json") -> dict[str, Any]:
    """The architecture properties a family adds to Llama's, as `ModelConfig` fields."""
    family = family_of(hf, path)
    missing = [key for key in REQUIRED_KEYS if hf.get(key) is None]
    if missing:
        raise ConfigError(f"{path} has no {', '.join(missing)}; add {'them' if len(missing) > 1 else 'it'} with the "
                          f"values the model was trained with")
    problems = unserved_features(hf, family)
    if problems:
        raise ConfigError(f"{path} describes what jaxcb's {family.name} does not compute: " + "; ".join(problems))
    num_layers = int(hf["num_hidden_layers"])
    window, layer_types = _window(hf, family, num_layers, path)
    arch = dict(architecture=family.name, qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
                sliding_window=window, layer_types=layer_types)
    if family.gemma:
        arch.update(_gemma(hf, path))
    return arch


def unserved_features(hf: dict[str, Any], family: Family) -> list[str]:
    """One phrase for each thing config.json says that jaxcb would otherwise compute differently."""
    problems = [f"{key}={hf[key]!r} ({meaning})" for key, meaning in family.refused_keys if hf.get(key)]
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if kv_heads is not None and heads and (not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads):
        problems.append(f"num_key_value_heads={kv_heads!r}, which must divide num_attention_heads={heads}")
    archs = hf.get("architectures") or []
    unserved = [a for a in archs if a not in CAUSAL_LM_ARCHITECTURES]
    if unserved:
        problems.append(f"architectures={archs} (jaxcb computes a causal LM's next-token logits: "
                        f"{', '.join(family.architectures)}; a classifier's or reward model's head is not one)")
    quantization = hf.get("quantization_config")
    if quantization and not _kv_cache_only(quantization):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        problems.append(f"quantization_config with quant_method={method!r} (jaxcb reads float16, bfloat16 or float32 "
                        f"safetensors, or a GGUF file; serve the unquantized checkpoint)")
    if not family.gemma and hf.get("hidden_act", "silu") not in LLAMA_ACTIVATIONS:
        problems.append(f"hidden_act={hf['hidden_act']!r} (jaxcb's {family.name} MLP is SwiGLU: silu)")
    return problems


def _kv_cache_only(quantization: Any) -> bool:
    """A compressed-tensors config that quantizes only the KV cache: its weights are floats, and its
    k_scale / v_scale tensors are read for an 8-bit cache.dtype (jaxcb.kv_scales)."""
    return (isinstance(quantization, dict) and quantization.get("quant_method") == "compressed-tensors"
            and not quantization.get("config_groups"))


def _gemma(hf: dict[str, Any], path: str) -> dict[str, Any]:
    activation = hf.get("hidden_activation") or hf.get("hidden_act")
    if activation not in GEMMA_ACTIVATIONS:
        raise ConfigError(f"{path} sets hidden_activation={activation!r}; jaxcb computes "
                          f"{', '.join(GEMMA_ACTIVATIONS)} for Gemma")
    rope_local = hf.get("rope_local_base_freq")
    rp = hf.get("rope_parameters") or {}
    if isinstance(rp.get("sliding_attention"), dict):  # transformers 5: one rope per layer type
        local = rp["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{path} rope_parameters.sliding_attention.rope_type={local['rope_type']!r}: "
                              f"jaxcb's windowed layers take an unscaled rope")
        rope_local = local.get("rope_theta", rope_local)
    return dict(embed_scale=True, norm_offset=True, hidden_act=GEMMA_ACTIVATIONS[activation], sandwich_norms=True,
                attn_logit_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
                final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
                rope_local_theta=float(rope_local or 0.0))


def _window(hf: dict[str, Any], family: Family, num_layers: int, path: str) -> tuple[int, Optional[list[str]]]:
    """(the window in tokens, 0 for none; each layer's type, None when every layer is the same)."""
    if family.window_keys is None:
        if hf.get("sliding_window"):
            raise ConfigError(f"{path} sets sliding_window={hf['sliding_window']}, which jaxcb's {family.name} does "
                              f"not read; a {family.name} checkpoint has no window")
        return 0, None
    # Qwen2Config and Qwen3Config default use_sliding_window to false and max_window_layers to 28.
    use = hf.get("use_sliding_window", False) if family.window_keys == "from_max_window_layers" else True
    # A key left out is transformers' default: MistralConfig's 4096 (an explicit null: no window, v0.2 on).
    default = MISTRAL_DEFAULT_WINDOW if family.window_keys == "every_layer" else None
    window = int(hf.get("sliding_window", default) or 0) if use else 0
    layer_types = hf.get("layer_types")
    if layer_types is not None:  # transformers 5 writes each layer's type
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown or len(layer_types) != num_layers:
            raise ConfigError(f"{path} layer_types must be {num_layers} of {', '.join(LAYER_TYPES)}; "
                              f"got {len(layer_types)} entries" + (f" with {', '.join(unknown)}" if unknown else ""))
        layer_types = list(layer_types)
    elif window and family.window_keys == "from_max_window_layers":
        first = int(28 if hf.get("max_window_layers") is None else hf["max_window_layers"])
        layer_types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    elif window and family.window_keys == "every_other_layer":  # as transformers' Gemma2Config: from the first
        layer_types = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)]
    elif window and family.window_keys == "sliding_window_pattern":  # Gemma3's: every pattern-th layer full
        pattern = int(hf.get("sliding_window_pattern") or 6)
        layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
    if not window or layer_types is not None and SLIDING_ATTENTION not in layer_types:
        return 0, None
    if layer_types is not None and FULL_ATTENTION not in layer_types:
        layer_types = None  # every layer windowed
    return window, layer_types


def layer_windows(num_layers: int, sliding_window: int, layer_types: Optional[tuple[str, ...]]) -> tuple[int, ...]:
    """Each layer's window in tokens (0: the layer sees the whole context)."""
    if not sliding_window:
        return (0,) * num_layers
    if not layer_types:
        return (sliding_window,) * num_layers
    return tuple(sliding_window if t == SLIDING_ATTENTION else 0 for t in layer_types)


def describe(architecture: str, qkv_bias: bool, qk_norm: bool, windows: tuple[int, ...]) -> str:
    """One phrase for the start-up log: the family and what it adds to Llama."""
    extras = [name for name, on in (("q/k/v bias", qkv_bias), ("q/k norms", qk_norm)) if on]
    windowed = [i for i, w in enumerate(windows) if w]
    if windowed:
        where = "every layer" if len(windowed) == len(windows) else f"{len(windowed)} of {len(windows)} layers"
        extras.append(f"a sliding window of {max(windows)} on {where}")
    return architecture + (f" ({', '.join(extras)})" if extras else "")
