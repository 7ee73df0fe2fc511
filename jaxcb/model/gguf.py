"""GGUF files, llama.cpp's one-file checkpoints: the architecture, weights and tokenizer inside.

Owns turning a `.gguf` file into what the loader gets from a Hugging Face directory:
config.json's fields (`read_gguf_config`), the tensors under their HF names in HF layout
(`GGUFCheckpoint`: dequantized to float32 by llama.cpp's own `gguf` library, with the q/k row
permutation of llama.cpp's convert script undone where it made one, and Gemma's norms stored as
1 + w given back as w), and the metadata that jaxcb.tokenizer builds the tokenizer from
(`open_gguf`, `metadata`). Whatever it cannot honour (another architecture, a key or a tensor type
it does not read) is refused before any weight is read. It builds no model and places nothing on a
device: the loader does that, the same way for both formats.

llama.cpp's architectures and the families (`jaxcb.model.families`) they hold:

    general.architecture    family       q/k rows permuted  the family's own tensors and keys
    llama                   llama        yes                -
    llama, with a window    mistral      yes                -
    qwen2                   qwen2        no                 blk.{i}.attn_{q,k,v}.bias
    qwen3                   qwen3        no                 blk.{i}.attn_{q,k}_norm.weight
    gemma2                  gemma2       no                 blk.{i}.{post_attention,ffn,post_ffw}_norm.weight;
                                                            {arch}.{attn,final}_logit_softcapping
    gemma3                  gemma3_text  no                 gemma2's norms, blk.{i}.attn_{q,k}_norm.weight;
                                                            rope.freq_base_swa, rope.scaling.type=linear,
                                                            final_logit_softcapping

A llama/qwen window ({arch}.attention.sliding_window) is on every layer: a GGUF has no per-layer
types. Gemma's ffn_norm is the MLP's input norm (pre_feedforward_layernorm), post_attention_norm
the norm after attention. For what llama.cpp's converter leaves out of a Gemma file, jaxcb takes
what llama.cpp's own loader assumes (which is transformers' default wherever the two agree):

- the layer pattern: gemma2 windows every other layer from the first, gemma3 five layers of
  each six (the sixth full), as llama.cpp's set_swa_pattern(2) / (6) and transformers' configs;
  {arch}.attention.sliding_window_pattern, which llama.cpp does not read for them, is refused;
- query_pre_attn_scalar: the head size, save for the 27B models (gemma2's 46 layers, gemma3's
  62), where it is hidden_size / num_heads: llama.cpp's rule, which gives every released Gemma 2
  and 3 its config.json value (transformers' default of 256 would be wrong for the 27Bs);
- the windowed layers' RoPE base: gemma3.rope.freq_base_swa when written (llama.cpp's converter
  writes it from transformers 5's rope_parameters), else 10000; gemma3.rope.freq_base is the full
  layers' base, and a linear rope scaling applies to the full layers only;
- gemma2's caps and window: 50 and 30, 4096 (its converter always writes them); no
  gemma2.rope.freq_base: 10000. gemma3 must state its window (its converter writes it whenever
  the model has one).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from jaxcb.model.config import RopeScaling
from jaxcb.model.families import FAMILIES, FULL_ATTENTION, GEMMA_ACTIVATIONS, SLIDING_ATTENTION
from jaxcb.model.gguf_rope import ROPE_FREQS, llama3_scaling_from_divisors
from jaxcb.model.loader import CheckpointError

# Tensor types that `gguf.quants.dequantize` reads and that the tests check.
READABLE_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
# general.architecture -> the family its models are (a llama file with a sliding window is a Mistral:
# llama.cpp writes Mistral as llama).
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
# The architectures whose q/k rows llama.cpp's convert script permutes (its LlamaModel.permute).
PERMUTED_QK_ARCHITECTURES = ("llama",)
# {arch}.* metadata that jaxcb reads or checks (the same for each architecture); any other {arch}.* key
# is refused, not ignored.
KNOWN_ARCH_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window", "rope.freq_base",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.finetuned", "expert_count", "expert_used_count",
})
# The {arch}.* keys an architecture adds to those; refused in any other.
ARCH_KEYS = {
    "gemma2": frozenset({"attn_logit_softcapping", "final_logit_softcapping"}),
    "gemma3": frozenset({"final_logit_softcapping", "rope.freq_base_swa"}),
}
# {arch}.rope.scaling.type values an architecture may carry, besides none (Llama 3's comes as rope_freqs.weight).
ROPE_SCALING_TYPES = {"gemma3": ("linear",)}
# Gemma: its converter stores every norm as 1 + w (jaxcb's parameter is w); its layer pattern as llama.cpp
# fixes it (of each n layers, the last sees the whole context); the layer count of its 27B model, whose
# queries llama.cpp scales by hidden_size / num_heads instead of the head size.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# {arch}.attention.sliding_window when the file leaves it out (None: it must say); 0: no window.
DEFAULT_WINDOWS = {"gemma2": 4096, "gemma3": None}
# GGUF tensor name -> HF name ({i}: the layer).
GGUF_TO_HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",  # qwen2
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # qwen3
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
# Gemma's four norms a layer (gguf.constants' MODEL_TENSORS for GEMMA2 / GEMMA3): ffn_norm is the MLP's input
# norm there, not the one after attention; no biases.
GEMMA_TO_HF_NAMES = {
    **{k: v for k, v in GGUF_TO_HF_NAMES.items() if not k.endswith(".bias")},
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


def _name_table(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)")), dst) for src, dst in table.items()]


def _name_tables(arch: str) -> tuple[list[tuple[re.Pattern, str]], list[tuple[re.Pattern, str]]]:
    table = GEMMA_TO_HF_NAMES if arch in GEMMA_ARCHITECTURES else GGUF_TO_HF_NAMES
    return _name_table(table), _name_table({hf: gg for gg, hf in table.items()})


_NAME_TABLES = {arch: _name_tables(arch) for arch in GGUF_FAMILIES}


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str:
    for pattern, target in table:
        match = pattern.fullmatch(name)
        if match:
            return target.format(i=match.groupdict().get("i"))
    return name  # not ours: kept, so that a check reports it by the name the file uses


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF name of the tensor `gguf_name` of a general.architecture=arch file."""
    return _rename(gguf_name, _NAME_TABLES.get(arch, _NAME_TABLES["llama"])[0])


