"""The GPU pipeline benchmark's own code path, run on CPU ranks (gloo) with a small bf16 model.

The script is what produces the H200 numbers in benchmarks/RESULTS.md; this keeps it runnable and
checks what it reports against independent facts: the export is read back equal on every rank and
loads in transformers with the same logits as the sharded model (bit-exact under FSDP, where the
same modules compute), the MMLU policies agree, and every export method measured the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["parallel.device=cpu", "model=deepseek_v3_tiny", "model.dtype=bfloat16", "trainer.max_steps=3",
         "data.n_test=12", "export.max_shard_size=200KB", "mmlu.batch_size=4",
         "mmlu.tokens_per_batch=0"]  # fixed batches of 4 rows, so the policies' step counts differ


def _run(tmp_path, nproc: int, *overrides: str) -> dict:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "gpu_pipeline_bench.py"), f"--nproc={nproc}",
           f"--out={out}", f"--run-dir={tmp_path / 'run'}", *SMALL, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", [["model.n_experts=5"], ["parallel=ep", "model.n_experts=6"]],
                         ids=["fsdp_uneven", "ep2"])
def test_pipeline_bench_on_two_cpu_ranks(tmp_path, strategy):
    report = _run(tmp_path, 2, *strategy)
    measured = report["measurements"]
    check = measured["export_check"]
    assert check["tensor_equal_on_every_rank"]
    assert sum(r["pieces_compared"] for r in check["readback_per_rank"]) > 0
    assert (check["missing_keys"], check["unexpected_keys"], check["mismatched_keys"]) == (0, 0, 0)
    assert check["argmax_agreement"] == 1.0
    if strategy[0].startswith("parallel=ep"):
        assert check["logits_rel_l2"] < 1e-2  # our EP experts vs transformers' own: bf16 rounding only
    else:
        assert check["logits_exactly_equal"], check  # FSDP runs transformers' own modules

    fp8 = measured["fp8_export_check"]  # transformers' FP8 load of the trained model (dequantized on CPU)
    assert fp8["path"] == "dequantized on load (CPU)" and fp8["logits_rel_l2"] < 0.1, fp8
    assert fp8["mmlu_agreement"] >= 0.5 and fp8["mmlu_same_predictions"].endswith("/48"), fp8

    mmlu = measured["mmlu"]
    assert mmlu["predictions_identical_across_policies"] and mmlu["predictions_identical_to_recipe_stage"]
    assert mmlu["predictions_identical_on_every_rank"]
    if strategy[0].startswith("parallel=ep"):  # EP=world: expert_dp runs every batch on both ranks
        assert mmlu["lockstep"]["steps"] < mmlu["expert_dp"]["steps"]

    agreement = mmlu["shared_prefix_agreement"]  # the recipe's shared prefixes vs full prompts, bf16
    assert agreement["prefix_attention"] == "packed" and agreement["questions"] == 4 * 12
    assert agreement["agreement"] >= 0.9, agreement

    export = measured["export"]
    assert export["checkpoint_bytes"] == report["export"]["bytes"]
    for name in ("ours_threads1", "ours_threads4", "fp8_e4m3_scales", "fp8_ue8m0_scales", "gather", "dcp",
                 "raw_disk_threads1", "raw_disk_threads4"):
        assert "seconds" in export["results"][name], (name, export["results"][name])
    fp8 = export["results"]["fp8_e4m3_scales"]
    assert sum(r["bytes_written"] for r in fp8["io_per_rank"]) < 0.75 * report["export"]["bytes"]
    ours_io = export["results"]["ours_threads1"]["io_per_rank"]
    assert sum(r["bytes_written"] for r in ours_io) == report["export"]["bytes"]
    assert report["train"]["steps"] == 3 and not os.path.exists(tmp_path / "run" / "checkpoint")
