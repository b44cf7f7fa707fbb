"""Distributed no-gather HF export: ``options`` -> ``plan`` (pure) -> ``storage`` (I/O) -> ``verify``,
run in order by ``step`` (docs/design.md#export-plan-and-invariants)."""

from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan, plan_export
from nemo_moe_export.export.step import ExportResult, ExportStep, export_hf_checkpoint
from nemo_moe_export.export.storage import LocalFilesystemWriter, SharedFilesystemWriter, StorageWriter, writer_for
from nemo_moe_export.export.verify import VerifyReport, compare_with_shards, verify_checkpoint

__all__ = [
    "ExportOptions",
    "ExportPlan",
    "ExportResult",
    "ExportStep",
    "LocalFilesystemWriter",
    "SharedFilesystemWriter",
    "StorageWriter",
    "VerifyReport",
    "compare_with_shards",
    "export_hf_checkpoint",
    "plan_export",
    "verify_checkpoint",
    "writer_for",
]
