"""torch TP2 x FSDP2 export side by side with Megatron-Bridge's method, and the row-parallel
weights written strided vs through an exchange of bytes (docs/design.md#tensor-and-context-parallelism-torch-tp).

One run, on CPU ranks (gloo), mesh ("dp", "tp") = (W / 2, 2): a DeepSeek-V3-style model
(``tiny_models``, sizes from the flags; the default is about 330 MB in fp32) is built with the same
weights on every rank, ``parallelize_tp(model, mesh["tp"])`` and ``fully_shard`` over "dp".

1. **Export**: ``ours`` = ``export_hf_checkpoint`` (no gather: each rank writes its own boxes, the
   row-parallel ones as whole rows after the exchange of item 2), ``ours_strided`` = the same with
   the row-parallel shares written as they are (the export before the exchange: its
   ``row_parallel_shares`` replaced, for this run only, by one that exchanges nothing), and
   ``gather_tp`` = Megatron-Bridge's method: every parameter's ``full_tensor()`` on every rank
   (all-gathers over TP and FSDP), then rank 0 writes the HF checkpoint (transformers
   ``save_pretrained`` of the gathered state dict). Per method: seconds (slowest rank, disk quiesced and ranks lined up before, ``export_methods.measured_run``; median of
   ``--repeat``, the methods alternating), peak RSS growth per rank, bytes written per rank.
2. **Row-parallel weights** (``Shard(1)`` over TP: ``o_proj``, ``mlp.down_proj``,
   ``shared_experts.down_proj``), into files laid out by the export's own plan, both through the
   export's ``writer.PieceWriter``: ``strided`` = each rank writes its own box, one run per row
   (``writer.byte_runs``), vs ``exchange`` = ``export/row_exchange.py``: the TP peers first swap
   bytes (one ``all_to_all_single`` per weight over a gloo group of the peers) so that each holds
   whole rows of ``1/tp`` of its row range, then write them as one contiguous run. Seconds (median
   of ``--repeat``, alternating), runs and bytes per rank, bytes sent to the peers; the two files
   compared byte for byte. The export uses the exchange since this benchmark showed it faster
   (``ours`` above includes it).

Prints one JSON object; ``--out FILE`` also writes it.

    OMP_NUM_THREADS=1 python benchmarks/tp_bench.py --world-size 4 --repeat 3 \\
        --out benchmarks/results/cpu_tp_w4.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from output import emit  # noqa: E402  (benchmarks/output.py)

ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight")


def build(args: argparse.Namespace, mesh: Any) -> Any:
    """The benchmark model, TP over mesh["tp"] and FSDP2 over mesh["dp"]."""
    import torch

    from nemo_moe_export.job.tensor_parallel import parallelize_tp_fsdp
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden, num_layers=args.layers,
                       moe_intermediate_size=args.moe_inter, intermediate_size=args.inter, vocab_size=args.vocab,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads, qk_nope_head_dim=64,
                       qk_rope_head_dim=32, v_head_dim=64, kv_lora_rank=256, q_lora_rank=None, seed=0,
                       dtype=torch.float32)
    return parallelize_tp_fsdp(model, mesh)


def _ours(model: Any, path: str) -> dict[str, Any]:
    from nemo_moe_export.export import export_hf_checkpoint

    result = export_hf_checkpoint(path, model, max_shard_size="256MB")
    return {"bytes": result.rank_bytes_written, "checkpoint_bytes": result.checkpoint_bytes,
            "step_seconds": result.step_seconds}


def _ours_strided(model: Any, path: str) -> dict[str, Any]:
    """``_ours`` with no row-parallel share exchanged (each written as its strided runs)."""
    from nemo_moe_export.export import step

    exchanging = step.row_parallel_shares
    step.row_parallel_shares = lambda shares, state_dict: (list(shares), [])
    try:
        return _ours(model, path)
    finally:
        step.row_parallel_shares = exchanging


def _gather_tp(model: Any, path: str) -> dict[str, Any]:
    """Megatron-Bridge's export: every tensor gathered whole on every rank, rank 0 writes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    written = 0
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        from export_methods import _fsync_tree

        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        shell.save_pretrained(path, state_dict=full, max_shard_size="256MB")
        _fsync_tree(path)
        written = sum(v.numel() * v.element_size() for v in full.values())
    del full
    return {"bytes": written}


