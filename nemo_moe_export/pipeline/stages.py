"""Pipeline stages of a transformers MoE CausalLM, the AutoModel / torchtitan way
(docs/design.md#pipeline-stages).

A stage is a copy of the model that keeps only its decoder layers, under their original names:
``model.layers`` becomes an ``nn.ModuleDict`` keyed by the original layer index, so a stage's
parameter names are the unsplit model's (``model.layers.3.mlp.gate.weight``) and the state-dict
adapter and the export read them unchanged. Embeddings live on the first stage, the final norm and
``lm_head`` on the last (``None`` elsewhere); the rotary embedding module, which holds no
parameters, is on every stage. ``stage.config`` is the whole model's config (shared, not copied).

transformers' own forward cannot run a pruned model (it iterates ``layers[:num_hidden_layers]``
and returns a ModelOutput), so :func:`split_stages` gives every stage its own forward,
:func:`stage_forward`: plain tensor in, plain tensor out. It is installed as the stage's
``forward`` (an instance attribute) rather than wrapped in another module, so that calling the
stage runs the module's forward hooks: ``fully_shard(stage)`` registers its unshard and
gradient-reduction hooks there, and a wrapper calling the submodules directly would skip them.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)

from nemo_moe_export.errors import InputError, current_rank

__all__ = ["PipelineStageError", "StageInfo", "SUPPORTED_MODEL_TYPES", "kept_positions", "split_stages",
           "stage_forward", "stage_ids", "stage_info"]

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "qwen3_moe", "kimi_linear")
"""``config.model_type`` of the CausalLM families whose decoder layers a stage forward can drive
(Kimi K2 is the DeepSeek-V3 architecture under its own ``model_type``)."""


class PipelineStageError(RuntimeError):
    """A stage's forward raised; names the stage and the global rank that ran it."""

    def __init__(self, stage: int, rank: int | None, cause: BaseException) -> None:
        self.stage, self.rank = stage, rank
        where = f"pipeline stage {stage}" + (f" on rank {rank}" if rank is not None else "")
        super().__init__(f"{where} failed: {type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class StageInfo:
    """Which stage a module is: its index, the stage count and the original layer indices it holds."""

    index: int
    n_stages: int
    layers: tuple[int, ...]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1


def stage_info(stage: nn.Module) -> StageInfo:
    """The :class:`StageInfo` :func:`split_stages` attached to ``stage``."""
    info = getattr(stage, "pipeline_stage", None)
    if not isinstance(info, StageInfo):
        raise InputError("not a pipeline stage", key=type(stage).__name__,
                         expected="a module returned by split_stages", actual="no pipeline_stage attribute")
    return info


def stage_ids(pp_rank: int, pp_size: int, stages_per_rank: int = 1) -> list[int]:
    """The stages rank ``pp_rank`` of a pipeline group of ``pp_size`` holds, in "loop" order:
    ``pp_rank, pp_rank + pp_size, ...`` (``stages_per_rank`` > 1: virtual stages)."""
    if pp_size < 1 or stages_per_rank < 1 or not 0 <= pp_rank < pp_size:
        raise InputError("invalid pipeline position", key="stage_ids",
                         expected="0 <= pp_rank < pp_size, stages_per_rank >= 1",
                         actual=f"pp_rank={pp_rank}, pp_size={pp_size}, stages_per_rank={stages_per_rank}")
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def split_stages(model: nn.Module, n_stages: int, *, layers_per_stage: Sequence[int] | None = None
                 ) -> list[nn.Module]:
    """``n_stages`` stage modules of ``model`` (copies; ``model`` is left as it was).

    ``layers_per_stage`` (default: as even as possible, earlier stages taking the remainder) says
    how many consecutive decoder layers each stage holds, e.g. ``[1, 3]``. Every stage is returned;
    a rank keeps those :func:`stage_ids` names and drops the rest. Each stage's forward is
    :func:`stage_forward`; ``stage.pipeline_stage`` is its :class:`StageInfo`.
    """
    _require_supported(model)
    layers = model.model.layers
    counts = _layer_counts(len(layers), n_stages, layers_per_stage)
    if n_stages > 1 and getattr(model.config, "tie_word_embeddings", False):
        raise InputError("tied input and output embeddings cannot be split over pipeline stages",
                         key="tie_word_embeddings", expected=False, actual=True,
                         hint="the first stage holds the embedding, the last lm_head: untie them")
    stages, start = [], 0
    for index, count in enumerate(counts):
        kept = tuple(range(start, start + count))
        stages.append(_build_stage(model, StageInfo(index, n_stages, kept)))
        start += count
    return stages


def _require_supported(model: nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    inner = getattr(model, "model", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise InputError("cannot split this model into pipeline stages", key="model_type",
                         expected=f"a transformers CausalLM of {list(SUPPORTED_MODEL_TYPES)} "
                                  "(model.model.layers an nn.ModuleList)",
                         actual=f"{type(model).__name__} (model_type {model_type!r})",
                         hint="split the unsplit transformers model, once, before any sharding")


def _layer_counts(n_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None) -> list[int]:
    if n_stages < 1 or n_stages > n_layers:
        raise InputError("invalid number of pipeline stages", key="n_stages",
                         expected=f"1 <= n_stages <= {n_layers} (the decoder layers)", actual=n_stages)
    if layers_per_stage is None:
        base, extra = divmod(n_layers, n_stages)
        return [base + (i < extra) for i in range(n_stages)]
    counts = [int(c) for c in layers_per_stage]
    if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
        raise InputError("layers_per_stage does not split the decoder layers", key="layers_per_stage",
                         expected=f"{n_stages} counts >= 1 summing to {n_layers}", actual=counts)
    return counts


def _build_stage(model: nn.Module, info: StageInfo) -> nn.Module:
    """A copy of ``model`` holding only ``info``'s layers (and the ends it owns); its forward replaced."""
    inner = model.model
    dropped = [layer for i, layer in enumerate(inner.layers) if i not in info.layers]
    if not info.is_first:
        dropped.append(inner.embed_tokens)
    if not info.is_last:
        dropped += [inner.norm, model.lm_head]
    # deepcopy's memo maps each dropped module to None, so it is never copied; the config is shared.
    memo: dict[int, Any] = {id(m): None for m in dropped}
    memo[id(model.config)] = model.config
    stage = copy.deepcopy(model, memo)
    stage.model.layers = nn.ModuleDict({str(i): stage.model.layers[i] for i in info.layers})
    stage.pipeline_stage = info
    stage.forward = types.MethodType(stage_forward, stage)
    return stage


# --------------------------------------------------------------------------------------------------
# The stage forward
# --------------------------------------------------------------------------------------------------


def stage_forward(stage: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
    """One stage of the model: ``x`` is ``input_ids`` ``[rows, length]`` on the first stage, the
    previous stage's hidden states ``[rows, length, hidden]`` on the others; returns hidden states,
    or on the last stage logits ``[rows, kept, vocab]`` (``logits_to_keep`` as transformers reads it).

    ``attention_mask`` (``[rows, length]``, 1 = real token) must reach every stage: each stage
    rebuilds position ids, rotary cos/sin and the causal + padding mask from its own input, exactly
    as the unsplit model does once. A failure is re-raised as :class:`PipelineStageError` naming
    the stage and the global rank.
    """
    info = stage_info(stage)
    try:
        return _run_stage(stage, x, attention_mask, logits_to_keep)
    except PipelineStageError:
        raise
    except Exception as exc:
        raise PipelineStageError(info.index, current_rank(), exc) from exc


def _run_stage(stage: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None,
               logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    inner = stage.model
    hidden = inner.embed_tokens(x) if inner.embed_tokens is not None else x
    position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    masks = _layer_masks(stage.config, hidden, attention_mask, position_ids)
    rotary = getattr(inner, "rotary_emb", None)
    extra = {"position_embeddings": rotary(hidden, position_ids)} if rotary is not None else {}
    for index, layer in inner.layers.items():
        hidden = layer(hidden, attention_mask=masks[int(index)], position_ids=position_ids, **extra)
    if stage.lm_head is None:
        return hidden
    return stage.lm_head(kept_positions(inner.norm(hidden), logits_to_keep))


def _layer_masks(config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor) -> dict[int, Any]:
    """Each decoder layer's attention mask, built as the family's transformers model builds it."""
    kwargs = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                  position_ids=position_ids)
    n_layers = config.num_hidden_layers
    if config.model_type == "kimi_linear":
        by_type = {"full_attention": create_causal_mask(**kwargs),
                   "linear_attention": create_recurrent_attention_mask(**kwargs)}
        return {i: by_type[config.layer_types[i]] for i in range(n_layers)}
    if config.model_type == "qwen3_moe" and getattr(config, "sliding_window", None) is not None:
        mask = create_sliding_window_causal_mask(**kwargs)
    else:
        mask = create_causal_mask(**kwargs)
    return dict.fromkeys(range(n_layers), mask)


def kept_positions(hidden: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """``hidden`` ``[rows, length, h]`` at the positions ``keep`` names, as transformers'
    ``logits_to_keep``: an int keeps the last ``keep`` (0: all); a 1-D tensor those positions of
    every row; a 2-D integer ``[rows, n]`` tensor each row's own positions."""
    if isinstance(keep, torch.Tensor) and keep.dim() == 2:
        if keep.dtype == torch.bool:
            raise InputError("boolean logits_to_keep masks are not supported", key="logits_to_keep",
                             expected="an int or integer positions", actual="a bool mask")
        return torch.take_along_dim(hidden, keep[..., None], dim=1)
    if isinstance(keep, int):
        return hidden if keep == 0 else hidden[:, -keep:, :]
    return hidden[:, keep, :]
