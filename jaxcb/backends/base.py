"""The layer operations the model calls (`jaxcb.model.llama.forward`), as XLA computes them.

A backend is chosen once at start-up (`jaxcb.backends.select_backend`). It prepares the
model's parameters once (`prepare`: per-layer arrays, packed or fused matrices, the rotary
table) and provides the operations the model's one forward pass calls (the protocol
`jaxcb.model.llama.LayerOps`), and the LM head, which the runner's step calls:

    self_attention        norm, project q/k/v, rope, write the new K/V, attend
    add_attention_output  h + attn @ o_proj
    add_mlp               h + SwiGLU(norm(h))
    logits_and_argmax     the LM head over the rows that sample (and their argmax, if the
                          backend gets it on the way)

`Backend` itself is the `xla` backend: XLA's dot everywhere, on any platform and mesh.
Subclasses override what they do differently. A backend is a frozen dataclass, hashable, so
it can be a static argument of a jit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxcb.kernels.attention import AttentionForm, AttentionMetadata, KVCache
from jaxcb.model.config import LlamaConfig
from jaxcb.model.lora import LoraRows, lora_delta
from jaxcb.sampling import Argmax, xla_argmax
from jaxcb.sharding import TP_AXIS
from jaxcb.model.llama import (LayerWeights, Llama, StepWeights, apply_rope, build_local_rope_table,
                               build_rope_table, layer_weight_names, rms_norm)

if TYPE_CHECKING:
    from jaxcb.startup_memory import WeightBytes

class FusedLayerWeights(NamedTuple):
    """One layer's weights (or every layer's, stacked) with q/k/v and gate/up each one matrix, so that a
    layer reads its input once for three projections and once for two. Under tensor parallelism the
    fused axes are grouped by device (G = the mesh size): each device's own q, k and v heads and its
    MLP columns stay side by side, and the split costs no communication."""

    attn_norm: jax.Array  # [D]
    qkv_proj: jax.Array  # [D, G, (Hq + 2 Hkv) / G, K]: a device group's q heads, then its k, then its v
    o_proj: jax.Array  # [Hq, K, D]
    mlp_norm: jax.Array  # [D]
    gate_up_proj: jax.Array  # [D, G, 2, F / G]: a device group's gate columns, then its up columns
    down_proj: jax.Array  # [F, D]
    qkv_bias: Optional[jax.Array] = None  # [G, (Hq + 2 Hkv) / G, K], grouped as qkv_proj (cfg.qkv_bias)
    q_norm: Optional[jax.Array] = None  # [K] (cfg.qk_norm)
    k_norm: Optional[jax.Array] = None  # [K]
    post_attn_norm: Optional[jax.Array] = None  # [D] (cfg.sandwich_norms)
    post_mlp_norm: Optional[jax.Array] = None  # [D]


def _tp_groups(w: LayerWeights) -> tuple[int, Optional[jax.sharding.Mesh]]:
    """(device groups of the fused axes, the mesh): the mesh's size when q_proj is split over it."""
    sharding = getattr(w.q_proj, "sharding", None)
    if isinstance(sharding, NamedSharding) and any(axis is not None for axis in sharding.spec):
        return sharding.mesh.size, sharding.mesh
    return 1, None


def _fused_sharding(mesh: Optional[jax.sharding.Mesh], lead: int) -> Optional[NamedSharding]:
    return None if mesh is None else NamedSharding(mesh, PartitionSpec(*([None] * (lead + 1)), TP_AXIS))


def _run_fusion(fn, parts: tuple, mesh: Optional[jax.sharding.Mesh], lead: int) -> jax.Array:
    fused = jax.jit(fn, out_shardings=_fused_sharding(mesh, lead))
    abstract = any(isinstance(p, jax.ShapeDtypeStruct) for p in parts)  # an abstract model (lowering tests)
    return jax.eval_shape(fused, *parts) if abstract else fused(*parts)


