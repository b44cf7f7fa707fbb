"""The export across pipeline stages: one plan from every stage's keys, each byte written once
(docs/design.md#pipeline-stages).

Under pipeline parallelism (PP) a rank holds only the tensors of its stages, under their global
names (torch stages keep the original module names; the megatron-core view renames stage-local
layers by the model's own layer offset). Planned from its own state dict alone, each pipeline rank
would lay out a checkpoint of one stage: the index built from one stage's keys that the anchors
shipped. So, once per export and only when the pipeline group has more than one rank:

1. :func:`catalogue_of` lists what this rank's stages write (HF key, global shape, dtype, which keys
   stay float32 or exact) and :func:`merge_catalogues` unions the catalogues of the pipeline
   group's ranks: one object all-gather over the PP group, whose size is the pipeline depth. Every
   pipeline group merges the same catalogue; the plan digest compared over the export group
   confirms it.
2. :func:`check_declared` refuses, before any file exists, a tensor the model's config declares and
   no stage holds, naming the layer and the pipeline ranks around it. The reference is transformers'
   own module tree for the config, built on the meta device (no memory, no weights).
3. :func:`stage_replicated` turns the plain tensors of a stage (FSDP2 buffers, unsharded weights),
   which only the ranks of that stage hold, into ``Replicate()`` DTensors over those ranks' group
   (the "stage peers"), so the layout engine, the write shares and the replica check read their
   holders from the placements like any replica's. Nothing downstream of validate knows of stages.

:func:`check_mtp_layers` runs for every export, pipelined or not: a config that declares
multi-token-prediction layers the export cannot write is refused before any file exists.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from transformers import AutoModelForCausalLM

from nemo_moe_export.adapters import StateDictAdapter, TensorMeta, get_table
from nemo_moe_export.collectives import gloo_group
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.replicas import checksum
from nemo_moe_export.export.verify import MTP_MODULES
from nemo_moe_export.parallel import Coordinator, RankGroup
from nemo_moe_export.placement import local_box

__all__ = ["Catalogue", "catalogue_of", "check_declared", "check_mtp_layers", "check_tied", "merge_catalogues",
           "pipeline_group_of", "stage_replicated", "tied_boxes", "tied_pairs"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Catalogue:
    """What a set of pipeline stages writes: everything the plan is laid out from.

    ``metadata``: HF key -> global shape and in-memory dtype; ``float32``: keys stored float32
    (casting like transformers); ``exact``: extra tensors kept in their own dtype, held by every
    rank rather than one stage; ``layers``: pipeline rank -> the global layer ids its stages hold.
    """

    metadata: Mapping[str, TensorMeta]
    float32: frozenset[str] = frozenset()
    exact: frozenset[str] = frozenset()
    layers: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    # Tied weights' copies this rank holds, for the check that stages agree on them:
    # in-memory key -> (offsets, local shape, checksum) of its box (:func:`tied_boxes`).
    tied: Mapping[str, tuple] = field(default_factory=dict)


def layers_of(keys: Any) -> tuple[int, ...]:
    """The global decoder-layer ids named in HF ``keys``, sorted."""
    return tuple(sorted({int(m.group(1)) for k in keys if (m := _LAYER.search(k))}))


def catalogue_of(metadata: Mapping[str, TensorMeta], float32: frozenset[str], exact: frozenset[str],
                 pp_rank: int = 0, tied: Mapping[str, tuple] | None = None) -> Catalogue:
    """This rank's catalogue (the layers it holds recorded under its pipeline rank)."""
    model_keys = [k for k in metadata if k not in exact]
    return Catalogue(dict(metadata), frozenset(float32), frozenset(exact), {pp_rank: layers_of(model_keys)},
                     dict(tied or {}))


