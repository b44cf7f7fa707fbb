"""Checkpoint conversion: a stored training checkpoint -> an HF checkpoint on N CPU ranks, no model.

``index.py`` reads what the checkpoint records (every tensor's shape, dtype, boxes and byte ranges);
``tables.py`` is the protocol of the per-format key tables, ``formats.py`` which table reads which
format; ``engine.py`` runs
the conversion on the export's steps (docs/design.md#checkpoint-conversion).
"""

from nemo_moe_export.convert.engine import ConvertResult, convert_checkpoint
from nemo_moe_export.convert.index import CheckpointIndex, StoredChunk, StoredTensor, detect_format, read_index
from nemo_moe_export.convert.formats import register_table, table_for
from nemo_moe_export.convert.tables import CheckpointTable

__all__ = ["CheckpointIndex", "CheckpointTable", "ConvertResult", "StoredChunk", "StoredTensor", "convert_checkpoint",
           "detect_format", "read_index", "register_table", "table_for"]
