"""How one rule maps a rank's box of an in-memory tensor to its HF pieces (docs/design.md#key-names):
each piece a view of the rank's shard with its HF key, global shape and offsets. ``engine.py`` calls
``rule_pieces`` for every matched key, in both directions (``to_hf`` and ``from_hf``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import torch

from nemo_moe_export.adapters.protocol import HFShard
from nemo_moe_export.adapters.rules import KeyRule
from nemo_moe_export.errors import InputError
from nemo_moe_export.placement import LocalBox

__all__ = ["interleaved_pieces", "leading_rows", "one_part", "rule_pieces", "target_key", "viewed"]


def target_key(template: str, m: re.Match[str], expert: int | None) -> str:
    return template.format(**m.groupdict(), expert=expert)


def one_part(rule: KeyRule, m: re.Match[str]) -> KeyRule:
    """``rule`` for a key that names one target's piece alone (``parts``): that target, unsplit."""
    part = m.groupdict().get("part")
    if not part:
        return rule
    return dataclasses.replace(rule, targets=(rule.targets[rule.parts.index(part)],), parts=())


def leading_rows(box: LocalBox, rows: int) -> LocalBox:
    """``box`` cut to the first ``rows`` rows of the global tensor (a view; a rank holding only
    padding rows keeps an empty box, which yields no piece)."""
    start = min(box.offsets[0], rows)
    held = max(0, min(box.offsets[0] + box.local.shape[0], rows) - start)
    return dataclasses.replace(box, global_shape=(rows, *box.global_shape[1:]),
                               offsets=(start, *box.offsets[1:]), local=box.local.narrow(0, 0, held))


def viewed(key: str, box: LocalBox, shape: tuple[int, ...]) -> LocalBox:
    """``box`` with its (whole) tensor viewed as ``shape``: a view, so loads write through."""
    if any(box.offsets) or tuple(box.local.shape) != box.global_shape:
        raise InputError("a tensor the table views as experts must be whole on each rank", key=key,
                         expected=f"the whole {box.global_shape}",
                         actual=f"{tuple(box.local.shape)} at {box.offsets}")
    return dataclasses.replace(box, global_shape=shape, offsets=(0,) * len(shape), local=box.local.view(shape))


def interleaved_pieces(key: str, rule: KeyRule, m: re.Match[str], box: LocalBox, groups: int,
                        sizes: list[int], merge: bool) -> Iterator[HFShard]:
    """The parts of an interleaved split: target ``i`` is part ``i`` of every group (``sizes[i]``
    rows of each ``sum(sizes)``-row block), in group order. One view per group, joined into one
    copy when ``merge`` (a contiguous run of the in-memory dim always lands on a contiguous run of
    each target)."""
    d, block = rule.split_dim, sum(sizes)
    start, stop = box.offsets[d], box.offsets[d] + box.local.shape[d]
    first = 0
    for template, size in zip(rule.targets, sizes):
        runs = []  # (row in the target, view)
        for g in range(groups):
            lo, hi = max(g * block + first, start), min(g * block + first + size, stop)
            if lo < hi:
                runs.append((g * size + lo - g * block - first, box.local.narrow(d, lo - start, hi - lo)))
        first += size
        if merge and len(runs) > 1:
            runs = [(runs[0][0], torch.cat([view for _, view in runs], dim=d))]
        shape = tuple(groups * size if k == d else s for k, s in enumerate(box.global_shape))
        for row, view in runs:
            if view.numel():
                offsets = tuple(row if k == d else o for k, o in enumerate(box.offsets))
                yield HFShard(target_key(template, m, None), shape, offsets, view, box.primary, key, None,
                              box.replica, box.replicas)


def rule_pieces(key: str, rule: KeyRule, m: re.Match[str], box: LocalBox,
                 experts: tuple[int, ...] | None = None) -> Iterator[HFShard]:
    """Intersect this rank's box with each HF tensor the rule makes; yield views, not copies.
    ``experts``: the global ids of the box's experts when the model numbers them (local experts)."""
    if rule.per_expert:
        first = box.offsets[0]
        items = [(experts[i] if experts else first + i, box.local[i]) for i in range(box.local.shape[0])]
        inner_offsets = box.offsets[1:]
        inner_shape = box.global_shape[1:]
    else:
        items = [(experts[0] if experts else None, box.local)]
        inner_offsets, inner_shape = box.offsets, box.global_shape
    n_parts, d = len(rule.targets), rule.split_dim
    part = inner_shape[d] // n_parts if inner_shape else 0
    for expert, local in items:
        if local.numel() == 0:
            continue
        for i, template in enumerate(rule.targets):
            if n_parts == 1:
                view, offsets, shape = local, inner_offsets, inner_shape
            else:
                lo = max(i * part, inner_offsets[d])
                hi = min((i + 1) * part, inner_offsets[d] + local.shape[d])
                if lo >= hi:
                    continue
                view = local.narrow(d, lo - inner_offsets[d], hi - lo)
                offsets = tuple(lo - i * part if k == d else o for k, o in enumerate(inner_offsets))
                shape = tuple(part if k == d else s for k, s in enumerate(inner_shape))
            if rule.transpose:
                view, offsets, shape = view.t(), tuple(reversed(offsets)), tuple(reversed(shape))
            yield HFShard(target_key(template, m, expert), tuple(shape), tuple(offsets), view,
                          box.primary, key, expert, box.replica, box.replicas)
