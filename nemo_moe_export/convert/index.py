"""The index of a stored checkpoint: every tensor's global shape, dtype, boxes and byte ranges.

Read from the checkpoint's own metadata on every rank, with no communication
(docs/design.md#checkpoint-conversion):

* a torch DCP checkpoint (megatron-core ``torch_dist``, torchtitan, AutoModel's DCP format): the
  ``.metadata`` pickle, read through :class:`_MetadataUnpickler`, which admits only the
  ``torch.distributed.checkpoint`` metadata records, ``torch.Size``, dtypes and a path record:
  a file a user hands us is never unpickled with arbitrary globals;
* a directory of HF-keyed safetensors shards (AutoModel's default ``model/`` output): the headers.

The format is detected from the checkpoint's own files (:func:`detect_format`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import dataclass

import torch

from nemo_moe_export.errors import InputError
from nemo_moe_export.safetensors_format import read_header, torch_dtype

__all__ = ["CheckpointIndex", "StoredChunk", "StoredTensor", "detect_format", "read_dcp_metadata", "read_index"]

METADATA_FILE = ".metadata"  # torch DCP's index of a checkpoint directory
MEGATRON_METADATA = "metadata.json"  # megatron-core dist_checkpointing's own note of its backend
# A fused experts parameter (no expert index, no ``.weight``): transformers' in-memory layout, which
# this repo's trainer saves and an HF checkpoint (one tensor per expert) never stores.
IN_MEMORY_EXPERTS = re.compile(r"model\..+\.experts\.[a-z_]+")

# The globals a DCP ``.metadata`` pickle may name (module, name): its records, their torch types,
# and the checkpoint id (a path) ``StorageMeta`` keeps. Anything else is refused.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_DCP_RECORDS = frozenset({
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "_StorageInfo", "_StoragePrefix",
    # megatron-core's torch_dist keeps its save plan in the metadata (Metadata.planner_data)
    "SavePlan", "WriteItem", "TensorWriteData", "WriteItemType",
})
_OTHER_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
})


@dataclass(frozen=True)
class StoredChunk:
    """One stored box of one tensor."""

    key: str  # the checkpoint's own key
    offsets: tuple[int, ...]  # the box's global offsets
    sizes: tuple[int, ...]
    file: str  # file name relative to the checkpoint directory
    byte_offset: int  # where the stored item starts in that file
    length: int  # the stored item's bytes
    # How the item is stored: "torch_save" (a DCP ``.distcp`` item: a small torch.save archive) or
    # "raw" (a safetensors tensor's bytes, row-major, of the tensor's dtype).
    encoding: str = "torch_save"


@dataclass(frozen=True)
class StoredTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[StoredChunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass(frozen=True)
class CheckpointIndex:
    directory: str
    format: str  # "megatron_torch_dist" | "torchtitan" | "automodel" | "transformers"
    tensors: dict[str, StoredTensor]  # every stored tensor
    other: frozenset[str]  # stored non-tensor entries (bytes, e.g. _extra_state, rng, train state)

    def files(self) -> dict[str, int]:
        """Every data file the tensors live in, with the least size the index says it has."""
        ends: dict[str, int] = {}
        for tensor in self.tensors.values():
            for chunk in tensor.chunks:
                ends[chunk.file] = max(ends.get(chunk.file, 0), chunk.byte_offset + chunk.length)
        return ends


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` admitting only its own record types (module docstring)."""

    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle's hook
        if (module in _DCP_MODULES and name in _DCP_RECORDS) or (module, name) in _OTHER_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name in {"strided", "contiguous_format", "preserve_format"}:
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not a DCP metadata record")


def read_dcp_metadata(path: str):
    """The DCP ``Metadata`` record at ``path`` (a ``.metadata`` file), through the restricted unpickler;
    a missing, truncated or foreign file is an InputError."""
    if not os.path.isfile(path):
        raise InputError("the checkpoint has no DCP metadata file", key=path, expected="a torch DCP .metadata file",
                         actual="missing", hint="pass the directory torch.distributed.checkpoint.save wrote")
    with open(path, "rb") as f:
        data = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError,
            IndexError, KeyError) as exc:
        raise InputError("the checkpoint's DCP metadata cannot be read", key=path,
                         expected="a complete torch DCP .metadata pickle", actual=f"{type(exc).__name__}: {exc}",
                         hint="the file is truncated or not a DCP checkpoint's; re-copy the checkpoint") from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise InputError("the checkpoint's DCP metadata is not a Metadata record", key=path,
                         expected="torch.distributed.checkpoint.metadata.Metadata", actual=type(metadata).__name__)
    return metadata


