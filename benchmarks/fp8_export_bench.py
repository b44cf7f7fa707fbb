"""FP8 export benchmark: FP8 export vs bf16 export vs the user's path today, side by side; prints JSON.

Three ways to a checkpoint of the same FSDP2-sharded bf16 DeepSeek-V3-style model, in one process
group, every output fsync'd, the disk quiesced (``sync``) before each run:

* ``bf16``                 ``export_hf_checkpoint`` (no gather);
* ``fp8``                  ``export_hf_checkpoint(quantize="fp8_block")``: every rank quantizes its
                           own slices and writes FP8 weights and scales in place;
* ``bf16_then_offline``    the user's path today: the bf16 export, then one process quantizes the
                           files (reads each file, quantizes the table's weights whole with the
                           same rules, writes FP8 files, the index and config.json, like the
                           ``bf16_cast_fp8.py`` scripts users run today) on rank 0 (its GPU, or
                           on CPU ranks its one thread: more threads ran slower on a shared box).

Per method: median wall time of ``--repeat`` runs (slowest rank), peak RSS growth per rank (and
peak GPU memory growth on GPUs), the FP8 export's own timings; the ratios ``fp8 / bf16`` and
``bf16_then_offline / fp8``; the staging bound each rank's extra memory is held to; whether the FP8
export equals the offline quantization tensor for tensor; and transformers' own load of the FP8
export against its load of the bf16 one (logits on one batch). One command per configuration:

    python benchmarks/fp8_export_bench.py --world-size 4                      # CPU, gloo, 4 ranks
    python benchmarks/fp8_export_bench.py --world-size 4 --hidden 512 --layers 4 --repeat 1   # quick
    python benchmarks/fp8_export_bench.py --device cuda --world-size 1 --model deepseek_v3_9gb  # GPU recipe model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
from output import emit  # noqa: E402  (benchmarks/output.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = ("bf16", "fp8", "bf16_then_offline")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="ranks (one GPU each with --device cuda)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default=None, help="a model preset of nemo_moe_export/conf/model (its sizes)")
    parser.add_argument("--experts", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-inter", type=int, default=512)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", default="512MB")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method; the median is reported")
    parser.add_argument("--scale-fmt", default=None, choices=(None, "ue8m0"))
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.model:
        _apply_preset(args)
    return args


def _apply_preset(args: argparse.Namespace) -> None:
    """The sizes of a packaged model preset (``deepseek_v3_9gb``: the GPU recipe's model)."""
    from importlib.resources import files

    import yaml

    preset = yaml.safe_load((files("nemo_moe_export") / "conf" / "model" / f"{args.model}.yaml").read_text())
    if preset.get("family") not in ("deepseek_v3", "kimi_k2"):
        raise SystemExit(f"--model {args.model}: this benchmark builds DeepSeek-V3-style models")
    args.experts = preset.get("n_experts", args.experts)
    args.hidden = preset.get("hidden_size", args.hidden)
    args.moe_inter = preset.get("moe_intermediate_size", args.moe_inter)
    args.layers = preset.get("num_layers", args.layers)


def _build(args: argparse.Namespace, world: int, device: str) -> Any:
    """The sharded bf16 model, built on meta and materialised shard by shard (random N(0, 0.02))."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.tiny_models import tiny_config

    config = tiny_config("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden,
                         moe_intermediate_size=args.moe_inter, num_layers=args.layers, vocab_size=args.vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mesh = init_device_mesh(device, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    # Shards differ per rank; a plain tensor (a buffer every rank holds) is the same on every rank,
    # as training keeps it (the export compares replicas).
    shards = torch.Generator(device=device).manual_seed(1 + torch.distributed.get_rank())
    plain = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            local, gen = (t.to_local(), shards) if hasattr(t, "to_local") else (t, plain)
            if local.is_floating_point():
                local.copy_(torch.randn(local.shape, generator=gen, dtype=torch.float32, device=device) * 0.02)
    return model


def offline_quantize(src: str, dst: str, patterns: list[str], device: str, scale_fmt: str | None) -> None:
    """The user's path today, in one process: each bf16 file read whole, the weights matching
    ``patterns`` quantized whole (``quantize_block_fp8``: the same rules as the export), the FP8
    files, the index and config.json written and fsync'd."""
    from safetensors.torch import load_file, save_file

    from nemo_moe_export.adapters.fp8 import SCALE_SUFFIX, official_quantization_config, quantize_block_fp8
    from nemo_moe_export.export.target import fsync_path

    os.makedirs(dst)
    compiled, weight_map, total = [re.compile(p) for p in patterns], {}, 0
    for name in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        out = {}
        for key, w in load_file(os.path.join(src, name), device=device).items():
            if any(p.search(key) for p in compiled):
                out[key], out[key + SCALE_SUFFIX] = quantize_block_fp8(w, scale_fmt=scale_fmt)
            else:
                out[key] = w
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
        total += sum(t.numel() * t.element_size() for t in out.values())
        del out
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = official_quantization_config(scale_fmt)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(dst):
        fsync_path(os.path.join(dst, name))
    fsync_path(dst)


def _same_tensors(a: str, b: str) -> bool:
    """Every tensor of checkpoint ``a`` equals ``b``'s, byte for byte, and the key sets match."""
    import torch
    from safetensors import safe_open

    def where(path: str) -> dict[str, str]:
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            return json.load(f)["weight_map"]

    wa, wb = where(a), where(b)
    if set(wa) != set(wb):
        return False
    for key in sorted(wa):
        with safe_open(os.path.join(a, wa[key]), "pt") as fa, safe_open(os.path.join(b, wb[key]), "pt") as fb:
            x, y = fa.get_tensor(key), fb.get_tensor(key)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return False
    return True


def transformers_logits(bf16_dir: str, fp8_dir: str, device: str, vocab: int) -> dict[str, Any]:
    """transformers' own loads of the FP8 export and of the bf16 export, on one fixed batch:
    relative L2 and max |difference| of the logits, argmax agreement, and which FP8 path ran (its
    FP8 kernels, fetched from the Hub as ``kernels-community/finegrained-fp8``, or, when they do not
    load, and always on CPU, its dequantize-on-load path)."""
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    ids = torch.randint(3, vocab - 1, (4, 64), generator=torch.Generator().manual_seed(0)).to(device)

    def logits(path: str, **kwargs: Any) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device, **kwargs)
        with torch.no_grad():
            out = model(ids).logits.float().cpu()
        del model
        return out

    want, error = logits(bf16_dir), None
    path = "fp8 kernels" if device == "cuda" else "dequantized on load (CPU)"
    try:
        got = logits(fp8_dir)
    except Exception as exc:  # no Hub access, no kernel build for this torch/CUDA
        error, path = f"{type(exc).__name__}: {exc}"[:300], "dequantized on load (the FP8 kernels did not load)"
        got = logits(fp8_dir, quantization_config=FineGrainedFP8Config(dequantize=True))
    return dict(path=path, fp8_kernel_error=error, logits_rel_l2=round(float((got - want).norm() / want.norm()), 4),
                logits_max_abs_diff=round(float((got - want).abs().max()), 4), logits_std=round(float(want.std()), 4),
                argmax_agreement=round(float((got.argmax(-1) == want.argmax(-1)).float().mean()), 4))


