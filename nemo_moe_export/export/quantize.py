"""FP8 block-quantized export, straight from the shards (docs/design.md#fp8-export).

``quantize="fp8_block"`` writes the weights the model family's table declares
(``ModelTable.fp8_weights``; ``ExportOptions.quantize_keys`` replaces that list) as
``float8_e4m3fn`` with ``{key}_scale_inv`` fp32 block scales, the format of DeepSeek's official
checkpoints (``adapters/fp8.py`` holds the block math). No rank gathers anything: each quantizes
the slices it writes anyway, its write shares (``plan.write_shares``). In the export's steps:

1. validate, on each rank: :func:`quantized_keys` and :func:`fp8_plan` (pure: which planned keys
   become FP8, and the plan with their dtype changed and their scale tensors added); then the max
   |w| of every 128 x 128 block this rank's shares touch, over its own elements only, one reduction
   per run of equally spaced shares (:func:`_runs`: the experts of a fused tensor), into one flat
   array. A block that lies wholly inside one share is final; the others cross a shard boundary.
2. validate, across ranks: one all-gather of the boundary blocks' partial amaxes (block id, amax),
   so every scale equals the one a whole-tensor quantization computes. Each scale is written by
   the one rank whose share holds the block's first element.
3. write: :class:`Fp8Writer` wraps the storage writer and quantizes the weight shares just before
   they are written, in batches of at most ``staging_bytes`` of FP8, so no rank holds more than its
   shard plus that batch and the writer's own staging.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from nemo_moe_export.adapters import HFShard, StateDictAdapter, TensorMeta, get_table
from nemo_moe_export.adapters.fp8 import (FP8_BLOCK, FP8_DTYPE, SCALE_SUFFIX, block_scales, official_quantization_config,
                                          quantize_with_scales)
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan, plan_export
from nemo_moe_export.export.storage import StorageWriter
from nemo_moe_export.export.writer import WriteStats

__all__ = ["Fp8WriteStats", "Fp8Writer", "block_ids", "crossing_block_ids", "fp8_plan", "keys_to_quantize",
           "quantization_config", "quantize_export", "quantize_whole_blocks", "quantized_keys", "scale_pieces"]


def quantization_config(options: ExportOptions) -> dict[str, Any] | None:
    """The ``quantization_config`` of ``config.json`` for what ``options`` write (None: not quantized)."""
    return official_quantization_config(options.scale_fmt) if options.quantize is not None else None


# --------------------------------------------------------------------------------------------------
# What is quantized, and the plan (pure: the same on every rank)
# --------------------------------------------------------------------------------------------------


def quantized_keys(plan: ExportPlan, adapter: StateDictAdapter, options: ExportOptions) -> frozenset[str]:
    """The planned keys written as FP8 (:func:`keys_to_quantize`), by ``adapter``'s table and config."""
    return keys_to_quantize(plan, options, adapter.config, adapter.table.fp8_weights)


def keys_to_quantize(plan: ExportPlan, options: ExportOptions, config: Any,
                     declared: tuple[str, ...] = ()) -> frozenset[str]:
    """The planned keys written as FP8: those matching ``options.quantize_keys`` (default: the
    patterns a table ``declared``, else the ``fp8_weights`` of ``config``'s model family), except
    keys matching ``keep_dtype``. Each must be a 2-D floating tensor; a pattern that matches
    anything else, or nothing at all, is refused."""
    patterns = [re.compile(p) for p in (options.quantize_keys or declared or _family_patterns(config))]
    keep = [re.compile(p) for p in options.keep_dtype]
    keys = set()
    for key, planned in plan.tensors.items():
        if not any(p.search(key) for p in patterns) or any(p.search(key) for p in keep):
            continue
        if len(planned.shape) != 2 or not planned.dtype.is_floating_point:
            raise InputError("only 2-D floating weights can be block-quantized", key=key,
                             expected="a floating [out, in] weight", actual=f"{planned.dtype} {planned.shape}",
                             hint="narrow quantize_keys (or the table's fp8_weights) to the linear weights")
        keys.add(key)
    if not keys:
        raise InputError("quantize='fp8_block' matches no weight of the model", key="quantize_keys",
                         expected=f"keys matching {[p.pattern for p in patterns]}",
                         actual=f"none of the {len(plan.tensors)} planned keys")
    return frozenset(keys)


