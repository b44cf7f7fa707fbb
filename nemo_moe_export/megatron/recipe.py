"""The recipe's megatron-core model: ``parallel_state`` from the ``parallel`` group, a tiny
``GPTModel`` from the ``model`` group (``backend: megatron_core``), wrapped for the hooks.

``job/trainer.py`` calls :func:`build_recipe_model` in place of building and sharding a
transformers model: megatron-core shards while it builds (each EP rank creates only its experts,
each pipeline rank only its stage), so ``parallel_state`` comes first. On CPU ranks the stand-ins
of ``cpu_patches`` are applied here, the one product path that does, and on GPU ranks without
Transformer Engine its TE stand-ins (docs/design.md#megatron-core-models).

With ``parallel.pp_size`` > 1 (``parallel=pp_ep``) ``parallel_state`` has ``pp_size`` pipeline
ranks, each building its stage with megatron's own split of the layers (:func:`pipeline_split`:
``parallel.layers_per_stage``, or the recipe's default split, as megatron's
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``); the trainer then
trains through ``MegatronCausalLM.train_step`` (megatron's 1F1B schedule) in
``parallel.microbatches`` microbatches (0: twice the stages, as for torch stages). Virtual
pipeline stages (``parallel.stages_per_rank`` > 1) are refused
(docs/design.md#pipeline-stages-megatron-core).
"""

from __future__ import annotations

import logging
from typing import Any

from nemo_moe_export.config import architecture, model_dtype
from nemo_moe_export.errors import InputError
from nemo_moe_export.megatron import MegatronCausalLM, cpu_patches
from nemo_moe_export.megatron.tiny import build_gpt, init_by_hf_name, tiny_transformer_config
from nemo_moe_export.parallel import ParallelLayout, dist_info

__all__ = ["build_recipe_model", "check_megatron_pipeline", "pipeline_split", "recipe_microbatches"]

logger = logging.getLogger(__name__)

FAMILIES = ("deepseek_v3", "kimi_k2", "qwen3_moe")  # built as config.architecture(family)


def build_recipe_model(model_cfg: Any, parallel_cfg: Any, *, vocab_size: int, device: str = "cpu") -> tuple[Any, ParallelLayout]:
    """``(MegatronCausalLM, layout)`` on every rank: ``parallel.pp_size`` pipeline stages, EP over
    groups of ``parallel.ep_size`` ranks of a stage, data parallel over the rest; weights from the
    model seed and their HF names (any EP or PP size gives the same model)."""
    _check(model_cfg, parallel_cfg)
    if device == "cpu":
        cpu_patches.apply()
    elif not cpu_patches.have_transformer_engine():
        applied = cpu_patches.apply_without_te()
        logger.warning("megatron-core without Transformer Engine: applying %s", "; ".join(applied))
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=parallel_cfg.pp_size,
                                                 expert_model_parallel_size=parallel_cfg.ep_size,
                                                 distributed_timeout_minutes=parallel_cfg.timeout_s / 60)
    if device != "cpu":  # megatron-core's attention forks the CUDA RNG tracker, which this seeds
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(model_cfg.seed)
    family = architecture(model_cfg.family)
    config = tiny_transformer_config(
        family, n_experts=model_cfg.n_experts, hidden_size=model_cfg.hidden_size,
        moe_ffn_hidden_size=model_cfg.moe_intermediate_size, num_layers=model_cfg.num_layers,
        dispatcher=model_cfg.dispatcher, dtype=model_dtype(model_cfg), pipeline_size=parallel_cfg.pp_size,
        **pipeline_split(model_cfg.num_layers, parallel_cfg.pp_size, parallel_cfg.layers_per_stage))
    gpt = build_gpt(config, vocab_size=vocab_size).to(device)
    model = MegatronCausalLM(gpt, family=family, microbatches=recipe_microbatches(parallel_cfg))
    init_by_hf_name(model, seed=model_cfg.seed)
    return model, model.layout


