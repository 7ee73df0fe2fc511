"""The scales of an 8-bit KV cache: one per (layer, KV head) for K and for V, fixed at start-up.

Where they come from, in order:

1. the checkpoint's `model.layers.{i}.self_attn.k_scale` / `v_scale` (or one `kv_scale` for both),
   as fp8 checkpoints for vLLM carry them: a scalar per layer (broadcast to its heads) or one per
   KV head. They are fp8-e4m3 scales (x ~ scale * e4m3): the range they cover, scale * 448, is
   kept and divided by the cache dtype's largest value, so an int8 or e5m2 cache covers the same
   range;
2. else a calibration prefill: `cache.kv_calibration_tokens` tokens of the text shipped with jaxcb
   (`jaxcb/data/kv_calibration.txt`: prose, dialogue, code, numbers, a few languages) run once
   through the served model into a small unquantized cache; each (layer, KV head)'s largest |K|
   and |V| over those tokens (after RoPE: what the cache holds) divided by the dtype's largest
   value is its scale. Values past that range later saturate (`quantization.quantize`).

Never 1.0 by default. Both paths are logged; the scales are part of the prefix-cache root
(`Engine.prefix_cache_root`), so blocks written under other scales are never reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from importlib import resources
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.config import ConfigError
from jaxcb.kernels.attention import AttentionMetadata
from jaxcb.kernels.attention.quantization import cache_dtype_name, quantized_max
from jaxcb.model.config import LlamaConfig

log = logging.getLogger(__name__)
CALIBRATION_TEXT = "kv_calibration.txt"  # in the jaxcb.data package
FP8_E4M3_MAX = 448.0  # what a checkpoint's k_scale / v_scale are relative to


@dataclasses.dataclass(frozen=True)
class KVScales:
    """f32[num_layers, num_kv_heads] each, and where they came from."""

    k: np.ndarray
    v: np.ndarray
    source: str

    def digest(self) -> str:
        """What the prefix-cache root folds in: the scales' exact bits."""
        return hashlib.sha256(self.k.astype(np.float32).tobytes() + self.v.astype(np.float32).tobytes()).hexdigest()

    def describe(self, dtype) -> str:
        return (f"KV cache {cache_dtype_name(dtype)} scales per (layer, KV head), {self.source}: "
                f"K {self.k.min():.4g}..{self.k.max():.4g} (ranges up to {self.k.max() * quantized_max(dtype):.4g}), "
                f"V {self.v.min():.4g}..{self.v.max():.4g} (up to {self.v.max() * quantized_max(dtype):.4g})")


def calibration_text() -> str:
    return resources.files("jaxcb.data").joinpath(CALIBRATION_TEXT).read_text(encoding="utf-8")


