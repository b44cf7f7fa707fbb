"""MMLU (or any evaluation task) during training: a callback any training loop can call, on every rank.

:class:`MMLUCallback` is a :class:`~nemo_moe_export.hooks.Hook` and knows nothing about the
trainer: the loop calls ``on_step_end(ctx, step)`` after each optimizer step and
``on_train_end(ctx)`` once at the end, on every rank (the evaluation is collective), with the
:class:`~nemo_moe_export.hooks.RecipeContext` holding the model, tokenizer and layout
(docs/design.md#hooks); ``evaluate(model, tokenizer, layout)`` runs one evaluation directly.
What it evaluates is ``options.task`` (docs/design.md#evaluation-tasks): MMLU by default, a
packaged task by name (``task="arc_challenge"``) or a task YAML by path, its data under
``data_path``. Data is loaded and tokenized once, on the first evaluation, and reused; bad data,
unknown subjects or a k larger than a subject's dev split raise
:class:`~nemo_moe_export.errors.InputError` there, on every rank, before any collective.

On global rank 0 each evaluation writes its results JSON, markdown table and charts into
``output_dir``, named after the task (:mod:`.outputs`: ``mmlu_results.json``,
``arc_challenge_results.json``; ``plot=False`` skips the charts); the history chart carries the
training loss when the loop records it in ``ctx.results["train_loss"]`` (``[step, loss]`` pairs, as
the recipe's trainer and the Lightning integration do).

It also logs the metrics (``logging``, logger ``nemo_moe_export.evaluate.callback``), shows a
progress bar (tqdm when importable, plain lines otherwise) and passes the flat metrics, with the
training step, to ``log_fn(metrics, step)`` if given and to every metrics logger added with
:meth:`MMLUCallback.add_metrics_logger` (the Lightning/NeMo integration adds the trainer's own
loggers, so TensorBoard or W&B show MMLU next to the loss); they are named after the task
(``mmlu/acc``, ``arc_challenge/acc_norm``). The flat metrics are also returned, on every rank.
``ctx.results`` keeps its keys (``"mmlu"``, ``"mmlu_during_training"``) whatever the task: they are
the evaluation's slots, which the recipe and the integrations read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.data import Question, normalize_split
from nemo_moe_export.evaluate.evaluator import evaluate_mmlu, phase_coordinator
from nemo_moe_export.evaluate.options import MMLUOptions
from nemo_moe_export.evaluate.outputs import log_summary, write_outputs
from nemo_moe_export.evaluate.prepare import (
    PreparedQuestions,
    default_max_length,
    model_vocab_size,
    prepare_questions,
)
from nemo_moe_export.evaluate.results import MMLUResult
from nemo_moe_export.evaluate.task import Task, load_questions, load_task
from nemo_moe_export.hooks import Hook, RecipeContext
from nemo_moe_export.parallel import Coordinator, ParallelLayout, PeerError, discover_layout, is_global_rank0

__all__ = ["LOSS_HISTORY_KEY", "MMLUCallback", "spread_subset"]

LOSS_HISTORY_KEY = "train_loss"
"""``ctx.results[LOSS_HISTORY_KEY]``: ``[step, loss]`` pairs a training loop records, charted with the accuracy."""


def spread_subset(questions: Sequence[Question], limit: int | None) -> list[Question]:
    """At most ``limit`` questions, taken evenly across subjects (groups: first of each, then second
    of each, ...), in their original order. A cap that kept only the first subjects would turn a
    quick check into a single-topic score."""
    if limit is None or limit >= len(questions):
        return list(questions)
    chosen = sorted(range(len(questions)), key=lambda i: (questions[i].index, questions[i].subject))[:limit]
    return [questions[i] for i in sorted(chosen)]


class MMLUCallback(Hook):
    """Evaluate MMLU (or ``options.task``) every ``every_n_steps`` steps and/or at the end of training.

    What is evaluated and how is :class:`~nemo_moe_export.evaluate.options.MMLUOptions`:
    ``options`` (an ``MMLUOptions``, a config node such as the recipe's ``mmlu`` group, or a
    mapping) with keyword ``overrides`` of its fields applied (``k_shot=0, every_n_steps=500``),
    validated here, so a bad value is refused before training starts. ``policy`` is
    ``"lockstep"`` or ``"expert_dp"`` (``"naive"`` is refused: it hangs under EP and FSDP);
    ``max_questions`` caps the evaluated questions, spread evenly over subjects
    (:func:`spread_subset`). ``output_dir`` receives the result files on global rank 0;
    ``log_fn(metrics, step)`` receives the flat metrics there.

    As a hook, it records what it measures in ``ctx.results``: each evaluation during training is
    appended to ``"mmlu_during_training"`` (``{"step": step, **flat metrics}``), the one at the
    end of training is ``"mmlu"`` (per-subject, per-category and overall metrics).
    """

    def __init__(
        self,
        data_path: str | os.PathLike[str],
        options: MMLUOptions | Mapping[str, Any] | Any = None,
        *,
        output_dir: str | os.PathLike[str] = "mmlu_eval",
        log_fn: Callable[[dict[str, float], int | None], None] | None = None,
        **overrides: Any,
    ) -> None:
        _require(options is None or not isinstance(options, (str, bytes, int, float, os.PathLike)), "options",
                 "MMLUOptions, a config node or a mapping of its fields (keyword overrides go by name)", options)
        if "split" in overrides:  # the data loader's aliases ("val") are accepted here as they were
            overrides["split"] = normalize_split(overrides["split"])
        self.options = MMLUOptions.of(options, **overrides)
        self.task: Task = load_task(self.options.task)
        _require(self.options.policy != "naive", "policy", "'lockstep' or 'expert_dp' (naive hangs under EP/FSDP)",
                 self.options.policy)
        self.data_path = Path(data_path)
        self.output_dir = Path(output_dir)
        self.log_fn = log_fn
        self.metrics_loggers: list[Callable[[dict[str, float], int | None], None]] = []
        self.loss_history: list[tuple[int, float]] = []  # read from ctx.results[LOSS_HISTORY_KEY]
        self.history: list[dict[str, Any]] = []
        self.last_result: MMLUResult | None = None
        self._last_step: int | None = None  # the step of the last evaluation
        self._seen_step: int | None = None  # the last step the training loop reported
        self._data: tuple[list[Question], list[Question]] | None = None
        self._prepared: tuple[tuple[int, int], PreparedQuestions] | None = None
        self._coordinators: dict[tuple[int, ...], Coordinator] = {}

    # --- hooks (docs/design.md#hooks) -------------------------------------------------------------

    def add_metrics_logger(self, log: Callable[[dict[str, float], int | None], None]) -> None:
        """``log(flat_metrics, step)`` after every evaluation, on global rank 0 (a framework's logger)."""
        self.metrics_loggers.append(log)

    def should_evaluate(self, step: int) -> bool:
        every = self.options.every_n_steps
        return every is not None and step > 0 and step % every == 0

    def on_step_end(self, ctx: RecipeContext, step: int) -> None:
        """Evaluate when ``step`` is a multiple of ``every_n_steps``; appends the flat metrics with
        the step to ``ctx.results["mmlu_during_training"]``."""
        self._seen_step = step
        if not self.should_evaluate(step):
            return
        self._read_losses(ctx)
        metrics = self.evaluate(ctx.model, ctx.tokenizer, ctx.layout, step=step)
        ctx.results.setdefault("mmlu_during_training", []).append({"step": step, **metrics})

    def on_train_end(self, ctx: RecipeContext) -> None:
        """The final evaluation into ``ctx.results["mmlu"]`` (unless ``at_train_end`` is off); the
        last step's evaluation is reused when the loop's last step was just evaluated."""
        if not self.options.at_train_end:
            return
        step = self._seen_step
        if not (step is not None and step == self._last_step and self.history):
            self._read_losses(ctx)
            self.evaluate(ctx.model, ctx.tokenizer, ctx.layout, step=step)
        ctx.results["mmlu"] = self.last_result.metrics

    def _read_losses(self, ctx: RecipeContext) -> None:
        self.loss_history = [(int(s), float(v)) for s, v in ctx.results.get(LOSS_HISTORY_KEY, ())]

    # --- evaluation -------------------------------------------------------------------------------

    def evaluate(self, model: Any, tokenizer: Any, layout: ParallelLayout | None = None, *,
                 step: int | None = None) -> dict[str, float]:
        """One collective evaluation; every rank gets the same metrics back."""
        layout = layout if layout is not None else discover_layout()
        prepared = self._prepare(model, tokenizer)  # bad input raises here, before any collective
        coordinator = self._coordinator(layout)
        result = evaluate_mmlu(model, tokenizer, prepared, layout=layout, options=self.options,
                               coordinator=coordinator)
        metrics = result.flat_metrics()
        self.last_result, self._last_step = result, step
        self.history.append({"step": step, "metrics": metrics})
        self._publish(result, metrics, step, coordinator)
        return metrics

    def questions(self) -> tuple[list[Question], list[Question]]:
        """The few-shot pool and the evaluated questions, read once from ``data_path`` (bad data
        raises here, on every rank, before any collective)."""
        o, task = self.options, self.task
        if self._data is None:
            # the few-shot split is read whenever the task samples one (MMLU's dev, even for 0-shot)
            samples = task.fewshot_split is not None and task.fewshot_sampler == "first_n"
            fewshot = normalize_split(task.fewshot_split) if samples else None
            loaded = load_questions(task, self.data_path, splits=(*([fewshot] if fewshot else []), o.split),
                                    subjects=o.subjects)
            dev = [q for q in loaded if q.split == fewshot]
            evaluated = spread_subset([q for q in loaded if q.split == o.split], o.max_questions)
            self._data = (dev, evaluated)
        return self._data

    def _prepare(self, model: Any, tokenizer: Any) -> PreparedQuestions:
        """Tokenize once per (tokenizer, max_length); deterministic, so equal on all ranks."""
        o = self.options
        dev, evaluated = self.questions()
        max_length = o.max_length or default_max_length(model, tokenizer)
        key = (id(tokenizer), max_length)
        if self._prepared is None or self._prepared[0] != key:
            prepared = prepare_questions(
                tokenizer, evaluated, dev, k_shot=o.k_shot, max_length=max_length, scoring=o.scoring,
                vocab_size=model_vocab_size(model), task=self.task)
            self._prepared = (key, prepared)
        return self._prepared[1]

    def _coordinator(self, layout: ParallelLayout) -> Coordinator:
        """One coordinator per DP (and pipeline) group, reused (creating one may create a process group)."""
        key = (tuple(layout.dp.ranks), tuple(layout.pp.ranks))
        if key not in self._coordinators:
            self._coordinators[key] = phase_coordinator(layout, timeout_s=self.options.timeout_s, name="mmlu")
        return self._coordinators[key]

    # --- output -----------------------------------------------------------------------------------

    def _publish(self, result: MMLUResult, metrics: dict[str, float], step: int | None,
                 coordinator: Coordinator) -> None:
        """Rank 0 writes files and logs; every rank learns whether writing worked."""
        error: BaseException | None = None
        if is_global_rank0():
            try:
                self.write_outputs(result, step)
                log_summary(result, step, self.task)
                for log in ([self.log_fn] if self.log_fn is not None else []) + self.metrics_loggers:
                    log(metrics, step)
            except Exception as exc:  # reported on every rank by the agreement
                error = exc
        try:
            coordinator.agree("write results", error)
        except PeerError as exc:
            raise PeerError(f"{self.task.display_name} results could not be published: {exc}", step=exc.step,
                            ranks=exc.ranks) from exc

    def write_outputs(self, result: MMLUResult, step: int | None) -> dict[str, Path]:
        """Write the JSON, markdown and (unless ``plot`` is off) PNG files; their paths."""
        run = {"step": step, "data_path": str(self.data_path), "split": self.options.split,
               "k_shot": self.options.k_shot}
        return write_outputs(self.output_dir, result, run, self.history, self.loss_history, plot=self.options.plot,
                             task=self.task)


def _require(ok: bool, key: str, expected: str, actual: Any) -> None:
    if not ok:
        raise InputError("bad MMLUCallback argument", key=key, expected=expected, actual=repr(actual))
