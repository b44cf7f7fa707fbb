"""Distributed no-gather HF export: ``plan`` (pure) -> ``writer`` (I/O) -> ``verify``, run by ``step``."""

from nemo_moe_export.export.plan import ExportPlan, plan_export
from nemo_moe_export.export.step import ExportResult, ExportStep, export_hf_checkpoint
from nemo_moe_export.export.verify import VerifyReport, compare_with_shards, verify_checkpoint

__all__ = [
    "ExportPlan",
    "ExportResult",
    "ExportStep",
    "VerifyReport",
    "compare_with_shards",
    "export_hf_checkpoint",
    "plan_export",
    "verify_checkpoint",
]
