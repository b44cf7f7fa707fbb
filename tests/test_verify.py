"""verify_checkpoint passes what transformers writes and fails, precisely, on hand-broken files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_moe_export.export import export_hf_checkpoint, verify_checkpoint
from nemo_moe_export.tiny_models import tiny_model


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "ckpt"
    model = tiny_model("deepseek_v3", n_experts=5)
    export_hf_checkpoint(path, model, max_shard_size="16KB")
    return path


def _copy(good, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _file_of(path, key):
    return path / _index(path)[key]


def test_good_checkpoint_passes_and_cli_exits_zero(good):
    report = verify_checkpoint(good)
    assert report.ok, report.summary()
    assert report.tensors == len(_index(good))
    run = subprocess.run([sys.executable, "-m", "nemo_moe_export", "verify", str(good)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout + run.stderr


def test_save_pretrained_output_passes_but_for_the_keys_serving_engines_need(tmp_path):
    """transformers' own output is sound byte for byte; its config.json lacks what vLLM needs to
    compute the same model (docs/design.md#serving-engines), and verify names exactly that."""
    model = tiny_model("kimi_linear", n_experts=4)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 2 and all("lacks mla_use_nope" in p or "lacks linear_attn_config" in p
                                              for p in report.problems), report.problems


@pytest.mark.parametrize("break_it,problem", [
    (lambda c: c.update(architectures=None), "architectures is None, expected ['DeepseekV3ForCausalLM']"),
    (lambda c: c.update(architectures=["DeepseekV3Model"]), "architectures is ['DeepseekV3Model']"),
    (lambda c: c.update(dtype="bfloat16"), "dtype is 'bfloat16', but the files hold 'float32'"),
    (lambda c: c.update(torch_dtype="float16"), "torch_dtype is 'float16', but the files hold 'float32'"),
    (lambda c: [c.pop("dtype"), c.pop("torch_dtype")], "declares no dtype: expected dtype and torch_dtype 'float32'"),
    (lambda c: c.pop("topk_method"), "lacks topk_method"),
    (lambda c: c.update(scoring_func="softmax"), "scoring_func is 'softmax', expected 'sigmoid'"),
])
def test_config_json_that_would_not_serve_the_model_is_reported(good, tmp_path, break_it, problem):
    path = _copy(good, tmp_path)
    config = json.loads((path / "config.json").read_text())
    break_it(config)
    (path / "config.json").write_text(json.dumps(config))
    report = verify_checkpoint(path)
    assert len(report.problems) == 1 and problem in report.problems[0], report.problems


def test_missing_key(good, tmp_path):
    path = _copy(good, tmp_path)
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    file = _file_of(path, key)
    tensors = load_file(file)
    del tensors[key]
    save_file(tensors, file, metadata={"format": "pt"})
    report = verify_checkpoint(path)
    assert f"key '{key}' -> {file.name}, but no file holds it" in report.summary()
    assert "experts differ in their projections" in report.summary()
    run = subprocess.run([sys.executable, "-m", "nemo_moe_export", "verify", str(path)], capture_output=True, text=True)
    assert run.returncode == 1 and key in run.stdout


def _edit_header(file, edit):
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    file.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def test_overlapping_offsets(good, tmp_path):
    path = _copy(good, tmp_path)
    file = _file_of(path, "model.layers.1.mlp.experts.0.gate_proj.weight")

    def shift(header):
        entries = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
        second = entries[1][1]
        header[second]["data_offsets"] = [o - 4 for o in header[second]["data_offsets"]]

    _edit_header(file, shift)
    summary = verify_checkpoint(path).summary()
    assert "overlaps the previous tensor" in summary and file.name in summary


def test_stale_fused_key_beside_per_expert_keys(good, tmp_path):
    path = _copy(good, tmp_path)
    file = _file_of(path, "model.layers.1.mlp.experts.0.gate_proj.weight")
    tensors = load_file(file)
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(5, 32, 32)
    save_file(tensors, file, metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.mlp.experts.gate_up_proj"] = file.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    summary = verify_checkpoint(path).summary()
    assert "stale fused expert key 'model.layers.1.mlp.experts.gate_up_proj'" in summary


def test_truncated_file(good, tmp_path):
    path = _copy(good, tmp_path)
    file = _file_of(path, "model.layers.1.mlp.experts.4.down_proj.weight")
    file.write_bytes(file.read_bytes()[:-100])
    summary = verify_checkpoint(path).summary()
    assert f"{file.name}: tensors end at data byte" in summary and "truncated" in summary


def test_expert_count_against_config(good, tmp_path):
    path = _copy(good, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["n_routed_experts"] = 6
    (path / "config.json").write_text(json.dumps(config))
    assert "model.layers.1.mlp: experts 5 found, config says 6; missing ids [5]" in verify_checkpoint(path).summary()


def test_reference_mismatch(good, tmp_path):
    reference = {k: v.clone() for k, v in tiny_model("deepseek_v3", n_experts=5).state_dict().items()}
    from nemo_moe_export.adapters import get_adapter

    hf = {k: p.tensor.clone() for k, p in get_adapter(tiny_model("deepseek_v3", n_experts=5).config).to_hf(reference).items()}
    assert verify_checkpoint(good, reference=hf).ok
    hf["model.norm.weight"] = hf["model.norm.weight"] + 1
    assert "tensor 'model.norm.weight' differs from the reference" in verify_checkpoint(good, reference=hf).summary()


def test_compare_with_shards_reads_the_boxes_and_names_a_changed_tensor(good, tmp_path):
    """The no-gather equality check: equal on the exported model; one flipped element is named."""
    from nemo_moe_export.export import compare_with_shards

    model = tiny_model("deepseek_v3", n_experts=5)
    report = compare_with_shards(good, model)
    assert report.ok and report.compared == len(_index(good)), report.summary()
    path = _copy(good, tmp_path)
    key = "model.layers.1.mlp.experts.2.down_proj.weight"
    file = _file_of(path, key)
    tensors = load_file(file)
    tensors[key][0, 0] += 1
    save_file(tensors, file, metadata={"format": "pt"})
    problems = compare_with_shards(path, model).problems
    assert problems == [f"tensor '{key}' at offsets (0, 0) differs from the model's shard"]
