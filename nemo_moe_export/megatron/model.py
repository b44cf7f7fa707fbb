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
  replica groups, under global layer numbers. Training checkpoints stay megatron's own
  (``gpt.sharded_state_dict()``).

Groups come from ``parallel_state`` (``parallel.discover_layout``). Expert, data, pipeline, tensor
(with or without sequence parallelism) and expert-tensor parallelism are supported. Under pipeline
parallelism each rank wraps its own stage (a ``GPTModel`` built with its ``pre_process`` /
``post_process``); the forward runs megatron's pipeline schedule and every rank returns the last
stage's logits (``pipeline.py``), and ``pipeline_group`` tells the export which ranks hold the other
stages (docs/design.md#pipeline-stages-megatron-core). Under tensor parallelism every rank of a TP
group is called with the same batch; megatron gathers the vocabulary-parallel logits, so every rank
returns the same ``.logits``; with sequence parallelism the sequence is padded (masked, on the
right) to a multiple of the TP size and the padding cut off the logits. The export's view places
each tensor as ``sharded_state_dict()`` records it (``state.py``,
docs/design.md#tensor-parallelism-megatron-core). megatron pads its vocabulary (to a multiple of
``make_vocab_size_divisible_by * TP`` in its training scripts): ``vocab_size`` is the HF one, and the
logits, ``config.json`` and the export carry only its rows. ``train_step`` (the recipe's trainer
calls it) trains a pipelined model through megatron's own 1F1B schedule; without pipeline stages it
is one forward and backward, as the trainer's own. Context and virtual-pipeline parallelism are
refused at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers.modeling_outputs import CausalLMOutput
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from nemo_moe_export.adapters import InMemoryFormat
from nemo_moe_export.adapters.tables_megatron import NAMING
from nemo_moe_export.errors import InputError
from nemo_moe_export.megatron.hf_config import hf_config_for, infer_family, stock_config_class
from nemo_moe_export.megatron.pipeline import (kept_positions, main_head_only, pipelined_logits, pipelined_train_step,
                                              projecting_only)
from nemo_moe_export.megatron.state import ReplicaMeshes, export_view, gather_local_experts, moe_layer_ids
from nemo_moe_export.parallel import ParallelLayout, RankGroup, discover_layout

__all__ = ["MegatronCausalLM", "attention_mask_for", "check_parallelism"]


class MegatronCausalLM(torch.nn.Module):
    """``gpt_model`` (a megatron-core ``GPTModel``) called transformers-style; see the module doc.

    Construct it on every rank (it all-gathers the MoE layers' ``local_expert_indices`` over the EP
    group and the MoE layer numbers over the pipeline group). ``family`` is ``"deepseek_v3"`` or
    ``"qwen3_moe"`` (default: DeepSeek-V3 for MLA models, Qwen3-MoE otherwise). ``vocab_size``: the
    HF vocabulary (the tokenizer's; default the model's own, i.e. no padding), at most the model's
    padded ``vocab_size``. ``microbatches``:
    how many microbatches the pipeline schedule cuts a batch into (default: one per stage; a
    training batch must split into that many equal ones, a forward's takes the largest count not
    above it that divides its rows); unused without pipeline stages.
    """

    def __init__(self, gpt_model: Any, *, family: str | None = None, layout: ParallelLayout | None = None,
                 microbatches: int | None = None, vocab_size: int | None = None) -> None:
        super().__init__()
        check_parallelism()
        self.gpt = gpt_model
        self.layout = layout or discover_layout()
        if self.layout.source != "megatron":
            raise InputError("a megatron-core model needs parallel_state's groups", key="layout",
                             expected="the layout discover_layout() reads from parallel_state",
                             actual=f"a layout from {self.layout.source}")
        if self.layout.pp.size != gpt_model.config.pipeline_model_parallel_size:  # a stage taken for a model
            raise InputError("the layout's pipeline group is not the model's pipeline", key="layout.pp",
                             expected=f"{gpt_model.config.pipeline_model_parallel_size} stages "
                                      "(the model's pipeline_model_parallel_size)",
                             actual=f"a pipeline group of {self.layout.pp.size} ranks")
        if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                         or microbatches < 1):
            raise InputError("the pipeline's microbatch count must be a positive integer", key="microbatches",
                             expected="an integer >= 1 (None: one per stage)", actual=repr(microbatches))
        self.microbatches = microbatches or self.layout.pp.size
        self.vocab_size = _hf_vocab_size(gpt_model, vocab_size)
        self.family = family or infer_family(gpt_model.config)
        local = gather_local_experts(gpt_model, self.layout)
        moe_layers = _over_stages(moe_layer_ids(gpt_model), self.layout.pp)
        self.config = hf_config_for(gpt_model, self.family, InMemoryFormat(NAMING, local), moe_layers,
                                    vocab_size=self.vocab_size)
        self._meshes = ReplicaMeshes(self.layout, next(gpt_model.parameters()).device.type, _etp_group())
        self._copy_fp32_declarations()

    def _copy_fp32_declarations(self) -> None:
        """What the family's transformers class keeps in float32, so an export cast to bf16 keeps
        the same tensors float32 (read from the class, as the export's casting does)."""
        hf_class = MODEL_FOR_CAUSAL_LM_MAPPING[stock_config_class(self.config)]
        self._keep_in_fp32_modules = list(getattr(hf_class, "_keep_in_fp32_modules", None) or [])
        self._keep_in_fp32_modules_strict = list(getattr(hf_class, "_keep_in_fp32_modules_strict", None) or [])

    @property
    def pipeline_group(self) -> Any:
        """The pipeline process group (one rank per stage, in stage order), or None without
        pipeline parallelism: the export gathers every stage's keys over it
        (docs/design.md#pipeline-stages-megatron-core)."""
        return self.layout.pp.group if self.layout.pp.size > 1 else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                use_cache: bool = False, logits_to_keep: int | torch.Tensor = 0) -> CausalLMOutput:
        """``.logits`` ``[rows, kept positions, vocab]``; ``use_cache`` is accepted and unused (no
        cache). Every rank of a pipeline and of a tensor-parallel group is called with the same
        batch and returns the same logits (``[..., :vocab_size]``: megatron's padding rows cut)."""
        length = input_ids.shape[1]
        input_ids, attention_mask, logits_to_keep = self._padded_for_sequence_parallel(input_ids, attention_mask,
                                                                                        logits_to_keep)
        rows, padded = input_ids.shape
        position_ids = torch.arange(padded, device=input_ids.device).expand(rows, padded)
        mask = attention_mask_for(attention_mask, rows, padded, input_ids.device)
        # under sequence parallelism the output layer's input is this rank's sequence shard (the
        # layer gathers it), so positions are selected from the logits, not before the projection
        sequence_parallel = self.gpt.config.sequence_parallel
        projected = 0 if sequence_parallel else logits_to_keep
        if self.layout.pp.size > 1:
            logits = pipelined_logits(self.gpt, self.layout.pp, input_ids, position_ids, mask, projected,
                                      self.microbatches)
        else:
            with projecting_only(self.gpt.output_layer, projected), main_head_only(self.gpt):
                logits = self.gpt(input_ids, position_ids, mask, runtime_gather_output=True)
        if isinstance(logits_to_keep, int) and logits_to_keep == 0:
            logits = logits[:, :length]  # the sequence-parallel padding
        elif sequence_parallel:
            logits = kept_positions(logits.transpose(0, 1), logits_to_keep).transpose(0, 1)
        return CausalLMOutput(logits=logits[..., :self.vocab_size])

    def _padded_for_sequence_parallel(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                                      keep: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                         int | torch.Tensor]:
        """Under sequence parallelism megatron splits the sequence over the TP ranks, so its length
        must divide by the TP size: pad on the right with masked positions (causal attention keeps
        them out of every real position) and name the kept positions explicitly (an int would
        count from the padded end)."""
        tp = self.layout.tp.size
        rows, length = input_ids.shape
        if not self.gpt.config.sequence_parallel or length % tp == 0:
            return input_ids, attention_mask, keep
        extra = tp - length % tp
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        input_ids = torch.nn.functional.pad(input_ids, (0, extra))
        attention_mask = torch.nn.functional.pad(attention_mask, (0, extra))
        if isinstance(keep, int) and keep > 0:
            keep = torch.arange(length - keep, length, device=input_ids.device)
        return input_ids, attention_mask, keep

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   attention_mask: torch.Tensor | None = None, optimizer: Any = None) -> torch.Tensor:
        """The batch's loss (a float32 scalar, detached), its gradients accumulated into ``.grad``:
        what the recipe's trainer calls for one training step.

        Under pipeline parallelism every rank of a pipeline passes the same batch; megatron's own
        1F1B schedule (``get_forward_backward_func()(forward_only=False)``) runs it in
        ``self.microbatches`` equal microbatches (``rows`` must divide), the last stage computes
        ``loss_fn(logits [rows, length, vocab], labels)`` per microbatch and the result is their
        mean on every rank of the pipeline. Gradients are those of that mean, so with as many
        labelled tokens in each microbatch they equal the unsplit model's for the whole batch; a
        stage's copy of the word embeddings (MTP or tied output) has its gradient all-reduced with
        the first stage's (``pipeline.py``). Without pipeline stages: ``loss_fn(self(...).logits,
        labels).backward()``, exactly the trainer's own step. Averaging over data-parallel ranks
        stays the caller's (the recipe's ``_sync_unsharded_grads``). With ``optimizer``: its
        gradients are zeroed first and it steps after."""
        expert_parallel = getattr(self.gpt.config, "expert_model_parallel_size", 1)
        if expert_parallel != self.layout.ep.size:  # experts would be averaged with other experts
            raise InputError("the model's config does not have parallel_state's expert-parallel size",
                             key="expert_model_parallel_size",
                             expected=f"{self.layout.ep.size} (megatron marks expert weights allreduce=False "
                                      "only when it is > 1; gradient averaging reads that mark)",
                             actual=expert_parallel)
        if optimizer is not None:
            optimizer.zero_grad()
        if self.layout.pp.size > 1:
            rows, length = input_ids.shape
            position_ids = torch.arange(length, device=input_ids.device).expand(rows, length)
            mask = attention_mask_for(attention_mask, rows, length, input_ids.device)
            loss = pipelined_train_step(self.gpt, self.layout.pp, input_ids, position_ids, mask, labels, loss_fn,
                                        self.microbatches)
        else:
            loss = loss_fn(self(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
            loss.backward()
            loss = loss.detach().float()
        if optimizer is not None:
            optimizer.step()
        return loss

    def sync_embedding_copy(self) -> None:
        """After loading weights through the view (``from_hf``), give a non-first stage's copy of
        the word embeddings (built for an MTP layer or a tied output layer; not in the view) the
        first stage's values again: megatron's own ``setup_embeddings_and_output_layer``, which
        zeroes the copy and all-reduces it over the embedding group. Every rank calls it."""
        gpt = self.gpt
        if self.layout.pp.size > 1 and (gpt.pre_process or gpt.post_process or gpt.mtp_process):
            with torch.no_grad():
                gpt.setup_embeddings_and_output_layer()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The export's view of the live tensors (``state.py``); megatron's own checkpoint is
        ``self.gpt.sharded_state_dict()``."""
        if args or kwargs:
            raise TypeError("MegatronCausalLM.state_dict() takes no arguments (it is the export's view); "
                            "use .gpt.state_dict(...) for megatron-core's own")
        return export_view(self.gpt, self._meshes)


def check_parallelism() -> None:
    """Refuse context and virtual-pipeline parallelism (EP x DP x PP x TP (+SP) x ETP only)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise InputError("megatron-core's parallel_state is not initialised", key="parallel_state",
                         expected="parallel_state.initialize_model_parallel(...) before wrapping the model",
                         actual="not initialised")
    sizes = {"context_parallel": ps.get_context_parallel_world_size(),
             "virtual_pipeline_model_parallel": ps.get_virtual_pipeline_model_parallel_world_size() or 1}
    if any(size != 1 for size in sizes.values()):
        raise InputError("context and virtual-pipeline parallelism are not supported for megatron-core models",
                         key="parallel_state", expected="CP = virtual PP = 1", actual=sizes,
                         hint="docs/design.md#tensor-parallelism-megatron-core says what is supported")


def _etp_group() -> RankGroup:
    """parallel_state's expert-tensor-parallel group (its ranks split each expert's weights)."""
    from megatron.core import parallel_state as ps

    return RankGroup.of(ps.get_expert_tensor_parallel_group())


def _hf_vocab_size(gpt_model: Any, vocab_size: int | None) -> int:
    padded = gpt_model.vocab_size
    if vocab_size is None:
        return padded
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise InputError("the HF vocabulary must fit the model's (padded) vocabulary", key="vocab_size",
                         expected=f"an integer in 1..{padded} (the GPTModel's vocab_size, padding included)",
                         actual=repr(vocab_size))
    return vocab_size


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


def _over_stages(ids: list[int], pp: RankGroup) -> list[int]:
    """``ids`` of every stage of this rank's pipeline (one all-gather over the pipeline group)."""
    if pp.size <= 1:
        return ids
    every: list[Any] = [None] * pp.size
    dist.all_gather_object(every, ids, group=pp.group)
    return sorted(i for stage in every for i in stage)
