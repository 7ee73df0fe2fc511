"""Llama (Llama 2/3/3.1/3.2 family): its parameters in Flax NNX, and its forward pass over a flat
ragged batch and a paged KV cache.

`Llama` holds the parameters in the one layout they are built, loaded and saved in: the
decoder layers' weights stacked on a leading `num_layers` axis. Before serving, a backend
(`jaxcb.backends`) prepares them once into the arrays its layer operations read
(`StepWeights`): per-layer arrays, packed or fused matrices, the rotary table.

`forward` is the model's code, and the only place it is written: it calls the backend's
layer operations (`LayerOps`) -- attention (project q/k/v, write the cache, attend), output
projection plus residual, MLP plus residual -- and never asks which backend runs. It takes what the
engine's step has -- `token_ids[T]`, `positions[T]`, the paged cache and its
`AttentionMetadata` -- and returns the final-normed hidden states `[T, hidden]` and the
updated cache. Linear layers see the flat token batch; only attention knows which token
belongs to which sequence. Logits are separate (`Backend.logits_and_argmax`) so the step
projects only the rows that sample.

The layers run under `jax.lax.scan` when the prepared layer weights are one stacked tree (one
layer traced and compiled, whatever the depth), and in a Python loop when they are a list,
one entry per layer (a backend's choice: XLA:CPU copies each layer's slice of a stacked
weight before every use, but reads a weight that is an input of its own in place); the loop
calls the layer as a nested jit, traced once for all of them.

Axis letters in einsums: t tokens, d hidden, h heads, k head_dim, f MLP width, v vocab.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcb.kernels.attention import AttentionForm, AttentionMetadata, KVCache
from jaxcb.model.config import LlamaConfig, RopeScaling
from jaxcb.model.lora import LoraRows

INIT_STD = 0.02


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """f32[head_dim // 2]: rotary frequencies, with Llama 3's or YaRN's scaling if given."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
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


def yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN: the frequencies that turn fewer than `beta_slow` times over the original context are divided
    by `factor` (interpolated), those that turn more than `beta_fast` times kept (extrapolated), with a
    linear ramp between, over dimensions (as transformers computes it, in float32)."""
    pos_freqs = theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / ((high + 0.001 if low == high else high) - low),
                   0, 1).astype(np.float32)
    keep = 1 - ramp  # the share of the unscaled (extrapolated) frequency
    return ((1.0 / (scaling.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep).astype(np.float32)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies cos and sin by (so q.k by its square): 1 for the other rope types."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def rope_angles(
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[head_dim // 2]
) -> tuple[jax.Array, jax.Array]:  # (cos, sin), each f32[T, head_dim // 2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(
    x: jax.Array,  # [T, heads, head_dim]
    cos: jax.Array,  # f32[T, head_dim // 2]
    sin: jax.Array,  # f32[T, head_dim // 2]
) -> jax.Array:
    """Rotary embedding in the HF layout: the two halves of head_dim are the pair (rotate_half)."""
    cos = jnp.concatenate([cos, cos], axis=-1)[:, None, :].astype(x.dtype)
    sin = jnp.concatenate([sin, sin], axis=-1)[:, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """RMSNorm computed in f32, as HF does, then scaled in the activation dtype (Llama's order); with
    `offset`, Gemma's: scaled by (1 + weight) in f32, then cast."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


class LayerWeights(NamedTuple):
    """One decoder layer's weights (stacked: every layer's, each with a leading [num_layers] axis).
    The family's own weights are None where its architecture has none (`jaxcb.model.families`)."""

    attn_norm: jax.Array  # [D]
    q_proj: jax.Array  # [D, Hq, K]
    k_proj: jax.Array  # [D, Hkv, K]
    v_proj: jax.Array  # [D, Hkv, K]
    o_proj: jax.Array  # [Hq, K, D]
    mlp_norm: jax.Array  # [D]
    gate_proj: jax.Array  # [D, F]
    up_proj: jax.Array  # [D, F]
    down_proj: jax.Array  # [F, D]
    q_bias: Optional[jax.Array] = None  # [Hq, K]: cfg.qkv_bias
    k_bias: Optional[jax.Array] = None  # [Hkv, K]
    v_bias: Optional[jax.Array] = None  # [Hkv, K]
    q_norm: Optional[jax.Array] = None  # [K]: cfg.qk_norm, one weight shared by every head
    k_norm: Optional[jax.Array] = None  # [K]
    post_attn_norm: Optional[jax.Array] = None  # [D]: cfg.sandwich_norms, on attention's output
    post_mlp_norm: Optional[jax.Array] = None  # [D]: on the MLP's output


def layer_weight_names(cfg: LlamaConfig) -> tuple[str, ...]:
    """The `LayerWeights` fields this architecture has."""
    optional = {"q_bias": cfg.qkv_bias, "k_bias": cfg.qkv_bias, "v_bias": cfg.qkv_bias, "q_norm": cfg.qk_norm,
                "k_norm": cfg.qk_norm, "post_attn_norm": cfg.sandwich_norms, "post_mlp_norm": cfg.sandwich_norms}
    return tuple(name for name in LayerWeights._fields if optional.get(name, True))


class StepWeights(NamedTuple):
    """The weights as the step takes them, prepared once by a backend."""

    embed: jax.Array  # [V, D]: the token lookup
    layers: Any  # the backend's layer weights: one tree stacked on [L] (scan) or a list, one per layer
    final_norm: jax.Array  # [D]
    head: Any  # the backend's LM head
    rope_table: jax.Array  # f32[2, max_len, K // 2]: cos and sin of every position's rotary angles
    local_rope_table: Optional[jax.Array] = None  # the same for the windowed layers' base (cfg.rope_local_theta)
    # LoRA's slot buffers (`jaxcb.model.lora`), laid out as `layers` is (stacked or a list); None: no LoRA
    lora: Any = None


class DecoderLayers(nnx.Module):
    """All decoder layers, each weight stacked on a leading [num_layers] axis."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        Hq, Hkv, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt = jnp.dtype(cfg.dtype)
        normal = nnx.initializers.normal(INIT_STD)
        norm = jnp.zeros if cfg.norm_offset else jnp.ones  # a norm scales by 1 at init: Gemma's by 1 + w
        self.attn_norm = nnx.Param(norm((L, D), dt))
        self.q_proj = nnx.Param(normal(rngs.params(), (L, D, Hq, K), dt))
        self.k_proj = nnx.Param(normal(rngs.params(), (L, D, Hkv, K), dt))
        self.v_proj = nnx.Param(normal(rngs.params(), (L, D, Hkv, K), dt))
        self.o_proj = nnx.Param(normal(rngs.params(), (L, Hq, K, D), dt))
        self.mlp_norm = nnx.Param(norm((L, D), dt))
        self.gate_proj = nnx.Param(normal(rngs.params(), (L, D, F), dt))
        self.up_proj = nnx.Param(normal(rngs.params(), (L, D, F), dt))
        self.down_proj = nnx.Param(normal(rngs.params(), (L, F, D), dt))
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(normal(rngs.params(), (L, Hq, K), dt))
            self.k_bias = nnx.Param(normal(rngs.params(), (L, Hkv, K), dt))
            self.v_bias = nnx.Param(normal(rngs.params(), (L, Hkv, K), dt))
        if cfg.qk_norm:
            self.q_norm = nnx.Param(norm((L, K), dt))
            self.k_norm = nnx.Param(norm((L, K), dt))
        if cfg.sandwich_norms:
            self.post_attn_norm = nnx.Param(norm((L, D), dt))
            self.post_mlp_norm = nnx.Param(norm((L, D), dt))

    def weights(self) -> LayerWeights:
        return LayerWeights(**{name: getattr(self, name).get_value() for name in LayerWeights._fields
                               if hasattr(self, name)})


class Llama(nnx.Module):
    """The parameters, in the layout they are loaded and saved in; a backend's `prepare` takes them over."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.dtype)
        normal = nnx.initializers.normal(INIT_STD)
        self.embed = nnx.Param(normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dt))
        self.layers = DecoderLayers(cfg, rngs=rngs)
        self.final_norm = nnx.Param((jnp.zeros if cfg.norm_offset else jnp.ones)((cfg.hidden_size,), dt))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(normal(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dt))


def build_rope_table(cfg: LlamaConfig, max_len: int, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """f32[2, max_len, head_dim // 2]: the rotary angles of positions [0, max_len), max_len x head_dim
    f32 of memory (4 MiB for head_dim 128 at 8,192 positions). A gather from it replaces cos/sin in
    the step: XLA fuses whatever computes the angles into every layer's q and k rotations, where it
    runs once per head. Computed by the same XLA cos/sin as `rope_angles`, so the values are the same bits."""
    return _rope_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_len, sharding)


def build_local_rope_table(cfg: LlamaConfig, max_len: int, sharding: jax.sharding.Sharding | None = None
                           ) -> Optional[jax.Array]:
    """The windowed layers' table (their own base, unscaled), where the model has one (Gemma 3)."""
    if not cfg.rope_local_theta:
        return None
    return _rope_table(cfg.head_dim, cfg.rope_local_theta, None, max_len, sharding)


def _rope_table(head_dim: int, theta: float, scaling: RopeScaling | None, max_len: int, sharding) -> jax.Array:
    inv_freq = jnp.asarray(rope_inv_freq(head_dim, theta, scaling))
    scale = rope_attention_factor(scaling)
    return jax.jit(lambda: jnp.stack(rope_angles(jnp.arange(max_len, dtype=jnp.int32), inv_freq)) * scale,
                   out_shardings=sharding)()


@runtime_checkable
class LayerOps(Protocol):
    """The layer operations `forward` calls; a backend (`jaxcb.backends.Backend`) provides them.

    `w` is one layer's weights in the form the backend prepared them (an entry of
    `StepWeights.layers`, or all layers stacked, sliced by the scan): only the backend reads them.
    The LM head is not here: the runner's step calls it (`Backend.logits_and_argmax`), not the model.
    Axes: T tokens, D hidden, Hq query heads, K head_dim.
    """

    @property
    def cfg(self) -> LlamaConfig:
        """The architecture: layers, heads, norm epsilon."""
        ...

    @property
    def attention(self) -> AttentionForm:
        """The attention form: `forward` calls its `prepare_step` once, before the layers."""
        ...

    def self_attention(
        self,
        w: Any,  # one layer's weights
        h: jax.Array,  # [T, D]: the residual stream
        rope: tuple[jax.Array, jax.Array],  # (cos, sin) f32[T, K // 2]
        cache: KVCache,
        layer: jax.Array,  # i32[]
        md: AttentionMetadata,
        window: Optional[jax.Array] = None,  # i32[]: the layer's sliding window (NO_WINDOW: none); None: no layer has one
        lora: Optional[LoraRows] = None,  # each row's adapter on q/k/v; None: LoRA is not compiled in
    ) -> tuple[jax.Array, KVCache]:  # (attention output [T, Hq, K], the cache with this layer's new K/V)
        """Norm, project q/k/v (+ bias, + each row's LoRA update), q/k norms, rope, write every row's new
        K/V, then attend."""
        ...

    def add_attention_output(
        self,
        w: Any,  # one layer's weights
        h: jax.Array,  # [T, D]
        attn: jax.Array,  # [T, Hq, K], in h's dtype
        lora: Optional[LoraRows] = None,  # each row's adapter on o_proj
        num_tokens: Optional[jax.Array] = None,  # i32[]: the real tokens; rows past them are padding, never read
    ) -> jax.Array:  # [T, D]: h + attn @ o_proj (+ its LoRA update); a padding row's may be anything finite
        ...

    def add_mlp(
        self,
        w: Any,  # one layer's weights
        h: jax.Array,  # [T, D]
        lora: Optional[LoraRows] = None,  # each row's adapter on gate/up/down
        num_tokens: Optional[jax.Array] = None,  # i32[]: as in add_attention_output
    ) -> jax.Array:  # [T, D]: h + SwiGLU(norm(h)) (gate, up and down each with its LoRA update)
        ...


def forward(
    ops: LayerOps,  # the backend's layer operations
    w: StepWeights,
    token_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    cache: KVCache,
    md: AttentionMetadata,
    lora_mask: Optional[jax.Array] = None,  # f32[T, S R]: each token row's LoRA slot columns (w.lora set; lora_row_mask)
    lora_ids: Optional[jax.Array] = None,  # i32[T]: each token row's LoRA slot, -1 for the base (w.lora set)
) -> tuple[jax.Array, KVCache]:  # ([T, hidden] final-normed, updated cache)
    cfg = ops.cfg
    # Clipped: padding tokens may carry any position.
    cos_sin = jnp.take(w.rope_table, positions, axis=1, mode="clip")  # f32[2, T, head_dim // 2]
    if w.local_rope_table is not None:  # the windowed layers' own base: [2 (global, local), 2, T, K // 2]
        cos_sin = jnp.stack([cos_sin, jnp.take(w.local_rope_table, positions, axis=1, mode="clip")])
        local = jnp.asarray([bool(win) for win in cfg.layer_windows], jnp.int32)  # i32[L]: 1 on windowed layers
    else:
        local = None

    def layer_step(carry, xs):
        (h, cache), (layer, window, is_local, lw, ll) = carry, xs
        lora = None if ll is None else LoraRows(ll, lora_mask, lora_ids)
        return decoder_layer(ops, lw, h, cos_sin, is_local, cache, layer, md, window, lora), None

    # What attention derives from the step's metadata (the kernel's tile table) is built once, here.
    md = ops.attention.prepare_step(md, token_ids.shape[0], cfg.num_heads // cfg.num_kv_heads, cache.k.shape[3])
    h = jnp.take(w.embed, token_ids, axis=0)
    if cfg.embed_scale:  # Gemma: sqrt(hidden) rounded to the activation dtype first, as transformers does
        h = h * jnp.asarray(math.sqrt(cfg.hidden_size), h.dtype)
    # Each layer's window, a traced i32[] (it changes from layer to layer inside the scan); None when
    # no layer has one, so that a model without windows compiles the attention it always had.
    windows = layer_window_array(cfg)
    if isinstance(w.layers, list):
        for i, lw in enumerate(w.layers):
            window = None if windows is None else windows[i]
            lora = None if w.lora is None else LoraRows(w.lora[i], lora_mask, lora_ids)
            h, cache = _decoder_layer_traced_once(ops, lw, h, cos_sin, None if local is None else local[i], cache,
                                                  jnp.int32(i), md, window, lora)
    else:
        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (h, cache), _ = jax.lax.scan(layer_step, (h, cache), (layers, windows, local, w.layers, w.lora))
    return rms_norm(h, w.final_norm, cfg.rms_norm_eps, cfg.norm_offset), cache


def decoder_layer(
    ops: LayerOps,
    w: Any,  # one layer's weights
    h: jax.Array,  # [T, D]: the residual stream
    cos_sin: jax.Array,  # f32[2, T, K // 2] (or [2 (global, local), 2, T, K // 2] with a local table)
    is_local: Optional[jax.Array],  # i32[]: 1 on a windowed layer (which has its own table); None: one table
    cache: KVCache,
    layer: jax.Array,  # i32[]
    md: AttentionMetadata,
    window: Optional[jax.Array],  # i32[]: the layer's sliding window; None: no layer has one
    lora: Optional[LoraRows] = None,  # the layer's LoRA slots and each row's slot; None: no LoRA
) -> tuple[jax.Array, KVCache]:  # ([T, D], the cache with this layer's new K/V)
    """One decoder layer: attention (its K/V written), output projection plus residual, MLP plus residual."""
    cs = cos_sin if is_local is None else cos_sin[is_local]
    # The step's real tokens (the last sequence's end): a backend may skip the padding rows after them.
    num_tokens = md.query_start_loc[-1]
    if lora is None:  # the operations' own calls: a model without LoRA compiles what it always did
        attn, cache = ops.self_attention(w, h, (cs[0], cs[1]), cache, layer, md, window)
        h = ops.add_attention_output(w, h, attn.astype(h.dtype), num_tokens=num_tokens)
        return ops.add_mlp(w, h, num_tokens=num_tokens), cache
    attn, cache = ops.self_attention(w, h, (cs[0], cs[1]), cache, layer, md, window, lora=lora)
    h = ops.add_attention_output(w, h, attn.astype(h.dtype), lora=lora, num_tokens=num_tokens)
    return ops.add_mlp(w, h, lora=lora, num_tokens=num_tokens), cache


# The unrolled loop's layer, a nested jit: every layer has the same shapes, so a step traces and
# lowers one layer, not one per layer (SmolLM2's 34 start-up steps lower in 3.5 s instead of 4.5 s),
# and XLA inlines the calls: the compiled step is the one the plain loop compiles.
_decoder_layer_traced_once = jax.jit(decoder_layer, static_argnums=(0,))


def layer_window_array(cfg: LlamaConfig) -> Optional[jax.Array]:
    """i32[L]: each layer's sliding window, NO_WINDOW for a layer without one; None when no layer has one."""
    if not any(cfg.layer_windows):
        return None
    from jaxcb.kernels.attention import NO_WINDOW

    return jnp.asarray([w or NO_WINDOW for w in cfg.layer_windows], jnp.int32)


def build_random_model(cfg: LlamaConfig, seed: int) -> Llama:
    return Llama(cfg, rngs=nnx.Rngs(seed))


def build_abstract_model(cfg: LlamaConfig) -> Llama:
    """The model with ShapeDtypeStruct leaves: shapes and sizes without allocating weights."""
    return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))


def count_params(model: Llama) -> int:
    state = nnx.state(model, nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
