"""The export methods the benchmarks compare, measured the same way on CPU ranks and on GPUs.

``measure_exports(model, root, ...)`` runs, on every rank of the default process group and on the
live sharded model:

* ``ours``      ``export_hf_checkpoint`` (no gather; every rank writes its own bytes), once per
                ``writer_threads`` value;
* ``gather``    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` onto rank 0, then
                transformers ``save_pretrained`` there (what recipes do today);
* ``dcp``       torch DCP's ``HuggingFaceStorageWriter`` (sharded safetensors) + its consolidation
                into one set of files;
* ``raw_disk``  the disk's own limit: each rank writes its share of the checkpoint's bytes in
                64 MiB ``O_DIRECT`` writes, with 1 and with 4 threads per rank.

Before each run the previous output is deleted and the disk quiesced (``sync``); every output is
fsync'd. Per run: wall time (slowest rank), peak host RSS growth and (on GPUs) peak GPU memory
growth per rank. ``summarize`` turns the per-rank results into the JSON the scripts print.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any

__all__ = ["measure_exports", "status_mib", "summarize"]


def status_mib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: now, VmHWM: peak since the last reset), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_hwm() -> None:
    """Reset this process's peak-RSS counter (Linux: writing 5 to clear_refs), so each run's peak is its own."""
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


def _clear(root: str) -> None:
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def measured_run(fn: Any, cuda: bool) -> tuple[Any, float, float, float | None]:
    """One timed run of ``fn`` on every rank, the disk quiesced (``sync``) and the ranks lined up
    before and after: ``(fn's result, seconds, peak RSS growth in MiB, peak GPU memory growth in
    MiB or None off the GPU)``."""
    import torch
    import torch.distributed as dist

    os.sync()
    dist.barrier()
    _reset_hwm()
    rss0 = status_mib("VmRSS")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t0
    rss = max(0.0, status_mib("VmHWM") - rss0)
    gpu = (torch.cuda.max_memory_allocated() - gpu0) / 2**20 if cuda else None
    return out, seconds, rss, gpu


def measure_exports(model: Any, root: str, *, methods: list[str], repeat: int = 1, shard_size: str = "5GB",
                    writer_threads: tuple[int, ...] = (1,), raw_threads: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    """Run the export ``methods`` on this rank (every rank calls it); returns this rank's results."""
    import torch
    import torch.distributed as dist

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import export_hf_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = next(model.parameters()).is_cuda
    results: dict[str, Any] = {}

    def timed(name: str, fn: Any) -> None:
        runs = []
        for _ in range(repeat):
            if rank == 0:
                _clear(root)
            extra, seconds, rss, gpu = measured_run(fn, cuda)
            run = dict(seconds=seconds, bytes=extra.pop("bytes"), rss=rss, **extra)
            if cuda:
                run["gpu"] = gpu
            runs.append(run)
        med = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
        results[name] = dict(
            seconds=round(med["seconds"], 3), all_seconds=[round(r["seconds"], 3) for r in runs], bytes=med["bytes"],
            peak_rss_growth_mib=round(max(r["rss"] for r in runs), 1),
            **({"peak_gpu_growth_mib": round(max(r["gpu"] for r in runs), 1)} if cuda else {}),
            **{k: v for k, v in med.items() if k not in ("seconds", "bytes", "rss", "gpu")},
        )

    def ours(threads: int) -> Any:
        def run() -> dict[str, Any]:
            name = f"ours_threads{threads}"
            r = export_hf_checkpoint(os.path.join(root, name), model, max_shard_size=shard_size,
                                     writer_threads=threads)
            return dict(bytes=r.checkpoint_bytes, io=r.io, steps=r.step_seconds)
        return run

    def fp8(scale_fmt: str | None) -> Any:
        def run() -> dict[str, Any]:
            r = export_hf_checkpoint(os.path.join(root, f"fp8_{scale_fmt or 'e4m3'}"), model, max_shard_size=shard_size,
                                     quantize="fp8_block", scale_fmt=scale_fmt)
            return dict(bytes=r.checkpoint_bytes, io=r.io, steps=r.step_seconds)
        return run

    def gather() -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        total = 0
        if rank == 0:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(model.config, dtype=next(iter(full.values())).dtype)
            shell.save_pretrained(os.path.join(root, "gather"), state_dict=full, max_shard_size=shard_size)
            _fsync_tree(os.path.join(root, "gather"))
            total = sum(v.numel() * v.element_size() for v in full.values())
        del full
        return dict(bytes=total)

    def dcp() -> dict[str, Any]:
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
            os.makedirs(out, exist_ok=True)  # the consolidation helper does not create its output directory
        dist.barrier()
        consolidate_safetensors_files_on_every_rank(shards, out, mapping, num_threads=1)
        _fsync_tree(out)
        _fsync_tree(shards)  # the sharded files are written to disk too: all outputs are fsync'd
        total = sum(v.numel() * v.element_size() for v in sd.values())  # global sizes (DTensor numel)
        return dict(bytes=total if rank == 0 else 0)

    def raw(threads: int) -> Any:
        def run() -> dict[str, Any]:
            import mmap

            total = results[f"ours_threads{writer_threads[0]}"]["bytes"]
            share = -(-total // world)
            block = 64 << 20
            per_thread = -(-share // threads // block) * block
            buf = mmap.mmap(-1, block)
            buf.write(os.urandom(1 << 20) * (block >> 20))
            written = [0] * threads

            def writer(i: int) -> None:
                path = os.path.join(root, f"raw-{rank}-{i}.bin")
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
                fd = os.open(path, flags, 0o644)
                try:
                    while written[i] < per_thread:
                        written[i] += os.write(fd, buf)
                    os.fsync(fd)
                finally:
                    os.close(fd)

            pool = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            return dict(bytes=sum(written))
        return run

    plan: list[tuple[str, Any]] = [(f"ours_threads{t}", ours(t)) for t in writer_threads]
    if "fp8" in methods:  # ours, DeepSeek's FP8 block format, both scale formats
        plan += [("fp8_e4m3_scales", fp8(None)), ("fp8_ue8m0_scales", fp8("ue8m0"))]
    if "gather" in methods:
        plan.append(("gather", gather))
    if "dcp" in methods:
        plan.append(("dcp", dcp))
    if "raw_disk" in methods:
        plan += [(f"raw_disk_threads{t}", raw(t)) for t in raw_threads]
    for name, fn in plan:
        try:
            timed(name, fn)
        except Exception as exc:  # report, keep measuring the others
            results[name] = dict(error=f"{type(exc).__name__}: {exc}")
            dist.barrier()
    if rank == 0:
        _clear(root)
    dist.barrier()
    return results


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: slowest rank's time, GB/s of the checkpoint's bytes, memory per rank; ratios."""
    first = ranks[0]
    ours_names = [k for k in first if k.startswith("ours_threads") and "seconds" in first[k]]
    checkpoint_bytes = first[ours_names[0]]["bytes"] if ours_names else 0
    summary: dict[str, Any] = {}
    for name, r0 in first.items():
        if "error" in r0:
            summary[name] = r0
            continue
        seconds = max(r[name]["seconds"] for r in ranks)
        nbytes = (sum(r[name]["bytes"] for r in ranks) if name.startswith("raw_disk")
                  else r0["bytes"] if name.startswith("fp8") else checkpoint_bytes)
        entry = dict(seconds=seconds, runs_seconds=r0["all_seconds"], gb_per_s=round(nbytes / seconds / 1e9, 3),
                     peak_rss_growth_mib_per_rank=[r[name]["peak_rss_growth_mib"] for r in ranks])
        if "peak_gpu_growth_mib" in r0:
            entry["peak_gpu_growth_mib_per_rank"] = [r[name]["peak_gpu_growth_mib"] for r in ranks]
        if "io" in r0:
            entry["io_per_rank"] = [r[name]["io"] for r in ranks]
            entry["step_seconds_rank0"] = r0["steps"]
        summary[name] = entry
    timed = {k: v for k, v in summary.items() if "seconds" in v}
    ratios: dict[str, Any] = {}
    if ours_names:
        best = min(ours_names, key=lambda k: summary[k]["seconds"])
        ratios["ours_best"] = best
        ours = summary[best]
        for k, v in timed.items():
            if k.startswith("fp8"):  # the target: <= 0.6x the bf16 export
                ratios[f"{k}_over_bf16"] = round(v["seconds"] / ours["seconds"], 3)
            elif not k.startswith(("ours", "raw_disk")):
                ratios[f"{k}_over_ours"] = round(v["seconds"] / ours["seconds"], 2)
                ratios[f"{k}_over_ours_first_run"] = round(v["runs_seconds"][0] / ours["runs_seconds"][0], 2)
        raw = [v["gb_per_s"] for k, v in timed.items() if k.startswith("raw_disk")]
        if raw:
            ratios["disk_gb_per_s"] = max(raw)
            ratios["ours_fraction_of_disk_bandwidth"] = round(ours["gb_per_s"] / max(raw), 3)
            for k, v in timed.items():
                if k.startswith("fp8"):
                    ratios[f"{k}_fraction_of_disk_bandwidth"] = round(v["gb_per_s"] / max(raw), 3)
    return dict(checkpoint_bytes=checkpoint_bytes, results=summary, ratios=ratios)
