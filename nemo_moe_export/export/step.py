"""The collective export step: sharded model -> HF checkpoint directory, with no gather.

Steps, each closed by ``Coordinator.agree`` (one all-reduce of a status word under a timeout, so
a failure or stall on any rank becomes the same clear error on every rank; the words a step
shares ride on it; docs/design.md#coordination-protocol):

1. ``validate``  every rank checks the options, resolves its inputs, builds the plan (pure,
                 identical everywhere) and its write shares (every holder of a replicated piece
                 writes a part of it), and the ranks agree, summing the plan digest's fingerprint
                 (one plan on every rank) and rank 0's export id; then every replicated tensor is
                 compared across its replicas (``replicas.py``) and the ranks agree again, summing
                 the count of findings and the per-key element counts (every element must have
                 exactly one writer); the storage writer assigns each file an owner. Nothing is
                 written until all of this has passed.
2. ``prepare``   rank 0 creates a fresh temporary sibling directory ``.{name}.partial``.
3. ``headers``   the owner of each file creates it at full size and writes its header; rank 0
                 writes the index, ``config.json``, the generation config and tokenizer files.
4. ``write``     the storage writer puts every rank's write shares at their final offsets, then
                 fsyncs.
5. ``verify``    rank 0 checks the structure from the bytes on disk (``verify_checkpoint``) and
                 fsyncs the directory.
6. ``publish``   rank 0 renames the directory into place atomically (and, with
                 ``overwrite="replace"``, swaps the old one out) and fsyncs the parent.

Steps 2-6 live in ``steps.py``, shared with the checkpoint conversion; this module is
``validate`` and the entry points. On any failure rank 0 removes the temporary directory; the
target is never touched until step 6 (docs/design.md#export-plan-and-invariants). The parts: ``options.py`` (what to write),
``casting.py`` (what stays float32, as transformers keeps it), ``plan.py`` (where every byte goes,
who writes which share, who owns each file, coverage), ``replicas.py`` (replica agreement),
``storage.py`` (the shared- or local-filesystem writer), ``target.py`` (the directories and the
publish), ``verify.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nemo_moe_export.adapters import HFShard, StateDictAdapter, get_adapter, model_parts, state_dict_of
from nemo_moe_export.adapters.passthrough import extra_metadata, extra_pieces
from nemo_moe_export.collectives import FINGERPRINT_WORDS, fingerprint_words
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.casting import float32_keys, fp32_patterns
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan, check_coverage, element_counts, plan_export, write_shares
from nemo_moe_export.export.quantize import quantization_config, quantize_export
from nemo_moe_export.export.replicas import (ReplicaReport, ReplicaSet, compare_replicas, replica_sets, settle_findings,
                                             with_copies)
from nemo_moe_export.export.row_exchange import row_parallel_shares, write_exchanged_rows
from nemo_moe_export.export.stages import (Catalogue, catalogue_of, check_declared, check_mtp_layers, check_tied,
                                           merge_catalogues, pipeline_group_of, stage_replicated, tied_boxes,
                                           tied_pairs)
from nemo_moe_export.export.storage import SharedFilesystemWriter, StorageWriter, check_writer_ranks, writer_for
from nemo_moe_export.export.target import ExportTarget, export_id_of, new_export_id, write_metadata_files
from nemo_moe_export.export.steps import StepJob, Steps, cyclic_gc_paused, run_after_validate
from nemo_moe_export.export.writer import WriteStats
from nemo_moe_export.hooks import Hook, RecipeContext
from nemo_moe_export.parallel import Coordinator, RankGroup

__all__ = ["ExportResult", "ExportStep", "cyclic_gc_paused", "export_catalogue", "export_hf_checkpoint",
           "export_plan_of", "plan_of", "rank_write_shares", "replicated_tensors"]


@dataclass
class ExportResult:
    path: str
    files: int
    tensors: int
    checkpoint_bytes: int
    rank_bytes_written: int
    seconds: float
    step_seconds: dict[str, float] = field(default_factory=dict)
    # This rank's write step: bytes staged (cast or device-to-host), seconds copying into staging
    # buffers and seconds in pwrite (summed over writer threads), against the step's wall time.
    io: dict[str, float] = field(default_factory=dict)
    # The replica agreement (part of validate): its seconds on this rank, what it compared (replica
    # groups, tensors, bytes) and every key it reconciled under replica_mismatch="mean" / "rank:N".
    replica_seconds: float = 0.0
    replica_check: dict[str, int] = field(default_factory=dict)
    reconciled: list[dict[str, Any]] = field(default_factory=list)
    passthrough_keys: list[str] = field(default_factory=list)  # extra keys written beside the model's
    # The files this rank created and wrote the header of, and the files it wrote tensor bytes into
    # (the planner predicts both: docs/design.md#planner).
    files_owned: list[str] = field(default_factory=list)
    files_written: list[str] = field(default_factory=list)
    # What rank 0 cleaned or replaced around the target (a dead job's lock or partial directory,
    # the previous checkpoint); also logged as warnings.
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Inputs:
    """What is exported, resolved from the caller's arguments."""

    state_dict: Mapping[str, torch.Tensor]
    config: Any
    adapter: StateDictAdapter
    tokenizer: Any = None
    generation_config: Any = None
    model: Any = None  # the model, or this rank's first stage module (what casting reads)
    extra: Mapping[str, Any] = field(default_factory=dict)  # HF key -> tensor | DTensor | HFShard
    pp: RankGroup = field(default_factory=RankGroup.alone)  # this rank's pipeline group
    stages: bool = False  # given as a list of stage modules


