"""Factories for tiny Hugging Face Llama checkpoints, built offline with transformers."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Odd sizes so that a transposed axis cannot pass by accident; GQA with 3 query heads per KV head.
TINY_HF = dict(
    vocab_size=131,
    hidden_size=48,
    intermediate_size=97,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_ROPE_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)


def make_hf_llama(out_dir: str, seed: int = 0, shards: int = 1, rope_scaling: dict | None = None, **overrides):
    """Save a random LlamaForCausalLM (fp32, safetensors) to out_dir; return the torch model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(TINY_HF, **overrides)
    if rope_scaling is not None:
        fields["rope_scaling"] = dict(rope_scaling, rope_theta=fields["rope_theta"])
    config = LlamaConfig(**fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # HF init leaves norms at 1; perturb them so a norm mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    max_shard = None
    if shards > 1:
        total = sum(p.numel() * 4 for p in model.parameters())
        max_shard = f"{total // shards // 1000 + 1}KB"
    model.save_pretrained(out_dir, safe_serialization=True, **({"max_shard_size": max_shard} if max_shard else {}))
    return model


def write_word_tokenizer(out_dir: str, vocab_size: int, chat_template: str | None = None) -> None:
    """A whitespace word-level tokenizer.json with <unk>=0, <s>=1 (added as BOS), </s>=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def write_byte_tokenizer(out_dir: str, added: tuple[str, ...] = (), chat_template: str | None = None) -> int:
    """A byte-level BPE tokenizer.json without merges: the 256 bytes, <s>=256 (BOS), </s>=257, then `added`
    as ordinary (not special) added tokens -- as Qwen3 adds <think> and </think>. Returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return 258 + len(added)


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet writes as `char`."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


# Each family's random-init checkpoint: TINY_HF's odd sizes, and the window shorter than the test
# prompts (PROMPTS in test_model_families.py reach 37 tokens), not a multiple of the block size.
FAMILY_HF = {
    "qwen2": dict(use_sliding_window=True, sliding_window=7, max_window_layers=1),  # layer 0 full, 1-2 windowed
    "qwen3": dict(use_sliding_window=True, sliding_window=11, max_window_layers=2),  # layers 0-1 full, 2 windowed
    "mistral": dict(sliding_window=7),  # every layer windowed
    # Caps small enough to bite on a random model's scores and logits; a query scale that is not head_dim's.
    "gemma2": dict(sliding_window=7, query_pre_attn_scalar=13, attn_logit_softcapping=0.02,
                   final_logit_softcapping=1.5, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
    # Layers 0 and 2 windowed with the local base, layer 1 full with the global base, linearly scaled.
    "gemma3": dict(sliding_window=7, sliding_window_pattern=2, query_pre_attn_scalar=13, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
}


def make_hf_family(out_dir: str, family: str, seed: int = 0, **overrides):
    """Save a random model of `family` (qwen2, qwen3, mistral; fp32, safetensors) to out_dir; return the
    torch model. Norms are perturbed and biases drawn, so that a weight read in the wrong place shows."""
    import torch
    import transformers

    classes = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, name) for name in classes[family])
    fields = dict(TINY_HF, **FAMILY_HF[family])
    fields.update(overrides)
    if "rope_parameters" in fields:
        fields.pop("rope_theta", None)
    config = config_cls(**fields)
    config._attn_implementation = "eager"  # the sliding window as a mask, exactly
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
