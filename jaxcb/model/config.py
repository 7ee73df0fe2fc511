"""The frozen architecture of a Llama model, resolved from a preset and/or a checkpoint's config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional

from jaxcb.config import ConfigError, ModelConfig, RopeScalingConfig
from jaxcb.model.families import read_architecture, text_config


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are stretched past the context a model was trained at."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"  # llama3 | yarn | linear
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: Optional[float] = None  # yarn: the cos/sin scale; None: 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions


ROPE_TYPES = ("llama3", "yarn", "linear")
# The keys each rope type is computed from, as transformers requires them (yarn's are optional).
_REQUIRED_ROPE_KEYS = {"linear": ("factor",),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # How the family differs from Llama (`jaxcb.model.families`): Llama's by default.
    architecture: str = "llama"
    qkv_bias: bool = False  # a bias on q, k and v
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE
    sliding_window: int = 0  # tokens a windowed layer's query sees, its own included; 0: no window
    layer_types: Optional[tuple[str, ...]] = None  # per layer; None: every layer alike
    # Gemma's (jaxcb.model.families): Llama's values by default.
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    norm_offset: bool = False  # RMSNorm scales by (1 + w), in float32
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) | gelu_tanh (GeGLU)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before each residual add
    attn_logit_softcap: float = 0.0  # scores -> c tanh(scores / c); 0: none
    final_logit_softcap: float = 0.0  # logits -> c tanh(logits / c); 0: none
    query_pre_attn_scalar: float = 0.0  # scores scaled by its -1/2 power; 0: head_dim's
    rope_local_theta: float = 0.0  # the windowed layers' RoPE base, unscaled; 0: the global rope everywhere
    rope_scaling: Optional[RopeScaling] = None
    dtype: str = "float32"  # parameter / activation dtype

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's window in tokens, 0 where the layer sees the whole context."""
        from jaxcb.model.families import layer_windows

        return layer_windows(self.num_layers, self.sliding_window, self.layer_types)

    @property
    def llama_layers(self) -> bool:
        """Whether the layers are Llama's (norms, SwiGLU MLP, LM head): what the `cpu` backend's
        fused kernels compute."""
        return not (self.norm_offset or self.sandwich_norms or self.hidden_act != "silu" or self.final_logit_softcap)

    def kv_bytes_per_token(self, cache_itemsize: int) -> int:
        """Bytes of K and V that one token occupies in the cache, over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * cache_itemsize


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's "rope_parameters": one dict, or one per layer type (Gemma 3), of which the
    full-attention layers' is the model's rope (the windowed layers' base is `rope_local_theta`)."""
    rp = hf.get("rope_parameters") or {}
    return rp.get("full_attention") or {} if isinstance(rp.get("full_attention"), dict) else rp


def _hf_rope_scaling(hf: dict[str, Any]) -> Optional[RopeScaling]:
    rs = hf.get("rope_scaling") or None
    if rs is None:
        # transformers 5 writes rope settings under "rope_parameters".
        rp = _rope_parameters(hf)
        if rp.get("rope_type", "default") not in ("default", None):
            rs = rp
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in ("default", None):
        return None
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config.json rope_scaling type {kind!r} is not supported; jaxcb supports "
                          f"{', '.join(map(repr, ROPE_TYPES))}")
    missing = [key for key in _REQUIRED_ROPE_KEYS.get(kind, ()) if rs.get(key) is None]
    if missing:
        raise ConfigError(f"config.json rope_scaling of type {kind!r} has no {', '.join(missing)}; add "
                          f"{'them' if len(missing) > 1 else 'it'} as the model was trained")
    if kind == "linear":  # positions divided by factor: every frequency alike (Gemma 3's full layers)
        return RopeScaling(float(rs["factor"]), 1.0, 4.0, 0, rope_type="linear")
    if kind == "yarn":
        original = rs.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        factor = rs["factor"] if rs.get("factor") is not None else hf["max_position_embeddings"] / original
        attention_factor = rs.get("attention_factor")
        refused = [k for k in ("mscale", "mscale_all_dim") if rs.get(k) not in (None, 1, 1.0)]
        if attention_factor is None and (refused or rs.get("mscale") and rs.get("mscale_all_dim")):
            # transformers takes the ratio of the two mscales; vLLM's Llama-family YaRN ignores them both.
            raise ConfigError(f"config.json rope_scaling (yarn) sets "
                              f"{', '.join(f'{k}={rs[k]}' for k in ('mscale', 'mscale_all_dim') if k in rs)} without "
                              f"attention_factor, which jaxcb does not derive from them; set "
                              f"rope_scaling.attention_factor to the cos/sin scale the model was trained with")
        return RopeScaling(float(factor), 1.0, 4.0, int(original), rope_type="yarn",
                           beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                           attention_factor=None if attention_factor is None else float(attention_factor),
                           truncate=bool(rs.get("truncate", True)))
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def _check_rotary_dims(hf: dict[str, Any]) -> None:
    """jaxcb rotates every dimension of a head: a partial_rotary_factor (top-level, or in a rope dict) is
    refused, since transformers' Llama-family default rope ignores it where vLLM honours it."""
    rp = hf.get("rope_parameters") or {}
    dicts = {"": hf, "rope_scaling.": hf.get("rope_scaling") or {}, "rope_parameters.": rp,
             **{f"rope_parameters.{k}.": v for k, v in rp.items() if isinstance(v, dict)}}
    for where, d in dicts.items():
        value = d.get("partial_rotary_factor") if isinstance(d, dict) else None
        if value not in (None, 1, 1.0):
            raise ConfigError(f"config.json sets {where}partial_rotary_factor={value}: jaxcb rotates every dimension "
                              f"of each head, so it cannot serve a partial rotary embedding")


