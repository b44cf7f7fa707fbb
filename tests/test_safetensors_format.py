"""The safetensors format module against the installed ``safetensors`` library: what it writes we
read, what we write it reads, and every malformed header is a clear error naming the file."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nemo_moe_export.errors import InputError
from nemo_moe_export.safetensors_format import (
    DTYPES,
    INDEX_FILE,
    TensorEntry,
    data_nbytes,
    decode_header,
    dtype_info,
    dtype_name,
    encode_header,
    encode_index,
    read_header,
    read_weight_map,
    torch_dtype,
)

TORCH_DTYPES = [d for d in DTYPES if d.torch is not None]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(6, dtype=torch.int32).reshape(3, 2).to(dtype) if dtype != torch.bool else \
        torch.tensor([[True, False]] * 3)


def test_the_table_is_the_formats_full_list():
    names = [d.name for d in DTYPES]
    assert len(names) == len(set(names)) == 22
    for name in ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32",
                 "F32", "F64", "I64", "U64", "F4", "F6_E2M3", "F6_E3M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64"):
        assert dtype_info(name) is not None, name
    assert torch_dtype("F8_E8M0") == torch.float8_e8m0fnu and dtype_name(torch.float8_e4m3fn) == "F8_E4M3"
    for d in TORCH_DTYPES:
        assert d.bits == 8 * d.torch.itemsize and torch_dtype(d.name) == d.torch and dtype_name(d.torch) == d.name


@pytest.mark.parametrize("info", TORCH_DTYPES, ids=lambda d: d.name)
def test_what_the_library_writes_we_name_and_size_the_same(tmp_path, info):
    path = tmp_path / "t.safetensors"
    save_file({"t": _sample(info.torch)}, path)
    header = read_header(path)
    entry = header.entry("t")
    assert entry.dtype == info.name and entry.shape == (3, 2)
    assert entry.nbytes == entry.expected_nbytes == 6 * info.torch.itemsize
    with safe_open(path, "pt") as f:
        assert f.get_slice("t").get_dtype() == info.name


@pytest.mark.parametrize("info", TORCH_DTYPES, ids=lambda d: d.name)
def test_what_we_write_the_library_reads(tmp_path, info):
    tensor = _sample(info.torch)
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = encode_header({"t": TensorEntry(info.name, (3, 2), 0, len(data))}, {"format": "pt"})
    n = int.from_bytes(header[:8], "little")
    assert len(header) == 8 + n and n % 8 == 0
    assert json.loads(header[8:]) == {"__metadata__": {"format": "pt"},
                                      "t": {"dtype": info.name, "shape": [3, 2], "data_offsets": [0, len(data)]}}
    (tmp_path / "t.safetensors").write_bytes(header + data)
    with safe_open(tmp_path / "t.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        got = f.get_tensor("t")
    assert got.dtype == info.torch and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))


def test_header_is_padded_with_spaces_to_eight_bytes():
    for key in ("a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"):
        header = encode_header({key: TensorEntry("F32", (1,), 0, 4)})
        n = int.from_bytes(header[:8], "little")
        raw = header[8:]
        assert n == len(raw) and n % 8 == 0 and raw.rstrip(b" ") == json.dumps(
            {key: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, separators=(",", ":")).encode()


def test_sub_byte_dtypes_count_bits():
    assert data_nbytes("F4", (4,)) == 2 and data_nbytes("F4", (3,)) is None
    assert data_nbytes("F6_E2M3", (4,)) == 3 and data_nbytes("F6_E3M2", (2, 2)) == 3
    assert data_nbytes("F32", ()) == 4 and data_nbytes("F32", (0, 5)) == 0 and data_nbytes("Q8", (1,)) is None
    with pytest.raises(InputError, match="unsupported safetensors dtype.*torch has no dtype for it"):
        torch_dtype("F4", key="w")
    with pytest.raises(InputError, match="unsupported safetensors dtype"):
        torch_dtype("Q8")
    with pytest.raises(InputError, match="dtype has no safetensors encoding"):
        dtype_name(torch.complex128)


@pytest.mark.parametrize(
    "raw,problem",
    [
        (b"\x01\x00", "file is too short for a safetensors header"),
        ((1000).to_bytes(8, "little") + b"{}", "header length exceeds the file: truncated?"),
        ((8).to_bytes(8, "little") + b"{not json", "header is not valid JSON"),
        ((8).to_bytes(8, "little") + b"[1, 2]  ", "header is not a JSON object"),
    ],
)
def test_malformed_headers_are_named_errors(raw, problem):
    with pytest.raises(InputError) as info:
        decode_header(io.BytesIO(raw), len(raw), name="model-00001-of-00002.safetensors")
    assert info.value.problem == problem and info.value.key == "model-00001-of-00002.safetensors"


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [2]},
    {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": [0]},
    "F32",
])
def test_malformed_entries_are_refused_by_key(entry):
    with pytest.raises(InputError, match="malformed safetensors header entry") as info:
        TensorEntry.from_json("w", entry)
    assert info.value.key == "w"


def test_index_round_trip_and_unreadable_index(tmp_path):
    text = encode_index({"a": "model-00001-of-00002.safetensors"}, 16)
    assert json.loads(text) == {"metadata": {"total_size": 16}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / INDEX_FILE).write_text(text)
    assert read_weight_map(tmp_path) == {"a": "model-00001-of-00002.safetensors"}
    (tmp_path / INDEX_FILE).write_text('{"metadata": {}}')
    with pytest.raises(InputError, match="unreadable checkpoint index") as info:
        read_weight_map(tmp_path)
    assert info.value.key == os.path.join(str(tmp_path), INDEX_FILE)
