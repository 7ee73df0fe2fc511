"""The layer operations the model calls (`jaxcb.model.llama.forward`), as XLA computes them.

A backend is chosen once at start-up (`jaxcb.backends.select_backend`). It prepares the
model's parameters once (`prepare`: per-layer arrays, packed or fused matrices, the rotary
table) and provides the operations the model's one forward pass calls:

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
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxcb.kernels.attention import AttentionForm, AttentionMetadata, KVCache
from jaxcb.model.config import LlamaConfig
from jaxcb.sampling import Argmax, xla_argmax
from jaxcb.model.llama import LayerWeights, Llama, StepWeights, apply_rope, build_rope_table, rms_norm

def split_layers(stacked: jax.Array) -> tuple[jax.Array, ...]:
    """[L, ...] -> L arrays [...], each split over the devices as its parent was, minus the layer axis."""
    sharding = stacked.sharding if isinstance(stacked, jax.Array) else None
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return tuple(jax.jit(lambda w: [w[i] for i in range(w.shape[0])], out_shardings=sharding)(stacked))


@dataclasses.dataclass(frozen=True)
class Backend:
    cfg: LlamaConfig
    attention: AttentionForm
    unroll_layers: bool = False  # prepare one array per layer and weight, run the layers in a loop
    argmax: Argmax = xla_argmax  # the row argmax that sampling uses (same indices whatever it is)
    name = "xla"

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
        if self.unroll_layers:
            columns = []  # columns[weight][layer]
            for name in LayerWeights._fields:
                columns.append(split_layers(getattr(stacked, name).get_value()))
                delattr(stacked, name)
            layers = [LayerWeights(*ws) for ws in zip(*columns)]
            del columns
        else:
            layers = stacked.weights()
        head = self.prepare_head(model)
        weights = StepWeights(model.embed.get_value(), layers, model.final_norm.get_value(), head,
                              build_rope_table(cfg, max_len, replicated))
        del model.embed, model.layers, model.final_norm
        return weights

    def prepare_head(self, model: Llama) -> Optional[jax.Array]:
        """The LM head as `logits` reads it: [D, V], or None with tied embeddings (read from `embed`)."""
        return None if self.cfg.tie_word_embeddings else model.lm_head.get_value()

    # --- the layer operations ------------------------------------------------------------------

    def self_attention(
        self,
        w: LayerWeights,
        h: jax.Array,  # [T, D]: the residual stream
        rope: tuple[jax.Array, jax.Array],  # (cos, sin) f32[T, K // 2]
        cache: KVCache,
        layer: jax.Array,  # i32[]
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # (attention output [T, Hq, K], the cache with this layer's new K/V)
        x = rms_norm(h, w.attn_norm, self.cfg.rms_norm_eps)
        q, k, v = (jnp.einsum("td,dhk->thk", x, p) for p in (w.q_proj, w.k_proj, w.v_proj))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return self.attention.write_and_attend(q, k, v, cache, layer, md, self.sm_scale)

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.cfg.head_dim)

    def add_attention_output(self, w: LayerWeights, h: jax.Array, attn: jax.Array) -> jax.Array:
        return h + jnp.einsum("thk,hkd->td", attn, w.o_proj)

    def add_mlp(self, w: LayerWeights, h: jax.Array) -> jax.Array:
        x = rms_norm(h, w.mlp_norm, self.cfg.rms_norm_eps)
        gate = jnp.einsum("td,df->tf", x, w.gate_proj)
        up = jnp.einsum("td,df->tf", x, w.up_proj)
        return h + jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, w.down_proj)

    def logits(self, w: StepWeights, hidden: jax.Array) -> jax.Array:  # [N, D] -> f32[N, V]
        if w.head is None:
            return jnp.einsum("td,vd->tv", hidden, w.embed).astype(jnp.float32)
        return jnp.einsum("td,dv->tv", hidden, w.head).astype(jnp.float32)

    def logits_and_argmax(self, w: StepWeights, hidden: jax.Array, want_logits: jax.Array
                          ) -> tuple[jax.Array, Optional[jax.Array]]:
        """(logits f32[N, V], their row argmax i32[N] or None where it is not computed on the way).
        Where `want_logits` (a traced bool) is false a backend may leave the logits undefined."""
        return self.logits(w, hidden), None
