"""Pipeline stages presented as one transformers-style CausalLM (docs/design.md#pipeline-stages).

:class:`PipelinedCausalLM` is built on every rank of a pipeline (PP) group from that rank's stage
modules (:func:`~nemo_moe_export.pipeline.stages.split_stages`). ``model(input_ids=,
attention_mask=, logits_to_keep=)`` runs a forward-only ``torch.distributed.pipelining`` schedule
over microbatches and returns ``.logits`` on every rank of the group: the last stage computes the
kept positions' logits and broadcasts them (only those) over the PP group. The evaluator, the
hooks and the export use it like any transformers model; ``state_dict()`` is the union of this
rank's stages under the original parameter names.

Shapes. ``PipelineStage`` fixes its receive buffers when its schedule first runs and does not
look at later shapes (torch 2.13), so a stage and its schedule are built per batch shape, with
the shapes given statically (no metadata-inference forward; hidden states travel in ``dtype``),
and the most recent ones are cached. torch sets the gradients of ``fully_shard`` stages to None
when it initialises a schedule, so evaluate (or change shapes) between optimizer steps, not in
the middle of gradient accumulation. It also reshards their ``fully_shard`` modules then, on the
ranks that initialise a stage only; a module that keeps its weights gathered after a forward
(``reshard_after_forward=False``, the usual setting under pipeline stages) would then all-gather
on some ranks of its data-parallel group and not on others, a hang. So every schedule step starts
and ends with this rank's ``fully_shard`` modules resharded (local, no collective), the state a
training step leaves them in.
Every call is cut into exactly ``n_microbatches`` microbatches, whatever its rows: a stage runs the
same number of forwards on every rank, which keeps expert-parallel all-to-alls and FSDP
all-gathers inside each stage in lockstep across pipelines that evaluate different batches; a
batch with fewer rows (or rows not a multiple of it) is padded with one-token rows, dropped after.

Faults. A stage that raises is named (:class:`~nemo_moe_export.pipeline.stages.PipelineStageError`,
stage and global rank) on its rank, which also posts that message to the rendezvous store. Its
pipeline peers are then blocked in a point-to-point receive or the logits broadcast, which gloo
ends at the PP group's timeout (create the group with one); the peers then read the store and raise
a :class:`PipelineError` naming the failed stage and rank, not just "timed out".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _get_default_store
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from transformers.modeling_outputs import CausalLMOutput

from nemo_moe_export.errors import InputError
from nemo_moe_export.pipeline.stages import PipelineStageError, StageInfo, stage_ids, stage_info

__all__ = ["PipelineError", "PipelinedCausalLM", "pipeline_train_step", "reshard_stages"]

CACHED_SHAPES = 8
"""Stages + schedules kept per wrapper (one per batch shape); each holds its receive buffers."""
_PEER_REPORT_GRACE_S = 1.0


class PipelineError(RuntimeError):
    """A pipeline forward (or training step) failed on this rank. ``stage`` and ``rank`` name the
    stage and global rank that failed first, when one reported (else None: a transport failure,
    e.g. a peer that stalled past the PP group's timeout)."""

    def __init__(self, message: str, *, stage: int | None = None, rank: int | None = None) -> None:
        super().__init__(message)
        self.stage, self.rank = stage, rank


@dataclass(frozen=True)
class _Shape:
    """What a stage's static metadata depends on: microbatch rows, sequence length, kept positions."""

    rows: int
    length: int
    kept: int
    train: bool


class PipelinedCausalLM(nn.Module):
    """This rank's pipeline stages, called transformers-style; see the module docstring.

    ``parts``: this rank's stage modules, ``ids``: their stage ids in "loop" order
    (:func:`~nemo_moe_export.pipeline.stages.stage_ids`), ``n_stages``: stages in the whole
    pipeline, ``pipeline_group``: the PP process group (create it with a timeout: pipeline waits
    end only there), ``n_microbatches``: microbatches per call (default: ``n_stages``).
    ``dtype``: the hidden states' dtype between stages and the returned logits' (default:
    ``config.dtype``). Construct it on every rank of the group, in the same order (no collective).
    """

    cache_unsupported_reason = ("pipeline stages keep no KV cache between forwards (each stage would have to "
                                "keep its own, across schedule steps)")
    """Why shared-prefix evaluation is off (read by the evaluator's ``cache_support``)."""

    def __init__(self, parts: Sequence[nn.Module], ids: Sequence[int], n_stages: int, pipeline_group: Any,
                 n_microbatches: int | None = None, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.stage_ids = tuple(ids)
        self.n_stages = n_stages
        self.pipeline_group = pipeline_group
        self.n_microbatches = n_microbatches or n_stages
        self.config = parts[0].config
        self.dtype = dtype or _config_dtype(self.config)
        self.pp_rank, self.pp_size = dist.get_rank(pipeline_group), dist.get_world_size(pipeline_group)
        self._check_parts()
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        self._reports = _FailureReports(pipeline_group, self.stage_ids)

    def _check_parts(self) -> None:
        """Stage ids must be this rank's in loop order (torch's multi-stage schedules assume it) and
        match what each part is."""
        if len(self.parts) != len(self.stage_ids) or not self.parts:
            raise InputError("one stage id per stage module", key="ids", expected=len(self.parts),
                             actual=len(self.stage_ids))
        expected = stage_ids(self.pp_rank, self.pp_size, len(self.parts))
        if list(self.stage_ids) != expected or self.n_stages != self.pp_size * len(self.parts):
            raise InputError("pipeline stages are not this rank's, in loop order", key="ids",
                             expected=f"{expected} of {self.pp_size * len(self.parts)} stages",
                             actual=f"{list(self.stage_ids)} of {self.n_stages}",
                             hint="give rank r of a PP group of p the stages r, r+p, ... (stage_ids())")
        for part, sid in zip(self.parts, self.stage_ids):
            info = self.stage_info(part)
            if info.index != sid or info.n_stages != self.n_stages:
                raise InputError("stage module does not match its stage id", key=f"stage {sid}",
                                 expected=f"stage {sid} of {self.n_stages}",
                                 actual=f"stage {info.index} of {info.n_stages}")

    # --- transformers-style surface ---------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                use_cache: bool = False, logits_to_keep: int | torch.Tensor = 0) -> CausalLMOutput:
        """``.logits`` ``[rows, kept positions, vocab]`` on every rank of the PP group; forward only
        (no autograd across stages: train with :func:`pipeline_train_step`).

        Every rank of the group calls it with the same arguments: the first stage reads the tokens,
        every stage the mask, and every rank needs the shapes."""
        if use_cache:
            raise InputError("pipeline stages keep no KV cache", key="use_cache", expected=False,
                             actual=True)
        with torch.no_grad():
            return CausalLMOutput(logits=self.reported(lambda: self._forward(input_ids, attention_mask,
                                                                             logits_to_keep)))

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   attention_mask: torch.Tensor | None = None, optimizer: Any = None) -> torch.Tensor:
        """One 1F1B training step: :func:`pipeline_train_step` (the recipe's trainer calls this)."""
        return pipeline_train_step(self, input_ids, labels, loss_fn, attention_mask=attention_mask,
                                   optimizer=optimizer)

    def reported(self, run: Callable[[], Any]) -> Any:
        """``run()``, one pipeline call on every rank of the group; a failure is raised as
        :class:`PipelineError` naming the stage and rank that failed first (module docstring)."""
        call = self._reports.next_call()
        try:
            return run()
        except Exception as exc:
            raise self._reports.error(call, exc) from exc

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The union of this rank's stage state dicts, under the original parameter names."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.state_dict(*args, **kwargs))
        return out

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original names (``model.layers.3...``)."""
        for part in self.parts:
            yield from part.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for part in self.parts:
            yield from part.named_buffers(prefix, recurse, remove_duplicate)

    @property
    def device(self) -> torch.device:
        return next((p.device for p in self.parameters()), torch.device("cpu"))

    @property
    def holds_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    # --- the forward ------------------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        rows, length = input_ids.shape
        keep = _row_positions(logits_to_keep, rows, length, input_ids.device)
        kept = length if keep is None else keep.shape[1]
        ids, kwargs = self._padded_inputs(input_ids, attention_mask, keep)
        if self.pp_size == 1:  # every stage on this rank: nothing to schedule (torch's looped
            output = ids       # schedules expect their local hand-offs to run backward too)
            for part in self.parts:
                output = self.stage_module(part)(output, **kwargs)
        else:
            output = self.run(ids.shape[0], length, kept, *self.first_stage_args(ids), **kwargs)
        logits = output[:rows].to(self.dtype).contiguous() if self.holds_last_stage else None
        return self.broadcast_from_last(logits, (rows, kept, self.config.vocab_size), self.dtype)

    def first_stage_args(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A schedule's positional inputs on this rank: the token ids where the first stage is."""
        return (input_ids,) if self.stage_ids[0] == 0 else ()

    def _padded_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       keep: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Inputs padded to a multiple of ``n_microbatches`` rows; padding rows have one real token."""
        rows = input_ids.shape[0]
        extra = -rows % self.n_microbatches
        if extra:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(extra, input_ids.shape[1])])
            if attention_mask is not None:
                pad = attention_mask.new_zeros(extra, attention_mask.shape[1])
                pad[:, 0] = 1
                attention_mask = torch.cat([attention_mask, pad])
            if keep is not None:
                keep = torch.cat([keep, keep.new_zeros(extra, keep.shape[1])])
        kwargs = {name: value for name, value in (("attention_mask", attention_mask), ("logits_to_keep", keep))
                  if value is not None}
        return input_ids, kwargs

    def broadcast_from_last(self, value: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype
                            ) -> torch.Tensor:
        """``value`` of the rank holding the last stage (None elsewhere), on every rank of the group."""
        if value is None:
            value = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        if self.pp_size > 1:
            dist.broadcast(value, group=self.pipeline_group, group_src=(self.n_stages - 1) % self.pp_size)
        return value

    # --- stages and schedules, per shape ----------------------------------------------------------

    def run(self, rows: int, length: int, kept: int, *args: Any, loss_fn: Callable[..., torch.Tensor] | None = None,
            **step_kwargs: Any) -> Any:
        """One schedule step over batches of ``rows`` x ``length`` tokens (``rows`` a multiple of
        ``n_microbatches``) keeping ``kept`` positions' logits: forward-only without ``loss_fn``,
        forward and backward with it. ``args``/``step_kwargs`` go to ``schedule.step``. Returns the
        last stage's merged output on the rank holding it (None elsewhere). The stages' runtime
        state (each microbatch's activations, output chunks) is released after the step, so a cached
        schedule holds only its receive buffers."""
        stages, schedule = self._compiled(_Shape(rows // self.n_microbatches, length, kept, loss_fn is not None),
                                          loss_fn)
        reshard_stages(self.parts)  # as torch reshards a stage it initialises: the same state on every rank
        try:
            return schedule.step(*args, **step_kwargs)
        finally:
            for stage in stages:
                stage.clear_runtime_states()
            reshard_stages(self.parts)  # what comes next (another shape, another schedule) finds them sharded

    def _compiled(self, shape: _Shape, loss_fn: Callable[..., torch.Tensor] | None) -> tuple[list[Any], Any]:
        """The stages and schedule for ``shape``, built on first use; the least recently used are
        dropped past :data:`CACHED_SHAPES`."""
        key = (shape, loss_fn)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        stages = [self._stage(part, sid, shape) for part, sid in zip(self.parts, self.stage_ids)]
        self._schedules[key] = compiled = (stages, self._schedule(stages, shape.train, loss_fn))
        if len(self._schedules) > CACHED_SHAPES:
            self._schedules.popitem(last=False)
        return compiled

    def _schedule(self, stages: list[Any], train: bool, loss_fn: Callable[..., torch.Tensor] | None) -> Any:
        """GPipe / looped BFS forward-only (no constraint on the microbatch count); 1F1B /
        interleaved 1F1B to train, whose microbatch constraints torch checks here."""
        if len(stages) == 1:
            cls, arg = (Schedule1F1B if train else ScheduleGPipe), stages[0]
        else:
            cls, arg = (ScheduleInterleaved1F1B if train else ScheduleLoopedBFS), stages
        try:
            return cls(arg, self.n_microbatches, loss_fn=loss_fn)
        except ValueError as exc:
            raise InputError(f"{cls.__name__} cannot run this microbatch count", key="n_microbatches",
                             expected="what the schedule accepts", actual=self.n_microbatches,
                             hint=str(exc)) from exc

    def _stage(self, part: nn.Module, sid: int, shape: _Shape) -> Any:
        """A ``PipelineStage`` of ``part`` whose input and output shapes are given, not inferred
        (inference would run an extra forward, on uninitialised inputs past the first stage)."""
        meta = torch.device("meta")
        hidden = torch.empty(shape.rows, shape.length, self.config.hidden_size, dtype=self.dtype, device=meta,
                             requires_grad=True)
        ids = torch.empty(shape.rows, shape.length, dtype=torch.long, device=meta)
        logits = torch.empty(shape.rows, shape.kept, self.config.vocab_size, dtype=self.dtype, device=meta,
                             requires_grad=True)
        info = self.stage_info(part)
        return PipelineStage(self.stage_module(part), sid, self.n_stages, self.device,
                             input_args=ids if info.is_first else hidden,
                             output_args=logits if info.is_last else hidden, group=self.pipeline_group)

    # --- what a subclass over other stage modules replaces (the AutoModel integration) ------------

    def stage_info(self, part: nn.Module) -> StageInfo:
        """Which stage ``part`` is (:func:`~nemo_moe_export.pipeline.stages.split_stages` records it)."""
        return stage_info(part)

    def stage_module(self, part: nn.Module) -> nn.Module:
        """What a ``PipelineStage`` calls for ``part``: ``part(x, attention_mask=, logits_to_keep=)``
        returning a tensor, as :func:`~nemo_moe_export.pipeline.stages.stage_forward` does."""
        return part


def _row_positions(keep: int | torch.Tensor, rows: int, length: int, device: torch.device) -> torch.Tensor | None:
    """``logits_to_keep`` as ``[rows, n]`` positions (None: every position), so that it splits
    into microbatches along the rows like every other input."""
    if isinstance(keep, int):
        if keep == 0:
            return None
        keep = min(keep, length)  # transformers' hidden[:, -keep:] keeps at most every position
        return torch.arange(length - keep, length, device=device).expand(rows, keep)
    if keep.dim() == 1:
        return keep.to(device).expand(rows, keep.shape[0])
    if keep.dtype == torch.bool or keep.shape[0] != rows:
        raise InputError("logits_to_keep must be an int or integer positions", key="logits_to_keep",
                         expected=f"an int, [n] or [{rows}, n] integer positions",
                         actual=f"{keep.dtype} {tuple(keep.shape)}")
    return keep


def reshard_stages(parts: Sequence[nn.Module]) -> None:
    """Free the gathered weights of every ``fully_shard`` module in ``parts`` (local, no collective).

    torch's pipeline schedule reshards a stage's modules when it initialises that stage, on the
    ranks that initialise one; a module left gathered by a forward (``reshard_after_forward=False``)
    would then all-gather on those ranks only, and its data-parallel group would hang."""
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()


# --------------------------------------------------------------------------------------------------
# Failure reports through the rendezvous store
# --------------------------------------------------------------------------------------------------


class _FailureReports:
    """Each rank's failure of one pipeline call, posted to the rendezvous store (which outlives a
    broken group) under ``nemo_moe_export/pipeline/<group>/<wrapper>/<call>/<rank>``; a rank whose
    wait ended reads its peers' reports to name the stage that failed. Nothing is written while all
    is well."""

    _per_group: dict[str, int] = {}

    def __init__(self, group: Any, ids: Sequence[int]) -> None:
        self.store = _get_default_store()
        self.me, self.ids = dist.get_rank(), tuple(ids)
        self.peers = dist.get_process_group_ranks(group)
        name = group.group_name
        # several wrappers may share a group: numbered in construction order, the same on every rank
        _FailureReports._per_group[name] = instance = _FailureReports._per_group.get(name, 0) + 1
        self.base = f"nemo_moe_export/pipeline/{name}/{instance}"
        self.call = 0

    def next_call(self) -> int:
        self.call += 1
        return self.call

    def error(self, call: int, exc: BaseException) -> PipelineError:
        """What this rank raises for a failed ``call``: its own stage's failure, else the failure a
        peer reported, else its own (a transport error: a peer stalled or left)."""
        own = _find_cause(exc, PipelineStageError)
        if own is not None:
            self._post(call, f"stage|{own.stage}|{own}")
            return PipelineError(str(own), stage=own.stage, rank=own.rank)
        here = f"rank {self.me} (stages {list(self.ids)}) stopped waiting for its pipeline peers: {_first_line(exc)}"
        self._post(call, f"wait|{here}")
        reported = self._peer_stage_failure(call)
        if reported is not None:
            stage, rank, text = reported
            return PipelineError(f"{text}; {here}", stage=stage, rank=rank)
        return PipelineError(f"pipeline call {call} failed: {here}")

    def _post(self, call: int, text: str) -> None:
        try:
            self.store.set(f"{self.base}/{call}/{self.me}", text)
        except Exception:  # the store's host is gone: nothing to tell the peers through
            pass

    def _peer_stage_failure(self, call: int) -> tuple[int, int, str] | None:
        """The first stage failure a peer posted for ``call``, waiting a short grace for it."""
        deadline = time.monotonic() + _PEER_REPORT_GRACE_S
        while True:
            for rank in self.peers:
                key = f"{self.base}/{call}/{rank}"
                try:
                    if rank != self.me and self.store.check([key]):
                        kind, _, text = self.store.get(key).decode().partition("|")
                        if kind == "stage":
                            stage, _, text = text.partition("|")
                            return int(stage), rank, text
                except Exception:
                    return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _find_cause(exc: BaseException | None, kind: type[BaseException]) -> Any:
    """The first exception of type ``kind`` in ``exc``'s cause/context chain (torch's schedule
    wraps a stage's exception in its own RuntimeError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


# --------------------------------------------------------------------------------------------------
# Training: Schedule1F1B with one stage per rank, ScheduleInterleaved1F1B with virtual stages. The
# loss is computed on the last stage per microbatch and gradients are scaled by the microbatch
# count, so with a loss that averages over its microbatch (and equal microbatches) the gradients
# are those of the same loss over the whole batch in the unsplit model. Data-parallel gradient
# reduction stays the stages' own (fully_shard reduces at the last microbatch's backward).
# --------------------------------------------------------------------------------------------------


def pipeline_train_step(model: PipelinedCausalLM, input_ids: torch.Tensor, labels: torch.Tensor,
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                        attention_mask: torch.Tensor | None = None, optimizer: Any = None) -> torch.Tensor:
    """Forward and backward of one batch through the pipeline; the mean microbatch loss (a float32
    scalar) on every rank of the PP group.

    Every rank of the group passes the same ``input_ids`` ``[rows, length]``, ``labels`` (what
    ``loss_fn(logits_mb, labels_mb)`` takes, split along the rows) and ``attention_mask``; ``rows``
    must be a multiple of ``model.n_microbatches`` (padding rows would change the loss).
    ``loss_fn`` should be one function object across steps: schedules are cached per shape and loss.
    With ``optimizer``: its gradients are zeroed first and it steps after. A failure raises
    :class:`~nemo_moe_export.pipeline.model.PipelineError` naming the stage that failed.
    """
    rows, length = input_ids.shape
    if rows % model.n_microbatches:
        raise InputError("a training batch must split into equal microbatches", key="input_ids",
                         expected=f"rows a multiple of n_microbatches={model.n_microbatches}", actual=rows)
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    model.train()

    def step() -> torch.Tensor:
        if optimizer is not None:
            optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        target = labels if model.holds_last_stage else None
        model.run(rows, length, length, *model.first_stage_args(input_ids), loss_fn=loss_fn, target=target,
                  losses=losses, **kwargs)
        loss = torch.stack(losses).detach().float().mean().to(model.device) if model.holds_last_stage else None
        loss = model.broadcast_from_last(loss, (), torch.float32)
        if optimizer is not None:
            optimizer.step()
        return loss

    return model.reported(step)
