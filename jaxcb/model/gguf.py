"""GGUF files, llama.cpp's one-file checkpoints: the architecture, weights and tokenizer inside.

Owns turning a `.gguf` file into what the loader gets from a Hugging Face directory:
config.json's fields (`read_gguf_config`), the tensors under their HF names in HF layout
(`GGUFCheckpoint`: dequantized to float32 by llama.cpp's own `gguf` library, with the q/k row
permutation of llama.cpp's convert script undone where it made one), and the metadata that
jaxcb.tokenizer builds the tokenizer from (`open_gguf`, `metadata`). Whatever it cannot honour
(another architecture, a tensor type it does not dequantize) is refused before any weight is read.
It builds no model and places nothing on a device: the loader does that, the same way for both formats.

llama.cpp's architectures and the families (`jaxcb.model.families`) they hold:

    general.architecture    family    q/k rows permuted  the family's own tensors
    llama                   llama     yes                -
    llama, with a window    mistral   yes                -
    qwen2                   qwen2     no                 blk.{i}.attn_{q,k,v}.bias
    qwen3                   qwen3     no                 blk.{i}.attn_{q,k}_norm.weight

A window ({arch}.attention.sliding_window) is on every layer: a GGUF has no per-layer types.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from jaxcb.model.config import RopeScaling
from jaxcb.model.families import FAMILIES
from jaxcb.model.loader import CheckpointError

# Tensor types that `gguf.quants.dequantize` reads and that the tests check.
READABLE_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
# general.architecture -> the family its models are (a llama file with a sliding window is a Mistral:
# llama.cpp writes Mistral as llama).
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
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
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's form of Llama 3's rope scaling: a divisor per frequency


def _name_table(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)")), dst) for src, dst in table.items()]


_TO_HF = _name_table(GGUF_TO_HF_NAMES)
_TO_GGUF = _name_table({hf: gg for gg, hf in GGUF_TO_HF_NAMES.items()})


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str:
    for pattern, target in table:
        match = pattern.fullmatch(name)
        if match:
            return target.format(i=match.groupdict().get("i"))
    return name  # not ours: kept, so that a check reports it by the name the file uses


def hf_name(gguf_name: str) -> str:
    return _rename(gguf_name, _TO_HF)


def gguf_name(hf_tensor_name: str) -> str:
    return _rename(hf_tensor_name, _TO_GGUF)


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, stamp: tuple[int, int]):
    import gguf

    try:
        return gguf.GGUFReader(path)
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
    window = need("attention.sliding_window", 0)
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
    return dict(
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


def _metadata_problems(reader, arch: str) -> list[str]:
    """What the file's metadata says that jaxcb does not honour: unknown {arch}.* keys, experts, rope
    scaling other than Llama 3's, a split file."""
    prefix = f"{arch}."
    unknown = sorted(k for k in reader.fields if k.startswith(prefix) and k[len(prefix):] not in KNOWN_ARCH_KEYS)
    problems = [f"metadata {k}={metadata(reader, k)!r} is not understood by jaxcb" for k in unknown]
    if (metadata(reader, "split.count", 1) or 1) > 1:
        problems.append(
            f"the model is split over {metadata(reader, 'split.count')} files; merge them into one with "
            f"llama.cpp's `llama-gguf-split --merge`"
        )
    if (metadata(reader, f"{arch}.expert_count", 0) or 0) > 0:
        problems.append(f"{arch}.expert_count={metadata(reader, f'{arch}.expert_count')}: mixtures of experts are not "
                        f"supported")
    scaling_type = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        problems.append(f"{arch}.rope.scaling.type={scaling_type!r} is not supported (jaxcb reads Llama 3's rope "
                        f"scaling only from a GGUF)")
    return problems


