"""Export benchmark: gather + save_pretrained vs torch DCP HF writer + consolidation vs ours vs raw disk.

All four run in one process group, on the same FSDP2-sharded DeepSeek-V3-style model, every output
fsync'd, and the script prints JSON: wall time, peak RSS growth per rank, bytes written, GB/s.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _status_mib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: now, VmHWM: peak since the last reset), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_hwm() -> None:
    """Reset this process's peak-RSS counter (Linux: writing 5 to clear_refs), so each method's
    peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass




def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


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
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_floating_point():
                local.copy_(torch.randn(local.shape, generator=gen, dtype=torch.float32) * 0.02)
    return model


def _worker(rank, world, args, root):
    import torch
    import torch.distributed as dist

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import export_hf_checkpoint

    model = _build_sharded(args, world)
    results = {}

    def timed(name, fn):
        """Median of ``--repeat`` runs. Before each: the previous output is deleted and the disk
        quiesced (``sync``), so no method pays for another's writeback or discards."""
        runs = []
        for _ in range(args.repeat):
            if rank == 0:
                for entry in os.listdir(root):
                    shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
                    if os.path.isfile(os.path.join(root, entry)):
                        os.remove(os.path.join(root, entry))
            os.sync()
            dist.barrier()
            _reset_hwm()
            rss0 = _status_mib("VmRSS")
            t0 = time.perf_counter()
            nbytes = fn()
            dist.barrier()
            runs.append((time.perf_counter() - t0, nbytes, max(0.0, _status_mib("VmHWM") - rss0)))
        seconds = sorted(r[0] for r in runs)[len(runs) // 2]
        results[name] = dict(seconds=round(seconds, 3), all_seconds=[round(r[0], 3) for r in runs],
                             bytes=runs[-1][1], peak_rss_growth_mib=round(max(r[2] for r in runs), 1))

    def ours():
        r = export_hf_checkpoint(os.path.join(root, "ours"), model, max_shard_size=args.shard_size)
        return r.checkpoint_bytes

    def gather():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        total = 0
        if rank == 0:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
            shell.save_pretrained(os.path.join(root, "gather"), state_dict=full, max_shard_size=args.shard_size)
            _fsync_tree(os.path.join(root, "gather"))
            total = sum(v.numel() * v.element_size() for v in full.values())
        del full
        return total

    def dcp():
        import torch.distributed.checkpoint as dcp_mod
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files_on_every_rank,
        )

        adapter = get_adapter(model.config)
        sd = model.state_dict()
        keys = sorted(k for k in sd if not (adapter.tie_word_embeddings and k in adapter.table.tied_keys))
        n_files = max(1, world)
        mapping = {k: 1 + i * n_files // len(keys) for i, k in enumerate(keys)}
        shards, out = os.path.join(root, "dcp-shards"), os.path.join(root, "dcp")
        dcp_mod.save({k: sd[k] for k in keys},
                     storage_writer=HuggingFaceStorageWriter(shards, save_distributed=True,
                                                             fqn_to_index_mapping=mapping))
        if rank == 0:
            os.makedirs(out, exist_ok=True)  # the helper does not create it (REFERENCE.md section 3)
        dist.barrier()
        consolidate_safetensors_files_on_every_rank(shards, out, mapping, num_threads=1)
        _fsync_tree(out)
        _fsync_tree(shards)  # the sharded files are written to disk too: all outputs are fsync'd
        return sum(v.numel() * v.element_size() for v in sd.values()) if rank == 0 else 0

    def raw():
        # The disk's limit: each rank writes its share of the checkpoint's bytes, 64 MiB O_DIRECT writes.
        import mmap

        total = results["ours"]["bytes"]
        share = -(-total // world)
        block = 64 << 20
        buf = mmap.mmap(-1, block)
        buf.write(os.urandom(1 << 20) * (block >> 20))
        path = os.path.join(root, f"raw-{rank}.bin")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
        fd = os.open(path, flags, 0o644)
        try:
            written = 0
            while written < share:
                written += os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        return written

    for name, fn in (("ours", ours), ("gather", gather), ("dcp", dcp), ("raw_disk", raw)):
        if name in args.methods or name == "ours":
            try:
                timed(name, fn)
            except Exception as exc:  # report, keep measuring the others
                results[name] = dict(error=f"{type(exc).__name__}: {exc}")
                dist.barrier()
    return results


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
    summary = {}
    for name in ranks[0]:
        if "error" in ranks[0][name]:
            summary[name] = ranks[0][name]
            continue
        seconds = max(r[name]["seconds"] for r in ranks)
        nbytes = ranks[0]["ours"]["bytes"] if name != "raw_disk" else sum(r[name]["bytes"] for r in ranks)
        summary[name] = dict(seconds=seconds, runs_seconds=ranks[0][name]["all_seconds"],
                             gb_per_s=round(nbytes / seconds / 1e9, 3),
                             peak_rss_growth_mib_per_rank=[r[name]["peak_rss_growth_mib"] for r in ranks])
    ours = summary["ours"]["seconds"]
    ratios = {f"{k}_over_ours": round(v["seconds"] / ours, 2) for k, v in summary.items()
              if k != "ours" and "seconds" in v}
    # A training job exports once, cold: the first run of each method is reported beside the median.
    first_ours = summary["ours"]["runs_seconds"][0]
    ratios.update({f"{k}_over_ours_first_run": round(v["runs_seconds"][0] / first_ours, 2)
                   for k, v in summary.items() if k != "ours" and "runs_seconds" in v})
    if "raw_disk" in summary and "seconds" in summary["raw_disk"]:
        ratios["ours_fraction_of_raw_disk_bandwidth"] = round(summary["ours"]["gb_per_s"] / summary["raw_disk"]["gb_per_s"], 3)
    print(json.dumps(dict(benchmark="export", world_size=args.world_size, experts=args.experts,
                          checkpoint_bytes=ranks[0]["ours"]["bytes"], wall_s=round(wall, 1),
                          results=summary, ratios=ratios), indent=2))


if __name__ == "__main__":
    main()
