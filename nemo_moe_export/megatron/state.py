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

Under pipeline parallelism a stage's ``state_dict()`` numbers its layers from 0
(``decoder.layers.0`` on every stage). The view names each layer by the model's own global number,
``layer.layer_number - 1`` (megatron adds ``get_transformer_layer_offset()`` when it builds the
layer), never by a number we derive from the pipeline rank. A multi-token-prediction (MTP) layer
is named by the global number megatron gives its decoder block (after the decoder's layers, as
HF's ``model.layers.{num_hidden_layers}``). A non-first stage's copy of the word embeddings (built
for its MTP layer or tied output layer, and kept equal to the first stage's by megatron) is not a
tensor of its own and is left out; the MTP layer's shared head (the output layer it projects
through) appears under the MTP layer as well (docs/design.md#pipeline-stages-megatron-core).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from nemo_moe_export.adapters import LocalExperts
from nemo_moe_export.parallel import ParallelLayout

__all__ = ["ReplicaMeshes", "export_view", "gather_local_experts", "global_key", "layer_numbers", "moe_layer_ids",
           "moe_modules", "mtp_layers"]

_STAGE_LOCAL = re.compile(r"(decoder|mtp)\.layers\.(\d+)\.")
MTP_HEAD = "output_layer.weight"
"""The view's name, under an MTP layer, of the output layer the MTP layer projects through."""


def mtp_layers(gpt_model: Any) -> list[Any]:
    """The MTP layers this stage holds (megatron-core builds them on the stage given an MTP spec)."""
    mtp = getattr(gpt_model, "mtp", None) if getattr(gpt_model, "mtp_process", False) else None
    return list(mtp.layers) if mtp is not None else []


def layer_numbers(gpt_model: Any) -> dict[tuple[str, int], int]:
    """``(block, stage-local index) -> global layer number`` of this stage's layers, as the model
    numbers them: a decoder layer's ``layer_number - 1`` (1-based, offset by megatron's
    ``get_transformer_layer_offset``), an MTP layer's decoder block's likewise."""
    numbers = {("decoder", i): layer.layer_number - 1 for i, layer in enumerate(gpt_model.decoder.layers)}
    for i, layer in enumerate(mtp_layers(gpt_model)):
        numbers[("mtp", i)] = layer.transformer_layer.layer_number - 1
    return numbers


def global_key(key: str, numbers: dict[tuple[str, int], int]) -> str:
    """``key`` (a stage-local state-dict key or module name followed by a dot) under its global layer number."""
    m = _STAGE_LOCAL.match(key)
    if m is None:
        return key
    return f"{m[1]}.layers.{numbers[(m[1], int(m[2]))]}.{key[m.end():]}"


def moe_modules(gpt_model: Any) -> dict[str, Any]:
    """Global qualified name -> MoE layer, for every module that numbers its experts
    (``local_expert_indices``)."""
    numbers = layer_numbers(gpt_model)
    return {global_key(f"{name}.", numbers)[:-1]: m for name, m in gpt_model.named_modules()
            if hasattr(m, "local_expert_indices")}


def moe_layer_ids(gpt_model: Any) -> list[int]:
    """Global numbers of this stage's decoder layers whose MLP is an MoE layer."""
    return [layer.layer_number - 1 for layer in gpt_model.decoder.layers if hasattr(layer.mlp, "local_expert_indices")]


def gather_local_experts(gpt_model: Any, layout: ParallelLayout) -> dict[str, LocalExperts]:
    """Each MoE layer's ``local_expert_indices`` on every rank of this rank's EP group (one
    all-gather over the EP group: a collective, every rank calls it). Keyed by global module name;
    the layers of this stage only (the adapter maps only this stage's keys)."""
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
    """``gpt_model``'s tensors under megatron's own names with global layer numbers, each a
    ``Replicate()`` DTensor over its replica group (no copy). Left out: ``_extra_state`` entries
    (Transformer Engine's FP8 metadata, not weights) and a non-first stage's copy of the word
    embeddings. Added: each MTP layer's shared head, ``mtp.layers.{L}.output_layer.weight``."""
    numbers = layer_numbers(gpt_model)
    experts = tuple(f"{name}.experts." for name in moe_modules(gpt_model))
    out: dict[str, torch.Tensor] = {}
    for key, value in gpt_model.state_dict().items():
        if key.endswith("._extra_state") or not isinstance(value, torch.Tensor) or _embedding_copy(gpt_model, key):
            continue
        name = global_key(key, numbers)
        mesh = meshes.experts if name.startswith(experts) else meshes.dense
        out[name] = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    for i in range(len(mtp_layers(gpt_model))):
        head = _mtp_head_weight(gpt_model)
        out[f"mtp.layers.{numbers[('mtp', i)]}.{MTP_HEAD}"] = DTensor.from_local(head, meshes.dense, [Replicate()],
                                                                                 run_check=False)
    return out


def _embedding_copy(gpt_model: Any, key: str) -> bool:
    """Whether ``key`` is a non-first stage's copy of the word embeddings: megatron builds it on
    the last stage for an MTP layer or a tied output layer, fills it from the first stage's over
    the embedding group and keeps the two equal (``setup_embeddings_and_output_layer``)."""
    return key.startswith("embedding.") and not gpt_model.pre_process


def _mtp_head_weight(gpt_model: Any) -> torch.Tensor:
    """The weight the MTP layers' logits are projected with: the output layer's, or the (copied)
    word embeddings when they are tied (``GPTModel._postprocess``)."""
    if gpt_model.share_embeddings_and_output_weights:
        return gpt_model.shared_embedding_or_output_weight().detach()
    return gpt_model.output_layer.weight.detach()
