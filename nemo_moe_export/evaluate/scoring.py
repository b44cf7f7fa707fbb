"""Turn per-choice log-likelihoods into a task's accuracy, the way lm-eval reports it.

* A choice's score is the sum over its continuation tokens of ``log_softmax`` over the whole
  vocabulary (``HFLM._loglikelihood_tokens``), see :func:`continuation_logprob`.
* The prediction is ``np.argmax`` of the scores (``ConfigurableTask.process_results``), so ties
  go to the first choice, see :func:`predict`; ``acc_norm``'s is the argmax of each score divided
  by its choice's length in characters (``completion_len`` there), for tasks that list it.
* ``acc`` per group (MMLU: subject) is the mean; categories and the overall number weight groups by
  their size (``weight_by_size: True`` in ``_mmlu*.yaml``), i.e. they are micro averages over
  questions (docs/design.md#evaluation-tasks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.data import Question
from nemo_moe_export.evaluate.task import Task, load_task

__all__ = [
    "aggregate",
    "batch_continuation_logprobs",
    "continuation_logprob",
    "predict",
    "question_record",
    "record_outcomes",
    "results_to_markdown",
]


def continuation_logprob(
    logits: torch.Tensor,
    continuation: Sequence[int],
    *,
    input_length: int | None = None,
    dtype: torch.dtype | None = None,
) -> float:
    """Summed log-probability of ``continuation`` from the logits of one model input.

    ``logits`` is ``[seq, vocab]`` for the input built by
    :func:`~nemo_moe_export.evaluate.prompts.truncate_left`; positions ``input_length - n ..
    input_length - 1`` predict the ``n`` continuation tokens (``input_length`` defaults to ``seq``;
    pass it when the row is right-padded). ``dtype`` is lm-eval's ``softmax_dtype``: None keeps the
    logits' dtype as lm-eval does by default; ``torch.float32`` avoids bf16 ties.
    """
    if logits.dim() != 2:
        raise InputError("logits must be [seq, vocab]", key="logits", expected="2 dims",
                         actual=tuple(logits.shape))
    seq = logits.shape[0] if input_length is None else input_length
    n = len(continuation)
    if not 0 < n <= seq <= logits.shape[0]:
        raise InputError(
            "continuation does not fit the logits", key="continuation",
            expected=f"1 <= {n} tokens <= input_length {seq} <= {logits.shape[0]} rows",
            actual=f"{n} tokens",
        )
    logprobs = torch.log_softmax(logits[seq - n : seq], dim=-1, dtype=dtype)
    target = torch.as_tensor(list(continuation), dtype=torch.long, device=logits.device)
    return float(logprobs.gather(1, target.unsqueeze(1)).sum())


def batch_continuation_logprobs(
    logits: torch.Tensor,
    continuations: Sequence[Sequence[Sequence[int]]],
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`continuation_logprob` of every row and choice of a batch at once, left on the device.

    ``logits`` is ``[rows, n_keep, vocab]``, each row's last ``n_keep`` input positions;
    ``continuations[i]`` are row ``i``'s continuations (one single token per choice, or one
    multi-token continuation), each scored from the last ``len(continuation)`` of those positions.
    Returns ``[rows, max(4, most choices of a row)]`` (NaN where a row has fewer choices). The sum
    over a continuation's tokens is taken in float32 and rounded to the log-softmax dtype once, as
    ``torch.sum`` does, so values equal :func:`continuation_logprob`'s.
    """
    rows, n_keep, _ = logits.shape
    width = max(4, *(len(choices) for choices in continuations))  # MMLU's 4 columns, more for more choices
    index: list[tuple[int, int, int, int]] = []  # (row, position, token, output slot)
    for i, choices in enumerate(continuations):
        for j, continuation in enumerate(choices):
            if not 0 < len(continuation) <= n_keep:
                raise InputError("continuation does not fit the kept logits", key="continuation",
                                 expected=f"1..{n_keep} tokens", actual=f"{len(continuation)} tokens")
            index += [(i, n_keep - len(continuation) + t, tok, width * i + j) for t, tok in enumerate(continuation)]
    row, position, token, slot = torch.tensor(index, dtype=torch.long).T.to(logits.device)
    logprobs = torch.log_softmax(logits, dim=-1, dtype=dtype)
    picked = logprobs[row, position, token].float()
    sums = torch.zeros(width * rows, dtype=torch.float32, device=logits.device).index_add_(0, slot, picked)
    present = torch.zeros(width * rows, dtype=torch.bool, device=logits.device).index_fill_(0, slot, True)
    return sums.to(logprobs.dtype).float().masked_fill(~present, float("nan")).view(rows, width)


