"""A synthetic multiple-choice corpus in the MMLU layout, and a word-level tokenizer for it.

The embedded demo must train to well above chance in minutes on CPU ranks, and its evaluation must
go through exactly the same MMLU code as real data. Each made-up subject asks a question whose
answer letter is a function of the question (choices are always listed in the same order), so a
tiny model can learn it from examples and answer held-out questions it never saw:

* ``modular_arithmetic``: ``What is (a + b) mod 4?`` for digits below 6, with choices 0..3;
* ``comparison``: ``Which is larger, a or b?`` -> the first / the second / they are equal / neither;
* ``parity``: ``Is n even or odd?`` -> even / odd / prime / negative;
* ``successor``: ``Which number comes after n, counting modulo 4?`` with choices 0..3.

Files are written as ``{dev,val,test}/{subject}_{split}.csv`` (no header; question, A, B, C, D,
answer letter), the original MMLU layout, plus ``train/{subject}_train.csv`` for training.
"""

from __future__ import annotations

import csv
import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = ["SUBJECTS", "build_tokenizer", "write_synthetic_mmlu"]

LETTERS = "ABCD"


def _modular_arithmetic(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randrange(6), rng.randrange(6)
    return f"What is ( {a} + {b} ) mod 4 ?", ["0", "1", "2", "3"], (a + b) % 4


def _comparison(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randrange(10), rng.randrange(10)
    answer = 0 if a > b else 1 if b > a else 2
    return f"Which is larger , {a} or {b} ?", ["the first", "the second", "they are equal", "neither"], answer


def _parity(rng: random.Random) -> tuple[str, list[str], int]:
    n = rng.randrange(100)
    return f"Is {n // 10} {n % 10} even or odd ?", ["even", "odd", "prime", "negative"], n % 2


def _successor(rng: random.Random) -> tuple[str, list[str], int]:
    n = rng.randrange(10)
    return f"Which number comes after {n} , counting modulo 4 ?", ["0", "1", "2", "3"], (n + 1) % 4


SUBJECTS: dict[str, Callable[[random.Random], tuple[str, list[str], int]]] = {
    "modular_arithmetic": _modular_arithmetic,
    "comparison": _comparison,
    "parity": _parity,
    "successor": _successor,
}


def write_synthetic_mmlu(
    root: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_train: int = 400,
    n_dev: int = 5,
    n_test: int = 50,
    subjects: list[str] | None = None,
) -> Path:
    """Write the corpus under ``root``; returns it. Deterministic for a seed; test questions are
    drawn from a separate random stream from training ones."""
    root = Path(root)
    subjects = list(subjects or SUBJECTS)
    for split in ("train", "dev", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
    for index, subject in enumerate(subjects):
        make = SUBJECTS[subject]
        for split, count, offset in (("train", n_train, 0), ("dev", n_dev, 1), ("test", n_test, 2)):
            rng = random.Random(seed * 1000 + index * 10 + offset)
            with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                for _ in range(count):
                    question, choices, answer = make(rng)
                    writer.writerow([question, *choices, LETTERS[answer]])
    return root


def _words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]+", text)  # the same split as pre_tokenizers.Whitespace


def build_tokenizer(root: str | os.PathLike[str], *, extra_text: str = "") -> Any:
    """A word-level ``PreTrainedTokenizerFast`` covering the corpus and the MMLU prompt template.

    Built offline with the ``tokenizers`` library; ``" A"`` .. ``" D"`` are single tokens, as the
    MMLU single-token scoring path needs. ``<bos>`` is prepended like Llama/DeepSeek tokenizers do.
    """
    template = ("The following are multiple choice questions ( with answers ) about "
                f"{' '.join(s.replace('_', ' ') for s in SUBJECTS)} .\n\nA . B . C . D . Answer : {extra_text}")
    vocab_words = set(_words(template))
    for path in sorted(Path(root).rglob("*.csv")):
        with open(path, newline="") as f:
            for row in csv.reader(f):
                for cell in row:
                    vocab_words.update(_words(cell))
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(vocab_words - set(specials)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
