"""The suite's judge of inexact results (tests/bounds.py) can fail: a swapped decided answer, a
difference beyond the bound and a comparison that decides too little are each refused, while a
near-tie answered either way is not. Also the product's reload check (evaluate/agreement.py)."""

from __future__ import annotations

import pytest
import torch

from bounds import Bound, check_close, judge_answers, judge_choices
from nemo_moe_export.evaluate.agreement import compare_answers

BOUND = Bound(0.01, "a test's bound")
REFERENCE = [[1.0, 0.5, 0.2], [0.300, 0.305, 0.1], [2.0, 1.0, 0.0], [0.0, 0.9, 0.1]]  # row 1: a near-tie


def test_a_near_tie_answered_otherwise_is_not_judged():
    got = [[1.0, 0.5, 0.2], [0.306, 0.300, 0.1], [2.0, 1.0, 0.0], [0.0, 0.9, 0.1]]
    judgement = judge_choices(REFERENCE, got, BOUND, "near-tie flipped")
    assert (judgement.decided, judgement.total, judgement.disagreeing) == (3, 4, [])


def test_a_decided_answer_answered_otherwise_fails():
    got = [row[:] for row in REFERENCE]
    got[2] = [1.0, 2.0, 0.0]  # the reference's gap is 1.0: far beyond 2 x 0.01
    with pytest.raises(AssertionError, match=r"choices differ at 1 decided positions \[2\]"):
        judge_choices(REFERENCE, got, BOUND, "swapped")
    with pytest.raises(AssertionError, match="choices differ"):
        judge_choices(REFERENCE, [0, 1, 1, 1], BOUND, "as indices")


def test_too_few_decided_positions_fail():
    with pytest.raises(AssertionError, match="too few to judge"):
        judge_choices(REFERENCE, REFERENCE, Bound(0.45, "wide"), "wide bound", min_decided=0.5)


def test_a_difference_beyond_the_bound_fails_and_names_its_source():
    with pytest.raises(AssertionError, match=r"exceeds the bound 0.01 \(a test's bound\)"):
        check_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.02]), BOUND, "beyond")
    with pytest.raises(AssertionError, match="exceeds the bound"):
        judge_answers({"scores": [[1.0, 0.0]]}, {"scores": [[1.0, 0.5]]}, "scores moved", BOUND)


def test_ragged_choices_are_padded_and_never_chosen():
    judgement = judge_choices([[1.0, 0.0], [0.0, 1.0, 0.5]], [[0.9, 0.0], [0.0, 1.0, 0.4]], BOUND, "ragged")
    assert (judgement.decided, judgement.disagreeing) == (2, [])


def test_the_reload_check_fails_a_decided_difference_and_reports_a_near_tie():
    trained = [[-7.0, -7.5, -8.0], [-7.2, -7.2000001, -9.0]]
    near_tie = [[-7.0, -7.5, -8.0], [-7.2000001, -7.2, -9.0]]
    report = compare_answers(trained, near_tie, torch.float32)
    assert report["ok"] and report["decided"] == 1 and report["differ_undecided"] == [1], report
    swapped = [[-7.5, -7.0, -8.0], [-7.2, -7.2000001, -9.0]]
    report = compare_answers(trained, swapped, torch.float32)
    assert not report["ok"] and report["differ_decided"] == [0], report
    assert not compare_answers(trained, [[-7.0, -7.5, -8.1], trained[1]], torch.float32)["ok"]  # beyond 1e-5
    assert compare_answers(trained, [[-7.0, -7.5, -8.1], trained[1]], torch.bfloat16)["ok"]  # within 2**-6 x 9
