"""Step 4 of an evaluation, the *result*: per-row scores of every rank become per-question records.

Everything here is local and deterministic: every rank assembles the same :class:`MMLUResult`
from the same gathered scores, so every rank returns the same metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nemo_moe_export.evaluate.batching import Batch
from nemo_moe_export.evaluate.prefixes import SharedPrefix
from nemo_moe_export.evaluate.prepare import PreparedQuestions
from nemo_moe_export.evaluate.runner import PaddingTally
from nemo_moe_export.evaluate.scoring import question_record
from nemo_moe_export.parallel import ParallelLayout

__all__ = [
    "MMLUResult",
    "layout_summary",
    "padding_summary",
    "question_scores",
    "score_records",
    "scoring_summary",
    "timing_summary",
]


@dataclass
class MMLUResult:
    """Everything one evaluation produced; identical on every rank of the data-parallel group.

    ``records[i]`` is the prediction for ``questions[i]`` (``scoring.question_record`` plus
    ``question_id``); ``metrics`` is :func:`~nemo_moe_export.evaluate.scoring.aggregate`'s output;
    ``task`` the evaluated task's name (the prefix of its flat metrics and result files).
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
    task: str = "mmlu"

    @property
    def predictions(self) -> list[str]:
        """Predicted letter per question, in question order."""
        return [r["pred"] for r in self.records]

    def flat_metrics(self, prefix: str | None = None) -> dict[str, float]:
        """Scalars for a training logger, named ``<task>/...`` unless ``prefix`` says otherwise:
        overall / category accuracy (and ``acc_norm`` where measured), throughput, padding waste."""
        prefix = self.task if prefix is None else prefix
        out = {f"{prefix}/{m}": v for m, v in _accuracies(self.metrics["overall"])}
        out.update({f"{prefix}/{cat}/{m}": v for cat, e in self.metrics["categories"].items()
                    for m, v in _accuracies(e)})
        out[f"{prefix}/questions_per_s"] = self.timing["questions_per_s"]
        out[f"{prefix}/padding_waste"] = self.padding["waste"]
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _accuracies(entry: dict[str, Any]) -> list[tuple[str, float]]:
    return [(m, entry[m]) for m in ("acc", "acc_norm") if m in entry]


def question_scores(prepared: PreparedQuestions, row_scores: dict[int, list[float]]) -> list[list[float]]:
    """One score per choice of each question from its rows; a missing row is a bug, never a silent zero."""
    n_choices = [0] * len(prepared.questions)
    for row in prepared.rows:
        n_choices[row.question] += len(row.choices)
    per_question: list[list[float | None]] = [[None] * n for n in n_choices]
    for row in prepared.rows:
        if row.row_id not in row_scores:
            raise RuntimeError(f"MMLU: no score for row {row.row_id} (question {row.question}); plan bug")
        for choice, score in zip(row.choices, row_scores[row.row_id], strict=True):
            per_question[row.question][choice] = score
    return per_question  # type: ignore[return-value]


def score_records(prepared: PreparedQuestions, row_scores: dict[int, list[float]]) -> list[dict[str, Any]]:
    """One record per question, in question order: its scores, prediction and correctness."""
    return [{"question_id": i, **question_record(q, s, prepared.task)}
            for i, (q, s) in enumerate(zip(prepared.questions, question_scores(prepared, row_scores)))]


def layout_summary(layout: ParallelLayout) -> dict[str, Any]:
    """Where the groups came from and this rank's place in each (picklable, JSON-ready); the
    pipeline, tensor and context groups only where they have more than one rank."""
    groups = [("dp", layout.dp), ("ep", layout.ep), ("edp", layout.edp), *layout.model_parallel_groups().items()]
    return {"source": layout.source,
            **{k: {"rank": g.rank, "size": g.size, "ranks": list(g.ranks)} for k, g in groups}}


def padding_summary(tallies: Iterable[PaddingTally]) -> dict[str, float]:
    """Tokens fed over all ranks; ``waste`` = padded / fed (dummy forwards included);
    ``attended_tokens`` adds the cached prefix each suffix row attends."""
    tallies = list(tallies)
    real = sum(t.real_tokens for t in tallies)
    fed = sum(t.fed_tokens for t in tallies)
    return {"real_tokens": real, "fed_tokens": fed, "padded_tokens": fed - real,
            "waste": (fed - real) / fed if fed else 0.0,
            "attended_tokens": sum(t.attended_tokens for t in tallies),
            "forwards": sum(t.forwards for t in tallies), "prefix_forwards": sum(t.prefix_forwards for t in tallies)}


def timing_summary(started: float, prepared_at: float, forwards_done: float, finished: float,
                   n_questions: int) -> dict[str, float]:
    """Seconds per phase (``perf_counter`` marks); throughput counts everything after preparing."""
    return {"prepare_s": prepared_at - started, "forward_s": forwards_done - prepared_at,
            "total_s": finished - started, "questions_per_s": n_questions / max(finished - prepared_at, 1e-9)}


def scoring_summary(prepared: PreparedQuestions, *, batch_size: int, batches: Sequence[Batch],
                    uniform_shapes: bool, tokens_per_batch: int,
                    prefixes: Sequence[SharedPrefix], prefix_attention: str | None = None,
                    prefix_status: str | None = None) -> dict[str, Any]:
    """How the questions were scored and batched (``tokens_per_batch`` as resolved: 0 = fixed
    batches of ``batch_size`` rows; ``prefix_attention``: how suffixes attended to their shared
    prefix, ``"packed"`` or ``"copied"``, None without shared prefixes; ``prefix_status`` (reported
    as ``shared_prefix``): ``"on"``
    or ``"off: <why>"``, e.g. pipeline stages, which keep no KV cache)."""
    shared_rows = sum(len(p.rows) for p in prefixes)
    return {"k_shot": prepared.k_shot, "max_length": prepared.max_length,
            "single_token_questions": prepared.single_token_questions,
            "full_questions": prepared.full_questions,
            "truncated_questions": prepared.truncated_questions, "rows": len(prepared.rows),
            "batch_size": batch_size, "tokens_per_batch": tokens_per_batch, "batches": len(batches),
            "prefix_batches": sum(b.kind == "prefix" for b in batches), "shared_prefixes": len(prefixes),
            "shared_prefix_rows": shared_rows, "prefix_attention": prefix_attention, "shared_prefix": prefix_status,
            "uniform_shapes": bool(uniform_shapes)}
