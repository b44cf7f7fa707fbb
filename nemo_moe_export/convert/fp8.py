"""FP8 block quantization in the conversion: the export's own (docs/design.md#checkpoint-conversion).

``quantize="fp8_block"`` writes what the in-job export's FP8 path writes (``export/quantize.py``:
its choice of keys, its plan of scales, its block math and its rows in batches). A 128 x 128 block
may span stored boxes (TP shards, GLU halves, expert boxes, query groups); its scale needs the
amax of all of it. Rather than exchange partial blocks, every box feeding one block goes to the
same rank: :func:`units_of` links the boxes whose pieces share a block (the blocks crossing a
piece's edge), and ``assign.assign_units`` balances these units by bytes. A rank then reads a unit
whole (a unit of one box: as it streams), and quantizes its pieces with no communication. Real
checkpoints' dimensions are multiples of 128, so almost every unit is one box.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nemo_moe_export.adapters import HFShard
from nemo_moe_export.convert.index import CheckpointIndex, StoredChunk
from nemo_moe_export.convert.reader import ReadStats, read_chunks
from nemo_moe_export.convert.tables import CheckpointTable, meta_pieces
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan
from nemo_moe_export.export.quantize import (block_ids, crossing_block_ids, fp8_plan, keys_to_quantize,
                                             quantize_whole_blocks, scale_pieces)

__all__ = ["Fp8Layout", "fp8_layout", "units_of", "write_units"]


@dataclass(frozen=True)
class Fp8Layout:
    """What is quantized (``keys``), every block's id (``ids``: ``export/quantize.block_ids``) and how."""

    keys: frozenset[str]
    ids: dict[str, tuple[int, int]]
    scale_fmt: str | None
    staging_bytes: int

    def split(self, pieces: list[HFShard]) -> tuple[list[HFShard], list[HFShard]]:
        """``pieces`` as (written as they are, quantized)."""
        return [p for p in pieces if p.key not in self.keys], [p for p in pieces if p.key in self.keys]

    def with_scales(self, pieces: list[HFShard]) -> list[HFShard]:
        """``pieces`` (meta) and the scale pieces their quantized ones write: for the coverage check."""
        return [*pieces, *scale_pieces(self.split(pieces)[1])]


def fp8_layout(plan: ExportPlan, options: ExportOptions, hf_config: Any) -> tuple[ExportPlan, Fp8Layout]:
    """The quantized plan (``export/quantize.fp8_plan``) and its layout, as the export lays them out."""
    keys = keys_to_quantize(plan, options, hf_config)
    quantized = fp8_plan(plan, keys, options.max_shard_bytes)
    return quantized, Fp8Layout(keys, block_ids(keys, quantized), options.scale_fmt, options.staging_bytes)


def units_of(chunks: list[StoredChunk], table: CheckpointTable, index: CheckpointIndex,
             layout: Fp8Layout) -> list[list[StoredChunk]]:
    """``chunks`` (read order) grouped so that the boxes feeding one block share a unit (union-find
    over the blocks crossing their pieces' edges); units in read order of their first box. Pure:
    the same on every rank."""
    parent = list(range(len(chunks)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    holder: dict[int, int] = {}  # block id -> the first box feeding it
    for i, chunk in enumerate(chunks):
        for piece in layout.split(list(meta_pieces(table, index, [chunk])))[1]:
            for block in crossing_block_ids(piece, layout.ids):
                parent[root(i)] = root(holder.setdefault(block, i))
    units: dict[int, list[StoredChunk]] = {}
    for i, chunk in enumerate(chunks):
        units.setdefault(root(i), []).append(chunk)
    return list(units.values())


def _segments(units: list[list[StoredChunk]]) -> Iterator[list[list[StoredChunk]]]:
    """Runs of one-box units (read as one stream), and each larger unit alone (read whole)."""
    run: list[list[StoredChunk]] = []
    for unit in units:
        if len(unit) == 1:
            run.append(unit)
            continue
        if run:
            yield run
        run = []
        yield [unit]
    if run:
        yield run


def write_units(index: CheckpointIndex, table: CheckpointTable, units: list[list[StoredChunk]], layout: Fp8Layout,
                reads: ReadStats, write: Callable[[list[HFShard]], None], done: Callable[[int], None]) -> None:
    """Read this rank's ``units``, write their plain pieces as they come and, once a unit is
    whole, its quantized pieces (scales, then FP8 rows in batches). Holds at most one unit's boxes
    (with one-box units, one box)."""
    for segment in _segments(units):
        unit_of = {id(c): u for u, unit in enumerate(segment) for c in unit}
        left = [len(unit) for unit in segment]
        held: list[list[HFShard]] = [[] for _ in segment]
        for chunk, tensor in read_chunks(index, [c for unit in segment for c in unit], reads):
            plain, quantized = layout.split(table.pieces(chunk.key, chunk.offsets, tensor))
            write(plain)
            u = unit_of[id(chunk)]
            held[u] += quantized
            left[u] -= 1
            if not left[u]:
                for batch in quantize_whole_blocks(held[u], layout.ids, layout.scale_fmt, layout.staging_bytes):
                    write(batch)
                held[u] = []
            done(chunk.length)
