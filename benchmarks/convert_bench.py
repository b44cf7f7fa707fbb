"""Conversion benchmark: a stored checkpoint -> HF on N CPU ranks, against loading the whole state dict.

Saves a DeepSeek-V3-style model's HF-keyed state dict with torch DCP (the layout of AutoModel's
``model_save_format: torch_save``), then converts it with ``convert_checkpoint`` on each of
``--ranks`` (docs/convert.md) and, side by side, with the route that loads the whole state dict
into one process and writes it (what DCP's consolidation and a model-loading converter do). Per
run: wall seconds, bytes read and written, peak RSS of the largest rank. Each conversion is
checked equal, tensor for tensor, to this repo's in-job export of the same model. Prints JSON lines,
then one summary line:

    python benchmarks/convert_bench.py --ranks 1,2
    python benchmarks/convert_bench.py --ranks 1,2,4 --experts 64 --hidden 1024 --layers 8   # ~1 GB
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _convert(rank: int, world: int, src: str, out: str, config: str) -> dict:
    from nemo_moe_export.convert.engine import convert_checkpoint

    result = convert_checkpoint(src, out, config=config, dtype="bfloat16", progress_s=None)
    return {"read": result.rank_bytes_read, "written": result.rank_bytes_written, "rss_mib": _peak_rss_mib()}


def _ready(rank: int, world: int) -> float:
    """A rank's peak RSS before any work (torch, transformers and the package preloaded): the first
    spawn also starts the fork server, which no route's time should include."""
    return _peak_rss_mib()


def _whole_state_dict(rank: int, world: int, src: str, out: str) -> dict:
    """One process loads every stored tensor (torch DCP), casts, and writes one file."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(src).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}
    dcp.load(state, checkpoint_id=src, no_dist=True)
    os.makedirs(out, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, os.path.join(out, "model.safetensors"))
    read = sum(info.length for info in metadata.storage_data.values())
    return {"read": read, "written": os.path.getsize(os.path.join(out, "model.safetensors")), "rss_mib": _peak_rss_mib()}


def _save_checkpoint(args: argparse.Namespace, work: str):
    """The model, its HF-keyed DCP checkpoint and its config folder; the in-job export of it."""
    import torch.distributed.checkpoint as dcp

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden, num_layers=args.layers,
                       moe_intermediate_size=args.hidden // 2, vocab_size=args.vocab, seed=0)
    hf = {k: p.tensor.contiguous() for k, p in get_adapter(model.config).to_hf(model.state_dict()).items()}
    src, config = os.path.join(work, "checkpoint"), os.path.join(work, "config")
    dcp.save(hf, checkpoint_id=src, no_dist=True)
    model.config.save_pretrained(config)
    export_hf_checkpoint(os.path.join(work, "in_job"), model, dtype="bfloat16")
    return src, config, sum(t.numel() * t.element_size() for t in hf.values())


def _equal(a: str, b: str) -> bool:
    import glob

    import torch
    from safetensors.torch import load_file

    def tensors(d):
        return {k: v for f in glob.glob(os.path.join(d, "*.safetensors")) for k, v in load_file(f).items()}

    x, y = tensors(a), tensors(b)
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def _timed(fn, *args) -> tuple[list[dict], float]:
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started


def main() -> None:
    import warnings

    from nemo_moe_export.spawn import spawn

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="convert-bench-") as work:
        src, config, model_bytes = _save_checkpoint(args, work)
        baseline = spawn(_ready, 1)[0]
        runs, equal = [], True
        for n in [int(r) for r in args.ranks.split(",")]:
            out = os.path.join(work, f"ours-{n}")
            ranks, seconds = _timed(spawn, _convert, n, src, out, config)
            equal &= _equal(out, os.path.join(work, "in_job"))
            runs.append(dict(route=f"convert_checkpoint x{n}", seconds=round(seconds, 3),
                             read=sum(r["read"] for r in ranks), written=sum(r["written"] for r in ranks),
                             peak_rss_mib=round(max(r["rss_mib"] for r in ranks), 1)))
        whole, seconds = _timed(spawn, _whole_state_dict, 1, src, os.path.join(work, "whole"))
        runs.append(dict(route="whole state dict, one process", seconds=round(seconds, 3), read=whole[0]["read"],
                         written=whole[0]["written"], peak_rss_mib=round(whole[0]["rss_mib"], 1)))
        for run in runs:
            print(json.dumps({"model_bytes": model_bytes, **run, "rank_baseline_rss_mib": round(baseline, 1)}))
        print(f"converted on {args.ranks} ranks: equal to the in-job export: {equal}")


if __name__ == "__main__":
    main()
