"""Checkpoint-key tables: one per stored format, each mapping stored boxes to HF pieces.

The protocol every format's table implements; ``formats.py`` says which table reads which format
(docs/design.md#checkpoint-conversion). A table is pure: from global shapes and the HF config only,
so every rank computes the same HF metadata and pieces with no communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch

from nemo_moe_export.adapters import HFShard, TensorMeta
from nemo_moe_export.convert.index import CheckpointIndex, StoredChunk

__all__ = ["CheckpointTable", "meta_pieces"]


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


def meta_pieces(table: CheckpointTable, index: CheckpointIndex, chunks: Iterable[StoredChunk]) -> Iterator[HFShard]:
    """The pieces ``chunks`` give, from meta tensors: their keys, offsets and shapes, nothing read."""
    for chunk in chunks:
        box = torch.empty(chunk.sizes, dtype=index.tensors[chunk.key].dtype, device="meta")
        yield from table.pieces(chunk.key, chunk.offsets, box)