def tied_pairs(model: Any, config: Any) -> dict[str, str]:
    """``{tied key: the key it aliases}`` when the config ties weights, as the model class records
    them (transformers' ``_tied_weights_keys``, e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return {}
    pairs = getattr(model, "_tied_weights_keys", None)
    return dict(pairs) if isinstance(pairs, Mapping) else {}


def tied_boxes(state_dict: Mapping[str, torch.Tensor], pairs: Mapping[str, str]) -> dict[str, tuple]:
    """The boxes of the tied weights' copies in ``state_dict``: ``(offsets, shape, checksum)`` by key.
    A rank holding both names of a pair holds one tensor (the model ties them itself): nothing to check."""
    out = {}
    for tied, source in pairs.items():
        if (tied in state_dict) == (source in state_dict):
            continue
        key = tied if tied in state_dict else source
        box = local_box(state_dict[key], key=key)
        out[key] = (tuple(box.offsets), tuple(box.local.shape), tuple(checksum(box.local).tolist()))
    return out


def pipeline_group_of(pp_group: Any, model: Any) -> RankGroup:
    """This rank's pipeline group: ``pp_group`` as given (a process group or a ``RankGroup``), else
    the one the model records (``model.pipeline_group``: the pipeline wrappers set it), else none."""
    group = pp_group if pp_group is not None else getattr(model, "pipeline_group", None)
    if group is None:
        return RankGroup.alone()
    return group if isinstance(group, RankGroup) else RankGroup.of(group)


def merge_catalogues(local: Catalogue, pp: RankGroup) -> Catalogue:
    """The union of the catalogues of every rank of the pipeline group ``pp`` (a collective over it).

    A model key held by two pipeline ranks is refused: each tensor lives on one stage, and two
    writers would write it twice (tied embeddings are written from the embedding's stage only).
    Extra tensors (``exact``) are held by every rank and may appear everywhere."""
    if pp.size <= 1:
        return local
    every: list[Any] = [None] * pp.size
    dist.all_gather_object(every, _portable(local), group=pp.group)
    metadata: dict[str, TensorMeta] = {}
    holder: dict[str, int] = {}
    float32, exact, layers, tied = set(), set(), {}, {}
    for pp_rank, (meta, f32, ex, held, copies) in enumerate(every):
        for key, (shape, dtype) in meta.items():
            _add_stage_key(metadata, holder, key, TensorMeta(tuple(shape), dtype), pp_rank, pp, key in ex)
        float32 |= set(f32)
        exact |= set(ex)
        layers[pp_rank] = tuple(held.get(pp_rank, ()))
        tied.update({(key, pp_rank): box for key, box in copies.items()})
    return Catalogue(metadata, frozenset(float32), frozenset(exact), layers, tied)


def check_tied(merged: Catalogue, pairs: Mapping[str, str], pp: RankGroup) -> None:
    """Tied weights whose two names live on different stages (the embedding on the first, ``lm_head``
    on the last) must hold equal values: the export writes the embedding's copy only, as
    ``save_pretrained`` does. Compared box by box, by exact checksums (gathered with the catalogue)."""
    copies: dict[str, list[tuple[int, tuple]]] = {}
    for (key, pp_rank), box in merged.tied.items():
        copies.setdefault(key, []).append((pp_rank, box))
    for tied, source in pairs.items():
        for pp_tied, (offsets, shape, sums) in copies.get(tied, []):
            same_box = [(r, b) for r, b in copies.get(source, []) if b[0] == offsets and b[1] == shape]
            if not same_box:
                raise InputError(
                    "a tied weight's two copies sit on stages sharded differently", key=tied,
                    expected=f"'{source}' on another stage holding the same box {offsets} {shape}",
                    actual=f"its boxes there: {[b[:2] for _, b in copies.get(source, [])] or 'none'}",
                    hint="shard the first and the last stage over the same data-parallel mesh")
            pp_source, (_, _, source_sums) = same_box[0]
            if tuple(source_sums) != tuple(sums):
                raise InputError(
                    "the tied weights' copies on two pipeline stages differ", key=tied,
                    expected=f"equal to '{source}' (the export writes that copy only)",
                    actual=f"different values at box {offsets} {shape}: pipeline rank {pp_tied} (global rank "
                           f"{pp.ranks[pp_tied]}) vs pipeline rank {pp_source} (global rank {pp.ranks[pp_source]})",
                    hint="the training step must all-reduce the tied weights' gradients between the first "
                         "and the last stage (Megatron's embedding group), or untie them")


def _portable(c: Catalogue) -> tuple:
    return ({k: (tuple(m.shape), m.dtype) for k, m in c.metadata.items()}, sorted(c.float32), sorted(c.exact),
            dict(c.layers), dict(c.tied))


def _add_stage_key(metadata: dict[str, TensorMeta], holder: dict[str, int], key: str, meta: TensorMeta,
                   pp_rank: int, pp: RankGroup, exact: bool) -> None:
    if key in metadata and (not exact or metadata[key] != meta):
        raise InputError(
            "two pipeline stages hold the same tensor", key=key,
            expected="each tensor on exactly one stage",
            actual=f"held by pipeline ranks {holder[key]} and {pp_rank} (global ranks "
                   f"{pp.ranks[holder[key]]} and {pp.ranks[pp_rank]}), shapes {tuple(metadata[key].shape)} "
                   f"and {tuple(meta.shape)}",
            hint="build each stage with only its own layers; a weight two stages share (tied embeddings) "
                 "is exported from the embedding's stage")
    metadata.setdefault(key, meta)
    holder.setdefault(key, pp_rank)


def check_declared(catalogue: Catalogue, adapter: StateDictAdapter, pp: RankGroup) -> None:
    """Refuse a tensor the config declares that no pipeline stage holds. The declared tensors are
    those of transformers' own model for the config, mapped by the family's transformers table
    (about 1 s for DeepSeek-V3's 45k keys, once per process: the export runs it on one rank and
    its agreement tells every rank)."""
    declared = declared_tensors(adapter)
    if declared is None:  # no transformers class for this config: the layer count still checks
        declared = {f"model.layers.{i}.": None for i in range(_num_layers(adapter))}
        have = {f"model.layers.{i}." for i in layers_of(catalogue.metadata)}
    else:
        have = set(catalogue.metadata)
    missing = sorted(set(declared) - have, key=_layer_then_key)
    if missing:
        raise _no_stage_holds(missing, catalogue, pp)


def _layer_then_key(key: str) -> tuple[int, str]:
    m = _LAYER.search(key)
    return (int(m.group(1)) if m else -1, key)


def _no_stage_holds(missing: list[str], catalogue: Catalogue, pp: RankGroup) -> InputError:
    first = missing[0]
    m = _LAYER.search(first)
    held = "; ".join(f"pipeline rank {r} (global rank {pp.ranks[r] if r < len(pp.ranks) else '?'}): "
                     f"layers {_ranges(ls)}" for r, ls in sorted(catalogue.layers.items()))
    if m is not None:
        layer = int(m.group(1))
        what = f"layer {layer} is held by no pipeline stage"
        hint = (f"the stage that should hold layer {layer} is {_stages_around(layer, catalogue.layers)}: build "
                "it with that layer (each stage keeps its layers under their original, global names)")
    else:
        what = f"'{first}' is held by no pipeline stage"
        hint = ("embeddings belong to the first stage, the final norm and lm_head to the last: build those "
                "stages with them")
    if pp.size <= 1:
        hint += ("; stage modules on other ranks are planned only through the pipeline group: pass "
                 "pp_group= (or a model that records its pipeline_group)")
    return InputError(
        f"{what} ({len(missing)} declared tensors missing)", key=first,
        expected="every tensor of the config's model held by one stage of the pipeline",
        actual=f"missing: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; stages hold: {held}",
        hint=hint)


def _stages_around(layer: int, layers: Mapping[int, tuple[int, ...]]) -> str:
    """Which pipeline rank(s) a missing layer sits between, by the layers their stages hold."""
    before = [r for r, ls in layers.items() if ls and min(ls) < layer]
    after = [r for r, ls in layers.items() if ls and max(ls) > layer]
    last_before = max(before, key=lambda r: max(x for x in layers[r] if x < layer)) if before else None
    first_after = min(after, key=lambda r: min(x for x in layers[r] if x > layer)) if after else None
    around = [f"pipeline rank {r}" for r in dict.fromkeys((last_before, first_after)) if r is not None]
    return " or ".join(around) or "pipeline rank 0"


def _ranges(ids: tuple[int, ...]) -> str:
    if not ids:
        return "none"
    runs, start, prev = [], ids[0], ids[0]
    for x in ids[1:]:
        if x != prev + 1:
            runs.append((start, prev))
            start = x
        prev = x
    runs.append((start, prev))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _num_layers(adapter: StateDictAdapter) -> int:
    return int(getattr(adapter.text_config, "num_hidden_layers", 0) or 0)


def declared_tensors(adapter: StateDictAdapter) -> dict[str, TensorMeta] | None:
    """HF key -> shape of every tensor transformers' model of the adapter's config has, or None when
    transformers has no causal-LM class for it. Built once per config on the meta device."""
    config = adapter.config
    try:
        text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else json.dumps(config)
    except (TypeError, ValueError):
        return None
    return _declared(type(config), text, getattr(config, "model_type", None))


@functools.lru_cache(maxsize=8)
def _declared(config_class: type, config_json: str, model_type: str | None) -> dict[str, TensorMeta] | None:
    try:
        config = config_class.from_dict(json.loads(config_json))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # no transformers class builds this config: the caller checks layer counts
        return None
    reference = StateDictAdapter(config, get_table(model_type or config.model_type))
    return reference.hf_metadata(model.state_dict())


def check_mtp_layers(keys: Any, config: Any) -> None:
    """Refuse, before any file exists, a config that declares multi-token-prediction (MTP) layers
    (``num_nextn_predict_layers``) whose tensors the export would not write: the checkpoint would
    claim a layer its files lack, and serving it with MTP speculative decoding fails."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    get = text.get if isinstance(text, Mapping) else functools.partial(getattr, text)
    n, layers = get("num_nextn_predict_layers", None), get("num_hidden_layers", None)
    if not isinstance(n, int) or not isinstance(layers, int) or n <= 0:
        return
    keys = set(keys)
    for layer in range(layers, layers + n):
        prefix = f"model.layers.{layer}."
        have = {k[len(prefix):] for k in keys if k.startswith(prefix)}
        missing = [m for m in MTP_MODULES if m not in have]
        if missing:
            raise InputError(
                f"the config declares {n} multi-token-prediction layer(s) the export would not write",
                key=f"{prefix}*", expected=f"the MTP layer's tensors ({', '.join(MTP_MODULES)}, ...)",
                actual=f"lacks {missing}" if have else "no tensor of it",
                hint=(_INCOMPLETE_MTP if have else _NO_MTP) + "; to export without MTP, set "
                     "config.num_nextn_predict_layers = 0")


_NO_MTP = ("transformers has no module for the MTP layer, so from_hf keeps it in the adapter that loaded it: "
           "export with that adapter (adapter=) or its LoadReport.passthrough (extra=)")
_INCOMPLETE_MTP = ("the MTP tensors given (the loading adapter's pass-through, extra=, or the model's) are an "
                   "incomplete layer: the source checkpoint lacks them")


# --------------------------------------------------------------------------------------------------
# Plain tensors of a stage: Replicate DTensors over the stage peers
# --------------------------------------------------------------------------------------------------


def stage_replicated(state_dict: Mapping[str, torch.Tensor], pp: RankGroup, coordinator: Coordinator
                     ) -> dict[str, torch.Tensor]:
    """``state_dict`` with each plain tensor a ``Replicate()`` DTensor over the ranks that hold the
    same stages (same pipeline rank), without copying. A collective over the export group (every
    rank calls it): the pipeline ranks are gathered to find the peers."""
    peers = _stage_peers(pp, coordinator)
    group = gloo_group(peers, coordinator.timeout, members_only=True)
    out: dict[str, torch.Tensor] = {}
    meshes: dict[str, DeviceMesh] = {}
    for key, tensor in state_dict.items():
        if isinstance(tensor, DTensor) or not torch.is_tensor(tensor):
            out[key] = tensor
            continue
        device = tensor.device.type
        mesh = meshes.get(device) or meshes.setdefault(
            device, DeviceMesh.from_group(group, device, mesh_dim_names=("stage_peers",)))
        out[key] = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
    return out


def _stage_peers(pp: RankGroup, coordinator: Coordinator) -> tuple[int, ...]:
    """Global ranks of the export group whose pipeline rank is this rank's, in rank order: each
    rank's pipeline rank in its own slot of a vector summed over the export group."""
    if not coordinator.active:
        return (coordinator.global_rank(0),)
    every = torch.zeros(coordinator.world_size, dtype=torch.int64)
    every[coordinator.rank] = pp.rank
    coordinator.all_reduce(every, step="validate stages")
    return tuple(coordinator.global_rank(r) for r, p in enumerate(every.tolist()) if p == pp.rank)
