"""The recipe's model split into pipeline stages (``parallel.pp_size`` > 1; docs/design.md#pipeline-stages).

The layout, as AutoModel and torchtitan lay out PP jobs: the world is ``pp_size`` pipeline ranks x
the ranks of one stage, on one ``init_device_mesh`` whose outermost dim is ``"pp"`` (so the ranks
of a stage are contiguous, as on a node). Inside a stage the strategy shards the stage's tensors as
``trainer.shard_model`` shards a whole model, on the stage's sub-mesh:

* ``fsdp``  ("pp", "dp_shard"); ``hsdp`` ("pp", "dp_replicate", "dp_shard");
* ``ep`` / ``ep_fsdp``  ("pp", "edp", "ep"): experts split over "ep"; with ``ep_fsdp`` the dense part
  is also ``fully_shard`` ed over the stage's ranks ("edp" x "ep" flattened).

Stages come from :func:`~nemo_moe_export.pipeline.split_stages` (each keeps its layers under their
original names); pipeline rank r keeps stages r, r + pp_size, ... and the rest is dropped before
sharding. The result is a :class:`~nemo_moe_export.pipeline.PipelinedCausalLM`, which the MMLU
evaluator and the export use like any model, and the layout read back from the mesh
(``discover_layout``: ``layout.pp`` is the pipeline group, ``layout.dp`` the stage's ranks).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from nemo_moe_export.config import ParallelConfig
from nemo_moe_export.expert_parallel import apply_expert_parallel, experts_modules
from nemo_moe_export.parallel import ParallelLayout, discover_layout
from nemo_moe_export.pipeline import PipelinedCausalLM, split_stages, stage_ids

__all__ = ["pipeline_mesh", "shard_pipelined", "stages_in_pipeline"]


def stages_in_pipeline(cfg: ParallelConfig) -> int:
    return cfg.pp_size * cfg.stages_per_rank


def pipeline_mesh(cfg: ParallelConfig, world: int, device: str) -> DeviceMesh:
    """The job's mesh: "pp" outermost, then the strategy's dims over the ranks of one stage."""
    per_stage = world // cfg.pp_size
    if cfg.strategy == "fsdp":
        shape, names = (per_stage,), ("dp_shard",)
    elif cfg.strategy == "hsdp":
        shape, names = (cfg.replicate, per_stage // cfg.replicate), ("dp_replicate", "dp_shard")
    else:  # ep, ep_fsdp
        shape, names = (per_stage // cfg.ep_size, cfg.ep_size), ("edp", "ep")
    # Every dim's group is made with parallel.timeout_s: gloo's point-to-point waits (the pipeline's
    # transfers) keep the timeout a group was made with. The groups flattened later get it from
    # bound_groups (job/trainer.py), which bounds their collectives.
    override = _with_timeout(device, cfg.timeout_s)
    return init_device_mesh(device, (cfg.pp_size, *shape), mesh_dim_names=("pp", *names),
                            backend_override={name: override for name in ("pp", *names)})


def _with_timeout(device: str, timeout_s: float) -> tuple[str, Any]:
    """A mesh dim's backend with ``parallel.timeout_s``: a stage blocked in a receive from a failed
    or stalled peer gives up then (a mesh's groups otherwise wait torch's default 30 minutes)."""
    if device == "cuda":
        options: Any = dist.ProcessGroupNCCL.Options()
        backend = "nccl"
    else:
        options, backend = dist.ProcessGroupGloo._Options(), "gloo"
    options._timeout = timedelta(seconds=timeout_s)
    return backend, options


def shard_pipelined(model: Any, cfg: ParallelConfig, world: int, *, device: str = "cpu",
                    shard_other_dtypes: Any = None) -> tuple[PipelinedCausalLM, ParallelLayout]:
    """``model`` split into stages, this rank's stages sharded inside the stage, wrapped as one
    model; the layout read from the mesh. ``shard_other_dtypes(module, mesh, ignored)`` gives
    modules of another dtype their own FSDP unit (``trainer._shard_other_dtype_modules``)."""
    mesh = pipeline_mesh(cfg, world, device)
    layout = discover_layout(mesh)
    n_stages = stages_in_pipeline(cfg)
    ids = stage_ids(layout.pp.rank, cfg.pp_size, cfg.stages_per_rank)
    stages = split_stages(model, n_stages, layers_per_stage=cfg.layers_per_stage)
    parts = [stages[i] for i in ids]
    del stages  # the other ranks' stages: never sharded, freed here
    for part in parts:
        _shard_stage(part, cfg, mesh, layout, shard_other_dtypes)
    microbatches = cfg.microbatches or 2 * n_stages
    return PipelinedCausalLM(parts, ids, n_stages, mesh["pp"].get_group(), microbatches), layout


def _shard_stage(part: Any, cfg: ParallelConfig, mesh: DeviceMesh, layout: ParallelLayout,
                 shard_other_dtypes: Any) -> None:
    """Shard one stage module over the ranks of its stage, as the strategy shards a whole model."""
    experts: set = set()
    if cfg.strategy in ("ep", "ep_fsdp"):
        if experts_modules(part):  # a stage of dense layers only has no experts to split
            apply_expert_parallel(part, layout)
        if cfg.strategy == "ep":
            return
        experts = {p for p in part.parameters() if isinstance(p, DTensor)}
        inner = mesh["edp", "ep"]._flatten("edp_ep")  # the group discover_layout flattened as dense DP
    else:
        inner = mesh["dp_shard"] if cfg.strategy == "fsdp" else mesh["dp_replicate", "dp_shard"]
    if shard_other_dtypes is not None:
        shard_other_dtypes(part, inner, experts or None)
    for layer in part.model.layers.values():
        fully_shard(layer, mesh=inner, ignored_params=experts or None)
    fully_shard(part, mesh=inner, ignored_params=experts or None)
