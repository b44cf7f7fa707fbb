"""The three doors: Hydra config + CLI main job under torchrun, recipe stages, NeMo-Run launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from safetensors.torch import load_file

from bounds import assert_reload_agrees
from nemo_moe_export.errors import InputError
from nemo_moe_export.job.checks import check_stages
from nemo_moe_export.job.compose import load_config
from nemo_moe_export.job.stages import check_recipe

QUICK = ["trainer.max_steps=20", "trainer.progress=false", "mmlu.every_n_steps=10", "data.n_test=12",
         "data.n_train=60"]


def test_recipe_config_is_typed():
    cfg = load_config("deepseek_v3_tiny", ["trainer.max_steps=7", "parallel=ep", "export.dtype=bfloat16"])
    assert cfg.trainer.max_steps == 7 and isinstance(cfg.trainer.max_steps, int)
    assert cfg.parallel.strategy == "ep" and cfg.parallel.ep_size == 2
    assert list(cfg.stages) == ["train", "mmlu", "export", "verify"]
    assert cfg.run_dir == "runs/deepseek_v3_tiny"


@pytest.mark.parametrize(
    "override,error,pattern",
    [
        ("trainer.max_steps=lots", ConfigCompositionException, "trainer.max_steps=lots"),
        ("trainer.learning_rate=0.1", ConfigCompositionException, "trainer.learning_rate"),
        ("+trainer.learning_rate=0.1", InputError, "key 'trainer.learning_rate'"),
        ("parallel=zero3", MissingConfigException, "parallel/zero3"),
    ],
    ids=["wrong-type", "unknown-key", "unknown-key-appended", "unknown-group-option"],
)
def test_config_errors_are_hydras_own(override, error, pattern):
    with pytest.raises(error) as info:
        load_config("deepseek_v3_tiny", [override])
    text = str(info.value) + str(info.value.__cause__ or "")
    assert pattern in text


def test_wrong_type_names_the_type():
    with pytest.raises(ConfigCompositionException) as info:
        load_config("deepseek_v3_tiny", ["trainer.max_steps=lots"])
    assert "could not be converted to Integer" in str(info.value.__cause__)


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(InputError, match=r"unknown recipe.*deepseek_v3_tiny.*qwen3_moe_tiny"):
        load_config("mixtral_tiny")


@pytest.mark.parametrize(
    "stages,pattern",
    [
        (["train", "bake"], "unknown stage"),
        (["export", "train"], "pipeline order"),
        (["train", "train"], "pipeline order"),
        (["export", "verify"], "need a trained checkpoint"),
    ],
)
def test_stage_order_and_inputs(stages, pattern):
    cfg = load_config("deepseek_v3_tiny", [f"stages=[{','.join(stages)}]"])
    with pytest.raises(InputError, match=pattern):
        check_stages(cfg)


@pytest.mark.parametrize("override,pattern", [
    ("mmlu.policy=lockstpe", "key 'policy'.*got 'lockstpe'"),
    ("mmlu.policy=naive", "key 'policy'.*naive hangs"),
    ("export.max_shard_size=5 gigs", "max_shard_size"),
    ("export.writer_threads=0", "key 'writer_threads'.*got 0"),
])
def test_every_stage_option_is_checked_before_any_work(override, pattern, tmp_path):
    """run_recipe builds every stage's options first: a bad value is refused before the process
    group, the model or the first training step, and nothing is written."""
    from nemo_moe_export.job.stages import run_recipe

    run_dir = tmp_path / "run"
    with pytest.raises(InputError, match=pattern):
        run_recipe(load_config("deepseek_v3_tiny", [f"run_dir={run_dir}", override]))
    assert not run_dir.exists()


def test_an_existing_export_target_is_refused_before_training(tmp_path):
    """Re-running a recipe into the same run_dir fails in a second, naming the way out, instead of
    after training (export.overwrite defaults to error); with replace it is accepted up front."""
    from nemo_moe_export.job.checks import check_export_target, export_target
    from nemo_moe_export.job.stages import run_recipe

    run_dir = tmp_path / "run"
    (run_dir / "hf").mkdir(parents=True)
    cfg = load_config("deepseek_v3_tiny", [f"run_dir={run_dir}"])
    assert cfg.export.overwrite == "error"
    with pytest.raises(InputError, match="export target already exists.*pass export.overwrite=replace"):
        run_recipe(cfg)
    assert sorted(os.listdir(run_dir)) == ["hf"], "nothing was set up or written"
    replace = load_config("deepseek_v3_tiny", [f"run_dir={run_dir}", "export.overwrite=replace"])
    check_export_target(export_target(replace, str(run_dir)), replace.export.overwrite)  # accepted
    # A run without the export stage does not care (verify reads the existing export).
    check_stages(load_config("deepseek_v3_tiny", [f"run_dir={run_dir}", "stages=[verify]"]))


def run_cli(args, timeout=400):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nemo_moe_export", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "r"
    proc = run_cli(["recipe=deepseek_v3_tiny", f"run_dir={run_dir}", *QUICK, "--nproc", "4"])
    return run_dir, proc


def test_cli_under_torchrun_runs_every_stage(trained_run):
    run_dir, proc = trained_run
    results = json.loads((run_dir / "results.json").read_text())
    assert results["train"]["steps"] == 20 and results["train"]["last_loss"] < results["train"]["first_loss"]
    assert results["mmlu"]["overall"]["n"] == 4 * 12
    assert os.path.exists(run_dir / "mmlu" / "mmlu_results.json") and os.path.exists(run_dir / "mmlu" / "mmlu_results.md")
    assert_reload_agrees(results["verify"])
    assert (run_dir / "hf" / "model.safetensors.index.json").exists()
    assert (run_dir / "hf" / "tokenizer.json").exists()
    assert (run_dir / "config.json").exists() and (run_dir / "logs" / "rank3.log").exists()
    assert "summary" in proc.stdout and "verify : OK" in proc.stdout
    from nemo_moe_export.serving.vllm_logprobs import vllm_python

    if vllm_python() is not None:  # make test names vLLM's environment: the demo's dims are not vLLM CPU's
        assert "not served here" in results["verify"]["vllm"] and "kv_lora_rank" in results["verify"]["vllm"]
        assert "serve  : vLLM: not served here" in proc.stdout


def test_single_stage_from_a_saved_checkpoint(trained_run, tmp_path):
    run_dir, _ = trained_run
    second = tmp_path / "export-only"
    run_cli(["recipe=deepseek_v3_tiny", f"run_dir={second}", "stages=[export,verify]",
          f"export.from_checkpoint={run_dir / 'checkpoint'}", "mmlu.enabled=false", "--nproc", "4"])
    results = json.loads((second / "results.json").read_text())
    assert "train" not in results and results["verify"]["ok"]
    # The export of the restored checkpoint equals the export made right after training.
    first = {}
    for name in os.listdir(run_dir / "hf"):
        if name.endswith(".safetensors"):
            first.update(load_file(run_dir / "hf" / name))
    again = {}
    for name in os.listdir(second / "hf"):
        if name.endswith(".safetensors"):
            again.update(load_file(second / "hf" / name))
    assert first.keys() == again.keys()
    assert all((first[k] == again[k]).all() for k in first)
    # The export.from_checkpoint door: config.json and dtypes as transformers writes the same weights
    # (loaded in the dtype the config declares), and as the export right after training wrote them.
    from transformers import AutoModelForCausalLM

    from checks import assert_serving_config

    AutoModelForCausalLM.from_pretrained(second / "hf", dtype="auto").save_pretrained(tmp_path / "reference")
    config = assert_serving_config(str(second / "hf"), str(tmp_path / "reference"))
    assert config == json.loads((run_dir / "hf" / "config.json").read_text())


def test_a_task_from_yaml_alone_runs_through_the_recipe(tmp_path):
    """ARC-Challenge picked by overrides only: the recipe trains on its synthetic MMLU-format corpus,
    evaluates ARC from mmlu.data_path (acc_norm), exports, and the reload answers every question as
    the trained model did."""
    from test_eval_tasks import write_arc

    data = write_arc(tmp_path / "ARC-Challenge")
    run_dir = tmp_path / "arc"
    proc = run_cli(["recipe=qwen3_moe_tiny", f"run_dir={run_dir}", *QUICK, "mmlu.task=arc_challenge",
                    "mmlu.k_shot=0", f"mmlu.data_path={data}", "mmlu.max_questions=16", "mmlu.plot=false",
                    "--nproc", "2"])
    results = json.loads((run_dir / "results.json").read_text())
    assert results["train"]["steps"] == 20
    assert results["mmlu"]["overall"]["n"] == 16 and "acc_norm" in results["mmlu"]["overall"]
    assert results["mmlu_during_training"][0]["step"] == 10 and "arc_challenge/acc_norm" in results["mmlu_during_training"][0]
    written = json.loads((run_dir / "mmlu" / "arc_challenge_results.json").read_text())
    assert written["task"] == "arc_challenge" and len(written["predictions"]) == 16
    assert_reload_agrees(results["verify"])
    assert "ARC-Challenge overall acc" in proc.stdout


def test_a_task_of_its_own_format_needs_its_documents(tmp_path):
    cfg = load_config("deepseek_v3_tiny", [f"run_dir={tmp_path / 'r'}", "mmlu.task=arc_challenge", "mmlu.k_shot=0"])
    with pytest.raises(InputError, match="key 'mmlu.data_path'.*MMLU-shaped"):
        check_recipe(cfg, 1)


def test_nemo_run_launcher_runs_the_recipe_locally(tmp_path):
    pytest.importorskip("nemo_run")
    run_dir = tmp_path / "nr"
    proc = run_cli(["launch", "recipe=qwen3_moe_tiny", f"run_dir={run_dir}", *QUICK, "stages=[train,export]",
                 "--nproc", "2", "--job-dir", str(tmp_path / "jobs")], timeout=500)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["train"]["steps"] == 20 and os.path.exists(results["export"]["path"])
    assert "qwen3_moe_tiny" in proc.stdout + proc.stderr


def test_nemo_run_launcher_validates_before_launching(tmp_path):
    pytest.importorskip("nemo_run")
    proc = subprocess.run([sys.executable, "-m", "nemo_moe_export", "launch", "recipe=deepseek_v3_tiny",
                           "trainer.max_steps=abc", "--nproc", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "trainer.max_steps=abc" in proc.stderr


@pytest.mark.parametrize("override, message", [("export.overwrite=repalce", "unknown overwrite policy"),
                                               ("parallel.ep_size=3", "ep_size"),
                                               ("parallel.pp_size=3", "pipeline size must divide the ranks")])
def test_nemo_run_launcher_checks_the_recipe_for_its_world_before_launching(tmp_path, override, message):
    """The recipe checks (options, EP size against the ranks) run before NeMo-Run starts anything:
    no job directory is made."""
    pytest.importorskip("nemo_run")
    jobs = tmp_path / "jobs"
    proc = subprocess.run([sys.executable, "-m", "nemo_moe_export", "launch", "recipe=deepseek_v3_tiny",
                           "parallel=ep", override, "--nproc", "4", "--job-dir", str(jobs)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not jobs.exists()


def test_device_choice_is_checked(monkeypatch):
    """``parallel.device``: auto falls back to the CPU without a GPU per local rank; an explicit
    cuda without enough GPUs, or an unknown device, is an error naming the key."""
    import torch

    from nemo_moe_export.parallel import resolve_device

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(InputError, match="parallel.device.*expected 4 visible GPUs, got 2"):
        resolve_device("cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_device("auto") == "cuda"
    with pytest.raises(InputError, match="unknown device"):
        resolve_device("gpu")
    cfg = load_config("deepseek_v3_gpu")
    assert (cfg.parallel.device, cfg.model.dtype, cfg.model.n_experts % 2) == ("cuda", "bfloat16", 1)


def _tensors(directory):
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def _assert_same_tensors(first, second):
    assert first.keys() == second.keys()
    differ = [k for k in first if first[k].dtype != second[k].dtype or not (first[k] == second[k]).all()]
    assert not differ, differ[:5]


def test_convert_reads_the_trainers_own_checkpoint(trained_run, tmp_path):
    """The train stage's DCP checkpoint (transformers' in-memory keys, fused experts) converts,
    with no model, to what the in-job export of the same weights wrote, tensor for tensor."""
    from nemo_moe_export.convert import convert_checkpoint, read_index

    run_dir, _ = trained_run
    assert read_index(run_dir / "checkpoint").format == "transformers"
    dtype = json.loads((run_dir / "hf" / "config.json").read_text()).get("dtype")
    result = convert_checkpoint(run_dir / "checkpoint", tmp_path / "hf", config=run_dir / "hf", dtype=dtype)
    assert result.format == "transformers"
    _assert_same_tensors(_tensors(run_dir / "hf"), _tensors(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((run_dir / "hf" / "config.json").read_text())


def test_export_from_another_frameworks_checkpoint_converts_it(trained_run, tmp_path):
    """export.from_checkpoint of an HF-keyed DCP checkpoint (AutoModel's format) with stages=[export]:
    converted on 2 ranks into the export's directory, equal to the in-job export; stages that need the
    model are refused before any rank starts."""
    import torch.distributed.checkpoint as dcp

    run_dir, _ = trained_run
    foreign = tmp_path / "automodel"
    dcp.save(_tensors(run_dir / "hf"), checkpoint_id=str(foreign), no_dist=True)
    second = tmp_path / "converted"
    proc = run_cli(["recipe=deepseek_v3_tiny", f"run_dir={second}", "stages=[export,verify]", "mmlu.enabled=false",
                    f"export.from_checkpoint={foreign}", "--nproc", "2"])
    assert "converted the automodel checkpoint" in proc.stdout and "verify : OK" in proc.stdout
    _assert_same_tensors(_tensors(run_dir / "hf"), _tensors(second / "hf"))
    assert json.loads((second / "hf" / "config.json").read_text()) == json.loads((run_dir / "hf" / "config.json").read_text())
    for stages in ("[mmlu,export]", "[train,export]"):
        with pytest.raises(InputError, match="converted, not loaded into the model") as info:
            check_recipe(load_config("deepseek_v3_tiny", [f"run_dir={tmp_path / 'x'}", f"stages={stages}",
                                                          f"export.from_checkpoint={foreign}"]))
        assert info.value.key == "export.from_checkpoint"


def _plain_ranks(argv, world, cwd):
    """``python -m nemo_moe_export ARGV`` as ``world`` plain processes, as srun starts them (env://)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, "-m", "nemo_moe_export", *argv], cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    return [(p.wait(timeout=300), *p.communicate()) for p in procs]


def test_convert_as_plain_processes(trained_run, tmp_path):
    """``nemo-moe-export convert`` on 2 ranks started like srun (RANK / WORLD_SIZE / MASTER_ADDR):
    a refused input (an existing OUT) is one line and exit 1 on every rank, then the conversion."""
    run_dir, _ = trained_run
    argv = ["convert", str(run_dir / "checkpoint"), str(tmp_path / "hf"), "--config", str(run_dir / "hf")]
    (tmp_path / "hf").mkdir()
    refused = _plain_ranks(argv, 2, tmp_path)
    assert [status for status, _, _ in refused] == [1, 1], refused
    assert "nemo-moe-export: error:" in refused[0][2] and "Traceback" not in refused[0][2] + refused[1][2]
    (tmp_path / "hf").rmdir()
    done = _plain_ranks(argv, 2, tmp_path)
    assert [status for status, _, _ in done] == [0, 0], done
    assert json.loads(done[0][1].splitlines()[-1])["format"] == "transformers"
    _assert_same_tensors(_tensors(run_dir / "hf"), _tensors(tmp_path / "hf"))


def test_convert_under_the_nemo_run_launcher(trained_run, tmp_path):
    pytest.importorskip("nemo_run")
    run_dir, _ = trained_run
    run_cli(["launch", "convert", str(run_dir / "checkpoint"), str(tmp_path / "hf"), "--config", str(run_dir / "hf"),
             "--nproc", "2", "--job-dir", str(tmp_path / "jobs")], timeout=300)
    _assert_same_tensors(_tensors(run_dir / "hf"), _tensors(tmp_path / "hf"))


def test_an_unreadable_foreign_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"\x80\x04truncated")
    cfg = load_config("deepseek_v3_tiny", [f"run_dir={tmp_path / 'r'}", "stages=[export]",
                                           f"export.from_checkpoint={tmp_path / 'ckpt'}"])
    with pytest.raises(InputError, match="nor one the conversion reads.*cannot be read") as info:
        check_recipe(cfg, 2)
    assert info.value.key == "export.from_checkpoint" and not (tmp_path / "r").exists()
