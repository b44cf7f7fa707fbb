"""Positioned reads of stored boxes: each stored byte read once, in file order, and counted.

A rank reads only its own boxes (``assign.py``), file by file in offset order, adjacent items
merged into one ``pread`` of at most ``read_bytes`` (docs/design.md#checkpoint-conversion). A DCP
``.distcp`` item is a small ``torch.save`` archive, decoded with ``torch.load(weights_only=True)``
(never an arbitrary unpickle); a safetensors item is raw bytes. :func:`check_files` refuses a
missing or short data file before anything is written.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from nemo_moe_export.convert.index import CheckpointIndex, StoredChunk
from nemo_moe_export.errors import InputError

__all__ = ["READ_BYTES", "ReadStats", "check_files", "read_chunks"]

READ_BYTES = 64 << 20  # the most one pread asks for (adjacent items merged up to it)


@dataclass
class ReadStats:
    bytes_read: int = 0
    reads: int = 0  # preads issued
    items: int = 0  # stored boxes decoded
    seconds: float = 0.0  # in pread and decoding


def check_files(index: CheckpointIndex, chunks: Iterable[StoredChunk]) -> None:
    """Every data file ``chunks`` live in exists and is long enough for its items (rank-local)."""
    ends: dict[str, int] = {}
    for chunk in chunks:
        ends[chunk.file] = max(ends.get(chunk.file, 0), chunk.byte_offset + chunk.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(index.directory, name)
        if not os.path.isfile(path):
            raise InputError("a data file of the checkpoint is missing", key=path, expected="the file the index names",
                             actual="missing", hint="copy the whole checkpoint directory")
        size = os.path.getsize(path)
        if size < end:
            raise InputError("a data file of the checkpoint is truncated", key=path,
                             expected=f"at least {end} bytes", actual=f"{size} bytes",
                             hint="the copy is incomplete; copy the checkpoint again")


def _runs(chunks: list[StoredChunk], limit: int) -> Iterator[list[StoredChunk]]:
    """``chunks`` (one file, offset order) as runs of adjacent items of at most ``limit`` bytes
    (an item larger than that is a run of its own)."""
    run: list[StoredChunk] = []
    for chunk in chunks:
        if run and (chunk.byte_offset != run[-1].byte_offset + run[-1].length
                    or chunk.byte_offset + chunk.length - run[0].byte_offset > limit):
            yield run
            run = []
        run.append(chunk)
    if run:
        yield run


def _pread(fd: int, length: int, offset: int, name: str):
    """``length`` bytes at ``offset``, into a buffer that is not zero-filled first (every byte of it
    is read over: a ``bytearray`` would write the whole buffer once more before the read)."""
    buffer = torch.empty(length, dtype=torch.uint8).numpy()
    view, done = memoryview(buffer), 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise InputError("a data file of the checkpoint ended early", key=name,
                             expected=f"{length} bytes at {offset}", actual=f"{done}")
        done += n
    return buffer


def _decode(chunk: StoredChunk, data: memoryview, dtype: torch.dtype) -> torch.Tensor:
    if chunk.encoding == "raw":
        tensor = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
        return tensor.view(chunk.sizes)
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise InputError("a stored item is not a torch.save archive of a tensor", key=chunk.key,
                         expected=f"{chunk.length} bytes of torch.save at {chunk.file}:{chunk.byte_offset}",
                         actual=f"{type(exc).__name__}: {str(exc)[:200]}") from None
    if not torch.is_tensor(tensor) or tuple(tensor.shape) != chunk.sizes or tensor.dtype != dtype:
        raise InputError("a stored item does not hold the box the index declares", key=chunk.key,
                         expected=f"{tuple(chunk.sizes)} {dtype}",
                         actual=f"{tuple(tensor.shape)} {tensor.dtype}" if torch.is_tensor(tensor) else type(tensor))
    return tensor


def read_chunks(index: CheckpointIndex, chunks: Iterable[StoredChunk], stats: ReadStats, *,
                read_bytes: int = READ_BYTES) -> Iterator[tuple[StoredChunk, torch.Tensor]]:
    """Each of ``chunks`` with its data, file by file in offset order; every byte read once."""
    by_file: dict[str, list[StoredChunk]] = {}
    for chunk in chunks:
        by_file.setdefault(chunk.file, []).append(chunk)
    for name in sorted(by_file):
        fd = os.open(os.path.join(index.directory, name), os.O_RDONLY)
        try:
            for run in _runs(sorted(by_file[name], key=lambda c: c.byte_offset), read_bytes):
                started = time.perf_counter()
                first = run[0].byte_offset
                length = run[-1].byte_offset + run[-1].length - first
                data = memoryview(_pread(fd, length, first, name))
                stats.bytes_read += length
                stats.reads += 1
                for chunk in run:
                    start = chunk.byte_offset - first
                    tensor = _decode(chunk, data[start:start + chunk.length], index.tensors[chunk.key].dtype)
                    stats.items += 1
                    stats.seconds += time.perf_counter() - started
                    yield chunk, tensor
                    started = time.perf_counter()
                del data
        finally:
            os.close(fd)