def _checked_rope_scaling(rs: Optional[RopeScaling], path: str) -> Optional[RopeScaling]:
    """config.json's rope scaling in the ranges its frequencies are computed in, as model.rope_scaling's are."""
    from jaxcb.config_validation import validate_rope_scaling

    if rs is not None:
        validate_rope_scaling(rs, f"{path}: rope_scaling")
    return rs


def _max_positions(hf: dict[str, Any]) -> int:
    """config.json's max_position_embeddings; left out or null, LlamaConfig's 2048 (the other families' defaults
    are filled in by families.text_config)."""
    value = hf.get("max_position_embeddings")
    return 2048 if value is None else int(value)


def _hf_rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    return float(_rope_parameters(hf).get("rope_theta", 10000.0))


def read_hf_config(checkpoint_dir: str) -> dict[str, Any]:
    """The checkpoint's config.json mapped onto ModelConfig field names."""
    path = os.path.join(checkpoint_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.checkpoint={checkpoint_dir} has no config.json; is it a Hugging Face Llama directory?")
    with open(path) as f:
        hf = text_config(json.load(f))
    arch = read_architecture(hf, path)
    _check_rotary_dims(hf)
    num_heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    return dict(
        **arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # every family's config class defaults it to 1e-6
        rope_theta=_hf_rope_theta(hf),
        max_position_embeddings=_max_positions(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=_checked_rope_scaling(_hf_rope_scaling(hf), path),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[eos] if isinstance(eos, int) else (list(eos) if eos else None),
        checkpoint_dtype=hf.get("torch_dtype") or hf.get("dtype"),
    )


_ARCH = [f.name for f in fields(LlamaConfig) if f.name not in ("rope_scaling", "dtype")]
# What a preset without a checkpoint leaves unset is Llama's.
_LLAMA_DEFAULTS = {f.name: f.default for f in fields(LlamaConfig) if f.name in (
    "architecture", "qkv_bias", "qk_norm", "sliding_window", "layer_types", "embed_scale", "norm_offset", "hidden_act",
    "sandwich_norms", "attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_theta")}


def _preset_rope(rs: Optional[RopeScalingConfig]) -> Optional[RopeScaling]:
    if rs is None:
        return None
    return RopeScaling(rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings,
                       rope_type=rs.rope_type, beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                       attention_factor=rs.attention_factor)


def resolve_llama_config(m: ModelConfig) -> LlamaConfig:
    """The architecture to build: the preset's fields, filled from (and checked against) config.json.

    A preset that names a checkpoint must agree with it: serving `model=llama8b` from a 1B
    checkpoint fails here, listing every field that differs, instead of at weight loading.
    """
    from_ckpt = read_checkpoint_config(m.checkpoint) if m.checkpoint else {}
    values: dict[str, Any] = {}
    conflicts = []
    for name in _ARCH:
        preset = getattr(m, name)
        ckpt = from_ckpt.get(name)
        if name == "layer_types" and preset is not None:
            preset = list(preset)
        if preset is not None and name in from_ckpt and preset != ckpt:
            conflicts.append(f"model.{name}={preset} but config.json says {ckpt}")
        values[name] = preset if preset is not None else ckpt
        if values[name] is None and name in _LLAMA_DEFAULTS:
            values[name] = _LLAMA_DEFAULTS[name]
    if conflicts:
        raise ConfigError(
            f"model={m.name} does not match {m.checkpoint}/config.json: " + "; ".join(conflicts)
            + " (use model=hf to take the architecture from the checkpoint)"
        )
    missing = [n for n, v in values.items() if v is None and n not in _LLAMA_DEFAULTS]
    if values["layer_types"] is not None:
        values["layer_types"] = tuple(values["layer_types"])
    if missing:
        raise ConfigError(
            f"model={m.name}: {', '.join('model.' + n for n in missing)} unset and not found in a config.json; "
            f"add model.checkpoint=DIR or set them"
        )
    if m.name == "hf" or m.rope_scaling is None and from_ckpt:
        rope = from_ckpt.get("rope_scaling")
    else:
        rope = _preset_rope(m.rope_scaling)
    cfg = LlamaConfig(**values, rope_scaling=rope)
    dtype, _ = choose_model_dtype(m.dtype, from_ckpt.get("checkpoint_dtype"),
                                  packed_cpu_backend=m.backend != "xla" and cfg.llama_layers)
    return replace(cfg, dtype=dtype)


def _cpu_bf16_speedup() -> Optional[float]:
    from jaxcb.backends import bf16_matmul_speedup  # only here: it builds and probes the C++ kernels

    return bf16_matmul_speedup()


def choose_model_dtype(
    requested: str, checkpoint_dtype: Optional[str], platform: Optional[str] = None, packed_cpu_backend: bool = False,
    cpu_bf16_speedup: Callable[[], Optional[float]] = _cpu_bf16_speedup,
) -> tuple[str, str]:
    """(dtype, why) of `model.dtype`. auto: elsewhere than on CPU the checkpoint's dtype, with
    float32 (or an unknown one: quantized or random weights) served as bfloat16. On CPU bf16
    checkpoints and weights of no stated dtype are served in bfloat16 where the `cpu` backend runs
    them (`packed_cpu_backend`) and this CPU multiplies bf16 at least as fast as float32
    (`cpu_bf16_speedup`: AMX, or bf16 dot products); else, and for float32 and float16
    checkpoints, in float32, transformers' reference precision."""
    if requested != "auto":
        return requested, f"model.dtype={requested}"
    if platform is None:
        import jax  # only here: the config modules stay host-only otherwise

        platform = jax.default_backend()
    source = f"a {checkpoint_dtype} checkpoint" if checkpoint_dtype else "weights of no stated dtype (quantized or random)"
    if platform == "cpu":
        if checkpoint_dtype not in ("bfloat16", None):
            return "float32", f"model.dtype=auto: float32 on CPU for {source}"
        if not packed_cpu_backend:
            return "float32", f"model.dtype=auto: float32 on CPU for {source}: only the cpu backend multiplies bf16 fast"
        speedup = cpu_bf16_speedup()
        if speedup is not None and speedup >= 1.0:
            return "bfloat16", (f"model.dtype=auto: bfloat16 on CPU for {source}: this CPU's bf16 matmul runs "
                                f"{speedup:.1f}x float32's speed")
        measured = "is unavailable" if speedup is None else f"runs {speedup:.2f}x float32's speed"
        return "float32", f"model.dtype=auto: float32 on CPU for {source}: this CPU's bf16 matmul {measured}"
    if checkpoint_dtype in ("bfloat16", "float16"):
        return checkpoint_dtype, f"model.dtype=auto: the checkpoint's {checkpoint_dtype} on {platform}"
    return "bfloat16", f"model.dtype=auto: bfloat16 on {platform} for {source}"


def read_checkpoint_config(checkpoint: str) -> dict[str, Any]:
    """config.json's fields, or a GGUF file's metadata under the same names; {} when there is neither."""
    if checkpoint.endswith(".gguf") and os.path.isfile(checkpoint):
        from jaxcb.model.gguf import read_gguf_config  # it needs the loader, which imports this module

        return read_gguf_config(checkpoint)
    return read_hf_config(checkpoint) if _has_hf_config(checkpoint) else {}


def _has_hf_config(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))
