"""What a megatron-core ``GPTModel`` holds on this rank, described so the adapter and the export can
use it: every tensor as a DTensor over the ranks that hold the same copy, and the global ids of the
experts each EP rank holds.

megatron-core keeps plain tensors: with expert parallelism (EP) ``decoder.layers.L.mlp.experts.
local_experts.0`` is a *different* expert on each EP rank (the module's ``local_expert_indices``
say which), and a dense weight is the same on every data-parallel rank. Read as plain tensors, rank
0's copy of every key would be taken for the only one, and every EP rank but the first would lose
its experts. So the view wraps each tensor, without copying, in a DTensor over its replica group
from ``parallel_state`` (docs/design.md#megatron-core-models):

* dense tensors (attention, norms, router, shared experts, embeddings): the data-parallel group;
* routed experts (everything under an MoE layer's ``experts``): the expert-data-parallel group;

and, under tensor (expert-tensor) parallelism, a second mesh dim over the TP (expert-TP) group,
placed as the model's own ``sharded_state_dict()`` records each tensor: ``Shard(d)`` for the dim
megatron splits, ``Replicate()`` for tensors every TP rank duplicates; the view checks each
DTensor's box and replica index against the record. A SwiGLU ``linear_fc1`` (a TP rank holds
``[gate_r; up_r]``) becomes the two pieces megatron's GLU factory builds, ``linear_fc1.weight_w``
and ``_v``, each a row range of its own HF tensor (docs/design.md#tensor-parallelism-megatron-core).

The layout engine then reads each copy's holders and primary from the placements
(docs/design.md#placement-rules), like any HSDP replica. The DTensors' local tensors are the
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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nemo_moe_export.adapters import LocalExperts
from nemo_moe_export.adapters.tables_megatron import GLU_PARTS
from nemo_moe_export.errors import InputError
from nemo_moe_export.parallel import ParallelLayout, RankGroup
from nemo_moe_export.placement import replica_coordinate

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
    """The meshes the view's DTensors live on: over the dense data-parallel group (with the tensor-
    parallel group as a second dim under TP) and over the expert-data-parallel group (with the
    expert-tensor-parallel group as a second dim under ETP). Every rank builds them together (one
    all-gather over each replica group when a second dim exists)."""

    def __init__(self, layout: ParallelLayout, device_type: str, etp: RankGroup | None = None) -> None:
        self.dense = _replica_mesh(layout.dp, layout.tp, device_type, ("dp", "tp"))
        self.experts = _replica_mesh(layout.edp, etp or RankGroup.alone(), device_type, ("edp", "etp"))


def _replica_mesh(replica: RankGroup, shard: RankGroup, device_type: str, names: tuple[str, str]) -> DeviceMesh:
    """A 1-D mesh over ``replica``, or with a ``shard`` group of more than one rank the 2-D mesh
    ``[replica, shard]``: row ``i`` is the shard group of replica rank ``i`` (gathered over the
    replica group), and this rank's column must be its own replica group."""
    if shard.size == 1:
        return DeviceMesh.from_group(replica.group, device_type, mesh_dim_names=names[:1])
    rows: list[Any] = [None] * replica.size
    dist.all_gather_object(rows, list(shard.ranks), group=replica.group)
    mesh = torch.tensor(rows, dtype=torch.int)
    if mesh.shape != (replica.size, shard.size) or mesh[:, shard.rank].tolist() != list(replica.ranks):
        raise InputError("parallel_state's groups do not form a grid", key=f"{names[0]} x {names[1]}",
                         expected=f"the {names[1]} groups of the {names[0]} ranks {list(replica.ranks)} "
                                  f"holding them in column {shard.rank}",
                         actual=f"rows {rows}", hint="build the groups with parallel_state")
    return DeviceMesh.from_group([replica.group, shard.group], device_type, mesh=mesh, mesh_dim_names=names)


