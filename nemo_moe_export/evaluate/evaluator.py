"""Distributed MMLU evaluation that cannot hang on MoE models, and keeps every rank busy.

Why this exists
---------------
With expert parallelism (EP) every forward runs an all-to-all over the EP group, and under FSDP2
every forward all-gathers parameters over the shard group. Ranks that run a different number of
forwards therefore block forever in a collective (REFERENCE.md section 5, seed 003). Sharding
batches only over the expert-data-parallel group (EP peers run identical batches) fixes the hang
but makes every EP peer recompute the same batch: throughput divided by the EP size.

How it works
------------
1. **Prepare** (no communication): every rank tokenizes every question the way lm-evaluation-
   harness does (:mod:`~nemo_moe_export.evaluate.prompts`) and validates the input. Bad input
   raises :class:`~nemo_moe_export.errors.ExportInputError` here, identically on every rank, before
   any collective has started.
2. **Plan** (no communication): rows are sorted by length (longest first, as lm-eval does, so an
   out-of-memory shows on the first batch) and cut into batches of ``batch_size``; every rank
   computes the same global plan from the same question list and derives from it which batch it
   runs at each step. A fingerprint of the plan is compared across ranks once, so ranks that read
   different data fail loudly instead of drifting out of step.
3. **Forward steps**: every rank runs the same number of steps (a rank without a batch at a step
   runs a 1-token dummy forward whose result is discarded); each step is closed with
   :meth:`Coordinator.agree <nemo_moe_export.parallel.Coordinator.agree>`, so a rank that fails or
   stalls becomes a :class:`~nemo_moe_export.parallel.PeerError` naming the step ("mmlu step 17 of
   40") on every rank within ``timeout_s``.
4. **Gather**: per-row scores are all-gathered over the data-parallel group; every rank assembles
   the per-question scores in question order and aggregates them with
   :func:`~nemo_moe_export.evaluate.scoring.aggregate`.

Sharding policies (:data:`POLICIES`)
------------------------------------
* ``lockstep`` (default): batches are split over the whole data-parallel group, EP peers included,
  so every rank does distinct, useful work; step counts are equalised with dummy batches. Our EP
  all-to-all takes uneven splits, so EP peers may run batches of different shapes.
* ``expert_dp``: the known fix. EP peers run identical batches; batches are split over the
  expert-DP group only. Step counts are equalised over the whole DP group as well, so an FSDP
  shard group spanning several EP groups cannot hang either.
* ``naive``: dense-DP split with uneven step counts and no dummy batches. **Unsafe with EP or FSDP**
  (it is what hangs); it exists only so a test can show the hazard is real and that it is reported
  as an error rather than a hang.

When shapes must match across ranks (``uniform_shapes``; e.g. a dispatcher with fixed-capacity
buffers or sequence-parallel regions), every rank pads its step to the same ``[rows, length]``,
planned up front from the global plan (the largest batch of that step), so no extra communication
is needed. ``uniform_shapes=None`` detects it: on for Megatron-core modules, off for transformers
models (our :class:`~nemo_moe_export.expert_parallel.ExpertParallelExperts` and FSDP2 all-gathers do
not depend on the input shape).

Padding and exactness
---------------------
Rows are right-padded and each row is read at its own last real positions; with a causal model
the real positions never see the padding, so padded results equal unpadded ones up to fp32 noise
(predictions, not raw logits, are what is compared for "identical"). Logits are projected only at
the positions scored (``logits_to_keep`` with a per-row position tensor), which keeps memory at
``rows x scored positions x vocab`` instead of ``rows x length x vocab``. ``padding_waste`` =
padded tokens / all tokens fed (dummy batches included).

Timeouts
--------
Forwards run under the process groups of the model: the EP groups of
:func:`~nemo_moe_export.parallel.init_expert_parallel` carry their own timeout; FSDP2's all-gathers
use the timeout of its mesh's process groups (``init_process_group(timeout=...)`` / the groups
passed to ``init_device_mesh``). ``timeout_s`` bounds each agreement between steps; agreements
run on a gloo group of their own (:func:`phase_coordinator`) whose timeout is ``timeout_s`` too.
A rank blocked in a forward collective raises after the model group's timeout, a rank waiting at
an agreement after ``timeout_s``; set ``timeout_s`` above the model groups' timeout so the error
every rank sees names the failing ranks rather than only "did not arrive". One agreement costs
a monitored barrier and a small all-gather (about 7 ms with 4 gloo ranks on 2 busy CPU cores).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.evaluate.data import Question, group_by_subject, require_dev_examples
from nemo_moe_export.evaluate.prompts import (
    build_prompt,
    encode_request,
    multi_token_answers,
    select_fewshot,
    single_token_answer_ids,
    truncate_left,
)
from nemo_moe_export.evaluate.scoring import aggregate, continuation_logprob, question_record
from nemo_moe_export.parallel import Coordinator, ParallelLayout, PeerError, discover_layout

__all__ = [
    "POLICIES",
    "SCORING_MODES",
    "Batch",
    "MMLUResult",
    "MMLUStepError",
    "PreparedQuestions",
    "Row",
    "StepPlan",
    "default_max_length",
    "evaluate_mmlu",
    "phase_coordinator",
    "plan_batches",
    "plan_steps",
    "prepare_questions",
]

logger = logging.getLogger(__name__)

POLICIES: tuple[str, ...] = ("lockstep", "expert_dp", "naive")
SCORING_MODES: tuple[str, ...] = ("auto", "single_token", "full")
_HF_UNSET_MAX_LENGTH = 1000000000000000019884624838656  # transformers' "no limit" model_max_length


# --------------------------------------------------------------------------------------------------
# Prepare: tokenize and validate (no communication)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One model input and the answers it scores.

    A single-token row scores all four choices from the logits at its last position; a full row
    scores one choice's continuation from its last ``len(continuation)`` positions (one lm-eval
    loglikelihood request each).
    """

    row_id: int
    question: int  # position of the question in the evaluated list
    choices: tuple[int, ...]  # which of A..D this row scores
    continuations: tuple[tuple[int, ...], ...]  # per choice, the tokens scored at the end of input
    input_ids: tuple[int, ...]
    truncated: bool

    @property
    def scored_positions(self) -> int:
        return max(len(c) for c in self.continuations)


@dataclass(frozen=True)
class PreparedQuestions:
    """Tokenized rows of every question, plus how they are scored; identical on every rank."""

    questions: tuple[Question, ...]
    rows: tuple[Row, ...]
    max_length: int
    k_shot: int
    single_token_questions: int
    full_questions: int
    truncated_questions: int


def default_max_length(model: Any, tokenizer: Any) -> int:
    """``HFLM.max_length``: the config's context size, else the tokenizer's, else 2048."""
    config = getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value != _HF_UNSET_MAX_LENGTH:
        return value
    return 2048


def prepare_questions(
    tokenizer: Any,
    questions: Sequence[Question],
    dev: Sequence[Question],
    *,
    k_shot: int = 5,
    max_length: int = 2048,
    scoring: str = "auto",
    vocab_size: int | None = None,
) -> PreparedQuestions:
    """Build and tokenize every question's lm-eval requests; refuse bad input before any collective.

    ``scoring``: ``"auto"`` uses the single-token path for a question when " A".." D" are one
    distinct token each and full continuation log-likelihood otherwise; ``"single_token"``
    requires the single-token path (a tokenizer that splits the answer letters is an error);
    ``"full"`` always scores full continuations (four rows per question).
    """
    _check_choice("scoring", scoring, SCORING_MODES)
    if not questions:
        raise ExportInputError("no MMLU questions to evaluate", key="questions", expected=">= 1", actual=0)
    require_dev_examples(dev, sorted({q.subject for q in questions}), k_shot)
    pools = group_by_subject(dev)
    rows: list[Row] = []
    split_answers: list[str] = []
    single = full = truncated = 0
    for qi, question in enumerate(questions):
        prompt = build_prompt(question, select_fewshot(pools.get(question.subject, []), k_shot, question))
        request = encode_request(tokenizer, prompt)
        answer_ids = None if scoring == "full" else single_token_answer_ids(request)
        if answer_ids is None and scoring == "single_token":
            split_answers.append(f"{question.subject}[{question.index}]: {multi_token_answers(request)}")
            continue
        new_rows = (_single_token_rows if answer_ids is not None else _full_rows)(
            qi, request, answer_ids, max_length, first_id=len(rows))
        rows.extend(new_rows)
        single += answer_ids is not None
        full += answer_ids is None
        truncated += any(r.truncated for r in new_rows)
    if split_answers:
        raise ExportInputError(
            "the tokenizer splits the answer letters, but single-token scoring was required",
            key="scoring", expected="' A', ' B', ' C', ' D' one distinct token each after the prompt",
            actual=f"{len(split_answers)} question(s), e.g. {split_answers[0]}",
            hint="use scoring='auto' or 'full' (full continuation log-likelihood, as lm-eval does)",
        )
    if vocab_size is not None:
        _check_token_ids(rows, vocab_size)
    if truncated:
        logger.warning("MMLU: %d of %d prompts longer than max_length=%d were cut from the left (as lm-eval does)",
                       truncated, len(questions), max_length)
    return PreparedQuestions(tuple(questions), tuple(rows), max_length, k_shot, single, full, truncated)


def _single_token_rows(qi: int, request: Any, answer_ids: tuple[int, ...], max_length: int,
                       first_id: int) -> list[Row]:
    """One row: the context (cut as lm-eval cuts it); all four answers read at its last position."""
    input_ids, cut = truncate_left(request.context, (answer_ids[0],), max_length)
    return [Row(first_id, qi, (0, 1, 2, 3), tuple((a,) for a in answer_ids), tuple(input_ids), cut)]


def _full_rows(qi: int, request: Any, _answer_ids: Any, max_length: int, first_id: int) -> list[Row]:
    """Four rows, one per choice: ``(context + continuation)[-(max_length + 1):][:-1]``."""
    rows = []
    for choice, continuation in enumerate(request.continuations):
        input_ids, cut = truncate_left(request.context, continuation, max_length)
        rows.append(Row(first_id + choice, qi, (choice,), (tuple(continuation),), tuple(input_ids), cut))
    return rows


def _check_token_ids(rows: Sequence[Row], vocab_size: int) -> None:
    """A tokenizer/model mismatch would otherwise fail inside the embedding on some rank only."""
    largest = max(max(r.input_ids) for r in rows)
    largest = max(largest, max(t for r in rows for c in r.continuations for t in c))
    if largest >= vocab_size:
        raise ExportInputError(
            "the tokenizer produces token ids outside the model's vocabulary", key="vocab_size",
            expected=f"ids < {vocab_size}", actual=f"id {largest}",
            hint="evaluate with the tokenizer the model was trained with",
        )