def predict(scores: Sequence[float]) -> int:
    """Index of the best score; the first wins a tie (``np.argmax``). NaN is refused: it means a
    broken forward, and argmax would silently pick it."""
    values = [float(s) for s in scores]
    if not values or any(math.isnan(v) for v in values):
        raise InputError("bad choice scores", key="scores", expected="non-empty, no NaN",
                         actual=values)
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def question_record(q: Question, scores: Sequence[float], task: Task | str = "mmlu") -> dict[str, Any]:
    """JSON-serialisable per-question result (for a samples file): the predicted and gold choice as
    the task names them (MMLU: the letters), with ``pred_norm`` / ``correct_norm`` when the task
    lists ``acc_norm``."""
    task = load_task(task)
    choices = task.choices(q)
    if len(scores) != len(choices):
        raise InputError("one score per choice", key=f"{q.subject}[{q.index}]", expected=len(choices),
                         actual=len(scores))
    pred = predict(scores)
    record = {
        "subject": q.subject,
        "split": q.split,
        "index": q.index,
        "scores": [float(s) for s in scores],
        "pred": choices[pred],
        "gold": choices[q.answer],
        "correct": pred == q.answer,
    }
    if "acc_norm" in task.metrics:  # lm-eval: np.argmax(lls / completion_len), lengths in characters
        pred_norm = predict([float(s) / len(c) for s, c in zip(scores, choices)])
        record |= {"pred_norm": choices[pred_norm], "correct_norm": pred_norm == q.answer}
    return record


def record_outcomes(records: Iterable[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """``(group, correct[, correct_norm])`` of each record, what :func:`aggregate` takes."""
    return [(r["subject"], r["correct"], *((r["correct_norm"],) if "correct_norm" in r else ())) for r in records]


def _acc_entry(correct: int, n: int, correct_norm: int | None = None) -> dict[str, Any]:
    entry = {"acc": correct / n, "correct": correct, "n": n}
    if correct_norm is not None:
        entry |= {"acc_norm": correct_norm / n, "correct_norm": correct_norm}
    return entry


def aggregate(outcomes: Iterable[tuple[Any, ...]], task: Task | str = "mmlu") -> dict[str, Any]:
    """Per-group, per-category and overall accuracy from ``(group, correct)`` pairs, or
    ``(group, correct, correct_norm)`` triples (then ``acc_norm`` too).

    Categories and overall are micro averages (total correct / total questions), equal to lm-eval's
    size-weighted mean of group accuracies. Only categories with questions appear, in the task's
    order. For MMLU the groups are subjects and a subject outside the 57 counts as ``other``
    (:meth:`Task.category_of <nemo_moe_export.evaluate.task.Task.category_of>`); a task without
    categories has none.
    """
    task = load_task(task)
    tallies: dict[str, list[int]] = {}  # group -> [correct, n, correct_norm]
    normed = None
    for subject, correct, *norm in outcomes:
        tally = tallies.setdefault(subject, [0, 0, 0])
        tally[0] += int(bool(correct))
        tally[1] += 1
        tally[2] += int(bool(norm and norm[0]))
        normed = bool(norm) if normed is None else normed and bool(norm)
    if not tallies:
        raise InputError("no results to aggregate", key="outcomes", expected=">= 1", actual=0)

    def entry(c: int, n: int, cn: int) -> dict[str, Any]:
        return _acc_entry(c, n, cn if normed else None)

    cats: dict[str, list[int]] = {}
    for subject, (c, n, cn) in tallies.items():
        category = task.category_of(subject)
        if category is not None:
            tally = cats.setdefault(category, [0, 0, 0, 0])
            for i, v in enumerate((c, n, cn, 1)):
                tally[i] += v
    order = [*task.categories, *([task.other_category] if task.other_category not in task.categories else [])]
    total = [sum(t[i] for t in tallies.values()) for i in range(3)]
    return {
        "subjects": {
            s: {**entry(*t), **({} if task.category_of(s) is None else {"category": task.category_of(s)})}
            for s, t in sorted(tallies.items())
        },
        "categories": {cat: {**entry(*cats[cat][:3]), "subjects": cats[cat][3]} for cat in order if cat in cats},
        "overall": {**entry(*total), "subjects": len(tallies)},
    }


def results_to_markdown(results: dict[str, Any], task: Task | str = "mmlu") -> str:
    """A markdown table: overall, then categories, then groups (accuracy in percent; ``acc_norm``
    beside it when measured)."""
    normed = "acc_norm" in results["overall"]
    lines = (["| group | acc (%) | acc_norm (%) | correct | n |", "|---|---:|---:|---:|---:|"] if normed
             else ["| group | acc (%) | correct | n |", "|---|---:|---:|---:|"])

    def row(name: str, e: dict[str, Any]) -> str:
        norm = f" {100 * e['acc_norm']:.2f} |" if normed else ""
        return f"| {name} | {100 * e['acc']:.2f} |{norm} {e['correct']} | {e['n']} |"

    lines.append(row(f"**{load_task(task).name}**", results["overall"]))
    lines += [row(f"- {cat}", e) for cat, e in results["categories"].items()]
    lines += [row(f"  - {s}", e) for s, e in results["subjects"].items()]
    return "\n".join(lines) + "\n"
