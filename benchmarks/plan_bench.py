"""Planner benchmark: the predicted export time against the real export, on CPU ranks.

For each world size, on the same model and layout (docs/design.md#planner):

1. ``nemo_moe_export.planner`` simulates the export on ``W`` ranks (one node) and records every
   rank's byte runs; the checksum bandwidth (``replicas.checksum``, one process) is measured;
2. ``W`` gloo ranks (``spawn``) build the model, sharded by ``job/trainer.shard_model``, and
   measure what the time model takes, the way it assumes it, among themselves: the latency of
   each kind of collective the export makes (an agreement, ``Coordinator.agree``, over its
   butterfly's rounds; on gloo rings as the model's groups run the replica check, a vector
   all-reduce and an object all-gather, over their hops: ``timing.all_reduce_hops`` /
   ``gather_hops``), and a new Coordinator group's connections (``butterfly_rounds(W)`` of them);
   and the node's write bandwidth: every rank
   pwrites its planned byte runs into the plan's files (created at full size first, as the
   headers step does) from memory of its own, in the writer's slices with early writeback
   (``writer._write_and_release``), then fsyncs; bandwidth = bytes / (last fsync - first start);
3. the same ranks run ``export_hf_checkpoint``: ``--repeat`` rounds, each a bandwidth measurement
   and a small-file operation on rank 0 (4 KB written and fsynced, the median of 10) then an
   export into a new target, after one discarded bandwidth round (the disk's first burst after
   the model build is slow); every measurement and export is followed by the deletion of what it
   wrote and a ``sync`` (untimed), so each starts from the same state of the disk;
   measured = the median export's slowest rank's ``ExportResult.seconds``, predicted = the
   planner's time with the medians of the bandwidths and file operations, and the latencies.

With ``--pp P`` (``--stages-per-rank``, ``--layers-per-stage``) the job has pipeline stages: each
rank builds its stages with ``pipeline.stages.split_stages``, shards them inside the stage on
meshes with "pp" outermost, and exports them with ``pp_group=``. With ``--tp T`` / ``--cp C``
(FSDP only) the ranks build the torchtitan layout: mesh ``("dp", "cp", "tp")`` (sizes 1 left
out), ``job.tensor_parallel.parallelize_tp`` over "tp", ``fully_shard`` over "dp".

Prints JSON (and writes it with ``--out``):

    python benchmarks/plan_bench.py --worlds 2 4 8 --out /tmp/plan.json
    python benchmarks/plan_bench.py --worlds 4 8 --pp 2 --strategy ep --ep 2     # pipeline stages x EP
    python benchmarks/plan_bench.py --measure-bandwidth /tmp --mb 1024 --writers 4 --files 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]
from output import emit  # noqa: E402  (benchmarks/output.py)

_BLOCK = 2 << 20  # the random block a writer's own memory is filled with


def _own_memory(nbytes: int) -> bytearray:
    """``nbytes`` of this process's own memory, every page touched (a rank's tensors are distinct
    memory: a writer reading one cached block would copy faster than the export does)."""
    block = os.urandom(_BLOCK)
    memory = bytearray(nbytes)
    view = memoryview(memory)
    for start in range(0, nbytes, _BLOCK):
        view[start:start + _BLOCK] = block[:min(_BLOCK, nbytes - start)]
    return memory


def write_runs(directory: str, runs: list[tuple[str, int, int]], memory: bytearray) -> tuple[float, float]:
    """pwrite ``runs`` (file, offset, bytes) from ``memory`` the way the export's writer does (2 MiB
    slices, each handed to writeback), then fsync every file; ``(start, end)`` perf_counter times."""
    from nemo_moe_export.export.writer import _write_and_release

    view = memoryview(memory)
    started = time.perf_counter()
    fds: dict[str, int] = {}
    try:
        source = 0
        for name, offset, nbytes in runs:
            if name not in fds:
                fds[name] = os.open(os.path.join(directory, name), os.O_WRONLY)
            _write_and_release(fds[name], view[source:source + nbytes], offset, True)
            source += nbytes
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return started, time.perf_counter()


def create_files(directory: str, sizes: dict[str, int]) -> None:
    """The files at their full size, as the headers step creates them before the write step."""
    for name, size in sizes.items():
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)


def _writer_process(directory: str, runs: list, start: Any, done: Any) -> None:
    memory = _own_memory(sum(n for _, _, n in runs))
    start.wait()
    done.put(write_runs(directory, runs, memory))


def measure_bandwidth(directory: str, total_bytes: int, writers: int, files: int = 1) -> dict:
    """Without a plan: ``writers`` processes write ``total_bytes`` into ``files`` files of equal
    size, each writer a contiguous share of every file, from its own memory: bytes / wall time
    from the common start to the last fsync."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    per_file = total_bytes // files
    share = per_file // writers
    folder = tempfile.mkdtemp(prefix="nme-bw-", dir=directory)
    try:
        create_files(folder, {f"f{i}": per_file for i in range(files)})
        start, done = ctx.Barrier(writers + 1), ctx.Queue()
        procs = [ctx.Process(target=_writer_process,
                             args=(folder, [(f"f{i}", w * share, share) for i in range(files)], start, done))
                 for w in range(writers)]
        for p in procs:
            p.start()
        start.wait()
        times = [done.get() for _ in procs]
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a bandwidth writer failed: exit codes {[p.exitcode for p in procs]}")
    seconds = max(e for _, e in times) - min(s for s, _ in times)
    nbytes = share * writers * files
    return dict(bytes=nbytes, writers=writers, files=files, seconds=round(seconds, 4), bytes_per_s=nbytes / seconds)