# --------------------------------------------------------------------------------------------------
# Row-parallel weights: strided positioned writes vs an exchange, then contiguous rows
# --------------------------------------------------------------------------------------------------


def _row_parallel_pieces(model: Any) -> tuple[Any, list[Any]]:
    """The export's plan of the row-parallel weights alone, and this rank's pieces of them."""
    from nemo_moe_export.adapters import TensorMeta, get_adapter
    from nemo_moe_export.export.plan import plan_export

    adapter = get_adapter(model.config)
    pieces = [p for k, p in adapter.to_hf(model.state_dict()).items() if k.endswith(ROW_PARALLEL)]
    plan = plan_export({p.key: TensorMeta(p.global_shape, p.tensor.dtype) for p in pieces}, max_shard_size="1GB")
    return plan, sorted(pieces, key=lambda p: p.key)


def _create(plan: Any, directory: str) -> None:
    from nemo_moe_export.export.writer import write_headers

    write_headers(plan, directory, [f.name for f in plan.files])


def _strided(plan: Any, pieces: list[Any], directory: str) -> dict[str, Any]:
    """The export's writer on each rank's own boxes: one run per row, straight from the tensor."""
    from nemo_moe_export.export.writer import PieceWriter

    writer = PieceWriter(plan, directory)
    writer.write(pieces)
    stats = writer.close()
    return {"runs": stats.runs, "bytes": stats.bytes_written, "exchanged_bytes": 0}


def _exchange(plan: Any, pieces: list[Any], state_dict: Any, directory: str) -> dict[str, Any]:
    """The export's row exchange (``export/row_exchange.py``): the TP peers swap bytes, then each
    writes whole rows of its part of the shared row range through the same writer."""
    from datetime import timedelta

    from nemo_moe_export.export.row_exchange import row_parallel_shares, write_exchanged_rows
    from nemo_moe_export.export.writer import PieceWriter

    regular, exchanges = row_parallel_shares(pieces, state_dict)
    if regular:
        raise RuntimeError(f"not exchanged: {[p.key for p in regular]}")
    writer = PieceWriter(plan, directory)
    sent = write_exchanged_rows(writer, exchanges, timedelta(seconds=600))
    stats = writer.close()
    return {"runs": stats.runs, "bytes": stats.bytes_written, "exchanged_bytes": sent}


def _same_bytes(a: str, b: str) -> bool:
    for name in sorted(os.listdir(a)):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            if fa.read() != fb.read():
                return False
    return True


# --------------------------------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from export_methods import measured_run

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    started = time.perf_counter()
    model = build(args, mesh).eval()
    out: dict[str, Any] = {"build_seconds": time.perf_counter() - started, "export": {}, "row_parallel": {}}
    methods = {"ours": _ours, "ours_strided": _ours_strided, "gather_tp": _gather_tp}
    for repeat in range(args.repeat):
        order = list(methods)[repeat % 3:] + list(methods)[:repeat % 3]
        for name in order:
            path = os.path.join(root, f"{name}-{repeat}")
            result, seconds, rss, _ = measured_run(lambda: methods[name](model, path), cuda=False)
            out["export"].setdefault(name, []).append({"seconds": seconds, "rss_mib": rss, **result})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    plan, pieces = _row_parallel_pieces(model)
    state_dict = model.state_dict()
    variants = {"strided": lambda d: _strided(plan, pieces, d),
                "exchange": lambda d: _exchange(plan, pieces, state_dict, d)}
    for repeat in range(args.repeat):
        order = list(variants) if repeat % 2 == 0 else list(variants)[::-1]
        for name in order:
            directory = os.path.join(root, f"rows-{name}-{repeat}")
            if rank == 0:
                os.makedirs(directory)
                _create(plan, directory)
            dist.barrier()
            result, seconds, _, _ = measured_run(lambda: variants[name](directory), cuda=False)
            out["row_parallel"].setdefault(name, []).append({"seconds": seconds, **result})
    dist.barrier()
    if rank == 0:
        out["row_parallel_files_equal"] = _same_bytes(os.path.join(root, "rows-strided-0"),
                                                      os.path.join(root, "rows-exchange-0"))
        out["row_parallel_bytes"] = sum(f.size for f in plan.files)
    return out