def gguf_name(hf_tensor_name: str, arch: str = "llama") -> str:
    """The name a general.architecture=arch file gives the HF tensor `hf_tensor_name`."""
    return _rename(hf_tensor_name, _NAME_TABLES.get(arch, _NAME_TABLES["llama"])[1])


@functools.lru_cache(maxsize=1)
def _reader_class():
    """gguf.GGUFReader, its metadata arrays read in one pass each. The library makes two numpy views
    of every element of an array (each string's length and its bytes): 2 s of start-up for SmolLM2's
    49,152 tokens and 48,900 merges, before anything else can start. Here a string array's elements
    are memoryview slices of the file (what `ReaderField.contents` reads: `.tobytes()`), and a
    number array is one view, its field's one data part (`contents()` gives the same list). Anything
    else (another byte order, nested or empty arrays, scalars) goes to the library's own code."""
    import gguf
    from gguf.constants import GGUFValueType

    class ArrayReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            values = self.gguf_scalar_to_np.get(GGUFValueType(int(item_type[0])))
            if int(count[0]) == 0 or (values is None and item_type[0] != GGUFValueType.STRING):
                return super()._get_field_parts(orig_offs, raw_type)
            offs, parts = orig_offs + 12, [item_type, count]
            types = [GGUFValueType.ARRAY, GGUFValueType(int(item_type[0]))]
            if values is not None:
                parts.append(self._get(offs, values, int(count[0])))
                return 12 + int(parts[-1].nbytes), parts, [2], types
            buf = memoryview(self.data)
            for _ in range(int(count[0])):
                size = int.from_bytes(buf[offs : offs + 8], "little")
                parts += (buf[offs : offs + 8], buf[offs + 8 : offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), types

    return ArrayReader


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, stamp: tuple[int, int]):
    try:
        return _reader_class()(path)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(
            f"{path} cannot be read by the gguf library {_gguf_version()} ({e}); check that it is a complete "
            f"GGUF file, or upgrade the gguf package if the file is newer than it"
        ) from e


