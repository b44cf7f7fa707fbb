"""Judging results of inexact arithmetic: each bound says where it comes from, and agreement of
choices (argmax, predictions) is judged only where the reference decides them beyond the bound.

Two computations of the same forward in a different order (bf16 vs fp32, expert parallel vs one
process, tensor-parallel partial sums, another CPU's GEMM kernels) differ by rounding. A test that
requires their argmax to be equal everywhere passes or fails with the CPU at positions where the
reference's best two scores are nearly tied. So:

* ``Bound`` is an error bound on one score (a logit, a log-likelihood) with its source: dtype
  epsilon, reduction length, or a measured worst case with a margin (the figure measured and where);
* ``check_close`` asserts the largest difference is within the bound and returns the figure;
* ``judge_choices`` asserts the choices agree at every *decided* position: one whose reference
  top-2 gap exceeds ``2 * bound`` (each of the two scores may move by ``bound``, so no rounding
  within the bound can swap them there). It also asserts that enough positions were decided, so a
  comparison cannot pass by judging none, and records the count for the run's summary.

Exact equality stays exact where the arithmetic is the same (the export's bytes, the same modules on
the same inputs); this module is for the rest.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: one bf16 rounding is within half of this, relative

# What the run judged and measured, for the terminal summary (conftest.py prints it): per test,
# (what, decided, total, bound) of each comparison of choices and (what, measured, bound) of each
# check_close.
JUDGED: dict[str, list[tuple[str, int, int, "Bound"]]] = {}
MEASURED: dict[str, list[tuple[str, float, "Bound"]]] = {}


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]


def summary_lines() -> list[str]:
    """One line per test: how many comparisons, the fewest positions any of them could judge, the
    worst measured difference against its bound; then each bound's source, once."""
    lines, sources = [], {}
    for test in sorted(set(JUDGED) | set(MEASURED)):
        parts = []
        if test in MEASURED:
            what, measured, bound = max(MEASURED[test], key=lambda m: m[1] / m[2].value)
            parts.append(f"{len(MEASURED[test])} within bounds, worst {measured:.3g} <= {bound.value:.3g}")
            sources.update({m[2].source: None for m in MEASURED[test]})
        if test in JUDGED:
            what, decided, total, bound = min(JUDGED[test], key=lambda j: j[1] / j[2])
            parts.append(f"{len(JUDGED[test])} judged, fewest decided {decided}/{total} ({what})")
            sources.update({j[3].source: None for j in JUDGED[test]})
        lines.append(f"{test}: " + "; ".join(parts))
    return lines + ["bounds:"] + [f"  {source}" for source in sources]


@dataclass(frozen=True)
class Bound:
    """An error bound on one score, with where it comes from."""

    value: float
    source: str

    def __post_init__(self) -> None:
        if not (self.value > 0 and math.isfinite(self.value)):
            raise ValueError(f"a bound must be positive and finite, got {self.value}")
        if not self.source:
            raise ValueError("a bound states where it comes from")

    def scaled(self, scale: float, why: str) -> "Bound":
        """This bound relative to a magnitude (e.g. the largest |logit| of the reference)."""
        return Bound(self.value * scale, f"{self.source}; x {scale:.3g} ({why})")


# fp32 forwards of the same weights in another order (sharded or pipelined vs one process, tensor-
# parallel partial sums, megatron-core vs transformers, another batch composition or CPU's GEMM
# kernels). Logits relative to the largest |logit| of the reference (the tiny models' reach 10 at
# initializer_range 0.5, where one ulp is 9.5e-7): 1e-5 is 84 ulps of the largest, eight times the
# worst measured. MMLU / ARC log-likelihoods are below 32 in magnitude (ulp <= 3.8e-6).
FP32_LOGITS = Bound(1e-5, "fp32 logits in another summation order, of the largest |logit|: 84 ulps; "
                          "measured <= 1.3e-6 on AMD EPYC (TP2 Qwen3-MoE)")
FP32_SCORES = Bound(1e-4, "fp32 log-likelihoods (|score| < 32) in another summation order: >= 26 ulps; "
                          "measured <= 4.6e-5 on AMD EPYC (ours vs lm-eval, ARC 2-shot)")
# Gradients likewise, relative to each tensor's largest |gradient|.
FP32_GRADS = Bound(3e-5, "fp32 gradients in another summation order, of the tensor's largest |gradient|: "
                         "measured <= 3.5e-6 on AMD EPYC (TP2 Qwen3-MoE)")