def export_view(gpt_model: Any, meshes: ReplicaMeshes) -> dict[str, torch.Tensor]:
    """``gpt_model``'s tensors under megatron's own names with global layer numbers, each a
    DTensor placed as ``gpt_model.sharded_state_dict()`` records it (no copy). A SwiGLU
    ``linear_fc1`` becomes its GLU factory's two pieces, ``linear_fc1.weight_w`` (gate rows) and
    ``_v`` (up rows). Left out: ``_extra_state`` entries (Transformer Engine's FP8 metadata, not
    weights) and a non-first stage's copy of the word embeddings. Added: each MTP layer's shared
    head, ``mtp.layers.{L}.output_layer.weight``, placed as the output layer."""
    numbers = layer_numbers(gpt_model)
    experts = tuple(f"{name}.experts." for name in moe_modules(gpt_model))
    records = sharded_records(gpt_model)
    out: dict[str, torch.Tensor] = {}
    for key, value in gpt_model.state_dict().items():
        if key.endswith("._extra_state") or not isinstance(value, torch.Tensor) or _embedding_copy(gpt_model, key):
            continue
        name = global_key(key, numbers)  # the record's data is this tensor's storage
        mesh = meshes.experts if name.startswith(experts) else meshes.dense
        for suffix, placed in placed_pieces(key, records, mesh):
            out[name + suffix] = placed
    for i in range(len(mtp_layers(gpt_model))):
        head = _mtp_head_weight(gpt_model)
        source = "embedding.word_embeddings.weight" if gpt_model.share_embeddings_and_output_weights else MTP_HEAD
        (_, placed), = placed_pieces(source, records, meshes.dense, data=head)
        out[f"mtp.layers.{numbers[('mtp', i)]}.{MTP_HEAD}"] = placed
    return out


# --------------------------------------------------------------------------------------------------
# Placements from megatron's sharded_state_dict() (docs/design.md#tensor-parallelism-megatron-core)
# --------------------------------------------------------------------------------------------------


def sharded_records(gpt_model: Any) -> dict[str, list[Any]]:
    """State-dict key -> the ShardedTensors ``gpt_model.sharded_state_dict()`` records for it: one,
    or a factory's built pieces (the SwiGLU ``linear_fc1``: gate, then up). The records' data are
    views of the parameters (no copy)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    # megatron's own default metadata: 0.16.1's GPTModel.sharded_state_dict reads
    # metadata["dp_cp_group"] on a stage with an MTP layer and no embedding, where None fails
    metadata = ensure_metadata_has_dp_cp_group(None)
    out: dict[str, list[Any]] = {}
    for key, record in gpt_model.sharded_state_dict(metadata=metadata).items():
        if isinstance(record, ShardedTensorFactory):
            out[key] = list(record.build())
        elif isinstance(record, ShardedTensor):
            out[key] = [record]
    return out


def placed_pieces(key: str, records: dict[str, list[Any]], mesh: DeviceMesh,
                  data: torch.Tensor | None = None) -> list[tuple[str, DTensor]]:
    """``(name suffix, DTensor)`` of each piece of the state-dict tensor ``key``, placed as its
    record says, over the record's data detached (the parameter's storage); ``data``: the tensor
    to place instead (the MTP head)."""
    found = records.get(key)
    if found is None:
        raise InputError("megatron's sharded_state_dict() has no record of a tensor", key=key,
                         expected="a ShardedTensor or a ShardedTensorFactory for every parameter",
                         actual="none", hint="docs/design.md#tensor-parallelism-megatron-core")
    if len(found) == 1:
        return [("", _placed(key, found[0], mesh, (found[0].data if data is None else data).detach()))]
    if len(found) == len(GLU_PARTS) and key.endswith("linear_fc1.weight"):
        return [(suffix, _placed(key, _glu_half(key, record, i), mesh, record.data.detach()))
                for i, (suffix, record) in enumerate(zip(GLU_PARTS, found))]
    raise InputError("a sharded_state_dict() factory the view does not know", key=key,
                     expected="one ShardedTensor, or the SwiGLU linear_fc1's two pieces",
                     actual=f"{len(found)} pieces")


@dataclass(frozen=True)
class _Box:
    """A record's box without megatron's prepended axes (layers, experts): global shape, global
    offset, fragments per dim, and whether megatron names this copy the primary (replica id 0)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    fragments: tuple[int, ...]
    primary: bool


