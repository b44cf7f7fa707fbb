"""Every rank of a job, simulated in one process under torch's fake process group.

For each simulated rank ``r`` of ``W`` (docs/design.md#planner):

1. the default process group is re-initialised as rank ``r`` of the ``fake`` backend
   (``FakeStore``: no peer, no traffic), and the layout's DeviceMeshes are built on it with
   ``init_device_mesh``, so every mesh coordinate, group and replica number is torch's own
   (``ranks.py``: the fake world, each rank's meshes and its state dict);
2. the rank's state dict is the meta model's tensors laid out as ``job/trainer.shard_model``
   lays them out: FSDP2 ``Shard(0)`` of every parameter over ``dp_shard`` (HSDP: ``(Replicate,
   Shard(0))`` on ``(dp_replicate, dp_shard)``), expert parallelism's ``Shard(0)`` of the fused
   expert tensors on ``ep`` (``(Replicate, Shard(0))`` on ``(edp, ep)`` with expert-DP replicas),
   buffers and EP's dense part as plain tensors; under TP / CP, each tensor where torch's own
   ``parallelize_tp`` and ``fully_shard`` put it (``model_parallel.py``); each a meta DTensor made by
   ``DTensor.from_local`` with the local shape torch computes for that coordinate;
3. the export's own code runs on it: ``step.rank_write_shares`` (the adapter's ``to_hf`` and
   ``plan.write_shares``), ``plan.element_counts``, ``row_exchange.row_parallel_shares`` (the
   row-parallel TP shares, written as whole rows after the exchange), ``writer.byte_runs``,
   ``replicas.replica_sets``.

The plan itself (``step.export_plan_of``) and the file owners (``plan.assign_file_owners``) are
rank-independent and computed once, from the full meta state dict. The export's rank-local code is
timed here too (``timing.py`` takes those times), as is rank 0's bookkeeping on a skeleton of the
checkpoint (``metadata_seconds``). Ranks are simulated on the representative layer of each layer
group (``model.py``); a result for a representative key is counted for every member layer, whose
keys map to files through the plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import replace
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nemo_moe_export.errors import InputError
from nemo_moe_export.export import stages
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan, assign_file_owners, check_coverage, element_counts
from nemo_moe_export.export.replicas import replica_sets
from nemo_moe_export.export.row_exchange import row_parallel_shares, row_parts
from nemo_moe_export.export.step import export_plan_of, rank_write_shares, replicated_tensors
from nemo_moe_export.export.writer import byte_runs
from nemo_moe_export.planner.code_times import catalogue_seconds, metadata_seconds, timed
from nemo_moe_export.planner.model import MetaModel
from nemo_moe_export.planner.model_parallel import ModelParallel, model_parallel_of, recorded_placements
from nemo_moe_export.planner.pipeline import Pipeline, pipeline_of
from nemo_moe_export.planner.ranks import (Layout, SimulatedCoordinator, check_layout, fake_world, pp_size_of,
                                           rank_state_dict)

__all__ = ["RankPlan", "Simulation", "StageWork", "fake_world", "simulate"]

# What the replica check all-reduces (replicas.py): per replica group a header of 2 int64 and per
# tensor 3 int64 checksums, each as [v, flip(v)] so one MAX gives max and min.
_HEADER_BYTES = 2 * 2 * 8
_CHECKSUM_BYTES = 3 * 2 * 8


@dataclass
class RankPlan:
    """What one rank does in an export (bytes in the stored dtypes)."""

    rank: int
    bytes: int = 0  # tensor bytes it pwrites
    runs: int = 0  # contiguous byte runs (one pwrite stream each)
    staged_bytes: int = 0  # bytes that go through staging buffers (a cast, a strided view, a GPU tensor)
    staged_chunks: int = 0
    staging_peak_bytes: int = 0  # staging buffers it allocates (the writer's bound)
    files_owned: int = 0  # files it creates and writes the header of
    header_bytes: int = 0
    index_bytes: int = 0  # rank 0: model.safetensors.index.json
    files_written: int = 0  # files it writes tensor bytes into
    replica_groups: int = 0
    replica_tensors: int = 0
    replica_bytes_checked: int = 0  # bytes its checksums read
    replica_allreduce_bytes: int = 0  # payload of its replica-check all-reduces
    elements: int = 0
    replica_group_sizes: list[int] = field(default_factory=list)  # ranks in each of its replica groups
    export_group_checked: bool = False  # one of them is the export group (its plain tensors): butterfly all-reduces
    # row-parallel TP shares (export/row_exchange.py): bytes it sends its TP peers, the all-to-alls
    # (one per weight), the size of its TP group, and the largest exchange's buffers (received + whole rows)
    exchanged_bytes: int = 0
    row_exchanges: int = 0
    exchange_group: int = 0
    exchange_peak_bytes: int = 0
    share_seconds: float = 0.0  # rank_write_shares here (the representative layers, scaled to every layer)
    # element_counts and replica_sets here, the rest of validate's rank-local work (scaled likewise)
    local_seconds: float = 0.0
    # (file, offset, bytes) of every byte run it pwrites, when simulate(record_runs=True)
    byte_runs: list[tuple[str, int, int]] | None = None


@dataclass
class Simulation:
    """The outcome for every rank, and what the ranks agree on."""

    world_size: int
    plan: ExportPlan
    ranks: list[RankPlan]
    digests: list[str]  # the plan digest each rank computed
    coverage_ok: bool
    tiling_ok: bool | None  # every element of every written key covered by exactly one box (None: not 1-D)
    file_owner: dict[str, int]
    coverage_allreduce_bytes: int  # the per-key element counts every rank all-reduces in validate
    seconds: float = 0.0
    plan_seconds: float = 0.0  # export_plan_of here: what every rank computes in validate
    stamp_seconds: float = 0.0  # plan.stamped (the job's id spliced into every header), in validate
    replicated_seconds: float = 0.0  # step.replicated_tensors here (rank-independent), in validate
    state_dict_seconds: float = 0.0  # the model's state_dict() here (validate resolves the inputs with it)
    # rank 0's bookkeeping, the export's own code on a skeleton of the checkpoint (every planned
    # file at full size, sparse, with its header): write_metadata_files (the index, config.json,
    # the generation config; headers step) and verify_checkpoint (verify step)
    index_seconds: float = 0.0
    verify_seconds: float = 0.0
    layer_groups: dict[int, tuple[int, ...]] = field(default_factory=dict)
    stages: "StageWork | None" = None  # under pipeline stages: their layout and the export's extra work
    model_parallel: "ModelParallel | None" = None  # TP / CP / ETP / SP sizes (model_parallel.py)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.ranks)


@dataclass
class StageWork:
    """Under pipeline stages: the stages, and what the export's validate step does for them besides
    a plain export's work (``stages.py`` of the export; timed here on this model)."""

    pipeline: Pipeline
    catalogue_seconds: float = 0.0  # a rank's catalogue pickled, every pipeline rank's unpickled and merged
    catalogue_bytes: int = 0  # the largest pickled catalogue (all_gather_object pads each to it)
    declared_seconds: float = 0.0  # rank 0's check_declared (transformers' model on the meta device)
    held_fraction: float = 1.0  # the model's tensors the fullest pipeline rank holds

    def pp_rank(self, rank: int, world: int) -> int:
        return rank // (world // self.pipeline.pp_size)


