"""Training checkpoints of a megatron-core model: megatron's own ``dist_checkpointing``.

The export's view (``MegatronCausalLM.state_dict()``) names experts by local index, which repeats
on every EP rank, so it must never go to torch DCP (which would merge the different experts of one
local name into one tensor). A training checkpoint is megatron's sharded state dict instead, with
global expert ids, readable on another EP size (docs/design.md#megatron-core-models).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["load_training_checkpoint", "save_training_checkpoint"]


def save_training_checkpoint(model: Any, path: str | os.PathLike[str]) -> None:
    """``dist_checkpointing.save`` of ``model.gpt.sharded_state_dict()`` into ``path`` (every rank)."""
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(model.gpt.sharded_state_dict(), os.fspath(path))


def load_training_checkpoint(model: Any, path: str | os.PathLike[str]) -> None:
    """Fill ``model.gpt`` from a checkpoint :func:`save_training_checkpoint` wrote (every rank)."""
    from megatron.core import dist_checkpointing

    model.gpt.load_state_dict(dist_checkpointing.load(model.gpt.sharded_state_dict(), os.fspath(path)))
