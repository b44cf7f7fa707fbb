"""One export's coordination on W gloo ranks: the protocol before and after the butterfly, side by side.

Each rank runs, ``--repeat`` times and interleaved so machine noise hits both alike, the collectives
an export makes besides writing (docs/design.md#coordination-protocol), with nothing in between:

* ``before`` (the protocol until 0.2): a new eagerly connected gloo group for the export, seven
  one-word ring all-reduces (``dist.all_reduce``) polled with a sleep doubling from 0.1 ms to
  20 ms, two object all-gathers (the plan digest, rank 0's export id), the coverage counts'
  all-reduce (one int64 per tensor), the replica check's two all-reduces over the export group
  (header, checksums) and its one-word count of findings;
* ``after`` (``parallel.Coordinator`` now): a new lazily connected gloo group
  (``collectives.gloo_group``, made once per job; timed here as a job's first), seven agreements
  on the butterfly, the first carrying the plan digest's fingerprint and the export id, the
  second the findings' count and the coverage counts, and the replica check's two butterfly
  all-reduces over the export group.

Prints JSON: per world size the median and p90 of the slowest rank's seconds, for the whole
sequence and without the group's setup (what a job's later exports pay).

    python benchmarks/agree_bench.py --world-sizes 8 16 32 --repeat 20 --tensors 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

from nemo_moe_export.spawn import spawn  # noqa: E402
from output import emit  # noqa: E402

AGREEMENTS = 7


def _polled_all_reduce(tensor, group) -> None:
    """The agreement's wait before: poll the async all-reduce, sleeping 0.1 ms doubling to 20 ms."""
    import torch.distributed as dist

    work = dist.all_reduce(tensor, group=group, async_op=True)
    pause = 1e-4
    while not work.is_completed():
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    work.wait()


def before(round_no: int, tensors: int) -> tuple[float, float]:
    """The old sequence; returns (seconds with the group's setup, seconds after it)."""
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300 + round_no))
    set_up = time.perf_counter()
    digest, ids = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    _polled_all_reduce(torch.zeros(1, dtype=torch.int64), group)  # validate
    dist.all_gather_object(digest, "0" * 64, group=group)
    _polled_all_reduce(torch.ones(tensors, dtype=torch.int64), group)  # coverage
    dist.all_reduce(torch.zeros(4, dtype=torch.int64), op=dist.ReduceOp.MAX, group=group)  # replica header
    dist.all_reduce(torch.zeros(6, dtype=torch.int64), op=dist.ReduceOp.MAX, group=group)  # replica checksums
    _polled_all_reduce(torch.zeros(1, dtype=torch.int64), group)  # findings
    dist.all_gather_object(ids, "20261202T000000-000000000000", group=group)
    for _ in range(AGREEMENTS - 1):  # validate replicas, prepare, headers, write, verify, publish
        _polled_all_reduce(torch.zeros(1, dtype=torch.int64), group)
    ended = time.perf_counter()
    return ended - started, ended - set_up


def after(round_no: int, tensors: int) -> tuple[float, float]:
    """The sequence now; returns (seconds with the group's setup, seconds after it)."""
    import torch

    from nemo_moe_export.collectives import fingerprint_words
    from nemo_moe_export.parallel import Coordinator

    started = time.perf_counter()
    coordinator = Coordinator(None, timeout_s=300 + round_no, name=f"after{round_no}")  # a new group each round
    set_up = time.perf_counter()
    coordinator.agree("validate", sums=torch.cat([fingerprint_words("0" * 64), torch.zeros(1, dtype=torch.int64)]))
    coordinator.all_reduce(torch.zeros(4, dtype=torch.int64), "max")  # replica header
    coordinator.all_reduce(torch.zeros(6, dtype=torch.int64), "max")  # replica checksums
    coordinator.agree("validate replicas", sums=torch.ones(1 + tensors, dtype=torch.int64))
    for step in ("prepare", "headers", "write", "verify", "publish"):
        coordinator.agree(step)
    ended = time.perf_counter()
    return ended - started, ended - set_up


def _rank(rank: int, world: int, repeat: int, tensors: int) -> dict:
    import torch.distributed as dist

    dist.barrier()  # a training job's world is connected before its export
    seconds: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for i in range(repeat + 1):
        for name, protocol in (("before", before), ("after", after)):
            dist.barrier()
            taken = protocol(2 * i + (name == "after"), tensors)
            if i:  # the first round warms up
                seconds[name].append(taken)
    return seconds


def _summary(per_rank: list[dict]) -> dict:
    out = {}
    for name in per_rank[0]:
        # a sequence ends for the job when its slowest rank leaves it
        whole = [max(r[name][i][0] for r in per_rank) for i in range(len(per_rank[0][name]))]
        later = [max(r[name][i][1] for r in per_rank) for i in range(len(per_rank[0][name]))]
        out[name] = {"median_ms": round(1e3 * statistics.median(whole), 2),
                     "p90_ms": round(1e3 * sorted(whole)[int(0.9 * len(whole))], 2),
                     "without_group_setup_median_ms": round(1e3 * statistics.median(later), 2)}
    out["speedup"] = round(out["before"]["median_ms"] / out["after"]["median_ms"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--tensors", type=int, default=4096, help="coverage counts (one int64 per planned tensor)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    results = {"cpus": os.cpu_count(), "repeat": args.repeat, "tensors": args.tensors, "by_world_size": {}}
    for world in args.world_sizes:
        per_rank = spawn(_rank, world, args.repeat, args.tensors, timeout_s=1800, pg_timeout_s=300)
        results["by_world_size"][world] = _summary(per_rank)
        print(json.dumps({world: results["by_world_size"][world]}), file=sys.stderr, flush=True)
    emit(results, args.out, indent=2)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
