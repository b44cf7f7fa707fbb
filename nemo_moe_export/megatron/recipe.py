"""The recipe's megatron-core model: ``parallel_state`` from the ``parallel`` group, a tiny
``GPTModel`` from the ``model`` group (``backend: megatron_core``), wrapped for the hooks.

``recipe/trainer.py`` calls :func:`build_recipe_model` in place of building and sharding a
transformers model: megatron-core shards while it builds (each EP rank creates only its experts),
so ``parallel_state`` comes first. On CPU ranks the stand-ins of ``cpu_patches`` are applied here,
the one product path that does, and on GPU ranks without Transformer Engine its three TE stand-ins
(docs/design.md#megatron-core-models).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.parallel import ParallelLayout, dist_info

__all__ = ["build_recipe_model"]

logger = logging.getLogger(__name__)

FAMILIES = {"deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "qwen3_moe": "qwen3_moe"}


def build_recipe_model(model_cfg: Any, parallel_cfg: Any, *, vocab_size: int, device: str = "cpu") -> tuple[Any, ParallelLayout]:
    """``(MegatronCausalLM, layout)`` on every rank: EP over groups of ``parallel.ep_size`` ranks,
    data parallel over the rest; weights from the model seed and their HF names (any EP size
    gives the same model)."""
    _check(model_cfg, parallel_cfg)
    from nemo_moe_export.megatron import cpu_patches

    if device == "cpu":
        cpu_patches.apply()
    elif not cpu_patches.have_transformer_engine():
        applied = cpu_patches.apply_without_te()
        logger.warning("megatron-core without Transformer Engine: applying %s", "; ".join(applied))
    from megatron.core import parallel_state

    from nemo_moe_export.megatron import MegatronCausalLM
    from nemo_moe_export.megatron.tiny import build_gpt, init_by_hf_name, tiny_transformer_config

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=parallel_cfg.ep_size,
                                                 distributed_timeout_minutes=parallel_cfg.timeout_s / 60)
    if device != "cpu":  # megatron-core's attention forks the CUDA RNG tracker, which this seeds
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(model_cfg.seed)
    family = FAMILIES[model_cfg.family]
    config = tiny_transformer_config(
        family, n_experts=model_cfg.n_experts, hidden_size=model_cfg.hidden_size,
        moe_ffn_hidden_size=model_cfg.moe_intermediate_size, num_layers=model_cfg.num_layers,
        dispatcher=model_cfg.dispatcher, dtype=getattr(torch, model_cfg.dtype))
    gpt = build_gpt(config, vocab_size=vocab_size).to(device)
    model = MegatronCausalLM(gpt, family=family)
    init_by_hf_name(model, seed=model_cfg.seed)
    return model, model.layout


def _check(model_cfg: Any, parallel_cfg: Any) -> None:
    """What megatron-core itself would assert, refused first with the config key to change."""
    if model_cfg.family not in FAMILIES:
        raise ExportInputError("no megatron-core layout for this family", key="model.family",
                               expected=sorted(FAMILIES), actual=repr(model_cfg.family))
    if parallel_cfg.strategy != "ep":
        raise ExportInputError("megatron-core models are sharded by parallel_state", key="parallel.strategy",
                               expected="'ep' (parallel=ep; ep_size=1 for data parallelism only)",
                               actual=repr(parallel_cfg.strategy))
    world = dist_info().world_size
    if world % parallel_cfg.ep_size or model_cfg.n_experts % parallel_cfg.ep_size:
        raise ExportInputError("megatron-core splits experts into equal EP blocks", key="parallel.ep_size",
                               expected=f"a divisor of the world ({world}) and of model.n_experts "
                                        f"({model_cfg.n_experts})", actual=parallel_cfg.ep_size)