def measure_file_op(directory: str, rounds: int = 20) -> float:
    """Median seconds of one small-file operation as the export's bookkeeping makes them: a 4 KB
    file created, written and fsynced (the time model's ``file_op_s``)."""
    folder = tempfile.mkdtemp(prefix="nme-fileop-", dir=directory)
    times = []
    try:
        for i in range(rounds):
            started = time.perf_counter()
            fd = os.open(os.path.join(folder, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, b"{}" * 2048)
                os.fsync(fd)
            finally:
                os.close(fd)
            times.append(time.perf_counter() - started)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return statistics.median(times)


def measure_group_setup(rounds: int = 5) -> float:
    """On this rank, the median seconds a new ``Coordinator`` on a new group (a job's first:
    ``collectives.gloo_group``, connected lazily) takes to build and agree once, less a warm
    agreement on it."""
    from nemo_moe_export.parallel import Coordinator

    times = []
    for i in range(rounds):
        started = time.perf_counter()
        coordinator = Coordinator(timeout_s=61 + i, name=f"setup{i}")  # a timeout of its own: a new group
        coordinator.agree("first")
        first = time.perf_counter() - started
        warm = []
        for j in range(5):
            started = time.perf_counter()
            coordinator.agree(f"warm {j}")
            warm.append(time.perf_counter() - started)
        times.append(first - statistics.median(warm))
    return statistics.median(times)


def measure_collectives(tensors: int, rounds: int = 40) -> dict[str, float]:
    """On this rank, the median seconds of each kind of collective the export makes, taken in
    turn (an agreement on the Coordinator's butterfly; on the world's gloo ring, as the model's own
    groups run the replica check, an all-reduce of ``tensors`` int64 counts and an object all-gather
    of a digest's length), after ten rounds that connect and warm up."""
    import torch
    import torch.distributed as dist

    from nemo_moe_export.parallel import Coordinator

    coordinator = Coordinator(timeout_s=60, name="latency")
    counts = torch.ones(tensors, dtype=torch.int64)

    def gather(i):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, f"{i:064d}")

    kinds = dict(agreement=lambda i: coordinator.agree(f"round {i}"), object_gather=gather,
                 vector_all_reduce=lambda i: dist.all_reduce(counts.clone()))
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(rounds + 10):
        for kind, run in kinds.items():
            started = time.perf_counter()
            run(i)
            if i >= 10:
                times[kind].append(time.perf_counter() - started)
    return {k: statistics.median(v) for k, v in times.items()}


