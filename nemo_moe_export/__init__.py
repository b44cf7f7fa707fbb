"""nemo-moe-export: expert-shard-aware HF conversion, MMLU evaluation and export for MoE training."""

from nemo_moe_export.adapters import get_adapter, supported_model_types
from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.layout import (
    get_ep_expert_range,
    get_sharded_expert_range,
    local_box,
    local_expert_range,
)

__version__ = "0.1.0"

__all__ = [
    "ExportInputError",
    "get_adapter",
    "get_ep_expert_range",
    "get_sharded_expert_range",
    "local_box",
    "local_expert_range",
    "supported_model_types",
]
