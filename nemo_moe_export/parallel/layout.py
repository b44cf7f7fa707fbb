"""Which ranks share a data-parallel, expert-parallel, expert-data-parallel, pipeline,
tensor-parallel or context-parallel group: :class:`RankGroup`, :class:`ParallelLayout`, read by
:func:`discover_layout` from Megatron, a named DeviceMesh or the plain world;
:func:`init_expert_parallel` creates Megatron's EP layout without Megatron; :func:`model_groups` lists
the process groups a model's collectives run on (docs/design.md#placement-rules).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nemo_moe_export.errors import InputError

__all__ = ["CP_DIM", "DENSE_DP_DIMS", "EP_DIM", "EXPERT_DP_DIMS", "MODEL_PARALLEL_DIMS", "PP_DIM", "TP_DIM",
           "ParallelLayout", "RankGroup", "discover_layout", "expert_parallel_groups", "init_expert_parallel",
           "model_groups"]

# Expert parallelism (EP) splits the routed experts of every MoE layer over the ranks of an EP
# group; the ranks that hold the *same* experts form an expert-data-parallel (expert-DP) group.
# Dense (non-expert) weights are replicated over the whole dense data-parallel (DP) group, which
# contains the EP groups (Megatron's layout, docs/design.md#placement-rules): on 4 ranks with EP=2 the EP
# groups are [0, 1], [2, 3], the expert-DP groups [0, 2], [1, 3] and the dense DP group [0..3].
#
# Why it matters: an EP forward is a collective over the EP group, so EP peers must run the same
# forwards in lockstep, while only expert-DP replicas may take disjoint batches (the MMLU hang).

# DeviceMesh dim names and what they mean to :func:`discover_layout`.
EP_DIM = "ep"
"""Expert-parallel dim: ranks along it hold different experts."""
EXPERT_DP_DIMS = ("edp", "ep_shard", "ep_replicate")
"""Expert-data-parallel dims (NeMo AutoModel calls the FSDP axis over experts ``ep_shard``)."""
DENSE_DP_DIMS = ("dp", "dp_replicate", "dp_shard", "dp_shard_cp")
"""Dense data-parallel dims (HSDP splits DP into ``dp_replicate`` x ``dp_shard``)."""
MODEL_PARALLEL_DIMS = ("tp", "pp", "cp", "etp")
"""Dims that split one model replica; they are in none of the three data groups."""
PP_DIM = "pp"
"""The pipeline dim: its ranks hold different stages of one replica (``ParallelLayout.pp``)."""
TP_DIM = "tp"
"""The tensor-parallel dim: its ranks hold different slices of the same layers (``ParallelLayout.tp``)."""
CP_DIM = "cp"
"""The context-parallel dim: its ranks hold the same weights and split each sequence (``ParallelLayout.cp``)."""


@dataclass(frozen=True)
class RankGroup:
    """This rank's place in one process group.

    ``ranks`` are the global ranks of the group in group-rank order, so ``ranks[rank]`` is this
    rank. ``group`` is None only for a group of one rank that no framework created (the EP group
    without expert parallelism, or everything in a single process): nothing to communicate.
    """

    rank: int
    size: int
    ranks: tuple[int, ...]
    group: Any = None

    @staticmethod
    def of(group: Any) -> "RankGroup":
        """Read rank, size and member ranks from an existing process group."""
        ranks = tuple(dist.get_process_group_ranks(group))
        return RankGroup(dist.get_rank(group), len(ranks), ranks, group)

    @staticmethod
    def alone() -> "RankGroup":
        """A group of just this rank (no process group needed)."""
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return RankGroup(0, 1, (me,), None)


@dataclass(frozen=True)
class ParallelLayout:
    """Dense data-parallel, expert-parallel, expert-data-parallel and pipeline groups of this rank.

    ``source`` says where the groups came from: ``"megatron"``, ``"device_mesh"``, ``"world"`` or
    ``"init_expert_parallel"``. Batches may differ only between ranks of different EP groups, i.e.
    shard data over ``edp`` (not ``dp``) whenever ``ep.size > 1``. ``pp`` is this rank's pipeline
    group (one rank per pipeline stage position, in stage order; alone without pipeline
    parallelism): its ranks hold different layers of one model replica, so they run every batch
    together and the export gathers the key catalogue over it (docs/design.md#pipeline-stages).
    ``tp`` (tensor parallel, sequence parallel rides on it) and ``cp`` (context parallel) also
    split one replica: their ranks take every batch together, and neither is in a data group.
    """

    dp: RankGroup
    ep: RankGroup
    edp: RankGroup
    source: str
    pp: RankGroup = field(default_factory=RankGroup.alone)
    tp: RankGroup = field(default_factory=RankGroup.alone)
    cp: RankGroup = field(default_factory=RankGroup.alone)

    def model_parallel_groups(self) -> dict[str, RankGroup]:
        """The groups that split one replica and have more than one rank, by name."""
        return {name: g for name, g in (("pp", self.pp), ("tp", self.tp), ("cp", self.cp)) if g.size > 1}


def discover_layout(device_mesh: Any = None, *, use_megatron: bool = True) -> ParallelLayout:
    """The DP / EP / expert-DP layout this process runs under, read from what set it up.

    Sources, in order:

    1. megatron-core ``parallel_state`` when ``use_megatron``, the module has been imported and
       ``model_parallel_is_initialized()``. (A module that was never imported cannot have been
       initialised, so this never pays megatron's multi-second import.)
    2. a named ``device_mesh``: ``"ep"`` is expert-parallel; ``"edp"``/``"ep_shard"``/
       ``"ep_replicate"`` are expert-data-parallel; ``"dp"``/``"dp_replicate"``/``"dp_shard"``/
       ``"dp_shard_cp"`` are dense data-parallel; ``"tp"``/``"pp"``/``"cp"``/``"etp"`` split one
       replica and belong to none. Dims are orthogonal, so expert-DP is every data-parallel dim
       other than ``"ep"`` and dense DP is every data-parallel dim including ``"ep"`` (EP sits
       inside dense DP, as in Megatron). Several dims of one kind are flattened into one group
       (``DeviceMesh._flatten``: a collective, every rank of the mesh must call this).
    3. the plain world: dense DP = expert-DP = world, EP = 1.
    """
    if use_megatron:
        layout = _megatron_layout()
        if layout is not None:
            return layout
    if device_mesh is not None:
        return _mesh_layout(device_mesh)
    return _world_layout()


def _megatron_layout() -> ParallelLayout | None:
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return ParallelLayout(
        dp=RankGroup.of(parallel_state.get_data_parallel_group()),
        ep=RankGroup.of(parallel_state.get_expert_model_parallel_group()),
        edp=RankGroup.of(parallel_state.get_expert_data_parallel_group()),
        source="megatron",
        pp=RankGroup.of(parallel_state.get_pipeline_model_parallel_group()),
        tp=RankGroup.of(parallel_state.get_tensor_model_parallel_group()),
        cp=RankGroup.of(parallel_state.get_context_parallel_group()),
    )


def _mesh_layout(mesh: Any) -> ParallelLayout:
    names = tuple(mesh.mesh_dim_names or ())
    known = (EP_DIM, *EXPERT_DP_DIMS, *DENSE_DP_DIMS, *MODEL_PARALLEL_DIMS)
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise InputError(
            "cannot tell the parallel layout from this DeviceMesh's dim names",
            expected=f"named dims among {list(known)}",
            actual=f"mesh_dim_names={names or None}",
            hint="name the mesh dims (init_device_mesh(..., mesh_dim_names=...)) with the names above",
        )
    data_dims = [n for n in names if n not in MODEL_PARALLEL_DIMS]
    return ParallelLayout(
        dp=_mesh_group(mesh, data_dims),
        ep=_mesh_group(mesh, [n for n in names if n == EP_DIM]),
        edp=_mesh_group(mesh, [n for n in data_dims if n != EP_DIM]),
        source="device_mesh",
        pp=_mesh_group(mesh, [n for n in names if n == PP_DIM]),
        tp=_mesh_group(mesh, [n for n in names if n == TP_DIM]),
        cp=_mesh_group(mesh, [n for n in names if n == CP_DIM]),
    )


def _mesh_group(mesh: Any, dims: list[str]) -> RankGroup:
    """The group spanning ``dims`` of ``mesh`` (flattened if several; alone if none)."""
    if not dims:
        return RankGroup.alone()
    sub = mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]._flatten("_".join(dims))
    return RankGroup.of(sub.get_group())


def _world_layout() -> ParallelLayout:
    if not (dist.is_available() and dist.is_initialized()):
        alone = RankGroup.alone()
        return ParallelLayout(dp=alone, ep=alone, edp=alone, source="world")
    world = RankGroup.of(dist.group.WORLD)
    return ParallelLayout(dp=world, ep=RankGroup.alone(), edp=world, source="world")


def expert_parallel_groups(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Megatron's rank lists for EP and expert-DP on a world of ``world_size`` (no TP/PP/CP).

    EP groups are contiguous blocks (``[0, 1], [2, 3]`` for EP=2 on 4 ranks), so EP peers sit close
    together (same node); expert-DP groups take one rank of each block (``[0, 2], [1, 3]``).
    """
    if ep_size < 1 or world_size < 1 or world_size % ep_size:
        raise InputError(
            "the expert-parallel size must divide the world size",
            expected=f"ep_size >= 1 dividing world_size={world_size}",
            actual=f"ep_size={ep_size}",
            hint="pick an EP size that divides the number of ranks (and the expert count)",
        )
    replicas = world_size // ep_size
    ep_groups = [[r * ep_size + i for i in range(ep_size)] for r in range(replicas)]
    edp_groups = [[r * ep_size + i for r in range(replicas)] for i in range(ep_size)]
    return ep_groups, edp_groups


def init_expert_parallel(ep_size: int, *, timeout_s: float = 600.0, backend: str | None = None) -> ParallelLayout:
    """Create EP, expert-DP and dense-DP groups on the world without Megatron; Megatron's layout.

    Every rank must call this (group creation is collective). All groups are created with
    ``timeout_s``: gloo honours it for every collective, so a stalled or missing EP peer makes the
    others raise after ``timeout_s`` instead of hanging. ``backend`` defaults to the world's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise InputError(
            "torch.distributed is not initialised",
            expected="dist.init_process_group(...) before init_expert_parallel",
            actual="no default process group",
        )
    world_size = dist.get_world_size()
    ep_groups, edp_groups = expert_parallel_groups(world_size, ep_size)
    timeout = timedelta(seconds=timeout_s)
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_groups, timeout=timeout, backend=backend)
    edp_group, _ = dist.new_subgroups_by_enumeration(edp_groups, timeout=timeout, backend=backend)
    dp_group = dist.new_group(ranks=list(range(world_size)), timeout=timeout, backend=backend)
    return ParallelLayout(
        dp=RankGroup.of(dp_group), ep=RankGroup.of(ep_group), edp=RankGroup.of(edp_group),
        source="init_expert_parallel",
    )


def model_groups(model: Any, layout: ParallelLayout) -> list[Any]:
    """The process groups a model's forwards and steps run collectives on, each once: the layout's
    (the pipeline group's transfers included) and those of the DeviceMeshes of its DTensor
    parameters (FSDP2's shard groups, the EP experts' mesh)."""
    groups = [g.group for g in (layout.dp, layout.ep, layout.edp, *layout.model_parallel_groups().values())
              if g.group is not None]
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    for mesh in meshes.values():
        groups.extend(mesh.get_all_groups())
    return list({g.group_name: g for g in groups}.values())
