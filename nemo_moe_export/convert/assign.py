"""Who reads which stored box: work assigned by source bytes, balanced over any number of ranks.

Pure and deterministic (docs/design.md#checkpoint-conversion): the boxes the table does not skip,
in (file, byte offset) order, are cut into ``world`` contiguous runs of about equal bytes, so each
rank reads a few long stretches of a few files, whatever world size saved the checkpoint; a rank's
share is within one box of ``total / world``. With FP8 block quantization the unit is a group of
boxes instead (:func:`assign_units`): all those feeding one 128 x 128 block go to one rank.
"""

from __future__ import annotations

from collections.abc import Callable

from nemo_moe_export.convert.index import CheckpointIndex, StoredChunk

__all__ = ["assign_units", "assign_work", "model_chunks"]


def model_chunks(index: CheckpointIndex, skipped: Callable[[str], bool]) -> list[StoredChunk]:
    """Every stored box of a tensor the table maps, in (file, byte offset) order."""
    chunks = [c for key, t in index.tensors.items() if not skipped(key) for c in t.chunks]
    return sorted(chunks, key=lambda c: (c.file, c.byte_offset, c.key))


def assign_work(chunks: list[StoredChunk], world: int) -> list[list[StoredChunk]]:
    """``chunks`` (in read order) cut into ``world`` contiguous runs of about equal bytes: a box
    goes to the rank whose byte range holds the box's middle byte."""
    return [[c for unit in units for c in unit] for units in assign_units([[c] for c in chunks], world)]


def assign_units(units: list[list[StoredChunk]], world: int) -> list[list[list[StoredChunk]]]:
    """``units`` (boxes that must go to one rank: FP8 blocks spanning boxes, ``convert/fp8.py``;
    in read order of their first box) cut into ``world`` contiguous runs of about equal bytes: a
    unit goes to the rank whose byte range holds the unit's middle byte; a rank's share is within
    one unit of ``total / world``."""
    world = max(world, 1)
    total = sum(c.length for unit in units for c in unit)
    work: list[list[list[StoredChunk]]] = [[] for _ in range(world)]
    done = 0
    for unit in units:
        length = sum(c.length for c in unit)
        middle = 2 * done + length  # twice the middle byte, to stay in integers
        rank = min(world - 1, middle * world // (2 * total)) if total else 0
        work[rank].append(unit)
        done += length
    return work