def _rope_scaling(reader, path: str, head_dim: int, theta: float) -> Optional[RopeScaling]:
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    if tensor.tensor_type.name != "F32" or tuple(tensor.shape) != (head_dim // 2,):
        raise CheckpointError(f"{path}: {ROPE_FREQS} should be F32 of shape ({head_dim // 2},), "
                              f"not {tensor.tensor_type.name} {tuple(tensor.shape)}")
    return llama3_scaling_from_divisors(np.asarray(tensor.data, np.float64), head_dim, theta, path)


def llama3_scaling_from_divisors(divisors: np.ndarray, head_dim: int, theta: float, path: str) -> Optional[RopeScaling]:
    """The Llama 3 rope scaling whose frequencies are `inv_freq / divisors`, or CheckpointError.

    Llama 3 divides the frequency of a long wavelength by `factor`, keeps a short one, and
    between `high` and `low` wavelengths interpolates with s = (L / w - lf) / (hf - lf), which
    rises linearly in 1 / w from 0 at w = low = L / lf to 1 at w = high = L / hf. The divisors
    give back `factor` and that line; L, lf, hf are chosen to draw it, then checked."""
    if np.allclose(divisors, 1.0, rtol=1e-6):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    refusal = CheckpointError(
        f"{path}: {ROPE_FREQS} holds rope frequency divisors {np.round(divisors, 4).tolist()} that no Llama 3 "
        f"rope scaling reproduces; jaxcb cannot serve this model's rope"
    )
    try:
        with np.errstate(divide="raise", over="raise", invalid="raise"):
            scaling = _fit_llama3_scaling(divisors, inv_freq)
    except (ArithmeticError, FloatingPointError, ValueError):
        raise refusal from None
    expected = (inv_freq / divisors).astype(np.float32)
    if not np.allclose(llama3_inv_freq(inv_freq, scaling), expected, rtol=1e-4, atol=0):
        raise refusal
    return scaling


def _fit_llama3_scaling(divisors: np.ndarray, inv_freq: np.ndarray) -> RopeScaling:
    wavelen = 2 * math.pi / inv_freq
    factor = float(divisors.max())
    if factor <= 1.0:
        raise ValueError("Llama 3 only slows frequencies down")
    kept, slowed = np.isclose(divisors, 1.0, rtol=1e-5), np.isclose(divisors, factor, rtol=1e-5)
    between = ~(kept | slowed)
    s = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    below = wavelen[kept].max() if kept.any() else wavelen.min() / 2
    above = wavelen[slowed].min() if slowed.any() else wavelen.max() * 2
    if between.sum() >= 2:
        slope, offset = np.polyfit(1 / wavelen[between], s[between], 1)  # s = slope / w + offset
        low, high = -slope / offset, slope / (1 - offset)
    else:  # no band to fit: put its ends in the gaps between the wavelengths the model has
        low = math.sqrt((wavelen[between].max() if between.any() else below) * above)
        if between.any():
            w, si = wavelen[between][0], s[between][0]
            high = 1 / (1 / low + (1 / w - 1 / low) / si)
        else:
            high = math.sqrt(below * low)
    if not 0 < high < low:
        raise ValueError("the band's ends are out of order")
    length = max(1, round(low))
    return RopeScaling(
        factor=float(f"{factor:.6g}"),
        low_freq_factor=float(f"{length / low:.6g}"),
        high_freq_factor=float(f"{length / high:.6g}"),
        original_max_position_embeddings=length,
    )


def llama3_inv_freq(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """f64[head_dim // 2]: Llama 3's scaled rotary frequencies, as transformers computes them."""
    wavelen = 2 * math.pi / inv_freq
    length = scaling.original_max_position_embeddings
    low, high = length / scaling.low_freq_factor, length / scaling.high_freq_factor
    smooth = (length / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    banded = inv_freq * ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < high, inv_freq, np.where(wavelen > low, inv_freq / scaling.factor, banded))


@dataclass(frozen=True)
class GGUFTensorInfo:
    gguf_name: str
    type_name: str  # ggml type: F32, Q4_K, ...
    shape: tuple[int, ...]  # numpy (HF) order: [out, in] for a matrix; GGUF lists it reversed


class GGUFCheckpoint:
    """A GGUF's tensors by HF name, read one at a time as float32 in HF layout: the q/k rows (and
    biases) of an architecture that llama.cpp permutes put back in HF order, the others as written."""

    def __init__(self, path: str, num_heads: int, num_kv_heads: int):
        self.path = path
        self._reader = open_gguf(path)
        permuted = metadata(self._reader, "general.architecture") in PERMUTED_QK_ARCHITECTURES
        self._num_heads = {"q_proj": num_heads, "k_proj": num_kv_heads} if permuted else {}
        self._by_name = {hf_name(t.name): t for t in self._reader.tensors if t.name != ROPE_FREQS}
        self.tensors = {
            name: GGUFTensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))
            for name, t in self._by_name.items()
        }

    def type_problems(self) -> list[str]:
        return [
            f"tensor {info.gguf_name} has type {info.type_name}, which jaxcb does not dequantize "
            f"(it reads {', '.join(READABLE_TYPES)}); use a GGUF quantized to one of those"
            for info in self.tensors.values()
            if info.type_name not in READABLE_TYPES
        ]

    def read(self, name: str) -> np.ndarray:
        """f32[shape] of the HF tensor `name`: dequantized, and q/k rows back in HF order."""
        from gguf.quants import dequantize

        tensor, info = self._by_name[name], self.tensors[name]
        value = dequantize(tensor.data, tensor.tensor_type).reshape(info.shape)
        projection = name.rsplit(".", 2)[-2]  # model.layers.3.self_attn.q_proj.weight -> q_proj
        if projection in self._num_heads:
            value = unpermute_rope_rows(value, self._num_heads[projection])
        return value


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of q/k rows: per head, GGUF interleaves the two rotary halves
    (rows 0, d/2, 1, d/2+1, ...); HF keeps them as two halves. weight: [num_heads * head_dim, in]."""
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)
