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

`model.linear_impl=cpu` (the default on CPU for float32 weights) then packs each unrolled
layer's projections into the 16-column panels of the C++ matmul (`cpu_kernels`), with q/k/v
fused into one matrix and gate/up into another (`PackedDecoderLayer`), and the LM head the
same way: XLA:CPU's dot re-packs its weight operand on every call and streams it at a few
GB/s for a decode step's few rows, where the packed kernel runs near the machine's matmul
peak. The layer's arithmetic is the same; only who multiplies changes.

Axis letters in einsums: t tokens, d hidden, h heads, k head_dim, f MLP width, v vocab.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from cpu_kernels import (
    ATTENTION_DTYPES as CPU_CACHE_DTYPES, CpuKernelUnavailable, load_cpu_kernels, pack_columns, pack_gate_up,
    packed_matmul, packed_matmul_argmax, packed_mlp, packed_qkv,
)
from jaxcb.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from jaxcb.config import ConfigError
from jaxcb.kv_cache import KVCache
from jaxcb.model.config import LlamaConfig, RopeScaling

INIT_STD = 0.02
log = logging.getLogger(__name__)


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


class RopeTable(nnx.Variable):
    """f32[2, max_len, head_dim // 2]: cos and sin of every position's rotary angles."""


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

    # A layer's three steps on the residual stream h [T, D]; the packed weights below fuse the
    # norms and residual adds into their kernels.
    def norm_and_project_qkv(self, h: jax.Array, cfg: LlamaConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
        x = rms_norm(h, self.attn_norm, cfg.rms_norm_eps)
        return tuple(jnp.einsum("td,dhk->thk", x, w) for w in (self.q_proj, self.k_proj, self.v_proj))

    def add_attention_output(self, h: jax.Array, attn: jax.Array, cfg: LlamaConfig) -> jax.Array:  # attn [T, Hq, K]
        return h + jnp.einsum("thk,hkd->td", attn, self.o_proj)

    def add_mlp(self, h: jax.Array, cfg: LlamaConfig) -> jax.Array:
        x = rms_norm(h, self.mlp_norm, cfg.rms_norm_eps)
        gate = jnp.einsum("td,df->tf", x, self.gate_proj)
        up = jnp.einsum("td,df->tf", x, self.up_proj)
        return h + jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, self.down_proj)