def _check(model_cfg: Any, parallel_cfg: Any) -> None:
    """What megatron-core itself would assert, refused first with the config key to change."""
    if model_cfg.family not in FAMILIES:
        raise InputError("no megatron-core layout for this family", key="model.family",
                         expected=sorted(FAMILIES), actual=repr(model_cfg.family))
    if parallel_cfg.strategy != "ep":
        raise InputError("megatron-core models are sharded by parallel_state", key="parallel.strategy",
                         expected="'ep' (parallel=ep; ep_size=1 for data parallelism only)",
                         actual=repr(parallel_cfg.strategy))
    check_megatron_pipeline(parallel_cfg, model_cfg)
    world = dist_info().world_size
    if world % parallel_cfg.pp_size:
        raise InputError("the pipeline size must divide the ranks", key="parallel.pp_size",
                         expected=f"a divisor of the world ({world})", actual=parallel_cfg.pp_size)
    stage_ranks = world // parallel_cfg.pp_size
    if stage_ranks % parallel_cfg.ep_size or model_cfg.n_experts % parallel_cfg.ep_size:
        raise InputError("megatron-core splits experts into equal EP blocks", key="parallel.ep_size",
                         expected=f"a divisor of the ranks of a stage ({stage_ranks}) and of model.n_experts "
                                  f"({model_cfg.n_experts})", actual=parallel_cfg.ep_size)


def check_megatron_pipeline(parallel_cfg: Any, model_cfg: Any) -> None:
    """What megatron-core's pipeline cannot take from the ``parallel`` group, refused with the key
    to change: virtual stages (``stages_per_rank`` > 1) and a split of the layers its
    first/last-stage sizes cannot express (:func:`pipeline_split`)."""
    if parallel_cfg.stages_per_rank > 1:
        raise InputError("virtual pipeline stages are not supported for megatron-core models",
                         key="parallel.stages_per_rank",
                         expected="1 (MegatronCausalLM wraps one model chunk per pipeline rank)",
                         actual=parallel_cfg.stages_per_rank,
                         hint="docs/design.md#pipeline-stages-megatron-core")
    pipeline_split(model_cfg.num_layers, parallel_cfg.pp_size, parallel_cfg.layers_per_stage)


def pipeline_split(num_layers: int, pp_size: int, layers_per_stage: Any = None) -> dict[str, int]:
    """megatron's ``TransformerConfig`` fields for the recipe's split of ``num_layers`` decoder
    layers over ``pp_size`` stages: ``layers_per_stage``, or the recipe's default (as even as
    possible, earlier stages taking the remainder, as for torch stages). An even split is
    megatron's default (no field); otherwise ``num_layers_in_first_pipeline_stage`` and
    ``num_layers_in_last_pipeline_stage``, with which megatron splits the rest evenly over the
    middle stages, so a split whose middle stages differ is refused."""
    if pp_size <= 1:
        return {}
    if layers_per_stage:
        counts = [int(c) for c in layers_per_stage]
    else:
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (i < extra) for i in range(pp_size)]
    if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
        raise InputError("parallel.layers_per_stage does not split the decoder layers",
                         key="parallel.layers_per_stage",
                         expected=f"{pp_size} counts >= 1 summing to model.num_layers={num_layers}",
                         actual=counts)
    if len(set(counts)) == 1:
        return {}
    if len(set(counts[1:-1])) > 1:
        raise InputError("megatron-core cannot split the decoder layers this way",
                         key="parallel.layers_per_stage",
                         expected="equal counts on the middle stages (megatron sets the first and last "
                                  "stages' counts and splits the rest evenly)", actual=counts)
    return {"num_layers_in_first_pipeline_stage": counts[0], "num_layers_in_last_pipeline_stage": counts[-1]}


def recipe_microbatches(parallel_cfg: Any) -> int:
    """The schedule's microbatch count: ``parallel.microbatches``, 0 meaning twice the stages (the
    count ``job/checks.py`` requires ``trainer.batch_size`` to divide)."""
    return parallel_cfg.microbatches or 2 * parallel_cfg.pp_size * parallel_cfg.stages_per_rank
