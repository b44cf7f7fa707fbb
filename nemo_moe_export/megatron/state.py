"""What a megatron-core ``GPTModel`` holds on this rank, described so the adapter and the export can
use it: every tensor as a DTensor over the ranks that hold the same copy, and the global ids of the
experts each EP rank holds.

megatron-core keeps plain tensors: with expert parallelism (EP) ``decoder.layers.L.mlp.experts.
local_experts.0`` is a *different* expert on each EP rank (the module's ``local_expert_indices``
say which), and a dense weight is the same on every data-parallel rank. Read as plain tensors, rank
0's copy of every key would be taken for the only one, and every EP rank but the first would lose
its experts. So the view wraps each tensor, without copying, in a ``Replicate()`` DTensor over its
replica group from ``parallel_state`` (docs/design.md#megatron-core-models):

* dense tensors (attention, norms, router, shared experts, embeddings): the data-parallel group;
* routed experts (everything under an MoE layer's ``experts``): the expert-data-parallel group.

The layout engine then reads each copy's holders and primary from the placements
(docs/design.md#layout-rules), like any HSDP replica. The DTensors' local tensors are the
parameters' own storage, so ``from_hf`` writes straight into the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from nemo_moe_export.adapters import LocalExperts
from nemo_moe_export.parallel import ParallelLayout

__all__ = ["ReplicaMeshes", "export_view", "gather_local_experts", "moe_modules"]


def moe_modules(gpt_model: Any) -> dict[str, Any]:
    """Qualified name -> MoE layer, for every module that numbers its experts (``local_expert_indices``)."""
    return {name: m for name, m in gpt_model.named_modules() if hasattr(m, "local_expert_indices")}


def gather_local_experts(gpt_model: Any, layout: ParallelLayout) -> dict[str, LocalExperts]:
    """Each MoE layer's ``local_expert_indices`` on every rank of this rank's EP group (one
    all-gather over the EP group: a collective, every rank calls it)."""
    mine = {name: tuple(int(e) for e in m.local_expert_indices) for name, m in moe_modules(gpt_model).items()}
    every: list[Any] = [None] * layout.ep.size
    dist.all_gather_object(every, mine, group=layout.ep.group)
    return {name: LocalExperts(tuple(peer[name] for peer in every), layout.ep.rank) for name in mine}


class ReplicaMeshes:
    """One-dimensional meshes over the dense data-parallel and the expert-data-parallel groups."""

    def __init__(self, layout: ParallelLayout, device_type: str) -> None:
        self.dense = DeviceMesh.from_group(layout.dp.group, device_type, mesh_dim_names=("dp",))
        self.experts = DeviceMesh.from_group(layout.edp.group, device_type, mesh_dim_names=("edp",))


def export_view(gpt_model: Any, meshes: ReplicaMeshes) -> dict[str, torch.Tensor]:
    """``gpt_model``'s tensors under megatron's own names, each a ``Replicate()`` DTensor over its
    replica group (no copy). ``_extra_state`` entries (Transformer Engine's FP8 metadata) are not
    weights and are left out."""
    experts = tuple(f"{name}.experts." for name in moe_modules(gpt_model))
    out: dict[str, torch.Tensor] = {}
    for key, value in gpt_model.state_dict().items():
        if key.endswith("._extra_state") or not isinstance(value, torch.Tensor):
            continue
        mesh = meshes.experts if key.startswith(experts) else meshes.dense
        out[key] = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    return out
