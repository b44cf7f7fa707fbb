"""Adapter benchmark: to_hf / from_hf on N CPU ranks with real fully_shard, printed as JSON.

For a DeepSeek-V3-style model it measures, per rank: ``to_hf`` time (views only, so it should not
grow with model size beyond key count), ``from_hf`` time and bytes read (should be the rank's
``torch.chunk`` share), against the common alternative of every rank reading the whole checkpoint.
It also checks that the loaded model equals the saved one. Run by hand:

    python benchmarks/adapter_bench.py --world-size 4 --experts 30 --hidden 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _worker(rank, world, args, ckpt):
    import resource

    import torch
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.tiny_models import tiny_model

    def build(seed):
        model = tiny_model(args.family, n_experts=args.experts, hidden_size=args.hidden,
                           moe_intermediate_size=args.moe_inter, num_layers=args.layers, seed=seed)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    model = build(seed=1)
    adapter = get_adapter(model.config)
    sd = model.state_dict()
    t0 = time.perf_counter()
    pieces = adapter.to_hf(sd)
    to_hf_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = adapter.from_hf(sd, ckpt)
    from_hf_s = time.perf_counter() - t0

    reference = tiny_model(args.family, n_experts=args.experts, hidden_size=args.hidden,
                           moe_intermediate_size=args.moe_inter, num_layers=args.layers, seed=0).state_dict()
    exact = all(
        torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, reference[k]) for k, v in sd.items()
    )
    # The alternative: every rank reads the whole checkpoint, then slices.
    t0 = time.perf_counter()
    full = load_file(os.path.join(ckpt, "model.safetensors"))
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    full_read_s = time.perf_counter() - t0
    return dict(
        rank=rank, to_hf_s=round(to_hf_s, 4), hf_pieces=len(pieces), from_hf_s=round(from_hf_s, 4),
        bytes_read=report.bytes_read, expert_bytes_read=report.expert_bytes_read,
        read_everything_bytes=full_bytes, read_everything_s=round(full_read_s, 4), exact=exact,
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--family", default="deepseek_v3")
    parser.add_argument("--experts", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--moe-inter", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)

    from nemo_moe_export.spawn import spawn
    from nemo_moe_export.tiny_models import tiny_model

    with tempfile.TemporaryDirectory(prefix="nme-adapter-bench-") as ckpt:
        tiny_model(args.family, n_experts=args.experts, hidden_size=args.hidden,
                   moe_intermediate_size=args.moe_inter, num_layers=args.layers, seed=0).save_pretrained(ckpt)
        t0 = time.perf_counter()
        ranks = spawn(_worker, args.world_size, args, ckpt, timeout_s=900)
        wall = time.perf_counter() - t0
    total = ranks[0]["read_everything_bytes"]
    print(json.dumps(dict(
        benchmark="adapter", family=args.family, experts=args.experts, world_size=args.world_size,
        checkpoint_bytes=total, wall_s=round(wall, 2),
        max_rank_read_fraction=round(max(r["bytes_read"] for r in ranks) / total, 4),
        all_exact=all(r["exact"] for r in ranks), ranks=ranks,
    ), indent=2))
    return 0 if all(r["exact"] for r in ranks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
