"""The ranks the planner simulates (docs/design.md#planner): this process as rank ``r`` of ``W``
under torch's fake process group, the meshes and placements ``shard_model`` gives each kind of
tensor on that rank, the rank's state dict of meta DTensors, and the checks that the layout fits the
world and the model. ``simulate.py`` runs the export's own code on each such rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from nemo_moe_export.errors import InputError
from nemo_moe_export.job.checks import check_strategy
from nemo_moe_export.parallel import expert_parallel_groups
from nemo_moe_export.placement import get_ep_expert_range
from nemo_moe_export.planner.model import MetaModel
from nemo_moe_export.planner.model_parallel import check_model_parallel, model_parallel_of

__all__ = ["Layout", "SimulatedCoordinator", "check_layout", "fake_world", "pp_size_of", "rank_state_dict",
           "stage_mesh"]


@contextmanager
def fake_world() -> Iterator[Any]:
    """Own the default process group for the simulation (refused if a real one exists); yields a
    function that makes this process rank ``r`` of ``W``."""
    if dist.is_initialized():
        raise InputError("the planner needs a process without a process group", key="torch.distributed",
                         expected="no default process group", actual=f"backend {dist.get_backend()}",
                         hint="run `nemo-moe-export plan` in its own process, not inside a job")

    def become(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    try:
        yield become
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class SimulatedCoordinator:
    """The parts of ``parallel.Coordinator`` that ``replica_sets`` reads, for a simulated rank of
    the world (a real Coordinator would open a gloo side group)."""

    rank: int
    world_size: int
    active: bool = True
    group: Any = None

    def global_rank(self, group_rank: int) -> int:
        return group_rank


class Layout:
    """The meshes and placements ``shard_model`` gives each kind of tensor, for the current rank.

    Under pipeline parallelism (``pp_size`` > 1) every mesh has "pp" as its outermost dim and the
    strategy shards inside a stage over the stage's ``S = W / pp_size`` ranks, on the stage's
    sub-mesh; a plain tensor is a ``Replicate()`` DTensor over those ranks (the "stage peers"), as
    the export's ``stages.stage_replicated`` makes it (docs/design.md#planner). Under TP / CP
    (``recorded``: each key's mesh dim names and placements, ``model_parallel.py``) a tensor goes on
    the sub-mesh of those names of the stage's ``("dp", "cp", "tp")`` root; EP still places the
    routed experts of the ``ep`` strategy."""

    def __init__(self, parallel: Any, world: int, recorded: Mapping[str, Any] | None = None) -> None:
        strategy, pp = parallel.strategy, pp_size_of(parallel)
        stage = world // pp  # ranks per stage (the whole world without pipeline stages)
        self.dense = self.experts = self.plain = None  # (mesh, placements); None: a plain tensor
        self.recorded, self.root = recorded, None
        self.meshes: dict[tuple[str, ...], Any] = {}
        if recorded is not None:  # TP / CP: torch's own placements (model_parallel.py), on this rank's meshes
            shape, names = model_parallel_of(parallel).root(stage)
            self.root = stage_mesh(pp, shape, names)
            self.meshes[names] = self.root
        elif strategy in ("fsdp", "hsdp", "ep_fsdp"):
            if strategy == "hsdp":
                mesh = stage_mesh(pp, (parallel.replicate, stage // parallel.replicate), ("dp_replicate", "dp_shard"))
                self.dense = (mesh, (Replicate(), Shard(0)))
            else:
                self.dense = (stage_mesh(pp, (stage,), ("dp_shard",)), (Shard(0),))
        if strategy in ("ep", "ep_fsdp"):
            ep, edp = parallel.ep_size, stage // parallel.ep_size
            if edp == 1:
                self.experts = (stage_mesh(pp, (ep,), ("ep",)), (Shard(0),))
            else:  # expert_parallel.expert_mesh: rows are the EP groups of parallel.expert_parallel_groups
                self.experts = (stage_mesh(pp, (edp, ep), ("edp", "ep")), (Replicate(), Shard(0)))
        else:
            self.experts = self.dense
        if pp > 1:
            self.plain = (stage_mesh(pp, (stage,), ("stage_peers",)), (Replicate(),))
        self.strategy = strategy

    def of(self, key: str, meta: MetaModel) -> tuple[Any, tuple] | None:
        if self.recorded is not None:
            if key in meta.experts and self.strategy == "ep":
                return self.experts
            where = self.recorded[key]
            return self.plain if where is None else (self._mesh(where[0]), where[1])
        if key in meta.experts:
            return self.experts
        if key in meta.buffers or self.strategy == "ep":
            return self.plain
        return self.dense

    def _mesh(self, names: tuple[str, ...]) -> Any:
        """The stage root's sub-mesh of ``names`` (FSDP2 over "dp" of a TP weight: ``("dp", "tp")``)."""
        if names not in self.meshes:
            self.meshes[names] = self.root[names if len(names) > 1 else names[0]]
        return self.meshes[names]


def pp_size_of(parallel: Any) -> int:
    return int(getattr(parallel, "pp_size", 1) or 1)


def stage_mesh(pp: int, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A mesh over one stage's ranks (``shape``, ``names``): the world's mesh without pipeline
    stages; else this rank's stage's block of ranks, as the sub-mesh of a mesh with "pp"
    outermost would be (the same ranks, coordinates and groups), without opening the groups of
    the other stages and of the "pp" dim, which no tensor is placed on (at 1,024 ranks, most of
    the simulation's time)."""
    if pp == 1:
        return init_device_mesh("cpu", shape, mesh_dim_names=names)
    size = math.prod(shape)
    first = dist.get_rank() // size * size
    return DeviceMesh("cpu", torch.arange(first, first + size).view(shape), mesh_dim_names=names)


def rank_state_dict(tensors: Mapping[str, torch.Tensor], meta: MetaModel, layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's state dict: meta DTensors of this rank's local shapes (one per distinct tensor
    layout; a DTensor is only read, so keys of equal shape and layout may share one)."""
    made: dict[tuple, torch.Tensor] = {}
    out = {}
    for key, tensor in tensors.items():
        where = layout.of(key, meta)
        if where is None:
            out[key] = tensor
            continue
        mesh, placements = where
        signature = (tuple(tensor.shape), tensor.dtype, id(mesh), placements)
        if signature not in made:
            local_shape, _ = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
            local = torch.empty(local_shape, dtype=tensor.dtype, device="meta")
            made[signature] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                 shape=tensor.shape, stride=tensor.stride())
        out[key] = made[signature]
    return out


def check_layout(parallel: Any, world: int, meta: MetaModel) -> None:
    """The layout fits the world and the model, as ``job/checks.py`` and ``shard_model`` require
    (under pipeline stages, the strategy's sizes divide the ranks of a stage)."""
    if not isinstance(world, int) or world < 1:
        raise InputError("the world size must be a positive integer", key="--world", expected=">= 1",
                         actual=world)
    check_strategy(parallel)
    pp = pp_size_of(parallel)
    if pp < 1 or world % pp:
        raise InputError("the pipeline size must divide the world", key="parallel.pp_size",
                         expected=f"a divisor of {world}", actual=pp)
    stage = world // pp
    check_strategy(parallel, stage)
    if parallel.strategy in ("ep", "ep_fsdp"):
        expert_parallel_groups(stage, parallel.ep_size)
        get_ep_expert_range(meta.adapter.num_experts, parallel.ep_size, 0)
    check_model_parallel(parallel, stage, " of a pipeline stage" if pp > 1 else "")