@dataclass(frozen=True)
class _Job(StepJob):
    """What the steps after ``validate`` work from: the same on every rank except ``pieces``."""

    coordinator: Coordinator
    options: ExportOptions
    target: ExportTarget
    inputs: _Inputs
    plan: ExportPlan
    pieces: list[HFShard]  # this rank's write shares
    writer: StorageWriter
    owners: dict[str, int]  # file -> global rank that creates it
    replicas: ReplicaReport = field(default_factory=ReplicaReport)

    def write_small_files(self, directory: str) -> None:
        """Rank 0's files beside the tensors: index, config.json, generation config, tokenizer."""
        inputs = self.inputs
        write_metadata_files(directory, self.plan, inputs.config, self.options.torch_dtype,
                             inputs.generation_config, inputs.tokenizer, quantization_config(self.options))


def export_hf_checkpoint(
    output_dir: str | os.PathLike[str],
    model: Any = None,
    options: ExportOptions | Mapping[str, Any] | None = None,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    config: Any = None,
    adapter: StateDictAdapter | None = None,
    tokenizer: Any = None,
    generation_config: Any = None,
    group: Any = None,
    extra: Mapping[str, Any] | None = None,
    pp_group: Any = None,
    **overrides: Any,
) -> ExportResult:
    """Export a (possibly sharded) model to a Hugging Face checkpoint; call on every rank of ``group``.

    Pass ``model`` (a transformers model, sharded or not), this rank's pipeline stage modules (a
    list of "model parts", each keeping the original names, as torch pipelining builds them) or
    ``state_dict`` + ``config``. No rank gathers the model: each writes its own shards into the
    final files. ``pp_group`` is the pipeline group (one rank per stage position; a process group
    or a ``RankGroup``; default: ``model.pipeline_group`` where the model records one, else no
    pipeline): the plan is laid out from the keys of every stage (docs/design.md#pipeline-stages). ``extra`` adds tensors
    that live outside the model's state dict, under their HF names and in their own dtype: the
    slices ``from_hf`` kept (``LoadReport.passthrough``; an adapter that loaded them adds its own),
    or plain tensors / DTensors (docs/design.md#pass-through-tensors). ``options`` (an
    :class:`ExportOptions`, a mapping or a config node) and ``overrides`` (its fields, e.g.
    ``dtype="bfloat16"``, ``overwrite="replace"``) say how; invalid ones are refused on every rank
    before anything is written. Runs validate -> prepare -> headers -> write -> verify -> publish
    (the module docstring says what each does).
    """
    started = time.perf_counter()
    options, refused = _options_or_refusal(options, overrides)
    steps = Steps(Coordinator(group, timeout_s=options.timeout_s, name="export"))
    given = dict(model=model, state_dict=state_dict, config=config, adapter=adapter, tokenizer=tokenizer,
                 generation_config=generation_config, extra=extra, pp_group=pp_group)
    with cyclic_gc_paused():
        job = _validate(steps, output_dir, options, refused, given)
        stats = run_after_validate(steps, job, lambda: _write(job))
    return _result(job, stats, steps.seconds, started)


def _options_or_refusal(options: Any, overrides: dict[str, Any]) -> tuple[ExportOptions, Exception | None]:
    """The validated options, or the defaults and the reason they were refused. The refusal is
    raised inside the validate step, so every rank hears it; until then the defaults only supply
    the coordinator's timeout."""
    try:
        return ExportOptions.of(options, **overrides), None
    except (TypeError, ValueError) as exc:
        return ExportOptions(), exc


def _validate(steps: Steps, output_dir: Any, options: ExportOptions, refused: Exception | None,
              given: dict[str, Any]) -> _Job:
    """Step 1: the rank-local checks and the plan, agreed by every rank; then the checks across ranks."""
    coordinator = steps.coordinator
    with steps.timed("validate"):
        with steps.agreed("validate", PLAN_WORDS) as shared:
            if refused is not None:
                raise refused
            staged = _stage_locally(coordinator, output_dir, options, _resolve_inputs(**given))
            local = None if staged.pipelined else _lay_out(staged, staged.catalogue, options, coordinator)
            if local is not None:
                shared.sums = _plan_words(local.plan, coordinator)
        if local is None:  # pipeline stages: the plan and the plain tensors' holders span the stages
            local, totals = _lay_out_stages(steps, staged, options)
        else:
            totals = shared.totals
        # Checks across ranks from the words summed by the agreement; inputs that differ between
        # ranks give every rank the same verdict, so all raise the same error.
        plan = local.plan
        coordinator.require_same("export plans", plan.digest(), key="plan", summed=totals[:-1],
                                 hint="every rank must export the same model with the same options")
        # One name for this job on every rank, rank 0's: its own partial directory, and its lock
        # (docs/design.md#export-target-and-concurrent-jobs).
        export_id = export_id_of(int(totals[-1]))
        inputs, shares, replicas = _agree_replicas(steps, local, options)
        writer = writer_for(options, coordinator)
        target, plan = local.target.for_job(export_id), plan.stamped(export_id)
        # FP8: the quantized plan (laid out stamped), scales and writer (docs/design.md#fp8-export); else unchanged.
        plan, shares, writer = quantize_export(steps, options, inputs.adapter, plan, shares, writer)
    return _Job(coordinator, options, target, inputs, plan, shares, writer, writer.file_owners(plan), replicas)


PLAN_WORDS = FINGERPRINT_WORDS + 1  # what the agreement closing the plan carries: see _plan_words


def _plan_words(plan: ExportPlan, coordinator: Coordinator) -> torch.Tensor:
    """What the agreement that closes the plan sums: the plan digest's fingerprint (every rank
    must have the same plan) and, from rank 0 alone, the job's export id."""
    export_id = new_export_id() if coordinator.rank == 0 else 0
    return torch.cat([fingerprint_words(plan.digest()), torch.tensor([export_id], dtype=torch.int64)])


@dataclass(frozen=True)
class _Staged:
    """What each rank resolves alone in validate: the target, the inputs and its stages' catalogue."""

    target: ExportTarget
    inputs: _Inputs
    extras: dict[str, HFShard]  # the extra tensors' pieces
    catalogue: Catalogue  # what this rank's stages write (the whole model without pipeline stages)

    @property
    def pipelined(self) -> bool:
        return self.inputs.pp.size > 1


def _stage_locally(coordinator: Coordinator, output_dir: Any, options: ExportOptions, inputs: _Inputs) -> _Staged:
    """Rank-local part of validate: the target may be written, the inputs and what they write."""
    check_writer_ranks(options, coordinator)
    _check_replica_source(options, coordinator)
    target = ExportTarget.at(output_dir)
    target.check(options.overwrite)
    if options.passthrough:  # what the adapter's from_hf kept, unless handed explicitly
        inputs = replace(inputs, extra={**inputs.adapter.passthrough, **inputs.extra})
    extras = extra_pieces(inputs.extra, _plain_replica(coordinator))
    catalogue = export_catalogue(inputs.adapter, inputs.state_dict, options, extras=extras, model=inputs.model,
                                 config=inputs.config, pp_rank=inputs.pp.rank)
    staged = _Staged(target, inputs, extras, catalogue)
    if staged.pipelined:  # the tied weights' copies, compared (and the checks run) once the catalogues are merged
        return replace(staged, catalogue=replace(catalogue, tied=tied_boxes(inputs.state_dict,
                                                                            tied_pairs(inputs.model, inputs.config))))
    if inputs.stages and coordinator.rank == 0:  # stage modules without a pipeline group
        check_declared(catalogue, inputs.adapter, inputs.pp)
    check_mtp_layers(catalogue.metadata, inputs.config)
    return staged


