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
}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`


def read_header(path: str) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, _ = entry["data_offsets"]
        infos[name] = TensorInfo(path, np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"]), base + begin)
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
        raise FileNotFoundError(f"{directory} has no *.safetensors files")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{index_path} names {os.path.basename(path)}, which is missing")
        for name, info in read_header(path).items():
            if name in tensors:
                raise ValueError(f"tensor {name} appears in both {tensors[name].file} and {path}")
            tensors[name] = info
    return tensors


def read_tensor(info: TensorInfo) -> np.ndarray:
    """A read-only memory map of one tensor (no copy until it is used)."""
    return np.memmap(info.file, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)
