"""Planner benchmark: the predicted export time against the real export, on CPU ranks.

For each world size, on the same model and layout:

1. the node's write bandwidth is measured the way the time model assumes it
   (``--measure-bandwidth``: ``W`` writer processes at once, each pwriting its share of the
   checkpoint's size in 2 MiB slices with early writeback, then fsync; bandwidth = bytes / wall
   time), the collective latency as an agreement's all-reduce among ``W`` gloo ranks over
   log2(W), and a small-file operation (4 KB written and fsynced);
2. ``nemo_moe_export.planner`` predicts the export on ``W`` ranks, one node, with that bandwidth
   (and a checksum bandwidth measured with ``replicas.checksum``);
3. the real ``export_hf_checkpoint`` runs on ``W`` gloo ranks (``spawn``) on the model sharded by
   ``recipe/trainer.shard_model``, each of ``--repeat`` exports into a new target (the previous
   one deleted and ``sync`` run before, untimed); measured = the median export's slowest rank's
   ``ExportResult.seconds``.

Prints JSON (and writes it with ``--out``):

    python benchmarks/plan_bench.py --worlds 4 8 --out benchmarks/results/cpu_plan_w4_w8.json
    python benchmarks/plan_bench.py --measure-bandwidth /tmp --mb 1024 --writers 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

_SLICE = 2 << 20  # export/writer.py writes in 2 MiB slices, each handed to writeback


def _write_share(path: str, share: int, start: Any) -> None:
    """One writer: ``share`` bytes in 2 MiB pwrites, each handed to writeback, then fsync."""
    block = os.urandom(_SLICE)
    start.wait()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, share)
        for offset in range(0, share, _SLICE):
            n = os.pwrite(fd, block[:min(_SLICE, share - offset)], offset)
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
        os.fsync(fd)
    finally:
        os.close(fd)


def measure_bandwidth(directory: str, total_bytes: int, writers: int) -> dict:
    """``writers`` processes (as the export's ranks are: each its own process, so CPU crowding
    counts as it does for them) write ``total_bytes`` together, one file each, then fsync:
    bytes / wall time from the common start to the last fsync."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    share = total_bytes // writers
    folder = tempfile.mkdtemp(prefix="nme-bw-", dir=directory)
    start = ctx.Barrier(writers + 1)
    procs = [ctx.Process(target=_write_share, args=(os.path.join(folder, f"w{i}"), share, start))
             for i in range(writers)]
    for p in procs:
        p.start()
    start.wait()
    started = time.perf_counter()
    for p in procs:
        p.join()
    seconds = time.perf_counter() - started
    shutil.rmtree(folder, ignore_errors=True)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a bandwidth writer failed: exit codes {[p.exitcode for p in procs]}")
    return dict(bytes=share * writers, writers=writers, seconds=round(seconds, 4),
                bytes_per_s=share * writers / seconds)


def measure_file_op(directory: str, rounds: int = 20) -> float:
    """Median seconds of one small-file operation as the export's bookkeeping makes them: a 4 KB
    file created, written and fsynced (the time model's ``file_op_s``)."""
    import statistics

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


def _latency_worker(rank: int, world: int, rounds: int) -> float:
    """The median seconds of one agreement (``parallel.Coordinator.agree``: the all-reduce of a
    status word, as the export's steps end) on this rank."""
    import statistics

    from nemo_moe_export.parallel import Coordinator

    coordinator = Coordinator(timeout_s=60, name="latency")
    times = []
    for i in range(rounds + 10):  # the first ten connect the pairs and warm up
        started = time.perf_counter()
        coordinator.agree(f"round {i}")
        if i >= 10:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_collective_latency(world: int, rounds: int = 50) -> float:
    """Seconds per step of a small collective among ``world`` gloo ranks on this machine, the
    ``collective_latency_s`` of the time model: an agreement's time over log2(W)."""
    import math

    from nemo_moe_export.spawn import spawn

    per_rank = spawn(_latency_worker, world, rounds, timeout_s=300)
    return max(per_rank) / max(1.0, math.log2(world))


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


