"""State-dict adapters: one engine (``engine.py``) and one small table per model family (``tables.py``).

Layers, lowest first, each importing only those below it: ``protocol.py`` (the adapter protocol and
its records: ``BaseStateDictAdapter``, ``HFShard``, ``LoadReport``, ``TensorMeta``) <- ``sources.py``
(checkpoint readers) <- ``fp8.py`` (the FP8 block reader) <- ``passthrough.py`` (checkpoint tensors
the model has no parameter for) <- ``engine.py`` <- ``tables.py`` (transformers / NeMo AutoModel
names) and ``tables_megatron.py`` (megatron-core names; picked when the config carries an
``in_memory_format``, as the configs of ``nemo_moe_export.megatron`` do).

>>> adapter = get_adapter(model.config)          # picked by config.model_type
>>> shards = adapter.to_hf(model.state_dict())   # {hf_key: HFShard}, views of this rank's shards
>>> adapter.from_hf(model.state_dict(), "ckpt/") # fills this rank's shards, reading only its slices
"""

from __future__ import annotations

from typing import Any

from nemo_moe_export.adapters.engine import (
    InMemoryFormat,
    KeyRule,
    LocalExperts,
    ModelTable,
    StateDictAdapter,
    expert_rules,
    model_parts,
    state_dict_of,
)
from nemo_moe_export.adapters.protocol import BaseStateDictAdapter, HFShard, LoadReport, TensorMeta
from nemo_moe_export.adapters.sources import SafetensorsSource, TensorDictSource
from nemo_moe_export.adapters.tables import TABLES as _TRANSFORMERS_TABLES
from nemo_moe_export.adapters.tables_megatron import MEGATRON_TABLES
from nemo_moe_export.errors import InputError

__all__ = [
    "BaseStateDictAdapter",
    "HFShard",
    "InMemoryFormat",
    "KeyRule",
    "LoadReport",
    "LocalExperts",
    "ModelTable",
    "SafetensorsSource",
    "StateDictAdapter",
    "TensorDictSource",
    "TensorMeta",
    "expert_rules",
    "get_adapter",
    "get_table",
    "model_parts",
    "state_dict_of",
    "supported_model_types",
]

TABLES: tuple[ModelTable, ...] = (*_TRANSFORMERS_TABLES, *MEGATRON_TABLES)


def supported_model_types() -> list[str]:
    return sorted(t for table in TABLES for t in table.model_types)


def get_table(model_type: str) -> ModelTable:
    for table in TABLES:
        if model_type in table.model_types:
            return table
    raise InputError(
        "no state-dict adapter for this model_type",
        key=str(model_type),
        expected=f"one of {supported_model_types()}",
        actual=repr(model_type),
        hint="add a ModelTable for the family in nemo_moe_export/adapters/tables.py",
    )


def get_adapter(config: Any, model_type: str | None = None) -> StateDictAdapter:
    """The adapter for a model's HF config (a ``PretrainedConfig`` or a dict).

    A config with an ``in_memory_format`` (:class:`InMemoryFormat`, set by
    ``nemo_moe_export.megatron`` and never written to ``config.json``) names state dicts in another
    framework's names: the table ``"{naming}:{model_type}"`` is used, with the model's local experts.
    """
    if model_type is None:
        model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    in_memory = getattr(config, "in_memory_format", None)
    if in_memory is None:
        return StateDictAdapter(config, get_table(model_type))
    return StateDictAdapter(config, get_table(f"{in_memory.naming}:{model_type}"), local_experts=in_memory.local_experts)