def _dcp_tensors(metadata) -> tuple[dict[str, StoredTensor], frozenset[str]]:
    """The tensors (each box with its file and byte range) and the other entries of a DCP Metadata."""
    locations: dict[tuple[str, tuple[int, ...]], object] = {}
    for index, info in metadata.storage_data.items():
        if index.offset is not None:
            locations[(index.fqn, tuple(index.offset))] = info
    tensors, other = {}, set()
    for key, meta in metadata.state_dict_metadata.items():
        if not hasattr(meta, "chunks"):
            other.add(key)
            continue
        chunks = []
        for chunk in meta.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            info = locations.get((key, offsets))
            if info is None:
                raise InputError("the DCP metadata has a box with no stored bytes", key=key,
                                 expected=f"a storage entry at offsets {offsets}", actual="none")
            if getattr(info, "transform_descriptors", None):  # e.g. compressed by a DCP extension
                raise InputError("a DCP item is stored through transforms the conversion does not read", key=key,
                                 expected="plain torch.save items", actual=list(info.transform_descriptors),
                                 hint="save the checkpoint without storage extensions")
            chunks.append(StoredChunk(key, offsets, tuple(int(s) for s in chunk.sizes), str(info.relative_path),
                                      int(info.offset), int(info.length)))
        tensors[key] = StoredTensor(key, tuple(int(s) for s in meta.size), meta.properties.dtype, tuple(chunks))
    return tensors, frozenset(other)


DCP_SHARDING_INFO = "DCP_SHARDING_INFO"  # torch DCP's HF storage writer: each file's boxes' global offsets


def _safetensors_tensors(directory: str) -> dict[str, StoredTensor]:
    """HF-keyed safetensors shards (AutoModel's, through torch DCP's HF storage writer): each file
    holds one box of each of its tensors, at the global offsets its header's ``DCP_SHARDING_INFO``
    records (none: the whole tensor); a tensor's global shape is where its boxes end."""
    boxes: dict[str, list[StoredChunk]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".safetensors")):
        header = read_header(os.path.join(directory, name))
        sharding = _sharding_info(header.metadata, name)
        for key in header.keys():
            entry = header.entry(key)
            sizes = tuple(int(s) for s in entry.shape)
            offsets = tuple(int(o) for o in sharding.get(key, {}).get("saved_offsets", (0,) * len(sizes)))
            boxes.setdefault(key, []).append(StoredChunk(key, offsets, sizes, name, header.data_start + entry.start,
                                                         entry.nbytes, "raw"))
            dtypes[key] = torch_dtype(entry.dtype, key=key)
    tensors = {}
    for key, chunks in boxes.items():
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].sizes)))
        tensors[key] = StoredTensor(key, shape, dtypes[key], tuple(chunks))
    return tensors


def _sharding_info(metadata: dict | None, name: str) -> dict:
    text = (metadata or {}).get(DCP_SHARDING_INFO)
    if text is None:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        raise InputError("a safetensors file's DCP sharding record cannot be read", key=name,
                         expected="JSON", actual=text[:80]) from None


def detect_format(directory: str, keys: frozenset[str] | set[str]) -> str:
    """The checkpoint's format from its own files: megatron's ``metadata.json`` names its backend;
    torchtitan's keys are its native module names; this repo's trainer's are transformers' in-memory
    names (fused experts ``mlp.experts.gate_up_proj``); AutoModel's are HF names (``model.``...)."""
    note = os.path.join(directory, MEGATRON_METADATA)
    if os.path.isfile(note):
        try:
            with open(note) as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            backend = None
        if backend == "torch_dist":
            return "megatron_torch_dist"
        raise InputError("a megatron checkpoint of an unsupported backend", key=note,
                         expected='"sharded_backend": "torch_dist"', actual=backend)
    if "tok_embeddings.weight" in keys or any(k.startswith("layers.") for k in keys):
        return "torchtitan"
    if any(IN_MEMORY_EXPERTS.fullmatch(k) for k in keys):  # transformers' fused experts: our trainer's
        return "transformers"
    if any(k.startswith(("model.", "lm_head.")) for k in keys):
        return "automodel"
    raise InputError("the checkpoint's format is not recognised", key=directory,
                     expected="megatron torch_dist, torchtitan DCP or AutoModel (HF-keyed) checkpoint",
                     actual=f"keys such as {sorted(keys)[:5]}")


def read_index(directory: str | os.PathLike[str]) -> CheckpointIndex:
    """The checkpoint's index from its own metadata; the same on every rank, no communication.

    ``directory`` is a DCP checkpoint directory (``.metadata`` + ``*.distcp``) or a directory of
    HF-keyed safetensors shards (AutoModel's ``model/``; a ``model/`` subdirectory is followed).
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise InputError("the checkpoint directory does not exist", key=directory, expected="a directory",
                         actual="missing")
    model_dir = os.path.join(directory, "model")  # AutoModel's layout: model/ beside optim/
    if not os.path.exists(os.path.join(directory, METADATA_FILE)) and os.path.isdir(model_dir):
        directory = model_dir
    if os.path.exists(os.path.join(directory, METADATA_FILE)) or not _has_safetensors(directory):
        tensors, other = _dcp_tensors(read_dcp_metadata(os.path.join(directory, METADATA_FILE)))
    else:
        tensors, other = _safetensors_tensors(directory), frozenset()
    return CheckpointIndex(directory, detect_format(directory, set(tensors) | set(other)), tensors, other)


def _has_safetensors(directory: str) -> bool:
    return any(n.endswith(".safetensors") for n in os.listdir(directory))
