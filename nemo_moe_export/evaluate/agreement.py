"""Do two evaluations of the same weights give the same answers? (the recipe's reload check)

The trained, sharded model and its export reloaded by ``transformers`` in one process compute the
same forward in another order, and in the coarser of the two dtypes. Their per-choice scores differ
by rounding, so a question whose best two choices are nearly tied can be answered either way on
some CPU or GPU. Two evaluations *agree* when

* every score is within the tolerance of the dtype (relative to the largest |score|): a wrong or
  missing weight moves scores far beyond it, and
* the answers are equal on every question the trained model *decides*: its top-2 score gap exceeds
  twice the tolerance, so no rounding within the tolerance can swap them.

Answers that differ on undecided questions are reported, not failed (docs/design.md#answer-agreement).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from nemo_moe_export.evaluate.scoring import predict

__all__ = ["ANSWER_RTOL", "compare_answers", "coarsest_dtype"]

# Tolerance of a score, relative to the largest |score|, by the coarser dtype of the two forwards:
# fp32 84 ulps of the largest score (order-of-summation differences measured at up to 6 ulps);
# bf16 and fp16 two ulps of it (a cast export rounds the weights once, and each side rounds its
# log-likelihoods once); FP8 e4m3 weights keep 3 mantissa bits (2**-4 relative each).
ANSWER_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9,
               torch.float8_e4m3fn: 2.0 ** -4}


def coarsest_dtype(*dtypes: torch.dtype | None) -> torch.dtype:
    """The dtype of the largest tolerance among those given (None: not given)."""
    known = [d for d in dtypes if d is not None]
    return max(known, key=lambda d: ANSWER_RTOL[d]) if known else torch.float32


def _margin(scores: Sequence[float]) -> float:
    top = sorted(scores, reverse=True)
    return top[0] - top[1] if len(top) > 1 else math.inf


def compare_answers(trained: Sequence[Sequence[float]], reloaded: Sequence[Sequence[float]],
                    dtype: torch.dtype) -> dict[str, Any]:
    """How the reloaded evaluation's answers agree with the trained model's (per-choice scores of
    each question, in question order); ``ok`` as the module says."""
    if len(trained) != len(reloaded) or any(len(a) != len(b) for a, b in zip(trained, reloaded)):
        return {"ok": False, "problem": "the two evaluations scored different questions or choices",
                "questions": [len(trained), len(reloaded)]}
    scale = max((abs(s) for q in trained for s in q), default=0.0)
    tolerance = ANSWER_RTOL[dtype] * scale
    worst = max((abs(a - b) for q, r in zip(trained, reloaded) for a, b in zip(q, r)), default=0.0)
    decided = [_margin(q) > 2 * tolerance for q in trained]
    differ = [i for i, (q, r) in enumerate(zip(trained, reloaded)) if predict(q) != predict(r)]
    differ_decided = [i for i in differ if decided[i]]
    return {"ok": not differ_decided and worst <= tolerance, "dtype": str(dtype).removeprefix("torch."),
            "questions": len(trained), "decided": sum(decided), "same_answers": len(trained) - len(differ),
            "max_score_diff": worst, "tolerance": tolerance, "differ_decided": differ_decided,
            "differ_undecided": [i for i in differ if not decided[i]]}
