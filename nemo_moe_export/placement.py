"""Which part of a tensor, and which experts, a rank holds.

Two rules exist in the wild and they must never be confused:

* FSDP2 ``Shard(0)`` and ``distribute_tensor`` split dim 0 like ``torch.chunk`` and pad with empty
  trailing shards: 5 experts on 4 ranks -> [2, 2, 1, 0], 64 on 24 -> 21 ranks of 3, one of 1, two
  of 0. :func:`get_sharded_expert_range` labels that layout.
* Expert parallelism (NeMo AutoModel, Megatron) requires ``n_experts % ep == 0`` and gives each EP
  rank one contiguous block. :func:`get_ep_expert_range` labels that layout.

A "balanced" split (first ``n % W`` ranks get one extra) is neither; code that assumes it passes
small tests and fails on real shapes (60 experts on 8 ranks). Both helpers here *describe* a layout
that already exists; they never choose a placement. For a real tensor prefer
:func:`local_expert_range` / :func:`local_box`, which read the tensor's own mesh and placements and
so cannot disagree with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nemo_moe_export.errors import InputError
from nemo_moe_export.parallel import CP_DIM, TP_DIM

__all__ = [
    "LocalBox",
    "get_ep_expert_range",
    "get_sharded_expert_range",
    "local_box",
    "local_expert_range",
    "replica_coordinate",
    "unsplit_model_parallel_dims",
]


def get_sharded_expert_range(n_experts: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """Experts ``[start, end)`` held by shard ``shard_index`` of an FSDP2/DTensor ``Shard(0)`` split.

    Equal to ``torch.chunk`` for every input: leading shards hold ``ceil(n / num_shards)`` experts,
    then the remainder, then empty shards (``start == end == n_experts``, as DTensor reports them).
    This labels an existing layout; do not use it to decide where experts should go.
    """
    if n_experts < 0 or num_shards < 1 or not 0 <= shard_index < num_shards:
        raise InputError(
            "invalid shard arguments",
            expected="n_experts >= 0, num_shards >= 1, 0 <= shard_index < num_shards",
            actual=f"n_experts={n_experts}, num_shards={num_shards}, shard_index={shard_index}",
        )
    chunk = -(-n_experts // num_shards)  # ceil division, as torch.chunk does
    start = min(shard_index * chunk, n_experts)
    end = min(start + chunk, n_experts)
    return start, end


def get_ep_expert_range(n_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """Experts ``[start, end)`` owned by expert-parallel rank ``ep_rank``: one contiguous block each.

    Expert parallelism in Megatron and NeMo AutoModel requires ``n_experts % ep_size == 0``; this
    helper asserts it rather than inventing a layout no framework uses. It labels an existing
    layout; it never chooses one.
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise InputError(
            "invalid expert-parallel arguments",
            expected="ep_size >= 1 and 0 <= ep_rank < ep_size",
            actual=f"ep_size={ep_size}, ep_rank={ep_rank}",
        )
    if n_experts % ep_size:
        raise InputError(
            "expert parallelism needs the expert count to divide by the EP size",
            expected=f"n_experts % ep_size == 0 (ep_size={ep_size})",
            actual=f"n_experts={n_experts}",
            hint="choose an EP size that divides the expert count, or shard experts with FSDP instead",
        )
    per_rank = n_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