def _lay_out(staged: _Staged, catalogue: Catalogue, options: ExportOptions, coordinator: Coordinator) -> "_LocalPlan":
    """The plan from ``catalogue``, this rank's write shares and its replica groups."""
    inputs = staged.inputs
    replicated = replicated_tensors(inputs.adapter, inputs.state_dict, inputs.extra)
    return _LocalPlan(staged.target, inputs, plan_of(catalogue, options),
                      _write_shares_of(inputs, coordinator, staged.extras),
                      replica_sets(replicated, coordinator), replicated)


def _lay_out_stages(steps: Steps, staged: _Staged, options: ExportOptions) -> tuple["_LocalPlan", torch.Tensor]:
    """Validate across pipeline stages (docs/design.md#pipeline-stages): the stage peers' plain
    tensors as replicas and the catalogue merged over the pipeline group (collectives every rank
    reaches first), then the checks and the plan, under one more agreement."""
    with steps.agreed("validate stages", PLAN_WORDS) as shared:
        inputs = staged.inputs
        state_dict = stage_replicated(inputs.state_dict, inputs.pp, steps.coordinator)
        merged = merge_catalogues(staged.catalogue, inputs.pp)
        if steps.coordinator.rank == 0:  # one rank builds the reference; the agreement tells every rank
            check_declared(merged, inputs.adapter, inputs.pp)
        check_tied(merged, tied_pairs(inputs.model, inputs.config), inputs.pp)
        check_mtp_layers(merged.metadata, inputs.config)
        staged = replace(staged, inputs=replace(inputs, state_dict=state_dict))
        local = _lay_out(staged, merged, options, steps.coordinator)
        shared.sums = _plan_words(local.plan, steps.coordinator)
    return local, shared.totals


@dataclass(frozen=True)
class _LocalPlan:
    """What each rank works out alone in validate, before the checks across ranks."""

    target: ExportTarget
    inputs: _Inputs
    plan: ExportPlan
    shares: list[HFShard]  # what this rank writes
    replica_sets: list[ReplicaSet]
    replicated: dict[str, torch.Tensor]  # the tensors the replica check compares, by name


def _agree_replicas(steps: Steps, local: _LocalPlan, options: ExportOptions
                    ) -> tuple[_Inputs, list[HFShard], ReplicaReport]:
    """Compare every replicated tensor across its replicas (docs/design.md#replica-agreement); with
    a reconciling policy, rebuild the inputs and shares from the reconciled copies."""
    # the findings' count and the coverage counts share the agreement (the plans are equal by now)
    # a transport failure in one replica group reaches every rank through the agreement
    with steps.agreed("validate replicas", 1 + len(local.plan.tensors)) as shared:
        current, report, findings = compare_replicas(local.replica_sets, local.replicated, steps.coordinator,
                                                     options.replica_mismatch)
        shared.sums = torch.cat([torch.tensor([len(findings)], dtype=torch.int64),
                                 element_counts(local.plan, local.shares)])
    check_coverage(local.plan, shared.totals[1:])
    settle_findings(findings, int(shared.totals[0]), steps.coordinator, options.replica_mismatch, report)
    if not report.reconciled:
        return local.inputs, local.shares, report
    inputs = _with_reconciled(local.inputs, current)
    return inputs, _write_shares_of(inputs, steps.coordinator), report


def _with_reconciled(inputs: _Inputs, current: Mapping[str, torch.Tensor]) -> _Inputs:
    state_dict = with_copies(inputs.state_dict, current)
    extra = {k: current.get(k, v) if torch.is_tensor(v) else v for k, v in inputs.extra.items()}
    return replace(inputs, state_dict=state_dict, extra=extra)


