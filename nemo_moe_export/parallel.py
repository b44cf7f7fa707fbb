"""Process groups and hang-free coordination between ranks.

:class:`Coordinator` is how multi-step collective work (export, evaluation) agrees, step by step,
that every rank succeeded. Each ``agree(step, error)`` is a barrier under a timeout followed by an
exchange of statuses, so that:

* a rank that raised makes every rank raise the same error, naming the failing ranks and step;
* a rank that died or stalls makes every other rank raise within the timeout, naming the ranks
  that did not arrive and the step, instead of hanging.

Coordination runs on a gloo group (a side group when the default backend is NCCL), because gloo
honours timeouts on CPU and reports which ranks did not reach a monitored barrier.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Coordinator", "PeerError", "dist_info"]


class PeerError(RuntimeError):
    """A collective step failed on some rank, or some rank did not reach it in time."""

    def __init__(self, message: str, *, step: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    initialized: bool


def dist_info(group: Any = None) -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(group), dist.get_world_size(group), True)
    return DistInfo(0, 1, False)


class Coordinator:
    """Step-by-step agreement between the ranks of ``group`` (default: the world), under a timeout."""

    def __init__(self, group: Any = None, *, timeout_s: float = 600.0, name: str = "export") -> None:
        self.name = name
        self.timeout = timedelta(seconds=timeout_s)
        info = dist_info(group)
        self.rank, self.world_size = info.rank, info.world_size
        self.active = info.initialized and info.world_size > 1
        self.group = group
        if self.active and (group is None or dist.get_backend(group) != "gloo"):
            # A side gloo group: CPU collectives that honour our timeout, also beside NCCL. Like any
            # new_group, every rank of the world must construct the Coordinator.
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=self.timeout)

    def global_rank(self, group_rank: int) -> int:
        if not self.active:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def agree(self, step: str, error: BaseException | None = None) -> None:
        """Every rank calls this after ``step``; raises on every rank unless all succeeded in time."""
        if not self.active:
            if error is not None:
                raise PeerError(f"{self.name} step '{step}' failed: {error}", step=step, ranks=[self.rank]) from error
            return
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            raise PeerError(
                f"{self.name} step '{step}': not every rank arrived within {self.timeout.total_seconds():.0f} s "
                f"(seen from rank {self.rank}): {exc}",
                step=step, ranks=[],
            ) from error
        statuses: list[Any] = [None] * self.world_size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(statuses, mine, group=self.group)
        failed = [r for r, s in enumerate(statuses) if s is not None]
        if failed:
            ranks = [self.global_rank(r) for r in failed]
            details = "; ".join(f"rank {self.global_rank(r)}: {statuses[r]}" for r in failed)
            raise PeerError(f"{self.name} step '{step}' failed on ranks {ranks}: {details}",
                            step=step, ranks=ranks) from error

    def all_reduce_sum(self, tensor: Any) -> Any:
        """Sum a CPU tensor over the group (gloo, under the coordinator's timeout)."""
        if self.active:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]
