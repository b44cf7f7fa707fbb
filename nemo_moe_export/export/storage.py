"""Where the tensor bytes go: one storage writer per filesystem mode, chosen once per export.

A :class:`StorageWriter` is used in this order, on every rank (docs/design.md#export-plan-and-invariants):

1. ``writer_for(options, coordinator)`` once the inputs are validated (collective in local mode
   without ``writer_ranks``: the ranks compare host names);
2. ``file_owners(plan)``: ``{file: global rank}``, the same on every rank; each owner creates its
   files at full size and writes their headers;
3. ``write(plan, pieces, directory)``: this rank's primary pieces reach their planned offsets
   and every file written is fsynced; returns this rank's :class:`~.writer.WriteStats`.

:class:`SharedFilesystemWriter` (``filesystem="shared"``: Lustre, NFS, GPFS; every rank sees the
target) has every rank ``pwrite`` its own bytes. :class:`LocalFilesystemWriter`
(``filesystem="local"``: a disk only some ranks see) lets only the writer ranks touch the disk;
every other rank streams its byte runs to the owner of each file (``exchange.py``). Another
storage (an object store, say) is one more subclass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nemo_moe_export.adapters import HFShard
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.exchange import exchange_and_write, same_host_ranks
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan, assign_file_owners
from nemo_moe_export.export.writer import PieceWriter, WriteStats, write_pieces
from nemo_moe_export.parallel import Coordinator

__all__ = ["LocalFilesystemWriter", "SharedFilesystemWriter", "StorageWriter", "check_writer_ranks", "writer_for"]


class StorageWriter:
    """Puts a planned checkpoint's tensor bytes on disk. ``writer_ranks`` (global ranks) own the files."""

    def __init__(self, writer_ranks: Sequence[int], *, staging_bytes: int, writer_threads: int) -> None:
        self.writer_ranks = list(writer_ranks)
        self.staging_bytes = staging_bytes
        self.writer_threads = writer_threads

    def file_owners(self, plan: ExportPlan) -> dict[str, int]:
        """``{file: global rank}``: who creates each file and writes its header."""
        return assign_file_owners(plan, self.writer_ranks)

    def write(self, plan: ExportPlan, pieces: Iterable[HFShard], directory: str) -> WriteStats:
        raise NotImplementedError

    def batch_writer(self, plan: ExportPlan, directory: str, *, pinned: bool) -> PieceWriter | None:
        """A :class:`~.writer.PieceWriter` that takes this rank's pieces over several calls (kept
        open between them), or None where each write is a collective of its own (the caller then
        makes the same number of ``write`` calls on every rank)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(writer_ranks={self.writer_ranks})"


class SharedFilesystemWriter(StorageWriter):
    """Every rank sees the target: files are spread over all ranks, and each rank writes its own
    pieces in place (no bytes cross the network)."""

    def __init__(self, coordinator: Coordinator, *, staging_bytes: int, writer_threads: int) -> None:
        ranks = [coordinator.global_rank(r) for r in range(coordinator.world_size)]
        super().__init__(ranks, staging_bytes=staging_bytes, writer_threads=writer_threads)

    def write(self, plan: ExportPlan, pieces: Iterable[HFShard], directory: str) -> WriteStats:
        return write_pieces(plan, pieces, directory, staging_bytes=self.staging_bytes,
                            writer_threads=self.writer_threads)

    def batch_writer(self, plan: ExportPlan, directory: str, *, pinned: bool) -> PieceWriter:
        return PieceWriter(plan, directory, staging_bytes=self.staging_bytes, writer_threads=self.writer_threads,
                           pinned=pinned)


class LocalFilesystemWriter(StorageWriter):
    """Only ``writer_ranks`` see the target: they own every file; the other ranks send them their
    bytes in bounded chunks (``exchange.py``). ``write`` is a collective over the group."""

    def __init__(self, coordinator: Coordinator, writer_ranks: Sequence[int], *, staging_bytes: int,
                 writer_threads: int) -> None:
        super().__init__(writer_ranks, staging_bytes=staging_bytes, writer_threads=writer_threads)
        self.coordinator = coordinator

    def write(self, plan: ExportPlan, pieces: Iterable[HFShard], directory: str) -> WriteStats:
        return exchange_and_write(plan, pieces, directory, self.file_owners(plan), self.coordinator,
                                  staging_bytes=self.staging_bytes, writer_threads=self.writer_threads)


def check_writer_ranks(options: ExportOptions, coordinator: Coordinator) -> None:
    """Refuse ``writer_ranks`` that name no rank of the group (rank-local: same verdict everywhere)."""
    ranks, world = options.writer_ranks, max(coordinator.world_size, 1)
    if ranks is not None and (not ranks or any(not 0 <= r < world for r in ranks)):
        raise InputError("writer_ranks must name ranks of the group", key="writer_ranks",
                         expected=f"a non-empty subset of 0..{coordinator.world_size - 1}", actual=ranks)


def writer_for(options: ExportOptions, coordinator: Coordinator) -> StorageWriter:
    """The storage writer ``options.filesystem`` asks for. In local mode without ``writer_ranks``
    the writers are the ranks on rank 0's host, found by a collective: call it on every rank."""
    sizes = dict(staging_bytes=options.staging_bytes, writer_threads=options.writer_threads)
    if options.filesystem == "local":
        ranks = sorted(options.writer_ranks) if options.writer_ranks else same_host_ranks(coordinator)
        return LocalFilesystemWriter(coordinator, ranks, **sizes)
    return SharedFilesystemWriter(coordinator, **sizes)
