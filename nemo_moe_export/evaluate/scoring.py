"""Turn per-choice log-likelihoods into MMLU accuracy, the way lm-eval reports it.

* A choice's score is the sum over its continuation tokens of ``log_softmax`` over the whole
  vocabulary (``HFLM._loglikelihood_tokens``), see :func:`continuation_logprob`.
* The prediction is ``np.argmax`` of the four scores (``ConfigurableTask.process_results``), so ties
  go to the first choice, see :func:`predict`.
* ``acc`` per subject is the mean; categories and the overall number weight subjects by their size
  (``weight_by_size: True`` in ``_mmlu*.yaml``), i.e. they are micro averages over questions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.evaluate.data import CATEGORIES, LETTERS, Question, category_of

__all__ = [
    "aggregate",
    "batch_continuation_logprobs",
    "continuation_logprob",
    "predict",
    "question_record",
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
        raise ExportInputError("logits must be [seq, vocab]", key="logits", expected="2 dims",
                               actual=tuple(logits.shape))
    seq = logits.shape[0] if input_length is None else input_length
    n = len(continuation)
    if not 0 < n <= seq <= logits.shape[0]:
        raise ExportInputError(
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
    ``continuations[i]`` are row ``i``'s continuations (four single tokens, or one multi-token
    continuation), each scored from the last ``len(continuation)`` of those positions. Returns
    ``[rows, 4]`` (NaN where a row has fewer choices). The sum over a continuation's tokens is
    taken in float32 and rounded to the log-softmax dtype once, as ``torch.sum`` does, so values
    equal :func:`continuation_logprob`'s.
    """
    rows, n_keep, _ = logits.shape
    index: list[tuple[int, int, int, int]] = []  # (row, position, token, output slot)
    for i, choices in enumerate(continuations):
        for j, continuation in enumerate(choices):
            if not 0 < len(continuation) <= n_keep:
                raise ExportInputError("continuation does not fit the kept logits", key="continuation",
                                       expected=f"1..{n_keep} tokens", actual=f"{len(continuation)} tokens")
            index += [(i, n_keep - len(continuation) + t, tok, 4 * i + j) for t, tok in enumerate(continuation)]
    row, position, token, slot = torch.tensor(index, dtype=torch.long).T.to(logits.device)
    logprobs = torch.log_softmax(logits, dim=-1, dtype=dtype)
    picked = logprobs[row, position, token].float()
    sums = torch.zeros(4 * rows, dtype=torch.float32, device=logits.device).index_add_(0, slot, picked)
    present = torch.zeros(4 * rows, dtype=torch.bool, device=logits.device).index_fill_(0, slot, True)
    return sums.to(logprobs.dtype).float().masked_fill(~present, float("nan")).view(rows, 4)


def predict(scores: Sequence[float]) -> int:
    """Index of the best score; the first wins a tie (``np.argmax``). NaN is refused: it means a
    broken forward, and argmax would silently pick it."""
    values = [float(s) for s in scores]
    if not values or any(math.isnan(v) for v in values):
        raise ExportInputError("bad choice scores", key="scores", expected="non-empty, no NaN",
                               actual=values)
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def question_record(q: Question, scores: Sequence[float]) -> dict[str, Any]:
    """JSON-serialisable per-question result (for a samples file)."""
    pred = predict(scores)
    return {
        "subject": q.subject,
        "split": q.split,
        "index": q.index,
        "scores": [float(s) for s in scores],
        "pred": LETTERS[pred],
        "gold": LETTERS[q.answer],
        "correct": pred == q.answer,
    }


def _acc_entry(correct: int, n: int) -> dict[str, Any]:
    return {"acc": correct / n, "correct": correct, "n": n}


def aggregate(outcomes: Iterable[tuple[str, bool]]) -> dict[str, Any]:
    """Per-subject, per-category and overall accuracy from ``(subject, correct)`` pairs.

    Categories and overall are micro averages (total correct / total questions), equal to lm-eval's
    size-weighted mean of subject accuracies. Only categories with questions appear. Subjects outside
    the 57 count as ``other`` (:func:`~nemo_moe_export.evaluate.data.category_of`).
    """
    subjects: dict[str, list[int]] = {}
    for subject, correct in outcomes:
        tally = subjects.setdefault(subject, [0, 0])
        tally[0] += int(bool(correct))
        tally[1] += 1
    if not subjects:
        raise ExportInputError("no results to aggregate", key="outcomes", expected=">= 1", actual=0)
    cats: dict[str, list[int]] = {}
    for subject, (c, n) in subjects.items():
        tally = cats.setdefault(category_of(subject), [0, 0, 0])
        tally[0] += c
        tally[1] += n
        tally[2] += 1
    total_c = sum(c for c, _ in subjects.values())
    total_n = sum(n for _, n in subjects.values())
    return {
        "subjects": {
            s: {**_acc_entry(c, n), "category": category_of(s)} for s, (c, n) in sorted(subjects.items())
        },
        "categories": {
            cat: {**_acc_entry(cats[cat][0], cats[cat][1]), "subjects": cats[cat][2]}
            for cat in CATEGORIES
            if cat in cats
        },
        "overall": {**_acc_entry(total_c, total_n), "subjects": len(subjects)},
    }


def results_to_markdown(results: dict[str, Any]) -> str:
    """A markdown table: overall, then categories, then subjects (accuracy in percent)."""
    lines = ["| group | acc (%) | correct | n |", "|---|---:|---:|---:|"]

    def row(name: str, e: dict[str, Any]) -> str:
        return f"| {name} | {100 * e['acc']:.2f} | {e['correct']} | {e['n']} |"

    lines.append(row("**mmlu**", results["overall"]))
    lines += [row(f"- {cat}", e) for cat, e in results["categories"].items()]
    lines += [row(f"  - {s}", e) for s, e in results["subjects"].items()]
    return "\n".join(lines) + "\n"