def relative_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want|: the figure FP32_LOGITS and FP32_GRADS bound."""
    got, want = as_scores(got), as_scores(want)
    return max_abs_diff(got, want) / max(float(want.abs().max()), 1e-30) if got.shape == want.shape else math.inf


@dataclass
class Judgement:
    """What one comparison of choices could judge."""

    what: str
    total: int
    decided: int
    disagreeing: list[int] = field(default_factory=list)


def as_scores(values: Any) -> torch.Tensor:
    """Scores as a float64 tensor ``[..., choices]`` (tensors of any float dtype, lists of lists; a
    ragged list, questions with different numbers of choices, padded with -inf: never chosen)."""
    if isinstance(values, torch.Tensor):
        return values.detach().to(torch.float64).cpu()
    rows = list(values)
    if rows and all(isinstance(r, (list, tuple)) for r in rows) and len({len(r) for r in rows}) > 1:
        width = max(len(r) for r in rows)
        rows = [list(r) + [-math.inf] * (width - len(r)) for r in rows]
    return torch.tensor(rows, dtype=torch.float64)


def max_abs_diff(got: Any, want: Any) -> float:
    """Largest |got - want| over all elements (NaN counts as infinitely far)."""
    got, want = as_scores(got), as_scores(want)
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    diff = (got - want).abs().masked_fill(got == want, 0.0)  # ragged rows' -inf padding on both sides
    return math.inf if bool(torch.isnan(diff).any()) else float(diff.max()) if diff.numel() else 0.0


def check_figure(measured: float, bound: Bound, what: str) -> float:
    """A difference measured elsewhere (a rank's own comparison): asserts it is within the bound."""
    MEASURED.setdefault(_current_test(), []).append((what, measured, bound))
    assert measured <= bound.value, (f"{what}: difference {measured:.3g} exceeds the bound {bound.value:.3g} "
                                     f"({bound.source})")
    return measured


def check_close(got: Any, want: Any, bound: Bound, what: str) -> float:
    """Asserts max |got - want| <= bound; returns the measured figure."""
    return check_figure(max_abs_diff(got, want), bound, f"{what}: max |difference|")


def _chosen(got: Any, shape: torch.Size) -> torch.Tensor:
    """The chosen index per position: ``got`` is scores of the reference's shape, or indices."""
    if isinstance(got, torch.Tensor) and got.shape == shape:
        return got.argmax(-1).cpu()
    if not isinstance(got, torch.Tensor) and got and isinstance(got[0], (list, tuple)):
        got = as_scores(got)  # per-choice scores, maybe ragged
    got_t = torch.as_tensor(got)
    if got_t.shape == shape:
        return got_t.to(torch.float64).argmax(-1)
    if got_t.shape != shape[:-1]:
        raise AssertionError(f"choices of shape {tuple(got_t.shape)} for scores of shape {tuple(shape)}")
    return got_t.long()


def judge_choices(reference: Any, got: Any, bound: Bound, what: str, *, min_decided: float = 0.5,
                  mask: Any = None) -> Judgement:
    """``got``'s choice (its argmax, or the index given) equals the reference's argmax at every
    position the reference decides beyond ``bound``; at least ``min_decided`` of the positions (a
    fraction) must be decided. ``mask`` (bool, the positions' shape) keeps only real positions.

    ``reference`` holds scores ``[..., choices]``; ``got`` the same shape of scores, or indices.
    """
    ref = as_scores(reference)
    chosen = _chosen(got, ref.shape).reshape(-1)
    ref = ref.reshape(-1, ref.shape[-1])
    keep = torch.ones(ref.shape[0], dtype=torch.bool) if mask is None else torch.as_tensor(mask).reshape(-1).bool().cpu()
    top2 = ref.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    decided = keep & (gap > 2 * bound.value)
    wrong = decided & (chosen != ref.argmax(-1))
    judgement = Judgement(what, total=int(keep.sum()), decided=int(decided.sum()),
                          disagreeing=wrong.nonzero().flatten().tolist())
    JUDGED.setdefault(_current_test(), []).append((what, judgement.decided, judgement.total, bound))
    assert judgement.total > 0, f"{what}: no positions to judge"
    assert not judgement.disagreeing, (
        f"{what}: choices differ at {len(judgement.disagreeing)} decided positions "
        f"{judgement.disagreeing[:10]} (reference top-2 gap > 2 x {bound.value:.3g}, {bound.source})")
    assert judgement.decided >= min_decided * judgement.total, (
        f"{what}: only {judgement.decided}/{judgement.total} positions decided beyond 2 x {bound.value:.3g} "
        f"({bound.source}): too few to judge")
    return judgement


def letters_to_indices(predictions: Sequence[str], labels: str = "ABCD") -> list[int]:
    """MMLU's predicted letters as choice indices."""
    return [labels.index(p) for p in predictions]


def judge_predictions(reference_scores: Sequence[Sequence[float]], predictions: Sequence[str], bound: Bound,
                      what: str, *, labels: str = "ABCD", min_decided: float = 0.5) -> Judgement:
    """An evaluation's predicted letters against a reference run's per-choice scores (records'
    ``scores``), judged where the reference decides."""
    return judge_choices(reference_scores, letters_to_indices(predictions, labels), bound, what,
                         min_decided=min_decided)


def judge_answers(got: dict, want: dict, where: str, bound: Bound = FP32_SCORES) -> Judgement:
    """Two evaluations' answers (dicts with per-question ``scores``; ``pred`` and ``metrics`` where
    given): scores within the bound, the same answer wherever ``want`` decides it beyond the bound,
    and the metrics equal when every answer is (a near-tie answered otherwise moves its subject's
    accuracy by one question)."""
    check_close(got["scores"], want["scores"], bound, where)
    judgement = judge_choices(want["scores"], got["scores"], bound, where)
    if "metrics" in got and got.get("pred") == want.get("pred"):
        assert got["metrics"] == want["metrics"], where
    return judgement


def assert_reload_agrees(verify: dict) -> None:
    """The recipe's verify stage: the reload's answers agree with the trained model's
    (``evaluate/agreement.py``), and most questions were decided, so it judged something."""
    answers = verify.get("answers")
    assert verify["ok"] and answers and answers["ok"], verify
    assert answers["decided"] >= answers["questions"] / 2, answers
    JUDGED.setdefault(_current_test(), []).append(
        ("the recipe's reload", answers["decided"], answers["questions"],
         Bound(answers["tolerance"], f"evaluate/agreement.py ANSWER_RTOL[{answers['dtype']}] of the largest |score|")))
