"""The forward of a megatron-core ``GPTModel`` split into pipeline stages, for the evaluator.

Every rank of a pipeline group holds one stage and is called with the same batch (the evaluator
shards questions over the data-parallel group, which megatron builds within a stage, so the ranks
of one pipeline share a shard). The batch is cut into microbatches and run through megatron's own
schedule, ``get_forward_backward_func()(forward_only=True)``: the first stage embeds, each stage
sends its hidden states on, and the last stage projects only the kept positions onto the
vocabulary (``logits_to_keep``). Every stage gets every microbatch's position ids and mask from its
own copy of the batch, so the padding mask reaches every stage. The last stage's logits are then
broadcast over the pipeline group, so every rank returns the same ``.logits``
(docs/design.md#pipeline-stages-megatron-core).

Training (:func:`pipelined_train_step`) runs the same schedule with ``forward_only=False``:
megatron's 1F1B (warm-up forwards, then one forward and one backward per microbatch, then the
remaining backwards). The last stage applies the caller's loss to each microbatch's logits and
megatron divides it by the microbatch count (its "legacy" loss convention: a ``(loss, reported)``
pair), so the gradients are those of the mean microbatch loss; with equal microbatches each
holding as many labelled tokens (the recipe: one answer letter per row) that is the batch's mean
loss and the gradients equal the unsplit model's. A stage holding a copy of the word embeddings
(an MTP layer's, or a tied output layer's) gets its gradient all-reduced with the first stage's
over megatron's embedding group, as megatron's ``finalize_model_grads`` does, so the copies stay
equal under any elementwise optimizer.

A stage that raises names itself (``PipelineStageError``: pipeline rank and global rank); a stage
waiting on it is released by the group's timeout or when the failing process ends, and names
itself and what it waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_export.errors import InputError
from nemo_moe_export.parallel import RankGroup

__all__ = ["PipelineStageError", "allreduce_embedding_copy_grads", "kept_positions", "main_head_only",
           "pipelined_logits", "pipelined_train_step", "projecting_only"]


class PipelineStageError(RuntimeError):
    """A pipeline stage failed during a forward; the message names its pipeline and global rank."""


@dataclass(frozen=True)
class Microbatch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    keep: int | torch.Tensor


@dataclass(frozen=True)
class TrainingMicrobatch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor


def pipelined_logits(gpt: Any, pp: RankGroup, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     mask: torch.Tensor, keep: int | torch.Tensor, count: int | None = None) -> torch.Tensor:
    """``[rows, kept positions, vocab]`` logits of the pipelined ``gpt``, the same on every rank of
    ``pp`` (every rank calls this with the same batch), over at most ``count`` microbatches
    (default: one per stage)."""
    rows, length = input_ids.shape
    micro = microbatches(input_ids, position_ids, mask, keep, count or pp.size)
    with _naming_the_stage(pp, "the pipeline schedule's forward"):
        store = _run_schedule(gpt, micro, length)
    shape = (rows, kept_count(length, keep), gpt.vocab_size)
    logits = _assembled(store, shape, gpt.config.params_dtype) if gpt.post_process else None
    with _naming_the_stage(pp, f"receiving the logits from the last stage (global rank {pp.ranks[-1]})"):
        return broadcast_from_last(logits, shape, gpt.config.params_dtype, pp, device=input_ids.device)


def pipelined_train_step(gpt: Any, pp: RankGroup, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         mask: torch.Tensor, labels: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], count: int) -> torch.Tensor:
    """One forward and backward of the batch through megatron's 1F1B schedule, in ``count`` equal
    microbatches; the gradients accumulate into the stage's parameters (``.grad``). Returns the
    mean of the microbatches' ``loss_fn(logits [rows, length, vocab], labels)`` as a float32
    scalar, the same on every rank of ``pp`` (every rank calls this with the same batch)."""
    rows, length = input_ids.shape
    if count < 1 or rows % count:
        raise InputError("a training batch must split into equal microbatches", key="input_ids",
                         expected=f"rows a multiple of the model's {count} microbatches", actual=rows)
    size = rows // count
    micro = [TrainingMicrobatch(input_ids[s:s + size], position_ids[s:s + size], mask[s:s + size], labels[s:s + size])
             for s in range(0, rows, size)]
    with _naming_the_stage(pp, "the pipeline schedule's training step (1F1B)"):
        store = _run_training_schedule(gpt, micro, length, loss_fn)
        allreduce_embedding_copy_grads(gpt)
    loss = torch.stack(store).float().mean() if gpt.post_process else None
    with _naming_the_stage(pp, f"receiving the loss from the last stage (global rank {pp.ranks[-1]})"):
        return broadcast_from_last(loss, (), torch.float32, pp, device=input_ids.device)


def _run_training_schedule(gpt: Any, micro: list[TrainingMicrobatch], length: int,
                           loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """megatron's schedule with backward (1F1B for one model chunk); on the last stage, each
    microbatch's loss as ``loss_fn`` gave it (before megatron divides it by the microbatch count)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator[TrainingMicrobatch], model: Any) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        with main_head_only(model):  # the main head's loss only, as the unsplit model's forward
            output = model(batch.input_ids, batch.position_ids, batch.mask, runtime_gather_output=True)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = loss_fn(logits, batch.labels)
            return loss, loss.detach().clone()  # megatron divides the first in place by the microbatch count

        return output, loss_func

    forward_backward = get_forward_backward_func()
    return forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=[gpt],
                            num_microbatches=len(micro), seq_length=length,
                            micro_batch_size=micro[0].input_ids.shape[0], forward_only=False)


