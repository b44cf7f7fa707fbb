"""This repo's own trainer checkpoints: torch DCP of a transformers model's in-memory state dict.

The recipe's trainer saves ``model.state_dict()`` with ``dcp.save`` (``job/stages.py``): transformers'
in-memory keys, fused experts included (``mlp.experts.gate_up_proj`` of shape ``(E, 2F, H)``), each
stored box a box of one in-memory tensor at its global offsets. The table maps a box through the
very adapter the in-job export uses (``get_adapter(config).box_pieces``), so the conversion writes
what the export of the same weights writes (docs/design.md#checkpoint-conversion).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_moe_export.adapters import HFShard, TensorMeta, get_adapter
from nemo_moe_export.convert.index import CheckpointIndex
from nemo_moe_export.errors import InputError
from nemo_moe_export.placement import LocalBox

__all__ = ["FORMAT", "TransformersTable"]

FORMAT = "transformers"  # what index.detect_format names it (by transformers' fused experts keys)


class TransformersTable:
    """The ``CheckpointTable`` of a DCP checkpoint of transformers' in-memory keys (module doc)."""

    format = FORMAT

    def __init__(self, index: CheckpointIndex, hf_config: Any) -> None:
        self.adapter = get_adapter(hf_config)
        if index.other:
            other = sorted(index.other)
            raise InputError("the trainer checkpoint holds entries that are not the model's tensors", key=other[0],
                             expected="only the model's state dict (what the recipe's trainer saves)",
                             actual=other[:8])
        self._shapes = {key: tuple(t.shape) for key, t in index.tensors.items()}

    def skipped(self, key: str) -> bool:
        return False  # the trainer saves the model's state dict alone

    def hf_metadata(self, index: CheckpointIndex) -> dict[str, TensorMeta]:
        view = {key: torch.empty(t.shape, dtype=t.dtype, device="meta") for key, t in index.tensors.items()}
        return self.adapter.hf_metadata(view)

    def pieces(self, key: str, offsets: tuple[int, ...], tensor: torch.Tensor) -> list[HFShard]:
        return self.adapter.box_pieces(key, LocalBox(self._shapes[key], tuple(offsets), tensor, True))