def measure_checksum_bandwidth(nbytes: int = 256 << 20) -> float:
    import torch

    from nemo_moe_export.export.replicas import checksum

    t = torch.ones(nbytes // 4, dtype=torch.float32)
    checksum(t)
    started = time.perf_counter()
    checksum(t)
    return nbytes / (time.perf_counter() - started)


def _config(args):
    from nemo_moe_export.tiny_models import tiny_config

    return tiny_config("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden,
                       moe_intermediate_size=args.moe_inter, num_layers=args.layers, vocab_size=args.vocab)


def _build_model(args, strategy):
    """The model on meta, sharded as the recipe shards it (under pipeline stages: this rank's stage
    modules, each sharded inside its stage), materialised with the same values on every replica;
    and the pipeline group (None without stages)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.config import ParallelConfig
    from nemo_moe_export.job.trainer import shard_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(args), dtype=torch.bfloat16)
    parallel = ParallelConfig(**strategy)
    if parallel.tp_size * parallel.cp_size > 1:
        parts, pp_group = [_model_parallel(model, parallel)], None
    elif parallel.pp_size > 1:
        parts, pp_group = _stage_parts(model, parallel)
    else:
        (model, _), pp_group = shard_model(model, parallel), None
        parts = [model]
    for part in parts:
        _materialise(part)
    return (parts if pp_group is not None else parts[0]), pp_group


def _model_parallel(model, parallel):
    """TP over "tp" (``parallelize_tp``), CP copies over "cp", FSDP2 over "dp", as torchtitan lays them out."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_moe_export.planner.model_parallel import model_parallel_of
    from nemo_moe_export.job.tensor_parallel import parallelize_tp_fsdp

    shape, names = model_parallel_of(parallel).root(dist.get_world_size())  # the planner's own mesh
    return parallelize_tp_fsdp(model, init_device_mesh("cpu", shape, mesh_dim_names=names))


def _stage_parts(model, parallel):
    """This rank's stages of ``model``, sharded inside the stage as the recipe lays a pipelined job
    out (``job/pipelined.py``: "pp" outermost), and the pipeline group."""
    import torch.distributed as dist

    from nemo_moe_export.job.pipelined import shard_pipelined
    from nemo_moe_export.job.trainer import _shard_other_dtype_modules

    pipelined, _ = shard_pipelined(model, parallel, dist.get_world_size(), shard_other_dtypes=_shard_other_dtype_modules)
    return list(pipelined.parts), pipelined.pipeline_group


def _materialise(model) -> None:
    """Random values (incompressible, like trained weights), equal on every replica."""
    import torch

    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            local, offsets = tensor, ()
            if hasattr(tensor, "to_local"):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                local = tensor.to_local()
                offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)[1]
            seed = zlib.crc32(f"{name}{tuple(offsets)}".encode())
            local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(seed)))


def _clean(rank: int, path: str) -> None:
    """Rank 0 deletes the last round's files and quiesces the disk (untimed), then every rank goes on."""
    import torch.distributed as dist

    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()
    dist.barrier()


