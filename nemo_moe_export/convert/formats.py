"""Which key table reads which stored format, and the HF config a format records.

One declarative table (docs/design.md#checkpoint-conversion): ``index.format`` (what
``index.detect_format`` found in the checkpoint's own files) -> the factory of its key table
(``tables.CheckpointTable``) and, where the format records the model's HF config, how to read it.
``register_table`` adds a format of your own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_moe_export.convert.automodel import automodel_table
from nemo_moe_export.convert.index import CheckpointIndex
from nemo_moe_export.convert.megatron import FORMAT as MEGATRON, MegatronTorchDistTable
from nemo_moe_export.convert.megatron_config import config_from_checkpoint
from nemo_moe_export.convert.tables import CheckpointTable
from nemo_moe_export.convert.torchtitan import torchtitan_table
from nemo_moe_export.convert.transformers_keys import FORMAT as TRANSFORMERS, TransformersTable
from nemo_moe_export.errors import InputError

__all__ = ["FORMATS", "recorded_config", "register_table", "table_for"]

TableFactory = Callable[[CheckpointIndex, Any], CheckpointTable]

# format -> (its table's factory(index, hf_config), the HF config it records (index -> config) or None)
FORMATS: dict[str, tuple[TableFactory, Callable[[CheckpointIndex], Any] | None]] = {
    MEGATRON: (MegatronTorchDistTable, config_from_checkpoint),
    "torchtitan": (torchtitan_table, None),
    "automodel": (automodel_table, None),
    TRANSFORMERS: (TransformersTable, None),  # this repo's own trainer checkpoints
}


def register_table(format: str, factory: TableFactory,
                   recorded_config: Callable[[CheckpointIndex], Any] | None = None) -> None:
    """Read checkpoints of ``format`` (as ``index.detect_format`` names it) with ``factory``'s table."""
    FORMATS[format] = (factory, recorded_config)


def recorded_config(index: CheckpointIndex) -> Any:
    """The HF config the checkpoint itself records, or None where its format records none."""
    derive = FORMATS.get(index.format, (None, None))[1]
    return None if derive is None else derive(index)


def table_for(index: CheckpointIndex, hf_config: Any) -> CheckpointTable:
    """The key table of ``index.format`` for a model of ``hf_config``."""
    if index.format not in FORMATS:
        raise InputError("no key table for this checkpoint format", key=index.format,
                         expected=f"one of {sorted(FORMATS)}", actual=index.format)
    return FORMATS[index.format][0](index, hf_config)