def _check_choice(key: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ExportInputError(f"unknown {key}", key=key, expected=f"one of {list(allowed)}", actual=repr(value))


# --------------------------------------------------------------------------------------------------
# Plan: length-sorted batches and who runs what at each step (no communication)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """Consecutive rows of the length-sorted order; ``length`` is the longest row's."""

    batch_id: int
    rows: tuple[int, ...]  # indices into PreparedQuestions.rows
    length: int
    real_tokens: int


def plan_batches(rows: Sequence[Row], batch_size: int) -> list[Batch]:
    """Rows sorted by length, longest first (ties by row id, so the plan is deterministic), cut
    into batches of ``batch_size``. Similar lengths share a batch, which keeps padding low."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ExportInputError("batch_size must be a positive integer", key="batch_size", expected=">= 1",
                               actual=batch_size)
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i].input_ids), rows[i].row_id))
    batches = []
    for start in range(0, len(order), batch_size):
        members = tuple(order[start:start + batch_size])
        lengths = [len(rows[i].input_ids) for i in members]
        batches.append(Batch(len(batches), members, max(lengths), sum(lengths)))
    return batches


@dataclass(frozen=True)
class StepPlan:
    """What this rank runs at each step.

    ``batch_of_step[s]`` is a global batch id, or None for a dummy forward (result discarded).
    ``shapes[s]`` is the ``(rows, length)`` every rank pads step ``s`` to when shapes must match,
    else None (each batch keeps its own shape, dummies are one token).
    """

    policy: str
    shard_rank: int
    shard_size: int
    batch_of_step: tuple[int | None, ...]
    shapes: tuple[tuple[int, int], ...] | None

    @property
    def n_steps(self) -> int:
        return len(self.batch_of_step)


def plan_steps(batches: Sequence[Batch], policy: str, layout: ParallelLayout, *,
               uniform_shapes: bool = False) -> StepPlan:
    """This rank's steps under ``policy``; every rank derives its own from the same global plan.

    Batches go round-robin over the shards (rank ``r`` of ``S`` takes ``r, r + S, ...``), so each
    step holds ``S`` consecutive batches of the length-sorted order: similar shapes, little waiting.
    ``lockstep`` shards over the DP group, ``expert_dp`` over the expert-DP group (EP peers share a
    shard index, hence identical batches); both run ``ceil(n / S)`` steps everywhere. ``naive``
    shards over the DP group and runs only its own batches (uneven step counts: unsafe).
    """
    _check_choice("policy", policy, POLICIES)
    group = layout.edp if policy == "expert_dp" else layout.dp
    shard_rank, shard_size = group.rank, group.size
    n = len(batches)
    if policy == "naive":
        return StepPlan(policy, shard_rank, shard_size, tuple(range(shard_rank, n, shard_size)), None)
    n_steps = math.ceil(n / shard_size)
    mine = tuple(b if (b := s * shard_size + shard_rank) < n else None for s in range(n_steps))
    shapes = None
    if uniform_shapes:
        shapes = tuple(_step_shape(batches[s * shard_size:(s + 1) * shard_size]) for s in range(n_steps))
    return StepPlan(policy, shard_rank, shard_size, mine, shapes)


def _step_shape(step_batches: Sequence[Batch]) -> tuple[int, int]:
    """The shape every rank pads one step to: the most rows and the longest row of the step."""
    return max(len(b.rows) for b in step_batches), max(b.length for b in step_batches)


def _plan_fingerprint(prepared: PreparedQuestions, batches: Sequence[Batch], plan: StepPlan) -> str:
    """Equal on all ranks iff they tokenized the same rows into the same global batches and steps."""
    h = hashlib.sha256()
    h.update(repr((plan.policy, plan.shard_size, plan.n_steps if plan.policy != "naive" else None,
                   prepared.max_length, prepared.k_shot)).encode())
    for row in prepared.rows:
        h.update(repr((row.question, row.choices, row.continuations, row.input_ids)).encode())
    h.update(repr([b.rows for b in batches]).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# Forward: one step
# --------------------------------------------------------------------------------------------------


@dataclass
class _PaddingTally:
    real_tokens: int = 0
    fed_tokens: int = 0  # rows x padded length, summed over every forward (dummies included)

    def add(self, real: int, rows: int, length: int) -> None:
        self.real_tokens += real
        self.fed_tokens += rows * length


class _ForwardRunner:
    """Runs right-padded batches through ``model`` and scores each row's continuations."""

    def __init__(self, model: Any, rows: Sequence[Row], pad_id: int, softmax_dtype: torch.dtype | None) -> None:
        self.model, self.rows, self.pad_id, self.softmax_dtype = model, rows, pad_id, softmax_dtype
        self.device = _model_device(model)
        params = inspect.signature(model.forward).parameters
        self.keeps_positions = "logits_to_keep" in params
        self.row_positions = _accepts_row_positions()
        self.takes_use_cache = "use_cache" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())

    def run(self, members: Sequence[int], shape: tuple[int, int] | None,
            tally: _PaddingTally) -> dict[int, list[float]]:
        """Scores by row id of the ``members`` rows (none for a dummy step)."""
        rows = [self.rows[i] for i in members]
        lengths = [len(r.input_ids) for r in rows]
        n_rows, length = shape if shape is not None else (max(len(rows), 1), max(lengths, default=1))
        n_keep = max((r.scored_positions for r in rows), default=1)
        ids = torch.full((n_rows, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n_rows, length), dtype=torch.long)
        mask[len(rows):, 0] = 1  # dummy rows: one real token, so no row is fully masked
        positions = torch.zeros((n_rows, n_keep), dtype=torch.long)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            ids[i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
            mask[i, :n] = 1
            # the row's last n_keep real positions (clamped at 0; the clamped ones are never read)
            positions[i] = (torch.arange(n - n_keep, n)).clamp(min=0)
        tally.add(sum(lengths), n_rows, length)
        logits = self._kept_logits(ids.to(self.device), mask.to(self.device), positions.to(self.device))
        return {row.row_id: [continuation_logprob(logits[i], c, dtype=self.softmax_dtype)
                             for c in row.continuations] for i, row in enumerate(rows)}

    def _kept_logits(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[rows, n_keep, vocab]`` logits at ``positions`` of each row (projected only there when
        the model takes ``logits_to_keep``, transformers >= 5)."""
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if self.takes_use_cache:
            kwargs["use_cache"] = False
        if self.keeps_positions:
            if self.row_positions:
                logits = self.model(**kwargs, logits_to_keep=positions).logits
            else:  # one 1-D position list for the whole batch, then each row picks its own
                union, inverse = torch.unique(positions, return_inverse=True)
                logits = self.model(**kwargs, logits_to_keep=union).logits
                if logits.dim() == 3 and logits.shape[1] == union.numel():
                    logits = torch.take_along_dim(logits, inverse.unsqueeze(-1), dim=1)
            if tuple(logits.shape[:2]) != tuple(positions.shape):
                raise RuntimeError(f"model ignored logits_to_keep positions: logits {tuple(logits.shape)}, "
                                   f"positions {tuple(positions.shape)}")
            return logits
        logits = self.model(**kwargs).logits
        return torch.take_along_dim(logits, positions.unsqueeze(-1), dim=1)


def _accepts_row_positions() -> bool:
    """Whether transformers' models take a 2-D ``[rows, positions]`` ``logits_to_keep`` (its
    ``slice_logits_to_keep``, in recent 5.x). Earlier 5.x releases index ``hidden[:, positions]``,
    which only a 1-D tensor of positions gets right."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep  # noqa: F401
    except ImportError:
        return False
    return True


def _model_device(model: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _pad_token_id(tokenizer: Any, vocab_size: int | None) -> int:
    """Any valid id will do (right padding never reaches a real position); prefer the tokenizer's."""
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int) and 0 <= value < (vocab_size or value + 1):
            return value
    return 0


def _wants_uniform_shapes(model: Any) -> bool:
    """Megatron-core modules exchange fixed-shape buffers across ranks; transformers models with our
    EP experts and FSDP2 do not depend on the input shape."""
    return any(type(m).__module__.startswith("megatron.") for m in model.modules())


# --------------------------------------------------------------------------------------------------
# Coordination
# --------------------------------------------------------------------------------------------------


class _SingleRankCoordinator(Coordinator):
    """A data-parallel group of one rank: nothing to agree with (no process group is touched)."""

    def __init__(self, *, timeout_s: float, name: str) -> None:  # noqa: D107 - no super(): no group
        self.name, self.timeout = name, timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.active, self.group = 0, 1, False, None


def phase_coordinator(layout: ParallelLayout, *, timeout_s: float = 600.0, name: str = "mmlu") -> Coordinator:
    """The coordinator over ``layout``'s data-parallel group that closes each evaluation phase.

    It runs on a gloo group of its own whose default timeout is ``timeout_s``: the agreement's
    point-to-point sends and all-gathers must wait as long as its monitored barrier, or a rank that
    arrives early (its peers still stuck in a forward) would give up after the *model* group's
    shorter timeout and leave the others without an answer. Creating it is a collective over the
    whole world (every rank, every DP group at once); create it once and pass it to
    :func:`evaluate_mmlu` for repeated evaluations (:class:`~nemo_moe_export.evaluate.callback.
    MMLUCallback` does).
    """
    if layout.dp.size == 1 or layout.dp.group is None:
        return _SingleRankCoordinator(timeout_s=timeout_s, name=name)
    dp_groups: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(dp_groups, list(layout.dp.ranks))
    unique = sorted({tuple(g) for g in dp_groups})
    group, _ = dist.new_subgroups_by_enumeration([list(g) for g in unique], timeout=timedelta(seconds=timeout_s),
                                                 backend="gloo")
    return Coordinator(group, timeout_s=timeout_s, name=name)


def _all_gather(coordinator: Coordinator, obj: Any) -> list[Any]:
    """``obj`` of every rank of the coordinator's group, by group rank."""
    if not coordinator.active:
        return [obj]
    out: list[Any] = [None] * coordinator.world_size
    dist.all_gather_object(out, obj, group=coordinator.group)
    return out


def _agree(coordinator: Coordinator, step: str, error: BaseException | None, policy: str) -> None:
    """``coordinator.agree`` with a message that reads "mmlu step 3 of 12" on every rank."""
    try:
        coordinator.agree(step, error)
    except PeerError as exc:
        raise PeerError(f"MMLU evaluation ({policy}) failed at {coordinator.name} step {step}: {exc}",
                        step=exc.step, ranks=exc.ranks) from exc


class MMLUStepError(RuntimeError):
    """A forward of one evaluation step failed on this rank (wrapped to name the step)."""


# --------------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------------


@dataclass
class MMLUResult:
    """Everything one evaluation produced; identical on every rank of the data-parallel group.

    ``records[i]`` is the prediction for ``questions[i]`` (``scoring.question_record`` plus
    ``question_id``); ``metrics`` is :func:`~nemo_moe_export.evaluate.scoring.aggregate`'s output.
    """

    metrics: dict[str, Any]
    records: list[dict[str, Any]]
    policy: str
    layout: dict[str, Any]
    timing: dict[str, float]
    padding: dict[str, float]
    scoring: dict[str, Any]
    steps: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def predictions(self) -> list[str]:
        """Predicted letter per question, in question order."""
        return [r["pred"] for r in self.records]

    def flat_metrics(self, prefix: str = "mmlu") -> dict[str, float]:
        """Scalars for a training logger: overall / category accuracy, throughput, padding waste."""
        out = {f"{prefix}/acc": self.metrics["overall"]["acc"]}
        out.update({f"{prefix}/{cat}/acc": e["acc"] for cat, e in self.metrics["categories"].items()})
        out[f"{prefix}/questions_per_s"] = self.timing["questions_per_s"]
        out[f"{prefix}/padding_waste"] = self.padding["waste"]
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _layout_summary(layout: ParallelLayout) -> dict[str, Any]:
    return {"source": layout.source,
            **{k: {"rank": g.rank, "size": g.size, "ranks": list(g.ranks)}
               for k, g in (("dp", layout.dp), ("ep", layout.ep), ("edp", layout.edp))}}


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def evaluate_mmlu(
    model: Any,
    tokenizer: Any,
    questions: Sequence[Question] | PreparedQuestions,
    dev: Sequence[Question] = (),
    layout: ParallelLayout | None = None,
    *,
    k_shot: int = 5,
    batch_size: int = 8,
    policy: str = "lockstep",
    scoring: str = "auto",
    uniform_shapes: bool | None = None,
    max_length: int | None = None,
    timeout_s: float = 600.0,
    coordinator: Coordinator | None = None,
    softmax_dtype: torch.dtype | None = None,
    progress: bool = True,
    name: str = "mmlu",
) -> MMLUResult:
    """Evaluate ``model`` on MMLU ``questions`` with ``k_shot`` examples from ``dev``, on every rank.

    ``model`` is called transformers-style (``model(input_ids=, attention_mask=, use_cache=False,
    logits_to_keep=) -> .logits``) and may be plain, FSDP2-sharded (``fully_shard``) or
    expert-parallel (:func:`~nemo_moe_export.expert_parallel.apply_expert_parallel`); every rank of ``layout.dp``
    (default :func:`~nemo_moe_export.parallel.discover_layout`) must call this with the same
    questions. ``questions`` may be a :class:`PreparedQuestions` from :func:`prepare_questions`
    (then ``dev``/``k_shot``/``scoring``/``max_length`` are already applied) to tokenize once for
    many evaluations. Returns the same :class:`MMLUResult` on every rank; predictions equal a
    single-process run's whatever the layout and policy (see the module docstring for the
    policies, padding and timeouts). Raises ``ExportInputError`` on bad input before any collective
    and ``PeerError`` on every rank when any rank fails or stalls.
    """
    started = time.perf_counter()
    layout = layout if layout is not None else discover_layout()
    _check_choice("policy", policy, POLICIES)
    if isinstance(questions, PreparedQuestions):
        prepared = questions
    else:
        prepared = prepare_questions(
            tokenizer, questions, dev, k_shot=k_shot, scoring=scoring,
            max_length=max_length or default_max_length(model, tokenizer),
            vocab_size=getattr(getattr(model, "config", None), "vocab_size", None))
    if uniform_shapes is None:
        uniform_shapes = _wants_uniform_shapes(model)
    batches = plan_batches(prepared.rows, batch_size)
    plan = plan_steps(batches, policy, layout, uniform_shapes=uniform_shapes)
    prepared_at = time.perf_counter()

    # --- first collective: everyone prepared the same plan ---------------------------------------
    coordinator = coordinator or phase_coordinator(layout, timeout_s=timeout_s, name=name)
    _agree(coordinator, "prepare", None, policy)
    _require_same_plan(coordinator, _plan_fingerprint(prepared, batches, plan))

    # --- forward steps ------------------------------------------------------------------------
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    runner = _ForwardRunner(model, prepared.rows, _pad_token_id(tokenizer, vocab_size), softmax_dtype)
    tally = _PaddingTally()
    scores: dict[int, list[float]] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _Progress(plan.n_steps, name, enabled=progress and _is_global_rank0()) as bar:
            for s, batch_id in enumerate(plan.batch_of_step):
                label = f"{s + 1} of {plan.n_steps}"
                error = None
                try:
                    members = () if batch_id is None else batches[batch_id].rows
                    scores.update(runner.run(members, plan.shapes[s] if plan.shapes else None, tally))
                except Exception as exc:  # reported to every rank by the agreement below
                    error = MMLUStepError(f"{name} step {label} ({policy}): {type(exc).__name__}: {exc}")
                    error.__cause__ = exc
                _agree(coordinator, label, error, policy)
                bar(1)
    finally:
        model.train(was_training)
    forward_done = time.perf_counter()

    # --- gather (after an agreement, so a rank still stuck in a step is reported, not mismatched) --
    _agree(coordinator, "gather", None, policy)
    gathered = _all_gather(coordinator, (scores, tally.real_tokens, tally.fed_tokens))
    all_scores: dict[int, list[float]] = {}
    for rank_scores, _, _ in gathered:
        all_scores.update(rank_scores)
    per_question = _assemble(prepared, all_scores)
    records = [{"question_id": i, **question_record(q, s)}
               for i, (q, s) in enumerate(zip(prepared.questions, per_question))]
    metrics = aggregate((r["subject"], r["correct"]) for r in records)
    finished = time.perf_counter()

    real = sum(g[1] for g in gathered)
    fed = sum(g[2] for g in gathered)
    n_q = len(prepared.questions)
    return MMLUResult(
        metrics=metrics,
        records=records,
        policy=policy,
        layout=_layout_summary(layout),
        timing={"prepare_s": prepared_at - started, "forward_s": forward_done - prepared_at,
                "total_s": finished - started, "questions_per_s": n_q / max(finished - prepared_at, 1e-9)},
        padding={"real_tokens": real, "fed_tokens": fed, "padded_tokens": fed - real,
                 "waste": (fed - real) / fed if fed else 0.0},
        scoring={"k_shot": prepared.k_shot, "max_length": prepared.max_length,
                 "single_token_questions": prepared.single_token_questions,
                 "full_questions": prepared.full_questions,
                 "truncated_questions": prepared.truncated_questions, "rows": len(prepared.rows),
                 "batch_size": batch_size, "batches": len(batches), "uniform_shapes": bool(uniform_shapes)},
        steps=plan.n_steps,
    )


def _require_same_plan(coordinator: Coordinator, fingerprint: str) -> None:
    """Ranks that read different data would run different step counts: refuse on every rank."""
    prints = _all_gather(coordinator, fingerprint)
    if len(set(prints)) > 1:
        by_print: dict[str, list[int]] = {}
        for r, p in enumerate(prints):
            by_print.setdefault(p, []).append(coordinator.global_rank(r))
        raise ExportInputError(
            "ranks built different MMLU batch plans (different questions, tokenizer or settings)",
            key="questions", expected="the same data and settings on every rank",
            actual="; ".join(f"ranks {rs}: plan {p}" for p, rs in by_print.items()),
        )


def _assemble(prepared: PreparedQuestions, row_scores: dict[int, list[float]]) -> list[list[float]]:
    """Four scores per question from its rows; a missing row is a bug, never a silent zero."""
    per_question: list[list[float | None]] = [[None] * 4 for _ in prepared.questions]
    for row in prepared.rows:
        if row.row_id not in row_scores:
            raise RuntimeError(f"MMLU: no score for row {row.row_id} (question {row.question}); plan bug")
        for choice, score in zip(row.choices, row_scores[row.row_id], strict=True):
            per_question[row.question][choice] = score
    return per_question  # type: ignore[return-value]


def _is_global_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class _Progress:
    """Progress over steps on rank 0: tqdm when importable, else a plain line every ~10%."""

    def __init__(self, total: int, name: str, *, enabled: bool) -> None:
        self.total, self.name, self.enabled, self.done, self.bar = total, name, enabled, 0, None
        self._next_line = 0

    def __enter__(self) -> Callable[[int], None]:
        if self.enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.total, desc=self.name, unit="step", leave=False, file=sys.stderr)
            except ImportError:
                self.bar = None
        return self.update

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
        elif self.done >= self._next_line or self.done == self.total:
            print(f"{self.name}: step {self.done}/{self.total}", file=sys.stderr, flush=True)
            self._next_line = self.done + max(1, self.total // 10)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()
