"""Checkpoints for tests/test_convert.py, saved by the frameworks themselves, and what they are
compared with.

* :func:`torchtitan_checkpoints` runs ``tests/torchtitan_fixture.py`` in an interpreter that
  imports torchtitan 0.3.0 (``$NEMO_MOE_EXPORT_TORCHTITAN_PATH``, or ``.torchtitan`` at the
  repository's root as ``make setup-torchtitan`` installs it): DCP checkpoints with optimizer state,
  saved under FSDP on 2 gloo ranks, and torchtitan's own ``to_hf`` of the same weights.
* :func:`bridge_run_configs` runs ``tests/bridge_fixture.py`` in an interpreter that finds
  Megatron-Bridge 0.3.1 (``$NEMO_MOE_EXPORT_BRIDGE_PATH``, or ``.megatron-bridge`` as ``make
  setup-bridge`` installs it) and torchtitan's folder (for triton): Bridge's own ``run_config.yaml``
  of each model of ``megatron_checkpoints.py``.
* :func:`in_job_export` is this repo's export of a transformers model loaded with those weights.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("deepseek_v3", "qwen3_moe")


def torchtitan_path() -> str | None:
    """Where torchtitan 0.3.0 and the modules it imports are installed, or None."""
    path = os.environ.get("NEMO_MOE_EXPORT_TORCHTITAN_PATH") or os.path.join(ROOT, ".torchtitan")
    return path if os.path.isdir(os.path.join(path, "torchtitan")) else None


def torchtitan_checkpoints(out: str, families: tuple[str, ...] = ()) -> str:
    """Save the torchtitan checkpoints into ``out`` (one folder per family: ``families``, else the
    fixture's default ones); returns ``out``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([torchtitan_path(), ROOT]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "torchtitan_fixture.py"), out, *families],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"torchtitan fixture failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return out


def bridge_path() -> str | None:
    """Where Megatron-Bridge 0.3.1 is installed (beside torchtitan, whose triton it needs), or None."""
    path = os.environ.get("NEMO_MOE_EXPORT_BRIDGE_PATH") or os.path.join(ROOT, ".megatron-bridge")
    found = os.path.isdir(os.path.join(path, "megatron", "bridge")) and torchtitan_path() is not None
    return path if found else None


def bridge_run_configs(out: str) -> str:
    """Megatron-Bridge's ``run_config.yaml`` of each family into ``out/{family}``; returns ``out``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([bridge_path(), torchtitan_path(), ROOT]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "bridge_fixture.py"), out],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"Megatron-Bridge fixture failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return out


def reference_model(family_dir: str, work: str):
    """The transformers model of ``family_dir``'s config loaded with torchtitan's ``to_hf`` of the
    weights, and transformers' loading info."""
    from transformers import AutoModelForCausalLM

    folder = os.path.join(work, "reference_hf")
    os.makedirs(folder, exist_ok=True)
    shutil.copy(os.path.join(family_dir, "config.json"), folder)
    shutil.copy(os.path.join(family_dir, "reference.safetensors"), os.path.join(folder, "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)


def in_job_export(model, out: str, **options) -> str:
    from nemo_moe_export.export import export_hf_checkpoint

    export_hf_checkpoint(out, model, **options)
    return out


def tensors_of(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def stored_model_bytes(dcp_dir: str, written: Callable[[str], bool]) -> tuple[int, int]:
    """(bytes, items) of the stored items of the tensors ``written`` names, from torch's own reading
    of the DCP metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(dcp_dir).read_metadata()
    items = [info for index, info in metadata.storage_data.items() if index.offset is not None and written(index.fqn)]
    return sum(info.length for info in items), len(items)
