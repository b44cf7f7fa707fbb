"""Step 1 of an evaluation, *prepare*: every question's lm-eval requests, tokenized into model rows.

No communication happens here, and every rank computes the same rows from the same questions, so
bad input (too few dev examples, a k the task cannot sample, a tokenizer that splits the answer
letters when single-token scoring is required, token ids outside the model's vocabulary) raises
:class:`~nemo_moe_export.errors.InputError` identically on every rank before any collective
has started. The requests are the task's (:class:`~nemo_moe_export.evaluate.task.Task`: its
prompt and one continuation per choice; MMLU by default), tokenized as lm-eval does
(:mod:`.prompts`; docs/design.md#evaluation-tasks).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.data import Question, group_by_subject, require_dev_examples
from nemo_moe_export.evaluate.options import SCORING_MODES, MMLUOptions
from nemo_moe_export.evaluate.prompts import (
    EncodedRequest,
    encode_request,
    multi_token_answers,
    select_fewshot,
    single_token_answer_ids,
    truncate_left,
)
from nemo_moe_export.evaluate.task import Task, load_task
from nemo_moe_export.options import require

__all__ = ["PreparedQuestions", "Row", "default_max_length", "model_vocab_size", "prepare_questions"]

logger = logging.getLogger(__name__)

_HF_UNSET_MAX_LENGTH = 1000000000000000019884624838656  # transformers' "no limit" model_max_length
_HFLM_FALLBACK_MAX_LENGTH = 2048  # lm-eval's HFLM when neither the model nor the tokenizer says


@dataclass(frozen=True)
class Row:
    """One model input and the answers it scores.

    A single-token row scores every choice from the logits at its last position; a full row
    scores one choice's continuation from its last ``len(continuation)`` positions (one lm-eval
    loglikelihood request each).
    """

    row_id: int
    question: int  # position of the question in the evaluated list
    choices: tuple[int, ...]  # which of the question's choices (A..D for MMLU) this row scores
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
    task: Task | str = MMLUOptions.task  # what the questions are; a name or path is read into its Task

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", load_task(self.task))

    @cached_property
    def digest(self) -> str:
        """A digest of every row (what is fed and scored), computed once for repeated evaluations."""
        h = hashlib.sha256(repr((self.max_length, self.k_shot)).encode())
        for row in self.rows:
            h.update(repr((row.question, row.choices, row.continuations, row.input_ids)).encode())
        return h.hexdigest()


def default_max_length(model: Any, tokenizer: Any) -> int:
    """``HFLM.max_length``: the config's context size, else the tokenizer's, else 2048.

    ``model`` may be None (only the tokenizer is asked then)."""
    config = getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value != _HF_UNSET_MAX_LENGTH:
        return value
    return _HFLM_FALLBACK_MAX_LENGTH


def model_vocab_size(model: Any) -> int | None:
    """The vocabulary size of a transformers-style ``model.config``, or None when it has none."""
    return getattr(getattr(model, "config", None), "vocab_size", None)


def prepare_questions(
    tokenizer: Any,
    questions: Sequence[Question],
    dev: Sequence[Question],
    *,
    k_shot: int = MMLUOptions.k_shot,
    max_length: int | None = MMLUOptions.max_length,
    scoring: str = MMLUOptions.scoring,
    vocab_size: int | None = None,
    task: Task | str = MMLUOptions.task,
) -> PreparedQuestions:
    """Build and tokenize every question's lm-eval requests; refuse bad input before any collective.

    ``task`` (a :class:`~nemo_moe_export.evaluate.task.Task`, a packaged task's name or a task
    YAML's path) builds each question's prompt and continuations, ``k_shot`` examples from ``dev``.
    ``scoring``: ``"auto"`` uses the single-token path for a question when its continuations
    (MMLU: " A".." D") are one distinct token each and full continuation log-likelihood otherwise;
    ``"single_token"`` requires the single-token path (a tokenizer that splits the answer letters
    is an error); ``"full"`` always scores full continuations (one row per choice). ``max_length=None``
    takes :func:`default_max_length` from the tokenizer alone (pass the model's, as
    :func:`~nemo_moe_export.evaluate.evaluator.evaluate_mmlu` does, when the model has one).
    ``vocab_size``: when given, every token id must be below it.
    """
    require(scoring in SCORING_MODES, "MMLU option", "scoring", f"one of {list(SCORING_MODES)}", scoring)
    task = load_task(task)
    task.require_fewshot(k_shot)
    if not questions:
        raise InputError("no MMLU questions to evaluate", key="questions", expected=">= 1", actual=0)
    require_dev_examples(dev, sorted({q.subject for q in questions}), k_shot, pool_split=task.fewshot_split or "dev")
    max_length = max_length or default_max_length(None, tokenizer)
    requests = _encode_requests(tokenizer, task, questions, dev, k_shot)
    answer_ids = [None if scoring == "full" else single_token_answer_ids(r) for r in requests]
    if scoring == "single_token":
        _require_single_token_answers(task, questions, requests, answer_ids)
    rows = _build_rows(requests, answer_ids, max_length)
    if vocab_size is not None:
        _check_token_ids(rows, vocab_size)
    truncated = len({r.question for r in rows if r.truncated})
    if truncated:
        logger.warning("%s: %d of %d prompts longer than max_length=%d were cut from the left (as lm-eval does)",
                       task.display_name, truncated, len(questions), max_length)
    single = sum(ids is not None for ids in answer_ids)
    return PreparedQuestions(tuple(questions), tuple(rows), max_length, k_shot, single, len(questions) - single,
                             truncated, task)


def _encode_requests(tokenizer: Any, task: Task, questions: Sequence[Question], dev: Sequence[Question],
                     k_shot: int) -> list[EncodedRequest]:
    """Each question's k-shot prompt (the first ``k_shot`` examples of its group in ``dev``) against
    each of its continuations, encoded."""
    pools = group_by_subject(dev)
    return [encode_request(tokenizer, task.context(q, select_fewshot(pools.get(q.subject, []), k_shot, q)),
                           task.continuations(q))
            for q in questions]


def _require_single_token_answers(task: Task, questions: Sequence[Question], requests: Sequence[EncodedRequest],
                                  answer_ids: Sequence[tuple[int, ...] | None]) -> None:
    split = [f"{q.subject}[{q.index}]: {multi_token_answers(r, task.continuations(q))}"
             for q, r, ids in zip(questions, requests, answer_ids) if ids is None]
    if split:
        raise InputError(
            "the tokenizer splits the answer letters, but single-token scoring was required",
            key="scoring", expected="' A', ' B', ' C', ' D' one distinct token each after the prompt",
            actual=f"{len(split)} question(s), e.g. {split[0]}",
            hint="use scoring='auto' or 'full' (full continuation log-likelihood, as lm-eval does)",
        )


def _build_rows(requests: Sequence[EncodedRequest], answer_ids: Sequence[tuple[int, ...] | None],
                max_length: int) -> list[Row]:
    """Rows of every question, in question order; row ids count up from 0."""
    rows: list[Row] = []
    for qi, (request, ids) in enumerate(zip(requests, answer_ids)):
        if ids is not None:
            rows.extend(_single_token_rows(qi, request, ids, max_length, first_id=len(rows)))
        else:
            rows.extend(_full_rows(qi, request, max_length, first_id=len(rows)))
    return rows


def _single_token_rows(qi: int, request: EncodedRequest, answer_ids: tuple[int, ...], max_length: int,
                       first_id: int) -> list[Row]:
    """One row: the context (cut as lm-eval cuts it); every answer read at its last position."""
    input_ids, cut = truncate_left(request.context, (answer_ids[0],), max_length)
    return [Row(first_id, qi, tuple(range(len(answer_ids))), tuple((a,) for a in answer_ids), tuple(input_ids),
                cut)]


def _full_rows(qi: int, request: EncodedRequest, max_length: int, first_id: int) -> list[Row]:
    """One row per choice: ``(context + continuation)[-(max_length + 1):][:-1]``."""
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
        raise InputError(
            "the tokenizer produces token ids outside the model's vocabulary", key="vocab_size",
            expected=f"ids < {vocab_size}", actual=f"id {largest}",
            hint="evaluate with the tokenizer the model was trained with",
        )
