"""NeMo AutoModel's checkpoints: HF-keyed already, so each stored box is a box of the same HF tensor.

AutoModel 0.7.0 saves ``model/`` (beside ``optim/``, never read) through its own state-dict
adapter's ``to_hf``: HF names, experts one tensor each. By default as safetensors shards through
torch DCP's HF storage writer (each file a box of each of its tensors; ``index.py`` reads the boxes
from the headers), with ``model_save_format: torch_save`` as a DCP checkpoint
(docs/design.md#checkpoint-conversion). Every key must be one the HF config's model has: the
engine's shape check names any other.
"""

from __future__ import annotations

from typing import Any

from nemo_moe_export.convert.index import CheckpointIndex
from nemo_moe_export.convert.rules import Rule, RuleTable

__all__ = ["automodel_table"]

_HF_KEYS = [Rule(r"((?:model|mtp)\..+|lm_head\.weight)", "{0}")]
# What may sit beside the model in a DCP-format model folder: never read.
_SKIP = (r"optim(?:izer)?\..*", r"lr_scheduler(\..*)?", r"dataloader(\..*)?", r"rng(\..*)?", r"step")


def automodel_table(index: CheckpointIndex, hf_config: Any) -> RuleTable:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    tied = (r"lm_head\.weight",) if getattr(text, "tie_word_embeddings", False) else ()
    return RuleTable("automodel", _HF_KEYS, _SKIP, tied)

