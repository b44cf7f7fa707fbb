"""Checkpoint readers for ``StateDictAdapter.from_hf``: each reads boxes of HF tensors by key.

A *source* has ``keys()``, ``meta(key)`` (global shape and dtype), ``read(key, offsets, shape)`` (one
box, counted in ``bytes_read``) and ``close()``. :class:`SafetensorsSource` reads a checkpoint on
disk slice by slice; :class:`TensorDictSource` serves an in-memory HF state dict. The FP8 reader
(``fp8.py``) wraps a :class:`SafetensorsSource`, and the engine uses all three, so they live here,
below both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from nemo_moe_export.adapters.protocol import TensorMeta
from nemo_moe_export.errors import InputError
from nemo_moe_export.safetensors_format import INDEX_FILE, SINGLE_FILE, check_file, read_weight_map, torch_dtype

__all__ = ["SafetensorsSource", "TensorDictSource", "box_slices"]


def box_slices(offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The index of the box ``offsets[d] : offsets[d] + shape[d]``."""
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


class SafetensorsSource:
    """HF safetensors checkpoint (a directory with or without an index, or one file).

    Reads slices only (``safe_open(...).get_slice(key)[...]``) and counts the bytes it returns.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0
        self._files = self._file_of_each_key(os.fspath(path))

    def _file_of_each_key(self, path: str) -> dict[str, str]:
        if not os.path.exists(path):
            raise InputError("checkpoint not found", key=path,
                             expected="a checkpoint directory or a .safetensors file", actual="no such path")
        if not os.path.isdir(path):
            return self._keys_of(path)
        if os.path.exists(os.path.join(path, INDEX_FILE)):
            return {k: os.path.join(path, v) for k, v in read_weight_map(path).items()}
        single = os.path.join(path, SINGLE_FILE)
        if not os.path.lexists(single):
            raise InputError("no safetensors checkpoint found", key=path,
                             expected=f"{INDEX_FILE} or {SINGLE_FILE}", actual=sorted(os.listdir(path)))
        return self._keys_of(single)

    def _keys_of(self, file: str) -> dict[str, str]:
        return {k: file for k in self._handle(file).keys()}

    def _handle(self, file: str) -> Any:
        """The open file, checked first as the library checks it, so a malformed file is an error
        naming it, the key and the problem rather than the library's own terse message."""
        if file not in self._handles:
            if not os.path.lexists(file):
                raise InputError(
                    "checkpoint index points at a missing file", key=file, expected="file exists",
                    actual="missing",
                )
            check = check_file(file)
            if check.problems:
                more = f" (and {len(check.problems) - 1} more problem(s))" if len(check.problems) > 1 else ""
                raise InputError(
                    "malformed safetensors file", key=file, expected="a file the safetensors library can open",
                    actual=check.problems[0] + more,
                    hint="re-export or re-copy it; `nemo-moe-export verify DIR` lists every problem",
                )
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except (OSError, SafetensorError) as exc:  # a rule check_file does not know: still name the file
                raise InputError("safetensors cannot open the file", key=file,
                                 expected="a readable safetensors file", actual=f"{type(exc).__name__}: {exc}",
                                 ) from exc
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def keys(self) -> set[str]:
        return set(self._files)

    def meta(self, key: str) -> TensorMeta:
        handle = self._handle(self._files[key])
        if key not in handle.keys():
            raise InputError(
                "checkpoint index lists a key its file does not hold",
                key=key, expected=f"key in {os.path.basename(self._files[key])}", actual="absent",
            )
        sl = handle.get_slice(key)
        try:
            dtype = torch_dtype(sl.get_dtype(), key=key)
        except InputError as exc:  # a format dtype torch cannot hold (F4, F6_*): say where
            raise InputError(exc.problem, key=key, expected=exc.expected,
                             actual=f"{exc.actual} in {self._files[key]}", hint=exc.hint) from None
        return TensorMeta(tuple(sl.get_shape()), dtype)

    def read(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        handle = self._handle(self._files[key])
        out = handle.get_slice(key)[box_slices(offsets, shape)] if shape else handle.get_tensor(key)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def read_whole(self, key: str) -> torch.Tensor:
        return self._handle(self._files[key]).get_tensor(key)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


class TensorDictSource:
    """An in-memory HF state dict (``{key: tensor}``) as a source."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self.bytes_read = 0

    def keys(self) -> set[str]:
        return set(self._tensors)

    def meta(self, key: str) -> TensorMeta:
        t = self._tensors[key]
        return TensorMeta(tuple(t.shape), t.dtype)

    def read(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        out = self._tensors[key][box_slices(offsets, shape)] if shape else self._tensors[key]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        pass