def allreduce_embedding_copy_grads(gpt: Any) -> None:
    """The word embeddings' gradient summed over megatron's embedding group (the first stage and
    the stage holding a copy: an MTP layer's or a tied output layer's), as megatron-core 0.16.1's
    ``finalize_model_grads._allreduce_word_embedding_grads`` does after its schedule, so every copy
    takes the same update. megatron's own helper reads its DDP wrapper's buffers (``ddp_config``,
    ``main_grad``); here the gradient is ``.grad``, and a copy no backward reached (the MTP layers
    are not run for the main head's loss) contributes zeros. Every rank of the pipeline calls it."""
    config = gpt.config
    if config.pipeline_model_parallel_size == 1 or not (gpt.share_embeddings_and_output_weights
                                                        or getattr(config, "mtp_num_layers", None)):
        return
    group = getattr(gpt, "embd_group", None)
    if group is None or dist.get_world_size(group) <= 1 or dist.get_rank() not in dist.get_process_group_ranks(group):
        return
    weight = gpt.shared_embedding_or_output_weight()
    if weight is None or not weight.requires_grad:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=group)


def microbatches(input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 keep: int | torch.Tensor, stages: int) -> list[Microbatch]:
    """The batch cut into equal microbatches along rows: as many as there are stages when the rows
    divide, else the largest count not above it that divides them (megatron's schedule takes one
    microbatch size). Each carries its rows' positions, mask and kept positions."""
    rows = input_ids.shape[0]
    count = max(n for n in range(1, min(stages, rows) + 1) if rows % n == 0)
    size = rows // count
    per_row = isinstance(keep, torch.Tensor) and keep.dim() == 2
    return [Microbatch(input_ids[s:s + size], position_ids[s:s + size], mask[s:s + size],
                       keep[s:s + size] if per_row else keep) for s in range(0, rows, size)]


def kept_count(length: int, keep: int | torch.Tensor) -> int:
    """How many positions ``logits_to_keep`` keeps of ``length``: the selection itself, made on an
    empty tensor, so it can never disagree with what the last stage projects."""
    rows = keep.shape[0] if isinstance(keep, torch.Tensor) and keep.dim() == 2 else 1
    return kept_positions(torch.empty(length, rows, 0), keep).shape[0]


