"""What the conversion checks before any file exists: the HF config, and the checkpoint's shapes
against the model that config describes (docs/design.md#checkpoint-conversion).

The reference is the in-job export's own view of the model: transformers builds the config's model
on the meta device (no memory, no weights) and the family's state-dict adapter lists every HF key
with its global shape, which is what ``export_hf_checkpoint`` of that model would write. A stored
checkpoint must map to exactly those keys and shapes (DeepSeek-V3's MTP layers, which transformers
does not build, are admitted where the config declares them).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from nemo_moe_export.adapters import TensorMeta, get_adapter
from nemo_moe_export.errors import InputError

__all__ = ["check_shapes", "expected_metadata", "hf_config_of"]


def hf_config_of(config: Any) -> Any:
    """A transformers config from a ``PretrainedConfig``, a ``config.json`` path or its directory."""
    if isinstance(config, PretrainedConfig):
        return config
    if config is None:
        raise InputError("no HF config given", key="config", expected="a config.json, its directory or a PretrainedConfig",
                         actual=None, hint="pass --config PATH (the HF config of the trained model)")
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise InputError("the HF config does not exist", key="config", expected="a config.json file or its directory",
                         actual=path)
    try:
        with open(path) as f:
            values = json.load(f)
        model_type = values.pop("model_type")
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError("the HF config cannot be read", key=path, expected="a transformers config.json with model_type",
                         actual=f"{type(exc).__name__}: {exc}") from None


def expected_metadata(hf_config: Any) -> dict[str, TensorMeta]:
    """Every HF key (global shape) the in-job export writes for a model of ``hf_config``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return get_adapter(hf_config).hf_metadata(model.state_dict())


def _mtp_layer(key: str, text: Any) -> bool:
    """An MTP layer's key the config declares (HF layers ``L .. L + num_nextn_predict_layers - 1``)."""
    match = re.match(r"model\.layers\.(\d+)\.", key)
    layers, mtp = int(getattr(text, "num_hidden_layers", 0)), int(getattr(text, "num_nextn_predict_layers", 0) or 0)
    return match is not None and layers <= int(match.group(1)) < layers + mtp


def check_shapes(metadata: Mapping[str, TensorMeta], hf_config: Any) -> None:
    """Refuse a checkpoint whose HF keys or shapes are not those of ``hf_config``'s model."""
    expected = expected_metadata(hf_config)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    missing = sorted(set(expected) - set(metadata))
    extra = sorted(k for k in set(metadata) - set(expected) if not _mtp_layer(k, text))
    if missing or extra:
        raise InputError("the checkpoint is not of the model the HF config describes", key=(missing or extra)[0],
                         expected=f"the {len(expected)} tensors of a {getattr(text, 'model_type', '?')} model "
                                  "of this config", actual=f"{len(missing)} missing (e.g. {missing[:3]}), "
                                                           f"{len(extra)} unexpected (e.g. {extra[:3]})",
                         hint="pass the HF config of the model this checkpoint was trained as")
    for key, meta in sorted(expected.items()):
        if tuple(metadata[key].shape) != tuple(meta.shape):
            raise InputError("the checkpoint's shape disagrees with the HF config", key=key,
                             expected=tuple(meta.shape), actual=tuple(metadata[key].shape),
                             hint="pass the HF config of the model this checkpoint was trained as")
