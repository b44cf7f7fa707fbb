"""Write this rank's slices straight to their final offsets in the planned files.

Every FSDP2 ``Shard(0)`` piece (per-expert gate/up/down slices of the fused layout included) is one
contiguous byte range of its file; pieces sharded on an inner dim (EP + FSDP ``Shard(1)``) or
transposed (AutoModel grouped layout) become a few runs, one per leading index. A run whose
source is a CPU tensor already in the target dtype and contiguous is written straight from the
tensor's memory (``pwrite`` of a zero-copy byte view). Anything else (a dtype cast, a transposed
view, a GPU tensor) goes through a fixed set of staging buffers (pinned when the source is on a
GPU), so memory stays bounded; copies into one buffer overlap the disk write of another. Many
short runs, one per row of a piece, are handled a block of rows at a time (one ``copy_`` into a
staging buffer, one job that pwrites the block's rows) rather than one job per run.

After each write the page cache range is handed to ``posix_fadvise(DONTNEED)``, which starts
writeback early: the final ``fsync`` then has little left to do and dirty memory stays small.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import product

import torch

from nemo_moe_export.adapters import HFShard
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan, PlannedTensor

__all__ = ["OpenFiles", "PieceWriter", "WriteStats", "byte_runs", "pwrite_all", "write_headers", "write_pieces"]


@dataclass
class WriteStats:
    """What one rank wrote. ``copy_seconds`` is the time spent filling staging buffers (device to
    host copies and casts), ``write_seconds`` the time writer threads spent in ``pwrite``; when
    staging overlaps writing, both are close to ``seconds`` rather than adding up to it."""

    bytes_written: int = 0
    runs: int = 0
    staged_bytes: int = 0
    copy_seconds: float = 0.0
    write_seconds: float = 0.0
    seconds: float = 0.0
    writer_threads: int = 1
    exchanged_bytes: int = 0  # sent to TP peers so that each writes whole rows (row_exchange.py)
    files_touched: set[str] = field(default_factory=set)

    def as_io(self) -> dict[str, float]:
        """The numbers ``ExportResult.io`` reports (everything but the file names)."""
        return {k: v for k, v in asdict(self).items() if k != "files_touched"}


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
    j, strides = _run_dim(shape, gshape), _global_strides(gshape)
    esize = planned.element_size
    for lead in product(*(range(s) for s in shape[:j])):
        first = sum((offsets[d] + lead[d]) * strides[d] for d in range(j)) + offsets[j] * strides[j]
        source = piece.tensor[lead] if lead else piece.tensor
        yield planned.data_start + first * esize, source


def _run_dim(shape: tuple[int, ...], gshape: tuple[int, ...]) -> int:
    """The first dim ``j`` after which the box spans every dim of the global tensor fully: the box
    is one contiguous run per index of its dims before ``j``."""
    j = len(gshape) - 1
    while j > 0 and shape[j] == gshape[j]:
        j -= 1
    return j


def _global_strides(gshape: tuple[int, ...]) -> list[int]:
    """Elements per unit step of each dim in the global (row-major) tensor."""
    strides = [1] * len(gshape)
    for d in range(len(gshape) - 2, -1, -1):
        strides[d] = strides[d + 1] * gshape[d + 1]
    return strides


# Runs shorter than this, one per row of a piece, are written as rows (``_short_rows``): the per-run
# path's Python, tensor indexing and futures cost far more than a short pwrite (AutoModel's
# hidden-dim-sharded experts: 18,481 runs of 512 bytes per rank took 6.8 s of a 7.1 s export, of
# which copying took 1.0 s and pwrite 0.35 s).
_SHORT_RUN_BYTES = 64 << 10


def _short_rows(piece: HFShard, planned: PlannedTensor) -> tuple[int, int, int] | None:
    """``(first_offset, step, row_bytes)`` when ``piece``'s byte runs are its rows (``byte_runs``
    with ``j == 1``), more than one and each shorter than ``_SHORT_RUN_BYTES``: row ``r`` then goes
    to file offset ``first_offset + r * step``. None otherwise (the generic per-run path)."""
    shape, gshape = tuple(piece.tensor.shape), planned.shape
    if len(gshape) < 2 or shape[0] < 2 or _run_dim(shape, gshape) != 1:
        return None
    row_bytes = piece.tensor[0].numel() * planned.element_size
    if not 0 < row_bytes < _SHORT_RUN_BYTES:
        return None
    strides, esize = _global_strides(gshape), planned.element_size
    first = planned.data_start + (piece.offsets[0] * strides[0] + piece.offsets[1] * strides[1]) * esize
    return first, strides[0] * esize, row_bytes


def _byte_view(t: torch.Tensor):
    """Zero-copy uint8 numpy view of a contiguous CPU tensor (bf16 and 0-d included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def pwrite_all(fd: int, data, offset: int) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset + done}")
        done += n
    return done


