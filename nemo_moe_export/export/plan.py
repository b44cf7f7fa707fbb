"""The export plan: every file, header and byte offset of the checkpoint, decided before any I/O.

Pure: it depends only on global key names, shapes and dtypes (``StateDictAdapter.hf_metadata``)
and the options, so every rank computes the identical plan with no communication. Writers then
place their bytes at the planned offsets; a plan always tiles each file exactly (header, then
tensors back to back, no gaps, no trailing bytes), which is what safetensors requires.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nemo_moe_export.adapters.engine import TensorMeta
from nemo_moe_export.errors import ExportInputError

__all__ = [
    "ExportPlan",
    "PlannedFile",
    "PlannedTensor",
    "SAFETENSORS_DTYPE_NAMES",
    "natural_key",
    "parse_size",
    "plan_export",
]

SAFETENSORS_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class PlannedTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    data_start: int  # absolute byte offset of the tensor's first byte in ``file``
    nbytes: int

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class PlannedFile:
    name: str
    header: bytes  # the 8-byte length prefix and the JSON header, padded to 8 bytes
    size: int  # total file size in bytes
    keys: tuple[str, ...]


@dataclass(frozen=True)
class ExportPlan:
    files: tuple[PlannedFile, ...]
    tensors: Mapping[str, PlannedTensor]

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def index_json(self) -> str:
        weight_map = {key: self.tensors[key].file for f in self.files for key in f.keys}
        return json.dumps({"metadata": {"total_size": self.total_tensor_bytes}, "weight_map": weight_map},
                          indent=2) + "\n"


def natural_key(key: str) -> tuple:
    """Sort ``layers.10`` after ``layers.9`` and ``experts.10`` after ``experts.9``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``5GB`` -> 5e9, ``64MiB`` -> 64 * 2**20, ints pass through (as transformers' max_shard_size)."""
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise ExportInputError("unreadable size", key="max_shard_size", expected="e.g. 5GB, 512MiB or bytes",
                                   actual=repr(size))
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ExportInputError("size must be positive", key="max_shard_size", expected="> 0", actual=value)
    return value


def _header(entries: list[tuple[str, TensorMeta, int, int]]) -> bytes:
    header = {"__metadata__": {"format": "pt"}}
    for key, meta, start, end in entries:
        header[key] = {"dtype": SAFETENSORS_DTYPE_NAMES[meta.dtype], "shape": list(meta.shape),
                       "data_offsets": [start, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
    return len(raw).to_bytes(8, "little") + raw


def plan_export(
    metadata: Mapping[str, TensorMeta],
    *,
    dtype: torch.dtype | None = None,
    keep_dtype: tuple[str, ...] = (),
    max_shard_size: int | str = "5GB",
) -> ExportPlan:
    """Lay out the checkpoint: files of at most ``max_shard_size`` tensor bytes, keys in natural order.

    ``dtype`` casts floating-point tensors (integer and bool tensors are kept exact), except keys
    matching a regex in ``keep_dtype`` (e.g. routers kept in fp32). A tensor larger than the shard
    size gets a file of its own, as transformers does.
    """
    limit = parse_size(max_shard_size)
    if dtype is not None and not dtype.is_floating_point:
        raise ExportInputError("export dtype must be floating point", key="dtype",
                               expected="e.g. torch.bfloat16", actual=dtype)
    keep = [re.compile(p) for p in keep_dtype]
    metas: dict[str, TensorMeta] = {}
    for key in sorted(metadata, key=natural_key):
        meta = metadata[key]
        if meta.dtype not in SAFETENSORS_DTYPE_NAMES:
            raise ExportInputError("dtype has no safetensors encoding", key=key,
                                   expected=sorted(map(str, SAFETENSORS_DTYPE_NAMES)), actual=meta.dtype)
        if dtype is not None and meta.dtype.is_floating_point and not any(p.search(key) for p in keep):
            meta = TensorMeta(meta.shape, dtype)
        metas[key] = meta

    groups: list[list[str]] = [[]]
    used = 0
    for key, meta in metas.items():
        nbytes = _nbytes(meta)
        if groups[-1] and used + nbytes > limit:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += nbytes

    n = len(groups)
    files, tensors = [], {}
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        entries, offset = [], 0
        for key in keys:
            nbytes = _nbytes(metas[key])
            entries.append((key, metas[key], offset, offset + nbytes))
            offset += nbytes
        header = _header(entries)
        for key, meta, start, end in entries:
            tensors[key] = PlannedTensor(key, meta.shape, meta.dtype, name, len(header) + start, end - start)
        files.append(PlannedFile(name, header, len(header) + offset, tuple(keys)))
    return ExportPlan(tuple(files), tensors)


def _nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize
