"""Step 2a of an evaluation: which rows share a k-shot prefix (docs/design.md#shared-prefix-evaluation).

Every question of a subject repeats the same description and k dev examples verbatim; in 5-shot
MMLU that is about 84% of all tokens. A subject's *shared prefix* is the longest run of leading
tokens that all of its rows have in common, read off the tokenized rows themselves, so feeding
``prefix + row[len(prefix):]`` is feeding exactly the tokens of the full prompt, whatever the
tokenizer merges across the boundary. It stops short of every row's scored positions (those must
be fed in the row's own forward), and rows cut from the left (``Row.truncated``) keep their full
prompts. Pure and deterministic: every rank finds the same prefixes from the same rows, so the
plan fingerprint covers them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_moe_export.evaluate.prepare import PreparedQuestions, Row

__all__ = ["CHUNKED_MODELS", "MIN_SHARED_TOKENS", "SharedPrefix", "find_shared_prefixes", "prefix_multiple"]

MIN_SHARED_TOKENS = 32
"""A prefix shorter than this is not worth a forward of its own (k_shot=0 shares only the
one-line description): its rows run as full prompts."""

CHUNKED_MODELS: dict[str, int] = {"kimi_linear": 64}
"""``config.model_type`` -> the chunk length of its linear attention (transformers' ``chunk_kda``
and the fla kernel). A prefix is cut at a multiple of it, so the prefix and the rest are computed
in the same chunks as the full prompt; a prefix ending mid-chunk changes the fp32 logits by about
1e-5 of their size."""


def prefix_multiple(model: Any) -> int:
    """What a shared prefix's length must be a multiple of for ``model`` (1: anything)."""
    return CHUNKED_MODELS.get(getattr(getattr(model, "config", None), "model_type", None), 1)


@dataclass(frozen=True)
class SharedPrefix:
    """Leading tokens the ``rows`` of one subject share; each row feeds ``input_ids[len(token_ids):]``
    after them."""

    prefix_id: int
    subject: str
    token_ids: tuple[int, ...]
    rows: tuple[int, ...]  # row ids, in row order

    @property
    def length(self) -> int:
        return len(self.token_ids)


def find_shared_prefixes(prepared: PreparedQuestions, min_tokens: int = MIN_SHARED_TOKENS,
                         multiple: int = 1) -> tuple[SharedPrefix, ...]:
    """The shared prefix of each subject with at least two uncut rows and ``min_tokens`` in common,
    cut to a multiple of ``multiple`` tokens (:func:`prefix_multiple`), in subject order;
    ``prefix_id`` is the position in the returned tuple."""
    by_subject: dict[str, list[Row]] = {}
    for row in prepared.rows:
        if not row.truncated:
            by_subject.setdefault(prepared.questions[row.question].subject, []).append(row)
    found: list[SharedPrefix] = []
    for subject in sorted(by_subject):
        rows = by_subject[subject]
        length = min(_common_prefix_length([r.input_ids for r in rows]),
                     min(len(r.input_ids) - r.scored_positions for r in rows)) // multiple * multiple
        if len(rows) >= 2 and length >= min_tokens:
            found.append(SharedPrefix(len(found), subject, rows[0].input_ids[:length],
                                      tuple(r.row_id for r in rows)))
    return tuple(found)


def _common_prefix_length(sequences: Sequence[tuple[int, ...]]) -> int:
    """Length of the longest common prefix; tuple slices compare in C, a mismatch is bisected."""
    first = sequences[0]
    n = len(first)
    for seq in sequences[1:]:
        n = min(n, len(seq))
        if seq[:n] == first[:n]:
            continue
        lo, hi = 0, n  # first[:lo] == seq[:lo], first[:hi] != seq[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if seq[:mid] == first[:mid] else (lo, mid)
        n = lo
    return n
