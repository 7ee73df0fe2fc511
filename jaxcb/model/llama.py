"""Llama (Llama 2/3/3.1/3.2 family) in Flax NNX, over a flat ragged batch and a paged KV cache.

The forward pass takes what the engine's step has -- `token_ids[T]`, `positions[T]`, the
paged cache and its `AttentionMetadata` -- and returns the final-normed hidden states
`[T, hidden]` and the updated cache. Linear layers see the flat token batch; only
attention knows which token belongs to which sequence. `compute_logits` is separate so the
step projects only the rows that sample.

The decoder layers' weights are built, loaded and saved stacked on a leading `num_layers`
axis (`DecoderLayers`) and run under `jax.lax.scan`: one layer is traced and compiled,
whatever the depth. `model.layer_loop=unrolled` (the default on CPU) splits them once, after
loading, into one `DecoderLayer` per layer and runs a Python loop over them: XLA:CPU copies
each layer's slice of a stacked weight before every use (~300 MB per decode step of the
100M-parameter `small` preset), but reads a weight that is an input of its own in place.
Both loops run the same `decoder_layer`.

Axis letters in einsums: t tokens, d hidden, h heads, k head_dim, f MLP width, v vocab.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxcb.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from jaxcb.kv_cache import KVCache
from jaxcb.model.config import LlamaConfig, RopeScaling

INIT_STD = 0.02


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """f32[head_dim // 2]: rotary frequencies, with Llama 3's frequency-dependent scaling if given."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: jax.Array,  # [T, heads, head_dim]
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[head_dim // 2]
) -> jax.Array:
    """Rotary embedding in the HF layout: the two halves of head_dim are the pair (rotate_half)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, head_dim // 2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in f32, as HF does, then scaled in the activation dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


class LayerWeights(NamedTuple):
    """One decoder layer's weights (under scan: every layer's, each with a leading [num_layers] axis)."""

    attn_norm: jax.Array  # [D]
    q_proj: jax.Array  # [D, Hq, K]
    k_proj: jax.Array  # [D, Hkv, K]
    v_proj: jax.Array  # [D, Hkv, K]
    o_proj: jax.Array  # [Hq, K, D]
    mlp_norm: jax.Array  # [D]
    gate_proj: jax.Array  # [D, F]
    up_proj: jax.Array  # [D, F]
    down_proj: jax.Array  # [F, D]


class _LayerParams(nnx.Module):
    def weights(self) -> LayerWeights:
        return LayerWeights(*(getattr(self, name)[...] for name in LayerWeights._fields))


class DecoderLayers(_LayerParams):
    """All decoder layers, each weight stacked on a leading [num_layers] axis."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        Hq, Hkv, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt = jnp.dtype(cfg.dtype)
        normal = nnx.initializers.normal(INIT_STD)
        self.attn_norm = nnx.Param(jnp.ones((L, D), dt))
        self.q_proj = nnx.Param(normal(rngs.params(), (L, D, Hq, K), dt))
        self.k_proj = nnx.Param(normal(rngs.params(), (L, D, Hkv, K), dt))
        self.v_proj = nnx.Param(normal(rngs.params(), (L, D, Hkv, K), dt))
        self.o_proj = nnx.Param(normal(rngs.params(), (L, Hq, K, D), dt))
        self.mlp_norm = nnx.Param(jnp.ones((L, D), dt))
        self.gate_proj = nnx.Param(normal(rngs.params(), (L, D, F), dt))
        self.up_proj = nnx.Param(normal(rngs.params(), (L, D, F), dt))
        self.down_proj = nnx.Param(normal(rngs.params(), (L, F, D), dt))


class DecoderLayer(_LayerParams):
    """One decoder layer's weights, each an array of its own (`model.layer_loop=unrolled`)."""

    def __init__(self, weights: LayerWeights):
        for name, value in weights._asdict().items():
            setattr(self, name, nnx.Param(value))


def _split_layers(stacked: jax.Array) -> list[jax.Array]:
    """[L, ...] -> L arrays [...], each split over the devices as its parent was, minus the layer axis."""
    sharding = stacked.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return jax.jit(lambda w: [w[i] for i in range(w.shape[0])], out_shardings=sharding)(stacked)


