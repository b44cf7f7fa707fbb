"""Casting like transformers: which tensors stay float32 when the export casts to ``dtype``.

A transformers model built (or loaded) in bf16 or fp16 keeps some tensors in float32: each model
class lists them as glob patterns in ``_keep_in_fp32_modules_strict`` (kept for bf16 and fp16) and
``_keep_in_fp32_modules`` (fp16 only), ``PreTrainedModel._get_dtype_plan``. DeepSeek-V3 keeps its
router ``gate.weight`` and ``e_score_correction_bias``, Kimi Linear also ``dt_bias``: rounding the
router bias to bf16 would change which experts are chosen. The loader turns the patterns into one
regex (``*`` -> ``.*``, ``core_model_loading.build_glob_alternation``) and searches it in each
in-memory parameter name; we do the same, so an export with ``dtype=`` equals ``save_pretrained``
of the same weights in a model built in that dtype (docs/design.md#casting-like-transformers).

Which tensors stay float32 is a property of the family's HF format, not of the in-memory class: the
patterns are read from transformers' causal-LM class for the config's ``model_type`` on every door
(NeMo AutoModel's DeepSeek-V3 class names only ``e_score_correction_bias``, transformers' also the
router ``gate.weight``), never from a list of ours.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from nemo_moe_export.adapters.tables_serving import causal_lm_class

__all__ = ["float32_keys", "fp32_patterns"]


def fp32_patterns(dtype: torch.dtype | None, config: Any = None) -> tuple[str, ...]:
    """The glob patterns transformers keeps in float32 for a model of ``config`` (a config object or
    a dict) built in ``dtype``."""
    if dtype not in (torch.float16, torch.bfloat16):
        return ()
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    source = causal_lm_class(model_type)
    if source is None:
        return ()
    patterns = set(getattr(source, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        patterns |= set(getattr(source, "_keep_in_fp32_modules", None) or ())
    return tuple(sorted(patterns))


def float32_keys(patterns: Iterable[str], source_keys: Mapping[str, str]) -> frozenset[str]:
    """HF keys (of ``{hf_key: in-memory key}``) whose in-memory name matches a pattern, as
    transformers searches it. The HF name is searched too, for state dicts whose in-memory names
    are not transformers' own (megatron-core); for the supported families both agree."""
    patterns = list(patterns)
    if not patterns:
        return frozenset()
    alternation = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    return frozenset(hf for hf, mem in source_keys.items() if alternation.search(mem) or alternation.search(hf))
