"""The export's directories: the target, the temporary sibling it is built in, and the atomic publish.

The checkpoint is written into ``.{name}.partial`` beside the target and renamed into place only
when complete and verified, so the target never holds a partial checkpoint; with
``overwrite="replace"`` the old directory is swapped out to ``.{name}.old`` and removed after the
rename (docs/design.md#export-plan-and-invariants). Directory fsyncs make the new entries durable.
All of it runs on rank 0 only, except :meth:`ExportTarget.check`, which every rank runs.
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.export.plan import ExportPlan
from nemo_moe_export.safetensors_format import INDEX_FILE, SUFFIX

__all__ = ["ExportTarget", "fsync_path", "write_metadata_files"]


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ExportTarget:
    """The final directory ``path`` and its siblings ``partial`` (being written) and ``trash``
    (the replaced checkpoint, briefly)."""

    path: str

    @staticmethod
    def at(output_dir: str | os.PathLike[str]) -> "ExportTarget":
        return ExportTarget(os.path.abspath(os.fspath(output_dir)))

    @property
    def parent(self) -> str:
        return os.path.dirname(self.path)

    @property
    def partial(self) -> str:
        return os.path.join(self.parent, f".{os.path.basename(self.path)}.partial")

    @property
    def trash(self) -> str:
        return os.path.join(self.parent, f".{os.path.basename(self.path)}.old")

    def check(self, overwrite: str) -> None:
        """Refuse an existing target unless it may be replaced, and a parent that does not exist."""
        if os.path.exists(self.path) and overwrite == "error":
            raise ExportInputError("export target already exists", key=self.path, expected="no directory there",
                                   actual="an existing path", hint='pass overwrite="replace" to swap it atomically')
        if not os.path.isdir(self.parent):
            raise ExportInputError("parent of the export target does not exist", key=self.parent,
                                   expected="an existing directory on a filesystem shared by all ranks",
                                   actual="missing")

    def prepare(self) -> None:
        """A fresh, empty partial directory (a stale one from a failed attempt is removed)."""
        shutil.rmtree(self.partial, ignore_errors=True)
        os.makedirs(self.partial)

    def seal(self) -> None:
        """Make the partial directory's entries durable before it is renamed."""
        fsync_path(self.partial)

    def publish(self, overwrite: str) -> None:
        """Rename the partial directory into place (swapping an existing target out when allowed)."""
        if not os.path.exists(self.path):
            os.rename(self.partial, self.path)
            fsync_path(self.parent)
            return
        if overwrite != "replace":
            raise ExportInputError("export target appeared while exporting", key=self.path,
                                   expected="no directory there", actual="an existing path")
        shutil.rmtree(self.trash, ignore_errors=True)
        os.rename(self.path, self.trash)
        os.rename(self.partial, self.path)
        fsync_path(self.parent)
        shutil.rmtree(self.trash, ignore_errors=True)

    def discard(self) -> None:
        """Remove the partial directory after a failure; the target was never touched."""
        shutil.rmtree(self.partial, ignore_errors=True)


def write_metadata_files(directory: str, plan: ExportPlan, config: Any, dtype: torch.dtype | None,
                         generation_config: Any = None, tokenizer: Any = None) -> None:
    """The index, ``config.json`` (with the exported ``dtype``), the generation config and the
    tokenizer files, each fsynced."""
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        f.write(plan.index_json())
        f.flush()
        os.fsync(f.fileno())
    config = copy.deepcopy(config)  # the live model's config keeps its own dtype
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if not entry.endswith(SUFFIX) and os.path.isfile(path):
            fsync_path(path)
