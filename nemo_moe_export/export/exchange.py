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

import os
from collections.abc import Iterable
from itertools import zip_longest
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_moe_export.adapters.engine import HFShard
from nemo_moe_export.export.plan import ExportPlan
from nemo_moe_export.export.writer import WriteStats, _pwrite_all, byte_runs, write_pieces
from nemo_moe_export.parallel import Coordinator

__all__ = ["exchange_and_write", "same_host_ranks"]


@dataclass(frozen=True)
class _Run:
    file: str
    offset: int
    nbytes: int


def same_host_ranks(coord: Coordinator, host: int = 0) -> list[int]:
    """Global ranks running on the same host as rank ``host`` (they see the same local disk)."""
    import socket

    names: list[str | None] = [None] * coord.world_size
    if coord.active:
        dist.all_gather_object(names, socket.gethostname(), group=coord.group)
    else:
        names = [socket.gethostname()]
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
    staging_bytes: int = 64 << 20,
    writer_threads: int = 1,
) -> WriteStats:
    """Write the pieces of files this rank owns; send the rest to their owners; receive and write
    what peers send for files this rank owns. Returns this rank's disk-write stats."""
    me = coord.rank
    pieces = [p for p in pieces if p.primary and p.tensor.numel()]
    local = [p for p in pieces if owners[plan.tensors[p.key].file] == coord.global_rank(me)]
    stats = (write_pieces(plan, local, directory, staging_bytes=staging_bytes, writer_threads=writer_threads)
             if local else WriteStats())

    # What this rank sends, per destination (group rank), as runs with their sources.
    outgoing: dict[int, list[tuple[_Run, torch.Tensor, torch.dtype]]] = {}
    group_rank_of = {coord.global_rank(r): r for r in range(coord.world_size)}
    for p in pieces:
        planned = plan.tensors[p.key]
        owner = group_rank_of[owners[planned.file]]
        if owner == me:
            continue
        for offset, source in byte_runs(p, planned):
            run = _Run(planned.file, offset, source.numel() * planned.element_size)
            outgoing.setdefault(owner, []).append((run, source, planned.dtype))
    manifests: list[dict[int, list[_Run]]] = [{}] * coord.world_size
    mine = {dst: [run for run, _, _ in items] for dst, items in outgoing.items()}
    dist.all_gather_object(manifests, mine, group=coord.group)

    fds: dict[str, int] = {}
    send_buf = torch.empty(staging_bytes, dtype=torch.uint8)
    recv_buf = torch.empty(staging_bytes, dtype=torch.uint8)
    try:
        for r in range(1, coord.world_size):
            dst, src = (me + r) % coord.world_size, (me - r) % coord.world_size
            sends = _outgoing_chunks(outgoing.get(dst, []), staging_bytes)
            recvs = [(run.file, run.offset + start, n) for run in manifests[src].get(me, [])
                     for start, n in _chunks(run.nbytes, staging_bytes)]
            for send, recv in zip_longest(sends, recvs):
                works = []
                if send is not None:
                    works.append(dist.isend(_stage(*send, send_buf), dst=coord.global_rank(dst), group=coord.group))
                if recv is not None:
                    file, offset, n = recv
                    works.append(dist.irecv(recv_buf[:n], src=coord.global_rank(src), group=coord.group))
                for w in works:
                    w.wait()
                if recv is not None:
                    if file not in fds:
                        fds[file] = os.open(os.path.join(directory, file), os.O_WRONLY)
                    stats.bytes_written += _pwrite_all(fds[file], recv_buf[:n].numpy(), offset)
                    stats.runs += 1
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    stats.files_touched |= set(fds)
    return stats


def _outgoing_chunks(items, staging_bytes: int):
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