def _run_schedule(gpt: Any, micro: list[Microbatch], length: int) -> list[torch.Tensor]:
    """megatron's schedule, forward only; on the last stage, each microbatch's logits."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    return forward_backward(forward_step_func=_forward_step, data_iterator=iter(micro), model=[gpt],
                            num_microbatches=len(micro), seq_length=length,
                            micro_batch_size=micro[0].input_ids.shape[0], forward_only=True)


def _forward_step(data_iterator: Iterator[Microbatch], model: Any) -> tuple[torch.Tensor, None]:
    """One microbatch through this stage (megatron's ``forward_step_func``): the stage's input
    tensor was set by the schedule; no loss function, so the last stage's logits are collected."""
    batch = next(data_iterator)
    head = model.output_layer if model.post_process else None
    with projecting_only(head, batch.keep), main_head_only(model):
        return model(batch.input_ids, batch.position_ids, batch.mask, runtime_gather_output=True), None


def _assembled(store: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    logits = torch.cat(store, dim=0).to(dtype)
    if tuple(logits.shape) != shape:  # the peers size their buffer from the batch, as this does
        raise InputError("the last stage's logits do not have the shape the batch gives",
                         key="logits", expected=shape, actual=tuple(logits.shape))
    return logits.contiguous()


def broadcast_from_last(logits: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                        pp: RankGroup, device: torch.device | str | None = None) -> torch.Tensor:
    """The last stage's ``logits`` (or loss) on every rank of ``pp`` (one broadcast over the
    pipeline group); the other ranks receive into a buffer on ``device``."""
    if logits is None:
        logits = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(logits, src=pp.ranks[-1], group=pp.group)
    return logits


@contextmanager
def _naming_the_stage(pp: RankGroup, what: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        raise PipelineStageError(
            f"pipeline stage {pp.rank} of {pp.size} (global rank {dist.get_rank()}) failed in {what}: "
            f"{type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# What every forward of the wrapper does to the last stage
# --------------------------------------------------------------------------------------------------


def kept_positions(hidden: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """``hidden`` [s, b, h] at the positions ``keep`` names, as transformers' ``logits_to_keep``:
    an int keeps the last ``keep``; a 1-D tensor those positions; a 2-D ``[b, n]`` integer tensor
    each row's own positions."""
    rows_first = hidden.transpose(0, 1)
    if isinstance(keep, torch.Tensor) and keep.dim() == 2:
        if keep.dtype == torch.bool:
            raise InputError("boolean logits_to_keep masks are not supported", key="logits_to_keep",
                             expected="an int or integer positions", actual="a bool mask")
        rows_first = torch.take_along_dim(rows_first, keep[..., None], dim=1)
    else:
        rows_first = rows_first[:, slice(-keep, None) if isinstance(keep, int) else keep, :]
    return rows_first.transpose(0, 1)


def projecting_only(output_layer: Any, keep: int | torch.Tensor) -> Any:
    """While active, ``output_layer`` projects only the kept positions (a forward pre-hook); a
    stage without the output layer (None) or ``keep == 0`` projects as it is."""
    if output_layer is None or (isinstance(keep, int) and keep == 0):
        return nullcontext()
    return _hooked(output_layer, keep)


@contextmanager
def _hooked(output_layer: Any, keep: int | torch.Tensor) -> Iterator[None]:
    def select(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (kept_positions(args[0], keep), *args[1:]), kwargs

    handle = output_layer.register_forward_pre_hook(select, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def main_head_only(gpt: Any) -> Iterator[None]:
    """While active, ``gpt`` computes its main head's logits without its MTP layers.

    megatron-core 0.16.1's ``GPTModel._postprocess`` runs the MTP block and then, whenever
    ``config.mtp_num_layers`` is set, takes ``labels.clone()`` for the MTP loss: a forward without
    labels raises AttributeError. The MTP layers are a training loss (and a draft head for
    speculative decoding); the main head's logits do not depend on them, and transformers'
    DeepSeek-V3 does not run them either. So the stage's ``mtp_process`` and the config's
    ``mtp_num_layers`` read as "none" for the forward and are restored after."""
    if not getattr(gpt.config, "mtp_num_layers", None):
        yield
        return
    process, layers = gpt.mtp_process, gpt.config.mtp_num_layers
    gpt.mtp_process, gpt.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        gpt.mtp_process, gpt.config.mtp_num_layers = process, layers
