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
* Headers, the index and the verify step read or write kilobytes per file: not modelled.
* **A new target.** The export writes into a directory that does not exist yet, as a job's
  end-of-training export does; ``overwrite="replace"`` also deletes the old checkpoint at publish,
  a cost of the filesystem's (0.12 s for 462 MB on the H200 host) that is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["AGREEMENTS", "TimeModel", "predict"]

AGREEMENTS = 9  # validate, validate replicas, digest, prepare, headers, write, verify, publish, result


@dataclass(frozen=True)
class TimeModel:
    node_bandwidth: float  # bytes/s one node writes, all its ranks together
    ranks_per_node: int
    checksum_bandwidth: float = 5e9  # bytes/s a rank checksums (CPU host memory; ~1e12 on an H200)
    collective_latency_s: float = 1e-3  # one small collective step (gloo over TCP)
    network_bandwidth: float = 1e9  # bytes/s of a rank's link for the coverage all-reduce
    cores_per_node: int | None = None  # None: one core per rank

    def __post_init__(self) -> None:
        from nemo_moe_export.errors import ExportInputError

        for name in ("node_bandwidth", "checksum_bandwidth", "network_bandwidth"):
            if not getattr(self, name) > 0:
                raise ExportInputError("bandwidth must be positive", key=name, expected="> 0 bytes/s",
                                       actual=getattr(self, name))
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
    validate_s = crowding * (simulation.plan_seconds + shares[len(shares) // 2])
    total = write_s + check_s + coverage_s + agree_s + validate_s
    return dict(seconds=round(total, 4), write_s=round(write_s, 4), replica_check_s=round(check_s, 4),
                coverage_s=round(coverage_s, 4), agreements_s=round(agree_s, 4), validate_compute_s=round(validate_s, 4), nodes=len(nodes),
                busiest_node_bytes=max(nodes.values()), assumptions=asdict(model))
