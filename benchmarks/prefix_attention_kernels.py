"""CUDA check of the packed shared-prefix attention's kernels against SDPA in float64; prints JSON.

The two parts ``nemo_moe_export/evaluate/prefix_attention.py`` combines, in bf16 with MLA's head
sizes (keys 192, values 128), against float64 attention and log-sum-exp:

* the prefix part: flash attention with its log-sum-exp, many queries against one prefix's keys, no mask;
* the own part: flash attention's variable-length kernel, each packed sequence causal over itself.

    python benchmarks/prefix_attention_kernels.py --out benchmarks/results/h200_prefix_attention_kernels.json
"""

from __future__ import annotations

import argparse
import os
import sys
from itertools import accumulate

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from output import emit  # noqa: E402  (benchmarks/output.py)

SCALE = 192 ** -0.5
HEADS = 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (q.double() @ k.double().transpose(-1, -2)) * SCALE
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v.double(), scores.logsumexp(-1)


def _random(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=gen).bfloat16()


def prefix_part(gen: torch.Generator) -> dict:
    from nemo_moe_export.evaluate.prefix_attention import attention_with_lse

    q, k, v = _random(gen, 1, HEADS, 3000, 192), _random(gen, 1, HEADS, 512, 192), _random(gen, 1, HEADS, 512, 128)
    out, lse = attention_with_lse(q, k, v, SCALE, causal=False)
    want, want_lse = _reference(q, k, v, causal=False)
    return dict(kernel="prefix part (flash, log-sum-exp)", queries=3000, keys=512,
                out_max_abs=float((out.double() - want).abs().max()), out_max=float(want.abs().max()),
                lse_max_abs=float((lse.double() - want_lse).abs().max()))


def own_part(gen: torch.Generator) -> dict:
    from nemo_moe_export.evaluate.prefix_attention import _own_attention

    lengths = [37, 250, 1, 96, 411]
    starts = tuple(accumulate(lengths, initial=0))
    q, k, v = (_random(gen, 1, HEADS, starts[-1], d) for d in (192, 192, 128))
    out, lse = _own_attention(q, k, v, starts, SCALE)
    worst_out = worst_lse = 0.0
    for a, b in zip(starts, starts[1:]):
        want, want_lse = _reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)
        worst_out = max(worst_out, float((out[:, :, a:b].double() - want).abs().max()))
        worst_lse = max(worst_lse, float((lse[:, :, a:b].double() - want_lse).abs().max()))
    return dict(kernel="own part (variable-length flash, log-sum-exp)", sequence_lengths=lengths,
                out_max_abs=worst_out, lse_max_abs=worst_lse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    emit([prefix_part(gen), own_part(gen)], args.out)


if __name__ == "__main__":
    main()
