"""``export.from_checkpoint`` of another framework's checkpoint: converted, never loaded into a model.

A checkpoint this repo's trainer saved (``.metadata`` and ``tokenizer/``) is restored into the
recipe's model as before. Any other (megatron-core ``torch_dist``, torchtitan DCP, AutoModel's)
is converted by ``convert_checkpoint`` into the export's output directory, with the export's
options and the recipe's model HF config, on the recipe's ranks: nothing builds the model
(docs/convert.md). Stages that need the model (train, mmlu) are refused before any rank starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from nemo_moe_export.convert import convert_checkpoint, read_index
from nemo_moe_export.errors import InputError
from nemo_moe_export.tiny_models import build_model

__all__ = ["FOREIGN_STAGES", "check_foreign", "convert_stage", "foreign_format", "recipe_hf_config"]

TRAINER_FILES = (".metadata", "tokenizer")  # what this repo's trainer saves (job/stages.py)
FOREIGN_STAGES = ("export", "verify")  # what runs on a converted checkpoint, without the model
_CONVERTIBLE = (".metadata", "model")  # a DCP index, or AutoModel's model/ folder (index.read_index)
# Each format's stored embedding: its rows are the vocabulary the recipe's HF config is given.
_EMBEDDINGS = ("model.embed_tokens.weight", "tok_embeddings.weight", "embedding.word_embeddings.weight")


def foreign_format(path: str) -> str | None:
    """None for a checkpoint this repo's trainer saved; else the format the conversion reads it as
    (an InputError where it is neither)."""
    if not os.path.isdir(path) or all(os.path.exists(os.path.join(path, n)) for n in TRAINER_FILES):
        return None
    if not any(os.path.exists(os.path.join(path, n)) for n in _CONVERTIBLE) and not _has_safetensors(path):
        return None  # nothing any format keeps: the training-checkpoint check says what is missing
    try:
        return read_index(path).format
    except InputError as exc:
        raise InputError("export.from_checkpoint is not a training checkpoint, nor one the conversion reads",
                         key="export.from_checkpoint", expected="{run_dir}/checkpoint of a training run, or a "
                         "megatron-core torch_dist, torchtitan or AutoModel checkpoint", actual=f"{path}: {exc}",
                         hint="docs/convert.md lists the formats") from None


def _has_safetensors(path: str) -> bool:
    return any(name.endswith(".safetensors") for name in os.listdir(path))


def check_foreign(cfg: Any, stages: list[str], format: str) -> None:
    """Refuse what a converted checkpoint cannot run: stages needing the model, quantization,
    MMLU evaluation of the reload (no tokenizer comes with another framework's checkpoint)."""
    needs_model = [s for s in stages if s not in FOREIGN_STAGES]
    if needs_model:
        raise InputError(f"a {format} checkpoint is converted, not loaded into the model", key="export.from_checkpoint",
                         expected=f"stages within {list(FOREIGN_STAGES)}", actual=f"stages {stages}",
                         hint="run stages=[export] to convert it; evaluate the converted HF checkpoint afterwards")
    if "verify" in stages and cfg.mmlu.enabled:
        raise InputError("verifying a converted checkpoint cannot re-evaluate MMLU (it has no tokenizer)",
                         key="mmlu.enabled", expected=False, actual=True, hint="pass mmlu.enabled=false")
    if cfg.export.quantize:
        raise InputError("the conversion does not quantize yet", key="export.quantize", expected=None,
                         actual=cfg.export.quantize, hint="convert, then quantize with the export")


def recipe_hf_config(model_cfg: Any, path: str) -> Any:
    """The recipe's model HF config (what its export writes), its vocabulary the stored embedding's rows."""
    tensors = read_index(path).tensors
    rows = next((tensors[k].shape[0] for k in _EMBEDDINGS if k in tensors), None)
    if rows is None:
        raise InputError("the checkpoint has no embedding to size the vocabulary", key="export.from_checkpoint",
                         expected=f"one of {list(_EMBEDDINGS)}", actual=path)
    # On the meta device: no memory, no weights; the config is the one the recipe's export writes.
    return build_model(model_cfg, vocab_size=rows, device="meta").config


def convert_stage(cfg: Any, target: str, options: Any, log: Any) -> dict[str, Any]:
    """Convert ``export.from_checkpoint`` into ``target`` on every rank; the export's summary."""
    source = cfg.export.from_checkpoint
    fields = dataclasses.asdict(options)
    result = convert_checkpoint(source, target, config=recipe_hf_config(cfg.model, source), **fields)
    log.info(f"converted the {result.format} checkpoint {source}: {result.checkpoint_bytes / 1e6:.1f} MB in "
             f"{result.files} files to {result.path} in {result.seconds:.2f} s")
    return {"path": result.path, "files": result.files, "bytes": result.checkpoint_bytes, "seconds": result.seconds,
            "step_seconds": result.step_seconds, "io": result.io, "format": result.format}