def fuse_qkv(q, k, v, groups: int = 1, mesh: Optional[jax.sharding.Mesh] = None) -> jax.Array:
    """[..., D, Hq, K], [..., D, Hkv, K] x 2 -> [..., D, G, (Hq + 2 Hkv) / G, K], device group by group.
    Their biases the same way, with no D axis: [..., Hq, K] x 3 -> [..., G, (Hq + 2 Hkv) / G, K]."""
    lead = q.ndim - 3  # 1 for stacked weights [L, ...], 0 for one layer's (biases: one less)

    def fuse(q, k, v):
        *outer, _, head_dim = q.shape
        by_group = lambda p: p.reshape(*outer, groups, p.shape[-2] // groups, head_dim)  # noqa: E731
        return jnp.concatenate([by_group(q), by_group(k), by_group(v)], axis=-2)

    return _run_fusion(fuse, (q, k, v), mesh, lead)


def fuse_qkv_bias(parts: dict, groups: int, mesh: Optional[jax.sharding.Mesh]) -> Optional[jax.Array]:
    """The q/k/v biases popped from `parts` and fused as `fuse_qkv` fuses their matrices (None without)."""
    biases = [parts.pop(name, None) for name in ("q_bias", "k_bias", "v_bias")]
    if biases[0] is None:
        return None
    # The same grouping as the matrices, seen as [..., 1, H, K]: a D axis of one, dropped after.
    fused = fuse_qkv(*(b[..., None, :, :] for b in biases), groups, mesh)
    return fused.reshape(*fused.shape[:-4], *fused.shape[-3:])


def fuse_gate_up(gate, up, groups: int = 1, mesh: Optional[jax.sharding.Mesh] = None) -> jax.Array:
    """[..., D, F] x 2 -> [..., D, G, 2, F / G], device group by group."""
    lead = gate.ndim - 2

    def fuse(gate, up):
        *outer, d, f = gate.shape
        return jnp.stack([p.reshape(*outer, d, groups, f // groups) for p in (gate, up)], axis=-2)

    return _run_fusion(fuse, (gate, up), mesh, lead)


def fuse_layer_weights(w: LayerWeights, mesh: Optional[jax.sharding.Mesh] = None) -> FusedLayerWeights:
    """q/k/v and gate/up fused (`FusedLayerWeights`), for one layer or stacked layers, sharded as the
    parts were (the fused axes split over the mesh by device group). `mesh`: the tensor-parallel mesh
    (default: the one q_proj is split over, if any). The other weights are kept as they are (no copy)."""
    groups, mesh = _tp_groups(w) if mesh is None else (mesh.size, mesh)
    qkv = fuse_qkv(w.q_proj, w.k_proj, w.v_proj, groups, mesh)
    gate_up = fuse_gate_up(w.gate_proj, w.up_proj, groups, mesh)
    bias = fuse_qkv_bias(dict(q_bias=w.q_bias, k_bias=w.k_bias, v_bias=w.v_bias), groups, mesh)
    return FusedLayerWeights(w.attn_norm, qkv, w.o_proj, w.mlp_norm, gate_up, w.down_proj, bias, w.q_norm, w.k_norm,
                             w.post_attn_norm, w.post_mlp_norm)


def fuse_stacked_weights(parts: dict[str, jax.Array]) -> FusedLayerWeights:
    """`fuse_layer_weights` for stacked weights handed over in a dict it empties: q/k/v are fused and
    let go before gate/up are, so that start-up holds at most one of the two fused copies beside the
    originals (the 8B's gate/up copy alone is 7 GiB in bf16; `Backend.prepare_memory`)."""
    groups, mesh = _tp_groups(LayerWeights(**{name: parts.get(name) for name in LayerWeights._fields}))
    qkv = fuse_qkv(parts.pop("q_proj"), parts.pop("k_proj"), parts.pop("v_proj"), groups, mesh)
    bias = fuse_qkv_bias(parts, groups, mesh)
    gate_up = fuse_gate_up(parts.pop("gate_proj"), parts.pop("up_proj"), groups, mesh)
    return FusedLayerWeights(parts.pop("attn_norm"), qkv, parts.pop("o_proj"), parts.pop("mlp_norm"), gate_up,
                             parts.pop("down_proj"), bias, parts.pop("q_norm", None), parts.pop("k_norm", None),
                             parts.pop("post_attn_norm", None), parts.pop("post_mlp_norm", None))


def cap_logits(logits: jax.Array, cap: float) -> jax.Array:
    """c tanh(logits / c) (Gemma 2's final soft-cap; 0: none). Monotonic, so the argmax is the uncapped one's."""
    return logits if not cap else cap * jnp.tanh(logits / cap)


def split_layers(stacked: jax.Array) -> tuple[jax.Array, ...]:
    """[L, ...] -> L arrays [...], each split over the devices as its parent was, minus the layer axis:
    one compiled slice at a layer index it is given, called once a layer (one program returning all L
    slices took XLA:CPU ~0.5 s to compile for each weight's shape, ~3 s of SmolLM2's cold start)."""
    sharding = stacked.sharding if isinstance(stacked, jax.Array) else None
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    layer = jax.jit(lambda w, i: w[i], out_shardings=sharding)
    return tuple(layer(stacked, i) for i in range(stacked.shape[0]))


@dataclasses.dataclass(frozen=True)
class Backend:
    cfg: LlamaConfig
    attention: AttentionForm
    unroll_layers: bool = False  # prepare one array per layer and weight, run the layers in a loop
    argmax: Argmax = xla_argmax  # the row argmax that sampling uses (same indices whatever it is)
    name = "xla"

    @property
    def lora_dtype(self) -> jnp.dtype:
        """The LoRA slot buffers' dtype: the model's (the adapters are cast to it either way)."""
        return jnp.dtype(self.cfg.dtype)

    def describe(self) -> str:
        return f"backend {self.name} (XLA's dot; layers {'unrolled' if self.unroll_layers else 'scanned'})"

    # --- preparing the weights, once at start-up ----------------------------------------------

    def prepare(self, model: Llama, max_len: int, replicated: Optional[jax.sharding.Sharding] = None
                ) -> StepWeights:
        """The step's weights from the loaded model, whose parameters this takes over (the model is
        left without them): weight by weight, so that at most one stacked weight exists twice at
        a time. `replicated`: where the rotary table goes under tensor parallelism."""
        cfg = self.cfg
        stacked = model.layers
        names = layer_weight_names(cfg)
        if self.unroll_layers:
            columns = []  # columns[weight][layer]
            for name in names:
                columns.append(split_layers(getattr(stacked, name).get_value()))
                delattr(stacked, name)
            layers = [LayerWeights(**dict(zip(names, ws))) for ws in zip(*columns)]
            del columns
            layers = self.prepare_layers(layers)
        else:  # the model lets go of each stacked weight as prepare takes it
            parts = {name: getattr(stacked, name).get_value() for name in names}
            for name in names:
                delattr(stacked, name)
            layers = self.prepare_layers(parts)
        head = self.prepare_head(model)
        weights = StepWeights(model.embed.get_value(), layers, model.final_norm.get_value(), head,
                              build_rope_table(cfg, max_len, replicated), build_local_rope_table(cfg, max_len, replicated))
        del model.embed, model.layers, model.final_norm
        return weights

    def prepare_layers(self, layers):
        """The layers' weights as this backend's operations read them: q/k/v and gate/up fused,
        layer by layer (a list, unrolled, replaced in place so that one layer exists twice at a time)
        or all at once (stacked, scanned: a dict of the stacked weights, which it empties)."""
        if isinstance(layers, dict):
            return fuse_stacked_weights(layers)
        if isinstance(layers, LayerWeights):
            return fuse_layer_weights(layers)
        for i in range(len(layers)):
            layers[i] = fuse_layer_weights(layers[i])
        return layers

    def prepare_memory(self, weights: "WeightBytes", max_len: int) -> tuple[int, int]:
        """(the most `prepare` holds beyond the loaded weights at once, the prepared weights' bytes), on
        each device: start-up's memory plan (`jaxcb.startup_memory`). Scanned: one of the two fused
        copies beside the originals; unrolled: one stacked weight split into layers (gate or up), the
        larger. Fusing rewrites without adding; the rotary table comes on top."""
        rope_table = max_len * self.cfg.head_dim * 4 * (2 if self.cfg.rope_local_theta else 1)  # f32[2, max_len, K // 2]
        transient = weights.gate_up // 2 if self.unroll_layers else max(weights.qkv, weights.gate_up)
        return transient, weights.total + rope_table

    def prepare_head(self, model: Llama) -> Optional[jax.Array]:
        """The LM head as `logits` reads it: [D, V], or None with tied embeddings (read from `embed`)."""
        return None if self.cfg.tie_word_embeddings else model.lm_head.get_value()

    # --- the layer operations ------------------------------------------------------------------

    def self_attention(
        self,
        w: Union[FusedLayerWeights, LayerWeights],
        h: jax.Array,  # [T, D]: the residual stream
        rope: tuple[jax.Array, jax.Array],  # (cos, sin) f32[T, K // 2]
        cache: KVCache,
        layer: jax.Array,  # i32[]
        md: AttentionMetadata,
        window: Optional[jax.Array] = None,  # i32[]: this layer's sliding window; None: no layer has one
        lora: Optional[LoraRows] = None,  # each row's adapter; None: no LoRA
    ) -> tuple[jax.Array, KVCache]:  # (attention output [T, Hq, K], the cache with this layer's new K/V)
        x = self.norm(h, w.attn_norm)
        if isinstance(w, FusedLayerWeights):  # one matmul; each device group's q, k, v sliced out
            qkv = jnp.einsum("td,dgnk->tgnk", x, w.qkv_proj)
            if w.qkv_bias is not None:
                qkv = qkv + w.qkv_bias
            groups, num_q, num_kv = qkv.shape[1], self.cfg.num_heads, self.cfg.num_kv_heads
            q, k, v = (qkv[:, :, a // groups : b // groups].reshape(x.shape[0], b - a, -1)
                       for a, b in ((0, num_q), (num_q, num_q + num_kv), (num_q + num_kv, num_q + 2 * num_kv)))
        else:
            q, k, v = (jnp.einsum("td,dhk->thk", x, p) for p in (w.q_proj, w.k_proj, w.v_proj))
            if w.q_bias is not None:
                q, k, v = q + w.q_bias, k + w.k_bias, v + w.v_bias
        if lora is not None:
            q, k, v = self.add_lora_qkv(x, q, k, v, lora)
        return self.rope_write_and_attend(w, q, k, v, rope, cache, layer, md, window)

    # --- LoRA: each row's low-rank update (`jaxcb.model.lora`) ----------------------------------

    def prepare_lora(self, buffers):
        """The LoRA slot buffers as `lora_update` reads them (here: as they are). Called after every slot
        write: it must compile once (a jitted function) and hold no more than one prepared copy."""
        return buffers

    def lora_update(self, x: jax.Array, lora: LoraRows, name: str, residual: Optional[jax.Array] = None
                    ) -> jax.Array:
        """[T, in] -> [T, out]: each row's x @ A @ B for projection `name` (zero on base rows), plus
        `residual` if given."""
        delta = lora_delta(x, getattr(lora.weights, name), lora.mask)
        return delta if residual is None else residual + delta.astype(residual.dtype)

    def add_lora_qkv(self, x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, lora: LoraRows
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q/k/v ([T, H, K] each) plus each row's LoRA update from the normed input x [T, D]."""
        q, k, v = (self.lora_update(x, lora, name, p.reshape(p.shape[0], -1)).reshape(p.shape)
                   for p, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
        return q, k, v

    def rope_write_and_attend(self, w, q, k, v, rope, cache: KVCache, layer, md: AttentionMetadata, window):
        """q/k norms (where the family has them), rope, then the form's write and attend: the part of
        self_attention after the projections, which every backend shares."""
        if w.q_norm is not None:  # one RMSNorm over each head's vector, before the rotation
            q, k = self.norm(q, w.q_norm), self.norm(k, w.k_norm)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        softcap = self.cfg.attn_logit_softcap or None
        if softcap is None:  # the forms' own call when nothing caps: every form compiles as without the argument
            return self.attention.write_and_attend(q, k, v, cache, layer, md, self.sm_scale, window)
        return self.attention.write_and_attend(q, k, v, cache, layer, md, self.sm_scale, window, softcap=softcap)

    def norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        """The model's RMSNorm: Llama's, or Gemma's (1 + w) (cfg.norm_offset)."""
        return rms_norm(x, weight, self.cfg.rms_norm_eps, self.cfg.norm_offset)

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.cfg.query_pre_attn_scalar or self.cfg.head_dim)

    def add_attention_output(self, w: LayerWeights, h: jax.Array, attn: jax.Array,
                             lora: Optional[LoraRows] = None, num_tokens: Optional[jax.Array] = None) -> jax.Array:
        # num_tokens unused: XLA's dot computes every row, the padding's with them
        out = jnp.einsum("thk,hkd->td", attn, w.o_proj)
        if lora is not None:
            out = self.lora_update(attn.reshape(attn.shape[0], -1), lora, "o_proj", out)
        return h + (out if w.post_attn_norm is None else self.norm(out, w.post_attn_norm))

    def add_mlp(self, w: LayerWeights, h: jax.Array, lora: Optional[LoraRows] = None,
                num_tokens: Optional[jax.Array] = None) -> jax.Array:
        x = self.norm(h, w.mlp_norm)
        if isinstance(w, FusedLayerWeights):
            gate_up = jnp.einsum("td,dgcf->tgcf", x, w.gate_up_proj)
            gate, up = (gate_up[:, :, c].reshape(x.shape[0], -1) for c in (0, 1))
        else:
            gate = jnp.einsum("td,df->tf", x, w.gate_proj)
            up = jnp.einsum("td,df->tf", x, w.up_proj)
        if lora is not None:
            gate, up = self.lora_update(x, lora, "gate_proj", gate), self.lora_update(x, lora, "up_proj", up)
        act = jax.nn.silu(gate) if self.cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
        out = jnp.einsum("tf,fd->td", act * up, w.down_proj)
        if lora is not None:
            out = self.lora_update(act * up, lora, "down_proj", out)
        return h + (out if w.post_mlp_norm is None else self.norm(out, w.post_mlp_norm))

    def head_weights(self, w: StepWeights) -> StepWeights:
        """What `logits` reads of the weights (the head, or the tied embedding), the rest None: the
        sampling step takes only these (every array an executable takes costs its call host time)."""
        return StepWeights(w.embed if w.head is None else None, None, None, w.head, None, None)

    def logits(self, w: StepWeights, hidden: jax.Array) -> jax.Array:  # [N, D] -> f32[N, V]
        if w.head is None:
            logits = jnp.einsum("td,vd->tv", hidden, w.embed).astype(jnp.float32)
        else:
            logits = jnp.einsum("td,dv->tv", hidden, w.head).astype(jnp.float32)
        return cap_logits(logits, self.cfg.final_logit_softcap)

    def logits_and_argmax(self, w: StepWeights, hidden: jax.Array, want_logits: jax.Array,
                          num_rows: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[jax.Array]]:
        """(logits f32[N, V], their row argmax i32[N] or None where it is not computed on the way).
        Where `want_logits` (a traced bool) is false a backend may leave the logits undefined. Rows
        from `num_rows` on (i32[], traced; None: every row) are padding: a backend may skip them, their
        logits zeros and argmax 0."""
        return self.logits(w, hidden), None
