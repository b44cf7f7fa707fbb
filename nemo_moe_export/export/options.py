"""The export's options: one dataclass, the one home of every export default.

``ExportOptions`` is what :func:`~nemo_moe_export.export.step.export_hf_checkpoint` and
:class:`~nemo_moe_export.export.step.ExportStep` read; the Hydra group ``export``
(``config.ExportConfig``) extends it with the recipe's own fields, so a default is declared once
(docs/design.md#options-and-defaults). Construction validates every field (``__post_init__``), so
a typo in a recipe is refused when the config is built, before training starts. What depends on
the process group (``writer_ranks`` naming ranks that exist) is checked by the export itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nemo_moe_export.errors import InputError
from nemo_moe_export.options import Options

__all__ = ["FILESYSTEMS", "OVERWRITE_POLICIES", "QUANTIZE_METHODS", "REPLICA_POLICIES", "SCALE_FORMATS", "ExportOptions",
           "parse_dtype", "parse_size"]

OVERWRITE_POLICIES = ("error", "replace")
FILESYSTEMS = ("shared", "local")
REPLICA_POLICIES = ("error", "mean", "rank:N")
QUANTIZE_METHODS = ("fp8_block",)  # official DeepSeek-V3 FP8: 128x128 blocks, {key}_scale_inv
SCALE_FORMATS = ("ue8m0",)  # power-of-two scales (DeepSeek-V3.1); None: plain fp32 amax / 448
_RANK_POLICY = re.compile(r"^rank:(\d+)$")


@dataclass
class ExportOptions(Options):
    """How the HF checkpoint is written (every field is checked on construction).

    ``dtype`` casts floating weights (``keep_dtype`` regexes exempt keys); ``overwrite`` is
    ``"error"`` (refuse an existing target) or ``"replace"`` (swap it atomically);
    ``filesystem="local"`` routes every byte to ``writer_ranks`` (default: the ranks on rank 0's
    host) for targets other ranks cannot see. ``replica_mismatch`` says what happens when replicas
    of a tensor differ: ``"error"`` refuses the export, ``"mean"`` writes the replicas' mean,
    ``"rank:N"`` global rank N's copy (docs/design.md#replica-agreement). ``passthrough`` writes
    the checkpoint tensors ``from_hf`` kept for keys the model has no parameter for
    (docs/design.md#pass-through-tensors). ``quantize="fp8_block"`` writes the linear weights the
    model family's table declares (``quantize_keys`` regexes replace that list; ``keep_dtype`` keys
    are never quantized) in DeepSeek's official FP8 block format, ``scale_fmt="ue8m0"`` with
    power-of-two scales (docs/design.md#fp8-export).
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
    replica_mismatch: str = "error"  # error | mean | rank:N (when replicas of a tensor differ)
    passthrough: bool = True  # write the tensors from_hf kept that the model has no parameter for
    quantize: Optional[str] = None  # fp8_block | None (write every weight in its stored dtype)
    scale_fmt: Optional[str] = None  # ue8m0 | None (fp32 scales amax / 448); with quantize only
    quantize_keys: Optional[list[str]] = None  # regexes of the HF keys to quantize (None: the table's)

    def __post_init__(self) -> None:
        self.keep_dtype = list(self.keep_dtype)
        _check_choice("overwrite", self.overwrite, OVERWRITE_POLICIES, "unknown overwrite policy")
        _check_choice("filesystem", self.filesystem, FILESYSTEMS, "unknown filesystem mode")
        parse_dtype(self.dtype)
        parse_size(self.max_shard_size)
        _check_patterns(self.keep_dtype)
        _check_writers(self.writer_ranks, self.writer_threads, self.staging_bytes)
        if self.quantize_keys is not None and not isinstance(self.quantize_keys, str):
            self.quantize_keys = list(self.quantize_keys)  # a Hydra ListConfig, a tuple
        _check_quantize(self.quantize, self.scale_fmt, self.quantize_keys)
        if self.replica_mismatch not in ("error", "mean") and not _RANK_POLICY.match(str(self.replica_mismatch)):
            raise InputError("unknown replica_mismatch policy", key="replica_mismatch",
                             expected="'error', 'mean' or 'rank:N' (N a global rank)",
                             actual=repr(self.replica_mismatch))
        if not isinstance(self.passthrough, bool):
            raise InputError("passthrough must be true or false", key="passthrough", expected="a bool",
                             actual=repr(self.passthrough))
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise InputError("timeout must be positive", key="timeout_s", expected="> 0 seconds",
                             actual=repr(self.timeout_s))

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a torch dtype (None: keep every tensor's own dtype)."""
        return parse_dtype(self.dtype)

    @property
    def max_shard_bytes(self) -> int:
        """``max_shard_size`` in bytes (``5GB`` -> 5e9): what the plan packs files by."""
        return parse_size(self.max_shard_size)

    @property
    def replica_source(self) -> int | None:
        """N of ``replica_mismatch="rank:N"``, else None."""
        m = _RANK_POLICY.match(str(self.replica_mismatch))
        return int(m.group(1)) if m else None


def parse_dtype(dtype: Any, *, key: str = "dtype", problem: str | None = None,
                expected: str = "e.g. bfloat16, float16, float32") -> torch.dtype | None:
    """``None`` or a floating ``torch.dtype`` from a dtype or its name (``"bfloat16"``): the one
    parser of every dtype setting (export, model, a config's). ``key`` names the setting in the
    error; ``problem`` replaces the export's two messages (unknown / not floating) with one."""
    if dtype is None:
        return None
    value = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""), None)
    if problem is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise InputError(problem, key=key, expected=expected, actual=repr(dtype))
    if not isinstance(value, torch.dtype):
        raise InputError("unknown dtype", key=key, expected=expected, actual=repr(dtype))
    if not value.is_floating_point:
        raise InputError("export dtype must be floating point", key=key,
                         expected="e.g. torch.bfloat16", actual=value)
    return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``5GB`` -> 5e9, ``64MiB`` -> 64 * 2**20, ints pass through (as transformers' max_shard_size)."""
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise InputError("unreadable size", key="max_shard_size", expected="e.g. 5GB, 512MiB or bytes",
                             actual=repr(size))
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise InputError("size must be positive", key="max_shard_size", expected="> 0", actual=value)
    return value


def _check_choice(key: str, value: Any, allowed: tuple[str, ...], problem: str) -> None:
    if value not in allowed:
        raise InputError(problem, key=key, expected=allowed, actual=repr(value))


def _check_patterns(patterns: list[str], key: str = "keep_dtype", example: str = r"[r'\.gate\.weight$']") -> None:
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise InputError(f"{key} entries must be regular expressions", key=key,
                             expected=f"e.g. {example}", actual=f"{pattern!r} ({exc})") from exc


def _check_writers(writer_ranks: Any, writer_threads: Any, staging_bytes: Any) -> None:
    if not isinstance(staging_bytes, int) or staging_bytes <= 0 or staging_bytes % 8:
        raise InputError("staging buffer size must be a positive multiple of 8 bytes",
                         key="staging_bytes", expected="e.g. 64 << 20", actual=staging_bytes)
    if not isinstance(writer_threads, int) or writer_threads < 1:
        raise InputError("writer_threads must be a positive integer", key="writer_threads",
                         expected=">= 1", actual=repr(writer_threads))
    if writer_ranks is not None and (len(writer_ranks) == 0 or any(
            not isinstance(r, int) or r < 0 for r in writer_ranks)):
        raise InputError("writer_ranks must name ranks of the group", key="writer_ranks",
                         expected="None or a non-empty list of ranks", actual=writer_ranks)


def _check_quantize(quantize: Any, scale_fmt: Any, quantize_keys: Any) -> None:
    """``quantize`` is a known method; ``scale_fmt`` and ``quantize_keys`` only come with it."""
    if quantize is not None:
        _check_choice("quantize", quantize, QUANTIZE_METHODS, "unknown quantization method")
    if scale_fmt is not None:
        _check_choice("scale_fmt", scale_fmt, SCALE_FORMATS, "unknown FP8 scale format")
    for key, value in (("scale_fmt", scale_fmt), ("quantize_keys", quantize_keys)):
        if value is not None and quantize is None:
            raise InputError(f"{key} applies to a quantized export", key=key,
                             expected="quantize='fp8_block' beside it", actual=f"quantize=None, {key}={value!r}")
    if quantize_keys is not None:
        if isinstance(quantize_keys, str) or not quantize_keys:
            raise InputError("quantize_keys must be a non-empty list of regexes", key="quantize_keys",
                             expected=r"e.g. ['\\.mlp\\.experts\\.']", actual=repr(quantize_keys))
        _check_patterns(quantize_keys, "quantize_keys", r"['\.mlp\.experts\.']")