def simulate(meta: MetaModel, parallel: Any, world: int, options: ExportOptions, *,
             device: str = "cpu", progress: Any = None, record_runs: bool = False) -> Simulation:
    """Simulate the export on every rank of ``world``; ``device`` is where the model's shards live
    (``cuda``: every byte goes through the pinned staging buffers). ``record_runs`` keeps every
    rank's byte runs (``RankPlan.byte_runs``: what ``benchmarks/plan_bench.py`` writes to measure
    the disk the way the export writes). With ``parallel.pp_size`` > 1 each rank holds only its
    stages' tensors (``pipeline.py``)."""
    started = time.perf_counter()
    check_layout(parallel, world, meta)
    pipeline = pipeline_of(parallel, meta)
    plan, expansion, plan_seconds = _plan_and_expansion(meta, options)
    owners = assign_file_owners(plan, list(range(world)))  # SharedFilesystemWriter: every rank writes
    ranks, digests = [], []
    digest = plan.digest()
    _, state_dict_s = timed(meta.model.state_dict)
    replicated, replicated_s = timed(replicated_tensors, meta.adapter, meta.simulated)
    replicated_names = sorted(replicated)  # by key: rank-independent
    replicated_s *= len(meta.state_dict) / max(1, len(meta.simulated))
    total_counts = torch.zeros(len(plan.tensors), dtype=torch.int64)
    tiling = _Tiling(plan, expansion, 1 if pipeline is None else pipeline.pp_size)
    per_stage = world // pp_size_of(parallel)
    holders = None if pipeline is None else [pipeline.pp_rank_of(k) for k in plan.tensors]
    held: dict[int, _Held] = {}
    mp = model_parallel_of(parallel)
    with fake_world() as become:
        recorded = (recorded_placements(meta, parallel, per_stage, become) if mp.tp * mp.cp > 1 else None)
        for rank in range(world):
            become(rank, world)
            pp_rank = rank // per_stage
            if pp_rank not in held:
                held[pp_rank] = _Held(meta, expansion, pipeline, pp_rank, holders)
                tiling.expect(held[pp_rank])
            state_dict = rank_state_dict(held[pp_rank].tensors, meta, Layout(parallel, world, recorded))
            result, counts = _simulate_rank(rank, world, state_dict, meta, plan, held[pp_rank], options, device,
                                            tiling, replicated_names, record_runs)
            digests.append(_digest_of(state_dict, digest, meta))
            total_counts += counts
            ranks.append(result)
            if progress is not None:
                progress(rank + 1, world)
    _add_file_work(ranks, plan, owners)
    coverage_ok = _covered(plan, total_counts)
    stamp_s, index_s, verify_s = metadata_seconds(meta, plan, options)
    return Simulation(world, plan, ranks, digests, coverage_ok, tiling.ok(), owners,
                      coverage_allreduce_bytes=8 * len(plan.tensors),
                      seconds=round(time.perf_counter() - started, 3), plan_seconds=round(plan_seconds, 4),
                      stamp_seconds=stamp_s, replicated_seconds=round(replicated_s, 4),
                      state_dict_seconds=round(state_dict_s, 4), index_seconds=index_s,
                      verify_seconds=verify_s,
                      layer_groups=dict(meta.members),
                      stages=None if pipeline is None else _stage_work(meta, plan, pipeline, options, held),
                      model_parallel=mp)