def calibration_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the shipped text; a ConfigError if it has fewer."""
    ids = list(tokenizer.encode(calibration_text()))
    if len(ids) < num_tokens:
        raise ConfigError(f"cache.kv_calibration_tokens={num_tokens} is more than the {len(ids)} tokens the "
                          f"calibration text (jaxcb/data/{CALIBRATION_TEXT}) has with this tokenizer; "
                          f"lower it to at most {len(ids)}")
    return ids[:num_tokens]


def _checkpoint_scale_tensors(checkpoint: Optional[str]) -> dict:
    """{(layer, k_scale | v_scale | kv_scale): TensorInfo} of a safetensors directory; {} for anything else."""
    from jaxcb.model.loader import KV_SCALE_TENSORS, is_gguf_file, is_orbax_checkpoint, text_tower_name
    from jaxcb.model.safetensors_io import index_checkpoint

    if not checkpoint or not os.path.isdir(checkpoint) or is_gguf_file(checkpoint) or is_orbax_checkpoint(checkpoint):
        return {}
    found = {}
    for name, info in index_checkpoint(checkpoint).items():
        match = KV_SCALE_TENSORS.fullmatch(text_tower_name(name))
        if match:
            found[(int(match.group(1)), match.group(2))] = info
    return found


def checkpoint_has_kv_scales(checkpoint: Optional[str]) -> bool:
    return bool(_checkpoint_scale_tensors(checkpoint))


def checkpoint_kv_scales(checkpoint: Optional[str], cfg: LlamaConfig, dtype) -> Optional[KVScales]:
    """The checkpoint's k_scale/v_scale (a safetensors directory's), converted for `dtype`; None if it
    has none. Some layers with scales and others without is a ConfigError naming them."""
    from jaxcb.model.safetensors_io import read_tensor

    found = {key: np.asarray(read_tensor(info), np.float32).reshape(-1)
             for key, info in _checkpoint_scale_tensors(checkpoint).items()}
    if not found:
        return None
    k, v, problems = [], [], []
    for layer in range(cfg.num_layers):
        pair = []
        for which in ("k_scale", "v_scale"):
            x = found.get((layer, which), found.get((layer, "kv_scale")))
            if x is None:
                problems.append(f"model.layers.{layer}.self_attn.{which}")
                x = np.ones(1, np.float32)
            elif x.size not in (1, cfg.num_kv_heads) or not np.all(np.isfinite(x)) or np.any(x <= 0):
                problems.append(f"model.layers.{layer}.self_attn.{which} = {x} (one positive value, or one per KV head)")
            pair.append(np.broadcast_to(x, (cfg.num_kv_heads,)))
        k.append(pair[0])
        v.append(pair[1])
    if problems:
        raise ConfigError(f"the checkpoint's KV cache scales are incomplete or invalid: {'; '.join(problems)}")
    factor = FP8_E4M3_MAX / quantized_max(dtype)  # the same range, in the cache dtype's units
    return KVScales(np.stack(k) * factor, np.stack(v) * factor,
                    f"from the checkpoint's k_scale/v_scale ({checkpoint})")


def measure_kv_amax(backend, weights, cfg: LlamaConfig, token_ids: list[int], block_size: int, dtype,
                    sharding=None) -> tuple[np.ndarray, np.ndarray]:
    """Largest |K| and |V| per (layer, KV head), f32[num_layers, num_kv_heads] each, over one prefill of
    `token_ids` through the served model (`backend`, prepared `weights`) into a fresh cache of `dtype`."""
    from jaxcb.kv_cache import allocate_kv_cache
    from jaxcb.model.llama import forward

    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    cache = allocate_kv_cache(cfg, num_blocks + 1, block_size, dtype, sharding, backend.attention.zeros_fn)
    md = AttentionMetadata(
        slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32) + block_size,  # block 1 onwards (0 is the null block)
        query_start_loc=jnp.asarray([0, num_tokens], jnp.int32),
        kv_lens=jnp.asarray([num_tokens], jnp.int32),
        block_tables=jnp.arange(1, num_blocks + 1, dtype=jnp.int32)[None, :],
        num_seqs=jnp.int32(1),
    )

    @jax.jit
    def prefill_amax(weights, token_ids, cache, md):
        positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        _, cache = forward(backend, weights, token_ids, positions, cache, md)

        def amax(x):  # [L, Hkv, NB, BS, D] -> [L, Hkv] over the prefill's slots
            x = x[:, :, 1:].reshape(x.shape[0], x.shape[1], -1, x.shape[-1])[:, :, :num_tokens]
            return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(2, 3))

        return amax(cache.k), amax(cache.v)

    k_amax, v_amax = prefill_amax(weights, jnp.asarray(token_ids, jnp.int32), cache, md)
    return np.asarray(k_amax), np.asarray(v_amax)


def resolve_kv_scales(checkpoint: Optional[str], cfg: LlamaConfig, dtype, *, calibrate) -> KVScales:
    """The scales of an 8-bit `dtype` cache: the checkpoint's, else `calibrate()`'s (a KVScales); logged."""
    scales = checkpoint_kv_scales(checkpoint, cfg, dtype)
    if scales is None:
        scales = calibrate()
    if not (np.all(np.isfinite(scales.k)) and np.all(np.isfinite(scales.v))):
        raise ConfigError(f"the KV cache scales ({scales.source}) are not finite: the model's K/V overflowed")
    log.info("%s", scales.describe(dtype))
    return scales


def calibrated_kv_scales(backend, weights, cfg: LlamaConfig, tokenizer, num_tokens: int, block_size: int,
                         dtype, calibration_dtype, sharding=None) -> KVScales:
    """Scales from a prefill of the shipped text's first `num_tokens` tokens, in a `calibration_dtype` cache."""
    ids = calibration_token_ids(tokenizer, num_tokens)
    k_amax, v_amax = measure_kv_amax(backend, weights, cfg, ids, block_size, calibration_dtype, sharding)
    to_scale = lambda a: np.maximum(a / quantized_max(dtype), np.finfo(np.float32).tiny).astype(np.float32)  # noqa: E731
    return KVScales(to_scale(k_amax), to_scale(v_amax),
                    f"calibrated on {len(ids)} tokens of jaxcb/data/{CALIBRATION_TEXT} (cache.kv_calibration_tokens)")
