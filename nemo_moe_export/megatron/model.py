"""A megatron-core ``GPTModel`` presented the way the evaluator, the hooks and the export use a
transformers model (docs/design.md#megatron-core-models).

    model = MegatronCausalLM(gpt_model)                  # every rank, after initialize_model_parallel
    evaluate_mmlu(model, tokenizer, questions, dev)      # megatron's own dispatchers run the forwards
    export_hf_checkpoint("out/hf", model)                # each EP rank writes its experts, no gather
    get_adapter(model.config).from_hf(model.state_dict(), "out/hf")   # reads only this rank's slices

* ``model(input_ids=, attention_mask=, use_cache=False, logits_to_keep=) -> .logits`` calls
  ``GPTModel.forward`` as it is, with position ids and an explicit boolean mask (megatron's default
  causal mask is built on ``"cuda"``); ``logits_to_keep`` (transformers' meaning, per-row positions
  included) selects hidden states before ``output_layer``, so only the scored positions are
  projected onto the vocabulary.
* ``.config`` is the HF config built from the model's ``TransformerConfig`` (``hf_config.py``); it
  carries the megatron names and the local experts for ``get_adapter``, not into ``config.json``.
* ``state_dict()`` is the export's view (``state.py``): the live tensors, as DTensors over their
  replica groups. Training checkpoints stay megatron's own (``gpt.sharded_state_dict()``).

Groups come from ``parallel_state`` (``parallel.discover_layout``). Expert parallelism and data
parallelism are supported; tensor, pipeline, context and expert-tensor parallelism are refused at
construction (the wrapper would call one pipeline stage or one TP shard a whole model).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutput

from nemo_moe_export.adapters import InMemoryLayout
from nemo_moe_export.adapters.tables_megatron import NAMING
from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.megatron.hf_config import hf_config_for, infer_family, stock_config_class
from nemo_moe_export.megatron.state import ReplicaMeshes, export_view, gather_local_experts
from nemo_moe_export.parallel import ParallelLayout, discover_layout

__all__ = ["MegatronCausalLM", "attention_mask_for", "check_parallelism"]


class MegatronCausalLM(torch.nn.Module):
    """``gpt_model`` (a megatron-core ``GPTModel``) called transformers-style; see the module doc.

    Construct it on every rank (it all-gathers the MoE layers' ``local_expert_indices`` over the EP
    group). ``family`` is ``"deepseek_v3"`` or ``"qwen3_moe"`` (default: DeepSeek-V3 for MLA models,
    Qwen3-MoE otherwise).
    """

    def __init__(self, gpt_model: Any, *, family: str | None = None, layout: ParallelLayout | None = None) -> None:
        super().__init__()
        check_parallelism()
        self.gpt = gpt_model
        self.layout = layout or discover_layout()
        if self.layout.source != "megatron":
            raise ExportInputError("a megatron-core model needs parallel_state's groups", key="layout",
                                   expected="the layout discover_layout() reads from parallel_state",
                                   actual=f"a layout from {self.layout.source}")
        self.family = family or infer_family(gpt_model.config)
        local = gather_local_experts(gpt_model, self.layout)
        self.config = hf_config_for(gpt_model, self.family, InMemoryLayout(NAMING, local))
        self._meshes = ReplicaMeshes(self.layout, next(gpt_model.parameters()).device.type)
        self._copy_fp32_declarations()

    def _copy_fp32_declarations(self) -> None:
        """What the family's transformers class keeps in float32, so an export cast to bf16 keeps
        the same tensors float32 (read from the class, as the export's casting does)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        hf_class = MODEL_FOR_CAUSAL_LM_MAPPING[stock_config_class(self.config)]
        self._keep_in_fp32_modules = list(getattr(hf_class, "_keep_in_fp32_modules", None) or [])
        self._keep_in_fp32_modules_strict = list(getattr(hf_class, "_keep_in_fp32_modules_strict", None) or [])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                use_cache: bool = False, logits_to_keep: int | torch.Tensor = 0) -> CausalLMOutput:
        """``.logits`` ``[rows, kept positions, vocab]``; ``use_cache`` is accepted and unused (no cache)."""
        rows, length = input_ids.shape
        position_ids = torch.arange(length, device=input_ids.device).expand(rows, length)
        mask = attention_mask_for(attention_mask, rows, length, input_ids.device)
        with _project_only(self.gpt.output_layer, logits_to_keep):
            logits = self.gpt(input_ids, position_ids, mask, runtime_gather_output=True)
        return CausalLMOutput(logits=logits)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The export's view of the live tensors (``state.py``); megatron's own checkpoint is
        ``self.gpt.sharded_state_dict()``."""
        if args or kwargs:
            raise TypeError("MegatronCausalLM.state_dict() takes no arguments (it is the export's view); "
                            "use .gpt.state_dict(...) for megatron-core's own")
        return export_view(self.gpt, self._meshes)


def check_parallelism() -> None:
    """Refuse tensor, pipeline, context and expert-tensor parallelism (EP x DP only)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise ExportInputError("megatron-core's parallel_state is not initialised", key="parallel_state",
                               expected="parallel_state.initialize_model_parallel(...) before wrapping the model",
                               actual="not initialised")
    sizes = {"tensor_model_parallel": ps.get_tensor_model_parallel_world_size(),
             "pipeline_model_parallel": ps.get_pipeline_model_parallel_world_size(),
             "context_parallel": ps.get_context_parallel_world_size(),
             "expert_tensor_parallel": ps.get_expert_tensor_parallel_world_size()}
    if any(size != 1 for size in sizes.values()):
        raise ExportInputError("only expert and data parallelism are supported for megatron-core models",
                               key="parallel_state", expected="TP = PP = CP = expert-TP = 1", actual=sizes,
                               hint="docs/design.md#megatron-core-models says what is supported")


