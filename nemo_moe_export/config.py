"""Typed configuration: the schemas behind the Hydra config groups in ``conf/``.

Every group (``model``, ``parallel``, ``trainer``, ``mmlu``, ``export``, ``data``) is a dataclass
registered in Hydra's ConfigStore, so Hydra itself checks types and rejects unknown keys (struct
mode) with its own error messages, before any rank starts work. Recipes in ``recipes/`` pick a
preset from each group and list the ordered ``stages`` to run.

A group's dataclass is its defaults: ``mmlu`` and ``export`` extend the components' own options
(``MMLUOptions``, ``ExportOptions``) with the recipe's fields only, and the YAML presets state only
what differs from the dataclass (docs/design.md#options-and-defaults; ``tests/test_defaults.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.options import MMLUOptions
from nemo_moe_export.export.options import ExportOptions, parse_dtype

__all__ = [
    "ARCHITECTURES", "BACKENDS", "DataConfig", "ExportConfig", "MMLUConfig", "ModelConfig", "ParallelConfig", "RecipeConfig",
    "STAGES", "TrainerConfig", "architecture", "model_dtype", "register_configs", "validate_config",
]

STAGES = ("train", "mmlu", "export", "verify")

# Model families (and HF model types) built with another family's architecture: kimi_k2 is the
# DeepSeek-V3 architecture, only its adapter lookup name differs (docs/design.md#placement-rules).
BACKENDS = ("transformers", "megatron_core")  # model.backend: who builds and runs the recipe's model
ARCHITECTURES = {"kimi_k2": "deepseek_v3"}


def architecture(family: str) -> str:
    """The family whose model / config classes build ``family`` (itself unless aliased)."""
    return ARCHITECTURES.get(family, family)


def model_dtype(model: Any) -> torch.dtype:
    """``model.dtype`` (a ``ModelConfig``'s parameter dtype) as a floating ``torch.dtype``."""
    problem, expected = "unknown parameter dtype", "float32 | bfloat16"
    if model.dtype is None:
        raise InputError(problem, key="model.dtype", expected=expected, actual=repr(model.dtype))
    return parse_dtype(model.dtype, key="model.dtype", problem=problem, expected=expected)


@dataclass
class ModelConfig:
    """A tiny MoE model built offline: a transformers model (``nemo_moe_export.tiny_models``) or,
    with ``backend: megatron_core``, a megatron-core ``GPTModel`` (``nemo_moe_export.megatron.tiny``)."""

    family: str = MISSING  # deepseek_v3 | kimi_k2 | kimi_linear | qwen3_moe
    backend: str = "transformers"  # transformers | megatron_core (deepseek_v3 / kimi_k2 / qwen3_moe)
    dispatcher: str = "alltoall"  # megatron_core: the MoE token dispatcher, alltoall | allgather
    n_experts: int = 6
    hidden_size: int = 64
    moe_intermediate_size: int = 32
    num_layers: int = 2
    seed: int = 0
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16


@dataclass
class ParallelConfig:
    """How the model is sharded over the ranks.

    ``fsdp``: ``fully_shard`` over all ranks. ``hsdp``: ``fully_shard`` on a
    (``replicate``, world / ``replicate``) mesh. ``ep``: experts split over EP groups of
    ``ep_size`` ranks (all-to-all token routing), the rest replicated. ``ep_fsdp``: EP for experts
    plus ``fully_shard`` of the dense part over all ranks.

    ``pp_size`` > 1 adds pipeline stages in front (docs/design.md#pipeline-stages): the world is
    ``pp_size`` pipeline ranks x the strategy's ranks, each pipeline rank holding
    ``stages_per_rank`` stages ("loop" order: rank r holds stages r, r + pp_size, ...; more than
    one is virtual stages), and the strategy applies inside each stage over the ranks of that stage.
    ``layers_per_stage`` splits the decoder layers unevenly (default: as even as possible);
    ``microbatches`` is the schedule's count per batch (0: twice the stages, a bubble of
    ``(stages - 1) / (microbatches + stages - 1)``).

    ``tp_size`` (tensor parallel), ``cp_size`` (context parallel), ``etp_size`` (expert tensor
    parallel, 1 in every Megatron-Bridge recipe of docs/design.md#planner) and
    ``sequence_parallel`` (activations only: no weight moves) describe meshes the planner plans
    (``nemo-moe-export plan --tp --cp --etp --sp``); the recipe runs none of them yet and refuses
    them (``job/checks.py``).
    """

    strategy: str = "fsdp"
    ep_size: int = 1
    replicate: int = 1
    pp_size: int = 1
    stages_per_rank: int = 1
    layers_per_stage: Optional[list[int]] = None
    microbatches: int = 0
    tp_size: int = 1
    cp_size: int = 1
    etp_size: int = 1
    sequence_parallel: bool = False
    timeout_s: float = 300.0
    # auto: one GPU per rank (NCCL) when every local rank has a GPU, else CPU (gloo) | cuda | cpu
    device: str = "auto"


@dataclass
class TrainerConfig:
    max_steps: int = 200
    batch_size: int = 16  # per rank
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    grad_clip: float = 1.0
    log_every: int = 10
    seed: int = 0
    progress: bool = True
    save_checkpoint: bool = True  # the sharded DCP checkpoint {run_dir}/checkpoint (export.from_checkpoint)


@dataclass
class MMLUConfig(MMLUOptions):
    """The ``mmlu`` group: :class:`MMLUOptions` plus where the recipe's data comes from."""

    enabled: bool = True
    data_path: Optional[str] = None  # None: the synthetic corpus the recipe writes


@dataclass
class ExportConfig(ExportOptions):
    """The ``export`` group: :class:`ExportOptions` plus where the recipe writes and reads."""

    output_dir: Optional[str] = None  # None: {run_dir}/hf
    from_checkpoint: Optional[str] = None  # run export/verify alone on a saved training checkpoint


@dataclass
class DataConfig:
    seed: int = 0
    n_train: int = 400
    n_dev: int = 5
    n_test: int = 50
    subjects: Optional[list[str]] = None


@dataclass
class RecipeConfig:
    name: str = "recipe"
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    run_dir: str = "runs/${name}"
    model: ModelConfig = MISSING
    parallel: ParallelConfig = MISSING
    trainer: TrainerConfig = MISSING
    mmlu: MMLUConfig = MISSING
    export: ExportConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)


