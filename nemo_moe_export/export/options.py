"""The export's options: one dataclass, the one home of every export default.

``ExportOptions`` is what :func:`~nemo_moe_export.export.step.export_hf_checkpoint` reads; the
Hydra group ``export`` (``config.ExportConfig``) extends it with the recipe's own fields, so a
default is declared once. Construction validates every field (``__post_init__``), so a typo in a
recipe is refused when the config is built, before training starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.options import Options, require

__all__ = ["FILESYSTEMS", "OVERWRITE_POLICIES", "ExportOptions", "parse_dtype"]

OVERWRITE_POLICIES = ("error", "replace")
FILESYSTEMS = ("shared", "local")


@dataclass
class ExportOptions(Options):
    """How the HF checkpoint is written (every field is checked on construction).

    ``dtype`` casts floating weights (``keep_dtype`` regexes exempt keys); ``overwrite`` is
    ``"error"`` (refuse an existing target) or ``"replace"`` (swap it atomically);
    ``filesystem="local"`` routes every byte to ``writer_ranks`` (default: the ranks on rank 0's
    host) for targets other ranks cannot see.
    """

    what = "export option"

    dtype: Optional[str] = None  # bfloat16 | float16 | float32 | None (keep the model's dtypes)
    keep_dtype: list[str] = field(default_factory=list)  # regexes of keys never cast
    max_shard_size: str = "5GB"  # per file, as transformers' max_shard_size (an int is bytes)
    overwrite: str = "error"  # error | replace
    filesystem: str = "shared"  # shared | local
    writer_ranks: Optional[list[int]] = None  # local filesystem: the ranks that own the files
    writer_threads: int = 1  # pwrite threads per rank for staged (cast or GPU) bytes
    staging_bytes: int = 64 << 20  # per staging buffer (cast / device-to-host), a multiple of 8
    verify: bool = True  # check the written checkpoint from its bytes before publishing
    timeout_s: float = 600.0  # every agreement between ranks

    def __post_init__(self) -> None:
        _choice("overwrite", self.overwrite, OVERWRITE_POLICIES)
        _choice("filesystem", self.filesystem, FILESYSTEMS)
        parse_dtype(self.dtype)
        from nemo_moe_export.export.plan import parse_size

        parse_size(self.max_shard_size)
        _require(isinstance(self.staging_bytes, int) and self.staging_bytes > 0 and self.staging_bytes % 8 == 0,
                 "staging_bytes", "a positive multiple of 8 bytes, e.g. 64 << 20", self.staging_bytes)
        _require(isinstance(self.writer_threads, int) and self.writer_threads >= 1,
                 "writer_threads", "an integer >= 1", self.writer_threads)
        _require(self.writer_ranks is None or (len(self.writer_ranks) > 0 and all(
            isinstance(r, int) and r >= 0 for r in self.writer_ranks)),
                 "writer_ranks", "None or a non-empty list of ranks", self.writer_ranks)
        _require(self.timeout_s > 0, "timeout_s", "> 0 seconds", self.timeout_s)
        self.keep_dtype = list(self.keep_dtype)


def parse_dtype(dtype: Any) -> Any:
    """``None`` or a floating ``torch.dtype`` from a dtype or its name (``"bfloat16"``)."""
    if dtype is None:
        return None
    import torch

    value = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ExportInputError("unknown or non-floating export dtype", key="dtype",
                               expected="bfloat16, float16, float32 or None", actual=repr(dtype))
    return value


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, key, f"one of {list(allowed)}", value)


def _require(ok: bool, key: str, expected: str, actual: object) -> None:
    require(ok, "export option", key, expected, actual)
