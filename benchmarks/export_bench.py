"""Export benchmark: gather + save_pretrained vs torch DCP HF writer + consolidation vs ours vs raw disk.

All four run in one process group, on the same FSDP2-sharded DeepSeek-V3-style model, every output
fsync'd (``export_methods.py`` runs them; the GPU pipeline benchmark uses the same code), and the
script prints JSON: wall time, peak RSS growth per rank, bytes written, GB/s.
Run by hand (defaults: ~1.3 GB bf16, 30 experts, 4 CPU ranks):

    python benchmarks/export_bench.py --world-size 4
    python benchmarks/export_bench.py --world-size 4 --hidden 256 --layers 3   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]


def _build_sharded(args, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.tiny_models import tiny_config

    config = tiny_config("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden,
                         moe_intermediate_size=args.moe_inter, num_layers=args.layers, vocab_size=args.vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    # Shards differ per rank; a plain tensor (a buffer every rank holds) is the same on every rank,
    # as training keeps it (the export compares replicas and refuses copies that differ).
    shards = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    plain = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            local, gen = (t.to_local(), shards) if hasattr(t, "to_local") else (t, plain)
            if local.is_floating_point():
                local.copy_(torch.randn(local.shape, generator=gen, dtype=torch.float32) * 0.02)
    return model


def _worker(rank, world, args, root):
    from export_methods import measure_exports

    model = _build_sharded(args, world)
    return measure_exports(model, root, methods=args.methods, repeat=args.repeat, shard_size=args.shard_size,
                           writer_threads=tuple(args.writer_threads), raw_threads=(1,))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--experts", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-inter", type=int, default=512)
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", default="512MB")
    parser.add_argument("--methods", default="ours,gather,dcp,raw_disk")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method; the median is reported")
    parser.add_argument("--writer-threads", type=int, nargs="+", default=[1], help="ours: pwrite threads per rank")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")

    from nemo_moe_export.spawn import spawn

    root = tempfile.mkdtemp(prefix="nme-export-bench-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        ranks = spawn(_worker, args.world_size, args, root, timeout_s=1800, pg_timeout_s=1200)
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from export_methods import summarize

    print(json.dumps(dict(benchmark="export", world_size=args.world_size, experts=args.experts,
                          wall_s=round(wall, 1), **summarize(ranks)), indent=2))


if __name__ == "__main__":
    main()
