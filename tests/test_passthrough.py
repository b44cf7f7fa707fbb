"""Pass-through tensors in one process: what ``from_hf`` keeps, refuses and dequantizes, and what
the export refuses to take (docs/design.md#pass-through-tensors). The 4-rank round trip of an MTP
layer is in ``test_export_fidelity.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_moe_export.adapters import get_adapter
from nemo_moe_export.adapters.fp8 import quantize_block_fp8
from nemo_moe_export.errors import InputError
from nemo_moe_export.export import export_hf_checkpoint
from nemo_moe_export.parallel import PeerError
from nemo_moe_export.tiny_models import tiny_model

EXTRA = {
    "model.layers.2.eh_proj.weight": torch.arange(64 * 32, dtype=torch.float32).reshape(32, 64).to(torch.bfloat16),
    "model.layers.2.enorm.weight": torch.linspace(0, 1, 32),
    "model.layers.2.hnorm.weight": torch.linspace(1, 2, 32),
    "mtp.step": torch.tensor(7, dtype=torch.int64),  # any other extra key, 0-dim included
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tiny_model("deepseek_v3", n_experts=4, num_nextn_predict_layers=1).save_pretrained(path)
    tensors = {**load_file(path / "model.safetensors"), **EXTRA}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _target():
    model = tiny_model("deepseek_v3", n_experts=4, num_nextn_predict_layers=1, seed=5)
    return model, get_adapter(model.config)


def test_extra_keys_are_kept_whole_in_one_process_and_written_back(checkpoint, tmp_path):
    model, adapter = _target()
    report = adapter.from_hf(model.state_dict(), checkpoint)
    assert sorted(report.passthrough) == sorted(EXTRA) and adapter.passthrough is report.passthrough
    assert report.passthrough_bytes_read == sum(t.numel() * t.element_size() for t in EXTRA.values())
    result = export_hf_checkpoint(tmp_path / "out", model, adapter=adapter, dtype="bfloat16")
    assert result.passthrough_keys == sorted(EXTRA)
    written = {k: v for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")
               for k, v in load_file(tmp_path / "out" / f).items()}
    for key, value in EXTRA.items():  # their own dtype, never cast by dtype=
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key


def test_opting_out_restores_the_strict_refusal(checkpoint):
    model, adapter = _target()
    with pytest.raises(InputError, match=r"4 checkpoint keys have no place in the model"):
        adapter.from_hf(model.state_dict(), checkpoint, passthrough=False)
    report = adapter.from_hf(model.state_dict(), checkpoint, passthrough=False, strict=False)
    assert report.passthrough == {} and adapter.passthrough == {}


def test_fp8_extra_weights_are_dequantized_like_the_model(checkpoint, tmp_path):
    """An FP8 block-quantized checkpoint stores MTP projections in FP8 with scales: they are kept
    dequantized (float32, the exact products), and their scales are not separate tensors."""
    tensors = load_file(checkpoint / "model.safetensors")
    weight = tensors.pop("model.layers.2.eh_proj.weight").float()
    q, scale = quantize_block_fp8(weight, (16, 16))
    tensors.update({"model.layers.2.eh_proj.weight": q, "model.layers.2.eh_proj.weight_scale_inv": scale})
    os.makedirs(tmp_path / "fp8")
    save_file(tensors, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    model, adapter = _target()
    report = adapter.from_hf(model.state_dict(), tmp_path / "fp8", allow_dtype_cast=True)
    kept = report.passthrough["model.layers.2.eh_proj.weight"].tensor
    expected = q.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[:32, :64]
    assert kept.dtype == torch.float32 and torch.equal(kept, expected)
    assert "model.layers.2.eh_proj.weight_scale_inv" not in report.passthrough


@pytest.mark.parametrize("extra,pattern", [
    ({"model.norm.weight": torch.ones(32)}, "an extra tensor has the name of a model tensor"),
    ({"mtp.thing": [1.0, 2.0]}, "extra tensors must be tensors, DTensors or HFShards"),
])
def test_extra_tensors_that_cannot_be_written_are_refused_before_any_file(extra, pattern, tmp_path):
    model = tiny_model("qwen3_moe", n_experts=4)
    with pytest.raises(PeerError, match=pattern):
        export_hf_checkpoint(tmp_path / "out", model, extra=extra)
    assert os.listdir(tmp_path) == []


def test_an_export_that_would_drop_the_declared_mtp_layer_is_refused_before_writing(checkpoint, tmp_path):
    """As users hit it: ``from_hf`` keeps the MTP layer in its adapter, then ``export_hf_checkpoint(out,
    model)`` without that adapter would write a config declaring an MTP layer and no MTP tensor. It is
    refused before any file exists, naming the layer and the ways out; an incomplete layer likewise."""
    model, adapter = _target()
    adapter.from_hf(model.state_dict(), checkpoint)
    with pytest.raises(PeerError, match=r"model\.layers\.2\.\*.*no tensor of it.*export with that adapter \(adapter=\)"
                                        r".*num_nextn_predict_layers = 0"):
        export_hf_checkpoint(tmp_path / "dropped", model)
    partial = {k: p for k, p in adapter.passthrough.items() if "hnorm" not in k}
    with pytest.raises(PeerError, match=r"lacks \['hnorm.weight'\].*incomplete layer"):
        export_hf_checkpoint(tmp_path / "partial", model, extra=partial)
    assert not os.listdir(tmp_path)
    export_hf_checkpoint(tmp_path / "kept", model, adapter=adapter)  # the loading adapter holds it: written
    written = {k for f in os.listdir(tmp_path / "kept") if f.endswith(".safetensors")
               for k in load_file(tmp_path / "kept" / f)}
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight"} <= written