_WRITE_SLICE = 2 << 20  # bytes per pwrite + fadvise: keeps writeback flowing without long inode holds
# Smaller writes skip the fadvise: it starts writeback so that dirty memory stays small, which
# kilobyte writes (FP8 scales, norms) do not need, while each call costs ~0.1 ms (2,000 FP8 scale
# writes took 0.3 s of fadvise on the H200 host, ahead of the first weight batch).
_FADVISE_MIN_BYTES = 1 << 20


def _write_and_release(fd: int, data, offset: int, fadvise: bool) -> int:
    """pwrite ``data`` at ``offset`` in slices; after each, hand the range to writeback.

    Measured here (4 ranks, 1.4 GB): per-run writes in 2-8 MiB slices with ``POSIX_FADV_DONTNEED`` run
    at the raw disk's speed, while coalescing runs into 64 MiB ``pwritev`` calls was 4-5x slower
    (long inode-lock holds and large synchronous writeback submissions under contention).
    """
    view = memoryview(data).cast("B")
    fadvise = fadvise and len(view) >= _FADVISE_MIN_BYTES
    for start in range(0, len(view), _WRITE_SLICE):
        part = view[start:start + _WRITE_SLICE]
        pwrite_all(fd, part, offset + start)
        if fadvise:
            os.posix_fadvise(fd, offset + start, len(part), os.POSIX_FADV_DONTNEED)
    return len(view)


@dataclass
class _Job:
    """One contiguous byte range of one file and the tensor whose bytes fill it."""

    fd: int
    offset: int
    source: torch.Tensor
    nbytes: int
    direct: bool  # CPU, contiguous, already in the target dtype: write the tensor's own memory


