"""Check an HF safetensors checkpoint from its bytes, not from whether it happens to load.

``from_pretrained`` silently accepts several broken checkpoints (a stale fused expert key beside
the per-expert keys, an index entry pointing at the wrong file, an extra ``lm_head.weight`` on a
tied model), so a clean load proves little. :func:`verify_checkpoint` reads every file's header
and the index and reports every problem it finds:

* each header parses; dtypes are known; ``data_offsets`` match dtype x shape, start at 0, tile the
  data region with no gap or overlap, and end exactly at the end of the file;
* every key sits in exactly one file, and the index names exactly the keys and files that exist;
* no fused expert tensor sits beside per-expert keys of the same layer;
* every MoE layer has experts ``0 .. E-1`` with E from ``config.json``, each with the same
  projections; no ``lm_head.weight`` when the config ties word embeddings;
* optionally, every tensor equals a reference checkpoint or state dict.

:func:`compare_with_shards` is the distributed equality check: every rank compares the parts of
the live (sharded) model it holds with the same boxes of the files, so a checkpoint of any size is
checked tensor for tensor with no gather.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from nemo_moe_export.adapters import SafetensorsSource, get_adapter
from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.safetensors_format import (
    INDEX_FILE,
    SINGLE_FILE,
    SUFFIX,
    SafetensorsHeader,
    TensorEntry,
    read_header,
    read_weight_map,
)

__all__ = ["VerifyReport", "compare_with_shards", "verify_checkpoint"]

_PER_EXPERT = re.compile(r"^(?P<layer>.*)\.experts\.(?P<expert>\d+)\.(?P<proj>.+)$")
_FUSED = re.compile(r"^(?P<layer>.*)\.experts\.(gate_up_proj|down_proj|gate_and_up_projs|down_projs)$")
_NUM_EXPERTS_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")


@dataclass
class VerifyReport:
    path: str
    files: int = 0
    tensors: int = 0
    tensor_bytes: int = 0
    compared: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = (f"{self.path}: {self.files} files, {self.tensors} tensors, {self.tensor_bytes / 1e9:.3f} GB"
                + (f", {self.compared} compared with the reference" if self.compared else ""))
        if self.ok:
            return head + ": OK"
        return head + f": {len(self.problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in self.problems)


def _read_header(path: str, report: VerifyReport) -> dict | None:
    """The file's tensor entries by key (malformed ones included, as stored), after checking that
    they tile the data region; None, with the problem reported, when the header is unreadable."""
    name = os.path.basename(path)
    try:
        header = read_header(path)
    except ExportInputError as exc:
        report.problems.append(f"{name}: {exc.problem} (expected {exc.expected}, found {exc.actual})")
        return None
    spans = []
    for key in header.keys():
        entry = _checked_entry(name, key, header, report)
        if entry is not None:
            spans.append((entry.start, entry.end, key))
    _check_tiling(name, sorted(spans), os.path.getsize(path) - header.data_start, report)
    report.tensor_bytes += sum(e - s for s, e, _ in spans)
    return header.raw


def _checked_entry(name: str, key: str, header: SafetensorsHeader, report: VerifyReport) -> TensorEntry | None:
    """The parsed entry of ``key``, or None with the problem reported; a span that disagrees with
    dtype x shape is reported but the entry still counts for the tiling."""
    try:
        entry = header.entry(key)
    except ExportInputError:
        report.problems.append(f"{name}: key '{key}' has a malformed entry {header.raw[key]}")
        return None
    expected = entry.expected_nbytes
    if expected is None:
        report.problems.append(f"{name}: key '{key}' ({entry.dtype} {list(entry.shape)}) does not end on a "
                               f"byte boundary")
    elif entry.nbytes != expected:
        report.problems.append(f"{name}: key '{key}' spans {entry.nbytes} bytes, expected {expected} "
                               f"for {entry.dtype} {list(entry.shape)}")
    return entry


def _check_tiling(name: str, spans: list[tuple[int, int, str]], data: int, report: VerifyReport) -> None:
    """Sorted ``(start, end, key)`` spans must cover the ``data`` bytes exactly: no overlap, no gap."""
    cursor = 0
    for start, end, key in spans:
        if start < cursor:
            report.problems.append(f"{name}: key '{key}' at bytes [{start}, {end}) overlaps the previous tensor "
                                   f"(which ends at {cursor})")
        elif start > cursor:
            report.problems.append(f"{name}: gap of {start - cursor} bytes before key '{key}' at {start}")
        cursor = max(cursor, end)
    if cursor != data:
        report.problems.append(f"{name}: tensors end at data byte {cursor} but the file holds {data} data bytes "
                               f"({'truncated' if cursor > data else 'trailing bytes'})")


def _expert_checks(keys: list[str], config: Mapping | None, report: VerifyReport) -> None:
    experts: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for key in keys:
        m = _PER_EXPERT.match(key)
        if m:
            experts[m["layer"]][int(m["expert"])].add(m["proj"])
    for key in keys:
        m = _FUSED.match(key)
        if m and m["layer"] in experts:
            report.problems.append(f"stale fused expert key '{key}' beside per-expert keys of {m['layer']}")
    expected = None
    if config is not None:
        text = config.get("text_config", config)
        expected = next((text[f] for f in _NUM_EXPERTS_FIELDS if text.get(f) is not None), None)
    for layer, by_id in sorted(experts.items()):
        ids = sorted(by_id)
        if expected is not None and ids != list(range(expected)):
            missing = sorted(set(range(expected)) - set(ids))
            extra = sorted(set(ids) - set(range(expected)))
            report.problems.append(f"{layer}: experts {len(ids)} found, config says {expected}"
                                   + (f"; missing ids {missing[:8]}" if missing else "")
                                   + (f"; unexpected ids {extra[:8]}" if extra else ""))
        projections = {frozenset(p) for p in by_id.values()}
        if len(projections) > 1:
            report.problems.append(f"{layer}: experts differ in their projections {sorted(map(sorted, projections))}")
    if config is not None and config.get("tie_word_embeddings") and any(k.endswith("lm_head.weight") for k in keys):
        report.problems.append("config ties word embeddings but the checkpoint also stores lm_head.weight")


def _compare(path: str, where: dict[str, str], reference, report: VerifyReport) -> None:
    if isinstance(reference, (str, os.PathLike)):
        source = SafetensorsSource(reference)
        ref_keys, get = source.keys(), source.read_whole
    else:
        source, ref_keys, get = None, set(reference), lambda k: reference[k]
    try:
        if set(where) != ref_keys:
            report.problems.append(
                f"keys differ from the reference: missing {sorted(ref_keys - set(where))[:8]}, "
                f"extra {sorted(set(where) - ref_keys)[:8]}")
        by_file: dict[str, list[str]] = defaultdict(list)
        for key, file in where.items():
            if key in ref_keys:
                by_file[file].append(key)
        for file, keys in by_file.items():
            with safe_open(os.path.join(path, file), framework="pt") as f:
                for key in keys:
                    ours, theirs = f.get_tensor(key), get(key)
                    if not torch.is_tensor(theirs):
                        theirs = torch.as_tensor(theirs)
                    theirs = theirs.detach().cpu()
                    report.compared += 1
                    if ours.dtype != theirs.dtype or ours.shape != theirs.shape or not torch.equal(ours, theirs):
                        report.problems.append(
                            f"tensor '{key}' differs from the reference ({ours.dtype} {tuple(ours.shape)} vs "
                            f"{theirs.dtype} {tuple(theirs.shape)})")
    finally:
        if source is not None:
            source.close()


def verify_checkpoint(path: str | os.PathLike[str], reference=None) -> VerifyReport:
    """Verify the checkpoint in ``path``; ``reference`` (a checkpoint dir or ``{key: tensor}``) adds a
    tensor-by-tensor comparison. Returns a report; ``report.ok`` is False on any problem."""
    path = os.fspath(path)
    report = VerifyReport(path)
    if not os.path.isdir(path):
        report.problems.append("not a directory")
        return report
    files = sorted(f for f in os.listdir(path) if f.endswith(SUFFIX))
    report.files = len(files)
    if not files:
        report.problems.append(f"no {SUFFIX} files")
        return report
    index = _read_index(path, files, report)
    where = _stored_keys(path, files, report)
    if index is not None:
        _check_index(index, where, files, report)
    _expert_checks(sorted(where), _read_config(path, report), report)
    if reference is not None and report.ok:
        _compare(path, where, reference, report)
    return report


def _read_index(path: str, files: list[str], report: VerifyReport) -> dict[str, str] | None:
    """The index's weight map; None (a problem unless the checkpoint is one ``model.safetensors``)
    when there is none or it cannot be read."""
    if os.path.exists(os.path.join(path, INDEX_FILE)):
        try:
            return read_weight_map(path)
        except ExportInputError as exc:
            report.problems.append(f"{INDEX_FILE}: unreadable ({exc.actual})")
    elif len(files) > 1 or files[0] != SINGLE_FILE:
        report.problems.append(f"{INDEX_FILE} is missing: transformers cannot map keys to {files}")
    return None


def _stored_keys(path: str, files: list[str], report: VerifyReport) -> dict[str, str]:
    """``{key: file}`` from every file's header (each header checked on the way); a key stored in
    two files is a problem."""
    where: dict[str, str] = {}
    for name in files:
        for key in _read_header(os.path.join(path, name), report) or {}:
            if key in where:
                report.problems.append(f"key '{key}' is stored twice: in {where[key]} and {name}")
            else:
                where[key] = name
    report.tensors = len(where)
    return where


def _check_index(index: dict[str, str], where: dict[str, str], files: list[str], report: VerifyReport) -> None:
    """The index names exactly the stored keys, each in the file that holds it, and existing files."""
    for key, file in sorted(index.items()):
        if key not in where:
            report.problems.append(f"{INDEX_FILE}: key '{key}' -> {file}, but no file holds it")
        elif where[key] != file:
            report.problems.append(f"{INDEX_FILE}: key '{key}' -> {file}, but it is stored in {where[key]}")
    for key in sorted(set(where) - set(index)):
        report.problems.append(f"key '{key}' in {where[key]} is missing from {INDEX_FILE}")
    for file in sorted(set(index.values()) - set(files)):
        report.problems.append(f"{INDEX_FILE} names {file}, which does not exist")


def _read_config(path: str, report: VerifyReport) -> dict | None:
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        report.problems.append("config.json is missing")
        return None
    with open(config_path) as f:
        return json.load(f)


def compare_with_shards(path: str | os.PathLike[str], model: Any = None, *,
                        state_dict: Mapping[str, torch.Tensor] | None = None, adapter: Any = None) -> VerifyReport:
    """Compare the checkpoint in ``path`` with this rank's shards of ``model`` (or ``state_dict``).

    Call on any rank, alone or on all of them: each reads only the boxes it holds
    (``get_slice``), in the model's HF orientation, and requires equal dtype and bytes; what the
    checkpoint stores in another dtype (an export with ``dtype=``) is compared after casting the
    shard to it. No communication; ``report.compared`` counts the pieces checked on this rank.
    """
    report = VerifyReport(os.fspath(path))
    state_dict = model.state_dict() if state_dict is None else state_dict
    adapter = adapter or get_adapter(model.config)
    source = SafetensorsSource(path)
    try:
        stored_keys = source.keys()
        for key, piece in adapter.to_hf(state_dict).items():
            if key not in stored_keys:
                report.problems.append(f"tensor '{key}' is not in the checkpoint")
                continue
            meta = source.meta(key)
            if tuple(meta.shape) != tuple(piece.global_shape):
                report.problems.append(f"tensor '{key}': checkpoint shape {tuple(meta.shape)}, "
                                       f"model shape {tuple(piece.global_shape)}")
                continue
            stored = source.read(key, piece.offsets, tuple(piece.tensor.shape))
            mine = piece.tensor.detach().to(device="cpu", dtype=stored.dtype)
            report.compared += 1
            report.tensor_bytes += stored.numel() * stored.element_size()
            if not torch.equal(stored, mine):
                report.problems.append(f"tensor '{key}' at offsets {piece.offsets} differs from the model's shard")
    finally:
        source.close()
    return report