def _export_worker(rank, world, args, strategy, target):
    """Every rank: the model on meta, sharded as the recipe shards it, materialised with the same
    values on every replica, exported."""
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.config import ParallelConfig
    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.recipe.trainer import shard_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(args), dtype=torch.bfloat16)
    model, _ = shard_model(model, ParallelConfig(**strategy))
    model.to_empty(device="cpu")
    with torch.no_grad():  # random values (incompressible, like trained weights), equal on every replica
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            local, offsets = tensor, ()
            if hasattr(tensor, "to_local"):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                local = tensor.to_local()
                offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)[1]
            seed = zlib.crc32(f"{name}{tuple(offsets)}".encode())
            local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(seed)))
    import torch.distributed as dist

    dist.barrier()  # a training job's process group is warm: connect the gloo pairs before timing
    results = []
    for i in range(args.repeat):
        # Each export into a new target, as a job's end-of-training export is (the planner predicts
        # that; replacing a checkpoint also deletes the old one, a cost of its own), the last
        # export's files removed and the disk quiesced before, outside the timing.
        if rank == 0:
            shutil.rmtree(f"{target}-{i - 1}", ignore_errors=True)
            os.sync()
        dist.barrier()
        results.append(export_hf_checkpoint(f"{target}-{i}", model, max_shard_size=args.max_shard_size))
    result = results[-1]
    return dict(seconds=[r.seconds for r in results], step_seconds=result.step_seconds, bytes=result.rank_bytes_written,
                checkpoint_bytes=result.checkpoint_bytes, files=result.files)


def run_world(args, world: int) -> dict:
    import torch

    from nemo_moe_export.config import ParallelConfig
    from nemo_moe_export.export.options import ExportOptions
    from nemo_moe_export.planner import TimeModel, build_meta_model, predict, simulate
    from nemo_moe_export.spawn import spawn

    strategy = dict(strategy=args.strategy, replicate=args.replicate, ep_size=args.ep)
    meta = build_meta_model(_config(args), torch.bfloat16)
    sim = simulate(meta, ParallelConfig(**strategy), world, ExportOptions(max_shard_size=args.max_shard_size),
                   device="cpu")
    # A first, discarded measurement: the disk's first burst after the model build ran at a third
    # of the later ones' speed here, and the exports measured are medians of warm runs too.
    measure_bandwidth(args.dir, sim.plan.total_tensor_bytes, world)
    runs = [measure_bandwidth(args.dir, sim.plan.total_tensor_bytes, world) for _ in range(args.repeat)]
    bandwidth = sorted(runs, key=lambda r: r["bytes_per_s"])[len(runs) // 2]  # the median run
    checksum_bw = measure_checksum_bandwidth()
    latency = measure_collective_latency(world)
    file_op = measure_file_op(args.dir)
    model = TimeModel(bandwidth["bytes_per_s"], ranks_per_node=world, checksum_bandwidth=checksum_bw,
                      collective_latency_s=latency, cores_per_node=os.cpu_count(), file_op_s=file_op)
    predicted = predict(sim, model)
    target = os.path.join(tempfile.mkdtemp(prefix="nme-plan-bench-", dir=args.dir), "hf")
    try:
        per_rank = spawn(_export_worker, world, args, strategy, target, timeout_s=1200)
    finally:
        shutil.rmtree(os.path.dirname(target), ignore_errors=True)
    repeats = [max(r["seconds"][i] for r in per_rank) for i in range(args.repeat)]
    measured = sorted(repeats)[len(repeats) // 2]  # the median export (each: its slowest rank)
    planned_bytes = [r.bytes for r in sim.ranks]
    return dict(
        world_size=world, layout=strategy, checkpoint_bytes=sim.plan.total_tensor_bytes, files=len(sim.plan.files),
        bandwidth=bandwidth, bandwidth_runs=[round(r["bytes_per_s"]) for r in runs], export_runs_s=repeats,
        checksum_bytes_per_s=checksum_bw, collective_latency_s=latency, file_op_s=file_op,
        predicted=predicted, measured_seconds=measured,
        measured_write_step_s=max(r["step_seconds"].get("write", 0.0) for r in per_rank),
        predicted_over_measured=round(predicted["seconds"] / measured, 3),
        bytes_per_rank_planned=planned_bytes, bytes_per_rank_written=[r["bytes"] for r in per_rank],
        bytes_equal=planned_bytes == [r["bytes"] for r in per_rank],
        step_seconds_rank0=per_rank[0]["step_seconds"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure-bandwidth", metavar="DIR", help="only measure the write bandwidth in DIR")
    parser.add_argument("--mb", type=int, default=1024, help="with --measure-bandwidth: MB to write")
    parser.add_argument("--writers", type=int, default=1, help="with --measure-bandwidth: concurrent writers")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-inter", type=int, default=512)
    parser.add_argument("--experts", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument("--repeat", type=int, default=3, help="bandwidth measurements and exports (medians)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the exports are written")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.measure_bandwidth:
        print(json.dumps(measure_bandwidth(args.measure_bandwidth, args.mb * 10**6, args.writers), indent=1))
        return
    import platform

    import torch

    result = dict(benchmark="plan_bench", environment=dict(torch=torch.__version__, cpu_cores=os.cpu_count(),
                                                           python=platform.python_version()),
                  args=vars(args), worlds=[run_world(args, w) for w in args.worlds])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