def _stage_work(meta: MetaModel, plan: ExportPlan, pipeline: Pipeline, options: ExportOptions,
                held: Mapping[int, "_Held"]) -> StageWork:
    """What the export does across the stages beyond a plain export, and the share of the model's
    tensors the fullest pipeline rank holds (its state dict and replica names scale with it)."""
    catalogue_s, catalogue_bytes, declared_s = catalogue_seconds(meta, pipeline, options)
    fraction = max(h.tensor_count for h in held.values()) / max(1, len(meta.state_dict))
    return StageWork(pipeline, catalogue_seconds=catalogue_s, catalogue_bytes=catalogue_bytes,
                     declared_seconds=declared_s, held_fraction=round(fraction, 4))


class _Held:
    """What one pipeline rank holds, at the layer-group level: the simulated (representative)
    tensors it lays out, and for each representative HF key the plan positions of the member keys
    it holds (every member without pipeline stages)."""

    def __init__(self, meta: MetaModel, expansion: "_Expansion", pipeline: Pipeline | None, pp_rank: int,
                 holders: list[int] | None = None) -> None:
        self.pp_rank, self.pipeline = pp_rank, pipeline
        if pipeline is None:
            self.tensors, self.members, self.mask = meta.simulated, expansion.members, None
            self.layers = None
            self.scale = expansion.scale
            self.tensor_count = len(meta.state_dict)
            return
        self.layers = {layer for s in pipeline.stages_of(pp_rank) for layer in pipeline.layers[s]}
        flags = [holder == pp_rank for holder in holders]  # holders: the pipeline rank of each plan position
        self.mask = torch.tensor(flags, dtype=torch.int64)
        held = {k: [p for p in ps if flags[p]] for k, ps in expansion.members.items()}
        self.members = {k: ps for k, ps in held.items() if ps}
        self.tensors = {k: t for k, t in meta.simulated.items() if self.count(k, meta)}
        self.tensor_count = sum(self.count(k, meta) for k in self.tensors)
        self.scale = self.tensor_count / max(1, len(self.tensors))

    def count(self, name: str, meta: MetaModel) -> int:
        """How many in-memory tensors the simulated tensor ``name`` stands for on this rank."""
        layers = meta.multiplicity(name)
        if self.pipeline is None:
            return len(layers or (0,))
        if layers is None:
            return int(self.pipeline.pp_rank_of(name) == self.pp_rank)
        return sum(1 for layer in layers if layer in self.layers)

    def counts(self, rep_counts: torch.Tensor, expansion: "_Expansion") -> torch.Tensor:
        """Element counts of every plan key from the representative keys' (the keys it holds only)."""
        counts = rep_counts[expansion.rep_slot]
        return counts if self.mask is None else counts * self.mask


