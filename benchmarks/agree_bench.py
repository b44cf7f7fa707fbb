"""Latency of one step agreement (``Coordinator.agree``) on W gloo ranks, beside the protocol it
replaced: a monitored barrier (rank 0 talks to every rank, O(W)) plus an all-gather of statuses.

Every rank runs ``--repeat`` agreements of each protocol, interleaved in rounds so machine noise
hits both alike; the script prints JSON with the median and p90 per protocol and world size.

    python benchmarks/agree_bench.py --world-sizes 4 8 16 32 --repeat 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

from nemo_moe_export.spawn import spawn  # noqa: E402


def monitored_barrier_agree(coordinator, step: str, error=None) -> None:
    """The agreement before the all-reduce protocol, kept here as the baseline."""
    import torch.distributed as dist

    dist.monitored_barrier(group=coordinator.group, timeout=coordinator.timeout, wait_all_ranks=True)
    statuses = [None] * coordinator.world_size
    dist.all_gather_object(statuses, None if error is None else str(error), group=coordinator.group)


def _rank(rank: int, world: int, repeat: int, rounds: int) -> dict:
    from nemo_moe_export.parallel import Coordinator

    coordinator = Coordinator(None, timeout_s=120, name="bench")
    protocols = {"all_reduce": coordinator.agree, "monitored_barrier":
                 lambda step: monitored_barrier_agree(coordinator, step)}
    for agree in protocols.values():  # warm up connections
        for _ in range(5):
            agree("warmup")
    seconds = {name: [] for name in protocols}
    for _ in range(rounds):
        for name, agree in protocols.items():
            for i in range(repeat // rounds):
                t0 = time.perf_counter()
                agree(f"step {i}")
                seconds[name].append(time.perf_counter() - t0)
    return seconds


def _summary(per_rank: list[dict]) -> dict:
    out = {}
    for name in per_rank[0]:
        # An agreement ends for the group when its slowest rank leaves it.
        slowest = [max(values) for values in zip(*(r[name] for r in per_rank))]
        out[name] = {"median_ms": round(1e3 * statistics.median(slowest), 3),
                     "p90_ms": round(1e3 * sorted(slowest)[int(0.9 * len(slowest))], 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    results = {"cpus": os.cpu_count(), "repeat": args.repeat, "by_world_size": {}}
    for world in args.world_sizes:
        per_rank = spawn(_rank, world, args.repeat, args.rounds, timeout_s=900, pg_timeout_s=120)
        results["by_world_size"][world] = _summary(per_rank)
        print(json.dumps({world: results["by_world_size"][world]}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
