"""A random-weight Hugging Face Llama checkpoint that jaxcb, vLLM and transformers all load, built offline.

    python benchmarks/compare/make_checkpoint.py --preset tiny --out ckpt/tiny-float32
    python benchmarks/compare/make_checkpoint.py --preset small --dtype bfloat16 --out ckpt/small-bfloat16

Writes config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and special_tokens_map.json. Needs only numpy, ml_dtypes and tokenizers
(jaxcb's own dependencies): no torch. Weights are normal(0, 0.02) like transformers' init,
norms 1, from a fixed seed, so the same command gives the same bytes.

Presets (the shapes the vLLM-CPU comparison uses):
  tiny   hidden 128, 4 layers, 4 heads of 32, 2 KV heads, MLP 1024, vocab 512, untied (1.9M)
  small  hidden 768, 12 layers, 12 heads of 64, 4 KV heads, MLP 2048, vocab 32000, tied (100M)

The tokenizer is byte-level (256 bytes after <unk>=0, <s>=1, </s>=2, <pad>=3), padded with
unreachable `<|extra_N|>` entries to the model's vocab so that every id decodes. The benchmark
workloads are token ids; the tokenizer is there so that every engine loads the directory as is.
"""

from __future__ import annotations

import argparse
import json
import os
import struct

import ml_dtypes
import numpy as np

PRESETS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=1024, vocab_size=512, tie_word_embeddings=False),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, tie_word_embeddings=True),
}
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3: unk, bos, eos, pad
FIRST_USABLE_TOKEN_ID = len(SPECIALS)
SAFETENSORS_DTYPES = {"float32": ("F32", np.float32), "bfloat16": ("BF16", ml_dtypes.bfloat16)}


def llama_config(preset: str, dtype: str, max_position_embeddings: int) -> dict:
    fields = PRESETS[preset]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **fields,
        "head_dim": fields["hidden_size"] // fields["num_attention_heads"],
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
        "torch_dtype": dtype, "use_cache": True,
    }


def random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """HF Llama parameter names, [out_features, in_features] for every projection, float32."""
    rng = np.random.default_rng(seed)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, nq, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * config["initializer_range"]).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(nq * d, h), p + "self_attn.k_proj.weight": normal(nkv * d, h),
            p + "self_attn.v_proj.weight": normal(nkv * d, h), p + "self_attn.o_proj.weight": normal(h, nq * d),
            p + "mlp.gate_proj.weight": normal(f, h), p + "mlp.up_proj.weight": normal(f, h),
            p + "mlp.down_proj.weight": normal(h, f),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        })
    weights["model.norm.weight"] = np.ones(h, np.float32)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(v, h)
    return weights


def write_safetensors(path: str, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """The safetensors layout: 8-byte little-endian header length, a JSON header, the raw bytes."""
    tag, np_dtype = SAFETENSORS_DTYPES[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        size = t.size * np.dtype(np_dtype).itemsize
        header[name] = {"dtype": tag, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t.astype(np_dtype)).tobytes())


def write_tokenizer(out_dir: str, vocab_size: int, max_length: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)  # 256 printable stand-ins for bytes
    if vocab_size < len(SPECIALS) + len(alphabet):
        raise SystemExit(f"vocab_size={vocab_size} must be >= {len(SPECIALS) + len(alphabet)} for a byte tokenizer")
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(alphabet)})
    vocab.update({f"<|extra_{i}|>": len(vocab) + i for i in range(vocab_size - len(vocab))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": False,
                   "add_eos_token": False, "model_max_length": max_length, "clean_up_tokenization_spaces": False,
                   "padding_side": "left"}, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(specials, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", required=True, help="the checkpoint directory to write")
    parser.add_argument("--dtype", choices=sorted(SAFETENSORS_DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    args = parser.parse_args()

    config = llama_config(args.preset, args.dtype, args.max_position_embeddings)
    os.makedirs(args.out, exist_ok=True)
    weights = random_weights(config, args.seed)
    write_safetensors(os.path.join(args.out, "model.safetensors"), weights, args.dtype)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, f, indent=2)
    write_tokenizer(args.out, config["vocab_size"], args.max_position_embeddings)
    num_params = sum(w.size for w in weights.values())
    print(json.dumps({"out": args.out, "preset": args.preset, "dtype": args.dtype, "params": num_params}))


if __name__ == "__main__":
    main()
