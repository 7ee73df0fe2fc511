"""Read .safetensors files as memory-mapped numpy arrays, so loading copies each tensor once.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and byte range, then the raw data. Mapping the file lets the
loader read a tensor straight into the device buffer it fills, with no intermediate
state dict; bf16 comes through `ml_dtypes`.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass
from typing import Optional

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
# The dtypes a weight may have: what is not a float is quantized (or not a weight) and refused by name.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model, or cannot be read; the message lists every problem."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: Optional[np.dtype]  # None: a dtype numpy cannot hold (F4, F8_E8M0, ...), refused before reading
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`
    dtype_name: str  # as the header writes it: F32, BF16, I8, F8_E4M3, ...


def read_header(path: str) -> dict[str, TensorInfo]:
    """Every tensor of one file, checked to lie inside it: a truncated or corrupt file is a
    CheckpointError naming it, before any tensor is read."""
    size = os.path.getsize(path)
    corrupt = f"{path} is not a complete safetensors file ({size} bytes)"
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
        if header_len > size - 8:
            raise CheckpointError(f"{corrupt}: its header does not fit in it; download or write it again")
        try:
            header = json.loads(f.read(header_len))
            entries = {name: (e["dtype"], tuple(e["shape"]), *e["data_offsets"])
                       for name, e in header.items() if name != "__metadata__"}
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{corrupt}: its header is not a safetensors header ({type(e).__name__}: {e}); "
                                  f"download or write it again") from None
    base = 8 + header_len
    infos = {}
    for name, (dtype_name, shape, begin, end) in entries.items():
        dtype = np.dtype(_DTYPES[dtype_name]) if dtype_name in _DTYPES else None
        if base + end > size:
            raise CheckpointError(f"{corrupt}: tensor {name} ends at byte {base + end}, past its end (truncated?); "
                                  f"download or write it again")
        if dtype is not None and end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise CheckpointError(f"{corrupt}: tensor {name} of {dtype_name}{list(shape)} has {end - begin} bytes")
        infos[name] = TensorInfo(path, dtype, shape, base + begin, dtype_name)
    return infos


def index_checkpoint(directory: str) -> dict[str, TensorInfo]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, by name."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({os.path.join(directory, fn) for fn in weight_map.values()})
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        pickles = sorted(found for pattern in ("*.bin", "*.bin.index.json", "*.pt", "*.pth")
                         for found in glob.glob(os.path.join(directory, pattern)))
        hint = f"; it has {', '.join(map(os.path.basename, pickles[:3]))}, PyTorch pickles, which jaxcb does not " \
               f"read (loading one runs the code in it): write safetensors with transformers' " \
               f"save_pretrained(OUT_DIR, safe_serialization=True)" if pickles else ""
        raise FileNotFoundError(f"{directory} has no *.safetensors files{hint}")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{index_path} names {os.path.basename(path)}, which is missing")
        for name, info in read_header(path).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} appears in both {tensors[name].file} and {path}; remove the "
                                      f"file that is not the checkpoint's")
            tensors[name] = info
    return tensors


def read_tensor(info: TensorInfo) -> np.ndarray:
    """A read-only memory map of one tensor (no copy until it is used)."""
    return np.memmap(info.file, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)
