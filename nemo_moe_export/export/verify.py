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
* FP8 block format: every ``float8_e4m3fn`` weight is 2-D with a ``{key}_scale_inv`` of shape
  ``[ceil(out / b0), ceil(in / b1)]`` in F32 or BF16 (F8_E8M0 with ``scale_fmt: ue8m0``), every
  scale has its FP8 weight, and ``config.json`` declares a ``quantization_config`` our loader reads
  exactly when the checkpoint holds FP8 tensors;
* optionally (``tp``), the serve check: for each tensor-parallel size, every quantized weight's
  per-shard width along its split dim is a whole number of blocks (vLLM and SGLang refuse to load
  it otherwise), and the MTP layer is there when ``num_nextn_predict_layers`` says so
  (docs/design.md#fp8-export);
* ``config.json`` serves (docs/design.md#serving-engines): ``architectures`` names a causal-LM
  class, ``dtype`` / ``torch_dtype`` (each one present, and at least one) equal the dtype the files
  hold, the family's required keys are there and its fixed keys hold their values
  (``adapters/tables_serving.py``);
* optionally, every tensor equals a reference checkpoint or state dict.

:func:`compare_with_shards` is the distributed equality check: every rank compares the parts of
the live (sharded) model it holds with the same boxes of the files, so a checkpoint of any size is
checked tensor for tensor with no gather.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from nemo_moe_export.adapters import SafetensorsSource, get_adapter
from nemo_moe_export.adapters.fp8 import FP8_BLOCK, SCALE_SUFFIX, fp8_block_size
from nemo_moe_export.adapters.tables_serving import causal_lm_class, serving_table
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.config_json import DTYPE_KEYS, files_dtype
from nemo_moe_export.safetensors_format import (
    EXPORT_ID_KEY,
    INDEX_FILE,
    SINGLE_FILE,
    SUFFIX,
    FileCheck,
    TensorEntry,
    check_file,
    read_header,
    torch_dtype,
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


def _read_header(path: str, report: VerifyReport) -> FileCheck:
    """The file checked the way the safetensors library does (``check_file``): its header (None,
    with the problem reported, when the file or its header is unreadable) and well-formed entries."""
    check = check_file(path)
    report.problems += check.problems
    report.tensor_bytes += sum(e.nbytes for e in check.entries.values())
    return check


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
    expected = _expert_count(config, report) if config is not None else None
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


def _expert_count(config: Mapping, report: VerifyReport) -> int | None:
    """The routed expert count ``config.json`` declares (None if it declares none)."""
    text = config.get("text_config")
    text = text if isinstance(text, dict) else config
    field_name = next((f for f in _NUM_EXPERTS_FIELDS if text.get(f) is not None), None)
    if field_name is None:
        return None
    value = text[field_name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        report.problems.append(f"config.json: {field_name} is {value!r}, expected an integer >= 0")
        return None
    return value


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


def verify_checkpoint(path: str | os.PathLike[str], reference=None, *, tp: Sequence[int] | None = None) -> VerifyReport:
    """Verify the checkpoint in ``path``; ``reference`` (a checkpoint dir or ``{key: tensor}``) adds a
    tensor-by-tensor comparison, ``tp`` (tensor-parallel sizes) the serve check. Returns a report;
    ``report.ok`` is False on any problem."""
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
    where, entries = _stored_keys(path, files, report)
    if index is not None:
        _check_index(index, where, files, report)
    _same_export(path, files, report)
    config = _read_config(path, report)
    _expert_checks(sorted(where), config, report)
    if config is not None:
        _config_checks(config, entries, report)
    block = _fp8_checks(path, entries, config, report)
    if tp:
        _serve_checks(entries, block or FP8_BLOCK, config or {}, tp, report)
    if reference is not None and report.ok:
        _compare(path, where, reference, report)
    return report


def _same_export(path: str, files: list[str], report: VerifyReport) -> None:
    """Every file and the index that name an export job name the same one
    (docs/design.md#export-target-and-concurrent-jobs): a directory mixing two exports' files is a
    problem even when each file is well formed."""
    writers: dict[str | None, list[str]] = defaultdict(list)
    for name in files:
        try:
            metadata = read_header(os.path.join(path, name)).metadata or {}
        except (InputError, OSError):
            continue  # an unreadable header is reported by _stored_keys
        writers[metadata.get(EXPORT_ID_KEY)].append(name)
    writers[_index_export_id(path)].append(INDEX_FILE)
    writers.pop(None, None)  # files written by other tools carry no id: nothing to compare
    if len(writers) > 1:
        found = "; ".join(f"{job}: {', '.join(names)}" for job, names in writers.items())
        report.problems.append(f"the files come from different exports ({found}): another job wrote into "
                               "this directory; export again")


def _index_export_id(path: str) -> str | None:
    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            metadata = json.load(f).get("metadata", {})
        return metadata.get(EXPORT_ID_KEY) if isinstance(metadata, dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def _read_index(path: str, files: list[str], report: VerifyReport) -> dict[str, str] | None:
    """The index's weight map; None (a problem unless the checkpoint is one ``model.safetensors``)
    when there is none or it cannot be read."""
    if os.path.exists(os.path.join(path, INDEX_FILE)):
        try:
            return read_weight_map(path)
        except InputError as exc:
            report.problems.append(f"{INDEX_FILE}: unreadable (expected {exc.expected}, found {exc.actual})")
    elif len(files) > 1 or files[0] != SINGLE_FILE:
        report.problems.append(f"{INDEX_FILE} is missing: transformers cannot map keys to {files}")
    return None


def _stored_keys(path: str, files: list[str], report: VerifyReport
                 ) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    """``{key: file}`` from every file's header (each header checked on the way; a key stored in
    two files is a problem), and the parsed entry of each key there, for the FP8 and serve checks
    (each header is parsed once: an FP8 checkpoint has twice the tensors, and parsing the headers
    is most of verify's time)."""
    where: dict[str, str] = {}
    entries: dict[str, TensorEntry] = {}
    for name in files:
        check = _read_header(os.path.join(path, name), report)
        for key in check.header.raw if check.header is not None else {}:
            if key in where:
                report.problems.append(f"key '{key}' is stored twice: in {where[key]} and {name}")
                continue
            where[key] = name
            if key in check.entries:  # a malformed entry was reported by check_file
                entries[key] = check.entries[key]
    report.tensors = len(where)
    return where, entries


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
    """``config.json`` as a dict; None, with the problem reported, when it is missing or unreadable."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        report.problems.append("config.json is missing")
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        report.problems.append(f"config.json: unreadable ({type(exc).__name__}: {exc})")
        return None
    if not isinstance(config, dict):
        report.problems.append(f"config.json: not a JSON object (found {type(config).__name__})")
        return None
    return config


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


# --------------------------------------------------------------------------------------------------
# FP8 block format and the serve check (docs/design.md#fp8-export)
# --------------------------------------------------------------------------------------------------

_FP8 = "F8_E4M3"
_SCALE_DTYPES = ("F32", "BF16")
# How vLLM and SGLang split each quantized projection over tensor-parallel ranks: column-parallel
# weights by output rows (dim 0), row-parallel ones by input columns (dim 1); ``q_a_proj`` and
# ``kv_a_proj_with_mqa`` are replicated. Routed experts' gate/up width is checked at tp=1 too: their
# FP8 MoE layer requires ``intermediate_size_per_partition % block_n == 0`` at any tp.
_TP_COLUMN = re.compile(r"\.(gate_proj|up_proj|w1|w3|q_proj|k_proj|v_proj|q_b_proj|kv_b_proj)\.weight$")
_TP_ROW = re.compile(r"\.(down_proj|w2|o_proj)\.weight$")
_KV = re.compile(r"\.(k_proj|v_proj)\.weight$")
MTP_MODULES = ("enorm.weight", "hnorm.weight", "eh_proj.weight")  # what only an MTP layer has


def _config_checks(config: Mapping, entries: dict[str, TensorEntry], report: VerifyReport) -> None:
    """What serving engines read from ``config.json`` (docs/design.md#serving-engines)."""
    text = _text_config(config)
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and architectures and str(architectures[0]).endswith("ForCausalLM")):
        expected = getattr(causal_lm_class(text.get("model_type")), "__name__", "a ...ForCausalLM class")
        report.problems.append(f"config.json: architectures is {architectures!r}, expected [{expected!r}] "
                               "(vLLM resolves the bare model otherwise and refuses to generate); re-export it")
    written = files_dtype((torch_dtype(e.dtype), math.prod(e.shape)) for e in entries.values() if _known(e.dtype))
    declared = {k: config[k] for k in DTYPE_KEYS if config.get(k) is not None}
    if not declared:
        report.problems.append(f"config.json declares no dtype: expected dtype and torch_dtype {_name(written)!r}")
    for key, value in declared.items():
        if written is not None and value != _name(written):
            report.problems.append(f"config.json: {key} is {value!r}, but the files hold {_name(written)!r}")
    table = serving_table(text.get("model_type"))
    for key in (table.required if table else ()):
        if key not in text:
            expected = repr(table.fixed[key]) if key in table.fixed else "the official key"
            report.problems.append(f"config.json lacks {key}, which serving engines read with another default "
                                   f"(expected: {expected}); re-export it")
    for key, value in (table.fixed.items() if table else ()):
        if key in text and text[key] != value:
            report.problems.append(f"config.json: {key} is {text[key]!r}, expected {value!r} (what the "
                                   "model computes; an engine reading another value serves another model)")


def _known(name: str) -> bool:
    try:
        return torch_dtype(name) is not None
    except InputError:
        return False


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _text_config(config: Mapping | None) -> Mapping:
    text = (config or {}).get("text_config")
    return text if isinstance(text, dict) else (config or {})


def _fp8_checks(path: str, entries: dict[str, TensorEntry], config: Mapping | None,
                report: VerifyReport) -> tuple[int, int] | None:
    """FP8 weights, their scales and ``quantization_config`` agree; returns the block size of an FP8
    checkpoint (None otherwise, or when its quantization_config cannot be read)."""
    fp8 = sorted(k for k, e in entries.items() if e.dtype == _FP8)
    scales = sorted(k for k in entries if k.endswith(SCALE_SUFFIX))
    quant = (config or {}).get("quantization_config") or _text_config(config).get("quantization_config")
    if not quant:
        if fp8 or scales:
            report.problems.append(f"{len(fp8)} float8_e4m3fn tensors and {len(scales)} scales, but config.json "
                                   "declares no quantization_config: loaders would read the FP8 bytes as weights")
        return None
    try:
        block = fp8_block_size(path)
    except InputError as exc:
        report.problems.append(f"config.json: {exc.problem} ({exc.key}: expected {exc.expected}, found {exc.actual})")
        return None
    scale_fmt = quant.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        report.problems.append(f"config.json: quantization_config.scale_fmt is {scale_fmt!r}, expected 'ue8m0' or none")
    if not fp8:
        report.problems.append("config.json declares FP8 quantization, but no tensor is float8_e4m3fn")
    allowed = _SCALE_DTYPES + (("F8_E8M0",) if scale_fmt == "ue8m0" else ())
    for key in fp8:
        _check_fp8_weight(key, entries, block, allowed, report)
    for key in scales:
        weight = entries.get(key[: -len(SCALE_SUFFIX)])
        if weight is None or weight.dtype != _FP8:
            report.problems.append(f"scale '{key}' has no float8_e4m3fn weight beside it"
                                   + ("" if weight is None else f" (the weight is {weight.dtype})"))
    return block


def _check_fp8_weight(key: str, entries: dict[str, TensorEntry], block: tuple[int, int], allowed: tuple[str, ...],
                      report: VerifyReport) -> None:
    weight, scale = entries[key], entries.get(key + SCALE_SUFFIX)
    if len(weight.shape) != 2:
        report.problems.append(f"FP8 weight '{key}' is {len(weight.shape)}-D {list(weight.shape)}, expected [out, in]")
        return
    if scale is None:
        report.problems.append(f"FP8 weight '{key}' has no '{key}{SCALE_SUFFIX}'")
        return
    grid = [-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])]
    if list(scale.shape) != grid:
        report.problems.append(f"scale '{key}{SCALE_SUFFIX}' has shape {list(scale.shape)}, expected {grid} for "
                               f"weight {list(weight.shape)} in {list(block)} blocks")
    if scale.dtype not in allowed:
        report.problems.append(f"scale '{key}{SCALE_SUFFIX}' is {scale.dtype}, expected one of {list(allowed)}")


def _serve_checks(entries: dict[str, TensorEntry], block: tuple[int, int], config: Mapping, tp_sizes: Sequence[int],
                  report: VerifyReport) -> None:
    """For each tensor-parallel size, the quantized weights whose shards would not be whole blocks
    (one line per kind of weight); then the MTP layer."""
    text = _text_config(config)
    for tp in tp_sizes:
        bad: dict[tuple, list[str]] = defaultdict(list)
        for key, entry in entries.items():
            dim = 0 if _TP_COLUMN.search(key) else 1 if _TP_ROW.search(key) else None
            if entry.dtype != _FP8 or len(entry.shape) != 2 or dim is None:
                continue
            if tp == 1 and not (dim == 0 and _PER_EXPERT.match(key)):
                continue  # no split at tp=1; only the experts' width rule applies
            width = _shard_width(key, entry.shape[dim], tp, text)
            if width is None or width % block[dim]:
                bad[(re.sub(r"\.\d+\.", ".N.", key), tuple(entry.shape), dim, width)].append(key)
        for (kind, shape, dim, width), keys in sorted(bad.items(), key=lambda kv: kv[0][0]):
            split = f"shards {width} wide" if width is not None else f"{tp} unequal shards"
            report.problems.append(
                f"tp={tp}: {len(keys)} FP8 weight(s) {kind} {list(shape)} split dim {dim} into {split}, not a "
                f"multiple of the {block[dim]}-wide block; vLLM and SGLang refuse to load this checkpoint at tp={tp}")
    _mtp_check(entries, text, report)


def _shard_width(key: str, size: int, tp: int, text: Mapping) -> int | None:
    """Rows (dim 0) or columns (dim 1) of one tensor-parallel shard; None when ``size`` does not
    split evenly. K and V heads are replicated once tp exceeds their count, as vLLM does."""
    heads = text.get("num_key_value_heads")
    if _KV.search(key) and isinstance(heads, int) and heads > 0 and size % heads == 0 and (heads % tp == 0 or tp % heads == 0):
        return size // heads * max(1, heads // tp)
    return size // tp if size % tp == 0 else None


def _mtp_check(entries: dict[str, TensorEntry], text: Mapping, report: VerifyReport) -> None:
    """``num_nextn_predict_layers`` MTP layers follow the main layers (DeepSeek's README_WEIGHTS.md):
    each must carry its own modules, or speculative decoding with it fails."""
    n, layers = text.get("num_nextn_predict_layers"), text.get("num_hidden_layers")
    if not isinstance(n, int) or not isinstance(layers, int) or n <= 0:
        return
    for layer in range(layers, layers + n):
        prefix = f"model.layers.{layer}."
        have = {k[len(prefix):] for k in entries if k.startswith(prefix)}
        missing = [m for m in MTP_MODULES if m not in have]
        if missing:
            report.problems.append(
                f"config.json says num_nextn_predict_layers={n}, but the MTP layer {prefix}* "
                + (f"lacks {missing}" if have else "is missing") + ": serving with MTP speculative decoding "
                "would fail (export with the layer, kept by from_hf, or set num_nextn_predict_layers to 0)")
