"""The export plan: every file, header and byte offset of the checkpoint, decided before any I/O.

Pure: it depends only on global key names, shapes and dtypes (``StateDictAdapter.hf_metadata``)
and the options, so every rank computes the identical plan with no communication. Writers then
place their bytes at the planned offsets; a plan always tiles each file exactly (header, then
tensors back to back, no gaps, no trailing bytes), which is what safetensors requires.

Besides the layout, the plan answers the questions the export step asks before writing
(docs/design.md#export-plan-and-invariants): which rank owns each file (:func:`assign_file_owners`),
whether every rank planned the same thing (:meth:`ExportPlan.digest`), and whether the ranks'
pieces cover every element exactly once (:func:`element_counts`, :func:`check_coverage`).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from nemo_moe_export.adapters import HFShard, TensorMeta
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.options import ExportOptions, parse_dtype, parse_size
from nemo_moe_export.placement import get_sharded_expert_range
from nemo_moe_export.safetensors_format import (EXPORT_ID_KEY, TensorEntry, dtype_name, encode_header, encode_index,
                                                replace_header_metadata)

__all__ = [
    "ExportPlan",
    "PlannedFile",
    "PlannedTensor",
    "assign_file_owners",
    "check_coverage",
    "element_counts",
    "natural_key",
    "parse_size",
    "plan_export",
    "write_share",
    "write_shares",
]

_FILE_METADATA = {"format": "pt"}  # what save_pretrained writes: transformers reads it as torch weights


def _file_metadata(export_id: str | None) -> dict[str, str]:
    """Every file header's metadata: ``_FILE_METADATA``, and the job's id once it has one."""
    return {**_FILE_METADATA, EXPORT_ID_KEY: export_id} if export_id else dict(_FILE_METADATA)


@dataclass(frozen=True)
class PlannedTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    data_start: int  # absolute byte offset of the tensor's first byte in ``file``
    nbytes: int

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class PlannedFile:
    name: str
    header: bytes  # the 8-byte length prefix and the JSON header, padded to 8 bytes
    size: int  # total file size in bytes
    keys: tuple[str, ...]


@dataclass(frozen=True)
class ExportPlan:
    files: tuple[PlannedFile, ...]
    tensors: Mapping[str, PlannedTensor]
    export_id: str | None = None  # the job that writes it, in every header and the index

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def index_json(self) -> str:
        weight_map = {key: self.tensors[key].file for f in self.files for key in f.keys}
        extra = {EXPORT_ID_KEY: self.export_id} if self.export_id else None
        return encode_index(weight_map, self.total_tensor_bytes, extra)

    def stamped(self, export_id: str) -> "ExportPlan":
        """The same layout with ``export_id`` in every file's header metadata, so a directory whose
        files come from different exports is detected (docs/design.md#export-target-and-concurrent-jobs).
        A longer header moves the file's data: every offset shifts by the same amount."""
        old, new = _file_metadata(self.export_id), _file_metadata(export_id)
        files, tensors = [], dict(self.tensors)
        for f in self.files:
            header = replace_header_metadata(f.header, old, new)
            shift = len(header) - len(f.header)
            for k in f.keys:
                t = tensors[k]
                tensors[k] = PlannedTensor(t.key, t.shape, t.dtype, t.file, t.data_start + shift, t.nbytes)
            files.append(replace(f, header=header, size=f.size + shift))
        return ExportPlan(tuple(files), tensors, export_id)

    def digest(self) -> str:
        """A fingerprint of the whole layout (file names and headers fix every offset): ranks whose
        digests differ would write different files."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode())
            h.update(f.header)
        return h.hexdigest()


_DIGIT_RUNS = re.compile(r"(\d+)")


def natural_key(key: str) -> tuple:
    """Sort ``layers.10`` after ``layers.9`` and ``experts.10`` after ``experts.9``."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGIT_RUNS.split(key))


def plan_export(
    metadata: Mapping[str, TensorMeta],
    *,
    dtype: torch.dtype | None = None,
    keep_dtype: Sequence[str] = (),
    max_shard_size: int | str = ExportOptions.max_shard_size,
    keep_float32: Collection[str] = (),
    keep_exact: Collection[str] = (),
    export_id: str | None = None,
) -> ExportPlan:
    """Lay out the checkpoint: files of at most ``max_shard_size`` tensor bytes, keys in natural order.

    ``dtype`` casts floating-point tensors (integer and bool tensors are kept exact), except keys
    matching a regex in ``keep_dtype`` and the keys in ``keep_exact`` (pass-through tensors), which
    keep their own dtype, and the keys in ``keep_float32``, which are stored float32 (what
    transformers keeps in fp32 in a model built in ``dtype``: ``casting.py``). A tensor larger than
    the shard size gets a file of its own, as transformers does. ``export_id`` lays the plan out
    already stamped (:meth:`ExportPlan.stamped`).
    """
    limit, dtype = parse_size(max_shard_size), parse_dtype(dtype)  # ExportOptions' own parsers
    rules = _CastRules(dtype, tuple(re.compile(p) for p in keep_dtype), frozenset(keep_float32),
                       frozenset(keep_exact))
    metas = _stored_metas(metadata, rules)
    groups = _pack_into_files(metas, limit)
    files, tensors = [], {}
    for i, keys in enumerate(groups):
        planned_file, planned_tensors = _lay_out_file(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors",
                                                      keys, metas, _file_metadata(export_id))
        files.append(planned_file)
        tensors.update(planned_tensors)
    return ExportPlan(tuple(files), tensors, export_id)


@dataclass(frozen=True)
class _CastRules:
    dtype: torch.dtype | None
    keep: tuple[re.Pattern[str], ...]
    float32: frozenset[str]
    exact: frozenset[str]

    def stored_dtype(self, key: str, dtype: torch.dtype) -> torch.dtype:
        """What ``key``, held in ``dtype``, is written as (docs/design.md#casting-like-transformers)."""
        if self.dtype is None or not dtype.is_floating_point or key in self.exact:
            return dtype
        if any(p.search(key) for p in self.keep):
            return dtype
        return torch.float32 if key in self.float32 else self.dtype


def _stored_metas(metadata: Mapping[str, TensorMeta], rules: _CastRules) -> dict[str, TensorMeta]:
    """Each key's shape and stored dtype (after the cast), in natural key order."""
    metas: dict[str, TensorMeta] = {}
    for key in sorted(metadata, key=natural_key):
        meta = metadata[key]
        dtype_name(meta.dtype, key=key)  # refuses a dtype safetensors cannot store
        metas[key] = TensorMeta(meta.shape, rules.stored_dtype(key, meta.dtype))
    return metas


def _pack_into_files(metas: Mapping[str, TensorMeta], limit: int) -> list[list[str]]:
    """Keys in order, cut into files of at most ``limit`` tensor bytes (an oversized tensor alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for key, meta in metas.items():
        nbytes = _nbytes(meta)
        if groups[-1] and used + nbytes > limit:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += nbytes
    return groups


def _lay_out_file(name: str, keys: list[str], metas: Mapping[str, TensorMeta], metadata: Mapping[str, str]
                  ) -> tuple[PlannedFile, dict[str, PlannedTensor]]:
    """One file: the header, then the tensors back to back in key order."""
    entries, offset = {}, 0
    for key in keys:
        nbytes = _nbytes(metas[key])
        entries[key] = TensorEntry(dtype_name(metas[key].dtype), metas[key].shape, offset, offset + nbytes)
        offset += nbytes
    header = encode_header(entries, metadata)
    tensors = {key: PlannedTensor(key, metas[key].shape, metas[key].dtype, name, len(header) + e.start, e.nbytes)
               for key, e in entries.items()}
    return PlannedFile(name, header, len(header) + offset, tuple(keys)), tensors


def _nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


# --------------------------------------------------------------------------------------------------
# Ownership and coverage: what the export step checks before the first byte is written
# --------------------------------------------------------------------------------------------------


def assign_file_owners(plan: ExportPlan, writer_ranks: Sequence[int]) -> dict[str, int]:
    """``{file: rank}``: file ``i`` is owned by ``writer_ranks[i % len(writer_ranks)]``.

    The owner creates the file at full size and writes its header; in local-filesystem mode it also
    receives every other rank's bytes for it.
    """
    if not writer_ranks:
        raise InputError("no rank to own the checkpoint files", key="writer_ranks",
                         expected="at least one rank", actual=list(writer_ranks))
    return {f.name: writer_ranks[i % len(writer_ranks)] for i, f in enumerate(plan.files)}


def element_counts(plan: ExportPlan, pieces: Iterable[HFShard]) -> torch.Tensor:
    """Elements this rank's primary ``pieces`` hold, per planned key (int64, in ``plan.tensors``
    order); summed over ranks it must equal every tensor's size (:func:`check_coverage`)."""
    position = {key: i for i, key in enumerate(plan.tensors)}
    counts = torch.zeros(len(position), dtype=torch.int64)
    for piece in pieces:
        if not piece.primary:
            continue
        if piece.key not in position:
            raise InputError("a piece has no place in the export plan", key=piece.key,
                             expected=f"one of the plan's {len(position)} keys", actual="not planned",
                             hint="pieces and plan must come from the same adapter and state dict")
        counts[position[piece.key]] += piece.tensor.numel()
    return counts


