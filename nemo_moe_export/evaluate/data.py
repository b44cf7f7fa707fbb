"""Load MMLU questions exactly as published, from the layouts people actually have on disk.

Supported layouts (detected from the directory given to :func:`load_mmlu`):

* The original hendrycks/test CSVs: ``{dev,val,test}/{subject}_{split}.csv`` (optionally under a
  ``data/`` child), no header, columns ``question,A,B,C,D,answer-letter``. They are read with
  Python's :mod:`csv` module and every field is kept as the exact string in the file: pandas would
  turn "None"/"NA" into NaN, "0.50" into 0.5 and "007" into 7 and so change the prompt.
* JSONL, one object per line with ``question``, ``subject``, ``choices`` (4 strings) and ``answer``
  (0-3 or "A"-"D"): ``{split}.jsonl`` files or ``{split}/*.jsonl``.
* A ``cais/mmlu`` snapshot: ``{subject}/{split}-*.parquet`` or ``all/{split}-*.parquet``. Needs
  ``pyarrow``; per-subject folders are preferred because that is what lm-eval loads.
* A ``datasets`` ``save_to_disk`` folder (``dataset_dict.json`` + ``{split}/*.arrow``), read with
  ``pyarrow`` directly so ``datasets`` itself is not needed.

Split names follow ``cais/mmlu``: ``dev`` (few-shot pool), ``validation`` (``val`` is accepted as an
alias) and ``test``. ``Question.index`` is the 0-based position of a question within its
(subject, split), in file order: the few-shot examples are "the first k of the dev split", so this
order is part of the benchmark definition.

The subject -> category table is read from the packaged MMLU task file (``tasks/mmlu.yaml``), and
:func:`read_records` reads the ``.jsonl`` / ``.parquet`` records of other tasks (:mod:`.task`) with
the same errors.

Every malformed input raises :class:`~nemo_moe_export.errors.InputError` naming the file,
the line or row, what was expected and what was found: a byte that is not UTF-8 (file, row and
byte offset), a file that cannot be read (a directory or a dangling link under a data file's name),
and a data file with no questions, which would otherwise silently drop its subject from the score
(``allow_empty_files=True`` makes that a warning; docs/design.md#faults-and-how-each-is-reported).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nemo_moe_export.errors import InputError

__all__ = [
    "CATEGORIES",
    "LETTERS",
    "SPLITS",
    "SUBJECT_CATEGORIES",
    "Question",
    "category_of",
    "group_by_subject",
    "load_mmlu",
    "normalize_split",
    "read_records",
    "require_dev_examples",
]

LETTERS: tuple[str, str, str, str] = ("A", "B", "C", "D")
SPLITS: tuple[str, ...] = ("dev", "validation", "test")
_SPLIT_ALIASES = {"dev": "dev", "val": "validation", "validation": "validation", "test": "test",
                  "train": "train", "auxiliary_train": "train"}
# File/folder names each canonical split may appear under, in the order they are looked for.
_SPLIT_FILE_NAMES = {"dev": ("dev",), "validation": ("val", "validation"), "test": ("test",),
                     "train": ("train", "auxiliary_train")}

def _mmlu_categories() -> dict[str, tuple[str, ...]]:
    """lm-eval's grouping of the 57 subjects (``tag: mmlu_{category}_tasks`` of
    lm_eval/tasks/mmlu/default/mmlu_*.yaml, v0.4.13), read from the packaged task file
    ``tasks/mmlu.yaml``, its one copy (docs/design.md#mmlu-definition)."""
    data = yaml.safe_load((Path(__file__).with_name("tasks") / "mmlu.yaml").read_text(encoding="utf-8"))
    return {category: tuple(subjects) for category, subjects in data["categories"].items()}


_CATEGORY_SUBJECTS: dict[str, tuple[str, ...]] = _mmlu_categories()
CATEGORIES: tuple[str, ...] = tuple(_CATEGORY_SUBJECTS)  # stem, humanities, social_sciences, other

SUBJECT_CATEGORIES: dict[str, str] = {
    subject: category for category, subjects in _CATEGORY_SUBJECTS.items() for subject in subjects
}


def category_of(subject: str) -> str:
    """Category of ``subject``; subjects outside the 57 of MMLU count as ``"other"``.

    Unknown subjects are not an error so that synthetic or extended test sets (a tiny subject a test
    writes, a translated variant) still aggregate; they land in ``"other"`` deliberately, and the
    results keep per-subject rows so nothing is hidden.
    """
    return SUBJECT_CATEGORIES.get(subject, "other")


@dataclass(frozen=True)
class Question:
    """One evaluated document: an MMLU item, fields as strings exactly as published, or a record of
    another task (:mod:`.task`) with its group, text, choices and gold index as the task reads them."""

    subject: str  # the aggregation group: MMLU's subject, else the task's group_by field or its name
    question: str
    choices: tuple[str, ...]  # MMLU: the four answer texts; other tasks: doc_to_choice
    answer: int  # index of the gold choice (MMLU: 0-3, into choices / LETTERS)
    split: str  # canonical: "dev", "validation", "test" (or "train")
    index: int  # 0-based position within (subject, split), file order
    doc: Any = field(default=None, compare=False, repr=False)  # the record a non-MMLU task's templates read


def normalize_split(split: str) -> str:
    """Canonical split name (``val`` -> ``validation``); refuses anything else."""
    try:
        return _SPLIT_ALIASES[split]
    except KeyError:
        raise InputError(
            "unknown MMLU split", key="split", expected=f"one of {sorted(_SPLIT_ALIASES)}",
            actual=repr(split),
        ) from None


def group_by_subject(questions: Iterable[Question]) -> dict[str, list[Question]]:
    """Questions per subject, keeping their order (which decides the few-shot examples)."""
    out: dict[str, list[Question]] = {}
    for q in questions:
        out.setdefault(q.subject, []).append(q)
    return out


def require_dev_examples(dev: Sequence[Question], subjects: Iterable[str], k: int, pool_split: str = "dev") -> None:
    """Refuse ``k`` larger than any needed subject's dev split before any prompt is built.

    lm-eval asserts the same (``FirstNSampler``); failing up front names every short subject at once
    instead of stopping at the first prompt.
    """
    if k < 0:
        raise InputError("few-shot count must be >= 0", key="k", expected=">= 0", actual=k)
    sizes = {s: 0 for s in subjects}
    for q in dev:
        if q.split != pool_split:
            raise InputError(
                f"few-shot pool must come from the {pool_split} split", key=q.subject, expected=pool_split,
                actual=q.split,
            )
        if q.subject in sizes:
            sizes[q.subject] += 1
    short = {s: n for s, n in sizes.items() if n < k}
    if short:
        raise InputError(
            f"k={k} few-shot examples requested but the dev split of {len(short)} subject(s) is "
            "smaller", key="k", expected=f">= {k} dev questions per subject",
            actual=", ".join(f"{s}: {n}" for s, n in sorted(short.items())),
            hint=f"lower k or load the {pool_split} split for these subjects",
        )


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_mmlu(
    path: str | Path,
    *,
    splits: Sequence[str] = ("dev", "test"),
    subjects: Sequence[str] | None = None,
    allow_empty_choices: bool = False,
    allow_empty_files: bool = False,
) -> list[Question]:
    """All questions of ``splits`` (and ``subjects``, if given) found under ``path``.

    The layout is detected (see the module docstring). Subjects named in ``subjects`` that are not
    present in every requested split are refused with the list of available ones, so a typo does not
    silently evaluate nothing. Empty choice strings are refused unless ``allow_empty_choices``: in a
    hand-made file they almost always mean a shifted or missing column. A data file without a single
    question is refused unless ``allow_empty_files`` (then it is a warning naming the file).
    """
    root = Path(path)
    if not root.is_dir():
        raise InputError(
            "MMLU data directory not found", key=str(root), expected="an existing directory",
            actual="missing" if not root.exists() else "a file",
        )
    wanted = tuple(dict.fromkeys(normalize_split(s) for s in splits))
    reader = _detect_layout(root)
    by_split = {split: reader(root, split, allow_empty_files) for split in wanted}
    for split, items in by_split.items():
        for raw in items:
            _check_choices(raw, allow_empty_choices)
    if subjects is not None:
        _check_subjects(subjects, by_split)
        keep = set(subjects)
        by_split = {s: [r for r in rs if r.subject in keep] for s, rs in by_split.items()}
    return [q for split in wanted for q in _number(by_split[split], split)]


@dataclass(frozen=True)
class _Raw:
    """A parsed row before numbering; ``where`` names file and line for error messages."""

    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: int
    where: str


def _number(rows: Iterable[_Raw], split: str) -> Iterator[Question]:
    """Attach the per-(subject, split) index in file order."""
    counters: dict[str, int] = {}
    for r in rows:
        i = counters.get(r.subject, 0)
        counters[r.subject] = i + 1
        yield Question(r.subject, r.question, r.choices, r.answer, split, i)


def _check_choices(raw: _Raw, allow_empty: bool) -> None:
    """Refuse empty questions and (unless allowed) empty choices."""
    if not raw.question.strip():
        raise InputError(
            f"empty question in {raw.where}", key=raw.subject, expected="non-empty text",
            actual=repr(raw.question),
        )
    if not allow_empty:
        empty = [LETTERS[i] for i, c in enumerate(raw.choices) if c == ""]
        if empty:
            raise InputError(
                f"empty choice(s) {', '.join(empty)} in {raw.where}", key=raw.subject,
                expected="4 non-empty choices", actual=list(raw.choices),
                hint="check for a missing or shifted column; pass allow_empty_choices=True if the "
                "data really has empty choices",
            )


def _check_subjects(subjects: Sequence[str], by_split: dict[str, list[_Raw]]) -> None:
    """Every requested subject must exist in every requested split."""
    for split, rows in by_split.items():
        available = sorted({r.subject for r in rows})
        missing = [s for s in subjects if s not in set(available)]
        if missing:
            raise InputError(
                f"subject(s) not found in the {split} split", key="subjects",
                expected=f"some of {available}", actual=missing,
            )


def _detect_layout(root: Path) -> Callable[[Path, str, bool], list[_Raw]]:
    """Return the reader for the layout under ``root`` (see module docstring)."""
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        return _read_arrow_split
    if any(_csv_split_dir(root, s) is not None for s in SPLITS):
        return _read_csv_split
    if any(root.glob("*.jsonl")) or any(root.glob("*/*.jsonl")):
        return _read_jsonl_split
    if any(root.glob("*/*.parquet")):
        return _read_parquet_split
    raise InputError(
        "no MMLU data found", key=str(root),
        expected="{dev,val,test}/{subject}_{split}.csv, {split}.jsonl, {split}/*.jsonl, "
        "{subject|all}/{split}-*.parquet or a datasets save_to_disk folder",
        actual=sorted(p.name for p in root.iterdir())[:20],
    )


def _missing_split(root: Path, split: str, looked_for: str) -> InputError:
    return InputError(
        f"MMLU {split} split not found under {root}", key=split, expected=looked_for,
        actual=sorted(p.name for p in root.iterdir())[:20],
    )


# --- reading files --------------------------------------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    """The file's bytes; a directory, dangling link or unreadable file is an error naming it."""
    try:
        return path.read_bytes()
    except OSError as e:
        kind = "a dangling symbolic link" if path.is_symlink() and not path.exists() else type(e).__name__
        raise InputError(f"cannot read MMLU data file {path}", key=str(path), expected="a readable file",
                         actual=f"{kind}: {e.strerror or e}") from e


def _decode(path: Path, data: bytes, row_of: Callable[[str], int]) -> str:
    """``data`` as UTF-8; a byte that is not UTF-8 is an error naming the file, the row (``row_of``
    the text before it) and the byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start].decode("utf-8")
        raise InputError(
            f"non-UTF-8 byte in {path} row {row_of(before)} (line {before.count(chr(10)) + 1})", key=str(path),
            expected="UTF-8 text", actual=f"byte 0x{data[e.start]:02x} at offset {e.start}",
            hint="re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None


def _require_questions(path: Path, count: int, allow_empty: bool) -> None:
    """A data file without questions silently drops its subject from the score: refused, or a
    warning when explicitly allowed."""
    if count:
        return
    message = f"MMLU data file {path} holds no questions"
    if not allow_empty:
        raise InputError(message, key=str(path), expected="at least one question", actual="none",
                         hint="restore the file, remove it, or pass allow_empty_files=True to skip it "
                              "with a warning")
    warnings.warn(message + ": its subject contributes nothing to this split", stacklevel=4)


# --- CSV ------------------------------------------------------------------------------------------


def _csv_split_dir(root: Path, split: str) -> Path | None:
    """The folder holding ``{subject}_{name}.csv`` for ``split`` (root or root/data), if any."""
    for base in (root, root / "data"):
        for name in _SPLIT_FILE_NAMES[split]:
            d = base / name
            if d.is_dir() and any(d.glob(f"*_{name}.csv")):
                return d
    return None


def _read_csv_split(root: Path, split: str, allow_empty: bool) -> list[_Raw]:
    d = _csv_split_dir(root, split)
    if d is None:
        names = _SPLIT_FILE_NAMES[split]
        raise _missing_split(root, split, " or ".join(f"{n}/{{subject}}_{n}.csv" for n in names))
    suffix = f"_{d.name}.csv"
    rows: list[_Raw] = []
    for f in sorted(d.glob(f"*{suffix}")):
        found = _read_csv_file(f, f.name[: -len(suffix)])
        _require_questions(f, len(found), allow_empty)
        rows.extend(found)
    return rows


def _csv_rows_in(text: str) -> int:
    """The 1-based row (as :func:`_read_csv_file` counts them) in which ``text`` ends."""
    try:
        rows = sum(1 for _ in csv.reader(io.StringIO(text, newline="")))
    except csv.Error:
        rows = text.count("\n")
    return rows + 1 if not text or text.endswith(("\n", "\r")) else rows


def _read_csv_file(path: Path, subject: str) -> list[_Raw]:
    """Rows of one hendrycks CSV; fields are kept verbatim (no type guessing, no stripping)."""
    out: list[_Raw] = []
    data = _read_bytes(path)
    # Tolerate a BOM some editors add; it would otherwise end up in the first question.
    text = _decode(path, data.removeprefix(codecs.BOM_UTF8), _csv_rows_in)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        for row_no, row in enumerate(reader, start=1):
            if not row:  # a blank line; csv gives [] and pandas skips it too
                continue
            where = f"{path} row {row_no} (line {reader.line_num})"
            if len(row) != 6:
                raise InputError(
                    f"wrong column count in {where}", key=subject,
                    expected="6 columns: question,A,B,C,D,answer", actual=f"{len(row)}: {row!r}",
                    hint="fields with commas, quotes or newlines must be double-quoted",
                )
            answer = _parse_answer(row[5], where, subject)
            out.append(_Raw(subject, row[0], (row[1], row[2], row[3], row[4]), answer, where))
    except csv.Error as e:
        raise InputError(
            f"malformed CSV in {path} near line {reader.line_num}", key=subject,
            expected="RFC 4180 CSV", actual=str(e),
        ) from e
    return out


# --- JSONL ----------------------------------------------------------------------------------------


def _jsonl_files(root: Path, split: str) -> list[Path]:
    for name in _SPLIT_FILE_NAMES[split]:
        if (root / f"{name}.jsonl").is_file():
            return [root / f"{name}.jsonl"]
        if (root / name).is_dir():
            files = sorted((root / name).glob("*.jsonl"))
            if files:
                return files
    return []


def _read_jsonl_split(root: Path, split: str, allow_empty: bool) -> list[_Raw]:
    files = _jsonl_files(root, split)
    if not files:
        names = _SPLIT_FILE_NAMES[split]
        raise _missing_split(root, split, " or ".join(f"{n}.jsonl or {n}/*.jsonl" for n in names))
    rows: list[_Raw] = []
    for f in files:
        text = _decode(f, _read_bytes(f), lambda before: before.count("\n") + 1)
        found = []
        for line_no, line in enumerate(io.StringIO(text, newline=None), start=1):
            if not line.strip():
                continue
            where = f"{f} line {line_no}"
            found.append(_raw_from_record(_json_line(line, where), where))
        _require_questions(f, len(found), allow_empty)
        rows.extend(found)
    return rows


def read_records(path: Path) -> list[tuple[dict[str, Any], str]]:
    """Every record of a ``.jsonl`` or ``.parquet`` file with where it is (file and line or row), for
    tasks read as records (:mod:`.task`); the same errors as MMLU's files."""
    if path.suffix == ".parquet":
        _require_pyarrow(f"the parquet file {path}")
        import pyarrow.parquet as pq

        found = [(rec, f"{path} row {i}") for i, rec in enumerate(_read_table(path, pq.read_table, path).to_pylist())]
    else:
        text = _decode(path, _read_bytes(path), lambda before: before.count("\n") + 1)
        found = []
        for line_no, line in enumerate(io.StringIO(text, newline=None), start=1):
            if line.strip():
                found.append((_json_line(line, f"{path} line {line_no}"), f"{path} line {line_no}"))
    for rec, where in found:
        if not isinstance(rec, dict):
            raise InputError(f"record in {where} is not an object", expected="object", actual=type(rec).__name__)
    _require_questions(path, len(found), False)
    return found


def _json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON in {where}", expected="one JSON object per line", actual=str(e)) from e


# --- parquet (cais/mmlu) and datasets save_to_disk ------------------------------------------------


def _require_pyarrow(what: str) -> Any:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise InputError(
            f"reading {what} needs pyarrow, which is not installed", key="pyarrow",
            expected="pyarrow importable", actual="ImportError", hint="pip install pyarrow",
        ) from None
    return pyarrow


def _read_parquet_split(root: Path, split: str, allow_empty: bool) -> list[_Raw]:
    _require_pyarrow(f"parquet MMLU data under {root}")
    import pyarrow.parquet as pq

    names = _SPLIT_FILE_NAMES[split]
    subject_dirs = sorted(d for d in root.iterdir() if d.is_dir() and d.name != "all")
    files = [f for d in subject_dirs for n in names for f in sorted(d.glob(f"{n}-*.parquet"))]
    if not files:  # fall back to the combined config
        files = [f for n in names for f in sorted((root / "all").glob(f"{n}-*.parquet"))]
    if not files:
        raise _missing_split(
            root, split, " or ".join(f"{{subject}}/{n}-*.parquet or all/{n}-*.parquet" for n in names)
        )
    rows: list[_Raw] = []
    for f in files:
        default_subject = None if f.parent.name == "all" else f.parent.name
        records = _read_table(f, pq.read_table, f).to_pylist()
        _require_questions(f, len(records), allow_empty)
        for i, rec in enumerate(records):
            if default_subject is not None and not rec.get("subject"):
                rec = {**rec, "subject": default_subject}
            rows.append(_raw_from_record(rec, f"{f} row {i}"))
    return rows


def _read_arrow_split(root: Path, split: str, allow_empty: bool) -> list[_Raw]:
    """A ``DatasetDict.save_to_disk`` folder: ``{split}/state.json`` lists the ``.arrow`` files."""
    _require_pyarrow(f"the datasets folder {root}")
    import pyarrow as pa

    split_dir = next(
        (root / n for n in (*_SPLIT_FILE_NAMES[split], split) if (root / n / "state.json").is_file()),
        None,
    )
    if split_dir is None:
        raise _missing_split(root, split, f"{split}/state.json")
    rows: list[_Raw] = []
    for f in _arrow_files(split_dir / "state.json"):
        table = _read_table(f, _read_arrow_stream, pa, f)
        _require_questions(f, table.num_rows, allow_empty)
        for i, rec in enumerate(table.to_pylist()):
            rows.append(_raw_from_record(rec, f"{f} row {i}"))
    return rows


def _arrow_files(state_file: Path) -> list[Path]:
    """The ``.arrow`` files a ``datasets`` split's ``state.json`` lists; an unreadable one is an error."""
    try:
        files = [state_file.parent / e["filename"] for e in json.loads(_read_bytes(state_file))["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"unreadable datasets state file {state_file}", key=str(state_file),
                         expected='{"_data_files": [{"filename": ...}, ...]}',
                         actual=f"{type(e).__name__}: {e}") from e
    return files


def _read_arrow_stream(pa: Any, path: Path) -> Any:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all()


def _read_table(path: Path, read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)`` of a parquet or arrow file; a missing, truncated or foreign file is an error naming it."""
    try:
        return read(*args)
    except Exception as e:  # pyarrow's ArrowInvalid, OSError, ...
        raise InputError(f"cannot read MMLU data file {path}", key=str(path), expected="a readable table file",
                         actual=f"{type(e).__name__}: {e}") from e


# --- shared record parsing ------------------------------------------------------------------------


def _raw_from_record(rec: Any, where: str) -> _Raw:
    """Validate one ``{question, subject, choices, answer}`` record (JSONL, parquet, arrow)."""
    if not isinstance(rec, dict):
        raise InputError(f"record in {where} is not an object", expected="object",
                         actual=type(rec).__name__)
    missing = [k for k in ("question", "subject", "choices", "answer") if k not in rec]
    if missing:
        raise InputError(
            f"missing field(s) in {where}", expected="question, subject, choices, answer",
            actual=f"missing {missing}; has {sorted(rec)}",
        )
    subject, question, choices = rec["subject"], rec["question"], rec["choices"]
    if not isinstance(subject, str) or not subject:
        raise InputError(f"bad subject in {where}", expected="non-empty string",
                         actual=repr(subject))
    if not isinstance(question, str):
        raise InputError(f"bad question in {where}", key=subject, expected="string",
                         actual=repr(question))
    if not isinstance(choices, list | tuple) or len(choices) != 4:
        raise InputError(
            f"bad choices in {where}", key=subject, expected="a list of 4 strings",
            actual=repr(choices),
        )
    if not all(isinstance(c, str) for c in choices):
        raise InputError(
            f"non-string choice in {where}", key=subject,
            expected="4 strings (numbers would lose their spelling, e.g. 0.50 -> 0.5)",
            actual=repr(choices),
        )
    answer = _parse_answer(rec["answer"], where, subject)
    return _Raw(subject, question, (choices[0], choices[1], choices[2], choices[3]), answer, where)


def _parse_answer(value: Any, where: str, subject: str) -> int:
    """0-3 from an int 0-3 or a letter A-D (surrounding whitespace ignored, case is not)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return value
    if isinstance(value, str) and value.strip() in LETTERS:
        return LETTERS.index(value.strip())
    raise InputError(
        f"bad answer in {where}", key=subject, expected="A, B, C, D or 0-3", actual=repr(value)
    )