def _export_worker(rank, world, args, strategy, target, runs, file_sizes, tensors):
    """Every rank: the model; the collectives' latencies; then bandwidth rounds and exports in turn."""
    import torch.distributed as dist

    from nemo_moe_export.export import export_hf_checkpoint

    model, pp_group = _build_model(args, strategy)
    dist.barrier()  # a training job's process group is warm: connect the gloo pairs before timing
    latencies = measure_collectives(tensors)
    latencies["group_setup"] = measure_group_setup()
    memory = _own_memory(max(1, sum(n for _, _, n in runs[rank])))
    bandwidth_runs, file_ops, results = [], [], []
    folder = f"{target}-bw"
    for i in range(args.repeat + 1):  # round 0: a bandwidth measurement only, discarded
        # Each measurement and each export writes into a new directory, the one before it deleted
        # and the disk quiesced first (untimed), so each writes after the same: one deletion and a sync.
        if rank == 0:
            os.makedirs(folder)
            create_files(folder, file_sizes)
        dist.barrier()
        bandwidth_runs.append(write_runs(folder, runs[rank], memory))
        dist.barrier()
        _clean(rank, folder)
        if i == 0:
            continue
        if rank == 0:  # rank 0 makes the bookkeeping's file operations
            file_ops.append(measure_file_op(os.path.dirname(target), rounds=10))
        dist.barrier()
        # Each export into a new target, as a job's end-of-training export is (the planner predicts
        # that; replacing a checkpoint also deletes the old one, a cost of its own).
        results.append(export_hf_checkpoint(f"{target}-{i}", model, max_shard_size=args.max_shard_size,
                                            pp_group=pp_group))
        _clean(rank, f"{target}-{i}")
    return dict(seconds=[r.seconds for r in results], step_seconds=[r.step_seconds for r in results],
                io=[r.io for r in results], bytes=results[-1].rank_bytes_written,
                checkpoint_bytes=results[-1].checkpoint_bytes, files=results[-1].files,
                latencies=latencies, bandwidth_times=bandwidth_runs[1:], file_ops=file_ops)