def _resolve_inputs(model: Any, state_dict: Mapping[str, torch.Tensor] | None, config: Any,
                    adapter: StateDictAdapter | None, tokenizer: Any, generation_config: Any,
                    extra: Mapping[str, Any] | None, pp_group: Any = None) -> _Inputs:
    """The state dict, HF config, adapter, extra tensors and pipeline group to export, from a model
    (or this rank's stage modules) or given directly."""
    parts = model_parts(model)
    first = parts[0] if parts else None
    if state_dict is None:
        if first is None:
            raise InputError("nothing to export", key="model", expected="a model, its stage modules or a state_dict",
                             actual="neither")
        state_dict = state_dict_of(parts)
    config = config if config is not None else getattr(first, "config", None)
    if config is None:
        raise InputError("no HF config", key="config", expected="model.config or config=", actual=None)
    if generation_config is None and first is not None and getattr(first, "can_generate", lambda: False)():
        generation_config = getattr(first, "generation_config", None)
    adapter = adapter or get_adapter(config)
    return _Inputs(state_dict, config, adapter, tokenizer, generation_config, first, dict(extra or {}),
                   pipeline_group_of(pp_group, model), isinstance(model, (list, tuple)))


def export_catalogue(adapter: StateDictAdapter, state_dict: Mapping[str, torch.Tensor], options: ExportOptions, *,
                     extras: Mapping[str, HFShard] | None = None, model: Any = None, config: Any = None,
                     pp_rank: int = 0) -> Catalogue:
    """What ``state_dict`` (a whole model, or one rank's pipeline stages) writes: every HF key with
    its global shape and dtype, and which keys stay float32 (``casting.py``) or exact (``extras``,
    kept in their own dtype). Pure: global shapes only."""
    extras = dict(extras or {})
    sources = adapter.hf_source_keys(state_dict)
    float32 = float32_keys(fp32_patterns(options.torch_dtype, config if config is not None else adapter.config), sources)
    return catalogue_of(_all_metadata(adapter, state_dict, extras), float32, frozenset(extras), pp_rank)


def plan_of(catalogue: Catalogue, options: ExportOptions) -> ExportPlan:
    """The checkpoint's layout (files, headers, offsets) of ``catalogue`` exported with ``options``."""
    return plan_export(catalogue.metadata, dtype=options.torch_dtype, keep_dtype=options.keep_dtype,
                       max_shard_size=options.max_shard_bytes, keep_exact=catalogue.exact,
                       keep_float32=catalogue.float32)


def export_plan_of(adapter: StateDictAdapter, state_dict: Mapping[str, torch.Tensor], options: ExportOptions, *,
                   extras: Mapping[str, HFShard] | None = None, model: Any = None, config: Any = None) -> ExportPlan:
    """The checkpoint's layout (files, headers, offsets) for ``state_dict`` exported with ``options``.

    Pure: global shapes and dtypes only, so every rank computes the same plan; the export's
    validate step and the planner (docs/design.md#planner) both call it. ``extras`` are the extra
    tensors' pieces (their own dtype is kept); ``config``'s model_type says what transformers keeps
    in float32 (``casting.py``: transformers' class for it, whatever ``model``'s class says).
    """
    return plan_of(export_catalogue(adapter, state_dict, options, extras=extras, model=model, config=config),
                   options)