def check_coverage(plan: ExportPlan, summed_counts: torch.Tensor) -> None:
    """Refuse unless every planned tensor gets exactly its number of elements from the ranks'
    primaries (``summed_counts``: :func:`element_counts` summed over ranks). Names the first bad key."""
    keys = list(plan.tensors)
    expected = torch.tensor([plan.tensors[k].numel for k in keys], dtype=torch.int64)
    wrong = (summed_counts != expected).nonzero().flatten().tolist()
    if wrong:
        first = wrong[0]
        raise InputError(
            f"{len(wrong)} tensors would not be written exactly once", key=keys[first],
            expected=f"{int(expected[first])} elements with one writer each",
            actual=f"{int(summed_counts[first])} written by primaries across ranks",
            hint="every element needs exactly one writer: export on every rank that holds a shard "
                 "(group=), and check the mesh and placements",
        )


# --------------------------------------------------------------------------------------------------
# Write shares: every holder of a replicated piece writes part of it (docs/design.md#replica-agreement)
# --------------------------------------------------------------------------------------------------


def write_share(piece: HFShard) -> HFShard | None:
    """The part of ``piece`` this rank writes, as the sole writer of that part (``primary``, one
    replica); None when its part is empty.

    A piece held by ``R`` ranks (``piece.replicas``) is split along its dim 0 by the chunk rule
    into ``R`` parts and holder ``j`` (``piece.replica``) takes part ``j``, so the holders write
    about ``1/R`` each and every byte once; a 0-dim piece is written by holder 0. Pure: a function
    of the piece's box and replica numbers only, so the same code plans any number of ranks.
    """
    if piece.replicas == 1:
        return piece if piece.primary else None
    shape = tuple(piece.tensor.shape)
    if not shape:
        part = piece.tensor if piece.replica == 0 else None
        start, count = 0, 1
    else:
        start, end = get_sharded_expert_range(shape[0], piece.replicas, piece.replica)
        count = end - start
        part = piece.tensor.narrow(0, start, count) if count else None
    if part is None or part.numel() == 0:
        return None
    offsets = (piece.offsets[0] + start, *piece.offsets[1:]) if shape else piece.offsets
    return replace(piece, offsets=tuple(offsets), tensor=part, primary=True, replica=0, replicas=1)


def write_shares(pieces: Iterable[HFShard]) -> list[HFShard]:
    """What this rank writes of its ``pieces``: :func:`write_share` of each, empty ones dropped."""
    return [share for share in map(write_share, pieces) if share is not None]
