"""FP8 load benchmark: official-format FP8 block-quantized checkpoint vs plain bf16, per rank, as JSON.

Both checkpoints hold the same DeepSeek-V3-style model; each of N CPU ranks loads its FSDP2 shards
with ``StateDictAdapter.from_hf`` (dequantizing its own slices for FP8). Prints load seconds and
bytes read per rank for both.

    python benchmarks/fp8_load_bench.py --world-size 4 --experts 30 --hidden 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _worker(rank, world, args, paths):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.tiny_models import tiny_model

    out = {}
    for name, path in paths.items():
        model = tiny_model("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden,
                           moe_intermediate_size=args.moe_inter, num_layers=args.layers, seed=1).to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        report = get_adapter(model.config).from_hf(model.state_dict(), path)
        out[name] = dict(seconds=round(time.perf_counter() - t0, 4), bytes_read=report.bytes_read)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--experts", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-inter", type=int, default=320)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import load_file, save_file

    from nemo_moe_export.adapters.fp8 import quantize_block_fp8
    from nemo_moe_export.spawn import spawn
    from nemo_moe_export.tiny_models import tiny_model

    with tempfile.TemporaryDirectory() as root:
        bf16, fp8 = os.path.join(root, "bf16"), os.path.join(root, "fp8")
        model = tiny_model("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden,
                           moe_intermediate_size=args.moe_inter, num_layers=args.layers).to(torch.bfloat16)
        model.save_pretrained(bf16)
        model.save_pretrained(fp8)
        tensors = load_file(os.path.join(fp8, "model.safetensors"))
        stored = {}
        for key, w in tensors.items():
            if w.dim() == 2 and not any(s in key for s in ("embed_tokens", "lm_head", "mlp.gate.weight")):
                stored[key], stored[key + "_scale_inv"] = quantize_block_fp8(w)
            else:
                stored[key] = w
        save_file(stored, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
        config = json.load(open(os.path.join(fp8, "config.json")))
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
        json.dump(config, open(os.path.join(fp8, "config.json"), "w"))
        sizes = {name: os.path.getsize(os.path.join(p, "model.safetensors")) for name, p in (("bf16", bf16), ("fp8", fp8))}
        ranks = spawn(_worker, args.world_size, args, {"bf16": bf16, "fp8": fp8}, timeout_s=900)
    print(json.dumps(dict(
        benchmark="fp8_load", world_size=args.world_size, experts=args.experts, checkpoint_bytes=sizes,
        max_seconds={k: max(r[k]["seconds"] for r in ranks) for k in ("bf16", "fp8")},
        max_rank_read_fraction={k: round(max(r[k]["bytes_read"] for r in ranks) / sizes[k], 4) for k in ("bf16", "fp8")},
        ranks=ranks), indent=2))


if __name__ == "__main__":
    main()