def open_gguf(path: str):
    """The file's `gguf.GGUFReader`, parsed once per path and modification (parsing takes seconds)."""
    st = os.stat(path)
    return _cached_reader(os.path.abspath(path), (st.st_mtime_ns, st.st_size))


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def metadata(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    return float(str(np.float32(value)))  # GGUF stores f32: 1e-5 comes back as 1e-5, not 9.99999974e-06


def read_gguf_config(path: str) -> dict[str, Any]:
    """The GGUF's architecture under ModelConfig's field names, as `read_hf_config` gives config.json's.

    Raises CheckpointError listing every problem: another architecture, an {arch}.* key jaxcb does
    not know, a mixture of experts, rope scaling it cannot reproduce, a file split in parts."""
    reader = open_gguf(path)
    arch = metadata(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise CheckpointError(
            f"{path} holds a {arch!r} model (general.architecture); jaxcb serves GGUF files of "
            f"{', '.join(GGUF_FAMILIES)} (llama.cpp writes Mistral as llama)"
        )
    problems = _metadata_problems(reader, arch)

    def need(key: str, default: Any = None):
        value = metadata(reader, f"{arch}.{key}", default)
        if value is None:
            problems.append(f"metadata {arch}.{key} is missing")
        elif isinstance(value, list):
            problems.append(f"metadata {arch}.{key} differs between layers ({value[:4]}...); jaxcb needs one value")
            return None
        return value

    hidden, num_heads = need("embedding_length"), need("attention.head_count")
    num_layers, intermediate = need("block_count"), need("feed_forward_length")
    num_kv_heads = need("attention.head_count_kv", num_heads)
    window = need("attention.sliding_window", DEFAULT_WINDOWS.get(arch, 0))
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else metadata(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        problems.append(f"neither tokenizer.ggml.tokens nor {arch}.vocab_size gives the vocabulary size")
    elif metadata(reader, f"{arch}.vocab_size", vocab_size) != vocab_size:
        problems.append(f"{arch}.vocab_size={metadata(reader, f'{arch}.vocab_size')} but tokenizer.ggml.tokens has "
                        f"{vocab_size}")
    head_dim = metadata(reader, f"{arch}.attention.key_length") or (hidden // num_heads if hidden and num_heads else None)
    for key in ("attention.value_length", "rope.dimension_count"):
        if metadata(reader, f"{arch}.{key}", head_dim) != head_dim:
            problems.append(f"{arch}.{key}={metadata(reader, f'{arch}.{key}')} differs from the head size {head_dim}")
    if problems:
        raise CheckpointError(f"{path} cannot be served by jaxcb ({len(problems)} problems): " + "; ".join(problems))
    family = FAMILIES["mistral" if arch == "llama" and window else GGUF_FAMILIES[arch]]
    theta = _f32(metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    tensor_names = {t.name for t in reader.tensors}
    eos_ids = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    config = dict(
        architecture=family.name,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        sliding_window=int(window),  # every layer's: a GGUF has no per-layer types
        layer_types=None,
        vocab_size=int(vocab_size),
        hidden_size=int(hidden),
        intermediate_size=int(intermediate),
        num_layers=int(num_layers),
        num_heads=int(num_heads),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=_f32(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=int(metadata(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_rope_scaling(reader, path, int(head_dim), theta),
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted({int(i) for i in eos_ids if i is not None}) or None,
    )
    if arch in GEMMA_ARCHITECTURES:
        config.update(_gemma_config(reader, arch, config))
    return config


def _gemma_config(reader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma's fields (`jaxcb.model.families`), with what llama.cpp assumes for the keys its converter
    leaves out (the module docstring lists them)."""
    num_layers, window = config["num_layers"], config["sliding_window"]
    pattern = GEMMA_WINDOW_PATTERN[arch]
    layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
    if not window or FULL_ATTENTION not in layer_types:  # as read_hf_config: None when every layer is alike
        layer_types = None
    if num_layers == GEMMA_27B_LAYERS[arch]:
        query_pre_attn_scalar = config["hidden_size"] // config["num_heads"]
    else:
        query_pre_attn_scalar = config["head_dim"]
    attn_cap, final_cap = (50.0, 30.0) if arch == "gemma2" else (0.0, 0.0)
    return dict(
        sliding_window=int(window),
        layer_types=layer_types,
        embed_scale=True,
        norm_offset=True,
        hidden_act=GEMMA_ACTIVATIONS["gelu_pytorch_tanh"],
        sandwich_norms=True,
        attn_logit_softcap=_f32(metadata(reader, f"{arch}.attn_logit_softcapping", attn_cap)),
        final_logit_softcap=_f32(metadata(reader, f"{arch}.final_logit_softcapping", final_cap)),
        query_pre_attn_scalar=float(query_pre_attn_scalar),
        rope_local_theta=_f32(metadata(reader, f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else 0.0,
    )


def _metadata_problems(reader, arch: str) -> list[str]:
    """What the file's metadata says that jaxcb does not honour: unknown {arch}.* keys, experts, rope
    scaling it does not compute, a split file."""
    prefix, known = f"{arch}.", KNOWN_ARCH_KEYS | ARCH_KEYS.get(arch, frozenset())
    unknown = sorted(k for k in reader.fields if k.startswith(prefix) and k[len(prefix):] not in known)
    problems = [f"metadata {k}={metadata(reader, k)!r} is not understood by jaxcb" for k in unknown]
    if (metadata(reader, "split.count", 1) or 1) > 1:
        problems.append(
            f"the model is split over {metadata(reader, 'split.count')} files; merge them into one with "
            f"llama.cpp's `llama-gguf-split --merge`"
        )
    if (metadata(reader, f"{arch}.expert_count", 0) or 0) > 0:
        problems.append(f"{arch}.expert_count={metadata(reader, f'{arch}.expert_count')}: mixtures of experts are not "
                        f"supported")
    scaling_type, allowed = metadata(reader, f"{arch}.rope.scaling.type", "none"), ROPE_SCALING_TYPES.get(arch, ())
    if scaling_type != "none" and scaling_type not in allowed:
        reads = f"{', '.join(allowed)} from a {arch} GGUF" if allowed else "Llama 3's rope scaling only from a GGUF"
        problems.append(f"{arch}.rope.scaling.type={scaling_type!r} is not supported (jaxcb reads {reads})")
    elif scaling_type != "none" and not metadata(reader, f"{arch}.rope.scaling.factor"):
        problems.append(f"{arch}.rope.scaling.type={scaling_type!r} without {arch}.rope.scaling.factor")
    return problems


def _rope_scaling(reader, path: str, head_dim: int, theta: float) -> Optional[RopeScaling]:
    arch = metadata(reader, "general.architecture")
    if metadata(reader, f"{arch}.rope.scaling.type", "none") == "linear":  # positions / factor (Gemma 3's full layers)
        from jaxcb.config_validation import validate_rope_scaling

        scaling = RopeScaling(_f32(metadata(reader, f"{arch}.rope.scaling.factor")), 1.0, 4.0, 0, rope_type="linear")
        validate_rope_scaling(scaling, f"{path}: {arch}.rope.scaling")
        return scaling
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    if tensor.tensor_type.name != "F32" or tuple(tensor.shape) != (head_dim // 2,):
        raise CheckpointError(f"{path}: {ROPE_FREQS} should be F32 of shape ({head_dim // 2},), "
                              f"not {tensor.tensor_type.name} {tuple(tensor.shape)}")
    return llama3_scaling_from_divisors(np.asarray(tensor.data, np.float64), head_dim, theta, path)


@dataclass(frozen=True)
class GGUFTensorInfo:
    gguf_name: str
    type_name: str  # ggml type: F32, Q4_K, ...
    shape: tuple[int, ...]  # numpy (HF) order: [out, in] for a matrix; GGUF lists it reversed


class GGUFCheckpoint:
    """A GGUF's tensors by HF name, read one at a time as float32 in HF layout: the q/k rows (and
    biases) of an architecture that llama.cpp permutes put back in HF order, Gemma's norms (stored as
    1 + w) given back as w, the others as written."""

    def __init__(self, path: str, num_heads: int, num_kv_heads: int):
        self.path = path
        self._reader = open_gguf(path)
        self.arch = metadata(self._reader, "general.architecture")
        permuted = self.arch in PERMUTED_QK_ARCHITECTURES
        self._num_heads = {"q_proj": num_heads, "k_proj": num_kv_heads} if permuted else {}
        self._norm_offset = self.arch in GEMMA_ARCHITECTURES
        self._by_name = {hf_name(t.name, self.arch): t for t in self._reader.tensors if t.name != ROPE_FREQS}
        self.tensors = {
            name: GGUFTensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))
            for name, t in self._by_name.items()
        }

    def gguf_name(self, hf_tensor_name: str) -> str:
        """The name this file gives (or would give) an HF tensor."""
        return gguf_name(hf_tensor_name, self.arch)

    def type_problems(self) -> list[str]:
        return [
            f"tensor {info.gguf_name} has type {info.type_name}, which jaxcb does not dequantize "
            f"(it reads {', '.join(READABLE_TYPES)}); use a GGUF quantized to one of those"
            for info in self.tensors.values()
            if info.type_name not in READABLE_TYPES
        ]

    def read(self, name: str) -> np.ndarray:
        """f32[shape] of the HF tensor `name`: dequantized, q/k rows back in HF order, a Gemma norm less 1."""
        from gguf.quants import dequantize

        tensor, info = self._by_name[name], self.tensors[name]
        value = dequantize(tensor.data, tensor.tensor_type).reshape(info.shape)
        projection = name.rsplit(".", 2)[-2]  # model.layers.3.self_attn.q_proj.weight -> q_proj
        if projection in self._num_heads:
            value = unpermute_rope_rows(value, self._num_heads[projection])
        if self._norm_offset and name.endswith("norm.weight"):
            value = value - np.float32(1.0)
        return value


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of q/k rows: per head, GGUF interleaves the two rotary halves
    (rows 0, d/2, 1, d/2+1, ...); HF keeps them as two halves. weight: [num_heads * head_dim, in]."""
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)
