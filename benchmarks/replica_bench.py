"""Write load and replica-check cost of the export on every mesh the recipe shards with.

For FSDP, HSDP 2x2, EP=2 x expert-DP=2 and EP x FSDP (``job/trainer.py shard_model``) on 4 CPU
gloo ranks, one DeepSeek-V3-style model per mesh, the script prints JSON per mesh:

* ``rank_bytes``: what each rank wrote (replicas share the writing, docs/design.md#replica-agreement),
  their max / mean and their sum (= the checkpoint's tensor bytes), beside ``primary_only``: what
  each rank would write if only the primary copy wrote (the export before issue 13);
* ``replica_seconds`` / ``export_seconds``: medians over ``--repeat`` exports of the replica
  agreement (part of validate) and of the whole export, and their ratio.

    python benchmarks/replica_bench.py                       # ~190 MB fp32, 8 experts
    python benchmarks/replica_bench.py --experts 10          # uneven expert rows under FSDP
    python benchmarks/replica_bench.py --checksum-only --device cuda --gb 8   # checksum speed alone

``--checksum-only`` times the replica checksum of one bf16 tensor on ``--device`` beside a copy of
it (``clone``: what any pass over the bytes costs at memory speed), medians of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

MESHES = ("fsdp", "hsdp", "ep", "ep_fsdp")


def _model(args, mesh):
    from nemo_moe_export.config import ParallelConfig
    from nemo_moe_export.job.trainer import shard_model
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden,
                       moe_intermediate_size=args.moe_inter, num_layers=args.layers, vocab_size=args.vocab)
    cfg = ParallelConfig(strategy=mesh, ep_size=2 if mesh.startswith("ep") else 1,
                         replicate=2 if mesh == "hsdp" else 1, timeout_s=300)
    return shard_model(model, cfg)[0]


def _primary_only_bytes(model):
    """What this rank wrote when only each box's primary holder wrote it."""
    from nemo_moe_export.adapters import get_adapter

    pieces = get_adapter(model.config).to_hf(model.state_dict()).values()
    return sum(p.tensor.numel() * p.tensor.element_size() for p in pieces if p.primary)


def _worker(rank, world, args, root):
    from nemo_moe_export.export import export_hf_checkpoint

    out = {}
    for mesh in MESHES:
        model = _model(args, mesh)
        runs = [export_hf_checkpoint(os.path.join(root, mesh), model, max_shard_size=args.shard_size,
                                     overwrite="replace", timeout_s=300) for _ in range(args.repeat)]
        out[mesh] = dict(rank_bytes=runs[-1].rank_bytes_written, checkpoint_bytes=runs[-1].checkpoint_bytes,
                         primary_only=_primary_only_bytes(model), replica_check=runs[-1].replica_check,
                         replica_seconds=[r.replica_seconds for r in runs], seconds=[r.seconds for r in runs])
    return out


def _summary(per_rank, mesh):
    rows = [r[mesh] for r in per_rank]
    written = [r["rank_bytes"] for r in rows]
    primary = [r["primary_only"] for r in rows]
    replica = statistics.median(max(r["replica_seconds"][i] for r in rows) for i in range(len(rows[0]["seconds"])))
    export = statistics.median(max(r["seconds"][i] for r in rows) for i in range(len(rows[0]["seconds"])))
    mean = statistics.mean(written)
    return dict(
        rank_bytes=written, max=max(written), mean=mean, max_over_mean=round(max(written) / mean, 4),
        sum=sum(written), checkpoint_bytes=rows[0]["checkpoint_bytes"],
        primary_only=dict(rank_bytes=primary, max_over_mean=round(max(primary) / statistics.mean(primary), 4)),
        replica_check=rows[0]["replica_check"], replica_seconds=replica, export_seconds=export,
        replica_fraction=round(replica / export, 4),
    )


def _checksum_speed(args):
    import time

    import torch

    from nemo_moe_export.export.replicas import checksum

    tensor = torch.randn(int(args.gb * 2**30) // 2, device=args.device, dtype=torch.bfloat16)

    def timed(fn):
        runs = []
        for _ in range(args.repeat + 1):  # the first run warms up
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            if args.device == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - started)
        return statistics.median(runs[1:])

    nbytes = tensor.numel() * tensor.element_size()
    seconds = dict(checksum=timed(lambda: checksum(tensor)), clone=timed(lambda: tensor.clone()))
    return dict(device=args.device, bytes=nbytes, seconds=seconds,
                gb_per_s={k: round(nbytes / v / 1e9, 2) for k, v in seconds.items()},
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", default="64MB")
    parser.add_argument("--repeat", type=int, default=3, help="exports per mesh; medians are reported")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    parser.add_argument("--checksum-only", action="store_true", help="time the checksum alone")
    parser.add_argument("--device", default="cpu", help="--checksum-only: cpu | cuda")
    parser.add_argument("--gb", type=float, default=1.0, help="--checksum-only: tensor size in GiB")
    args = parser.parse_args(argv)
    if args.checksum_only:
        print(json.dumps(_checksum_speed(args), indent=2))
        return

    from nemo_moe_export.spawn import spawn

    with tempfile.TemporaryDirectory(prefix="nme-replica-bench-", dir=args.dir) as root:
        per_rank = spawn(_worker, 4, args, root, timeout_s=1800, pg_timeout_s=300)
    print(json.dumps(dict(args=vars(args), world_size=4, meshes={m: _summary(per_rank, m) for m in MESHES}),
                     indent=2))


if __name__ == "__main__":
    main()
