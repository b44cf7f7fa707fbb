"""Local-filesystem mode: ranks that cannot see the target send their slices to the files' owners.

When the export target is on a disk only some ranks can see (a node-local NVMe, say), the files are
owned by those "writer" ranks and every other rank streams its bytes to the owner of each file.
Traffic goes in ``world - 1`` rounds; in round ``r`` rank ``i`` sends to ``i + r`` and receives from
``i - r`` (mod world), so every send has its matching receive posted at the same time and no round
can deadlock. Both sides cut each run into the same chunks of at most ``staging_bytes``, so
memory stays bounded on senders and receivers alike: nobody ever holds more than one outgoing and
one incoming chunk beyond its own shards.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import zip_longest

import torch
import torch.distributed as dist

from nemo_moe_export.adapters import HFShard
from nemo_moe_export.export.plan import ExportPlan
from nemo_moe_export.export.writer import OpenFiles, WriteStats, byte_runs, pwrite_all, write_pieces
from nemo_moe_export.parallel import Coordinator

__all__ = ["exchange_and_write", "same_host_ranks"]


@dataclass(frozen=True)
class _Run:
    file: str
    offset: int
    nbytes: int


_Outgoing = list[tuple[_Run, torch.Tensor, torch.dtype]]  # runs to one peer, with their sources


def same_host_ranks(coord: Coordinator, host: int = 0) -> list[int]:
    """Global ranks running on the same host as rank ``host`` (they see the same local disk).

    A collective over ``coord``'s group: every rank must call it.
    """
    names = coord.all_gather(socket.gethostname())
    return [coord.global_rank(r) for r, name in enumerate(names) if name == names[host]]


def _chunks(nbytes: int, staging_bytes: int) -> list[tuple[int, int]]:
    """``(byte_start, nbytes)`` cuts of a run, computed identically by sender and receiver.

    ``staging_bytes`` is a multiple of 8, so every cut falls on an element boundary.
    """
    return [(s, min(staging_bytes, nbytes - s)) for s in range(0, nbytes, staging_bytes)]


def exchange_and_write(
    plan: ExportPlan,
    pieces: Iterable[HFShard],
    directory: str,
    owners: dict[str, int],
    coord: Coordinator,
    *,
    staging_bytes: int,
    writer_threads: int,
) -> WriteStats:
    """Write the pieces of files this rank owns; send the rest to their owners; receive and write
    what peers send for files this rank owns. Returns this rank's disk-write stats.

    A collective over ``coord``'s group (an all-gather of what goes where, then the send rounds).
    """
    me = coord.global_rank(coord.rank)
    pieces = [p for p in pieces if p.primary and p.tensor.numel()]
    local = [p for p in pieces if owners[plan.tensors[p.key].file] == me]
    stats = (write_pieces(plan, local, directory, staging_bytes=staging_bytes, writer_threads=writer_threads)
             if local else WriteStats())
    outgoing = _outgoing_runs(plan, pieces, owners, coord)
    # Every rank learns what each peer will send it, so receives are posted for exactly those runs.
    manifests = coord.all_gather({dst: [run for run, _, _ in items] for dst, items in outgoing.items()})
    files = OpenFiles(directory)
    try:
        send_buf = torch.empty(staging_bytes, dtype=torch.uint8)
        recv_buf = torch.empty(staging_bytes, dtype=torch.uint8)
        for r in range(1, coord.world_size):
            dst, src = (coord.rank + r) % coord.world_size, (coord.rank - r) % coord.world_size
            incoming = manifests[src].get(coord.rank, [])
            _exchange_round(coord, dst, src, outgoing.get(dst, []), incoming, (send_buf, recv_buf), files, stats)
        files.fsync()
    finally:
        files.close()
    stats.files_touched |= files.names
    return stats


def _outgoing_runs(plan: ExportPlan, pieces: list[HFShard], owners: dict[str, int],
                   coord: Coordinator) -> dict[int, _Outgoing]:
    """What this rank sends, per destination (group rank): the byte runs of pieces of files that
    another rank owns, with their sources and stored dtypes."""
    outgoing: dict[int, _Outgoing] = {}
    group_rank_of = {coord.global_rank(r): r for r in range(coord.world_size)}
    for p in pieces:
        planned = plan.tensors[p.key]
        owner = group_rank_of[owners[planned.file]]
        if owner == coord.rank:
            continue
        for offset, source in byte_runs(p, planned):
            run = _Run(planned.file, offset, source.numel() * planned.element_size)
            outgoing.setdefault(owner, []).append((run, source, planned.dtype))
    return outgoing


def _exchange_round(coord: Coordinator, dst: int, src: int, sends: _Outgoing, receives: list[_Run],
                    buffers: tuple[torch.Tensor, torch.Tensor], files: OpenFiles, stats: WriteStats) -> None:
    """One round: send chunk after chunk to ``dst`` while receiving from ``src`` and writing what
    arrives; sender and receiver cut every run identically, so the chunks pair up."""
    send_buf, recv_buf = buffers
    staging_bytes = send_buf.numel()
    recvs = [(run.file, run.offset + start, n) for run in receives for start, n in _chunks(run.nbytes, staging_bytes)]
    for send, recv in zip_longest(_outgoing_chunks(sends, staging_bytes), recvs):
        works = []
        if send is not None:
            works.append(dist.isend(_stage(*send, send_buf), dst=coord.global_rank(dst), group=coord.group))
        if recv is not None:
            works.append(dist.irecv(recv_buf[:recv[2]], src=coord.global_rank(src), group=coord.group))
        for w in works:
            w.wait()
        if recv is not None:
            file, offset, n = recv
            stats.bytes_written += pwrite_all(files.fd(file), recv_buf[:n].numpy(), offset)
            stats.runs += 1


def _outgoing_chunks(items: _Outgoing, staging_bytes: int) -> Iterator[tuple[torch.Tensor, torch.dtype]]:
    """``(part, dtype)`` for every chunk of every outgoing run, cut exactly as the receiver cuts it.

    Lazy on purpose: a non-contiguous source (a transposed grouped-layout piece) is flattened once,
    when its run comes up, and dropped after its last chunk, so at most one run is ever copied.
    """
    for run, source, dtype in items:
        flat = source.reshape(-1)  # a view when contiguous
        for start, n in _chunks(run.nbytes, staging_bytes):
            yield flat[start // dtype.itemsize:(start + n) // dtype.itemsize], dtype


def _stage(part: torch.Tensor, dtype: torch.dtype, buf: torch.Tensor) -> torch.Tensor:
    """Cast/copy one chunk into ``buf``; return the bytes to send."""
    out = buf[: part.numel() * dtype.itemsize]
    out.view(dtype).copy_(part)
    return out
