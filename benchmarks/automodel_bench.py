"""Our no-gather export vs NeMo AutoModel's own consolidated HF save, side by side, on AutoModel's model.

CPU ranks (gloo), AutoModel 0.7.0's own DeepSeek-V3 class (torch backends, fp32) sharded by its own
``parallelize_model`` with FSDP2 + EP (``MeshContext.build(FSDP2Config, ParallelismSizes(ep_size=...))``:
experts on its (ep_shard, ep) mesh). Both methods save the same sharded model, interleaved, each
repeat into fresh directories:

* ``ours``: ``export_hf_checkpoint(dir, model)``: every rank writes its own slices into the final
  HF files (no gather), verified and published;
* ``automodel``: AutoModel's ``Checkpointer.save_model`` with ``model_save_format=safetensors`` and
  ``save_consolidated=True``, as its recipe saves the final checkpoint: every rank writes its shards
  (DCP, HF-named safetensors), then the ranks consolidate them into HF files under
  ``model/consolidated``.

Per method: seconds (slowest rank, disk quiesced and ranks lined up before, ``export_methods.measured_run``;
median of ``--repeat``), bytes written (every file the method left on disk; AutoModel's split into
its per-rank shards and its consolidated files), and peak RSS growth per rank during the save (MiB:
max and sum over ranks). Ours returns once its files are fsynced, verified and published; AutoModel's
save returns without fsync, so the time to fsync its files afterwards is reported apart
(``then_fsync_seconds``, ``seconds_with_fsync``). ``same_tensors``: the two checkpoints hold the same tensors (dtype and
value). Each figure's unit is in its key name. Prints one JSON object; ``--out FILE``
also writes it.

    OMP_NUM_THREADS=1 python benchmarks/automodel_bench.py --world-size 4 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from output import emit  # noqa: E402  (benchmarks/output.py)


def stand_in_for_torch_cuda_current_device() -> int:
    """AutoModel's model code builds ``torch.device(f"cuda:{torch.cuda.current_device()}")`` defaults
    it never allocates on here (the buffers are built on the CPU)."""
    return 0


def build_model(args: argparse.Namespace):
    import torch
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v3.model import DeepseekV3ForCausalLM
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_inter, num_hidden_layers=args.layers, first_k_dense_replace=1,
        n_routed_experts=args.experts, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=512, num_nextn_predict_layers=0, dtype="float32")
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", rope_fusion=False, experts="torch_mm",
                            dispatcher="torch")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM.from_config(config, backend=backend)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    return model


def _fsync_tree(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from nemo_automodel.components.distributed import model_parallelizer
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from export_methods import measured_run
    from nemo_moe_export.export import export_hf_checkpoint

    torch.cuda.current_device = stand_in_for_torch_cuda_current_device
    model = build_model(args)
    # What AutoModel's apply_model_infrastructure records before sharding, and its consolidated save
    # reads for the index: the HF keys of the whole model (a rank's shards hold only its experts).
    model._pre_shard_hf_state_dict_keys = model.state_dict_adapter.get_hf_state_dict_keys(model.state_dict())
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.float32)
    mesh = MeshContext.build(FSDP2Config(mp_policy=fp32), ParallelismSizes(ep_size=args.ep))
    model_parallelizer.parallelize_model(model, mesh)
    ep_shard = mesh.moe_mesh["ep_shard"].get_local_rank() if "ep_shard" in mesh.moe_mesh.mesh_dim_names else 0
    checkpointer = CheckpointingConfig(checkpoint_dir=root, model_save_format="safetensors", save_consolidated=True,
                                       model_repo_id=None).build(
        dp_rank=ep_shard * args.ep + mesh.moe_mesh["ep"].get_local_rank(), tp_rank=0, pp_rank=0,
        moe_mesh=mesh.moe_mesh)

    def ours(i: int) -> dict[str, Any]:
        path = os.path.join(root, f"ours_{i}")
        result, seconds, rss, _ = measured_run(lambda: export_hf_checkpoint(path, model), cuda=False)
        return {"seconds": seconds, "rss_mib": rss, "path": path, "rank_bytes": result.rank_bytes_written,
                "step_seconds": result.step_seconds, "io": result.io}

    def automodel(i: int) -> dict[str, Any]:
        path = os.path.join(root, f"automodel_{i}")
        _, seconds, rss, _ = measured_run(
            lambda: checkpointer.save_model(model, path, is_final_checkpoint=True), cuda=False)
        # AutoModel's save returns without fsync; ours returns once its files are fsynced, verified
        # and published. The time to make AutoModel's files durable, apart, for the comparison:
        _, fsync_seconds, _, _ = measured_run(lambda: _fsync_tree(path) if rank == 0 else None, cuda=False)
        return {"seconds": seconds, "rss_mib": rss, "path": path, "fsync_seconds": fsync_seconds}

    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "automodel": []}
    for i in range(args.repeat):
        order = [("ours", ours), ("automodel", automodel)]
        for name, fn in order if i % 2 == 0 else order[::-1]:  # each repeat starts with the other method
            runs[name].append(fn(i))
    dist.barrier()
    params = sum(p.numel() * p.element_size() for p in model.parameters()) if rank == 0 else None
    return {"runs": runs, "model_bytes_local": params}


def _same_tensors(ours: str, theirs: str) -> bool:
    """Both checkpoints hold the same keys with equal dtype and values."""
    import glob

    import torch
    from safetensors.torch import load_file

    def read(path: str) -> dict[str, Any]:
        return {k: v for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))) for k, v in load_file(f).items()}

    a, b = read(ours), read(theirs)
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def summarize(per_rank: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("ours", "automodel"):
        repeats = len(per_rank[0]["runs"][name])
        seconds = [max(r["runs"][name][i]["seconds"] for r in per_rank) for i in range(repeats)]
        rss_max = [max(r["runs"][name][i]["rss_mib"] for r in per_rank) for i in range(repeats)]
        rss_sum = [sum(r["runs"][name][i]["rss_mib"] for r in per_rank) for i in range(repeats)]
        path = per_rank[0]["runs"][name][-1]["path"]
        entry = {"seconds_median": statistics.median(seconds), "seconds_all": seconds,
                 "bytes_written": _dir_bytes(path),
                 "peak_rss_growth_max_rank_mib_median": statistics.median(rss_max),
                 "peak_rss_growth_sum_ranks_mib_median": statistics.median(rss_sum)}
        if name == "automodel":
            consolidated = os.path.join(path, "model", "consolidated")
            entry["consolidated_bytes"] = _dir_bytes(consolidated)
            entry["per_rank_shard_bytes"] = entry["bytes_written"] - entry["consolidated_bytes"]
            fsyncs = [per_rank[0]["runs"][name][i]["fsync_seconds"] for i in range(repeats)]
            entry["then_fsync_seconds_median"] = statistics.median(fsyncs)
            entry["seconds_with_fsync_median"] = statistics.median(a + b for a, b in zip(seconds, fsyncs))
        else:
            entry["rank_bytes_written"] = [r["runs"][name][-1]["rank_bytes"] for r in per_rank]
            steps = per_rank[0]["runs"][name][-1]["step_seconds"]
            entry["step_seconds_slowest_rank_last_repeat"] = {
                step: max(r["runs"][name][-1]["step_seconds"][step] for r in per_rank) for step in steps}
            entry["write_io_rank0_last_repeat"] = per_rank[0]["runs"][name][-1]["io"]
        out[name] = entry
    consolidated = os.path.join(per_rank[0]["runs"]["automodel"][-1]["path"], "model", "consolidated")
    out["same_tensors"] = _same_tensors(per_rank[0]["runs"]["ours"][-1]["path"], consolidated)
    out["automodel_over_ours_seconds_x"] = out["automodel"]["seconds_median"] / out["ours"]["seconds_median"]
    out["automodel_with_fsync_over_ours_seconds_x"] = (out["automodel"]["seconds_with_fsync_median"]
                                                        / out["ours"]["seconds_median"])
    out["automodel_over_ours_bytes_x"] = out["automodel"]["bytes_written"] / out["ours"]["bytes_written"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from nemo_moe_export.spawn import spawn

    root = tempfile.mkdtemp(prefix="automodel-bench-")
    try:
        per_rank = spawn(_worker, args.world_size, args, root, timeout_s=1800, pg_timeout_s=600)
        result = {"benchmark": "automodel_bench", "device": "cpu", "world_size": args.world_size,
                  "mesh": {"fsdp": args.world_size, "ep": args.ep, "ep_shard": args.world_size // args.ep},
                  "model": {"class": "nemo_automodel DeepseekV3ForCausalLM", "hidden": args.hidden,
                            "moe_inter": args.moe_inter, "experts": args.experts, "layers": args.layers,
                            "vocab": args.vocab, "dtype": "float32"},
                  "repeat": args.repeat, **summarize(per_rank, args)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()
