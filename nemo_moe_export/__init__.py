"""nemo-moe-export: expert-shard-aware HF conversion, MMLU evaluation and export for MoE training.

The entry points users need are importable from here; the export, evaluation and hook names are
loaded on first use (they pull in the export writer, the evaluator and transformers), so
``import nemo_moe_export`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from nemo_moe_export.adapters import get_adapter, supported_model_types
from nemo_moe_export.errors import ExportInputError, InputError
from nemo_moe_export.placement import (
    get_ep_expert_range,
    get_sharded_expert_range,
    local_box,
    local_expert_range,
)

__version__ = "0.1.0"

# name -> the public module that defines it, imported on first access (PEP 562)
_LAZY = {
    "ExportOptions": "nemo_moe_export.export.options",
    "ExportResult": "nemo_moe_export.export",
    "ExportStep": "nemo_moe_export.export",
    "compare_with_shards": "nemo_moe_export.export",
    "export_hf_checkpoint": "nemo_moe_export.export",
    "verify_checkpoint": "nemo_moe_export.export",
    "MMLUCallback": "nemo_moe_export.evaluate.callback",
    "MMLUOptions": "nemo_moe_export.evaluate.options",
    "evaluate_mmlu": "nemo_moe_export.evaluate",
    "load_mmlu": "nemo_moe_export.evaluate.data",
    "AdapterHook": "nemo_moe_export.plugin",
    "Hook": "nemo_moe_export.hooks",
    "RecipeContext": "nemo_moe_export.hooks",
    "make_context": "nemo_moe_export.hooks",
    "plugin_hooks": "nemo_moe_export.plugin",
    "discover_layout": "nemo_moe_export.parallel",
}

__all__ = sorted([
    "ExportInputError",
    "InputError",
    "get_adapter",
    "get_ep_expert_range",
    "get_sharded_expert_range",
    "local_box",
    "local_expert_range",
    "supported_model_types",
    *_LAZY,
])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_moe_export' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
