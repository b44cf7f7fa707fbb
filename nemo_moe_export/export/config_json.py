"""``config.json`` as the serving engines read it (docs/design.md#serving-engines).

Every door writes it here, from the model's transformers config: what ``save_pretrained`` writes,
with ``architectures`` naming transformers' causal-LM class of the ``model_type`` (a model built
with ``from_config`` carries none, and vLLM then resolves the bare model), the dtype of the written
tensors under both spellings (``dtype``, which transformers 5 and vLLM read, and ``torch_dtype``,
which SGLang reads with no default), the family's official keys that transformers' config class
lacks (``adapters/tables_serving.py``) and ``quantization_config`` for what the files hold.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from nemo_moe_export.adapters.tables_serving import causal_lm_class, serving_keys

__all__ = ["CONFIG_FILE", "DTYPE_KEYS", "files_dtype", "write_config_json"]

CONFIG_FILE = "config.json"
DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 / vLLM, and SGLang (transformers 4's name)


def files_dtype(tensors: Iterable[tuple[torch.dtype, int]]) -> torch.dtype | None:
    """The dtype a checkpoint's ``(dtype, elements)`` tensors are in: the floating dtype holding
    most elements, FP8 weights aside (an FP8 checkpoint declares the dtype of the rest, as
    DeepSeek's does) and float32 only where nothing else is (the router and scales transformers
    keeps in float32 are never the model's dtype)."""
    counts: Counter[torch.dtype] = Counter()
    for dtype, elements in tensors:
        if dtype.is_floating_point and dtype.itemsize > 1:
            counts[dtype] += elements
    if not counts:
        return None
    return counts.most_common(1)[0][0]


def write_config_json(directory: str, config: Any, dtype: torch.dtype | None,
                      quantization: dict[str, Any] | None = None) -> None:
    """Write ``config.json`` for ``config`` (a transformers config, left as it is) whose files hold
    ``dtype`` (see :func:`files_dtype`) and ``quantization`` (its ``quantization_config``)."""
    config = copy.deepcopy(config)  # the live model's config keeps its own dtype
    if dtype is not None:
        config.dtype = dtype
    # What the files hold, never a stale claim: a model loaded from an FP8 checkpoint keeps that
    # checkpoint's quantization_config, which an export in another format must drop
    # (docs/design.md#fp8-export).
    vars(config).pop("quantization_config", None)
    if quantization is not None:
        config.quantization_config = dict(quantization)
    full = config.to_dict()  # what save_pretrained writes (the class's model_type, not an instance's)
    model_class = causal_lm_class(full.get("model_type"))
    if model_class is not None:
        config.architectures = [model_class.__name__]
    config.save_pretrained(directory)  # its own JSON spelling; the keys engines need are added below
    path = os.path.join(directory, CONFIG_FILE)
    with open(path) as f:
        values = json.load(f)
    values.update(serving_keys(full))
    if dtype is not None:
        values.update(dict.fromkeys(DTYPE_KEYS, str(dtype).removeprefix("torch.")))
    with open(path, "w") as f:
        f.write(json.dumps(values, indent=2, sort_keys=True) + "\n")