def _box_of(record: Any) -> _Box:
    skip = record.prepend_axis_num
    replica = record.replica_id if isinstance(record.replica_id, tuple) else (record.replica_id,)
    return _Box(tuple(record.global_shape[skip:]), tuple(record.global_offset[skip:]),
                tuple(record.axis_fragmentations[skip:]), all(r == 0 for r in replica))


def _glu_half(key: str, record: Any, index: int) -> _Box:
    """The box of a GLU factory piece in its own HF tensor: megatron places gate piece ``r`` at rows
    ``r * F/tp`` and up piece ``r`` at ``F + r * F/tp`` of the global [2F, H]; each half is one
    HF tensor of F rows."""
    box = _box_of(record)
    half = box.global_shape[0] // 2
    row = box.offsets[0] - index * half
    if box.global_shape[0] % 2 or box.fragments[0] % 2 or not 0 <= row < half:
        raise InputError("a GLU factory piece outside its half of linear_fc1", key=key,
                         expected=f"piece {index} ({GLU_PARTS[index]}) in rows "
                                  f"[{index * half}, {(index + 1) * half})",
                         actual=f"row {box.offsets[0]} of {box.global_shape}")
    return _Box((half, *box.global_shape[1:]), (row, *box.offsets[1:]),
                (box.fragments[0] // 2, *box.fragments[1:]), box.primary)


def _placed(key: str, record: Any, mesh: DeviceMesh, local: torch.Tensor) -> DTensor:
    """``local`` as a DTensor over ``mesh`` with the record's global shape: ``Shard(d)`` on the
    tensor-parallel dim for the one dim megatron splits (its fragment count must be that dim's
    size), ``Replicate()`` elsewhere. Refused unless the DTensor's box is the record's box and its
    replica index is 0 exactly where megatron's replica id is."""
    box = record if isinstance(record, _Box) else _box_of(record)
    split = [d for d, f in enumerate(box.fragments) if f > 1]
    shard_size = mesh.size(1) if mesh.ndim == 2 else 1
    if len(split) > 1 or (split and box.fragments[split[0]] != shard_size):
        raise InputError("a tensor split in a way the view does not place", key=key,
                         expected=f"at most one dim split into {shard_size} (the tensor-parallel size)",
                         actual=f"fragments {box.fragments} of {box.global_shape}")
    placements = [Replicate()] + ([Shard(split[0]) if split else Replicate()] if mesh.ndim == 2 else [])
    placed = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(box.global_shape),
                                stride=_contiguous_stride(box.global_shape))
    _check_box(key, placed, box, local)
    return placed


def _check_box(key: str, placed: DTensor, box: _Box, local: torch.Tensor) -> None:
    shape, offsets = compute_local_shape_and_global_offset(placed.shape, placed.device_mesh, placed.placements)
    replica, _ = replica_coordinate(placed.device_mesh, placed.placements, placed.device_mesh.get_coordinate())
    if tuple(shape) != tuple(local.shape) or tuple(offsets) != box.offsets or (replica == 0) != box.primary:
        raise InputError(
            "megatron's sharded_state_dict() places a tensor where the parallel groups do not",
            key=key, expected=f"local {tuple(local.shape)} at {box.offsets}, primary={box.primary} (the record)",
            actual=f"local {tuple(shape)} at {tuple(offsets)}, replica {replica} on {placed.placements}",
            hint="the model was built under other parallel_state groups than the wrapper's")


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


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
