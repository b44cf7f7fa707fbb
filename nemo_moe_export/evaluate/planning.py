"""Step 2 of an evaluation, *plan*: length-sorted batches, and which batch each rank runs at each step.

No communication happens here: every rank computes the same global plan from the same prepared
rows and derives its own steps from it, so all ranks agree on the step count without asking each
other. Rows are sorted by length (longest first, as lm-eval does, so an out-of-memory shows on
the first batch) and cut into batches of ``batch_size``. :func:`plan_fingerprint` digests the
plan so the driver can compare it across ranks once (docs/design.md#coordination-protocol).

Sharding policies (:data:`~nemo_moe_export.evaluate.options.POLICIES`; docs/design.md#mmlu-definition)
---------------------------------------------------------------------------------------------------
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
is needed. ``uniform_shapes=None`` detects it
(:func:`~nemo_moe_export.evaluate.runner.wants_uniform_shapes`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.evaluate.options import POLICIES
from nemo_moe_export.evaluate.prepare import PreparedQuestions, Row
from nemo_moe_export.options import require
from nemo_moe_export.parallel import ParallelLayout

__all__ = ["Batch", "StepPlan", "plan_batches", "plan_fingerprint", "plan_steps"]


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
               uniform_shapes: bool | None = None) -> StepPlan:
    """This rank's steps under ``policy``; every rank derives its own from the same global plan.

    Batches go round-robin over the shards (rank ``r`` of ``S`` takes ``r, r + S, ...``), so each
    step holds ``S`` consecutive batches of the length-sorted order: similar shapes, little waiting.
    ``lockstep`` shards over the DP group, ``expert_dp`` over the expert-DP group (EP peers share a
    shard index, hence identical batches); both run ``ceil(n / S)`` steps everywhere. ``naive``
    shards over the DP group and runs only its own batches (uneven step counts: unsafe).
    ``uniform_shapes``: plan one padded shape per step for every rank. The driver resolves the
    option's ``None`` ("detect from the model") before planning; here, with no model, ``None``
    plans each batch at its own shape.
    """
    require(policy in POLICIES, "MMLU option", "policy", f"one of {list(POLICIES)}", policy)
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


def plan_fingerprint(prepared: PreparedQuestions, batches: Sequence[Batch], plan: StepPlan) -> str:
    """Equal on all ranks iff they tokenized the same rows into the same global batches and steps."""
    h = hashlib.sha256()
    h.update(repr((plan.policy, plan.shard_size, plan.n_steps if plan.policy != "naive" else None,
                   prepared.max_length, prepared.k_shot)).encode())
    for row in prepared.rows:
        h.update(repr((row.question, row.choices, row.continuations, row.input_ids)).encode())
    h.update(repr([b.rows for b in batches]).encode())
    return h.hexdigest()[:16]