def _plan_and_expansion(meta: MetaModel, options: ExportOptions) -> tuple[ExportPlan, "_Expansion"]:
    """The export plan (rank-independent: ``step.export_plan_of`` on the full meta state dict) and
    its layer-group expansion, cached per model and options."""
    key = repr(options)
    if key not in meta.plans:
        plan, seconds = timed(export_plan_of, meta.adapter, meta.state_dict, options, model=meta.model,
                               config=meta.config)
        meta.plans[key] = (plan, _Expansion(meta, plan), seconds)
    return meta.plans[key]


class _Expansion:
    """Representative keys -> the plan positions of every member layer's key."""

    def __init__(self, meta: MetaModel, plan: ExportPlan) -> None:
        self.position = {key: i for i, key in enumerate(plan.tensors)}
        self.members: dict[str, list[int]] = {}
        covered = torch.zeros(len(plan.tensors), dtype=torch.int64)
        self.rep_of = torch.zeros(len(plan.tensors), dtype=torch.int64)
        rep_keys = set(meta.adapter.hf_metadata(meta.simulated))
        for key in rep_keys:
            layers = meta.multiplicity(key)
            keys = [key] if layers is None else [meta.member_key(key, layer) for layer in layers]
            missing = [k for k in keys if k not in self.position]
            if missing:
                raise InputError("a layer group does not map onto the plan", key=missing[0],
                                 expected="a key of the export plan", actual="not planned",
                                 hint="the model's layers are not alike where their tensors say they are")
            self.members[key] = [self.position[k] for k in keys]
            covered[self.members[key]] += 1
            self.rep_of[self.members[key]] = self.position[key]
        if not bool((covered == 1).all()):
            first = list(plan.tensors)[int((covered != 1).nonzero()[0])]
            raise InputError("the layer groups do not cover the plan exactly once", key=first,
                             expected="1", actual=int(covered[self.position[first]]))
        self.planned_at = list(plan.tensors.values())  # by plan position
        self.file_of = [t.file for t in self.planned_at]
        self.scale = len(meta.state_dict) / max(1, len(meta.simulated))  # tensors per simulated tensor
        reps = sorted(self.members, key=self.position.__getitem__)
        self.rep_plan = ExportPlan(plan.files, {k: plan.tensors[k] for k in reps})
        slot = {self.position[k]: i for i, k in enumerate(reps)}
        self.rep_slot = torch.tensor([slot[int(p)] for p in self.rep_of], dtype=torch.int64)

    def count(self, key: str) -> int:
        return len(self.members[key])