def decoder_layer(
    cfg: LlamaConfig,
    attention: AttentionBackend,
    h: jax.Array,  # [T, hidden]: the residual stream
    cache: KVCache,
    layer: jax.Array,  # i32[]: which layer of the cache
    w: LayerWeights,
    positions: jax.Array,  # i32[T]
    md: AttentionMetadata,
) -> tuple[jax.Array, KVCache]:  # ([T, hidden], cache with this layer's new K/V)
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    x = rms_norm(h, w.attn_norm, cfg.rms_norm_eps)
    q = apply_rope(jnp.einsum("td,dhk->thk", x, w.q_proj), positions, inv_freq)
    k = apply_rope(jnp.einsum("td,dhk->thk", x, w.k_proj), positions, inv_freq)
    v = jnp.einsum("td,dhk->thk", x, w.v_proj)
    attn, cache = attention.write_and_attend(q, k, v, cache, layer, md, sm_scale)
    attn = attn.astype(h.dtype)
    h = h + jnp.einsum("thk,hkd->td", attn, w.o_proj)
    x = rms_norm(h, w.mlp_norm, cfg.rms_norm_eps)
    gate = jnp.einsum("td,df->tf", x, w.gate_proj)
    up = jnp.einsum("td,df->tf", x, w.up_proj)
    return h + jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, w.down_proj), cache


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, attention: AttentionBackend | None = None):
        self.cfg = cfg
        self.attention = attention if attention is not None else get_attention_backend()
        dt = jnp.dtype(cfg.dtype)
        normal = nnx.initializers.normal(INIT_STD)
        self.embed = nnx.Param(normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dt))
        self.layers = DecoderLayers(cfg, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dt))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(normal(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dt))

    def __call__(
        self,
        token_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # ([T, hidden] final-normed, updated cache)
        cfg = self.cfg

        def layer_step(carry, xs):
            (h, cache), (layer, w) = carry, xs
            return decoder_layer(cfg, self.attention, h, cache, layer, w, positions, md), None

        h = jnp.take(self.embed[...], token_ids, axis=0)
        if isinstance(self.layers, DecoderLayers):
            layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            (h, kv_cache), _ = jax.lax.scan(layer_step, (h, kv_cache), (layers, self.layers.weights()))
        else:
            for i, layer in enumerate(self.layers):
                (h, kv_cache), _ = layer_step((h, kv_cache), (jnp.int32(i), layer.weights()))
        return rms_norm(h, self.final_norm[...], cfg.rms_norm_eps), kv_cache

    def unstack_layers(self) -> None:
        """Replace the stacked decoder weights by one `DecoderLayer` per layer, in place.

        Weight by weight, so that at most one stacked weight exists twice at a time; the
        stacked arrays are freed unless something else still holds them."""
        stacked = self.layers
        if not isinstance(stacked, DecoderLayers):
            return
        columns = []  # columns[weight][layer]
        for name in LayerWeights._fields:
            columns.append(_split_layers(getattr(stacked, name)[...]))
            delattr(stacked, name)
        self.layers = nnx.List([DecoderLayer(LayerWeights(*weights)) for weights in zip(*columns)])

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, hidden] -> f32[N, vocab]
        if self.cfg.tie_word_embeddings:
            logits = jnp.einsum("td,vd->tv", hidden, self.embed[...])
        else:
            logits = jnp.einsum("td,dv->tv", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)


def resolve_layer_loop(layer_loop: str, platform: str | None = None) -> str:
    """`scan` or `unrolled` (the value is validated with the config): `auto` unrolls on CPU (see
    the module docstring) and scans elsewhere, where tracing one layer keeps compile time low."""
    if layer_loop == "auto":
        return "unrolled" if (platform or jax.default_backend()) == "cpu" else "scan"
    return layer_loop


def build_random_model(cfg: LlamaConfig, seed: int, attention: AttentionBackend | None = None) -> Llama:
    return Llama(cfg, rngs=nnx.Rngs(seed), attention=attention)


def build_abstract_model(cfg: LlamaConfig, attention: AttentionBackend | None = None) -> Llama:
    """The model with ShapeDtypeStruct leaves: shapes and sizes without allocating weights."""
    return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), attention=attention))


def count_params(model: Llama) -> int:
    state = nnx.state(model, nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
