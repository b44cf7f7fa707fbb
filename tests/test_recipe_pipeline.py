"""The recipe on pipeline stages (``parallel=pp``: PP x FSDP2, ``parallel=pp_ep``: PP x EP, for a
transformers model and for a megatron-core one): trained with a 1F1B schedule, evaluated, exported
and verified end to end on 4 CPU ranks, and its pipeline settings checked before anything runs
(docs/design.md#pipeline-stages, #pipeline-stages-megatron-core)."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from bounds import assert_reload_agrees
from nemo_moe_export.errors import InputError
from nemo_moe_export.job.checks import check_config
from nemo_moe_export.job.compose import load_config
from test_recipe import run_cli

QUICK = ["trainer.max_steps=12", "trainer.progress=false", "mmlu.progress=false", "mmlu.every_n_steps=6",
         "data.n_test=12", "data.n_train=60"]


def _tensors(path):
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


@pytest.mark.parametrize("overrides", [
    ["recipe=deepseek_v3_tiny", "parallel=pp_ep"],  # PP2 x EP2; stage 0 holds the dense layer only
    # megatron-core: parallel_state PP2 x EP2, each rank builds its stage, megatron's own 1F1B schedule trains it
    ["recipe=megatron_deepseek_v3_tiny", "parallel=pp_ep"],
], ids=["pp_ep", "megatron_pp_ep"])  # virtual stages: tests/test_pipeline.py, tests/test_export_pipeline.py
def test_pipeline_recipe_trains_evaluates_exports_and_verifies(overrides, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli([*overrides, f"run_dir={run_dir}", *QUICK, "--nproc", "4"])
    results = json.loads((run_dir / "results.json").read_text())
    assert results["train"]["steps"] == 12 and results["train"]["last_loss"] < results["train"]["first_loss"]
    assert results["mmlu"]["overall"]["n"] == 4 * 12
    # the transformers reload in a fresh process gives the pipeline's answers, question for question
    assert_reload_agrees(results["verify"])
    assert "verify : OK" in proc.stdout
    if overrides[:2] == ["recipe=deepseek_v3_tiny", "parallel=pp_ep"]:  # restored stages export the same bytes
        again = tmp_path / "again"
        run_cli([*overrides, f"run_dir={again}", "stages=[export,verify]", "mmlu.enabled=false",
              f"export.from_checkpoint={run_dir / 'checkpoint'}", "--nproc", "4"])
        first, second = _tensors(run_dir / "hf"), _tensors(again / "hf")
        assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)


@pytest.mark.parametrize("overrides, pattern", [
    (["parallel=pp", "parallel.pp_size=3"], "pipeline size must divide the ranks"),
    (["parallel=pp", "parallel.layers_per_stage=[1,2]"], "layers_per_stage does not split"),
    (["parallel=pp", "parallel.stages_per_rank=2"], "more pipeline stages than decoder layers"),
    (["parallel=pp", "trainer.batch_size=6"], "equal microbatches"),
    (["parallel=pp_ep", "parallel.ep_size=4"], "expert-parallel size must divide the ranks of a pipeline stage"),
    (["model=megatron_deepseek_v3_tiny", "parallel=pp_ep", "parallel.stages_per_rank=2", "model.num_layers=4"],
     "virtual pipeline stages are not supported for megatron-core models"),
    (["model=megatron_deepseek_v3_tiny", "parallel=pp_ep", "parallel.pp_size=4", "parallel.ep_size=1",
      "model.num_layers=6"], "megatron-core cannot split the decoder layers this way"),  # [2, 2, 1, 1]
])
def test_pipeline_settings_are_checked_before_anything_runs(overrides, pattern):
    with pytest.raises(InputError, match=pattern):
        check_config(load_config("deepseek_v3_tiny", overrides), world_size=4)
