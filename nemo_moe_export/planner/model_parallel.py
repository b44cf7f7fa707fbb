"""Tensor and context parallelism in the planner: where each tensor lives under TP x FSDP2, TP x EP
and CP meshes, read from torch itself (docs/design.md#planner).

The placements are not re-derived here. Once per layout, in the planner's fake process group as
rank 0 of one stage's ``S`` ranks, a meta model of the representative layers (``model.py``) is
laid out the way the job lays it out:

* the stage's root mesh is ``("dp", "cp", "tp")`` (``"cp"`` / ``"tp"`` left out at size 1), TP
  innermost, as torchtitan and megatron-core order their ranks;
* ``job.tensor_parallel.parallelize_tp(model, root["tp"])`` applies the TP plan (column-parallel
  ``Shard(0)``, row-parallel ``Shard(1)``, embeddings by vocabulary rows, routed experts whole);
* ``fsdp``: ``fully_shard`` of each decoder layer and of the model over ``root["dp"]``, as
  ``tests/test_tensor_parallel.py`` and torchtitan do. Every parameter then says its mesh dim names
  and placements (``(_StridedShard(0), Shard(0))`` on ``("dp", "tp")`` for a column-parallel weight,
  ``(Shard(0), Shard(1))`` for a row-parallel one, ``Shard(0)`` on ``("dp",)`` for a weight TP leaves
  whole, whose TP and CP peers hold copies: ``placement.unsplit_model_parallel_dims``);
* ``ep`` (Megatron-Bridge's meshes: experts over EP, the rest replicated over the data-parallel
  ranks, as megatron's DDP keeps them): the TP placement torch gives a weight on ``"tp"``, with
  ``Replicate()`` on the root's other dims (its DP and CP copies share the writing); weights TP
  leaves whole stay plain tensors on every rank, and the routed experts follow EP (``simulate.py``).

``simulate.py`` then builds, on every simulated rank, meshes of the recorded dim names over that
rank's stage and a meta DTensor of torch's local shape for each key. Sequence parallelism moves
activations only (the same weights as TP), and expert TP is 1 in the Megatron-Bridge recipes of
the reference table; ``etp_size`` > 1 is refused (torch TP leaves routed experts whole).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from transformers import AutoModelForCausalLM

from nemo_moe_export.errors import InputError
from nemo_moe_export.job.tensor_parallel import parallelize_tp_fsdp

__all__ = ["MODEL_PARALLEL_STRATEGIES", "ModelParallel", "check_model_parallel", "model_parallel_of",
           "recorded_placements"]

MODEL_PARALLEL_STRATEGIES = ("fsdp", "ep")
"""The strategies TP / CP are planned with: TP x FSDP2 (torchtitan) and TP x EP with DP replicas (Megatron-Bridge)."""


@dataclass(frozen=True)
class ModelParallel:
    """The dims that split one model replica (pipeline stages apart)."""

    tp: int = 1
    cp: int = 1
    etp: int = 1
    sequence_parallel: bool = False

    def root(self, stage_ranks: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Shape and dim names of one stage's root mesh: ``("dp", "cp", "tp")``, sizes 1 left out but "dp"."""
        dims = [("dp", stage_ranks // (self.tp * self.cp)), ("cp", self.cp), ("tp", self.tp)]
        kept = [(n, s) for n, s in dims if s > 1 or n == "dp"]
        return tuple(s for _, s in kept), tuple(n for n, _ in kept)

    def describe(self) -> dict[str, Any]:
        return dict(tp_size=self.tp, cp_size=self.cp, etp_size=self.etp, sequence_parallel=self.sequence_parallel)


def model_parallel_of(parallel: Any) -> ModelParallel:
    size = lambda name: int(getattr(parallel, name, 1) or 1)  # noqa: E731
    return ModelParallel(size("tp_size"), size("cp_size"), size("etp_size"),
                         bool(getattr(parallel, "sequence_parallel", False)))


def check_model_parallel(parallel: Any, stage_ranks: int, where: str) -> None:
    """TP, CP, ETP and SP fit the layout (``where``: " of a pipeline stage" or "")."""
    mp = model_parallel_of(parallel)
    for name, value in (("tp_size", mp.tp), ("cp_size", mp.cp), ("etp_size", mp.etp)):
        if value < 1:
            raise InputError("must be positive", key=f"parallel.{name}", expected=">= 1", actual=value)
    if mp.etp != 1:
        raise InputError("expert tensor parallelism is not planned", key="parallel.etp_size", expected=1,
                         actual=mp.etp, hint="torch TP leaves routed experts whole; the Megatron-Bridge "
                                             "recipes run ETP 1")
    if mp.sequence_parallel and mp.tp == 1:
        raise InputError("sequence parallelism needs tensor parallelism", key="parallel.sequence_parallel",
                         expected="tp_size > 1", actual="tp_size=1", hint="megatron-core refuses SP without TP")
    if mp.tp * mp.cp == 1:
        return
    if parallel.strategy not in MODEL_PARALLEL_STRATEGIES:
        raise InputError("TP and CP are planned with the fsdp and ep layouts only", key="parallel.strategy",
                         expected=MODEL_PARALLEL_STRATEGIES, actual=parallel.strategy)
    if stage_ranks % (mp.tp * mp.cp):
        raise InputError("tp_size x cp_size must divide the ranks" + where, key="parallel.tp_size",
                         expected=f"a divisor of {stage_ranks}", actual=f"{mp.tp} x {mp.cp}")


def recorded_placements(meta: Any, parallel: Any, stage_ranks: int, become: Any
                        ) -> dict[str, tuple[tuple[str, ...], tuple] | None]:
    """Every simulated key's mesh dim names and placements as torch lays the model out (module
    docstring); None for a plain tensor. Runs as rank 0 of ``stage_ranks`` in the fake process
    group (``become``); cached per model and layout."""
    mp = model_parallel_of(parallel)
    key = ("model parallel", mp, parallel.strategy, stage_ranks)
    if key not in meta.plans:
        become(0, stage_ranks)
        meta.plans[key] = _lay_out(meta, mp, parallel.strategy, stage_ranks)
    return meta.plans[key]


def _lay_out(meta: Any, mp: ModelParallel, strategy: str, stage_ranks: int) -> dict:
    model = _representative_model(meta)
    shape, names = mp.root(stage_ranks)
    root = init_device_mesh("cpu", shape, mesh_dim_names=names)
    parallelize_tp_fsdp(model, root, fsdp=strategy == "fsdp")
    state_dict = model.state_dict()
    out: dict[str, tuple[tuple[str, ...], tuple] | None] = {}
    for name, tensor in meta.simulated.items():
        got = state_dict.get(name)
        if got is None or tuple(got.shape) != tuple(tensor.shape):
            raise RuntimeError(f"the planner's layout model differs from the model at {name} (a planner defect)")
        if not isinstance(got, DTensor) or (strategy == "ep" and name in meta.experts):
            out[name] = None  # plain; EP places the routed experts (ranks.Layout)
        elif strategy == "ep":  # TP over "tp", copies over the data-parallel and CP dims
            placements = dict(zip(got.device_mesh.mesh_dim_names, got.placements))
            out[name] = (names, tuple(placements.get(n, Replicate()) for n in names))
        else:
            out[name] = (tuple(got.device_mesh.mesh_dim_names), tuple(got.placements))
    return out


def _representative_model(meta: Any) -> Any:
    """The model's first ``max(representative layer) + 1`` decoder layers on the meta device: every
    representative layer under its own name (layer kinds depend on the index only: dense first
    layers, sparse steps), and the embedding, final norm and ``lm_head``."""
    config = copy.deepcopy(meta.config)
    layers = max(meta.members) + 1 if meta.members else 0
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    dtype = next(iter(meta.state_dict.values())).dtype
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
