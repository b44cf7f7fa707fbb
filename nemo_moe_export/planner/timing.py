"""The export-time model: one place, its assumptions stated (docs/design.md#planner).

Assumptions:

* **Writing dominates.** Ranks are placed on nodes in order (``rank // ranks_per_node``); a node
  writes at ``node_bandwidth`` bytes/s in total whatever the number of its ranks writing at once
  (the measured bandwidth of ``benchmarks/plan_bench.py --measure-bandwidth``: ``ranks_per_node``
  writers, each write + fsync, the way the export writes). The write step lasts as long as the
  busiest node: ``max over nodes of (bytes its ranks write) / node_bandwidth``.
* **The replica check is memory-bound.** Each rank reads the bytes it checksums at
  ``checksum_bandwidth`` (host memory on CPU ranks, device memory on GPUs); its all-reduces carry
  a few bytes per tensor and cost ``collective_latency_s`` per replica group and log2(W) steps.
* **Agreements cost latency only.** Each of the export's steps ends with one all-reduce of a
  status word (``parallel.Coordinator``): ``AGREEMENTS`` x ``collective_latency_s`` x log2(W),
  plus the validate step's coverage all-reduce (8 bytes per tensor) at ``network_bandwidth``.
* **Validate computes.** Every rank computes the plan and its write shares: the planner times the
  same code (``step.export_plan_of``, ``step.rank_write_shares``) in its own process; ranks
  sharing ``cores_per_node`` cores run that much slower (default: a core per rank).
* **Files and metadata.** Each file operation of the export's bookkeeping (a file created, written
  and fsynced: a header, ``config.json``, the index, the lock; a directory made or renamed and
  its parent fsynced) costs ``file_op_s``, measured by ``benchmarks/plan_bench.py`` the same way
  (a small file written and fsynced). The headers step lasts as long as the rank owning the most
  files takes, plus rank 0's ``METADATA_FILE_OPS``; the JSON work (stamping every header with the
  job's id, the index, verify's decode of every header) is the planner's timing of that same code.
* **A new target.** The export writes into a directory that does not exist yet, as a job's
  end-of-training export does; ``overwrite="replace"`` also deletes the old checkpoint at publish,
  a cost of the filesystem's (0.12 s for 462 MB on the H200 host) that is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["AGREEMENTS", "METADATA_FILE_OPS", "TimeModel", "predict"]

AGREEMENTS = 9  # validate, validate replicas, digest, prepare, headers, write, verify, publish, result
# Rank 0's small-file operations besides the headers (export/target.py): the lock, the partial
# directory, config.json, generation_config.json, the index, the sealing fsync of the directory,
# the publish rename and its parent's fsync.
METADATA_FILE_OPS = 8


@dataclass(frozen=True)
class TimeModel:
    node_bandwidth: float  # bytes/s one node writes, all its ranks together
    ranks_per_node: int
    checksum_bandwidth: float = 5e9  # bytes/s a rank checksums (CPU host memory; ~1e12 on an H200)
    collective_latency_s: float = 1e-3  # one small collective step (gloo over TCP)
    network_bandwidth: float = 1e9  # bytes/s of a rank's link for the coverage all-reduce
    cores_per_node: int | None = None  # None: one core per rank
    file_op_s: float = 2e-3  # a small file written and fsynced (a local disk; network filesystems: more)

    def __post_init__(self) -> None:
        from nemo_moe_export.errors import ExportInputError

        for name in ("node_bandwidth", "checksum_bandwidth", "network_bandwidth"):
            if not getattr(self, name) > 0:
                raise ExportInputError("bandwidth must be positive", key=name, expected="> 0 bytes/s",
                                       actual=getattr(self, name))
        if not self.file_op_s >= 0:
            raise ExportInputError("a file operation's time cannot be negative", key="file_op_s",
                                   expected=">= 0 seconds", actual=self.file_op_s)
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ExportInputError("ranks per node must be a positive integer", key="ranks_per_node",
                                   expected=">= 1", actual=self.ranks_per_node)


def predict(simulation, model: TimeModel) -> dict:
    """Predicted seconds of each part of the export of ``simulation`` (a ``simulate.Simulation``)."""
    world = simulation.world_size
    steps = max(1.0, math.log2(world)) if world > 1 else 0.0
    nodes: dict[int, int] = {}
    for r in simulation.ranks:
        nodes[r.rank // model.ranks_per_node] = nodes.get(r.rank // model.ranks_per_node, 0) + r.bytes
    write_s = max(nodes.values()) / model.node_bandwidth
    check_s = max((r.replica_bytes_checked / model.checksum_bandwidth
                   + r.replica_groups * steps * model.collective_latency_s) for r in simulation.ranks)
    coverage_s = (2 * simulation.coverage_allreduce_bytes / model.network_bandwidth + steps * model.collective_latency_s
                  if world > 1 else 0.0)
    agree_s = AGREEMENTS * steps * model.collective_latency_s
    crowding = max(1.0, model.ranks_per_node / (model.cores_per_node or model.ranks_per_node))
    # every rank runs the same code: the median simulated rank's time (a max would pick up noise)
    shares = sorted(r.share_seconds for r in simulation.ranks)
    validate_s = crowding * (simulation.plan_seconds + simulation.stamp_seconds + shares[len(shares) // 2])
    owned = max(r.files_owned for r in simulation.ranks)
    files_s = ((owned + METADATA_FILE_OPS) * model.file_op_s
               + crowding * (simulation.index_seconds + simulation.verify_seconds))
    total = write_s + check_s + coverage_s + agree_s + validate_s + files_s
    return dict(seconds=round(total, 4), write_s=round(write_s, 4), replica_check_s=round(check_s, 4),
                coverage_s=round(coverage_s, 4), agreements_s=round(agree_s, 4), validate_compute_s=round(validate_s, 4),
                files_and_metadata_s=round(files_s, 4), nodes=len(nodes),
                busiest_node_bytes=max(nodes.values()), assumptions=asdict(model))