def _simulate_rank(rank: int, world: int, state_dict: dict[str, torch.Tensor], meta: MetaModel, plan: ExportPlan,
                   held: _Held, options: ExportOptions, device: str, tiling: "_Tiling",
                   replicated_names: list[str], record_runs: bool = False) -> tuple[RankPlan, torch.Tensor]:
    """The export's per-rank code on one simulated rank."""
    out = RankPlan(rank, byte_runs=[] if record_runs else None)
    expansion = tiling.expansion
    shares, seconds = timed(rank_write_shares, meta.adapter, state_dict, (rank, world))
    out.share_seconds = seconds * held.scale
    # element_counts over the representative keys (a sub-plan of the same tensors), then every
    # member layer's key counts as its representative's
    rep_counts, seconds = timed(element_counts, expansion.rep_plan, shares)
    out.local_seconds = seconds * held.scale
    counts = held.counts(rep_counts, expansion)
    files: set[str] = set()
    # step._write: on a shared filesystem, row-parallel TP shares go through the exchange first
    regular, exchanges = row_parallel_shares(shares, state_dict)
    pieces = [(share, device) for share in regular] + [(_exchanged_rows(e, out, held.members[e.share.key], device),
                                                         "cpu") for e in exchanges]
    for piece, where in pieces:
        if piece is None:
            continue
        planned = plan.tensors[piece.key]
        positions = held.members[piece.key]
        n = len(positions)
        files.update(expansion.file_of[p] for p in positions)
        tiling.add(piece, held.pp_rank)
        for offset, source in byte_runs(piece, planned):
            nbytes = source.numel() * planned.element_size
            out.runs += n
            out.bytes += n * nbytes
            if record_runs:  # the same run in every member layer's key, at that key's place
                relative = offset - planned.data_start
                out.byte_runs += [(expansion.file_of[p], expansion.planned_at[p].data_start + relative, nbytes)
                                  for p in positions]
            # writer._write_piece: a run is written straight from the tensor's memory when it is a
            # CPU tensor in the stored dtype and contiguous; anything else is staged. Exchanged rows
            # are host tensors (gloo moves host memory).
            if where == "cuda" or source.dtype != planned.dtype or not source.is_contiguous():
                out.staged_bytes += n * nbytes
                out.staged_chunks += n * math.ceil(nbytes / options.staging_bytes)
    out.elements = int(counts.sum())
    out.files_written = len(files)
    # writer._Pipeline: at most writer_threads + 1 buffers, allocated on first use
    out.staging_peak_bytes = min(options.writer_threads + 1, out.staged_chunks) * options.staging_bytes
    mine = {name: state_dict[name] for name in replicated_names if name in state_dict}
    _add_replica_work(out, mine, meta, world, held)
    return out, counts


def _exchanged_rows(exchange: Any, out: RankPlan, positions: list[int], device: str) -> Any:
    """What ``row_exchange.write_exchanged_rows`` hands the writer for one row-parallel share (this
    rank's part of the shared rows, every column; None when its part is empty), counting the bytes
    it sends its peers and its all-to-all, once per member layer (``positions``)."""
    share, tp, me = exchange.share, len(exchange.peers), exchange.me
    rows, cols = share.tensor.shape
    chunk, parts = row_parts(rows, tp)
    esize, n = share.tensor.element_size(), len(positions)
    out.row_exchanges += n
    out.exchange_group = tp
    out.exchanged_bytes += n * (rows - parts[me]) * cols * esize
    host_copy = rows * cols * esize if device == "cuda" else 0  # .cpu() of a GPU share
    out.exchange_peak_bytes = max(out.exchange_peak_bytes, host_copy + 2 * parts[me] * cols * tp * esize)
    if not parts[me]:
        return None
    whole = torch.empty(parts[me], tp * cols, dtype=share.tensor.dtype, device="meta")
    return replace(share, offsets=(share.offsets[0] + me * chunk, 0), tensor=whole)


def _add_replica_work(out: RankPlan, replicated: dict[str, torch.Tensor], meta: MetaModel, world: int,
                      held: _Held) -> None:
    """What the replica check (replicas.py) compares on this rank (``replicated``: the tensors
    ``step.replicated_tensors`` names, those of its stages), and what it all-reduces."""
    sets, seconds = timed(replica_sets, replicated, SimulatedCoordinator(out.rank, world))
    out.local_seconds += seconds * held.scale
    held_count = {name: held.count(name, meta) for name in replicated}
    for entry in sets:
        tensors = sum(held_count[n] for n in entry.names)
        local_bytes = 0
        for name in entry.names:
            t = replicated[name]
            local = t.to_local() if isinstance(t, DTensor) else t
            local_bytes += held_count[name] * local.numel() * local.element_size()
        ring = 2 * (len(entry.ranks) - 1) / len(entry.ranks)  # bytes a ring all-reduce sends per byte
        out.replica_groups += 1
        out.replica_group_sizes.append(len(entry.ranks))
        out.export_group_checked |= entry.export_group
        out.replica_tensors += tensors
        out.replica_bytes_checked += local_bytes
        out.replica_allreduce_bytes += int(ring * (_HEADER_BYTES + _CHECKSUM_BYTES * tensors))


