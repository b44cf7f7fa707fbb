"""This process's place in the job: its rank and world size, its device, the default process group
(docs/design.md#coordination-protocol)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_export.errors import InputError

__all__ = ["DEVICES", "DistInfo", "dist_info", "init_distributed", "is_global_rank0", "resolve_device"]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    initialized: bool


def dist_info(group: Any = None) -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(group), dist.get_world_size(group), True)
    return DistInfo(0, 1, False)


def is_global_rank0() -> bool:
    """True on the world's rank 0, and in a process with no process group (the one rank there is)."""
    return dist_info().rank == 0


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(requested: str = "auto") -> str:
    """``"cuda"`` or ``"cpu"`` for this rank.

    ``auto`` takes one GPU per local rank when the machine has a GPU for every local rank
    (``LOCAL_WORLD_SIZE``, set by torchrun), else the CPU. ``cuda`` without enough GPUs is refused
    rather than silently run on the CPU.
    """
    if requested not in DEVICES:
        raise InputError("unknown device", key="parallel.device", expected=DEVICES, actual=repr(requested))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu" or (requested == "auto" and gpus < local_ranks):
        return "cpu"
    if gpus < local_ranks:
        raise InputError("not enough GPUs for one per local rank", key="parallel.device",
                         expected=f"{local_ranks} visible GPUs", actual=gpus,
                         hint="run fewer ranks per node, or parallel.device=cpu")
    return "cuda"


def init_distributed(device: str, timeout_s: float) -> None:
    """Initialise the default process group from torchrun's environment, if not yet done.

    NCCL when ranks run on GPUs (each on ``cuda:LOCAL_RANK``), gloo on CPUs. Coordination steps
    still run on a gloo side group (:class:`Coordinator`), which honours timeouts.
    """
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if device == "cuda":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                                **kwargs)