@dataclass(frozen=True)
class LocalBox:
    """This rank's part of one tensor, as a box in the global tensor.

    ``local`` is the rank's own tensor (never a copy); it spans ``offsets[d] : offsets[d] +
    local.shape[d]`` of every dim ``d`` of a tensor of ``global_shape``. The ranks holding the same
    box (replicas under HSDP or expert-DP, the TP / CP peers of a weight TP leaves whole, or plain
    tensors held by every rank) number
    ``replicas``; this rank is holder ``replica`` of them (``0 <= replica < replicas``, the same
    numbering on every holder). ``primary`` is True on holder 0 only, so a writer that writes only
    primaries writes every byte once (docs/design.md#placement-rules).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: torch.Tensor
    primary: bool
    replica: int = 0
    replicas: int = 1

    @property
    def is_empty(self) -> bool:
        return self.local.numel() == 0


def local_box(tensor: torch.Tensor, *, key: str = "?", plain_replica: tuple[int, int] = (0, 1)) -> LocalBox:
    """Read the box a rank holds straight from a DTensor's mesh and placements.

    A plain tensor is taken as the whole tensor, held by every rank of some group (FSDP2 buffers,
    the dense part under EP): ``plain_replica`` is this rank's ``(index, count)`` in that group
    (default: this rank alone).
    """
    if not isinstance(tensor, DTensor):
        replica, replicas = plain_replica
        return LocalBox(tuple(tensor.shape), (0,) * tensor.dim(), tensor, replica == 0, replica, replicas)

    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise InputError(
            "this rank is not part of the tensor's device mesh",
            key=key,
            expected=f"a rank in {mesh.mesh.flatten().tolist()}",
            actual="a rank outside it",
            hint="call the adapter only on ranks of the mesh the model was sharded over",
        )
    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise InputError(
                "partial (pending-reduction) tensors cannot be converted",
                key=key,
                expected="Shard or Replicate placements",
                actual=f"{placement} on mesh dim {dim}",
                hint="reduce the tensor (full_tensor() or redistribute to Replicate) first",
            )
    local = tensor.to_local()
    local_shape, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    if tuple(local.shape) != tuple(local_shape):
        raise InputError(
            "local shard shape disagrees with the DTensor's placements",
            key=key,
            expected=f"{tuple(local_shape)} at offset {tuple(offsets)} for {placements}",
            actual=tuple(local.shape),
            hint="the tensor was likely built with a padded or balanced split; rebuild it with "
            "distribute_tensor/fully_shard or DTensor.from_local(..., shape=, stride=)",
        )
    replica, replicas = replica_coordinate(mesh, placements, coordinate)
    for root, dim in unsplit_model_parallel_dims(mesh):  # TP / CP copies: the innermost replica digits
        replica, replicas = replica * root.size(dim) + root.get_coordinate()[dim], replicas * root.size(dim)
    return LocalBox(tuple(tensor.shape), tuple(offsets), local, replica == 0, replica, replicas)


REPLICATING_DIMS = (TP_DIM, CP_DIM)
"""Root-mesh dims whose ranks split one model replica but hold the same copy of every weight they
do not split (docs/design.md#tensor-and-context-parallelism-torch-tp)."""


def unsplit_model_parallel_dims(mesh: Any) -> list[tuple[Any, int]]:
    """``(root mesh, dim)`` of each tensor-parallel (``"tp"``) or context-parallel (``"cp"``) dim of
    ``mesh``'s root mesh that ``mesh`` does not span: a DTensor on ``mesh`` is then the same on
    every rank along that dim (the weights TP leaves whole under TP x FSDP2, every weight under CP),
    so those ranks are its replicas. Read from the mesh alone (no collective): a dim counts only
    when none of this rank's peers along it is in ``mesh`` (a mesh that flattens ``"cp"`` into its
    FSDP dim, as torchtitan's ``dp_shard_cp``, already splits the weights over those ranks)."""
    root = mesh._get_root_mesh()
    if root is mesh or not root.mesh_dim_names:
        return []
    coordinate = root.get_coordinate()
    if coordinate is None:
        return []
    members = set(mesh.mesh.flatten().tolist())
    found = []
    for dim, name in enumerate(root.mesh_dim_names):
        if name not in REPLICATING_DIMS or root.size(dim) == 1:
            continue
        line = root.mesh[tuple(slice(None) if d == dim else c for d, c in enumerate(coordinate))].tolist()
        me = line[coordinate[dim]]
        if not members.intersection(r for r in line if r != me):
            found.append((root, dim))
    return found


def replica_coordinate(mesh: Any, placements: Sequence[Any], coordinate: Sequence[int]) -> tuple[int, int]:
    """``(index, count)`` of this rank among the holders of its box: replicas of a box differ only
    in their coordinates on the ``Replicate`` mesh dims, read here as one mixed-radix number (outer
    dim first), so holder 0 sits at coordinate 0 on all of them."""
    replica, replicas = 0, 1
    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            size = mesh.size(dim)
            replica, replicas = replica * size + coordinate[dim], replicas * size
    return replica, replicas


def local_expert_range(expert_param: torch.Tensor, *, key: str = "?") -> tuple[int, int]:
    """Global experts ``[start, end)`` whose data this rank holds in a stacked expert tensor.

    Dim 0 indexes experts. The answer comes from the tensor's own placements, so it covers 1-D
    FSDP ``Shard(0)``, HSDP ``(Replicate, Shard(0))``, EP ``Shard(0)`` on an ``ep`` axis and EP
    with ``Shard(1)`` on an inner FSDP axis (the rank then holds some rows of each of its experts).
    An empty shard returns ``(n, n)``.
    """
    box = local_box(expert_param, key=key)
    if not box.global_shape:
        raise InputError("expert tensor has no expert dim", key=key, expected="dim >= 1", actual=0)
    start = box.offsets[0]
    return start, start + box.local.shape[0]