def _report(ranks: list[dict[str, Any]], args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Per method: the slowest rank's seconds (median over repeats), per-rank bytes and peak RSS growth."""
    export: dict[str, Any] = {}
    for name in ranks[0]["export"]:
        per_repeat = [max(r["export"][name][i]["seconds"] for r in ranks) for i in range(args.repeat)]
        export[name] = {"seconds": round(statistics.median(per_repeat), 3),
                        "all_seconds": [round(s, 3) for s in per_repeat],
                        "rank_bytes": [r["export"][name][0]["bytes"] for r in ranks],
                        "peak_rss_growth_mib": [round(max(x["rss_mib"] for x in r["export"][name]), 1) for r in ranks]}
    export["ours"]["checkpoint_bytes"] = ranks[0]["export"]["ours"][0]["checkpoint_bytes"]
    export["ours"]["each_byte_once"] = sum(export["ours"]["rank_bytes"]) == export["ours"]["checkpoint_bytes"]
    export["gather_tp_over_ours_x"] = round(export["gather_tp"]["seconds"] / export["ours"]["seconds"], 2)
    export["ours_strided_over_ours_x"] = round(export["ours_strided"]["seconds"] / export["ours"]["seconds"], 2)
    rows: dict[str, Any] = {}
    for name in ranks[0]["row_parallel"]:
        per_repeat = [max(r["row_parallel"][name][i]["seconds"] for r in ranks) for i in range(args.repeat)]
        rows[name] = {"seconds": round(statistics.median(per_repeat), 4),
                      "all_seconds": [round(s, 4) for s in per_repeat],
                      "rank_runs": [r["row_parallel"][name][0]["runs"] for r in ranks],
                      "rank_bytes": [r["row_parallel"][name][0]["bytes"] for r in ranks],
                      "rank_exchanged_bytes": [r["row_parallel"][name][0]["exchanged_bytes"] for r in ranks]}
    rows["exchange_over_strided_x"] = round(rows["exchange"]["seconds"] / rows["strided"]["seconds"], 2)
    rows["files_equal"] = ranks[0]["row_parallel_files_equal"]
    rows["bytes"] = ranks[0]["row_parallel_bytes"]
    return {"command": "python benchmarks/tp_bench.py " + shlex.join(argv or sys.argv[1:]),
            "world_size": args.world_size, "mesh": {"dp": args.world_size // 2, "tp": 2},
            "model": {k: getattr(args, k)
                      for k in ("hidden", "inter", "moe_inter", "experts", "layers", "heads", "vocab")},
            "build_seconds_max": round(max(r["build_seconds"] for r in ranks), 2),
            "export": export, "row_parallel": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=4096, help="dense MLP width (layer 0)")
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from nemo_moe_export.spawn import spawn

    args = parse_args(argv)
    root = tempfile.mkdtemp(prefix="tp-bench-", dir=os.environ.get("TP_BENCH_DIR"))
    try:
        ranks = spawn(_worker, args.world_size, args, root, timeout_s=1800, pg_timeout_s=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = _report(ranks, args, argv)
    emit(report, args.out, indent=2)


if __name__ == "__main__":
    main()