def _digest_of(state_dict: dict[str, torch.Tensor], digest: str, meta: MetaModel) -> str:
    """The plan digest this rank computes: ``export_plan_of`` is a function of the keys, global
    shapes and dtypes of the rank's state dict only; when they are the full model's (checked
    here), the rank's plan is the full plan."""
    for key, tensor in state_dict.items():
        full = meta.state_dict[key]
        if tuple(tensor.shape) != tuple(full.shape) or tensor.dtype != full.dtype:
            return f"differs at {key}: {tuple(tensor.shape)} {tensor.dtype}"
    return digest


def _add_file_work(ranks: list[RankPlan], plan: ExportPlan, owners: Mapping[str, int]) -> None:
    """Headers by the owner of each file; the index by rank 0 (step.py's headers step)."""
    by_name = {f.name: f for f in plan.files}
    for name, owner in owners.items():
        ranks[owner].files_owned += 1
        ranks[owner].header_bytes += len(by_name[name].header)
    ranks[0].index_bytes = len(plan.index_json().encode())


def _covered(plan: ExportPlan, counts: torch.Tensor) -> bool:
    """The export's own coverage check (``plan.check_coverage``) on the summed element counts."""
    try:
        check_coverage(plan, counts)
    except InputError:
        return False
    return True


class _Tiling:
    """An exact check beyond the counts: along dim 0, the boxes of every written key tile it with
    no gap and no overlap (done when every box spans the key's other dims whole). Under pipeline
    stages a representative key stands for different member layers on each pipeline rank, so its
    boxes are tiled per pipeline rank (slot ``position * pp_size + pp_rank``); that every member
    key is held by exactly one stage is what the coverage counts check."""

    def __init__(self, plan: ExportPlan, expansion: _Expansion, pp_size: int = 1) -> None:
        self.plan, self.expansion, self.pp_size = plan, expansion, pp_size
        self.keys: list[int] = []
        self.starts: list[int] = []
        self.stops: list[int] = []
        self.expected: set[int] = set()
        self.one_dim = True

    def expect(self, held: _Held) -> None:
        """The representative keys pipeline rank ``held.pp_rank`` must tile."""
        self.expected.update(self.expansion.position[k] * self.pp_size + held.pp_rank for k in held.members)

    def add(self, share: Any, pp_rank: int = 0) -> None:
        shape, gshape = tuple(share.tensor.shape), share.global_shape
        if not gshape:
            start, stop = 0, 1
        else:
            if shape[1:] != tuple(gshape[1:]):
                self.one_dim = False
                return
            start, stop = share.offsets[0], share.offsets[0] + shape[0]
        self.keys.append(self.expansion.position[share.key] * self.pp_size + pp_rank)
        self.starts.append(start)
        self.stops.append(stop)

    def ok(self) -> bool | None:
        if not self.one_dim:
            return None
        keys, starts, stops = (torch.tensor(v, dtype=torch.int64) for v in (self.keys, self.starts, self.stops))
        order = torch.argsort(keys * (1 << 40) + starts)
        keys, starts, stops = keys[order], starts[order], stops[order]
        names = list(self.plan.tensors)
        rows = torch.tensor([(self.plan.tensors[n].shape or (1,))[0] for n in names], dtype=torch.int64)
        rows = rows.repeat_interleave(self.pp_size)  # by slot
        expected = sorted(self.expected)
        first = torch.ones_like(keys, dtype=torch.bool)
        first[1:] = keys[1:] != keys[:-1]
        last = torch.ones_like(keys, dtype=torch.bool)
        last[:-1] = keys[1:] != keys[:-1]
        contiguous = bool((starts[~first] == stops[:-1][~first[1:]]).all()) if len(keys) > 1 else True
        written = keys[first].tolist()
        empty = [p for p in expected if rows[p] == 0]
        return (contiguous and bool((starts[first] == 0).all()) and bool((stops[last] == rows[keys[last]]).all())
                and sorted(written + empty) == expected)
