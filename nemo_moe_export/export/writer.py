"""Write this rank's slices straight to their final offsets in the planned files.

Every FSDP2 ``Shard(0)`` piece (per-expert gate/up/down slices of the fused layout included) is one
contiguous byte range of its file; pieces sharded on an inner dim (EP + FSDP ``Shard(1)``) or
transposed (AutoModel grouped layout) become a few runs, one per leading index. A run whose
source is a CPU tensor already in the target dtype and contiguous is written straight from the
tensor's memory (``pwrite`` of a zero-copy byte view). Anything else (a dtype cast, a transposed
view, a GPU tensor) goes through a fixed set of staging buffers (pinned when the source is on a
GPU), so memory stays bounded; copies into one buffer overlap the disk write of another.

After each write the page cache range is handed to ``posix_fadvise(DONTNEED)``, which starts
writeback early: the final ``fsync`` then has little left to do and dirty memory stays small.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import product

import torch

from nemo_moe_export.adapters.engine import HFShard
from nemo_moe_export.export.plan import ExportPlan, PlannedTensor

__all__ = ["WriteStats", "byte_runs", "write_headers", "write_pieces"]


@dataclass
class WriteStats:
    bytes_written: int = 0
    runs: int = 0
    staged_bytes: int = 0
    files_touched: set[str] = field(default_factory=set)


def byte_runs(piece: HFShard, planned: PlannedTensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(file_offset, source)`` pairs covering ``piece``: each source's row-major bytes are one run.

    The box is contiguous in the file from the first dim ``j`` after which it spans every dim
    fully; one run per index of the dims before ``j``.
    """
    shape, offsets, gshape = tuple(piece.tensor.shape), piece.offsets, planned.shape
    if piece.tensor.numel() == 0:
        return
    if not gshape:  # 0-dim tensor
        yield planned.data_start, piece.tensor.reshape(1)
        return
    j = len(gshape) - 1
    while j > 0 and shape[j] == gshape[j]:
        j -= 1
    # Elements per unit step of each dim in the global (row-major) tensor.
    strides = [1] * len(gshape)
    for d in range(len(gshape) - 2, -1, -1):
        strides[d] = strides[d + 1] * gshape[d + 1]
    esize = planned.element_size
    for lead in product(*(range(s) for s in shape[:j])):
        first = sum((offsets[d] + lead[d]) * strides[d] for d in range(j)) + offsets[j] * strides[j]
        source = piece.tensor[lead] if lead else piece.tensor
        yield planned.data_start + first * esize, source


def _byte_view(t: torch.Tensor):
    """Zero-copy uint8 numpy view of a contiguous CPU tensor (bf16 and 0-d included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _pwrite_all(fd: int, data, offset: int) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset + done}")
        done += n
    return done


class _Pipeline:
    """One writer thread fed by the caller; a fixed pool of staging buffers bounds memory."""

    def __init__(self, staging_bytes: int, n_buffers: int, pinned: bool, fadvise: bool) -> None:
        self.staging_bytes = staging_bytes
        self.fadvise = fadvise and hasattr(os, "posix_fadvise")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nme-writer")
        self._buffers = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(n_buffers)]
        self._free = list(range(n_buffers))
        self._cond = threading.Condition()
        self._pending: list[Future] = []

    def _write(self, fd: int, data, offset: int, buffer_id: int | None, keepalive: torch.Tensor | None) -> int:
        try:
            n = _pwrite_all(fd, data, offset)
            if self.fadvise:
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
            return n
        finally:
            del keepalive
            if buffer_id is not None:
                with self._cond:
                    self._free.append(buffer_id)
                    self._cond.notify()

    def _check(self) -> None:
        done = [f for f in self._pending if f.done()]
        for f in done:
            f.result()  # re-raise a write error in the caller
        self._pending = [f for f in self._pending if not f.done()]

    def submit_direct(self, fd: int, source: torch.Tensor, offset: int) -> None:
        self._check()
        self._pending.append(self._pool.submit(self._write, fd, _byte_view(source), offset, None, source))

    def submit_staged(self, fd: int, source: torch.Tensor, offset: int, dtype: torch.dtype) -> None:
        """Copy (and cast) ``source`` into staging buffers chunk by chunk and write each chunk."""
        esize = torch.empty((), dtype=dtype).element_size()
        per_chunk = max(1, self.staging_bytes // esize)
        rows = source.reshape(-1) if source.is_contiguous() else None
        if rows is None and source.dim() > 0:
            row_elems = source[0].numel() if source.dim() > 1 else 1
            if row_elems > per_chunk:  # a single row bigger than a buffer: materialise it
                rows = source.contiguous().reshape(-1)
        total = source.numel()
        start = 0
        while start < total:
            self._check()
            with self._cond:
                while not self._free:
                    self._cond.wait(timeout=1.0)
                    self._check()
                buffer_id = self._free.pop()
            buf = self._buffers[buffer_id]
            if rows is not None:
                n = min(per_chunk, total - start)
                chunk = rows[start:start + n]
            else:  # non-contiguous source: whole leading rows, so each chunk keeps its shape
                row_elems = source[0].numel() if source.dim() > 1 else 1
                n_rows = max(1, per_chunk // row_elems)
                first = start // row_elems
                chunk = source[first:first + n_rows]
                n = chunk.numel()
            staged = buf[: n * esize].view(dtype).view(chunk.shape)
            staged.copy_(chunk, non_blocking=chunk.is_cuda)
            if chunk.is_cuda:
                torch.cuda.current_stream(chunk.device).synchronize()
            self._pending.append(
                self._pool.submit(self._write, fd, buf[: n * esize].numpy(), offset + start * esize, buffer_id, None)
            )
            start += n

    def drain(self) -> None:
        for f in self._pending:
            f.result()
        self._pending = []

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


def write_headers(plan: ExportPlan, directory: str, file_names: Iterable[str]) -> None:
    """Create the named files at their full planned size and write their headers."""
    by_name = {f.name: f for f in plan.files}
    for name in file_names:
        planned = by_name[name]
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, planned.size)
            _pwrite_all(fd, planned.header, 0)
        finally:
            os.close(fd)


def write_pieces(
    plan: ExportPlan,
    pieces: Iterable[HFShard],
    directory: str,
    *,
    staging_bytes: int = 64 << 20,
    n_buffers: int = 2,
    fadvise: bool = True,
) -> WriteStats:
    """Write every primary piece to its planned place; fsync every file written. Returns stats."""
    stats = WriteStats()
    fds: dict[str, int] = {}
    pieces = [p for p in pieces if p.primary and p.tensor.numel()]
    pinned = torch.cuda.is_available() and any(p.tensor.is_cuda for p in pieces)
    pipeline = _Pipeline(staging_bytes, n_buffers, pinned, fadvise)
    try:
        for piece in pieces:
            planned = plan.tensors[piece.key]
            if planned.file not in fds:
                fds[planned.file] = os.open(os.path.join(directory, planned.file), os.O_WRONLY)
            fd = fds[planned.file]
            for offset, source in byte_runs(piece, planned):
                stats.runs += 1
                nbytes = source.numel() * planned.element_size
                stats.bytes_written += nbytes
                if not source.is_cuda and source.dtype == planned.dtype and source.is_contiguous():
                    pipeline.submit_direct(fd, source, offset)
                else:
                    stats.staged_bytes += nbytes
                    pipeline.submit_staged(fd, source, offset, planned.dtype)
        pipeline.drain()
        for fd in fds.values():
            os.fsync(fd)
    finally:
        pipeline.close()
        for fd in fds.values():
            os.close(fd)
    stats.files_touched = set(fds)
    return stats