def run_world(args, world: int) -> dict:
    import torch

    from nemo_moe_export.config import ParallelConfig
    from nemo_moe_export.export.options import ExportOptions
    from nemo_moe_export.planner import TimeModel, build_meta_model, predict, simulate
    from nemo_moe_export.collectives import butterfly_rounds
    from nemo_moe_export.planner.timing import all_reduce_hops, gather_hops
    from nemo_moe_export.spawn import spawn

    strategy = dict(strategy=args.strategy, replicate=args.replicate, ep_size=args.ep)
    if args.pp > 1:
        strategy.update(pp_size=args.pp, stages_per_rank=args.stages_per_rank, layers_per_stage=args.layers_per_stage)
    if args.tp > 1 or args.cp > 1:
        strategy.update(tp_size=args.tp, cp_size=args.cp)
    load_before = os.getloadavg()  # the machine is shared: how busy it was around this world's runs
    meta = build_meta_model(_config(args), torch.bfloat16)
    sim = simulate(meta, ParallelConfig(**strategy), world, ExportOptions(max_shard_size=args.max_shard_size),
                   device="cpu", record_runs=True)
    checksum_bw = measure_checksum_bandwidth()
    sizes = {f.name: f.size for f in sim.plan.files}
    target = os.path.join(tempfile.mkdtemp(prefix="nme-plan-bench-", dir=args.dir), "hf")
    try:
        per_rank = spawn(_export_worker, world, args, strategy, target, [r.byte_runs for r in sim.ranks], sizes,
                         len(sim.plan.tensors), timeout_s=1200)
    finally:
        shutil.rmtree(os.path.dirname(target), ignore_errors=True)
    written = sum(r.bytes for r in sim.ranks)
    bandwidths = [written / (max(r["bandwidth_times"][i][1] for r in per_rank)
                             - min(r["bandwidth_times"][i][0] for r in per_rank)) for i in range(args.repeat)]
    bandwidth = statistics.median(bandwidths)
    file_op = statistics.median(per_rank[0]["file_ops"])
    # each kind's latency: the slowest rank's median, over the kind's hops (the butterfly's rounds and
    # connections) among W ranks
    latency = {k: max(r["latencies"][k] for r in per_rank) for k in per_rank[0]["latencies"]}
    hops = dict(agreement=butterfly_rounds(world), vector_all_reduce=all_reduce_hops(world),
                object_gather=gather_hops(world), group_setup=butterfly_rounds(world))
    per_hop = {k: latency[k] / hops[k] if hops[k] else 0.0 for k in latency}
    model = TimeModel(bandwidth, ranks_per_node=world, checksum_bandwidth=checksum_bw,
                      collective_latency_s=per_hop["agreement"], vector_hop_s=per_hop["vector_all_reduce"],
                      gather_hop_s=per_hop["object_gather"], group_connect_s=per_hop["group_setup"],
                      cores_per_node=os.cpu_count(), file_op_s=file_op)
    predicted = predict(sim, model)
    repeats = [max(r["seconds"][i] for r in per_rank) for i in range(args.repeat)]
    median = sorted(range(args.repeat), key=repeats.__getitem__)[args.repeat // 2]  # the median export
    steps = {k: max(r["step_seconds"][median][k] for r in per_rank) for k in per_rank[0]["step_seconds"][median]}
    planned_bytes = [r.bytes for r in sim.ranks]
    return dict(
        world_size=world, layout=strategy, load_average_before=[round(x, 2) for x in load_before],
        load_average_after=[round(x, 2) for x in os.getloadavg()], checkpoint_bytes=sim.plan.total_tensor_bytes, files=len(sim.plan.files),
        bandwidth_bytes_per_s=bandwidth, bandwidth_runs=[round(b) for b in bandwidths], export_runs_s=repeats,
        file_op_runs_s=per_rank[0]["file_ops"],
        checksum_bytes_per_s=checksum_bw, collective_seconds=latency, collective_hop_s=per_hop, file_op_s=file_op,
        predicted=predicted, measured_seconds=repeats[median],
        predicted_over_measured=round(predicted["seconds"] / repeats[median], 3),
        measured_steps_slowest_rank=steps, predicted_steps=predicted["steps"],
        # before the first step: the Coordinator's group (predicted: coordinator_setup_s)
        measured_before_steps_s=round(max(r["seconds"][median] - sum(r["step_seconds"][median].values())
                                          for r in per_rank), 4),
        write_io_slowest_rank=max((r["io"][median] for r in per_rank), key=lambda io: io["seconds"]),
        bytes_per_rank_planned=planned_bytes, bytes_per_rank_written=[r["bytes"] for r in per_rank],
        bytes_equal=planned_bytes == [r["bytes"] for r in per_rank],
        exchanged_bytes_planned=[r.exchanged_bytes for r in sim.ranks],
        exchanged_bytes_measured=[int(r["io"][median].get("exchanged_bytes", 0)) for r in per_rank],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure-bandwidth", metavar="DIR", help="only measure the write bandwidth in DIR")
    parser.add_argument("--mb", type=int, default=1024, help="with --measure-bandwidth: MB to write")
    parser.add_argument("--writers", type=int, default=1, help="with --measure-bandwidth: concurrent writers")
    parser.add_argument("--files", type=int, default=1, help="with --measure-bandwidth: files they share")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages' ranks (the layout inside each stage)")
    parser.add_argument("--stages-per-rank", type=int, default=1, help="virtual stages per pipeline rank")
    parser.add_argument("--layers-per-stage", type=int, nargs="+", help="decoder layers of each stage")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (torch TP x FSDP2)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (weights copied over CP)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-inter", type=int, default=512)
    parser.add_argument("--experts", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds of a bandwidth measurement and an export (medians)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the exports are written")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.measure_bandwidth:
        measured = measure_bandwidth(args.measure_bandwidth, args.mb * 10**6, args.writers, args.files)
        print(json.dumps(measured, indent=1))
        return
    import platform

    import torch

    result = dict(benchmark="plan_bench", environment=dict(torch=torch.__version__, cpu_cores=os.cpu_count(),
                                                           python=platform.python_version()),
                  args=vars(args), worlds=[run_world(args, w) for w in args.worlds])
    emit(result, args.out)


if __name__ == "__main__":
    main()
