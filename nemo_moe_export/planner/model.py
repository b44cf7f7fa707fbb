"""What the planner plans for: a model on the meta device, from a config file, a preset or a recipe.

The model is built by transformers from its config on the ``meta`` device (no memory, a few
seconds for 671B parameters), so the planner sees the same module tree, state-dict keys, shapes,
dtypes, buffers and experts modules the training job has. What is rank-independent is worked out
here once (docs/design.md#planner):

* the full state dict (plain meta tensors: global shapes), hence the export plan;
* which keys are parameters, buffers and expert tensors (``expert_parallel.experts_modules``);
* the *layer groups*: decoder layers whose tensors have the same names, shapes and dtypes are
  sharded alike under every supported layout (each parameter is split on its own), so the ranks
  are simulated on the first layer of each group and every result is counted once per member
  layer. The groups are checked to cover every key of the plan exactly once.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from nemo_moe_export.adapters import get_adapter
from nemo_moe_export.config import ModelConfig, ParallelConfig
from nemo_moe_export.config import ARCHITECTURES, architecture, model_dtype
from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.options import MMLUOptions
from nemo_moe_export.expert_parallel import experts_modules
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.options import parse_dtype
from nemo_moe_export.job.compose import load_config, packaged_dir
from nemo_moe_export.tiny_models import tiny_config

__all__ = ["MetaModel", "PlanTarget", "build_meta_model", "from_config_file", "from_preset", "from_recipe",
           "hf_config_from_dict"]

_LAYER = re.compile(r"^(?P<head>(?:.*\.)?layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")


@dataclass
class PlanTarget:
    """A model and the parallel layout and export options of the job to plan."""

    name: str
    config: Any  # the HF config
    dtype: torch.dtype  # the parameter dtype of the trained model
    parallel: Any  # config.ParallelConfig
    export: Any  # ExportOptions
    world_size: int | None = None  # from a recipe's launcher, if any
    mmlu: Any = None  # MMLUOptions from a recipe


def hf_config_from_dict(values: Mapping[str, Any]) -> Any:
    """A transformers config from ``config.json`` values (``kimi_k2`` is DeepSeek-V3's class with
    its own ``model_type``, so the adapter picks the Kimi table)."""
    values = dict(values)
    model_type = values.pop("model_type", None)
    if not model_type:
        raise InputError("config.json has no model_type", key="model_type", expected="e.g. deepseek_v3",
                         actual=None)
    for unused in ("architectures", "auto_map", "quantization_config", "transformers_version"):
        values.pop(unused, None)  # the trained model is not quantized; remote code is not needed
    try:
        config = AutoConfig.for_model(architecture(model_type), **values)
    except ValueError as exc:
        raise InputError("transformers does not know this model type", key="model_type",
                         expected="a model_type transformers can build", actual=model_type) from exc
    config.model_type = model_type
    return config


def _dtype_of(config: Any, default: str = "float32") -> torch.dtype:
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or default
    return parse_dtype(name, key="torch_dtype", problem="unknown parameter dtype in the config",
                       expected="e.g. bfloat16")


def from_config_file(path: str | os.PathLike[str], parallel: Any, export: Any) -> PlanTarget:
    """A model from an HF ``config.json`` (or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError("cannot read the model's config.json", key=str(path), expected="a JSON file",
                         actual=f"{type(exc).__name__}: {exc}") from exc
    config = hf_config_from_dict(values)
    return PlanTarget(path.parent.name or str(path), config, _dtype_of(config), parallel, export)


def from_preset(name: str, parallel: Any, export: Any) -> PlanTarget:
    """A model preset of ``nemo_moe_export/conf/model`` (``deepseek_v3_tiny``, ...), as the recipe builds it."""
    path = Path(packaged_dir("conf")) / "model" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise InputError("unknown model preset", key=name, expected=f"one of {known}", actual=name)
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))
    return PlanTarget(name, _preset_config(cfg), model_dtype(cfg), parallel, export)


