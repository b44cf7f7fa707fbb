"""The adapter protocol: what the export, the loaders and the hooks may rely on of a state-dict adapter.

An adapter maps one model's in-memory state dict (possibly sharded: DTensors, expert-parallel
shards, pipeline stage modules) to Hugging Face tensor names and back, for the part each rank holds:

* ``hf_metadata`` / ``hf_source_keys``: every HF key the model maps to, with its global shape and
  dtype (:class:`TensorMeta`) and the in-memory key it comes from; from global shapes only, so the
  same on every rank without communicating;
* ``to_hf``: this rank's parts of those tensors, one :class:`HFShard` per HF key, as views;
* ``from_hf``: fill this rank's tensors in place from HF weights, reading only its slices, and say
  what was read (:class:`LoadReport`); checkpoint tensors the model has no parameter for are kept in
  ``passthrough`` (docs/design.md#pass-through-tensors).

:class:`BaseStateDictAdapter` is that surface; ``engine.StateDictAdapter`` is the one implementation
(one engine over one table per model family). This module is the bottom layer of ``adapters/``: it
imports nothing of the package, and every other module of it (and the export) imports these records
from here.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BaseStateDictAdapter", "HFShard", "LoadReport", "TensorMeta"]


@dataclass(frozen=True)
class TensorMeta:
    """Global shape and dtype of one HF tensor; identical on every rank."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class HFShard:
    """One rank's part of one HF tensor.

    ``tensor`` is a view of the rank's own shard (HF orientation; possibly non-contiguous when
    the in-memory layout is transposed relative to HF). It covers ``offsets[d] : offsets[d] +
    tensor.shape[d]`` of a tensor of ``global_shape``. ``primary`` is True on exactly one of the
    ranks holding this same part, so writing only primaries writes each byte once. ``replica`` /
    ``replicas`` number the ranks holding this same part (``placement.LocalBox``; primary is holder 0),
    so the export can let every holder write a share of it (docs/design.md#replica-agreement).
    """

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor
    primary: bool
    source_key: str
    expert: int | None = None
    replica: int = 0
    replicas: int = 1


@dataclass
class LoadReport:
    """What ``from_hf`` read on this rank."""

    bytes_read: int = 0
    expert_bytes_read: int = 0
    slices_read: int = 0
    keys_filled: list[str] = field(default_factory=list)
    # Checkpoint tensors the model has no parameter for, kept as this rank's slice of each
    # (docs/design.md#pass-through-tensors); export_hf_checkpoint(..., extra=) writes them back.
    passthrough: dict[str, HFShard] = field(default_factory=dict)
    passthrough_bytes_read: int = 0


class BaseStateDictAdapter(ABC):
    """The surface of a state-dict adapter its callers use.

    ``config`` is the model's HF config (``text_config`` its text part, the config itself when it
    has none); ``passthrough`` what the last ``from_hf`` kept of checkpoint tensors the model has no
    parameter for, which an export with this adapter writes back. ``state_dict`` may be a state
    dict, a model, or this rank's list of pipeline stage modules.
    """

    config: Any
    text_config: Any
    passthrough: dict[str, HFShard]

    @abstractmethod
    def hf_metadata(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
        """Every HF key the model maps to, with its global shape and dtype (the same on every rank)."""

    @abstractmethod
    def hf_source_keys(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
        """``{hf_key: in-memory key}``: which state-dict tensor each HF tensor comes from."""

    @abstractmethod
    def to_hf(self, state_dict: Mapping[str, torch.Tensor] | Any, *,
              plain_replica: tuple[int, int] | None = None) -> dict[str, HFShard]:
        """The HF tensors (or parts of them) this rank holds, keyed by HF name, as views."""

    @abstractmethod
    def from_hf(self, state_dict: Mapping[str, torch.Tensor], source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
                *, strict: bool = True, allow_dtype_cast: bool = False, passthrough: bool = True,
                group: Any = None, pp_group: Any = None) -> LoadReport:
        """Fill ``state_dict`` in place from HF weights (a checkpoint directory, a ``.safetensors``
        file or an HF-keyed dict), each rank reading only the slices it holds; nothing is changed
        when the checkpoint does not fit."""
