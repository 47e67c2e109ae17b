"""The safetensors file format read and written directly (8-byte header length, JSON header, raw bytes): reads
are memory-mapped, so a process touches only the bytes of the slices it takes, bfloat16 included (which the
safetensors package's numpy slicing does not read), and neither torch nor safetensors is needed."""
from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Mapping

import ml_dtypes
import numpy as np

from mesh.errors import UserError

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(UserError):
    """A file that is not readable safetensors; the message names the file."""


def read_header(path: pathlib.Path) -> tuple[int, dict]:
    """(offset of the data section, {tensor name: {dtype, shape, data_offsets}})."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > os.fstat(f.fileno()).st_size - 8:  # garbage where the header's length should be
                raise ValueError
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: not a readable safetensors file ({type(e).__name__})") from None
    header.pop("__metadata__", None)
    return 8 + size, header


def open_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of one file as a read-only memory-mapped array (no bytes read until sliced)."""
    start, header = read_header(path)
    out = {}
    for name, info in header.items():
        if info.get("dtype") not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has dtype {info.get('dtype')}; expected one of "
                                   f"{', '.join(DTYPES)}")
        begin, end = info["data_offsets"]
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise SafetensorsError(f"{path}: tensor {name} holds {end - begin} bytes, not its shape {list(shape)}")
        out[name] = np.memmap(path, dtype=dtype, mode="r", offset=start + begin, shape=shape)
    return out


def write(path: pathlib.Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (C-contiguous, in name order) as one safetensors file."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in sorted(tensors):
        arr = tensors[name]
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