def _family_patterns(config: Any) -> tuple[str, ...]:
    """The ``fp8_weights`` of ``config``'s model family: a table in another framework's names
    (megatron-core) or the conversion's key tables write the family's HF keys, so the family's
    transformers table answers for them."""
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    try:
        patterns = get_table(str(model_type)).fp8_weights
    except InputError:
        patterns = ()
    if not patterns:
        raise InputError("this model family declares no FP8 weights", key=str(model_type),
                         expected="a table with fp8_weights (deepseek_v3, kimi_k2, qwen3_moe) or quantize_keys",
                         actual="none", hint="pass quantize_keys=[...] with regexes of the linear weights to quantize")
    return patterns


def _grid(shape: tuple[int, ...]) -> tuple[int, int]:
    """The scale tensor's shape for a weight of ``shape``: one scale per block, edge blocks included."""
    return math.ceil(shape[0] / FP8_BLOCK[0]), math.ceil(shape[1] / FP8_BLOCK[1])


def fp8_plan(plan: ExportPlan, keys: Collection[str], max_shard_bytes: int) -> ExportPlan:
    """``plan`` with ``keys`` stored as ``float8_e4m3fn`` and a ``{key}_scale_inv`` fp32 tensor of
    shape ``[ceil(out / 128), ceil(in / 128)]`` beside each, laid out again (the scale sorts right
    after its weight) in files of at most ``max_shard_bytes`` (``ExportOptions.max_shard_bytes``),
    stamped with ``plan``'s export id."""
    metas: dict[str, TensorMeta] = {}
    for key, planned in plan.tensors.items():
        if key not in keys:
            metas[key] = TensorMeta(planned.shape, planned.dtype)
            continue
        if key + SCALE_SUFFIX in plan.tensors:
            raise InputError("the scale name of a weight to quantize is taken", key=key + SCALE_SUFFIX,
                             expected="no tensor of that name", actual="a planned tensor",
                             hint="a checkpoint's own scales cannot be written beside new ones")
        metas[key] = TensorMeta(planned.shape, FP8_DTYPE)
        metas[key + SCALE_SUFFIX] = TensorMeta(_grid(planned.shape), torch.float32)
    return plan_export(metas, max_shard_size=max_shard_bytes, export_id=plan.export_id)


# --------------------------------------------------------------------------------------------------
# Block amaxes of this rank's shares, and the exchange of the boundary blocks
# --------------------------------------------------------------------------------------------------


