"""MMLU loading: exact field values from CSV/JSONL/parquet, subject/split selection, clear errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.data import (
    SUBJECT_CATEGORIES,
    Question,
    category_of,
    group_by_subject,
    load_mmlu,
    require_dev_examples,
)

# Values pandas would mangle ("None"/"NA" -> NaN, "0.50" -> 0.5, "007" -> 7) plus CSV hazards.
TRICKY = [
    ["What is 1/2?", "0.50", "007", "None", "NA", "A"],
    ['Say "hi", then\nleave.', "a, b", 'He said "no"', "  padded  ", "1e3", "D"],
    ["  Leading and trailing spaces  ", "True", "null", "-0", "NaN", "C"],
]


def write_csv(path: Path, rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows(rows)


def make_csv_tree(root: Path) -> None:
    write_csv(root / "dev" / "toy_subject_dev.csv", TRICKY)
    write_csv(root / "test" / "toy_subject_test.csv", TRICKY[::-1])
    write_csv(root / "dev" / "anatomy_dev.csv", [["Bone?", "a", "b", "c", "d", "B"]])
    write_csv(root / "test" / "anatomy_test.csv", [["Muscle?", "w", "x", "y", "z", "C"]])
    write_csv(root / "val" / "anatomy_val.csv", [["Skin?", "p", "q", "r", "s", "D"]])


def test_categories_are_lm_evals_57_subjects():
    counts = {}
    for cat in SUBJECT_CATEGORIES.values():
        counts[cat] = counts.get(cat, 0) + 1
    assert counts == {"stem": 19, "humanities": 13, "social_sciences": 12, "other": 13}
    assert category_of("high_school_government_and_politics") == "social_sciences"
    assert category_of("formal_logic") == "humanities"
    assert category_of("machine_learning") == "stem"
    assert category_of("toy_subject") == "other"  # documented fallback for unknown subjects


def test_csv_keeps_every_field_verbatim(tmp_path):
    make_csv_tree(tmp_path)
    qs = load_mmlu(tmp_path, splits=["dev"], subjects=["toy_subject"])
    assert [q.choices for q in qs] == [tuple(r[1:5]) for r in TRICKY]
    assert [q.question for q in qs] == [r[0] for r in TRICKY]  # no stripping at load time
    assert [q.answer for q in qs] == [0, 3, 2]
    assert [(q.split, q.index, q.subject) for q in qs] == [("dev", i, "toy_subject") for i in range(3)]
    assert all(isinstance(c, str) for q in qs for c in q.choices)


def test_csv_splits_order_and_val_alias(tmp_path):
    make_csv_tree(tmp_path)
    qs = load_mmlu(tmp_path, splits=["dev", "test", "val"])
    assert [(q.split, q.subject, q.index) for q in qs] == [
        ("dev", "anatomy", 0), ("dev", "toy_subject", 0), ("dev", "toy_subject", 1),
        ("dev", "toy_subject", 2), ("test", "anatomy", 0), ("test", "toy_subject", 0),
        ("test", "toy_subject", 1), ("test", "toy_subject", 2), ("validation", "anatomy", 0),
    ]
    test_toy = [q for q in qs if q.split == "test" and q.subject == "toy_subject"]
    assert test_toy[0].question == TRICKY[2][0]
    assert group_by_subject(qs)["anatomy"][2].question == "Skin?"


def test_csv_under_data_folder(tmp_path):
    make_csv_tree(tmp_path / "data")
    assert len(load_mmlu(tmp_path, splits=["test"])) == 4


def test_unknown_subject_lists_available(tmp_path):
    make_csv_tree(tmp_path)
    with pytest.raises(InputError, match="not found in the dev split") as e:
        load_mmlu(tmp_path, subjects=["anatomy", "astronmy"])
    assert e.value.actual == ["astronmy"]
    assert "anatomy" in str(e.value) and "toy_subject" in str(e.value)


def test_missing_dir_and_missing_split(tmp_path):
    with pytest.raises(InputError, match="directory not found"):
        load_mmlu(tmp_path / "nope")
    write_csv(tmp_path / "dev" / "anatomy_dev.csv", [["q", "a", "b", "c", "d", "A"]])
    with pytest.raises(InputError, match="test split not found"):
        load_mmlu(tmp_path, splits=["dev", "test"])
    with pytest.raises(InputError, match="unknown MMLU split"):
        load_mmlu(tmp_path, splits=["holdout"])
    with pytest.raises(InputError, match="train split not found"):  # a known split, absent here
        load_mmlu(tmp_path, splits=["train"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no MMLU data found"):
        load_mmlu(tmp_path / "empty")


@pytest.mark.parametrize(
    "row,match",
    [
        (["q", "a", "b", "c", "A"], "wrong column count"),
        (["q", "a", "b", "c", "d", "A", "extra"], "wrong column count"),
        (["q", "a", "b", "c", "d", "E"], "bad answer"),
        (["q", "a", "b", "c", "d", "a"], "bad answer"),
        (["q", "a", "b", "c", "d", "0"], "bad answer"),  # CSV answers are letters
        (["q", "a", "", "c", "d", "A"], r"empty choice\(s\) B"),
        (["   ", "a", "b", "c", "d", "A"], "empty question"),
    ],
)
def test_bad_csv_rows_name_file_and_row(tmp_path, row, match):
    write_csv(tmp_path / "test" / "anatomy_test.csv", [["ok", "a", "b", "c", "d", "A"], row])
    with pytest.raises(InputError, match=match) as e:
        load_mmlu(tmp_path, splits=["test"])
    assert "anatomy_test.csv row 2" in str(e.value)


def test_row_number_counts_rows_not_lines(tmp_path):
    write_csv(tmp_path / "test" / "x_test.csv", [["multi\nline\nq", "a", "b", "c", "d", "A"], ["q", "a", "b", "B"]])
    with pytest.raises(InputError, match=r"x_test.csv row 2 \(line 4\)"):
        load_mmlu(tmp_path, splits=["test"])


def test_empty_choices_can_be_allowed(tmp_path):
    write_csv(tmp_path / "test" / "x_test.csv", [["q", "a", "", "c", "d", "A"]])
    assert load_mmlu(tmp_path, splits=["test"], allow_empty_choices=True)[0].choices[1] == ""


def test_k_larger_than_dev_split(tmp_path):
    make_csv_tree(tmp_path)
    dev = load_mmlu(tmp_path, splits=["dev"])
    require_dev_examples(dev, ["toy_subject", "anatomy"], 1)
    with pytest.raises(InputError, match="k=2 few-shot") as e:
        require_dev_examples(dev, ["toy_subject", "anatomy"], 2)
    assert e.value.actual == "anatomy: 1"
    with pytest.raises(InputError, match="k=5") as e:
        require_dev_examples(dev, ["toy_subject", "anatomy", "virology"], 5)
    assert e.value.actual == "anatomy: 1, toy_subject: 3, virology: 0"


# --- JSONL ------------------------------------------------------------------------------------------


def write_jsonl(path: Path, records: list[object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def record(subject="toy", answer=1, choices=("0.50", "None", "007", "a,\"b\"\nc"), question="Q?"):
    return {"question": question, "subject": subject, "choices": list(choices), "answer": answer}


def test_jsonl_flat_files(tmp_path):
    write_jsonl(tmp_path / "dev.jsonl", [record(answer=0), record(subject="anatomy", answer="D")])
    write_jsonl(tmp_path / "test.jsonl", [record(answer="B"), record(answer=3)])
    qs = load_mmlu(tmp_path)
    assert [(q.split, q.subject, q.index, q.answer) for q in qs] == [
        ("dev", "toy", 0, 0), ("dev", "anatomy", 0, 3), ("test", "toy", 0, 1), ("test", "toy", 1, 3),
    ]
    assert qs[0].choices == ("0.50", "None", "007", 'a,"b"\nc')


def test_jsonl_split_folders(tmp_path):
    write_jsonl(tmp_path / "test" / "b.jsonl", [record(question="second")])
    write_jsonl(tmp_path / "test" / "a.jsonl", [record(question="first")])
    assert [q.question for q in load_mmlu(tmp_path, splits=["test"])] == ["first", "second"]


@pytest.mark.parametrize(
    "rec,match",
    [
        (record(answer=4), "bad answer"),
        (record(answer="E"), "bad answer"),
        (record(answer=True), "bad answer"),
        (record(answer=1.0), "bad answer"),
        (record(choices=()), "bad choices"),
        (record(choices=("a", "b", "c")), "bad choices"),
        (record(choices=("a", "b", "c", 0.5)), "non-string choice"),
        (record(choices=("a", "", "c", "d")), "empty choice"),
        ({"question": "q", "choices": ["a", "b", "c", "d"], "answer": 0}, "missing field"),
        ([1, 2], "not an object"),
    ],
)
def test_bad_jsonl_records_name_file_and_line(tmp_path, rec, match):
    write_jsonl(tmp_path / "test.jsonl", [record(), rec])
    with pytest.raises(InputError, match=match) as e:
        load_mmlu(tmp_path, splits=["test"])
    assert "test.jsonl line 2" in str(e.value)


def test_invalid_json_line(tmp_path):
    (tmp_path / "test.jsonl").write_text(json.dumps(record()) + "\n\n{oops\n", encoding="utf-8")
    with pytest.raises(InputError, match="invalid JSON in .*test.jsonl line 3"):
        load_mmlu(tmp_path, splits=["test"])


# --- parquet (cais/mmlu layout) -----------------------------------------------------------------------


def write_parquet(path: Path, records: list[dict]) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def test_parquet_per_subject_and_all(tmp_path):
    pytest.importorskip("pyarrow")
    write_parquet(tmp_path / "anatomy" / "test-00000-of-00001.parquet",
                  [record(subject="anatomy", answer=2), record(subject="anatomy", answer=0)])
    write_parquet(tmp_path / "toy" / "test-00000-of-00001.parquet", [record(answer=1)])
    write_parquet(tmp_path / "anatomy" / "dev-00000-of-00001.parquet", [record(subject="anatomy")])
    qs = load_mmlu(tmp_path, splits=["test"])
    assert [(q.subject, q.index, q.answer) for q in qs] == [("anatomy", 0, 2), ("anatomy", 1, 0), ("toy", 0, 1)]
    assert qs[0].choices == ("0.50", "None", "007", 'a,"b"\nc')

    only_all = tmp_path / "only_all"
    write_parquet(only_all / "all" / "validation-00000-of-00001.parquet",
                  [record(subject="anatomy"), record(subject="toy"), record(subject="anatomy")])
    qs = load_mmlu(only_all, splits=["val"], subjects=["anatomy"])
    assert [(q.split, q.subject, q.index) for q in qs] == [("validation", "anatomy", 0), ("validation", "anatomy", 1)]


def test_parquet_bad_answer(tmp_path):
    pytest.importorskip("pyarrow")
    write_parquet(tmp_path / "all" / "test-00000-of-00001.parquet", [record(), record(answer=7)])
    with pytest.raises(InputError, match=r"bad answer in .*test-00000-of-00001.parquet row 1"):
        load_mmlu(tmp_path, splits=["test"])


def test_parquet_without_pyarrow_says_install(tmp_path, monkeypatch):
    (tmp_path / "all").mkdir()
    (tmp_path / "all" / "test-00000-of-00001.parquet").write_bytes(b"PAR1")
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name == "pyarrow" or name.startswith("pyarrow."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(InputError, match="needs pyarrow.*pip install pyarrow"):
        load_mmlu(tmp_path, splits=["test"])


def test_datasets_save_to_disk_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    split_dir = tmp_path / "test"
    split_dir.mkdir()
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    table = pa.Table.from_pylist([record(answer=2), record(subject="anatomy", answer=0)])
    with pa.OSFile(str(split_dir / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (split_dir / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    qs = load_mmlu(tmp_path, splits=["test"])
    assert qs == [
        Question("toy", "Q?", ("0.50", "None", "007", 'a,"b"\nc'), 2, "test", 0),
        Question("anatomy", "Q?", ("0.50", "None", "007", 'a,"b"\nc'), 0, "test", 0),
    ]


# --- faults: empty, unreadable and non-UTF-8 files (docs/design.md#faults-and-how-each-is-reported) ----


def test_an_empty_test_file_is_an_error_naming_it_not_a_dropped_subject(tmp_path):
    make_csv_tree(tmp_path)
    empty = tmp_path / "test" / "anatomy_test.csv"
    empty.write_text("")
    with pytest.raises(InputError, match="holds no questions") as e:
        load_mmlu(tmp_path)
    assert e.value.key == str(empty)
    with pytest.warns(UserWarning, match=f"{empty} holds no questions"):  # explicitly allowed: said, not silent
        questions = load_mmlu(tmp_path, allow_empty_files=True)
    assert {q.subject for q in questions if q.split == "test"} == {"toy_subject"}


def test_an_empty_jsonl_file_is_an_error_naming_it(tmp_path):
    write_jsonl(tmp_path / "test" / "a.jsonl", [record()])
    (tmp_path / "test" / "b.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match=r"b\.jsonl holds no questions"):
        load_mmlu(tmp_path, splits=["test"])


@pytest.mark.parametrize("make,kind", [
    (lambda p: p.mkdir(), "IsADirectoryError"),
    (lambda p: p.symlink_to(p.parent / "gone.csv"), "a dangling symbolic link"),
])
def test_an_unreadable_file_is_an_error_naming_it(tmp_path, make, kind):
    make_csv_tree(tmp_path)
    bad = tmp_path / "test" / "zoology_test.csv"
    make(bad)
    with pytest.raises(InputError, match=f"cannot read MMLU data file {bad}.*{kind}"):
        load_mmlu(tmp_path)


def test_a_non_utf8_byte_names_file_row_and_offset(tmp_path):
    rows = [["multi\nline", "a", "b", "c", "d", "A"], ["fine", "a", "b", "c", "d", "B"],
            ["caf\u00e9", "a", "b", "c", "d", "C"]]
    write_csv(tmp_path / "test" / "x_test.csv", rows)
    path = tmp_path / "test" / "x_test.csv"
    data = path.read_bytes()
    path.write_bytes(data.replace("caf\u00e9".encode(), b"caf\xe9"))  # latin-1, as old editors save it
    offset = data.index("caf\u00e9".encode()) + 3
    with pytest.raises(InputError, match=rf"non-UTF-8 byte in {path} row 3 \(line 4\).*0xe9 at offset {offset}"):
        load_mmlu(tmp_path, splits=["test"])
    (tmp_path / "test" / "x_test.csv").unlink()
    (tmp_path / "test.jsonl").write_bytes(json.dumps(record()).encode() + b'\n{"question": "\xff"}\n')
    with pytest.raises(InputError, match=r"non-UTF-8 byte in .*test\.jsonl row 2 \(line 2\)"):
        load_mmlu(tmp_path, splits=["test"])


def test_a_corrupt_or_empty_parquet_file_is_an_error_naming_it(tmp_path):
    pytest.importorskip("pyarrow")
    write_parquet(tmp_path / "anatomy" / "test-00000-of-00001.parquet", [record(subject="anatomy")])
    bad = tmp_path / "toy" / "test-00000-of-00001.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1 this was cut off")
    with pytest.raises(InputError, match=f"cannot read MMLU data file {bad}"):
        load_mmlu(tmp_path, splits=["test"])
    write_parquet(bad, [])  # a valid file with no rows
    with pytest.raises(InputError, match="holds no questions"):
        load_mmlu(tmp_path, splits=["test"])