class PackedLayerWeights(NamedTuple):
    """One layer's weights packed for `cpu_kernels.packed_matmul` (`pack_columns` panels [P, in, 16])."""

    attn_norm: jax.Array  # [D]
    qkv_proj: jax.Array  # panels of [D, (Hq + 2 Hkv) K]: q, k and v side by side
    o_proj: jax.Array  # panels of [Hq K, D]
    mlp_norm: jax.Array  # [D]
    gate_up_proj: jax.Array  # panels of [D, F] each for gate and up, in pairs (`pack_gate_up`)
    down_proj: jax.Array  # panels of [F, D]

    @staticmethod
    def pack(w: LayerWeights) -> "PackedLayerWeights":
        d = w.q_proj.shape[0]
        qkv = jnp.concatenate([p.reshape(d, -1) for p in (w.q_proj, w.k_proj, w.v_proj)], axis=1)
        return PackedLayerWeights(
            w.attn_norm,
            pack_columns(qkv),
            pack_columns(w.o_proj.reshape(-1, w.o_proj.shape[-1])),
            w.mlp_norm,
            pack_gate_up(w.gate_proj, w.up_proj),
            pack_columns(w.down_proj),
        )

    def norm_and_project_qkv(self, h: jax.Array, cfg: LlamaConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = packed_matmul(h, self.qkv_proj, q + 2 * kv, norm=self.attn_norm, eps=cfg.rms_norm_eps)
        return (
            qkv[:, :q].reshape(-1, cfg.num_heads, cfg.head_dim),
            qkv[:, q : q + kv].reshape(-1, cfg.num_kv_heads, cfg.head_dim),
            qkv[:, q + kv :].reshape(-1, cfg.num_kv_heads, cfg.head_dim),
        )

    def project_qkv_and_write(
        self, h: jax.Array, cfg: LlamaConfig, rope: tuple[jax.Array, jax.Array], cache: KVCache, layer: jax.Array,
        slot_mapping: jax.Array,
    ) -> tuple[jax.Array, KVCache]:  # (q roped [T, Hq, K], the cache with this layer's new K/V)
        """norm_and_project_qkv, apply_rope and write_kv in one kernel call, the same values bit for bit."""
        q, k_cache, v_cache = packed_qkv(h, self.qkv_proj, self.attn_norm, cfg.rms_norm_eps, *rope, cache.k, cache.v,
                                         layer, slot_mapping, cfg.num_heads)
        return q, KVCache(k_cache, v_cache)

    def add_attention_output(self, h: jax.Array, attn: jax.Array, cfg: LlamaConfig) -> jax.Array:
        return packed_matmul(attn.reshape(attn.shape[0], -1), self.o_proj, cfg.hidden_size, residual=h)

    def add_mlp(self, h: jax.Array, cfg: LlamaConfig) -> jax.Array:
        return packed_mlp(h, self.gate_up_proj, self.down_proj, cfg.hidden_size, norm=self.mlp_norm,
                          eps=cfg.rms_norm_eps, residual=h)


class _LayerParams(nnx.Module):
    WEIGHTS = LayerWeights

    def weights(self):
        return self.WEIGHTS(*(getattr(self, name)[...] for name in self.WEIGHTS._fields))


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


class PackedDecoderLayer(DecoderLayer):
    """One decoder layer's weights packed for the CPU matmul (`model.linear_impl=cpu`)."""

    WEIGHTS = PackedLayerWeights


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
    w: LayerWeights | PackedLayerWeights,
    rope: tuple[jax.Array, jax.Array],  # (cos, sin) of the tokens' rotary angles, f32[T, head_dim // 2]
    md: AttentionMetadata,
) -> tuple[jax.Array, KVCache]:  # ([T, hidden], cache with this layer's new K/V)
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    # Packed weights on one device: q/k/v, rope and the cache write are one kernel call.
    if isinstance(w, PackedLayerWeights) and attention.mesh is None and cache.k.dtype.name in CPU_CACHE_DTYPES:
        q, cache = w.project_qkv_and_write(h, cfg, rope, cache, layer, md.slot_mapping)
        attn = attention.attend(q, cache, layer, md, sm_scale)
    else:
        q, k, v = w.norm_and_project_qkv(h, cfg)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        attn, cache = attention.write_and_attend(q, k, v, cache, layer, md, sm_scale)
    h = w.add_attention_output(h, attn.astype(h.dtype), cfg)
    return w.add_mlp(h, cfg), cache


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
        rope = self.rope_angles(positions)

        def layer_step(carry, xs):
            (h, cache), (layer, w) = carry, xs
            return decoder_layer(cfg, self.attention, h, cache, layer, w, rope, md), None

        h = jnp.take(self.embed[...], token_ids, axis=0)
        if isinstance(self.layers, DecoderLayers):
            layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            (h, kv_cache), _ = jax.lax.scan(layer_step, (h, kv_cache), (layers, self.layers.weights()))
        else:
            for i, layer in enumerate(self.layers):
                (h, kv_cache), _ = layer_step((h, kv_cache), (jnp.int32(i), layer.weights()))
        return rms_norm(h, self.final_norm[...], cfg.rms_norm_eps), kv_cache

    def rope_angles(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:  # i32[T] -> 2 x f32[T, head_dim // 2]
        table = getattr(self, "rope_table", None)
        if table is not None:
            # A gather, not cos/sin: XLA fuses whatever computes the angles into every layer's
            # q and k rotations, where it runs once per head, so the engine reads them from a
            # table built once (`build_rope_table`). Clipped: padding tokens may carry any position.
            cos_sin = jnp.take(table[...], positions, axis=1, mode="clip")
            return cos_sin[0], cos_sin[1]
        return rope_angles(positions, self._rope_inv_freq())

    def _rope_inv_freq(self) -> jax.Array:
        cfg = self.cfg
        return jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

    def build_rope_table(self, max_len: int, sharding: jax.sharding.Sharding | None = None) -> None:
        """Precompute the rotary angles of positions [0, max_len): max_len x head_dim f32 of memory
        (4 MiB for head_dim 128 at 8,192 positions). Computed by the same XLA cos/sin as the
        in-step path, so the values are the same bits."""
        inv_freq = self._rope_inv_freq()
        table = jax.jit(lambda: jnp.stack(rope_angles(jnp.arange(max_len, dtype=jnp.int32), inv_freq)),
                        out_shardings=sharding)()
        self.rope_table = RopeTable(table)

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

    def pack_linear_weights(self) -> None:
        """Pack every unrolled layer's projections and the LM head for the CPU matmul, in place.

        Layer by layer, so that at most one layer's weights exist twice at a time. The tied
        embedding stays as it is for the token lookup; its packed transpose is a copy."""
        if isinstance(self.layers, DecoderLayers):
            raise ValueError("pack_linear_weights needs unrolled layers: call unstack_layers first")
        pack = jax.jit(PackedLayerWeights.pack)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, PackedDecoderLayer):
                continue
            packed = pack(layer.weights())
            for name in LayerWeights._fields:
                delattr(layer, name)
            self.layers[i] = PackedDecoderLayer(packed)
        if getattr(self, "packed_lm_head", None) is None:
            head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
            self.packed_lm_head = nnx.Param(jax.jit(pack_columns)(head))
            if not self.cfg.tie_word_embeddings:
                del self.lm_head

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, hidden] -> f32[N, vocab]
        if getattr(self, "packed_lm_head", None) is not None:
            return packed_matmul(hidden, self.packed_lm_head[...], self.cfg.vocab_size)
        if self.cfg.tie_word_embeddings:
            logits = jnp.einsum("td,vd->tv", hidden, self.embed[...])
        else:
            logits = jnp.einsum("td,dv->tv", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)

    def logits_and_argmax(self, hidden: jax.Array, want_logits: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(logits, their row argmax, or None where it is not computed on the way). With the packed
        LM head the argmax comes out of the matmul, and where `want_logits` (a traced bool) is false
        the logits are never written (their contents are then undefined): a step whose every row
        is greedy needs only the argmax."""
        if getattr(self, "packed_lm_head", None) is not None:
            return packed_matmul_argmax(hidden, self.packed_lm_head[...], self.cfg.vocab_size, want_logits)
        return self.compute_logits(hidden), None


def resolve_layer_loop(layer_loop: str, platform: str | None = None) -> str:
    """`scan` or `unrolled` (the value is validated with the config): `auto` unrolls on CPU (see
    the module docstring) and scans elsewhere, where tracing one layer keeps compile time low."""
    if layer_loop == "auto":
        return "unrolled" if (platform or jax.default_backend()) == "cpu" else "scan"
    return layer_loop


def resolve_linear_impl(
    linear_impl: str, *, dtype: str, layer_loop: str, tensor_parallel_size: int, platform: str | None = None
) -> str:
    """`cpu` or `xla` (the value is validated with the config). `auto` picks the C++ matmul where
    it applies -- CPU, float32 weights, unrolled layers, one device -- and XLA's dot elsewhere;
    `cpu` where it does not apply is a ConfigError that says what to change."""
    if linear_impl == "xla":
        return "xla"
    platform = platform or jax.default_backend()
    why_not = []
    if platform != "cpu":
        why_not.append(f"it runs on CPU only (this is {platform})")
    if dtype != "float32":
        why_not.append(f"it takes float32 weights (model.dtype={dtype})")
    if layer_loop != "unrolled":
        why_not.append("it needs model.layer_loop=unrolled")
    if tensor_parallel_size > 1:
        why_not.append(f"it runs on one device (engine.tensor_parallel_size={tensor_parallel_size})")
    if not why_not:
        try:
            load_cpu_kernels()
        except CpuKernelUnavailable as e:
            if linear_impl == "auto":
                log.warning("model.linear_impl=auto: the C++ CPU matmul is unavailable, using XLA's dot (%s)", e)
            why_not.append(str(e))
    if not why_not:
        return "cpu"
    if linear_impl == "auto":
        return "xla"
    raise ConfigError(f"model.linear_impl=cpu: {'; '.join(why_not)}. Use model.linear_impl=auto or xla")


def build_random_model(cfg: LlamaConfig, seed: int, attention: AttentionBackend | None = None) -> Llama:
    return Llama(cfg, rngs=nnx.Rngs(seed), attention=attention)


def build_abstract_model(cfg: LlamaConfig, attention: AttentionBackend | None = None) -> Llama:
    """The model with ShapeDtypeStruct leaves: shapes and sizes without allocating weights."""
    return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), attention=attention))


def count_params(model: Llama) -> int:
    state = nnx.state(model, nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
