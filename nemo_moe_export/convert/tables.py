"""Checkpoint-key tables: one per stored format, each mapping stored boxes to HF pieces.

The protocol every format's table implements, and the registry that picks one for an index
(docs/design.md#checkpoint-conversion). A table is pure: from global shapes and the HF config only,
so every rank computes the same HF metadata and pieces with no communication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from nemo_moe_export.adapters import HFShard, TensorMeta
from nemo_moe_export.convert.index import CheckpointIndex
from nemo_moe_export.errors import InputError

__all__ = ["CheckpointTable", "recorded_config", "register_table", "table_for"]


@runtime_checkable
class CheckpointTable(Protocol):
    format: str

    def skipped(self, key: str) -> bool:
        """Optimizer / RNG / ``_extra_state`` / train state: matched by rule (never by suffix), never read."""

    def hf_metadata(self, index: CheckpointIndex) -> dict[str, TensorMeta]:
        """Every HF key with global shape and stored dtype; raises InputError naming any key that is
        neither skipped nor mapped, and any shape that disagrees with the HF config."""

    def pieces(self, key: str, offsets: tuple[int, ...], tensor: torch.Tensor) -> list[HFShard]:
        """One stored box (global offsets, its data) -> the HF pieces it holds (views of ``tensor``,
        ``primary=True``, ``source_key=key``); a box may feed several HF tensors and may be cut."""


# format -> factory(index, hf_config) -> table; each format's module registers itself on import.
_TABLES: dict[str, Callable[[CheckpointIndex, Any], CheckpointTable]] = {}
# the modules that register the tables, imported on first use (they import this module)
_TABLE_MODULES = ("nemo_moe_export.convert.megatron", "nemo_moe_export.convert.torchtitan",
                  "nemo_moe_export.convert.automodel")


# format -> the HF config its checkpoints record (megatron's common.pt), for a conversion given none
_CONFIGS: dict[str, Callable[[CheckpointIndex], Any]] = {}


def register_table(format: str, factory: Callable[[CheckpointIndex, Any], CheckpointTable],
                   recorded_config: Callable[[CheckpointIndex], Any] | None = None) -> None:
    _TABLES[format] = factory
    if recorded_config is not None:
        _CONFIGS[format] = recorded_config


def recorded_config(index: CheckpointIndex) -> Any:
    """The HF config the checkpoint itself records, or None where its format records none."""
    _load_tables()
    derive = _CONFIGS.get(index.format)
    return None if derive is None else derive(index)


def _load_tables() -> None:
    import importlib

    for name in _TABLE_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a missing dependency inside a table module is a real error
                raise


def table_for(index: CheckpointIndex, hf_config: Any) -> CheckpointTable:
    """The key table of ``index.format`` for a model of ``hf_config``."""
    _load_tables()
    factory = _TABLES.get(index.format)
    if factory is None:
        raise InputError("no key table for this checkpoint format", key=index.format,
                         expected=f"one of {sorted(_TABLES)}", actual=index.format)
    return factory(index, hf_config)
