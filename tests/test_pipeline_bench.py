"""The pipeline benchmark's code path on 4 real gloo ranks, at a tiny size (a smoke test, not speed).

``benchmarks/pipeline_bench.py`` runs in this process (its ranks spawned as the script spawns them)
with a 2-layer model, a few questions and one repeat; the JSON it reports must have its keys, and
its invariants must hold: for both export layouts (FSDP2; PP2 x FSDP2) the ranks' bytes add up to
the checkpoint's bytes, the two checkpoints are equal byte for byte (each export's id aside), and
every MMLU variant (PP or not, each microbatch count, EP with both policies) predicts the same
wherever the reference decides (tests/bounds.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from bounds import judge_answers

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
TINY = ["--world-size", "4", "--repeat", "1", "--hidden", "32", "--moe-inter", "32", "--experts", "4",
        "--layers", "2", "--heads", "2", "--head-dim", "16", "--questions-per-subject", "1",
        "--max-questions", "4", "--warmup-questions", "0", "--batch-size", "2", "--microbatches", "1", "2",
        "--shard-size", "200KB"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)  # spawned ranks inherit sys.path and unpickle pipeline_bench._worker
    import pipeline_bench

    out = tmp_path_factory.mktemp("pipeline-bench") / "bench.json"
    argv = [*TINY, "--out", str(out)]
    printed = pipeline_bench.run(pipeline_bench.parse_args(argv), argv)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(printed))  # --out holds what is printed
    return written


def test_report_keys(report):
    for key in ("command", "world_size", "torch_version", "loadavg_before_1_5_15min", "loadavg_after_1_5_15min",
                "sizes", "meshes", "export", "mmlu"):
        assert key in report, key
    assert report["world_size"] == 4 and report["pp_stages"] == 2 and report["ep_size"] == 2
    assert "--world-size 4" in report["command"]
    assert report["meshes"]["pp2_fsdp"] == {"pp": 2, "dp_shard": 2} and report["meshes"]["fsdp"] == {"dp_shard": 4}
    export = report["export"]
    for layout in ("fsdp", "pp2_fsdp"):
        entry = export[layout]
        for key in ("export_seconds_median", "export_seconds_all", "step_seconds_median", "checkpoint_bytes",
                    "rank_bytes_written_max", "rank_bytes_written_mean", "rank_bytes_written_all"):
            assert key in entry, (layout, key)
        assert {"validate", "write", "publish"} <= set(entry["step_seconds_median"])
    assert "pp2_fsdp_vs_fsdp_export_seconds_x" in export
    mmlu = report["mmlu"]
    pp = mmlu["pp_vs_no_pp"]
    assert pp["reference"] == "fsdp_dp4" and pp["fsdp_dp4"]["dp_size"] == 4
    for m in (1, 2):
        entry = pp[f"pp2_fsdp_mb{m}"]
        assert entry["microbatches"] == m and entry["dp_size"] == 2 and entry["pp_stages"] == 2
        assert entry["bubble_fraction_theoretical"] == pytest.approx(1 / (m + 1))
        assert entry["questions_per_s"] > 0 and "vs_fsdp_dp_questions_per_s_x" in entry
    ep = mmlu["policies_under_ep"]
    for prefix, dp in (("ep2", 4), ("pp2_ep2", 2)):
        assert ep[f"{prefix}_lockstep"]["dp_size"] == dp and ep[f"{prefix}_expert_dp"]["policy"] == "expert_dp"
        assert ep[f"{prefix}_lockstep_speedup_over_expert_dp_x"] > 0
    assert ep["pp2_ep2_lockstep"]["edp_size"] == 1 and ep["ep2_lockstep"]["edp_size"] == 2


def test_each_rank_writes_its_own_bytes_once_in_both_layouts(report):
    for layout in ("fsdp", "pp2_fsdp"):
        entry = report["export"][layout]
        assert entry["rank_bytes_written_sum_equals_checkpoint_bytes"]
        assert sum(entry["rank_bytes_written_all"]) == entry["checkpoint_bytes"]
        assert len(entry["rank_bytes_written_all"]) == 4 and min(entry["rank_bytes_written_all"]) > 0
        assert entry["rank_bytes_written_max"] < entry["checkpoint_bytes"] / 2  # nobody gathers
    assert report["export"]["fsdp"]["checkpoint_bytes"] == report["export"]["pp2_fsdp"]["checkpoint_bytes"]


def test_pipeline_and_fsdp_checkpoints_are_equal(report):
    compared = report["export"]["checkpoints_compared"]
    assert compared["equal"], compared
    assert not compared["differing_files"] and not compared["files_in_one_only"]
    assert compared["files_compared"] >= 3
    assert compared["bytes_compared"] >= report["export"]["fsdp"]["checkpoint_bytes"]


def test_every_mmlu_variant_predicts_the_same(report):
    predictions = report["mmlu"]["predictions"]
    variants = predictions["variants"]
    assert set(variants) == {"pp2_fsdp_mb1", "pp2_fsdp_mb2", "ep2_lockstep", "ep2_expert_dp",
                             "pp2_ep2_lockstep", "pp2_ep2_expert_dp"}
    assert predictions["questions"] == 4
    scores = predictions["scores"]
    want = scores[predictions["reference"]]
    for name, agree in variants.items():  # fp32: scores within the bound, answers judged where decided
        assert agree["questions"] == 4, (name, agree)
        judge_answers({"scores": scores[name]}, {"scores": want}, name)
