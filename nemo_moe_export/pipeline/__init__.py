"""Pipeline parallelism with torch stages, the AutoModel / torchtitan way (docs/design.md#pipeline-stages).

    from datetime import timedelta
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from nemo_moe_export.evaluate import evaluate_mmlu
    from nemo_moe_export.parallel import discover_layout
    from nemo_moe_export.pipeline import PipelinedCausalLM, pipeline_train_step, split_stages, stage_ids

    gloo = dist.ProcessGroupGloo._Options(); gloo._timeout = timedelta(seconds=300)  # pipeline waits end here
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"), backend_override={"pp": ("gloo", gloo)})
    pp = mesh["pp"].get_group()
    mine = stage_ids(dist.get_rank(pp), pp_size=2, stages_per_rank=2)      # rank r: stages r, r+2 (loop order)
    stages = split_stages(hf_model, n_stages=4)                            # every stage; keep only ours
    parts = [stages[i] for i in mine]
    for part in parts:                                                     # FSDP2 inside each stage
        for layer in part.model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
    model = PipelinedCausalLM(parts, mine, n_stages=4, pipeline_group=pp, n_microbatches=4)

    loss = pipeline_train_step(model, input_ids, labels, loss_fn, optimizer=opt)   # interleaved 1F1B
    logits = model(input_ids, attention_mask=mask, logits_to_keep=1).logits        # on every PP rank
    result = evaluate_mmlu(model, tokenizer, questions, dev, discover_layout(mesh))
    model.state_dict()                          # this rank's stages, original names (model.layers.3...)

* :func:`split_stages` / :func:`stage_ids`: stage modules (copies keeping their layers under the
  original names, a forward of their own) and which a rank holds.
* :class:`PipelinedCausalLM`: this rank's stages as one transformers-style model; forward-only
  schedules (``ScheduleGPipe``, ``ScheduleLoopedBFS`` with virtual stages), logits broadcast over
  the PP group; a failing stage is named on every rank of the pipeline.
* :func:`pipeline_train_step`: ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``, the loss on every rank.

Supported: the transformers DeepSeek-V3 (and Kimi K2), Qwen3-MoE and Kimi Linear CausalLMs, any
sharding inside a stage (FSDP2, expert parallelism); shared-prefix MMLU evaluation is off under
pipeline parallelism (no KV cache per stage), with the reason in ``MMLUResult.scoring``.
"""

from nemo_moe_export.pipeline.model import CACHED_SHAPES, PipelinedCausalLM, PipelineError, pipeline_train_step
from nemo_moe_export.pipeline.stages import (
    SUPPORTED_MODEL_TYPES,
    PipelineStageError,
    StageInfo,
    kept_positions,
    split_stages,
    stage_forward,
    stage_ids,
    stage_info,
)

__all__ = [
    "CACHED_SHAPES",
    "SUPPORTED_MODEL_TYPES",
    "PipelineError",
    "PipelineStageError",
    "PipelinedCausalLM",
    "StageInfo",
    "kept_positions",
    "pipeline_train_step",
    "split_stages",
    "stage_forward",
    "stage_ids",
    "stage_info",
]
