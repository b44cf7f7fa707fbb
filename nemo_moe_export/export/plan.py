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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_moe_export.adapters import HFShard, TensorMeta
from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.export.options import ExportOptions, parse_size
from nemo_moe_export.safetensors_format import TensorEntry, dtype_name, encode_header, encode_index

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
]

_FILE_METADATA = {"format": "pt"}  # what save_pretrained writes: transformers reads it as torch weights


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

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def index_json(self) -> str:
        weight_map = {key: self.tensors[key].file for f in self.files for key in f.keys}
        return encode_index(weight_map, self.total_tensor_bytes)

    def digest(self) -> str:
        """A fingerprint of the whole layout (file names and headers fix every offset): ranks whose
        digests differ would write different files."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode())
            h.update(f.header)
        return h.hexdigest()


def natural_key(key: str) -> tuple:
    """Sort ``layers.10`` after ``layers.9`` and ``experts.10`` after ``experts.9``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key))


def plan_export(
    metadata: Mapping[str, TensorMeta],
    *,
    dtype: torch.dtype | None = None,
    keep_dtype: Sequence[str] = (),
    max_shard_size: int | str = ExportOptions.max_shard_size,
) -> ExportPlan:
    """Lay out the checkpoint: files of at most ``max_shard_size`` tensor bytes, keys in natural order.

    ``dtype`` casts floating-point tensors (integer and bool tensors are kept exact), except keys
    matching a regex in ``keep_dtype`` (e.g. routers kept in fp32). A tensor larger than the shard
    size gets a file of its own, as transformers does.
    """
    limit = parse_size(max_shard_size)
    if dtype is not None and not dtype.is_floating_point:
        raise ExportInputError("export dtype must be floating point", key="dtype",
                               expected="e.g. torch.bfloat16", actual=dtype)
    metas = _stored_metas(metadata, dtype, [re.compile(p) for p in keep_dtype])
    groups = _pack_into_files(metas, limit)
    files, tensors = [], {}
    for i, keys in enumerate(groups):
        planned_file, planned_tensors = _lay_out_file(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors",
                                                      keys, metas)
        files.append(planned_file)
        tensors.update(planned_tensors)
    return ExportPlan(tuple(files), tensors)


def _stored_metas(metadata: Mapping[str, TensorMeta], dtype: torch.dtype | None,
                  keep: list[re.Pattern[str]]) -> dict[str, TensorMeta]:
    """Each key's shape and stored dtype (after the cast), in natural key order."""
    metas: dict[str, TensorMeta] = {}
    for key in sorted(metadata, key=natural_key):
        meta = metadata[key]
        dtype_name(meta.dtype, key=key)  # refuses a dtype safetensors cannot store
        if dtype is not None and meta.dtype.is_floating_point and not any(p.search(key) for p in keep):
            meta = TensorMeta(meta.shape, dtype)
        metas[key] = meta
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


def _lay_out_file(name: str, keys: list[str], metas: Mapping[str, TensorMeta]
                  ) -> tuple[PlannedFile, dict[str, PlannedTensor]]:
    """One file: the header, then the tensors back to back in key order."""
    entries, offset = {}, 0
    for key in keys:
        nbytes = _nbytes(metas[key])
        entries[key] = TensorEntry(dtype_name(metas[key].dtype), metas[key].shape, offset, offset + nbytes)
        offset += nbytes
    header = encode_header(entries, _FILE_METADATA)
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
        raise ExportInputError("no rank to own the checkpoint files", key="writer_ranks",
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
            raise ExportInputError("a piece has no place in the export plan", key=piece.key,
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
        raise ExportInputError(
            f"{len(wrong)} tensors would not be written exactly once", key=keys[first],
            expected=f"{int(expected[first])} elements with one writer each",
            actual=f"{int(summed_counts[first])} written by primaries across ranks",
            hint="replicated tensors must have a single primary; check the mesh and placements",
        )
