"""The safetensors file format in one place: dtypes, header bytes and checkpoint file names.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (padded
with spaces to a multiple of 8), then the data region. The JSON maps every key to its ``dtype``,
``shape`` and ``data_offsets`` ``[start, end)`` relative to the start of the data region, plus an
optional ``__metadata__`` object of string values. A sharded checkpoint adds
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map`` key -> file)
(docs/design.md#safetensors-format).

This is the lowest layer of the package: it imports only torch, the standard library and
``nemo_moe_export.errors``. Everything that encodes, decodes or names safetensors dtypes, headers
or checkpoint files goes through it; no other dtype table exists. :func:`check_file` applies every
rule the ``safetensors`` library applies when it opens a file, so ``verify`` and ``from_hf`` name a
malformed file, key and problem where the library would raise its own terse error
(docs/design.md#faults-and-how-each-is-reported).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from nemo_moe_export.errors import InputError

__all__ = [
    "DTYPES",
    "FileCheck",
    "HEADER_ALIGNMENT",
    "INDEX_FILE",
    "LENGTH_PREFIX_BYTES",
    "MAX_HEADER_BYTES",
    "METADATA_KEY",
    "SINGLE_FILE",
    "SUFFIX",
    "SafetensorsDtype",
    "SafetensorsHeader",
    "TensorEntry",
    "check_file",
    "data_nbytes",
    "decode_header",
    "dtype_info",
    "dtype_name",
    "EXPORT_ID_KEY",
    "encode_header",
    "encode_index",
    "read_header",
    "read_weight_map",
    "replace_header_metadata",
    "torch_dtype",
]

INDEX_FILE = "model.safetensors.index.json"  # the index of a sharded checkpoint
SINGLE_FILE = "model.safetensors"  # an unsharded checkpoint's only file (no index needed)
SUFFIX = ".safetensors"
METADATA_KEY = "__metadata__"
EXPORT_ID_KEY = "nemo_moe_export.export_id"  # which export job wrote a file (header and index metadata)
LENGTH_PREFIX_BYTES = 8
HEADER_ALIGNMENT = 8  # the JSON header is padded with spaces to a multiple of this
MAX_HEADER_BYTES = 100_000_000  # the library refuses a longer header ("header too large")


@dataclass(frozen=True)
class SafetensorsDtype:
    """One dtype of the format: its header name, bits per element and torch dtype.

    ``torch`` is None where torch has no element-for-element dtype: the 6-bit floats, and F4, whose
    torch counterpart ``float4_e2m1fn_x2`` packs two values per element (its shapes would disagree
    with the header's logical shape), so neither can be read into or written from a torch tensor.
    """

    name: str
    bits: int
    torch: torch.dtype | None


def _torch(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)  # newer dtypes are missing from older torch builds


# Every dtype the format defines (the ``Dtype`` enum of safetensors 0.8), in the format's order.
DTYPES: tuple[SafetensorsDtype, ...] = (
    SafetensorsDtype("BOOL", 8, torch.bool),
    SafetensorsDtype("F4", 4, None),
    SafetensorsDtype("F6_E2M3", 6, None),
    SafetensorsDtype("F6_E3M2", 6, None),
    SafetensorsDtype("U8", 8, torch.uint8),
    SafetensorsDtype("I8", 8, torch.int8),
    SafetensorsDtype("F8_E5M2", 8, _torch("float8_e5m2")),
    SafetensorsDtype("F8_E4M3", 8, _torch("float8_e4m3fn")),
    SafetensorsDtype("F8_E8M0", 8, _torch("float8_e8m0fnu")),
    SafetensorsDtype("F8_E4M3FNUZ", 8, _torch("float8_e4m3fnuz")),
    SafetensorsDtype("F8_E5M2FNUZ", 8, _torch("float8_e5m2fnuz")),
    SafetensorsDtype("I16", 16, torch.int16),
    SafetensorsDtype("U16", 16, _torch("uint16")),
    SafetensorsDtype("F16", 16, torch.float16),
    SafetensorsDtype("BF16", 16, torch.bfloat16),
    SafetensorsDtype("I32", 32, torch.int32),
    SafetensorsDtype("U32", 32, _torch("uint32")),
    SafetensorsDtype("F32", 32, torch.float32),
    SafetensorsDtype("C64", 64, torch.complex64),
    SafetensorsDtype("F64", 64, torch.float64),
    SafetensorsDtype("I64", 64, torch.int64),
    SafetensorsDtype("U64", 64, _torch("uint64")),
)
_BY_NAME: dict[str, SafetensorsDtype] = {d.name: d for d in DTYPES}
_NAME_OF: dict[torch.dtype, str] = {d.torch: d.name for d in DTYPES if d.torch is not None}


def dtype_info(name: str) -> SafetensorsDtype | None:
    """The format's entry for a header dtype name, or None if the format does not define it."""
    return _BY_NAME.get(name)


def dtype_name(dtype: torch.dtype, *, key: str | None = None) -> str:
    """The header name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``); refuses one the format lacks."""
    if dtype not in _NAME_OF:
        raise InputError("dtype has no safetensors encoding", key=key,
                         expected=sorted(map(str, _NAME_OF)), actual=dtype)
    return _NAME_OF[dtype]


def torch_dtype(name: str, *, key: str | None = None) -> torch.dtype:
    """The torch dtype of a header dtype name (``"BF16"`` -> ``torch.bfloat16``)."""
    info = _BY_NAME.get(name)
    if info is None or info.torch is None:
        raise InputError("unsupported safetensors dtype", key=key, expected=sorted(_NAME_OF.values()),
                         actual=name, hint="torch has no dtype for it" if info is not None else None)
    return info.torch


def data_nbytes(name: str, shape: Sequence[int]) -> int | None:
    """Bytes a tensor of this dtype and (logical) shape occupies; None for an unknown dtype or a
    sub-byte tensor that does not end on a byte boundary (the format refuses both)."""
    info = _BY_NAME.get(name)
    if info is None:
        return None
    bits = math.prod(shape) * info.bits
    return bits // 8 if bits % 8 == 0 else None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry; ``start`` and ``end`` are relative to the data region."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def expected_nbytes(self) -> int | None:
        """What dtype x shape occupies (None: not a whole number of bytes)."""
        return data_nbytes(self.dtype, self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data_offsets": [self.start, self.end]}

    @staticmethod
    def from_json(key: str, info: Any) -> "TensorEntry":
        """Parse one raw header entry; refuses a missing field, an unknown dtype or a bad shape/offsets
        (the library's types: shape and offsets are unsigned integers, never booleans or floats)."""
        ok = isinstance(info, dict) and info.get("dtype") in _BY_NAME
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if ok else (None, None)
        # type() is int, not isinstance: a JSON true is a Python bool, an int subclass the library refuses
        ok = ok and isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
        if not ok:
            raise InputError("malformed safetensors header entry", key=key,
                             expected="dtype (a format dtype name), shape [int >= 0, ...], "
                                      "data_offsets [start, end] (ints >= 0)",
                             actual=info)
        return TensorEntry(info["dtype"], tuple(shape), offsets[0], offsets[1])


@dataclass(frozen=True)
class SafetensorsHeader:
    """A decoded header. ``raw`` keeps every tensor entry as stored (parse with :meth:`entry`), so a
    checker can report each malformed entry and still look at the rest."""

    raw: dict[str, Any]
    metadata: dict[str, Any] | None
    json_bytes: int  # N: the JSON and its padding

    @property
    def data_start(self) -> int:
        """Absolute offset of the data region in the file."""
        return LENGTH_PREFIX_BYTES + self.json_bytes

    def keys(self) -> list[str]:
        return list(self.raw)

    def entry(self, key: str) -> TensorEntry:
        return TensorEntry.from_json(key, self.raw[key])


def encode_header(entries: Mapping[str, TensorEntry], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and the padded JSON header for ``entries`` (in their order), metadata first.

    The JSON is compact and deterministic, so every rank encodes identical bytes for one plan.
    """
    header: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata is not None else {}
    header.update((key, entry.to_json()) for key, entry in entries.items())
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGNMENT)
    return len(raw).to_bytes(LENGTH_PREFIX_BYTES, "little") + raw


def replace_header_metadata(header: bytes, old: Mapping[str, str], new: Mapping[str, str]) -> bytes:
    """``header`` (from :func:`encode_header` with metadata ``old``) with metadata ``new``: the
    bytes :func:`encode_header` gives for the same entries and ``new``, without encoding the
    entries again (thousands of entries take milliseconds; their offsets are relative to the data
    region, so a longer header leaves them unchanged)."""
    raw = header[LENGTH_PREFIX_BYTES:].rstrip(b" ")
    opening = json.dumps(METADATA_KEY).encode() + b":"
    before, after = (json.dumps(dict(m), separators=(",", ":")).encode() for m in (old, new))
    if not raw.startswith(b"{" + opening + before):
        raise ValueError(f"the header does not start with the metadata {dict(old)}")
    raw = b"{" + opening + after + raw[1 + len(opening) + len(before):]
    raw += b" " * (-len(raw) % HEADER_ALIGNMENT)
    return len(raw).to_bytes(LENGTH_PREFIX_BYTES, "little") + raw


def decode_header(f: BinaryIO, file_size: int, *, name: str) -> SafetensorsHeader:
    """Read and decode the header at the start of ``f`` (a file of ``file_size`` bytes named ``name``).

    Raises :class:`InputError` naming the file when it is too short, the length runs past the
    end of the file or the library's limit, the header is not UTF-8 JSON of an object, or
    ``__metadata__`` is not an object of strings.
    """
    prefix = f.read(LENGTH_PREFIX_BYTES)
    if len(prefix) < LENGTH_PREFIX_BYTES:
        raise InputError("file is too short for a safetensors header", key=name,
                         expected=f">= {LENGTH_PREFIX_BYTES} bytes", actual=f"{file_size} bytes")
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER_BYTES:  # checked before reading: a corrupt length must not allocate gigabytes
        raise InputError("header is larger than safetensors allows", key=name,
                         expected=f"<= {MAX_HEADER_BYTES} bytes", actual=f"{n} bytes")
    if n > file_size - LENGTH_PREFIX_BYTES:
        raise InputError("header length exceeds the file: truncated?", key=name,
                         expected=f"<= {file_size - LENGTH_PREFIX_BYTES} bytes", actual=f"{n} bytes")
    try:
        # Strict UTF-8 first: json.loads(bytes) would also accept UTF-16 or a BOM, the library does not.
        header = json.loads(f.read(n).decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError
        raise InputError("header is not valid JSON", key=name, expected="a UTF-8 JSON object",
                         actual=str(exc)) from exc
    if not isinstance(header, dict):
        raise InputError("header is not a JSON object", key=name, expected="a JSON object",
                         actual=type(header).__name__)
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise InputError(f"{METADATA_KEY} is not an object of strings", key=name,
                         expected='e.g. {"format": "pt"}', actual=metadata)
    return SafetensorsHeader(header, metadata, n)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Decode the header of the safetensors file at ``path`` (see :func:`decode_header`)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        return decode_header(f, os.path.getsize(path), name=os.path.basename(path))


@dataclass(frozen=True)
class FileCheck:
    """What :func:`check_file` found: the header (None when unreadable), its well-formed entries by
    key, and one line per problem, each naming the file (and the key)."""

    header: SafetensorsHeader | None
    entries: dict[str, TensorEntry]
    problems: list[str]


def check_file(path: str | os.PathLike[str]) -> FileCheck:
    """Check one ``.safetensors`` file from its header without reading tensor data: it is a
    readable regular file, the header decodes (:func:`decode_header`), every entry parses, spans
    ``dtype x shape`` bytes, and the spans tile the data region exactly (no gap, overlap or
    trailing bytes). These are the library's own rules, so a file passes exactly when
    ``safe_open`` would open it."""
    path = os.fspath(path)
    name = os.path.basename(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            return FileCheck(None, {}, [f"{name}: is {kind}, not a safetensors file"])
        with open(path, "rb") as f:
            header = decode_header(f, st.st_size, name=name)
    except InputError as exc:
        return FileCheck(None, {}, [f"{name}: {exc.problem} (expected {exc.expected}, found {exc.actual})"])
    except OSError as exc:
        if os.path.islink(path) and not os.path.exists(path):
            return FileCheck(None, {}, [f"{name}: is a symbolic link to a missing file ({os.readlink(path)})"])
        return FileCheck(None, {}, [f"{name}: cannot be read ({exc.strerror or exc})"])
    entries, problems = {}, []
    for key in header.keys():
        entry = _checked_entry(name, key, header, problems)
        if entry is not None:
            entries[key] = entry
    spans = sorted((e.start, e.end, k) for k, e in entries.items())
    problems += _tiling_problems(name, spans, st.st_size - header.data_start)
    return FileCheck(header, entries, problems)


def _checked_entry(name: str, key: str, header: SafetensorsHeader, problems: list[str]) -> TensorEntry | None:
    """The parsed entry of ``key``, or None with the problem recorded; a span that disagrees with
    dtype x shape is recorded but the entry still counts for the tiling."""
    try:
        entry = header.entry(key)
    except InputError:
        problems.append(f"{name}: key '{key}' has a malformed entry {header.raw[key]}")
        return None
    expected = entry.expected_nbytes
    if expected is None:
        problems.append(f"{name}: key '{key}' ({entry.dtype} {list(entry.shape)}) does not end on a byte boundary")
    elif entry.nbytes != expected:
        problems.append(f"{name}: key '{key}' spans {entry.nbytes} bytes (data_offsets [{entry.start}, "
                        f"{entry.end}]), expected {expected} for {entry.dtype} {list(entry.shape)}")
    return entry


def _tiling_problems(name: str, spans: list[tuple[int, int, str]], data: int) -> list[str]:
    """Sorted ``(start, end, key)`` spans must cover the ``data`` bytes exactly: no overlap, no gap."""
    problems, cursor = [], 0
    for start, end, key in spans:
        if start < cursor:
            problems.append(f"{name}: key '{key}' at bytes [{start}, {end}) overlaps the previous tensor "
                            f"(which ends at {cursor})")
        elif start > cursor:
            problems.append(f"{name}: gap of {start - cursor} bytes before key '{key}' at {start}")
        cursor = max(cursor, end)
    if cursor != data:
        problems.append(f"{name}: tensors end at data byte {cursor} but the file holds {data} data bytes "
                        f"({'truncated' if cursor > data else 'trailing bytes'})")
    return problems


def encode_index(weight_map: Mapping[str, str], total_size: int, metadata: Mapping[str, str] | None = None) -> str:
    """The text of ``model.safetensors.index.json``, as transformers writes it (indented); extra
    ``metadata`` entries sit beside ``total_size`` (transformers reads only the weight map)."""
    meta = {"total_size": total_size, **(metadata or {})}
    return json.dumps({"metadata": meta, "weight_map": dict(weight_map)}, indent=2) + "\n"


def read_weight_map(directory: str | os.PathLike[str]) -> dict[str, str]:
    """``weight_map`` (key -> file name) of the index in ``directory``; refuses an unreadable index,
    naming the index file and the first bad entry."""
    path = os.path.join(os.fspath(directory), INDEX_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise InputError("unreadable checkpoint index", key=path,
                         expected='JSON with a "weight_map" object', actual=f"{type(exc).__name__}: {exc}",
                         ) from exc
    if not isinstance(weight_map, dict):
        raise InputError("unreadable checkpoint index", key=path, expected='a "weight_map" object',
                         actual=type(weight_map).__name__)
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise InputError("unreadable checkpoint index", key=path,
                         expected=f'"weight_map" values that are file names (key {bad!r})',
                         actual=repr(weight_map[bad]))
    return weight_map
