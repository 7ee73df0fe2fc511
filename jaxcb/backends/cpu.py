"""The `cpu` backend: the linear layers and the LM head through the packed C++ matmul.

At load it packs each layer's projections into the 16-column panels of `packed_matmul`, with
q/k/v fused into one matrix and gate/up into another, and the LM head the same way; the
layers run unrolled, one packed weight set per layer. XLA:CPU's dot re-packs its weight
operand on every call and streams it at a few GB/s for a decode step's few rows, where the
packed kernel runs near the machine's matmul peak. The arithmetic is the XLA backend's; only
who multiplies changes. One device.

Float32 or bfloat16 weights. bf16 weights stay bf16 in memory and each product accumulates in
float32, on the fastest path this CPU runs (`jaxcb.kernels.cpu.bf16_matmul_path`: AMX tiles,
AVX512-BF16 dot products, or widening to float32). Whatever the weights, the residual stream,
norms, rotary embedding, attention's softmax and the logits are float32: a bf16 model here is
bf16 weights (and x rounded to bf16 at each product), not bf16 arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxcb.backends.base import Backend
from jaxcb.kernels.attention import AttentionMetadata, KVCache
from jaxcb.kernels.cpu import ATTENTION_DTYPES
from jaxcb.kernels.packed_matmul import (
    MlpLora, gate_up_pair_count, pack_columns, pack_gate_up, packed_matmul, packed_matmul_argmax, packed_mlp,
    packed_qkv,
)
from jaxcb.model.llama import LayerWeights, Llama
from jaxcb.backends.cpu_lora import PackedLoraLayer, pack_lora_layers
from jaxcb.kernels.batched_lora import batched_lora, lora_expand, lora_shrink
from jaxcb.model.lora import LoraLayerWeights, LoraRows


class PackedLayerWeights(NamedTuple):
    """One layer's weights packed for `packed_matmul` (`pack_columns` panels [P, in, 16])."""

    attn_norm: jax.Array  # [D]
    qkv_proj: jax.Array  # panels of [D, (Hq + 2 Hkv) K]: q, k and v side by side
    o_proj: jax.Array  # panels of [Hq K, D]
    mlp_norm: jax.Array  # [D]
    gate_up_proj: jax.Array  # panels of [D, F] each for gate and up, in pairs (`pack_gate_up`)
    down_proj: jax.Array  # panels of [F, D]
    qkv_bias: Optional[jax.Array] = None  # [(Hq + 2 Hkv) K]: q's, k's, v's (cfg.qkv_bias)
    q_norm: Optional[jax.Array] = None  # [K] (cfg.qk_norm)
    k_norm: Optional[jax.Array] = None  # [K]

    @staticmethod
    def pack(w: LayerWeights) -> "PackedLayerWeights":
        d = w.q_proj.shape[0]
        qkv = jnp.concatenate([p.reshape(d, -1) for p in (w.q_proj, w.k_proj, w.v_proj)], axis=1)
        bias = None if w.q_bias is None else jnp.concatenate([b.reshape(-1) for b in (w.q_bias, w.k_bias, w.v_bias)])
        f32 = lambda v: None if v is None else v.astype(jnp.float32)  # noqa: E731 (the float32 stream's vectors)
        return PackedLayerWeights(
            f32(w.attn_norm),
            pack_columns(qkv),
            pack_columns(w.o_proj.reshape(-1, w.o_proj.shape[-1])),
            f32(w.mlp_norm),
            pack_gate_up(w.gate_proj, w.up_proj),
            pack_columns(w.down_proj),
            f32(bias), f32(w.q_norm), f32(w.k_norm),
        )


@dataclasses.dataclass(frozen=True)
class CpuBackend(Backend):
    unroll_layers: bool = True
    name = "cpu"

    def describe(self) -> str:
        if self.cfg.dtype == "bfloat16":
            from jaxcb.kernels.cpu import BF16_MATMUL_DESCRIPTIONS, bf16_matmul_path

            return f"backend cpu (the packed C++ matmul, bf16 weights on {BF16_MATMUL_DESCRIPTIONS[bf16_matmul_path()]}; " \
                   "layers unrolled)"
        return "backend cpu (the packed C++ matmul; layers unrolled)"

    def prepare_layers(self, layers: list[LayerWeights]) -> list[PackedLayerWeights]:
        """Layer by layer (unrolled: one LayerWeights per layer), so that at most one layer's weights
        exist twice at a time."""
        pack = jax.jit(PackedLayerWeights.pack)
        for i in range(len(layers)):
            layers[i] = pack(layers[i])
        return layers

    def prepare_head(self, model: Llama) -> jax.Array:
        # The tied embedding stays as it is for the token lookup; its packed transpose is a copy.
        if self.cfg.tie_word_embeddings:
            return jax.jit(lambda e: pack_columns(e.T))(model.embed.get_value())
        head = jax.jit(pack_columns)(model.lm_head.get_value())
        del model.lm_head
        return head

    def self_attention(self, w: PackedLayerWeights, h, rope, cache: KVCache, layer, md: AttentionMetadata,
                       window=None, lora: Optional[LoraRows] = None):
        cfg = self.cfg
        h = h.astype(jnp.float32)  # a bf16 model's embeddings: the stream is float32 from here
        # Soft-capped scores (Gemma 2's attn_logit_softcap) take the path below, whose attend applies the cap.
        llama_attention = w.qkv_bias is None and w.q_norm is None and not cfg.attn_logit_softcap
        fused = self.attention.mesh is None and cache.k.dtype.name in ATTENTION_DTYPES and llama_attention
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        real_rows = md.query_start_loc[-1]  # the step's real tokens: the projection skips the padding after them
        if fused:
            # q/k/v, rope and the cache write in one kernel call, then attention over the cache. (A
            # family with q/k/v biases or q/k norms takes the path below: its projections, then XLA.)
            # LoRA: the rows' updates of q, k and v (one call, from the same normed input) go in
            # before rope, on the rows with an adapter.
            addend = None if lora is None else batched_lora(h, lora.weights.qkv, lora.slots, None, width=q + 2 * kv,
                                                            norm=w.attn_norm, eps=cfg.rms_norm_eps)
            q, k_cache, v_cache = packed_qkv(h, w.qkv_proj, w.attn_norm, cfg.rms_norm_eps, *rope, cache.k, cache.v,
                                             layer, md.slot_mapping, cfg.num_heads, addend,
                                             None if lora is None else lora.slots, real_rows=real_rows)
            cache = KVCache(k_cache, v_cache)
            return self.attention.attend(q, cache, layer, md, self.sm_scale, window), cache
        qkv = packed_matmul(h, w.qkv_proj, q + 2 * kv, norm=w.attn_norm, eps=cfg.rms_norm_eps, real_rows=real_rows)
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        if lora is not None:  # each row's updates of q, k and v in one call, from the same normed input
            qkv = batched_lora(h, lora.weights.qkv, lora.slots, qkv, norm=w.attn_norm, eps=cfg.rms_norm_eps)
        q_, k_, v_ = qkv[:, :q], qkv[:, q : q + kv], qkv[:, q + kv :]
        q_, k_, v_ = (q_.reshape(-1, cfg.num_heads, cfg.head_dim), k_.reshape(-1, cfg.num_kv_heads, cfg.head_dim),
                      v_.reshape(-1, cfg.num_kv_heads, cfg.head_dim))
        return self.rope_write_and_attend(w, q_, k_, v_, rope, cache, layer, md, window)

    # Given `num_tokens`, the matmuls skip the step's padding rows after them: their results are zeros,
    # which only the padding's own later rows read.
    def add_attention_output(self, w: PackedLayerWeights, h, attn, lora: Optional[LoraRows] = None,
                             num_tokens: Optional[jax.Array] = None):
        attn = attn.reshape(attn.shape[0], -1).astype(jnp.float32)
        residual = h.astype(jnp.float32)
        if lora is not None:  # folded into the residual the kernel adds (a base row's is left as it is)
            residual = batched_lora(attn, lora.weights.o, lora.slots, residual)
        return packed_matmul(attn, w.o_proj, self.cfg.hidden_size, residual=residual, real_rows=num_tokens)

    def add_mlp(self, w: PackedLayerWeights, h, lora: Optional[LoraRows] = None,
                num_tokens: Optional[jax.Array] = None):
        h = h.astype(jnp.float32)
        cfg = self.cfg
        if lora is None:
            return packed_mlp(h, w.gate_up_proj, w.down_proj, cfg.hidden_size, norm=w.mlp_norm, eps=cfg.rms_norm_eps,
                              residual=h, real_rows=num_tokens)
        # LoRA: each row's gate/up shrink in one call (from the same normed input); the fused kernel then
        # adds its B side inside its tiles before the activation and takes down's shrink from the
        # activation as it goes (no [T, 2F] update or [T, F] activation written out); down's B side
        # last, into the residual. A row without an adapter costs nothing; a step without one, the
        # two empty calls and the kernel's check of the slots.
        num_pairs, f, eps = w.gate_up_proj.shape[0] // 2, cfg.intermediate_size, cfg.rms_norm_eps
        assert lora.weights.gate_up.b.shape[1] == 2 * num_pairs == 2 * gate_up_pair_count(f, self.lora_dtype), (
            lora.weights.gate_up.b.shape, num_pairs, f, self.lora_dtype)
        u = lora_shrink(h, lora.weights.gate_up, lora.slots, norm=w.mlp_norm, eps=eps)
        y, down_u = packed_mlp(h, w.gate_up_proj, w.down_proj, cfg.hidden_size, norm=w.mlp_norm, eps=eps, residual=h,
                               lora=MlpLora(lora.slots, u, lora.weights.gate_up.b, lora.weights.down.a),
                               real_rows=num_tokens)
        return lora_expand(down_u, lora.weights.down, lora.slots, y)

    def prepare_lora(self, buffers: list[LoraLayerWeights]) -> list[PackedLoraLayer]:
        """The slot buffers packed for the batched LoRA kernel, one group per shared input
        (`cpu_lora.pack_lora_layers`): a layer's updates are 4 kernel calls beside its own, each row
        multiplying its own slot's A and B alone. In the model's dtype (`lora_dtype`)."""
        return pack_lora_layers(buffers)

    def logits(self, w, hidden):
        return packed_matmul(hidden, w.head, self.cfg.vocab_size)

    def logits_and_argmax(self, w, hidden, want_logits, num_rows=None) -> tuple[jax.Array, Optional[jax.Array]]:
        # The argmax comes out of the matmul; where no row reads the logits they are never written, and
        # the sequence bucket's padding rows are not multiplied.
        return packed_matmul_argmax(hidden, w.head, self.cfg.vocab_size, want_logits, real_rows=num_rows)
