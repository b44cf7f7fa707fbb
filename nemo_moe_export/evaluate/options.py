"""The evaluation's options: one dataclass, the one home of every evaluation default.

``MMLUOptions`` is what :func:`~nemo_moe_export.evaluate.evaluator.evaluate_mmlu` and
:class:`~nemo_moe_export.evaluate.callback.MMLUCallback` read; the Hydra group ``mmlu``
(``config.MMLUConfig``) extends it with the recipe's own fields. Construction validates every
field, so ``mmlu.policy=lockstpe`` is refused when the config is built, before training starts.
``task`` picks what is evaluated (docs/design.md#evaluation-tasks): MMLU by default, any packaged
task by name (``mmlu.task=arc_challenge``) or a task YAML by path; the task is read and checked
here too, with ``k_shot`` against the few-shot sampling it defines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.task import is_task_path, load_task
from nemo_moe_export.options import Options, require

__all__ = ["POLICIES", "SCORING_MODES", "SPLITS", "MMLUOptions"]

POLICIES: tuple[str, ...] = ("lockstep", "expert_dp", "naive")
"""How batches are sharded over ranks (``evaluate/batching.py``); ``naive`` is the unsafe split
kept only to show the hang is real: the callback and the recipe refuse it."""
SCORING_MODES: tuple[str, ...] = ("auto", "single_token", "full")
SPLITS: tuple[str, ...] = ("test", "validation")  # ``dev`` is the few-shot pool, never evaluated


@dataclass
class MMLUOptions(Options):
    """What is evaluated and how (every field is checked on construction)."""

    what = "MMLU option"

    k_shot: int = 5  # lm-eval's MMLU default; tasks without a first_n few-shot split take only 0
    # None: batches sized by tokens, the budget derived from the model's device memory
    # (batching.default_tokens_per_batch); N: at most N tokens attended per forward (rows x (shared
    # prefix + padded input)); 0: fixed batches of batch_size rows
    tokens_per_batch: Optional[int] = None
    batch_size: int = 16  # rows per forward with tokens_per_batch=0
    shared_prefix: bool = True  # each subject's k-shot prefix once per forward, its KV cache reused
    policy: str = "lockstep"  # lockstep | expert_dp (| naive, evaluate_mmlu only)
    scoring: str = "auto"  # auto | single_token | full
    uniform_shapes: Optional[bool] = None  # None: on for megatron-core modules
    max_length: Optional[int] = None  # None: the model's context size (lm-eval's HFLM.max_length)
    timeout_s: float = 600.0  # each agreement between ranks; keep it above the model groups' timeout
    # forward steps between agreements (docs/design.md#coordination-protocol): bounds how many
    # forwards a rank runs after a rank it shares no process group with failed; None: agree only
    # before the first step and after the last
    agree_every: Optional[int] = 16
    progress: bool = True  # a progress bar on global rank 0
    # what the callback evaluates, and when
    # a packaged task's name (evaluate/tasks/*.yaml: mmlu, arc_challenge) or a path to a task YAML
    task: str = "mmlu"
    split: str = "test"
    subjects: Optional[list[str]] = None  # None: every subject found
    max_questions: Optional[int] = None  # None: all; else spread evenly over subjects
    every_n_steps: Optional[int] = None  # None: only at the end of training
    at_train_end: bool = True
    plot: bool = True  # PNG charts in the output directory

    def __post_init__(self) -> None:
        _require(isinstance(self.k_shot, int) and self.k_shot >= 0, "k_shot", "an integer >= 0", self.k_shot)
        _require(isinstance(self.batch_size, int) and self.batch_size >= 1, "batch_size", "an integer >= 1",
                 self.batch_size)
        _require(self.tokens_per_batch is None or (isinstance(self.tokens_per_batch, int)
                                                    and not isinstance(self.tokens_per_batch, bool)
                                                    and self.tokens_per_batch >= 0),
                 "tokens_per_batch", "None (derived from memory), 0 (fixed batches) or an integer >= 1",
                 self.tokens_per_batch)
        _require(isinstance(self.shared_prefix, bool), "shared_prefix", "true or false", self.shared_prefix)
        _require(self.policy in POLICIES, "policy", f"one of {list(POLICIES)}", self.policy)
        _require(self.scoring in SCORING_MODES, "scoring", f"one of {list(SCORING_MODES)}", self.scoring)
        _require(self.max_length is None or (isinstance(self.max_length, int) and self.max_length >= 1),
                 "max_length", "None or an integer >= 1", self.max_length)
        _require(self.timeout_s > 0, "timeout_s", "> 0 seconds", self.timeout_s)
        _require(self.agree_every is None or (isinstance(self.agree_every, int)
                                              and not isinstance(self.agree_every, bool) and self.agree_every >= 1),
                 "agree_every", "None (only before the first step and after the last) or an integer >= 1",
                 self.agree_every)
        _require(self.split in SPLITS, "split", f"one of {list(SPLITS)} (dev is the few-shot pool)", self.split)
        _require(self.max_questions is None or (isinstance(self.max_questions, int) and self.max_questions >= 1),
                 "max_questions", "None or an integer >= 1", self.max_questions)
        _require(self.every_n_steps is None or (isinstance(self.every_n_steps, int) and self.every_n_steps >= 1),
                 "every_n_steps", "None or an integer >= 1", self.every_n_steps)
        if self.subjects is not None:
            self.subjects = list(self.subjects)
        _require(isinstance(self.task, str) and bool(self.task), "task",
                 "a packaged task name or a path to a task YAML", self.task)
        if is_task_path(self.task):  # absolute, so a process started elsewhere reads the same file
            self.task = str(Path(self.task).resolve())
        try:
            load_task(self.task).require_fewshot(self.k_shot)
        except InputError as exc:  # named as an option, with the task's own words
            raise InputError(f"bad MMLU option: {exc.problem}", key=exc.key, expected=exc.expected,
                             actual=exc.actual, hint=exc.hint) from None


def _require(ok: bool, key: str, expected: str, actual: object) -> None:
    require(ok, "MMLU option", key, expected, actual)