class _Pipeline:
    """Direct jobs are written from the tensors' own memory, in the caller's thread. Staged jobs
    are cast/copied into a free staging buffer chunk by chunk and written by ``threads`` writer
    threads, so the copy into one buffer overlaps the writes of the others; the fixed pool of
    ``threads + 1`` buffers bounds memory.
    """

    def __init__(self, staging_bytes: int, threads: int, pinned: bool, fadvise: bool) -> None:
        self.staging_bytes = staging_bytes
        self.fadvise = fadvise and hasattr(os, "posix_fadvise")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nme-writer")
        self._n_buffers, self._pinned = threads + 1, pinned
        self._buffers: list[torch.Tensor] = []  # allocated on first use: direct-only exports need none
        self._free: list[int] = []
        self._cond = threading.Condition()
        self._pending: deque[Future] = deque()
        self.copy_seconds = 0.0
        self.write_seconds = 0.0  # summed over writer threads (under _cond)

    def _write(self, fd: int, data, offset: int, buffer_id: int | None) -> int:
        started = time.perf_counter()
        try:
            return _write_and_release(fd, data, offset, self.fadvise)
        finally:
            self._done(started, buffer_id)

    def _write_rows(self, fd: int, rows, first: int, step: int, buffer_id: int | None) -> None:
        """pwrite row ``r`` of ``rows`` (a 2-D uint8 array, one run per row) at ``first + r * step``:
        one tight loop, no tensor or future per run. The rows are short, so no fadvise (as in
        ``_write_and_release``)."""
        started = time.perf_counter()
        try:
            for r, row in enumerate(rows):
                pwrite_all(fd, row, first + r * step)
        finally:
            self._done(started, buffer_id)

    def _done(self, started: float, buffer_id: int | None) -> None:
        """Count a write's time and hand its staging buffer (if any) back."""
        with self._cond:
            self.write_seconds += time.perf_counter() - started
            if buffer_id is not None:
                self._free.append(buffer_id)
                self._cond.notify()

    def _check(self) -> None:
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()  # re-raise a write error in the caller

    def _submit(self, write, *args) -> None:
        self._check()
        self._pending.append(self._pool.submit(write, *args))

    def write_direct(self, job: _Job) -> None:
        """Write a direct job from the tensor's own memory (a zero-copy byte view)."""
        self._check()
        self._write(job.fd, _byte_view(job.source), job.offset, None)

    def _take_buffer(self) -> int:
        with self._cond:
            if not self._free and len(self._buffers) < self._n_buffers:
                self._buffers.append(torch.empty(self.staging_bytes, dtype=torch.uint8, pin_memory=self._pinned))
                return len(self._buffers) - 1
            while not self._free:
                self._cond.wait(timeout=1.0)
                self._check()
            return self._free.pop()

    def write_staged(self, job: _Job, dtype: torch.dtype) -> None:
        """Copy (and cast) ``job.source`` into staging buffers chunk by chunk and write each chunk."""
        source, offset = job.source, job.offset
        esize = dtype.itemsize
        per_chunk = max(1, self.staging_bytes // esize)
        row_elems = source[0].numel() if source.dim() > 1 else 1
        flat = None
        if source.is_contiguous():
            flat = source.reshape(-1)
        elif row_elems > per_chunk:  # a single row bigger than a buffer: materialise that run
            flat = source.contiguous().reshape(-1)
        total, start = source.numel(), 0
        while start < total:
            buffer_id = self._take_buffer()
            if flat is not None:
                chunk = flat[start:start + min(per_chunk, total - start)]
            else:  # whole leading rows, so each chunk keeps the source's (strided) shape
                first = start // row_elems
                chunk = source[first:first + max(1, per_chunk // row_elems)]
            staged = self._stage(buffer_id, chunk, dtype)
            self._submit(self._write, job.fd, staged.numpy(), offset + start * esize, buffer_id)
            start += chunk.numel()

    def write_rows_direct(self, fd: int, rows: torch.Tensor, first: int, step: int) -> None:
        """Write row ``r`` of ``rows`` (CPU, in the stored dtype, each row contiguous) at
        ``first + r * step`` from the tensor's own memory, in the caller's thread."""
        self._check()
        n, row_elems = rows.shape[0], rows[0].numel()
        # one zero-copy (rows, row bytes) view: each row is contiguous, rows are stride(0) apart
        flat_rows = rows.as_strided((n, row_elems), (rows.stride(0), 1))
        self._write_rows(fd, flat_rows.view(torch.uint8).numpy(), first, step, None)

    def write_rows_staged(self, fd: int, rows: torch.Tensor, dtype: torch.dtype, first: int, step: int,
                          row_bytes: int) -> None:
        """Copy (and cast) as many whole rows as fit one staging buffer in one ``copy_``, then write
        that block's rows in one writer-thread job; ``row_bytes <= staging_bytes``."""
        per_block = self.staging_bytes // row_bytes
        for r0 in range(0, rows.shape[0], per_block):
            block = rows[r0:r0 + per_block]
            buffer_id = self._take_buffer()
            staged = self._stage(buffer_id, block, dtype)
            self._submit(self._write_rows, fd, staged.view(-1, row_bytes).numpy(), first + r0 * step, step,
                         buffer_id)

    def _stage(self, buffer_id: int, chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Copy (and cast) ``chunk`` into the start of staging buffer ``buffer_id``; its bytes."""
        staged = self._buffers[buffer_id][: chunk.numel() * dtype.itemsize]
        copy_started = time.perf_counter()
        staged.view(dtype).view(chunk.shape).copy_(chunk, non_blocking=chunk.is_cuda)
        if chunk.is_cuda:
            torch.cuda.current_stream(chunk.device).synchronize()
        self.copy_seconds += time.perf_counter() - copy_started
        return staged

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


class OpenFiles:
    """The planned files this rank writes into, opened once each on first use; ``close`` fsyncs
    (when asked) and closes them all."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fds: dict[str, int] = {}

    def fd(self, name: str) -> int:
        if name not in self._fds:
            self._fds[name] = os.open(os.path.join(self.directory, name), os.O_WRONLY)
        return self._fds[name]

    @property
    def names(self) -> set[str]:
        return set(self._fds)

    def fsync(self) -> None:
        for fd in self._fds.values():
            os.fsync(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)


def write_headers(plan: ExportPlan, directory: str, file_names: Iterable[str]) -> None:
    """Create the named files at their full planned size and write their headers."""
    by_name = {f.name: f for f in plan.files}
    for name in file_names:
        planned = by_name[name]
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, planned.size)
            pwrite_all(fd, planned.header, 0)
        finally:
            os.close(fd)


class PieceWriter:
    """Writes primary pieces to their planned places over one or more :meth:`write` calls, through
    one pipeline and one set of open files; :meth:`close` drains the pipeline, fsyncs every file
    written once and returns the stats. A writer fed batch after batch (the FP8 export's) thus
    keeps its staging buffers, its threads and its files between batches, and the next batch is
    made while the writer threads still write the last one's staged bytes."""

    def __init__(self, plan: ExportPlan, directory: str, *, staging_bytes: int = ExportOptions.staging_bytes,
                 writer_threads: int = ExportOptions.writer_threads, fadvise: bool = True,
                 pinned: bool = False) -> None:
        self.plan = plan
        self.started = time.perf_counter()
        self.stats = WriteStats(writer_threads=writer_threads)
        self.files = OpenFiles(directory)
        self.pipeline = _Pipeline(staging_bytes, writer_threads, pinned and torch.cuda.is_available(), fadvise)

    def write(self, pieces: Iterable[HFShard]) -> None:
        for piece in pieces:
            if piece.primary and piece.tensor.numel():
                _write_piece(self.pipeline, self.files, piece, self.plan.tensors[piece.key], self.stats)

    def close(self) -> WriteStats:
        try:
            self.pipeline.drain()
            self.files.fsync()
        finally:
            self.pipeline.close()
            self.files.close()
        stats = self.stats
        stats.files_touched = self.files.names
        stats.copy_seconds = round(self.pipeline.copy_seconds, 4)
        stats.write_seconds = round(self.pipeline.write_seconds, 4)
        stats.seconds = round(time.perf_counter() - self.started, 4)
        return stats

    def abandon(self) -> None:
        """Stop after an error: the pipeline's threads end and the files close, nothing is fsynced
        (a second write error met while draining is dropped: the first one is what is raised)."""
        try:
            self.pipeline.close()
        except Exception:  # noqa: BLE001 - the caller re-raises the original error
            pass
        finally:
            self.files.close()


def write_pieces(
    plan: ExportPlan,
    pieces: Iterable[HFShard],
    directory: str,
    *,
    staging_bytes: int = ExportOptions.staging_bytes,
    writer_threads: int = ExportOptions.writer_threads,
    fadvise: bool = True,
) -> WriteStats:
    """Write every primary piece to its planned place; fsync every file written. Returns stats.

    The buffer and thread defaults are ``ExportOptions``' own (docs/design.md#options-and-defaults).
    """
    pieces = list(pieces)
    pinned = any(p.tensor.is_cuda for p in pieces)
    writer = PieceWriter(plan, directory, staging_bytes=staging_bytes, writer_threads=writer_threads,
                         fadvise=fadvise, pinned=pinned)
    try:
        writer.write(pieces)
    except BaseException:
        writer.abandon()
        raise
    return writer.close()


def _write_piece(pipeline: _Pipeline, files: OpenFiles, piece: HFShard, planned: PlannedTensor,
                 stats: WriteStats) -> None:
    """Hand each byte run of ``piece`` to the pipeline: straight from the tensor's memory when it is
    a contiguous CPU tensor already in the stored dtype, through a staging buffer otherwise.

    Many short runs, one per row (``_short_rows``), go to the pipeline as whole rows instead of one
    job per run; ``stats`` count them exactly as the per-run path would (the planner predicts them).
    """
    rows = _short_rows(piece, planned)
    if rows is not None and rows[2] <= pipeline.staging_bytes:  # a staged block holds at least one row
        first, step, row_bytes = rows
        fd, n = files.fd(planned.file), piece.tensor.shape[0]
        stats.runs += n
        stats.bytes_written += n * row_bytes
        # every row has the same strides, so row 0 decides what the per-run path decides per run
        if not piece.tensor.is_cuda and piece.tensor.dtype == planned.dtype and piece.tensor[0].is_contiguous():
            pipeline.write_rows_direct(fd, piece.tensor, first, step)
        else:
            stats.staged_bytes += n * row_bytes
            pipeline.write_rows_staged(fd, piece.tensor, planned.dtype, first, step, row_bytes)
        return
    for offset, source in byte_runs(piece, planned):
        nbytes = source.numel() * planned.element_size
        job = _Job(files.fd(planned.file), offset, source, nbytes,
                   direct=not source.is_cuda and source.dtype == planned.dtype and source.is_contiguous())
        stats.runs += 1
        stats.bytes_written += nbytes
        if job.direct:
            pipeline.write_direct(job)
        else:
            stats.staged_bytes += nbytes
            pipeline.write_staged(job, planned.dtype)
