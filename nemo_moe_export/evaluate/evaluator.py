"""Distributed MMLU evaluation that cannot hang on MoE models, and keeps every rank busy.

Why this exists
---------------
With expert parallelism (EP) every forward runs an all-to-all over the EP group, and under FSDP2
every forward all-gathers parameters over the shard group. Ranks that run a different number of
forwards therefore block forever in a collective (docs/design.md#mmlu-definition).
Sharding batches only over the expert-data-parallel group (EP peers run identical batches) fixes
the hang but makes every EP peer recompute the same batch: throughput divided by the EP size.

How it works
------------
The task (MMLU as lm-evaluation-harness defines it, or any multiple-choice task of
:mod:`.task`: a YAML file read by :mod:`.data`, :mod:`.prompts`, :mod:`.scoring`) is data; this
module is the engine's driver, one module per step:

1. **Prepare** (:mod:`.prepare`, no communication): every rank tokenizes every question the way
   lm-eval does and validates the input. Bad input raises
   :class:`~nemo_moe_export.errors.InputError` here, identically on every rank, before any
   collective has started.
2. **Plan** (:mod:`.prefixes`, :mod:`.batching`, no communication): each subject's shared k-shot
   prefix is found in the tokenized rows; rows are sorted by length and cut into batches by a
   token budget (``tokens_per_batch``) or of ``batch_size`` rows, the rows of a shared prefix
   into units of one prefix forward and the suffix forwards that continue its cache. Every rank
   computes the same global plan and derives from it which forward it runs at each step (the
   sharding policies are described there). A fingerprint of the plan is compared across ranks
   once, so ranks that read different data fail loudly instead of drifting out of step.
3. **Forward steps** (:mod:`.runner` runs one forward): every rank runs the same number of steps,
   one forward each, a prefix forward being a step like any other (a rank without work at a step
   runs a 1-token dummy forward whose result is discarded); every ``agree_every`` steps the ranks
   agree (:meth:`Coordinator.agree <nemo_moe_export.parallel.Coordinator.agree>`). A rank whose
   forward raises aborts the model's process groups and leaves at once
   (:meth:`Coordinator.leave <nemo_moe_export.parallel.Coordinator.leave>`) rather than wait at
   an agreement its collective peers cannot reach; every rank raises a
   :class:`~nemo_moe_export.parallel.PeerError` naming the failing rank, the step ("mmlu step 17
   of 40") and its exception. Scores stay on the device until the last step.
4. **Gather** (:mod:`.results`): per-row scores are all-gathered over the data-parallel group;
   every rank assembles the per-question scores in question order and aggregates them with
   :func:`~nemo_moe_export.evaluate.scoring.aggregate` as the task groups them.

Every setting comes from :class:`~nemo_moe_export.evaluate.options.MMLUOptions`, the one home of
the defaults (docs/design.md#options-and-defaults).

Timeouts
--------
Forwards run under the process groups of the model: the EP groups of
:func:`~nemo_moe_export.parallel.init_expert_parallel` carry their own timeout; FSDP2's all-gathers
use the timeout of its mesh's process groups (``init_process_group(timeout=...)`` / the groups
passed to ``init_device_mesh``). ``timeout_s`` bounds each agreement between steps; agreements
run on a gloo group of their own (:func:`phase_coordinator`) whose timeout is ``timeout_s`` too.
A rank blocked in a forward collective raises after the model group's timeout, a rank waiting at
an agreement after ``timeout_s``; set ``timeout_s`` above the model groups' timeout so the error
every rank sees names the failing ranks rather than only "did not arrive". One agreement is one
all-reduce (about 1.2 ms on 4 gloo ranks); which agreements remain, and why, is
docs/design.md#coordination-protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_export.collectives import fingerprint_words
from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.batching import (
    Batch,
    StepPlan,
    default_tokens_per_batch,
    plan_batches,
    plan_fingerprint,
    plan_steps,
)
from nemo_moe_export.evaluate.data import Question
from nemo_moe_export.evaluate.options import MMLUOptions
from nemo_moe_export.evaluate.prefix_attention import shares_prefix_keys
from nemo_moe_export.evaluate.prefixes import SharedPrefix, find_shared_prefixes, prefix_multiple
from nemo_moe_export.evaluate.prepare import (
    PreparedQuestions,
    default_max_length,
    model_vocab_size,
    prepare_questions,
)
from nemo_moe_export.evaluate.results import (
    MMLUResult,
    layout_summary,
    padding_summary,
    score_records,
    scoring_summary,
    timing_summary,
)
from nemo_moe_export.evaluate.runner import (
    ForwardRunner,
    cache_support,
    inference,
    pad_token_id,
    wants_uniform_shapes,
)
from nemo_moe_export.evaluate.scoring import aggregate, record_outcomes
from nemo_moe_export.evaluate.task import load_task
from nemo_moe_export.parallel import (Coordinator, ParallelLayout, PeerError, discover_layout, is_global_rank0,
                                      model_groups)
from nemo_moe_export.progress import Progress

__all__ = ["MMLUStepError", "evaluate_mmlu", "global_batches", "phase_coordinator"]

logger = logging.getLogger(__name__)


class MMLUStepError(RuntimeError):
    """A forward of one evaluation step failed on this rank (wrapped to name the step)."""


def evaluate_mmlu(
    model: Any,
    tokenizer: Any,
    questions: Sequence[Question] | PreparedQuestions,
    dev: Sequence[Question] = (),
    layout: ParallelLayout | None = None,
    options: MMLUOptions | Any = None,
    *,
    coordinator: Coordinator | None = None,
    softmax_dtype: torch.dtype | None = None,
    name: str = "mmlu",
    **overrides: Any,
) -> MMLUResult:
    """Evaluate ``model`` on ``questions`` of ``options.task`` (MMLU unless told) with ``k_shot``
    examples from ``dev``, on every rank.

    Settings are ``MMLUOptions.of(options, **overrides)`` (an :class:`MMLUOptions`, a config node
    or a mapping, then keyword overrides such as ``k_shot=0, batch_size=4, policy="expert_dp"``);
    an unknown or invalid setting raises ``InputError`` before anything runs.

    ``model`` is called transformers-style (``model(input_ids=, attention_mask=, use_cache=False,
    logits_to_keep=) -> .logits``; with shared prefixes also ``use_cache=True``, ``position_ids=``
    and its cache argument, see :mod:`.runner`) and may be plain, FSDP2-sharded (``fully_shard``) or
    expert-parallel (:func:`~nemo_moe_export.expert_parallel.apply_expert_parallel`); every rank of
    ``layout.dp`` (default :func:`~nemo_moe_export.parallel.discover_layout`) must call this with
    the same questions. ``questions`` may be a :class:`PreparedQuestions` from
    :func:`prepare_questions` (then ``dev``/``k_shot``/``scoring``/``max_length`` are already
    applied, and its ``task``) to tokenize once for many evaluations. ``coordinator``: a :func:`phase_coordinator`
    to reuse (else one is created: a collective over the world). Returns the same
    :class:`MMLUResult` on every rank; predictions equal a single-process run's whatever the
    layout and policy. Raises ``InputError`` on bad input before any collective and
    ``PeerError`` on every rank when any rank fails or stalls.
    """
    started = time.perf_counter()
    opts = MMLUOptions.of(options, **overrides)
    _require_not_options(layout)
    layout = layout if layout is not None else discover_layout()
    # 1-2. prepare and plan: no communication, so bad input raises here on every rank alike
    prepared = _prepared(model, tokenizer, questions, dev, opts)
    batches, budget, prefixes, uniform_shapes = global_batches(model, prepared, opts)
    plan = plan_steps(batches, opts.policy, layout, uniform_shapes=uniform_shapes)
    prepared_at = time.perf_counter()
    coordinator = coordinator or phase_coordinator(layout, timeout_s=opts.timeout_s, name=name)
    _agree_on_plan(coordinator, plan_fingerprint(prepared, batches, plan), opts.policy)
    # 3. forward steps, with an agreement every opts.agree_every steps
    runner = ForwardRunner(model, prepared.rows, pad_token_id(tokenizer, model_vocab_size(model)), softmax_dtype,
                           prefixes)
    row_scores, error = _forward_steps(runner, model, batches, plan, layout, coordinator, opts, name)
    forwards_done = time.perf_counter()
    gathered = _gathered(coordinator, runner, row_scores, error, layout, opts.policy)  # 4. gather
    records = score_records(prepared, _merged(scores for scores, _ in gathered))
    return MMLUResult(
        metrics=aggregate(record_outcomes(records), prepared.task), records=records, policy=opts.policy,
        layout=layout_summary(layout),
        timing=timing_summary(started, prepared_at, forwards_done, time.perf_counter(), len(prepared.questions)),
        padding=padding_summary(tally for _, tally in gathered if tally is not None),
        scoring=_scoring(model, prepared, opts, batches, budget, prefixes, uniform_shapes, runner.packed),
        steps=plan.n_steps, task=load_task(prepared.task).name,
    )


def _agree_on_plan(coordinator: Coordinator, fingerprint: str, policy: str) -> None:
    """The first collective: every rank arrived, with the same plan (the plan's fingerprint is
    compared through words summed on the agreement)."""
    summed = _agree(coordinator, "prepare", None, policy, sums=fingerprint_words(fingerprint))
    coordinator.require_same("MMLU batch plan", fingerprint, key="questions", summed=summed,
                             hint="every rank must evaluate the same questions with the same tokenizer and options "
                                  "(and, with tokens_per_batch=None, on the same kind of device)")


def _forward_steps(runner: ForwardRunner, model: Any, batches: Sequence[Batch], plan: StepPlan,
                   layout: ParallelLayout, coordinator: Coordinator, opts: MMLUOptions,
                   name: str) -> tuple[dict[int, list[float]], BaseException | None]:
    """Step 3: this rank's forward steps of ``plan`` in inference mode (:func:`_run_steps`), then
    its scores read from the device once, or the error reading them raised."""
    with inference(model):
        _run_steps(runner, batches, plan, coordinator, lambda: _model_groups(model, layout, coordinator),
                   name=name, show_progress=opts.progress, agree_every=opts.agree_every)
        return _read_scores(runner)


def _gathered(coordinator: Coordinator, runner: ForwardRunner, row_scores: dict[int, list[float]],
              error: BaseException | None, layout: ParallelLayout, policy: str) -> list[Any]:
    """Step 4: every rank's ``(row scores, padding tally)``, after an agreement, so that a rank
    still stuck in a step is reported, not mismatched. Under pipeline stages every rank of a
    pipeline ran the same forwards: its tally counts once (the first stage's)."""
    _agree(coordinator, "gather", error, policy)
    return coordinator.all_gather((row_scores, runner.tally if layout.pp.rank == 0 else None))


def _scoring(model: Any, prepared: PreparedQuestions, opts: MMLUOptions, batches: list[Batch], budget: int,
             prefixes: tuple[SharedPrefix, ...], uniform_shapes: bool, packed: bool) -> dict[str, Any]:
    """``MMLUResult.scoring``: how the prompts were scored, batched and their prefixes shared."""
    return scoring_summary(prepared, batch_size=opts.batch_size, batches=batches, uniform_shapes=uniform_shapes,
                           tokens_per_batch=budget, prefixes=prefixes,
                           prefix_attention=("packed" if packed else "copied") if prefixes else None,
                           prefix_status=_shared_prefix_state(model, opts, uniform_shapes))


def global_batches(model: Any, prepared: PreparedQuestions, opts: MMLUOptions
                   ) -> tuple[list[Batch], int, tuple[SharedPrefix, ...], bool]:
    """``(batches, token budget, shared prefixes, uniform shapes)``: the evaluation's global batch
    plan for ``model``, the same on every rank and with no communication (the planner,
    ``planner/mmlu.py``, calls it for each simulated layout)."""
    uniform_shapes = wants_uniform_shapes(model) if opts.uniform_shapes is None else opts.uniform_shapes
    prefixes = _shared_prefixes(model, prepared, opts, uniform_shapes)
    budget = (default_tokens_per_batch(model, shared_prefix=bool(prefixes)) if opts.tokens_per_batch is None
              else opts.tokens_per_batch)
    batches = plan_batches(prepared.rows, opts.batch_size, token_budget=budget, prefixes=prefixes,
                           packed=bool(prefixes) and shares_prefix_keys(model))
    return batches, budget, prefixes, uniform_shapes


def _prepared(model: Any, tokenizer: Any, questions: Sequence[Question] | PreparedQuestions,
              dev: Sequence[Question], opts: MMLUOptions) -> PreparedQuestions:
    """``questions`` tokenized as ``opts`` say, unless the caller already prepared them."""
    if isinstance(questions, PreparedQuestions):
        return questions
    return prepare_questions(tokenizer, questions, dev, k_shot=opts.k_shot, scoring=opts.scoring,
                             max_length=opts.max_length or default_max_length(model, tokenizer),
                             vocab_size=model_vocab_size(model), task=opts.task)


def _shared_prefixes(model: Any, prepared: PreparedQuestions, opts: MMLUOptions,
                     uniform_shapes: bool) -> tuple[SharedPrefix, ...]:
    """The prefixes to share, or none (full prompts, with a log line saying why unless asked for)."""
    reason = _prefix_sharing_off(model, opts, uniform_shapes)
    if reason is None:
        return find_shared_prefixes(prepared, multiple=prefix_multiple(model))
    if opts.shared_prefix and is_global_rank0():
        logger.warning("MMLU: shared prefixes off, evaluating full prompts: %s", reason)
    return ()


def _prefix_sharing_off(model: Any, opts: MMLUOptions, uniform_shapes: bool) -> str | None:
    """Why shared prefixes are off for ``model``, or None when they are on."""
    if not opts.shared_prefix:
        return "shared_prefix=False"
    return "the model needs uniform shapes across ranks" if uniform_shapes else cache_support(model)


def _shared_prefix_state(model: Any, opts: MMLUOptions, uniform_shapes: bool) -> str:
    """``MMLUResult.scoring["shared_prefix"]``: ``"on"``, or ``"off: <why>"``."""
    reason = _prefix_sharing_off(model, opts, uniform_shapes)
    return "on" if reason is None else f"off: {reason}"


def _read_scores(runner: ForwardRunner) -> tuple[dict[int, list[float]], BaseException | None]:
    """The runner's scores, read from the device once; an error is handed to the gather agreement."""
    try:
        return runner.scores(), None
    except Exception as exc:  # reported to every rank by the agreement
        return {}, exc


def _require_not_options(layout: Any) -> None:
    """Options are the 6th argument; passed 5th they would be taken for the layout."""
    if isinstance(layout, (MMLUOptions, dict)):
        raise InputError("MMLU options were passed as the parallel layout", key="layout",
                         expected="a ParallelLayout or None", actual=type(layout).__name__,
                         hint="pass them as options=... (evaluate_mmlu(model, tok, qs, dev, layout, options))")


def _run_steps(runner: ForwardRunner, batches: Sequence[Batch], plan: StepPlan, coordinator: Coordinator,
               model_groups: Callable[[], list[Any]], *, name: str, show_progress: bool,
               agree_every: int | None) -> None:
    """This rank's steps of ``plan``, one forward each; the runner keeps the scores.

    Ranks agree after every ``agree_every`` steps (not after the last: the gather agreement
    follows). A rank whose forward raises does not wait for an agreement: its peers may be blocked
    in a collective of that forward, which only its leaving ends. It reports through the store
    (:meth:`Coordinator.leave`), aborts the model's process groups and raises; the other ranks
    raise at their next agreement, naming it (docs/design.md#coordination-protocol)."""
    with Progress(plan.n_steps, name, enabled=show_progress) as bar:
        for s, batch_id in enumerate(plan.batch_of_step):
            label = f"{s + 1} of {plan.n_steps}"
            try:
                runner.run(None if batch_id is None else batches[batch_id], plan.shapes[s] if plan.shapes else None)
            except Exception as exc:  # this rank leaves; its peers learn it through the store
                error = MMLUStepError(f"{name} step {label} ({plan.policy}): {type(exc).__name__}: {exc}")
                left = coordinator.leave(label, error)  # the report first: it must not wait on an abort
                raise _left(left, coordinator.name, plan.policy, _abort(model_groups)) from exc
            if agree_every is not None and (s + 1) % agree_every == 0 and s + 1 < plan.n_steps:
                _agree(coordinator, label, None, plan.policy)
            bar.update(1)


def _merged(per_rank_scores: Iterable[dict[int, list[float]]]) -> dict[int, list[float]]:
    """Row scores of every rank in one mapping (EP peers under ``expert_dp`` score the same rows)."""
    merged: dict[int, list[float]] = {}
    for scores in per_rank_scores:
        merged.update(scores)
    return merged


# --------------------------------------------------------------------------------------------------
# Coordination (docs/design.md#coordination-protocol)
# --------------------------------------------------------------------------------------------------


class _SingleRankCoordinator(Coordinator):
    """A data-parallel group of one rank: nothing to agree with (no process group is touched)."""

    def __init__(self, *, timeout_s: float, name: str) -> None:  # noqa: D107 - no super(): no group
        self.name, self.timeout = name, timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.active, self.group = 0, 1, False, None


def phase_coordinator(layout: ParallelLayout, *, timeout_s: float = MMLUOptions.timeout_s,
                      name: str = "mmlu") -> Coordinator:
    """The coordinator that closes each evaluation phase: over ``layout``'s data-parallel group,
    joined under pipeline stages with the data-parallel groups of this rank's pipeline peers.

    Pipeline stages couple their ranks: a stall or failure in one stage blocks the next one's
    receive, so the ranks that can only wait must agree with the ranks that failed or stalled, or
    none of them could name the culprit (the coordinator knows who reported). It runs on a gloo
    group of its own whose default timeout is ``timeout_s``: the agreement's point-to-point sends
    and all-gathers must wait as long as the agreement does, or a rank that arrives early (its
    peers still stuck in a forward) would give up after the *model* group's shorter timeout and
    leave the others without an answer. Creating it is a collective over the whole world (every
    rank, every group at once); create it once and pass it to :func:`evaluate_mmlu` for repeated
    evaluations (:class:`~nemo_moe_export.evaluate.callback.MMLUCallback` does).
    """
    if (layout.dp.size == 1 or layout.dp.group is None) and layout.pp.size == 1:
        return _SingleRankCoordinator(timeout_s=timeout_s, name=name)
    members: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(members, (list(layout.dp.ranks), list(layout.pp.ranks)))
    groups = _coupled([ranks for pair in members for ranks in pair])
    group, _ = dist.new_subgroups_by_enumeration(groups, timeout=timedelta(seconds=timeout_s), backend="gloo")
    return Coordinator(group, timeout_s=timeout_s, name=name)


def _coupled(groups: list[list[int]]) -> list[list[int]]:
    """The ranks linked by any of ``groups`` (data-parallel and pipeline groups), as disjoint
    sorted groups in order: the same on every rank."""
    root: dict[int, int] = {}

    def find(r: int) -> int:
        while root.setdefault(r, r) != r:
            r = root[r]
        return r

    for ranks in groups:
        for r in ranks[1:]:
            root[find(r)] = find(ranks[0])
    joined: dict[int, list[int]] = {}
    for r in sorted(root):
        joined.setdefault(find(r), []).append(r)
    return sorted(joined.values())


def _model_groups(model: Any, layout: ParallelLayout, coordinator: Coordinator) -> list[Any]:
    """The process groups the model's forwards run collectives on (``parallel.model_groups``), never
    the coordinator's own group, which must still carry the report."""
    ours = getattr(coordinator.group, "group_name", None)
    return [g for g in model_groups(model, layout) if g.group_name != ours]


def _abort(model_groups: Callable[[], list[Any]]) -> list[str]:
    """Abort the model's process groups on this rank (``ProcessGroup.abort``); the names of those
    aborted. A best effort on a failure path: what fails here is logged, never raised.

    On NCCL this aborts the communicators, so this rank's pending collectives end and no later one
    can start. gloo's abort does nothing (torch 2.13): a peer blocked in a collective that needs
    this rank is released when this rank's process ends and its connections close
    (docs/design.md#faults-and-how-each-is-reported)."""
    try:
        groups = model_groups()
    except Exception as exc:
        logger.warning("could not list the model's process groups to abort them: %s", exc)
        return []
    aborted = []
    for group in groups:
        try:
            group.abort()
            aborted.append(group.group_name)
        except Exception as exc:
            logger.warning("could not abort process group %s: %s", group.group_name, exc)
    return aborted


def _left(left: PeerError, name: str, policy: str, aborted: list[str]) -> PeerError:
    """What a rank whose step failed raises: ``left`` (:meth:`Coordinator.leave`) in the evaluator's words."""
    note = (f"; the model's process groups were aborted on this rank ({len(aborted)}): the job must end"
            if aborted else "")
    return PeerError(f"MMLU evaluation ({policy}) failed at {name} step {left.step}: {left}{note}",
                     step=left.step, ranks=left.ranks)


def _agree(coordinator: Coordinator, step: str, error: BaseException | None, policy: str,
           sums: torch.Tensor | None = None) -> torch.Tensor | None:
    """``coordinator.agree`` with a message that reads "mmlu step 3 of 12" on every rank."""
    try:
        return coordinator.agree(step, error, sums=sums)
    except PeerError as exc:
        raise PeerError(f"MMLU evaluation ({policy}) failed at {coordinator.name} step {step}: {exc}",
                        step=exc.step, ranks=exc.ranks) from exc
