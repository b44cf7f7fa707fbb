"""The small collectives coordination runs on: gloo side groups made once per job, and an
all-reduce in log2(W) rounds (docs/design.md#coordination-protocol).

Why not torch's own: gloo's all-reduce is a ring, ``2 (W - 1)`` hops one after the other whatever
the payload, and a new gloo group connects every rank to every other (``W - 1`` connections each).
At 1,024 ranks that made the export's few small agreements cost seconds. Here:

* :func:`gloo_group` opens a gloo group over given ranks once per job (cached by ranks and timeout
  under the default group) with lazy connections (``TORCH_GLOO_LAZY_INIT``): a rank connects only
  to the peers it exchanges with, which for :func:`butterfly_all_reduce` is ``log2 W`` of them.
* :func:`butterfly_all_reduce` is recursive doubling over point-to-point sends: in round ``k``
  rank ``r`` swaps its running value with rank ``r XOR 2**k`` and both combine the two, so after
  ``log2 W`` rounds every rank holds the result. Both partners compute ``op(a, b)`` from the same
  two operands, so every rank ends with the same bits, floating-point sums included. A world that
  is not a power of two folds its extra ranks into the first ones (one round before, one after).

Waiting is the caller's (``parallel.Coordinator`` bounds it by a timeout and its alarm): this
module only sends, receives and combines.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COMBINE", "FINGERPRINT_WORDS", "all_same", "butterfly_all_reduce", "butterfly_rounds", "fingerprint_words",
           "forget_gloo_group", "gloo_group"]

COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add, "max": torch.maximum, "min": torch.minimum,
}
"""How two partial results combine, by reduce op name (each commutative: partners agree bitwise)."""

# Side groups, created once per job: keyed by the default process group (a job that re-initialises
# torch.distributed gets new ones), then by member ranks (None: the whole world) and timeout.
_GROUPS: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()


def gloo_group(ranks: tuple[int, ...] | None, timeout: timedelta, *, members_only: bool = False) -> Any:
    """A gloo group over ``ranks`` (every rank of the world when None), made once per job.

    Connections are made lazily, on a pair's first message, so a rank pays only for the peers it
    talks to. ``members_only``: only the members take part in creating it (a subgroup created
    by some ranks only); otherwise, as for any ``new_group``, every rank of the world calls this
    in the same order."""
    groups = _GROUPS.setdefault(dist.distributed_c10d._get_default_group(), {})
    key = (ranks, timeout)
    if key not in groups:
        previous = os.environ.get("TORCH_GLOO_LAZY_INIT")
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read when the group is constructed
        try:
            groups[key] = dist.new_group(ranks=None if ranks is None else list(ranks), backend="gloo",
                                         timeout=timeout, use_local_synchronization=members_only)
        finally:
            if previous is None:
                os.environ.pop("TORCH_GLOO_LAZY_INIT")
            else:
                os.environ["TORCH_GLOO_LAZY_INIT"] = previous
    return groups[key]


def forget_gloo_group(group: Any) -> None:
    """Stop reusing ``group``: a broken agreement may have left messages in flight on its pairs.
    Every member breaks at the same agreement, so each makes a new group next time alike."""
    for groups in _GROUPS.values():
        for key in [k for k, g in groups.items() if g is group]:
            del groups[key]


# Fingerprints compared by a sum: 4 pieces of 16 bits of a hash, and their squares. Over n ranks,
# all pieces are equal exactly when n * sum(p**2) == sum(p)**2 for each piece (equality in
# Cauchy-Schwarz); int64 holds both sides for up to 2**15 ranks.
_PIECES, _PIECE_BITS = 4, 16
FINGERPRINT_WORDS = 2 * _PIECES


def fingerprint_words(value: Any) -> torch.Tensor:
    """int64 words whose sum over the ranks tells whether every rank had the same ``value``
    (:func:`all_same`); they ride on any sum all-reduce (``Coordinator.agree(sums=...)``)."""
    digest = int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little")
    pieces = [(digest >> (_PIECE_BITS * i)) & ((1 << _PIECE_BITS) - 1) for i in range(_PIECES)]
    return torch.tensor(pieces + [p * p for p in pieces], dtype=torch.int64)


def all_same(summed: torch.Tensor, ranks: int) -> bool:
    """Whether the sum over ``ranks`` ranks of their :func:`fingerprint_words` came from one value."""
    total, squares = summed[:_PIECES], summed[_PIECES:]
    return bool(torch.equal(ranks * squares, total * total))


def butterfly_rounds(size: int) -> int:
    """Messages one after the other of :func:`butterfly_all_reduce` on ``size`` ranks: ``log2`` of
    the largest power of two within ``size``, plus two when ``size`` is not one (fold in and out)."""
    if size <= 1:
        return 0
    power = 1 << (size.bit_length() - 1)
    return power.bit_length() - 1 + (2 if power != size else 0)


def butterfly_all_reduce(tensor: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    """Reduce the CPU ``tensor`` over the gloo ``group`` in place by recursive doubling; returns it.

    Blocks until done (run it where a timeout watches: ``Coordinator``). Every member must call it
    with a tensor of the same shape and dtype, in the same order as its other collectives."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return tensor
    combine = COMBINE[op]
    power = 1 << (size.bit_length() - 1)
    extra = size - power
    if rank >= power:  # folded in: hand the value to rank - power, receive the result back
        _exchange(tensor, group, send_to=rank - power)
        return tensor.copy_(_exchange(tensor, group, receive_from=rank - power))
    if rank < extra:
        tensor.copy_(combine(tensor, _exchange(tensor, group, receive_from=rank + power)))
    mask = 1
    while mask < power:
        peer = rank ^ mask
        tensor.copy_(combine(tensor, _exchange(tensor, group, send_to=peer, receive_from=peer)))
        mask <<= 1
    if rank < extra:
        _exchange(tensor, group, send_to=rank + power)
    return tensor


# The tag of the butterfly's messages: apart from the tags gloo's collectives take on the same group
# (a counter from 0), so a collective never matches one of them.
_TAG = 0x4E4D45


def _exchange(tensor: torch.Tensor, group: Any, *, send_to: int | None = None,
              receive_from: int | None = None) -> torch.Tensor:
    """Send ``tensor`` to and/or receive a tensor like it from group ranks; returns what came."""
    works, received = [], torch.empty_like(tensor)
    if send_to is not None:
        works.append(dist.isend(tensor, group=group, group_dst=send_to, tag=_TAG))
    if receive_from is not None:
        works.append(dist.irecv(received, group=group, group_src=receive_from, tag=_TAG))
    for work in works:
        work.wait()
    return received