def replicated_tensors(adapter: StateDictAdapter, state_dict: Mapping[str, torch.Tensor],
                       extra: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The tensors the replica check compares, by name: every state-dict tensor the checkpoint is
    written from, and the extra tensors handed as tensors."""
    replicated = {name: state_dict[name] for name in set(adapter.hf_source_keys(state_dict).values())}
    replicated.update({k: v for k, v in (extra or {}).items() if torch.is_tensor(v)})
    return replicated


def rank_write_shares(adapter: StateDictAdapter, state_dict: Mapping[str, torch.Tensor], place: tuple[int, int],
                      extras: Mapping[str, HFShard] | None = None) -> list[HFShard]:
    """What one rank writes: its write share of every piece ``to_hf`` gives it and of the extra
    pieces. ``place`` is the rank's ``(index, count)`` among the holders of a plain tensor (the
    export group). Pure apart from reading the DTensors' meshes, so the planner runs it for every
    simulated rank (docs/design.md#planner)."""
    pieces = [*adapter.to_hf(state_dict, plain_replica=place).values(), *(extras or {}).values()]
    return write_shares(pieces)


def _plain_replica(coordinator: Coordinator) -> tuple[int, int]:
    """A plain tensor sits on every rank of the export group: this rank's place among its holders."""
    return coordinator.rank, max(coordinator.world_size, 1)


def _write_shares_of(inputs: _Inputs, coordinator: Coordinator, extras: dict[str, HFShard] | None = None
                     ) -> list[HFShard]:
    """What this rank writes: its share of every piece of the model and of the extra tensors."""
    place = _plain_replica(coordinator)
    extras = extra_pieces(inputs.extra, place) if extras is None else extras
    return rank_write_shares(inputs.adapter, inputs.state_dict, place, extras)


def _all_metadata(adapter: StateDictAdapter, state_dict: Mapping[str, torch.Tensor],
                  extras: Mapping[str, HFShard]) -> dict[str, Any]:
    """The model's HF tensors and the extra ones; an extra tensor may not take a model tensor's name."""
    metadata = adapter.hf_metadata(state_dict)
    for key in extras:
        if key in metadata or key in state_dict:
            raise InputError("an extra tensor has the name of a model tensor", key=key,
                             expected="a name the model does not write", actual="a model tensor's name",
                             hint="pass extra tensors only for keys outside the model's state dict")
    return {**metadata, **extra_metadata(extras)}


def _check_replica_source(options: ExportOptions, coordinator: Coordinator) -> None:
    """``replica_mismatch="rank:N"`` names a rank of the export group (rank-local: same verdict everywhere)."""
    source = options.replica_source
    members = [coordinator.global_rank(r) for r in range(max(coordinator.world_size, 1))]
    if source is not None and source not in members:
        raise InputError("replica_mismatch names a rank outside the export group", key="replica_mismatch",
                         expected=f"rank:N with N in {members}", actual=repr(options.replica_mismatch))


def _write(job: _Job) -> WriteStats:
    """Step 4: the storage writer puts this rank's pieces in place (and fsyncs). On a shared
    filesystem, row-parallel TP shares are first exchanged between the TP peers and written as
    whole rows (``row_exchange.py``; docs/design.md#tensor-and-context-parallelism-torch-tp)."""
    regular, rows = job.pieces, []
    if type(job.writer) is SharedFilesystemWriter:  # not the local-filesystem or FP8 writers
        regular, rows = row_parallel_shares(job.pieces, job.inputs.state_dict)
    if not rows:
        return job.writer.write(job.plan, job.pieces, job.target.partial)
    writer = job.writer.batch_writer(job.plan, job.target.partial,
                                     pinned=any(p.tensor.is_cuda for p in job.pieces))
    try:
        exchanged = write_exchanged_rows(writer, rows, job.coordinator.timeout)
        writer.write(regular)
    except BaseException:
        writer.abandon()
        raise
    stats = writer.close()
    stats.exchanged_bytes = exchanged
    return stats


def _result(job: _Job, stats: WriteStats, step_seconds: dict[str, float], started: float) -> ExportResult:
    return ExportResult(
        path=job.target.path, files=len(job.plan.files), tensors=len(job.plan.tensors),
        checkpoint_bytes=job.plan.total_tensor_bytes, rank_bytes_written=stats.bytes_written,
        seconds=round(time.perf_counter() - started, 4), step_seconds=step_seconds, io=stats.as_io(),
        notes=list(job.target.notes),
        replica_seconds=job.replicas.seconds, reconciled=job.replicas.reconciled,
        replica_check=dict(groups=job.replicas.groups, tensors=job.replicas.tensors, bytes=job.replicas.bytes_checked),
        passthrough_keys=sorted(job.inputs.extra),
        files_owned=sorted(job.my_files()), files_written=sorted(stats.files_touched),
    )


class ExportStep(Hook):
    """The export as a recipe step and as a hook: configured once, run on every rank.

    ``ExportStep(output_dir, options, **overrides)`` validates its :class:`ExportOptions` when built
    (it declares no defaults of its own). Call it with the model (and optionally ``tokenizer``,
    ``adapter``, ...: the inputs of :func:`export_hf_checkpoint`), or install it as a hook: at the
    end of training it exports ``ctx.model`` with the context's tokenizer and adapter
    (docs/design.md#hooks) and records the :class:`ExportResult` in ``ctx.results["export"]``.
    """

    def __init__(self, output_dir: str | os.PathLike[str], options: Any = None, **overrides: Any) -> None:
        self.output_dir = os.fspath(output_dir)
        self.options = ExportOptions.of(options, **overrides)

    def __call__(self, model: Any = None, **inputs: Any) -> ExportResult:
        return export_hf_checkpoint(self.output_dir, model, self.options, **inputs)

    def on_train_end(self, ctx: RecipeContext) -> None:
        ctx.results["export"] = self(ctx.model, tokenizer=ctx.tokenizer, adapter=ctx.adapter)

    def __repr__(self) -> str:
        return f"ExportStep({self.output_dir!r}, {self.options!r})"