@dataclass
class _Blocks:
    """The blocks one weight share touches: ``grid`` block rows and columns from ``first`` of its
    key's grid, of which ``inside`` (global block rows, columns) lie wholly inside the share.
    ``start`` places the share's amaxes, and later its scales, in the rank's flat per-block arrays
    (row-major over ``grid``), so the host does no tensor op per share until the scales, which
    come last (fp32, CPU)."""

    share: HFShard
    first: tuple[int, int]
    grid: tuple[int, int]
    inside: tuple[range, range]
    start: int = 0
    scale: torch.Tensor | None = None
    scale_on_device: torch.Tensor | None = None  # ``scale`` where the share lives, for the quantize step

    @property
    def size(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def boundary(self) -> int:
        """How many of its blocks cross the share's edge (partial here, completed by the exchange)."""
        return self.size - len(self.inside[0]) * len(self.inside[1])

    @property
    def span(self) -> slice:
        """Where its amaxes and scales lie in the rank's flat arrays."""
        return slice(self.start, self.start + self.size)


def _blocks_of(share: HFShard) -> _Blocks:
    """Which blocks ``share`` touches and which of them lie wholly inside it."""
    (r0, c0), (h, w) = share.offsets, tuple(share.tensor.shape)
    (b0, b1), (rows, cols) = FP8_BLOCK, share.global_shape
    first = (r0 // b0, c0 // b1)
    grid = ((r0 + h - 1) // b0 + 1 - first[0], (c0 + w - 1) // b1 + 1 - first[1])
    return _Blocks(share, first, grid, (_wholly_inside(b0, r0, h, rows), _wholly_inside(b1, c0, w, cols)))


def _wholly_inside(size: int, start: int, length: int, total: int) -> range:
    """The blocks (of ``size``, the last one cut at ``total``) that lie within ``[start, start + length)``:
    from the first that starts in it to the last that ends in it (at the tensor's end, the cut one)."""
    end = start + length
    lo, hi = -(-start // size), -(-end // size) if end == total else end // size
    return range(lo, max(lo, hi))


def _whole_blocks(share: HFShard) -> bool:
    """The share starts and ends on block edges (routed experts, most dense weights)."""
    (r0, c0), (h, w), (b0, b1) = share.offsets, share.tensor.shape, FP8_BLOCK
    return r0 % b0 == 0 and c0 % b1 == 0 and h % b0 == 0 and w % b1 == 0


def _amaxes(blocks: list[_Blocks], runs: list[list[_Blocks]]) -> torch.Tensor:
    """Every block amax of this rank's shares, flat (fp32, CPU), each share's over its own elements
    until the exchange: one reduction per run of shares (:func:`_runs` of ``blocks``) and one copy
    to the host (one sync, not one per share); each ``_Blocks`` gets its ``start``. Refused where
    any is NaN or inf."""
    parts, start = [], 0
    for run in runs:
        parts.append(_run_amax(run).reshape(-1))
        for b in run:
            b.start, start = start, start + b.size
    flat = torch.cat(parts).cpu() if parts else torch.zeros(0)
    if not bool(torch.isfinite(flat).all()):
        for b in blocks:  # the first offending share, in share order, names the key
            _refuse_non_finite(b.share, flat[b.span].view(b.grid), *b.first)
    return flat


def _runs(blocks: list[_Blocks]) -> list[list[_Blocks]]:
    """The shares grouped so that one reduction covers each group: whole-block shares of one shape
    and strides, equally spaced in one storage (the experts of a fused in-memory tensor, one run per
    projection: a strided view of them all is one tensor); every other share alone. On a GPU each
    reduction is a few kernel launches: thousands of expert shares become a few runs per layer."""
    groups: dict[Any, list[_Blocks]] = {}
    for b in blocks:
        t = b.share.tensor
        same = (t.untyped_storage().data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride())
        groups.setdefault(same if _whole_blocks(b.share) else id(b), []).append(b)
    return [run for group in groups.values() for run in _equally_spaced(group)]


def _equally_spaced(group: list[_Blocks]) -> list[list[_Blocks]]:
    """``group`` (views of one storage) in storage order, cut where the step between offsets changes."""
    def offset(b: _Blocks) -> int:
        return b.share.tensor.storage_offset()

    runs: list[list[_Blocks]] = []
    for b in sorted(group, key=offset):
        run = runs[-1] if runs else []
        same_step = len(run) < 2 or offset(b) - offset(run[-1]) == offset(run[1]) - offset(run[0])
        if run and same_step:
            run.append(b)
        else:
            runs.append([b])
    return runs


def _run_amax(run: list[_Blocks]) -> torch.Tensor:
    """The block amaxes of one run (:func:`_runs`), on its device, in the share's own dtype (|w| and
    max are exact in any dtype), then fp32: ``[shares, block rows, block columns]``."""
    share = run[0].share
    if not _whole_blocks(share):
        return _cut_amax(run[0])
    t, (b0, b1) = share.tensor, FP8_BLOCK
    h, w = t.shape
    step = run[1].share.tensor.storage_offset() - t.storage_offset() if len(run) > 1 else 0
    values = t.as_strided((len(run), h, w), (step, *t.stride()), t.storage_offset())
    blocked = values.view(len(run), h // b0, b0, w // b1, b1)
    # max |w| = max(max w, -min w): two reductions over the blocked view, no |w| temporary.
    return torch.maximum(blocked.amax(dim=(2, 4)), blocked.amin(dim=(2, 4)).neg()).float()


def _cut_amax(blocks: _Blocks) -> torch.Tensor:
    """The block amaxes of a share that starts or ends inside a block, a few block rows at a time
    (:func:`_row_steps`), its part of each cut block zero-padded (|w| >= 0: padding never wins)."""
    share, (rows, cols), (first_row, first_col), b1 = blocks.share, blocks.grid, blocks.first, FP8_BLOCK[1]
    (r0, c0), w = share.offsets, share.tensor.shape[1]
    lead = c0 - first_col * b1  # where the share starts inside its first block column
    padded = torch.zeros(rows, cols * b1, dtype=share.tensor.dtype, device=share.tensor.device)
    for lo, hi, block, n in _row_steps(r0, share.tensor.shape[0], w):
        part = share.tensor[lo:hi].abs()
        i = block - first_row
        padded[i:i + n, lead:lead + w] = part.view(n, -1, w).amax(dim=1)
    return padded.view(rows, cols, b1).amax(dim=2).float()


_STEP_VALUES = 1 << 22  # values per step of the amax and quantize loops: <= 16 MiB of fp32 temporaries


def _row_steps(r0: int, h: int, w: int) -> Iterator[tuple[int, int, int, int]]:
    """``(lo, hi, first block row, block rows)`` over rows ``[0, h)`` of a share whose row 0 is global
    row ``r0``: runs of whole 128-row blocks (at most ``_STEP_VALUES`` values), and a block cut by
    the share's (or the tensor's) edge alone. Few steps, so few kernel launches on a GPU."""
    b0, lo = FP8_BLOCK[0], 0
    while lo < h:
        block, offset = divmod(r0 + lo, b0)
        if offset or h - lo < b0:  # a cut block: up to its end or the share's
            hi, n = min(h, (block + 1) * b0 - r0), 1
        else:
            n = max(1, min(h - lo, max(b0, _STEP_VALUES // max(w, 1))) // b0)
            hi = lo + n * b0
        yield lo, hi, block, n
        lo = hi


def _refuse_non_finite(share: HFShard, amax: torch.Tensor, row0: int, col0: int) -> None:
    bad = (~torch.isfinite(amax)).nonzero()
    if bad.numel():
        r, c = (int(v) for v in bad[0])
        raise InputError(
            "a weight to quantize holds NaN or inf", key=share.key, expected="finite values",
            actual=f"{len(bad)} 128x128 block(s) with non-finite values, the first block ({row0 + r}, {col0 + c}) "
                   f"in this rank's slice at offsets {share.offsets}",
            hint="the model diverged: export an earlier checkpoint, or keep this weight unquantized with keep_dtype")


def _owned_scales(blocks: _Blocks) -> tuple[range, range]:
    """The blocks whose first element this share holds: it alone writes their scales."""
    (r0, c0), (h, w), (b0, b1) = blocks.share.offsets, tuple(blocks.share.tensor.shape), FP8_BLOCK
    return range(-(-r0 // b0), -(-(r0 + h) // b0)), range(-(-c0 // b1), -(-(c0 + w) // b1))


def block_ids(keys: Collection[str], plan: ExportPlan) -> dict[str, tuple[int, int]]:
    """``{key: (first id, grid columns)}``: every block of every quantized key numbered once, in the
    plan's key order, the same on every rank."""
    ids, start = {}, 0
    for key in plan.tensors:
        if key in keys:
            rows, cols = _grid(plan.tensors[key].shape)
            ids[key], start = (start, cols), start + rows * cols
    return ids


def _crossing(b: _Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and columns, in the share's grid, of its blocks that cross the share's edge."""
    outside = torch.ones(b.grid, dtype=torch.bool)
    (rows, cols), (f0, f1) = b.inside, b.first
    outside[rows.start - f0:rows.stop - f0, cols.start - f1:cols.stop - f1] = False
    return outside.nonzero(as_tuple=True)


def _crossing_ids(b: _Blocks, ids: Mapping[str, tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``b``'s blocks that cross its share's edge lie in the rank's flat arrays, and their
    ids (:func:`block_ids`)."""
    r, c = _crossing(b)
    first, cols = ids[b.share.key]
    return b.start + r * b.grid[1] + c, first + (r + b.first[0]) * cols + c + b.first[1]


def crossing_block_ids(share: HFShard, ids: Mapping[str, tuple[int, int]]) -> list[int]:
    """The ids (:func:`block_ids`) of the blocks that cross ``share``'s edge: those it shares with
    the other shares of its key (a meta tensor will do: only its offsets and shape are read)."""
    return _crossing_ids(_blocks_of(share), ids)[1].tolist()


def _boundary(blocks: list[_Blocks], ids: Mapping[str, tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every boundary block of ``blocks``: its place in the flat arrays, and its id."""
    local, mine = [], []
    for b in (b for b in blocks if b.boundary):
        where, block = _crossing_ids(b, ids)
        local.append(where)
        mine.append(block)
    return (torch.cat(local) if local else torch.zeros(0, dtype=torch.int64),
            torch.cat(mine) if mine else torch.zeros(0, dtype=torch.int64))


def _combine(amax: torch.Tensor, local_t: torch.Tensor, mine_t: torch.Tensor, every_id: torch.Tensor,
             every_value: torch.Tensor) -> None:
    """Each boundary block of ours (``local_t``, ids ``mine_t``) gets, in ``amax``, the max of the
    partial amaxes ``every_value`` of its id in ``every_id``."""
    if not mine_t.numel():
        return
    unique, where = torch.unique(mine_t, return_inverse=True)
    pos = torch.searchsorted(unique, every_id).clamp_(max=unique.numel() - 1)
    hit = unique[pos] == every_id
    amax[local_t] = torch.zeros(unique.numel()).scatter_reduce_(0, pos[hit], every_value[hit], "amax")[where]


def _exchange(blocks: list[_Blocks], amax: torch.Tensor, ids: dict[str, tuple[int, int]], coordinator: Any,
              facts: Any) -> list[Any]:
    """Combine the partial amaxes of boundary blocks over the export group: one all-gather of
    ``(block ids, amaxes)``, after which each of this rank's boundary blocks holds, in the flat
    ``amax``, the max over every rank holding part of it. Only shares with such blocks take part
    (none, for whole-block shares). ``facts`` (small per-rank numbers) travel along; returns every rank's."""
    local_t, mine_t = _boundary(blocks, ids)
    gathered = coordinator.all_gather((mine_t, amax[local_t], facts))
    _combine(amax, local_t, mine_t, torch.cat([g[0] for g in gathered]), torch.cat([g[1] for g in gathered]))
    return [g[2] for g in gathered]


def _set_scales(blocks: list[_Blocks], amax: torch.Tensor, scale_fmt: str | None) -> None:
    """Every scale from its (exchanged) amax in one call over the flat array, and each share's
    scales beside its values: one copy per device (none for shares on the CPU)."""
    scale = block_scales(amax, scale_fmt)
    in_flat = sorted(blocks, key=lambda b: b.start)
    sizes = [b.size for b in in_flat]
    parts = {scale.device: torch.split(scale, sizes)}  # one call for all views: cheaper than a slice each
    for device in {b.share.tensor.device for b in blocks} - {scale.device}:
        parts[device] = torch.split(scale.to(device), sizes)
    for i, b in enumerate(in_flat):
        device = b.share.tensor.device
        b.scale = parts[scale.device][i].view(b.grid)
        b.scale_on_device = b.scale if device == scale.device else parts[device][i].view(b.grid)


def _scale_share(blocks: _Blocks) -> HFShard | None:
    """The part of the key's scale tensor this share writes (its owned blocks), or None."""
    rows, cols = _owned_scales(blocks)
    if not rows or not cols:
        return None
    (f0, f1), share = blocks.first, blocks.share
    part = blocks.scale[rows.start - f0:rows.stop - f0, cols.start - f1:cols.stop - f1].contiguous()
    return HFShard(share.key + SCALE_SUFFIX, _grid(share.global_shape), (rows.start, cols.start), part, True,
                   share.source_key, share.expert)


def scale_pieces(shares: list[HFShard]) -> list[HFShard]:
    """The scale pieces ``shares`` write (their owned blocks, :func:`_owned_scales`) as meta
    tensors: shapes only, for a coverage check before anything is read."""
    pieces = []
    for b in map(_blocks_of, shares):
        b.scale = torch.empty(b.grid, dtype=torch.float32, device="meta")
        pieces.append(_scale_share(b))
    return [p for p in pieces if p is not None]


def quantize_whole_blocks(shares: list[HFShard], ids: Mapping[str, tuple[int, int]], scale_fmt: str | None,
                          staging_bytes: int) -> Iterator[list[HFShard]]:
    """``shares`` that together hold every element of every block they touch (the conversion's
    units, docs/design.md#checkpoint-conversion), quantized as the export does but with no
    exchange: their boundary blocks' amaxes combined among themselves; yields their scale pieces,
    then their FP8 rows in batches of at most ``staging_bytes``."""
    blocks = [_blocks_of(s) for s in shares]
    amax = _amaxes(blocks, _runs(blocks))
    local_t, mine_t = _boundary(blocks, ids)
    _combine(amax, local_t, mine_t, mine_t, amax[local_t])
    _set_scales(blocks, amax, scale_fmt)
    yield [s for s in map(_scale_share, blocks) if s is not None]
    for batch in _batches(blocks, staging_bytes):
        yield [_quantized_rows(*rows) for rows in batch]


# --------------------------------------------------------------------------------------------------
# The one call from the export's validate step
# --------------------------------------------------------------------------------------------------


def quantize_export(steps: Any, options: ExportOptions, adapter: StateDictAdapter, plan: ExportPlan,
                    shares: list[HFShard], writer: StorageWriter
                    ) -> tuple[ExportPlan, list[HFShard], StorageWriter]:
    """The plan, write shares and storage writer of the FP8 checkpoint (returned unchanged unless
    ``options.quantize``). Call on every rank in validate, after the plan and coverage checks:
    ``steps`` (the export's step runner: ``coordinator``, ``agreed``) closes the rank-local part with
    an agreement before the exchange. Refuses, on every rank, before anything is written."""
    if options.quantize is None:
        return plan, shares, writer
    stats = Fp8WriteStats(writer_threads=options.writer_threads)
    with steps.agreed("validate fp8"):
        keys = quantized_keys(plan, adapter, options)
        quantized = fp8_plan(plan, keys, options.max_shard_bytes)
        started = time.perf_counter()
        blocks = [_blocks_of(s) for s in shares if s.key in keys]
        runs = _runs(blocks)
        amax = _amaxes(blocks, runs)
        stats.amax_seconds, stats.amax_runs = round(time.perf_counter() - started, 4), len(runs)
        batches = _batches(blocks, options.staging_bytes)
        owned = sum(len(r) * len(c) for r, c in map(_owned_scales, blocks))
    started = time.perf_counter()
    facts = _exchange(blocks, amax, block_ids(keys, quantized), steps.coordinator, (len(batches), owned))
    stats.exchange_seconds = round(time.perf_counter() - started, 4)
    stats.boundary_blocks = sum(b.boundary for b in blocks)
    _check_scale_coverage(quantized, keys, sum(n for _, n in facts))
    _set_scales(blocks, amax, options.scale_fmt)  # from the amaxes the exchange completed in place
    scales = [s for s in map(_scale_share, blocks) if s is not None]
    calls = max(1, *(n for n, _ in facts))  # the local-filesystem writer's write is a collective
    return quantized, [*shares, *scales], Fp8Writer(writer, blocks, batches, calls, stats)


def _check_scale_coverage(plan: ExportPlan, keys: Collection[str], owned: int) -> None:
    """Every scale has exactly one writer: the owners' counts, summed over ranks, tile every grid
    (the same verdict on every rank: the counts are gathered)."""
    expected = sum(math.prod(plan.tensors[k + SCALE_SUFFIX].shape) for k in keys)
    if owned != expected:
        raise InputError("FP8 scales would not be written exactly once", key=SCALE_SUFFIX,
                         expected=f"{expected} scales, one writer each", actual=f"{owned} owned across ranks",
                         hint="the weight shares must tile every quantized tensor; check the mesh and placements")


# --------------------------------------------------------------------------------------------------
# Writing: the weight shares quantized batch by batch, through the storage writer
# --------------------------------------------------------------------------------------------------


@dataclass
class Fp8WriteStats(WriteStats):
    """A quantized export's write stats: the storage writer's, summed over its batches, and the
    FP8 work (``amax_runs``: the reductions this rank's block amaxes took, one per run of shares;
    ``boundary_blocks``: this rank's blocks that cross a shard boundary; ``batches``: this rank's
    quantized batches)."""

    amax_seconds: float = 0.0
    amax_runs: int = 0
    exchange_seconds: float = 0.0
    boundary_blocks: int = 0
    quantize_seconds: float = 0.0
    batches: int = 0


_Batch = list[tuple[_Blocks, int, int]]  # row ranges [start, stop) of weight shares


def _batches(blocks: list[_Blocks], budget: int) -> list[_Batch]:
    """The weight shares' rows in batches of at most ``budget`` FP8 bytes (one row at least)."""
    batches: list[_Batch] = []
    current: _Batch = []
    size = 0
    for b in blocks:
        h, w = b.share.tensor.shape
        step = max(1, budget // max(w, 1))
        for start in range(0, h, step):
            n = (min(h, start + step) - start) * w
            if current and size + n > budget:
                batches.append(current)
                current, size = [], 0
            current.append((b, start, min(h, start + step)))
            size += n
    return batches + [current] if current else batches


def _quantized_rows(blocks: _Blocks, start: int, stop: int) -> HFShard:
    """Rows ``start:stop`` of a weight share as FP8, a few block rows at a time, each row with the
    scales of its blocks (a ``[block rows, 1, blocks, 1]`` or ``[block rows, 1, width]`` view: no
    scale is expanded over the block's rows)."""
    share, (f0, f1), (b0, b1) = blocks.share, blocks.first, FP8_BLOCK
    source = share.tensor[start:stop]
    r0, c0, w = share.offsets[0] + start, share.offsets[1], source.shape[1]
    first = r0 // b0
    rows = blocks.scale_on_device[first - f0:(r0 + stop - start - 1) // b0 + 1 - f0]
    out = torch.empty(source.shape, dtype=FP8_DTYPE, device=source.device)
    if c0 % b1 == 0 and w % b1 == 0:  # whole block columns: a [rows, blocks, 128] view, one scale per block
        scales = rows[:, c0 // b1 - f1:(c0 + w) // b1 - f1]
        for lo, hi, block, n in _row_steps(r0, stop - start, w):
            part = source[lo:hi].view(n, -1, w // b1, b1)
            out[lo:hi] = quantize_with_scales(part, scales[block - first:block - first + n, None, :, None]
                                              ).reshape(hi - lo, w)
        return replace(share, offsets=(r0, c0), tensor=out)
    columns = (torch.arange(w, device=source.device) + c0) // b1 - f1  # each column's block
    scales = rows[:, columns]
    for lo, hi, block, n in _row_steps(r0, stop - start, w):
        part = source[lo:hi].view(n, -1, w)
        out[lo:hi] = quantize_with_scales(part, scales[block - first:block - first + n, None, :]).reshape(hi - lo, w)
    return replace(share, offsets=(r0, c0), tensor=out)


class Fp8Writer(StorageWriter):
    """Writes a quantized checkpoint through another storage writer: the plain pieces (and the
    scales) first, then the weight shares quantized batch by batch right before their write, so at
    most one batch of FP8 exists at a time. Where the storage writer offers a session
    (``batch_writer``: the shared-filesystem one) every batch goes through it; otherwise every
    rank makes ``calls`` writes, empty ones included (the local-filesystem writer's write is a
    collective)."""

    def __init__(self, inner: StorageWriter, blocks: list[_Blocks], batches: list[_Batch], calls: int,
                 stats: Fp8WriteStats) -> None:
        super().__init__(inner.writer_ranks, staging_bytes=inner.staging_bytes, writer_threads=inner.writer_threads)
        self.inner, self.batches, self.calls, self.stats = inner, batches, calls, stats
        self._weights = {(b.share.key, b.share.offsets) for b in blocks}
        self._on_gpu = any(b.share.tensor.is_cuda for b in blocks)

    def file_owners(self, plan: ExportPlan) -> dict[str, int]:
        return self.inner.file_owners(plan)

    def write(self, plan: ExportPlan, pieces: list[HFShard], directory: str) -> WriteStats:
        started = time.perf_counter()
        plain = [p for p in pieces if (p.key, p.offsets) not in self._weights]
        if len(pieces) - len(plain) != len(self._weights):
            raise RuntimeError("the FP8 writer was handed other weight shares than it quantizes")
        stats = replace(self.stats, files_touched=set())
        session = self.inner.batch_writer(plan, directory, pinned=self._on_gpu)
        if session is None:
            self._write_per_call(plan, plain, directory, stats)
        else:
            self._write_in_session(session, plain, stats)
        stats.batches, stats.quantize_seconds = len(self.batches), round(stats.quantize_seconds, 4)
        stats.seconds = round(time.perf_counter() - started, 4)
        return stats

    def _quantized(self, batch: _Batch, stats: Fp8WriteStats) -> list[HFShard]:
        started = time.perf_counter()
        out = [_quantized_rows(*rows) for rows in batch]
        stats.quantize_seconds += time.perf_counter() - started
        return out

    def _write_in_session(self, session: Any, plain: list[HFShard], stats: Fp8WriteStats) -> None:
        """One storage session for every batch: its staging buffers, threads and files stay open,
        so batch ``k + 1`` is quantized while the writer threads still write batch ``k``, and each
        file is fsynced once."""
        try:
            session.write(plain)
            for batch in self.batches:
                quantized = self._quantized(batch, stats)
                session.write(quantized)
                del quantized  # staged by now: this batch's FP8 goes before the next one is made
        except BaseException:
            session.abandon()
            raise
        _add(stats, session.close())

    def _write_per_call(self, plan: ExportPlan, plain: list[HFShard], directory: str, stats: Fp8WriteStats) -> None:
        """A storage writer whose every write is a collective (the local-filesystem one): ``calls``
        writes on every rank, empty ones included."""
        for call in range(self.calls):
            batch = plain if call == 0 else []
            if call < len(self.batches):
                batch = batch + self._quantized(self.batches[call], stats)
            _add(stats, self.inner.write(plan, batch, directory))
            del batch  # this batch's FP8 goes before the next one is made

    def __repr__(self) -> str:
        return f"Fp8Writer({self.inner!r}, calls={self.calls})"


def _add(total: WriteStats, part: WriteStats) -> None:
    for name in ("bytes_written", "runs", "staged_bytes", "copy_seconds", "write_seconds"):
        setattr(total, name, round(getattr(total, name) + getattr(part, name), 4))
    total.files_touched |= part.files_touched
