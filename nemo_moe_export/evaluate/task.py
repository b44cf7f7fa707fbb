r"""Evaluation tasks as data: a multiple-choice task is a YAML file in lm-evaluation-harness' words.

A :class:`Task` says how a document (one record of the data) becomes lm-eval's loglikelihood
requests, and how the answers are scored and grouped (docs/design.md#evaluation-tasks):

* ``doc_to_text``, ``doc_to_choice``, ``doc_to_target``, ``description``: lm-eval's fields, each a
  document field's name or a Jinja2 template rendered over the document in lm-eval's own
  environment (``lm_eval/utils.py``: ``Environment(loader=BaseLoader, undefined=StrictUndefined,
  keep_trailing_newline=True)`` with its ``regex_replace`` filter); ``doc_to_choice`` may also be a
  list. A rendered choice list is read with ``ast.literal_eval`` and a rendered target of digits is
  an index, as ``ConfigurableTask.doc_to_choice`` / ``doc_to_target`` do.
* The prompt is ``description + sum(text(shot) + target_delimiter + choices(shot)[target(shot)] +
  fewshot_delimiter) + text(doc)``, the continuations ``target_delimiter + choice``
  (``ConfigurableTask.fewshot_context`` / ``construct_requests``).
* Few-shot examples: the ``first_n`` sampler over ``fewshot_split``, per group (MMLU's dev split).
  lm-eval's ``default`` sampler draws with a seeded ``random.Random`` from the whole split; it is
  not reproduced, so such a task runs 0-shot only (lm-eval's default ``num_fewshot``).
* ``metric_list``: ``acc`` (argmax of the loglikelihoods) and ``acc_norm`` (argmax of each
  loglikelihood divided by its choice's length in characters, ``ConfigurableTask.process_results``).
* Aggregation: results per group (the document field ``group_by``, else one group, the task), then
  per category of ``categories`` and overall, weighted by size (lm-eval's ``weight_by_size``).
* ``dataset_format``: ``mmlu`` (:func:`~nemo_moe_export.evaluate.data.load_mmlu`'s layouts) or
  ``records`` (``{split}.jsonl`` / ``{split}-*.parquet`` files of the ``*_split`` names).

Packaged tasks live in ``evaluate/tasks/`` (:data:`PACKAGED_TASKS`); :func:`load_task` takes one's
name or the path of a user's own YAML file. Every malformed task or document is an
:class:`~nemo_moe_export.errors.InputError` naming the file, the key and what was expected.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import yaml

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.data import Question, load_mmlu, normalize_split, read_records

__all__ = ["METRICS", "PACKAGED_TASKS", "TASKS_DIR", "Task", "is_task_path", "load_questions", "load_task",
           "task_from_mapping"]

TASKS_DIR = Path(__file__).with_name("tasks")
PACKAGED_TASKS: tuple[str, ...] = tuple(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))
METRICS: tuple[str, ...] = ("acc", "acc_norm")
FORMATS: tuple[str, ...] = ("mmlu", "records")
# lm-eval keys that say nothing about how a document is scored here (hub location, tags, versions)
_IGNORED_KEYS = frozenset({"tag", "dataset_path", "dataset_name", "dataset_kwargs", "should_decontaminate",
                           "doc_to_decontamination_query", "metadata"})


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    """lm_eval/utils.py ``regex_replace``: the one filter lm-eval adds to Jinja's."""
    return re.sub(pattern, repl, string, count=count)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    env = jinja2.Environment(loader=jinja2.BaseLoader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["regex_replace"] = _regex_replace
    return env


@dataclass(frozen=True)
class Task:
    """One multiple-choice task (lm-eval's ``output_type: multiple_choice``), read from YAML."""

    name: str
    doc_to_text: str
    doc_to_choice: str | tuple[str, ...]
    doc_to_target: str | int
    dataset_format: str = "records"
    title: str = ""  # headers and charts; the name when empty
    description: str = ""
    target_delimiter: str = " "  # lm_eval/config/task.py TaskConfig
    fewshot_delimiter: str = "\n\n"
    fewshot_split: str | None = None
    fewshot_sampler: str = "first_n"
    metrics: tuple[str, ...] = ("acc",)
    group_by: str | None = None
    categories: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    other_category: str | None = None  # the category of a group outside ``categories``
    splits: Mapping[str, str] = field(default_factory=dict)  # "test" -> the file name of that split
    source: str = ""  # the YAML file, for error messages

    # --- the document -> requests mapping ---------------------------------------------------------

    def record(self, q: Question) -> Mapping[str, Any]:
        """The document the templates see: the record as read, or MMLU's fields."""
        if q.doc is not None:
            return q.doc
        return {"question": q.question, "subject": q.subject, "choices": list(q.choices), "answer": q.answer}

    def text(self, q: Question) -> str:
        return self.text_of(self.record(q))

    def choices(self, q: Question) -> list[str]:
        return self.choices_of(self.record(q))

    def context(self, q: Question, shots: Sequence[Question]) -> str:
        """lm-eval's prompt: description, each shot answered and delimited, then the open question."""
        return (self.describe(self.record(q))
                + "".join(self.text(s) + self.target_delimiter + self.choices(s)[s.answer] + self.fewshot_delimiter
                          for s in shots)
                + self.text(q))

    def continuations(self, q: Question) -> tuple[str, ...]:
        return tuple(self.target_delimiter + c for c in self.choices(q))

    def describe(self, doc: Mapping[str, Any]) -> str:
        return self._render("description", self.description, doc) if self.description else ""

    def text_of(self, doc: Mapping[str, Any]) -> str:
        text = self._field_or_render("doc_to_text", self.doc_to_text, doc)
        self._check(isinstance(text, str), "doc_to_text", "a string", text, doc)
        return text

    def choices_of(self, doc: Mapping[str, Any]) -> list[str]:
        spec = self.doc_to_choice
        if isinstance(spec, tuple):
            choices: Any = list(spec)
        elif spec in doc:
            choices = doc[spec]
        else:  # a template renders the list's repr (lm-eval reads it back the same way)
            rendered = self._render("doc_to_choice", spec, doc)
            try:
                choices = ast.literal_eval(rendered)
            except (ValueError, SyntaxError):
                choices = rendered
        ok = isinstance(choices, list | tuple) and len(choices) > 0 and all(isinstance(c, str) and c for c in choices)
        self._check(ok, "doc_to_choice", "a non-empty list of non-empty strings", choices, doc)
        return list(choices)

    def target_of(self, doc: Mapping[str, Any], choices: Sequence[str]) -> int:
        """The gold choice's index (an int, digits, or a choice string, as lm-eval accepts)."""
        spec = self.doc_to_target
        target = spec if isinstance(spec, int) else self._field_or_render("doc_to_target", spec, doc)
        if isinstance(target, str):
            target = int(target) if target.isdigit() else choices.index(target) if target in choices else target
        ok = isinstance(target, int) and not isinstance(target, bool) and 0 <= target < len(choices)
        self._check(ok, "doc_to_target", f"a choice index 0..{len(choices) - 1} or one of {choices}", target, doc)
        return target

    def _field_or_render(self, key: str, spec: str, doc: Mapping[str, Any]) -> Any:
        """A document field's value when ``spec`` names one, else the rendered template (lm-eval's rule)."""
        return doc[spec] if spec in doc else self._render(key, spec, doc)

    def _render(self, key: str, template: str, doc: Mapping[str, Any]) -> str:
        try:
            return _template(template).render(**doc)
        except Exception as exc:  # jinja2's UndefinedError, a ValueError of .index(), ...
            raise InputError(f"task {self.name!r}: {key} cannot be rendered for a document", key=key,
                             expected=f"the template {template!r} to apply",
                             actual=f"{type(exc).__name__}: {exc} (document {_short(doc)})") from None

    def _check(self, ok: bool, key: str, expected: str, actual: Any, doc: Mapping[str, Any]) -> None:
        if not ok:
            raise InputError(f"task {self.name!r}: bad {key} for a document", key=key, expected=expected,
                             actual=f"{actual!r} (document {_short(doc)})")

    # --- few-shot and groups --------------------------------------------------------------------

    def require_fewshot(self, k: int) -> None:
        """Refuse ``k`` examples this task cannot draw as lm-eval would."""
        if k > 0 and (self.fewshot_sampler != "first_n" or self.fewshot_split is None):
            raise InputError(
                f"task {self.name!r} cannot run {k}-shot", key="k_shot", expected="0",
                actual=k, hint=f"its few-shot sampler is {self.fewshot_sampler!r} over "
                f"{self.fewshot_split!r} (lm-eval's seeded random draw, not reproduced here; only 'first_n' "
                "is); set k_shot=0, lm-eval's default for it")

    def category_of(self, group: str) -> str | None:
        """The category ``group`` counts in (None: the task has no categories)."""
        for category, groups in self.categories.items():
            if group in groups:
                return category
        return self.other_category

    @property
    def display_name(self) -> str:
        return self.title or self.name


@functools.lru_cache(maxsize=256)
def _template(source: str) -> Any:
    return _environment().from_string(source)


def _short(doc: Mapping[str, Any], limit: int = 160) -> str:
    text = repr(dict(doc))
    return text if len(text) <= limit else text[:limit] + "...}"


# --- reading a task --------------------------------------------------------------------------------


def load_task(task: Task | str = "mmlu") -> Task:
    """``task`` itself, the packaged task of that name (:data:`PACKAGED_TASKS`) or the task a YAML
    file at that path defines; read once per path."""
    if isinstance(task, Task):
        return task
    if not isinstance(task, str) or not task:
        raise InputError("bad evaluation task", key="task", expected="a task name or a YAML path",
                         actual=repr(task))
    if task in PACKAGED_TASKS:
        return _read_task(str(TASKS_DIR / f"{task}.yaml"))
    if is_task_path(task):
        return _read_task(str(Path(task).resolve()))
    raise InputError("unknown evaluation task", key="task",
                     expected=f"one of the packaged tasks {list(PACKAGED_TASKS)} or a path to a task YAML",
                     actual=repr(task))


def is_task_path(task: str) -> bool:
    """Whether ``task`` names a YAML file rather than a packaged task."""
    return task not in PACKAGED_TASKS and (task.endswith((".yaml", ".yml")) or os.sep in task or "/" in task)


@functools.lru_cache(maxsize=32)
def _read_task(path: str) -> Task:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError("cannot read task file", key="task", expected="a readable YAML file",
                         actual=f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InputError("task file is not valid YAML", key="task", expected="YAML",
                         actual=f"{path}: {exc}") from None
    return task_from_mapping(data, path)


def task_from_mapping(data: Any, source: str = "<mapping>") -> Task:
    """A :class:`Task` from a parsed task YAML (every key checked, every template compiled)."""
    def need(ok: bool, key: str, expected: str, actual: Any) -> None:
        if not ok:
            raise InputError(f"bad task file {source}", key=key, expected=expected, actual=repr(actual))

    need(isinstance(data, dict), "<top level>", "a mapping of lm-eval task keys", type(data).__name__)
    known = {"task", "title", "output_type", "dataset_format", "description", "doc_to_text", "doc_to_choice",
             "doc_to_target", "target_delimiter", "fewshot_delimiter", "fewshot_split", "fewshot_config",
             "metric_list", "group_by", "categories", "other_category", "training_split", "validation_split",
             "test_split"}
    unknown = sorted(set(data) - known - _IGNORED_KEYS)
    need(not unknown, unknown[0] if unknown else "", f"only the keys {sorted(known)}", unknown)
    for key in ("task", "doc_to_text", "doc_to_choice", "doc_to_target"):
        need(key in data, key, "present", "missing")
    need(data.get("output_type", "multiple_choice") == "multiple_choice", "output_type", "multiple_choice",
         data.get("output_type"))
    need(isinstance(data["task"], str) and re.fullmatch(r"[A-Za-z0-9_.-]+", data["task"]) is not None, "task",
         "a name of letters, digits, _ . -", data["task"])
    for key in ("doc_to_text", "description", "target_delimiter", "fewshot_delimiter", "title"):
        need(isinstance(data.get(key, ""), str), key, "a string", data.get(key))
    choice = data["doc_to_choice"]
    need(isinstance(choice, str) or (isinstance(choice, list) and choice and all(isinstance(c, str) for c in choice)),
         "doc_to_choice", "a field name, a template or a list of strings", choice)
    target = data["doc_to_target"]
    need(isinstance(target, (str, int)) and not isinstance(target, bool), "doc_to_target",
         "a field name, a template or an index", target)
    fmt = data.get("dataset_format", "records")
    need(fmt in FORMATS, "dataset_format", f"one of {list(FORMATS)}", fmt)
    sampler = (data.get("fewshot_config") or {}).get("sampler", "first_n")
    need(isinstance(sampler, str), "fewshot_config.sampler", "a sampler name", sampler)
    metrics = tuple(_metric(m, need) for m in data.get("metric_list", [{"metric": "acc"}]))
    need(len(metrics) > 0 and "acc" in metrics, "metric_list", "acc, optionally acc_norm", list(metrics))
    categories = data.get("categories") or {}
    need(isinstance(categories, dict) and all(isinstance(v, list) for v in categories.values()), "categories",
         "a mapping of category -> list of groups", categories)
    task = Task(name=data["task"], doc_to_text=data["doc_to_text"],
                doc_to_choice=tuple(choice) if isinstance(choice, list) else choice, doc_to_target=target,
                dataset_format=fmt, title=data.get("title", ""), description=data.get("description", ""),
                target_delimiter=data.get("target_delimiter", " "),
                fewshot_delimiter=data.get("fewshot_delimiter", "\n\n"),
                fewshot_split=data.get("fewshot_split"), fewshot_sampler=sampler, metrics=metrics,
                group_by=data.get("group_by"), categories={c: tuple(g) for c, g in categories.items()},
                other_category=data.get("other_category"),
                splits={s: data.get(f"{s}_split", s) for s in ("train", "validation", "test")}, source=source)
    for key in ("doc_to_text", "doc_to_choice", "doc_to_target", "description"):
        value = getattr(task, key)
        if isinstance(value, str) and value:
            try:
                _template(value)
            except Exception as exc:  # jinja2.TemplateSyntaxError
                need(False, key, "a Jinja2 template", f"{value!r}: {exc}")
    return task


def _metric(entry: Any, need: Any) -> str:
    """``acc`` / ``{metric: acc, aggregation: mean, higher_is_better: true}`` -> ``"acc"``."""
    name = entry.get("metric") if isinstance(entry, dict) else entry
    need(name in METRICS, "metric_list", f"metrics among {list(METRICS)}", entry)
    if isinstance(entry, dict):
        need(entry.get("aggregation", "mean") == "mean", "metric_list", "aggregation: mean", entry)
    return name


# --- reading a task's documents ----------------------------------------------------------------------


def load_questions(task: Task | str, path: str | Path, *, splits: Sequence[str],
                   subjects: Sequence[str] | None = None) -> list[Question]:
    """The documents of ``splits`` (and of the groups ``subjects``, if given) as questions, each with
    its choices and gold index as the task reads them; bad documents are refused before anything runs."""
    task = load_task(task)
    if task.dataset_format == "mmlu":
        return load_mmlu(path, splits=splits, subjects=subjects)
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{task.name} data directory not found", key=str(root), expected="an existing directory",
                         actual="missing" if not root.exists() else "a file")
    wanted = tuple(dict.fromkeys(normalize_split(s) for s in splits))
    out = [q for split in wanted for q in _questions(task, root, split)]
    if subjects is not None:
        for split in wanted:
            available = sorted({q.subject for q in out if q.split == split})
            missing = [s for s in subjects if s not in available]
            if missing:
                raise InputError(f"group(s) not found in the {split} split", key="subjects",
                                 expected=f"some of {available}", actual=missing)
        out = [q for q in out if q.subject in set(subjects)]
    return out


def _questions(task: Task, root: Path, split: str) -> list[Question]:
    """One split's records, numbered per group in file order (the order ``first_n`` reads)."""
    name = task.splits.get(split, split)
    files = [root / f"{name}.jsonl"] if (root / f"{name}.jsonl").is_file() else sorted(root.glob(f"{name}-*.parquet"))
    if not files:
        raise InputError(f"{task.name} {split} split not found under {root}", key=split,
                         expected=f"{name}.jsonl or {name}-*.parquet",
                         actual=sorted(p.name for p in root.iterdir())[:20])
    counters: dict[str, int] = {}
    out = []
    for doc, where in (r for f in files for r in read_records(f)):
        group = task.name if task.group_by is None else doc.get(task.group_by)
        if not isinstance(group, str) or not group:
            raise InputError(f"bad {task.group_by} in {where}", key=str(task.group_by),
                             expected="a non-empty string", actual=repr(group))
        try:
            choices = task.choices_of(doc)
            gold = task.target_of(doc, choices)
            text = task.text_of(doc)
        except InputError as exc:
            raise InputError(f"{exc.problem} ({where})", key=exc.key, expected=exc.expected,
                             actual=exc.actual) from None
        index = counters.get(group, 0)
        counters[group] = index + 1
        out.append(Question(group, text, tuple(choices), gold, split, index, doc))
    return out