def validate_config(cfg: Any, schema: type = None, prefix: str = "") -> None:
    """Refuse keys the schemas do not declare.

    Hydra rejects ``trainer.typo=1`` itself, but its ``+trainer.typo=1`` append syntax opens the
    node on purpose; a key no code reads would then be silently ignored, so it is refused here.
    """
    schema = schema or RecipeConfig
    declared = {f.name: f for f in fields(schema)}
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if key not in declared:
            raise InputError("unknown config key", key=name, expected=f"one of {sorted(declared)}",
                             actual=repr(key), hint="check the spelling; the schemas are in nemo_moe_export/config.py")
        node = cfg.get(key)
        nested = _dataclass_type(declared[key].type)
        if nested is not None and isinstance(node, DictConfig):
            validate_config(node, nested, prefix=f"{name}.")


def _dataclass_type(annotation: Any) -> type | None:
    hints = {"ModelConfig": ModelConfig, "ParallelConfig": ParallelConfig, "TrainerConfig": TrainerConfig,
             "MMLUConfig": MMLUConfig, "ExportConfig": ExportConfig, "DataConfig": DataConfig}
    return hints.get(annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))


def register_configs() -> None:
    """Register the schemas with Hydra: ``schema`` for recipes, ``<group>/schema`` for presets."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=RecipeConfig)
    for group, node in (("model", ModelConfig), ("parallel", ParallelConfig), ("trainer", TrainerConfig),
                        ("mmlu", MMLUConfig), ("export", ExportConfig)):
        cs.store(group=group, name="schema", node=node)