def _preset_config(cfg: Any, vocab_size: int = 256) -> Any:
    """The HF config ``tiny_models.build_model`` builds for a model preset (vocab: the recipe's
    tokenizer's size is only known at run time; 256 stands in)."""
    if cfg.backend != "transformers":
        raise InputError("the planner builds transformers models only", key="model.backend",
                         expected="transformers", actual=cfg.backend)
    config = tiny_config(architecture(cfg.family), n_experts=cfg.n_experts, hidden_size=cfg.hidden_size,
                         moe_intermediate_size=cfg.moe_intermediate_size, num_layers=cfg.num_layers,
                         vocab_size=vocab_size)
    if cfg.family in ARCHITECTURES:
        config.model_type = cfg.family  # the adapter table is the family's own
    return config


def from_recipe(recipe: str, overrides: list[str], config_dirs: list[str] = ()) -> PlanTarget:
    """A recipe's model, parallel layout and export options, composed as the job composes them."""
    cfg = load_config(recipe, list(overrides), list(config_dirs))
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model))
    parallel = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParallelConfig), cfg.parallel))
    export = {k: v for k, v in OmegaConf.to_container(cfg.export, resolve=True).items()
              if k in ExportOptions.__dataclass_fields__}
    mmlu = {k: v for k, v in OmegaConf.to_container(cfg.mmlu, resolve=True).items()
            if k in MMLUOptions.__dataclass_fields__}
    return PlanTarget(str(cfg.name), _preset_config(model), model_dtype(model), parallel,
                      ExportOptions.of(export), mmlu=MMLUOptions.of(mmlu))


@dataclass
class MetaModel:
    """The model on the meta device and what the planner derives from it once."""

    model: Any
    config: Any
    adapter: Any
    state_dict: dict[str, torch.Tensor]  # global shapes, plain meta tensors
    buffers: frozenset[str]
    experts: frozenset[str]  # fused expert tensors (what expert parallelism distributes)
    members: dict[int, tuple[int, ...]] = field(default_factory=dict)  # representative layer -> its group
    plans: dict[str, Any] = field(default_factory=dict)  # export options -> (plan, expansion), see simulate.py

    @property
    def simulated(self) -> dict[str, torch.Tensor]:
        """The keys the ranks are simulated on: everything outside the decoder layers and the
        representative layer of each group."""
        keep = {}
        for key, tensor in self.state_dict.items():
            m = _LAYER.match(key)
            if m is None or int(m.group("layer")) in self.members:
                keep[key] = tensor
        return keep

    def multiplicity(self, key: str) -> tuple[int, ...] | None:
        """The member layers an HF or in-memory key of a representative layer stands for (None:
        a key outside the layers, counted once)."""
        m = _LAYER.match(key)
        if m is None:
            return None
        return self.members[int(m.group("layer"))]

    @staticmethod
    def member_key(key: str, layer: int) -> str:
        """``key`` (of a representative layer) in layer ``layer``."""
        m = _LAYER.match(key)
        return f"{m.group('head')}{layer}.{m.group('rest')}"


def build_meta_model(config: Any, dtype: torch.dtype) -> MetaModel:
    """Build the model from ``config`` on the meta device (as the recipe builds it, in ``dtype``)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state_dict = dict(model.state_dict())
    buffers = frozenset(name for name, _ in model.named_buffers() if name in state_dict)
    experts = frozenset(f"{name}.{p}" for name in experts_modules(model) for p in ("gate_up_proj", "down_proj"))
    meta = MetaModel(model, config, get_adapter(config), state_dict, buffers, experts & set(state_dict))
    meta.members = _layer_groups(state_dict, buffers, meta.experts)
    return meta


def _layer_groups(state_dict: Mapping[str, torch.Tensor], buffers: frozenset[str], experts: frozenset[str]
                  ) -> dict[int, tuple[int, ...]]:
    """Decoder layers grouped by their tensors' relative names, shapes, dtypes and kinds; the
    first layer of each group represents it."""
    signatures: dict[int, list] = {}
    for key, tensor in state_dict.items():
        m = _LAYER.match(key)
        if m is not None:
            kind = "expert" if key in experts else "buffer" if key in buffers else "param"
            signatures.setdefault(int(m.group("layer")), []).append(
                (m.group("head"), m.group("rest"), tuple(tensor.shape), tensor.dtype, kind))
    groups: dict[tuple, list[int]] = {}
    for layer in sorted(signatures):
        groups.setdefault(tuple(sorted(signatures[layer], key=repr)), []).append(layer)
    return {members[0]: tuple(members) for members in groups.values()}
