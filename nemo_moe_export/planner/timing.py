"""The export-time model: one place, its assumptions stated (docs/design.md#planner).

Assumptions:

* **Writing.** Ranks are placed on nodes in order (``rank // ranks_per_node``); a node writes at
  ``node_bandwidth`` bytes/s in total whatever the number of its ranks writing at once. That
  bandwidth is the export's own I/O pattern's: ``benchmarks/plan_bench.py`` measures it with the
  job's ranks each pwriting its planned byte runs (``RankPlan.byte_runs``) into the plan's files,
  created at full size beforehand as the headers step creates them, from memory of its own (not
  one cached block), in the writer's 2 MiB slices with early writeback, then fsync. Where ranks
  outnumber cores the copies into the page cache compete for the cores, which that measurement
  includes. The write step lasts as long as the busiest node: ``max over nodes of (bytes its ranks
  write) / node_bandwidth``.
* **Coordination is a butterfly on a lazily connected gloo group.** The export coordinates on a
  gloo side group (``parallel.Coordinator``) whose all-reduces are recursive doubling
  (``collectives.butterfly_all_reduce``): ``butterfly_rounds(G)`` exchanges one after the other on
  a group of ``G`` ranks (``log2 G``, two more when ``G`` is not a power of two), whatever the
  payload's size, which is also sent once per round at ``network_bandwidth``. A round costs what
  ``plan_bench.py`` measures among as many ranks per node as the job runs (ranks that outnumber
  the cores included): ``collective_latency_s`` is one round of an agreement (its median seconds
  over its rounds). The collectives the export makes there (``export/step.py``): ``AGREEMENTS``
  agreements, one at the end of each step and one after the replica check; the first carries the
  plan digest's fingerprint and rank 0's export id (``VALIDATE_WORDS``), the second the count of
  replica findings and the coverage counts (8 bytes per tensor); and, when plain tensors are
  replicated over the whole export group, the replica check's two all-reduces of that group on
  the butterfly too. Nothing is gathered unless a check fails. The replica check's other groups
  are the model's own (DTensor meshes): their two all-reduces each (a header, the checksums) are
  gloo rings on CPUs, ``2 (g - 1)`` hops of ``vector_hop_s`` on a group of ``g`` ranks; on GPUs
  they run on NCCL, modelled with the same hops (an upper bound). The agreements stay on gloo on
  GPU jobs too (a wait on NCCL cannot be bounded by the export's timeout without aborting its
  communicator); ``agreements_on_nccl_s`` says what they would cost there, at
  ``nccl_all_reduce_s`` each (an assumption: state your cluster's).
* **Pipeline stages** (``export/stages.py``, ``step._lay_out_stages``) add, once per export: each
  rank's pipeline rank in a vector of ``W`` words summed on the butterfly (the stage peers); the
  stage peers' gloo group (made once per job, opened by its ``S = W / pp_size`` members and
  connected lazily: the ring neighbours of the replica check's all-reduces, ``2 x
  group_connect_s``); the catalogue merge, an object all-gather over the pipeline group
  (``gather_hops(pp_size)`` hops, the largest pickled catalogue times ``pp_size - 1`` at
  ``network_bandwidth``, and the pickling and merging, timed by the planner with the export's own
  representation and merge, crowded like validate's work); and the "validate stages" agreement,
  which carries the plan words and waits for rank 0's ``check_declared`` (transformers' model for
  the config on the meta device, timed by the planner with its cache cleared): rank 0's work, as
  the bookkeeping steps' is. A rank's state dict and replica names scale with the share of the
  model its stages hold (the fullest pipeline rank's). Per pipeline rank the report gives the
  seconds its ranks alone take to write their bytes; the write step is the busiest node's.
* **Row-parallel TP weights** (``export/row_exchange.py``) are exchanged in the write step before
  they are written: the TP peers' gloo group is opened once (``(tp - 1) x group_connect_s``; it is
  the stage peers' group when those are the same ranks), then one ``all_to_all_single`` per
  row-parallel weight over the ``tp`` peers (``tp - 1`` pairwise hops at a vector all-reduce's hop)
  and the bytes a rank sends (``RankPlan.exchanged_bytes``) at ``network_bandwidth``; the busiest
  rank's exchange lengthens the write step. Its pieces are then written as whole rows (the write
  model above counts their bytes like any other).
* **A coordination group per job, connected where used.** ``parallel.Coordinator``'s gloo group is
  made once per job (``collectives.gloo_group``) with lazy connections: a rank connects to the
  ``butterfly_rounds(W)`` peers it exchanges with at most, ``group_connect_s`` each, measured by
  ``plan_bench.py`` as a new group's first agreement less a warm one, over those peers. The
  prediction counts it, as for the job's first coordination (an end-of-training export).
* **CPU-bound work competes for the cores.** Validate's rank-local work (the model's
  ``state_dict()``, ``step.export_plan_of``, ``step.replicated_tensors``, ``step.rank_write_shares``,
  ``plan.element_counts``, ``replicas.replica_sets``, ``plan.stamped``) is the planner's timing of
  that same code in its own process (with the cycle collector paused, as the export pauses it);
  every rank of a node runs it at once, so where ``ranks_per_node`` exceeds ``cores_per_node`` it
  takes ``ranks_per_node / cores_per_node`` times as long (default: a core per rank). The replica
  check's checksums read their bytes at ``checksum_bandwidth`` per core, shared the same way.
* **Files and metadata.** Each file operation of the export's bookkeeping (a file created, written
  and fsynced: a header, ``config.json``, the index, the lock; a directory made or renamed and
  its parent fsynced) costs ``file_op_s``, measured by ``benchmarks/plan_bench.py`` the same way
  (a small file written and fsynced): ``BOOKKEEPING_FILE_OPS`` of rank 0's in prepare, headers,
  verify and publish, and in headers the files of the rank owning the most. Rank 0's code there
  (``target.write_metadata_files``, ``verify.verify_checkpoint``) is the planner's timing of that
  same code on a skeleton of the checkpoint (``simulate.py``); it runs while the other ranks wait,
  so it is not slowed by crowding.
* **Waiting ranks notice an agreement at once.** ``Coordinator.agree`` waits on the all-reduce's
  completion (a thread blocked in it wakes the waiting one), so a rank that waited for rank 0's
  bookkeeping leaves the agreement when its last round ends; the handover is inside the measured
  round time. In those four steps the other ranks wait for rank 0's work and the agreement, so
  each step lasts that wait plus the agreement. Where the ranks work alike (validate, write) the
  skew between them is not modelled.
* **A new target.** The export writes into a directory that does not exist yet, as a job's
  end-of-training export does; ``overwrite="replace"`` also deletes the old checkpoint at publish,
  a cost of the filesystem's (0.12 s for 462 MB on the H200 host) that is not modelled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nemo_moe_export.collectives import butterfly_rounds
from nemo_moe_export.errors import InputError

__all__ = ["AGREEMENTS", "BOOKKEEPING_FILE_OPS", "METADATA_FILE_OPS", "STAGE_AGREEMENTS", "STAGE_RANK_VECTORS",
           "TimeModel", "VALIDATE_WORDS", "all_reduce_hops", "collectives", "exchange_collectives", "gather_hops",
           "predict"]

# Coordinator.agree calls (export/step.py): the end of validate, of the replica check ("validate
# replicas"), prepare, headers, write, verify and publish.
AGREEMENTS = 7
VALIDATE_AGREEMENTS = 2  # of those, the ones inside the validate step
# Words the validate agreement carries besides its status: the plan digest's fingerprint (8) and
# rank 0's export id; the replica agreement carries the findings' count and one word per tensor.
VALIDATE_WORDS = 9
# Under pipeline stages (export/stages.py, step._lay_out_stages): the "validate stages" agreement
# (which then carries the plan words), and every rank's pipeline rank summed in a vector of W words.
STAGE_AGREEMENTS = 1
STAGE_RANK_VECTORS = 1
# The stage peers' group connects its ring neighbours (the replica check's all-reduces on it).
STAGE_GROUP_CONNECTIONS = 2
# Rank 0's small-file operations besides the headers (export/target.py), by step: the lock and the
# partial directory; the index, config.json and generation_config.json; the sealing fsync of the
# directory; the publish rename and its parent's fsync.
BOOKKEEPING_FILE_OPS = dict(prepare=2, headers=3, verify=1, publish=2)
METADATA_FILE_OPS = sum(BOOKKEEPING_FILE_OPS.values())
# The defaults: what benchmarks/plan_bench.py measured among 8 and 16 ranks of the 16-core H200
# host, a core each (docs/design.md#planner): one round of an agreement's butterfly (0.27 and 0.35
# ms), one hop of a ring all-reduce of a vector and of an object all-gather, and a peer's
# connection in a new gloo group (0.6 and 3.0 ms). Across nodes a round also crosses the network:
# pass the cluster's own.
DEFAULT_ROUND_S = 3.1e-4
DEFAULT_VECTOR_HOP_S = 1.7e-4
DEFAULT_GATHER_HOP_S = 2.3e-4
DEFAULT_CONNECT_S = 1.8e-3
DEFAULT_NCCL_ALL_REDUCE_S = 1e-4


def all_reduce_hops(group: int) -> int:
    """Hops one after the other of a gloo ring all-reduce on ``group`` ranks (reduce-scatter, all-gather)."""
    return 2 * (group - 1) if group > 1 else 0


def gather_hops(group: int) -> int:
    """Hops of ``Coordinator.all_gather`` (``all_gather_object``: two ring all-gathers) on ``group`` ranks."""
    return 2 * (group - 1) if group > 1 else 0


@dataclass(frozen=True)
class TimeModel:
    node_bandwidth: float  # bytes/s one node writes, all its ranks together
    ranks_per_node: int
    checksum_bandwidth: float = 5e9  # bytes/s a core checksums (CPU host memory; ~1e12 on an H200)
    collective_latency_s: float = DEFAULT_ROUND_S  # one round of an agreement's butterfly
    network_bandwidth: float = 1e9  # bytes/s of a rank's link for collectives' payloads
    cores_per_node: int | None = None  # None: one core per rank
    file_op_s: float = 2e-3  # a small file written and fsynced (a local disk; network filesystems: more)
    vector_hop_s: float = DEFAULT_VECTOR_HOP_S  # one hop of a ring all-reduce of a vector
    gather_hop_s: float = DEFAULT_GATHER_HOP_S  # one hop of an object all-gather
    group_connect_s: float = DEFAULT_CONNECT_S  # one peer connection in a gloo group (made on first use)
    # one small all-reduce on the job's NCCL group: what the agreements would cost there (an
    # assumption, not measured here: nccl-tests' all_reduce_perf at 8 bytes gives yours)
    nccl_all_reduce_s: float = DEFAULT_NCCL_ALL_REDUCE_S

    def __post_init__(self) -> None:
        for name in ("node_bandwidth", "checksum_bandwidth", "network_bandwidth"):
            if not getattr(self, name) > 0:
                raise InputError("bandwidth must be positive", key=name, expected="> 0 bytes/s",
                                 actual=getattr(self, name))
        for name in ("file_op_s", "collective_latency_s", "vector_hop_s", "gather_hop_s", "group_connect_s",
                     "nccl_all_reduce_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise InputError("a time cannot be negative", key=name, expected=">= 0 seconds", actual=value)
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise InputError("ranks per node must be a positive integer", key="ranks_per_node",
                             expected=">= 1", actual=self.ranks_per_node)

    @property
    def crowding(self) -> float:
        """How much slower CPU-bound work runs when every rank of a node runs it at once."""
        return max(1.0, self.ranks_per_node / (self.cores_per_node or self.ranks_per_node))


def collectives(simulation, rank: int) -> list[tuple[str, int]]:
    """The collectives the export makes on ``rank``, as ``(kind, group size)``: kind is
    ``group_setup`` (a gloo group made: the Coordinator's, once per job; under pipeline stages also
    the stage peers'), ``agreement`` (``Coordinator.agree``, a butterfly), ``butterfly`` (another
    all-reduce on the Coordinator's group: the replica check's over the export group, the pipeline
    ranks), ``vector_all_reduce`` (a replica group's header and checksums on the model's own
    group), ``object_gather`` (under pipeline stages, the catalogue merge over the pipeline group)
    or ``all_to_all`` (under TP, the row-parallel exchange's, over the TP group); none when alone."""
    world = simulation.world_size
    if world == 1:
        return []
    return ([("group_setup", world)] + [("agreement", world)] * AGREEMENTS + _stage_collectives(simulation)
            + _replica_collectives(simulation, rank) + exchange_collectives(simulation, rank))


def exchange_collectives(simulation, rank: int) -> list[tuple[str, int]]:
    """The row-parallel exchange's (``row_exchange.write_exchanged_rows``): the TP peers' gloo group
    (``collectives.gloo_group``, shared with the stage peers' when they are the same ranks) and one
    ``all_to_all`` per row-parallel weight over the TP group; none without TP."""
    r = simulation.ranks[rank]
    if not r.row_exchanges:
        return []
    work = getattr(simulation, "stages", None)
    same_as_stage = work is not None and simulation.world_size // work.pipeline.pp_size == r.exchange_group
    setup = [] if same_as_stage else [("group_setup", r.exchange_group)]
    return setup + [("all_to_all", r.exchange_group)] * r.row_exchanges


def _stage_collectives(simulation) -> list[tuple[str, int]]:
    """Under pipeline stages (``export/stages.py``): the "validate stages" agreement, the pipeline
    ranks summed on the butterfly, the stage peers' gloo group (opened by its ``S`` members only)
    and the catalogue merge, an object all-gather over the pipeline group."""
    work = getattr(simulation, "stages", None)
    if work is None:
        return []
    world, pp = simulation.world_size, work.pipeline.pp_size
    return ([("agreement", world)] * STAGE_AGREEMENTS + [("butterfly", world)] * STAGE_RANK_VECTORS
            + [("group_setup", world // pp), ("object_gather", pp)])


def _replica_collectives(simulation, rank: int) -> list[tuple[str, int]]:
    """The replica check's (``replicas.compare_replicas``): per replica group of the rank a header
    and a checksum all-reduce, on the butterfly for the export group (its count of findings rides
    on the agreement)."""
    r = simulation.ranks[rank]
    sizes = [g for g in r.replica_group_sizes if g > 1]
    if r.export_group_checked:
        sizes.remove(simulation.world_size)
    return (([("butterfly", simulation.world_size)] * 2 if r.export_group_checked else [])
            + [("vector_all_reduce", g) for g in sizes for _ in range(2)])


def _collective_seconds(kind: str, group: int, model: TimeModel, words: int = 1) -> float:
    """One collective of ``kind`` on ``group`` ranks; ``words`` (8 bytes each) for the butterfly's payload."""
    if kind in ("agreement", "butterfly"):
        return butterfly_rounds(group) * (model.collective_latency_s + 8 * words / model.network_bandwidth)
    if kind == "object_gather":
        return gather_hops(group) * model.gather_hop_s
    if kind == "all_to_all":  # gloo: a pairwise exchange with each peer in turn
        return (group - 1) * model.vector_hop_s
    if kind == "vector_all_reduce":
        return all_reduce_hops(group) * model.vector_hop_s
    raise ValueError(kind)


def predict(simulation, model: TimeModel) -> dict:
    """Predicted seconds of each part of the export of ``simulation`` (a ``simulate.Simulation``),
    and of its validate and write steps."""
    world = simulation.world_size
    crowding = model.crowding
    word_s = _collective_seconds("agreement", world, model)  # one agreement
    write_s, nodes = _write_seconds(simulation.ranks, model)
    # the replica check: checksums, each replica group's two all-reduces
    check_s = max(crowding * r.replica_bytes_checked / model.checksum_bandwidth
                  + sum(_collective_seconds(kind, g, model) for kind, g in _replica_collectives(simulation, r.rank))
                  for r in simulation.ranks)
    # the words the validate and replica agreements carry (the coverage counts: one per tensor)
    coverage_words = simulation.coverage_allreduce_bytes // 8
    carried_s = (_collective_seconds("agreement", world, model, 1 + VALIDATE_WORDS)
                 + _collective_seconds("agreement", world, model, 2 + coverage_words) - 2 * word_s)
    agree_s = AGREEMENTS * word_s + carried_s if world > 1 else 0.0
    stages = _stage_seconds(simulation, model)
    # every rank runs the same code: the median simulated rank's time (a max would pick up noise)
    local = sorted(r.share_seconds + r.local_seconds for r in simulation.ranks)
    held = simulation.stages.held_fraction if simulation.stages is not None else 1.0
    validate_s = crowding * (held * (simulation.state_dict_seconds + simulation.replicated_seconds)
                             + simulation.plan_seconds + simulation.stamp_seconds + local[len(local) // 2])
    setup_s = butterfly_rounds(world) * model.group_connect_s
    # rank 0's work in the bookkeeping steps (and the declared-tensors check under stages), which
    # the other ranks wait for at the agreement
    owned = max(r.files_owned for r in simulation.ranks)
    solo = {step: ops * model.file_op_s for step, ops in BOOKKEEPING_FILE_OPS.items()}
    solo["headers"] += owned * model.file_op_s + simulation.index_seconds
    solo["verify"] += simulation.verify_seconds
    declared_s = simulation.stages.declared_seconds if simulation.stages is not None and world > 1 else 0.0
    files_s = sum(solo.values())
    exchange_s = max(_exchange_seconds(simulation, r.rank, model) for r in simulation.ranks)
    total = (setup_s + write_s + exchange_s + check_s + agree_s + validate_s + files_s + declared_s
             + sum(stages.values()))
    checksums_s = max(crowding * r.replica_bytes_checked / model.checksum_bandwidth for r in simulation.ranks)
    # coordination: all but the writing, validate's rank-local compute, rank 0's own work and the
    # checksums (the side group's collectives, the exchange, the pipeline's stage collectives)
    coordination_s = total - write_s - validate_s - files_s - declared_s - checksums_s
    steps = dict(validate=validate_s + check_s + VALIDATE_AGREEMENTS * word_s + carried_s + declared_s
                 + sum(stages.values()),
                 write=write_s + exchange_s + word_s,
                 **{step: t + word_s for step, t in solo.items()})
    out = dict(seconds=round(total, 4), coordinator_setup_s=round(setup_s, 4), write_s=round(write_s, 4),
               replica_check_s=round(check_s, 4), coverage_s=round(carried_s, 4), agreements_s=round(agree_s, 4),
               validate_compute_s=round(validate_s, 4), files_and_metadata_s=round(files_s, 4),
               declared_check_s=round(declared_s, 4), row_exchange_s=round(exchange_s, 4),
               # the same agreements on NCCL instead (GPU jobs): what they would cost, for comparison
               agreements_on_nccl_s=round(AGREEMENTS * model.nccl_all_reduce_s if world > 1 else 0.0, 4),
               coordination_s=round(coordination_s, 4),
               coordination_share=round(coordination_s / total, 4) if total else 0.0,
               steps={k: round(v, 4) for k, v in steps.items()}, crowding=round(crowding, 3), nodes=len(nodes),
               busiest_node_bytes=max(nodes.values()), assumptions=asdict(model))
    if simulation.stages is not None:
        out["pipeline"] = dict({k: round(v, 4) for k, v in stages.items()},
                               by_pipeline_rank=_pipeline_rank_seconds(simulation, model))
    return out


def _exchange_seconds(simulation, rank: int, model: TimeModel) -> float:
    """The row-parallel exchange on ``rank``: its group (every TP peer connected), its all-to-alls
    and the bytes it sends."""
    sent = simulation.ranks[rank].exchanged_bytes / model.network_bandwidth
    return sent + sum((g - 1) * model.group_connect_s if kind == "group_setup" else _collective_seconds(kind, g, model)
                      for kind, g in exchange_collectives(simulation, rank))


def _write_seconds(ranks, model: TimeModel) -> tuple[float, dict[int, int]]:
    """The write step: the busiest node's bytes at the node's bandwidth; and bytes by node."""
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r.rank // model.ranks_per_node] = nodes.get(r.rank // model.ranks_per_node, 0) + r.bytes
    return max(nodes.values()) / model.node_bandwidth, nodes


def _stage_seconds(simulation, model: TimeModel) -> dict[str, float]:
    """The export's collectives for pipeline stages (``step._lay_out_stages``), none without them:
    the stage peers' group (its ring neighbours connected), the pipeline ranks summed on the
    butterfly (``W`` words), the catalogue merge (an object all-gather over the pipeline group: its
    hops, the padded catalogues at the network bandwidth, the pickling and merging on every rank,
    crowded like validate's work) and the "validate stages" agreement (rank 0's declared-tensors
    check, which it waits for, is rank 0's work: ``declared_check_s``)."""
    work = simulation.stages
    if work is None or simulation.world_size == 1:
        return {}
    world, pp = simulation.world_size, work.pipeline.pp_size
    return dict(
        stage_group_setup_s=min(STAGE_GROUP_CONNECTIONS, world // pp - 1) * model.group_connect_s,
        pipeline_ranks_gather_s=STAGE_RANK_VECTORS * _collective_seconds("butterfly", world, model, world),
        catalogue_merge_s=(_collective_seconds("object_gather", pp, model)
                           + (pp - 1) * work.catalogue_bytes / model.network_bandwidth
                           + model.crowding * work.catalogue_seconds),
        validate_stages_s=STAGE_AGREEMENTS * _collective_seconds("agreement", world, model),
    )


def _pipeline_rank_seconds(simulation, model: TimeModel) -> list[dict]:
    """Per pipeline rank: its ranks' bytes and the seconds they alone take to write them (their
    busiest node's bytes at the node's bandwidth; the write step lasts as long as the slowest)."""
    work = simulation.stages
    by_pp: dict[int, list] = {}
    for r in simulation.ranks:
        by_pp.setdefault(work.pp_rank(r.rank, simulation.world_size), []).append(r)
    out = []
    for pp_rank, ranks in sorted(by_pp.items()):
        write_s, _ = _write_seconds(ranks, model)
        out.append(dict(pp_rank=pp_rank, bytes=sum(r.bytes for r in ranks), max_rank_bytes=max(r.bytes for r in ranks),
                        write_s=round(write_s, 4)))
    return out