def _run_method(name: str, model: Any, root: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``name`` into ``root/name`` on every rank; returns this rank's numbers."""
    import torch.distributed as dist

    from nemo_moe_export.adapters import get_table
    from nemo_moe_export.export import export_hf_checkpoint

    out, common = os.path.join(root, name), dict(max_shard_size=args.shard_size)
    if name == "fp8":
        r = export_hf_checkpoint(out, model, quantize="fp8_block", scale_fmt=args.scale_fmt, **common)
        return dict(bytes=r.checkpoint_bytes, io=r.io, steps=r.step_seconds)
    r = export_hf_checkpoint(out + ("-bf16" if name != "bf16" else ""), model, **common)
    if name == "bf16":
        return dict(bytes=r.checkpoint_bytes, io=r.io, steps=r.step_seconds)
    started = time.perf_counter()
    if dist.get_rank() == 0:  # the other ranks wait (blocked, not spinning) while one process works
        offline_quantize(out + "-bf16", out, list(get_table("deepseek_v3").fp8_weights), args.device, args.scale_fmt)
    dist.barrier()
    return dict(bytes=r.checkpoint_bytes, offline_seconds=round(time.perf_counter() - started, 3))


def _worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from export_methods import measured_run

    cuda = args.device == "cuda"
    model = _build(args, world, args.device)
    from nemo_moe_export.export import export_hf_checkpoint

    export_hf_checkpoint(os.path.join(root, "warm-up"), model, max_shard_size=args.shard_size)  # untimed
    if rank == 0:
        shutil.rmtree(os.path.join(root, "warm-up"))
    results: dict[str, Any] = {name: [] for name in METHODS}
    for _ in range(args.repeat):  # round robin, so a slow spell of the shared machine hits every method
        for name in METHODS:
            if rank == 0:
                for entry in (name, name + "-bf16"):
                    shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
            run, seconds, rss, gpu = measured_run(lambda: _run_method(name, model, root, args), cuda)
            run.update(seconds=seconds, rss_mib=rss)
            if cuda:
                run["gpu_mib"] = gpu
            results[name].append(run)
    if rank == 0:
        results["fp8_equals_offline"] = _same_tensors(os.path.join(root, "fp8"), os.path.join(root, "bf16_then_offline"))
        try:
            results["transformers_fp8"] = transformers_logits(os.path.join(root, "bf16"), os.path.join(root, "fp8"),
                                                              args.device, args.vocab)
        except Exception as exc:  # reported, the timings stand
            results["transformers_fp8"] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
    dist.barrier()
    return results


def _summary(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per method: median over runs of the slowest rank's seconds, the largest growth per rank."""
    from nemo_moe_export.export import ExportOptions

    out: dict[str, Any] = {}
    for name in METHODS:
        per_run = [max(r[name][i]["seconds"] for r in ranks) for i in range(args.repeat)]
        first = ranks[0][name][len(per_run) // 2]
        entry = dict(seconds=round(statistics.median(per_run), 3), runs_seconds=[round(s, 3) for s in per_run],
                     checkpoint_bytes=first["bytes"],
                     peak_rss_growth_mib_per_rank=[round(max(run["rss_mib"] for run in r[name]), 1) for r in ranks])
        if "gpu_mib" in first:
            entry["peak_gpu_growth_mib_per_rank"] = [round(max(run["gpu_mib"] for run in r[name]), 1) for r in ranks]
        if "io" in first:
            entry["io_rank0"] = first["io"]
            entry["step_seconds_rank0"] = first["steps"]
        if "offline_seconds" in first:
            entry["offline_quantize_seconds"] = first["offline_seconds"]
        out[name] = entry
    from nemo_moe_export.export.quantize import _STEP_VALUES

    options = ExportOptions()
    # One FP8 batch + the writer's staging pool + one step's fp32 and FP8 temporaries
    # (docs/design.md#fp8-export).
    bound = options.staging_bytes * (options.writer_threads + 2) + _STEP_VALUES * 5
    ratios = dict(fp8_over_bf16=round(out["fp8"]["seconds"] / out["bf16"]["seconds"], 3),
                  user_path_over_fp8=round(out["bf16_then_offline"]["seconds"] / out["fp8"]["seconds"], 2),
                  fp8_bytes_over_bf16=round(out["fp8"]["checkpoint_bytes"] / out["bf16"]["checkpoint_bytes"], 3))
    key = "peak_gpu_growth_mib_per_rank" if args.device == "cuda" else "peak_rss_growth_mib_per_rank"
    memory = dict(staging_bound_mib=round(bound / 2**20, 1), measured=key,
                  fp8_within_bound=all(m <= bound / 2**20 for m in out["fp8"][key]))
    return dict(results=out, ratios=ratios, memory=memory, fp8_equals_offline=ranks[0]["fp8_equals_offline"],
                transformers_fp8=ranks[0].get("transformers_fp8"))


def _report(args: argparse.Namespace, ranks: list[dict[str, Any]], wall: float) -> None:
    import torch

    report = dict(benchmark="fp8_export", device=args.device, world_size=args.world_size, model=args.model,
                  experts=args.experts, hidden=args.hidden, moe_inter=args.moe_inter, layers=args.layers,
                  vocab=args.vocab, repeat=args.repeat, scale_fmt=args.scale_fmt, cpu_cores=os.cpu_count(),
                  gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                  wall_s=round(wall, 1), **_summary(ranks, args))
    emit(report, args.out)


def _torchrun_rank(args: argparse.Namespace) -> None:
    """A rank started by torchrun (``--device cuda``): NCCL for the model, results to rank 0's file."""
    import torch.distributed as dist

    from nemo_moe_export.parallel import init_distributed

    init_distributed("cuda", timeout_s=1800)
    results = _worker(dist.get_rank(), dist.get_world_size(), args, args.dir)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, "ranks.json"), "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if "LOCAL_RANK" in os.environ:
        _torchrun_rank(args)
        return 0
    root = tempfile.mkdtemp(prefix="nme-fp8-bench-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        if args.device == "cuda":
            forwarded = list(argv if argv is not None else sys.argv[1:])  # the last --dir wins: this run's root
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.world_size}", os.path.abspath(__file__), *forwarded, f"--dir={root}"]
            code = subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")})
            if code:
                return code
            with open(os.path.join(root, "ranks.json")) as f:
                ranks = json.load(f)
        else:
            from nemo_moe_export.spawn import spawn

            ranks = spawn(_worker, args.world_size, args, root, timeout_s=3600, pg_timeout_s=1800)
        _report(args, ranks, time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
