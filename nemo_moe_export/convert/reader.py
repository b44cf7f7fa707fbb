"""Positioned reads of stored boxes: each stored byte read once, in file order, and counted.

A rank reads only its own boxes (``assign.py``), file by file in offset order, adjacent items
merged into one ``pread`` of at most ``read_bytes`` (docs/design.md#checkpoint-conversion). A DCP
``.distcp`` item is a small ``torch.save`` archive (an uncompressed zip), decoded over the read
buffer without a copy: its zip directory gives the ``data.pkl`` and storage records, and torch's
weights-only unpickler (never an arbitrary unpickle) rebuilds the tensor over the storage's bytes;
anything else about the archive goes to ``torch.load(weights_only=True)``, whose errors stand. A
safetensors item is raw bytes. :func:`check_files` refuses a
missing or short data file before anything is written.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch._weights_only_unpickler import Unpickler as _WeightsOnlyUnpickler
from torch.serialization import _maybe_decode_ascii

from nemo_moe_export.convert.index import CheckpointIndex, StoredChunk
from nemo_moe_export.errors import InputError

__all__ = ["READ_AHEAD_BYTES", "READ_BYTES", "ChunkReader", "ReadStats", "check_files", "read_chunks"]

READ_BYTES = 64 << 20  # the most one pread asks for (adjacent items merged up to it)
READ_AHEAD_BYTES = 256 << 20  # runs read ahead of the consumer, at most (ChunkReader)


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


class _NotPlain(Exception):
    """The item is not the plain archive :func:`_load_in_place` reads; ``torch.load`` decides."""


# zip records (the zip format's own layouts): end of central directory, central directory entry,
# local file header; torch.save writes no zip64 fields below 4 GiB and no archive comment
_EOCD = struct.Struct("<IHHHHIIH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_EOCD_SIG, _CENTRAL_SIG, _LOCAL_SIG, _ZIP64 = 0x06054B50, 0x02014B50, 0x04034B50, 0xFFFFFFFF


def _records(data: memoryview) -> dict[str, memoryview]:
    """Each entry of the zip archive ``data`` by name: a view of its stored bytes (no copy)."""
    if len(data) < _EOCD.size:
        raise _NotPlain
    sig, disk, cd_disk, n_disk, n, cd_size, cd_offset, comment = _EOCD.unpack_from(data, len(data) - _EOCD.size)
    if sig != _EOCD_SIG or disk or cd_disk or n != n_disk or comment or _ZIP64 in (cd_size, cd_offset):
        raise _NotPlain
    records, pos = {}, cd_offset
    for _ in range(n):
        (sig, _made_by, _needs, flags, method, _time, _date, _crc, stored, size, name_len, extra_len, comment_len,
         _disk, _internal, _external, local) = _CENTRAL.unpack_from(data, pos)
        if sig != _CENTRAL_SIG or flags & 1 or method != 0 or stored != size or _ZIP64 in (size, local):
            raise _NotPlain  # encrypted, compressed or zip64: not what torch.save writes for an item
        name = bytes(data[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len])
        pos += _CENTRAL.size + name_len + extra_len + comment_len
        head = _LOCAL.unpack_from(data, local)
        start = local + _LOCAL.size + head[9] + head[10]
        if head[0] != _LOCAL_SIG or head[3] != 0 or bytes(data[local + _LOCAL.size:local + _LOCAL.size + head[9]]) \
                != name or start + size > cd_offset:
            raise _NotPlain
        records[name.decode("utf-8")] = data[start:start + size]
    return records


class _InPlaceUnpickler(_WeightsOnlyUnpickler):
    """torch's weights-only unpickler whose storages are the archive's own bytes, wrapped as
    ``torch.serialization._load`` wraps the storages it reads (a ``TypedStorage`` of the saved dtype)."""

    def __init__(self, pickled: memoryview, storages: dict[str, memoryview]) -> None:
        super().__init__(io.BytesIO(pickled), encoding="utf-8")  # torch.load's default encoding
        self.storages = storages

    def persistent_load(self, saved_id):
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise _NotPlain
        typename, storage_type, key, _location, numel = saved_id  # map_location is the CPU: bytes stay here
        if _maybe_decode_ascii(typename) != "storage" or key not in self.storages:
            raise _NotPlain
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        raw = self.storages[key]
        if len(raw) != numel * torch._utils._element_size(dtype):
            raise _NotPlain
        untyped = torch.frombuffer(raw, dtype=torch.uint8).untyped_storage() if len(raw) else torch.UntypedStorage(0)
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _load_in_place(data: memoryview) -> torch.Tensor:
    """The tensor a one-storage ``torch.save`` archive holds, over ``data``'s own bytes: it keeps the
    saved strides and offset, and keeps the read buffer alive for as long as it lives."""
    records = _records(data)
    pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise _NotPlain
    prefix = pickles[0][:-len("data.pkl")]
    storages = {name[len(prefix) + 5:]: raw for name, raw in records.items() if name.startswith(prefix + "data/")}
    order = records.get(prefix + "byteorder")
    if len(storages) != 1 or order is None or bytes(order) != b"little" or sys.byteorder != "little":
        raise _NotPlain  # several storages, or bytes to swap: torch.load's own path
    tensor = _InPlaceUnpickler(records[pickles[0]], storages).load()
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        raise _NotPlain
    return tensor


def _torch_load(chunk: StoredChunk, data: memoryview) -> torch.Tensor:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise InputError("a stored item is not a torch.save archive of a tensor", key=chunk.key,
                         expected=f"{chunk.length} bytes of torch.save at {chunk.file}:{chunk.byte_offset}",
                         actual=f"{type(exc).__name__}: {str(exc)[:200]}") from None


def _decode(chunk: StoredChunk, data: memoryview, dtype: torch.dtype) -> torch.Tensor:
    if chunk.encoding == "raw":
        tensor = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
        return tensor.view(chunk.sizes)
    try:
        tensor = _load_in_place(data)
    except Exception:  # noqa: BLE001 - any surprise in the archive: torch.load reads it (or refuses it) as before
        tensor = _torch_load(chunk, data)
    if not torch.is_tensor(tensor) or tuple(tensor.shape) != chunk.sizes or tensor.dtype != dtype:
        raise InputError("a stored item does not hold the box the index declares", key=chunk.key,
                         expected=f"{tuple(chunk.sizes)} {dtype}",
                         actual=f"{tuple(tensor.shape)} {tensor.dtype}" if torch.is_tensor(tensor) else type(tensor))
    return tensor


def _planned_reads(chunks: Iterable[StoredChunk], read_bytes: int) -> list[tuple[str, list[StoredChunk]]]:
    """The preads that read ``chunks``: file by file (name order), each a run in offset order."""
    by_file: dict[str, list[StoredChunk]] = {}
    for chunk in chunks:
        by_file.setdefault(chunk.file, []).append(chunk)
    return [(name, run) for name in sorted(by_file)
            for run in _runs(sorted(by_file[name], key=lambda c: c.byte_offset), read_bytes)]


_END = object()  # the read-ahead thread's last queue entry


class ChunkReader:
    """Each of ``chunks`` with its data, file by file in offset order; every byte read once.

    One thread issues the preads ahead of the consumer, up to ``ahead_bytes`` of runs waiting
    (always at least one): ``pread`` releases the GIL, so the disk works while the consumer
    decodes, casts and writes the run before, and while the conversion's own checks still run
    (``engine.py`` starts the reader before them; nothing is written until they agree). Memory is
    bounded by ``ahead_bytes`` plus the run being consumed. ``close`` stops the thread (an
    abandoned conversion), and a read error reaches the consumer at the run that failed.
    """

    def __init__(self, index: CheckpointIndex, chunks: Iterable[StoredChunk], stats: ReadStats, *,
                 read_bytes: int = READ_BYTES, ahead_bytes: int = READ_AHEAD_BYTES) -> None:
        self.index, self.stats = index, stats
        self._reads = _planned_reads(chunks, read_bytes)
        self._ahead_bytes = ahead_bytes
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._read_all, name="nme-convert-reader", daemon=True)
        self._thread.start()

    def _read_all(self) -> None:
        fd, open_name = None, None
        try:
            for name, run in self._reads:
                first, length = run[0].byte_offset, run[-1].byte_offset + run[-1].length - run[0].byte_offset
                with self._cond:  # wait for room: at most ahead_bytes queued, and one run whatever its size
                    while not self._stopped and self._queue and self._queued_bytes + length > self._ahead_bytes:
                        self._cond.wait()
                    if self._stopped:
                        return
                if name != open_name:
                    if fd is not None:
                        os.close(fd)
                    fd, open_name = os.open(os.path.join(self.index.directory, name), os.O_RDONLY), name
                started = time.perf_counter()
                data = _pread(fd, length, first, name)
                self._put((run, data, time.perf_counter() - started), length)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(exc, 0)
        finally:
            if fd is not None:
                os.close(fd)
        self._put(_END, 0)

    def _put(self, entry, length: int) -> None:
        with self._cond:
            if self._stopped:
                return
            self._queue.append((entry, length))
            self._queued_bytes += length
            self._cond.notify_all()

    def _take(self):
        with self._cond:
            while not self._queue:
                if self._stopped:
                    raise RuntimeError("the checkpoint reader was closed before its last run was read")
                self._cond.wait()
            entry, length = self._queue.popleft()
            self._queued_bytes -= length
            self._cond.notify_all()
        return entry

    def __iter__(self) -> Iterator[tuple[StoredChunk, torch.Tensor]]:
        try:
            while (entry := self._take()) is not _END:
                if isinstance(entry, BaseException):
                    raise entry
                run, buffer, pread_seconds = entry
                self._count(run, pread_seconds)
                data, first = memoryview(buffer), run[0].byte_offset
                for chunk in run:
                    started = time.perf_counter()
                    start = chunk.byte_offset - first
                    tensor = _decode(chunk, data[start:start + chunk.length], self.index.tensors[chunk.key].dtype)
                    self.stats.items += 1
                    self.stats.seconds += time.perf_counter() - started
                    yield chunk, tensor
                del data, buffer
        finally:
            self.close()

    def _count(self, run: list[StoredChunk], pread_seconds: float) -> None:
        self.stats.bytes_read += run[-1].byte_offset + run[-1].length - run[0].byte_offset
        self.stats.reads += 1
        self.stats.seconds += pread_seconds

    def close(self) -> None:
        """Stop reading ahead and drop what was read but not consumed."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()


def read_chunks(index: CheckpointIndex, chunks: Iterable[StoredChunk], stats: ReadStats, *,
                read_bytes: int = READ_BYTES) -> Iterator[tuple[StoredChunk, torch.Tensor]]:
    """Each of ``chunks`` with its data, file by file in offset order; every byte read once
    (a :class:`ChunkReader` started now)."""
    return iter(ChunkReader(index, chunks, stats, read_bytes=read_bytes))