def attention_mask_for(attention_mask: torch.Tensor | None, rows: int, length: int, device: torch.device
                       ) -> torch.Tensor:
    """megatron's ``[rows, 1, length, length]`` boolean mask (True = masked): causal, padded keys
    masked, and every position free to see itself, so a padding row never softmaxes over nothing
    (its output is never read; a fully masked row would be NaN and leak through the values)."""
    future = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    mask = future.expand(rows, 1, length, length)
    if attention_mask is not None:
        mask = mask | (attention_mask == 0).view(rows, 1, 1, length)
    return mask & ~torch.eye(length, dtype=torch.bool, device=device)


def _kept_positions(hidden: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """``hidden`` [s, b, h] at the positions ``keep`` names, as transformers' ``logits_to_keep``:
    an int keeps the last ``keep``; a 1-D tensor those positions; a 2-D ``[b, n]`` integer tensor
    each row's own positions."""
    rows_first = hidden.transpose(0, 1)
    if isinstance(keep, torch.Tensor) and keep.dim() == 2:
        if keep.dtype == torch.bool:
            raise ExportInputError("boolean logits_to_keep masks are not supported", key="logits_to_keep",
                                   expected="an int or integer positions", actual="a bool mask")
        rows_first = torch.take_along_dim(rows_first, keep[..., None], dim=1)
    else:
        rows_first = rows_first[:, slice(-keep, None) if isinstance(keep, int) else keep, :]
    return rows_first.transpose(0, 1)


def _project_only(output_layer: Any, keep: int | torch.Tensor) -> Any:
    """While active, ``output_layer`` projects only the kept positions (a forward pre-hook)."""
    if isinstance(keep, int) and keep == 0:
        return nullcontext()
    return _hooked(output_layer, keep)


@contextmanager
def _hooked(output_layer: Any, keep: int | torch.Tensor) -> Iterator[None]:
    def select(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (_kept_positions(args[0], keep), *args[1:]), kwargs

    handle = output_layer.register_forward_pre_hook(select, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
