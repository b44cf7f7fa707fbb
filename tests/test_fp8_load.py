"""Loading official-format FP8 block-quantized DeepSeek-V3 checkpoints into sharded bf16 models.

The test quantizes a random tiny model itself (block size 32 over dims 48 and 40, so partial blocks
occur and FSDP slices start inside blocks), then loads it on 4 gloo ranks with uneven experts
(FSDP and HSDP 2x2). Every parameter must equal the checkpoint dequantized independently in one
process with the same arithmetic, bit for bit.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_moe_export.adapters.fp8 import quantize_block_fp8
from nemo_moe_export.errors import InputError
from nemo_moe_export.spawn import spawn
from nemo_moe_export.tiny_models import tiny_model

BLOCK = (32, 32)
SIZES = dict(n_experts=5, hidden_size=48, moe_intermediate_size=40)


def _expand(scale, shape):
    return scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[: shape[0], : shape[1]]


def _quantized(key, tensor):
    """Which weights the official checkpoints keep in FP8: 2-D projections, not embeddings,
    lm_head or the router."""
    return tensor.dim() == 2 and not any(s in key for s in ("embed_tokens", "lm_head", "mlp.gate.weight"))


def write_fp8_checkpoint(path):
    """Block-quantize a tiny DeepSeek-V3 as the official checkpoints are stored; return the reference
    (every HF key dequantized in one process)."""
    model = tiny_model("deepseek_v3", **SIZES).to(torch.bfloat16)
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    stored, reference = {}, {}
    for key, w in tensors.items():
        if not _quantized(key, w):
            stored[key] = reference[key] = w
            continue
        q, scale_inv = quantize_block_fp8(w, BLOCK)
        assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (math.ceil(w.shape[0] / BLOCK[0]),
                                                                       math.ceil(w.shape[1] / BLOCK[1]))
        stored[key], stored[key + "_scale_inv"] = q, scale_inv
        # The reference: dequantized here, whole tensor at once, independently of the loader.
        reference[key] = (q.float() * _expand(scale_inv, w.shape)).to(torch.bfloat16)
    os.remove(os.path.join(path, "model.safetensors"))
    save_file(stored, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return reference


def _load_worker(rank, world, path, mesh_kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nemo_moe_export.adapters import get_adapter

    model = tiny_model("deepseek_v3", seed=1, **SIZES).to(torch.bfloat16)
    dims, names = ((world,), ("dp_shard",)) if mesh_kind == "fsdp" else ((2, world // 2), ("dp_replicate", "dp_shard"))
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    adapter = get_adapter(model.config)
    report = adapter.from_hf(model.state_dict(), path)
    pieces = [(k, p.offsets, p.tensor.clone()) for k, p in adapter.to_hf(model.state_dict()).items()]
    return dict(pieces=pieces, bytes=report.bytes_read, expert_bytes=report.expert_bytes_read)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fp8"))
    return path, write_fp8_checkpoint(path)


@pytest.mark.parametrize("mesh_kind", ["fsdp", "hsdp"])
def test_fp8_checkpoint_loads_exactly_into_sharded_bf16(fp8_checkpoint, mesh_kind):
    path, reference = fp8_checkpoint
    results = spawn(_load_worker, 4, path, mesh_kind, timeout_s=300)
    checked = set()
    for res in results:
        for key, offsets, tensor in res["pieces"]:
            box = tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, reference[key][box]), f"{key} at {offsets}"
            checked.add(key)
    assert checked == set(reference)
    # Bytes read: each rank its torch.chunk share of the experts (FP8 weights plus their scales).
    stored = load_file(os.path.join(path, "model.safetensors"))
    per_expert = sum(t.numel() * t.element_size() for k, t in stored.items() if ".experts.0." in k)
    shards = 4 if mesh_kind == "fsdp" else 2
    chunks = [len(c) for c in torch.chunk(torch.arange(SIZES["n_experts"]), shards)] + [0] * shards
    for rank, res in enumerate(results):
        assert res["expert_bytes"] == chunks[rank % shards] * per_expert
    total = sum(t.numel() * t.element_size() for t in stored.values())
    assert max(r["bytes"] for r in results) < total / (shards - 1)


def test_fp8_errors_name_key_and_shapes(fp8_checkpoint, tmp_path):
    from nemo_moe_export.adapters import get_adapter

    path, _ = fp8_checkpoint
    stored = load_file(os.path.join(path, "model.safetensors"))
    config = json.loads(open(os.path.join(path, "config.json")).read())
    model = tiny_model("deepseek_v3", **SIZES).to(torch.bfloat16)
    adapter = get_adapter(model.config)
    key = "model.layers.1.mlp.experts.2.down_proj.weight"

    def broken(name, tensors, cfg=config):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    no_scale = {k: v for k, v in stored.items() if k != key + "_scale_inv"}
    with pytest.raises(InputError, match=rf"FP8 weight without its scale \(key '{key}'"):
        adapter.from_hf(model.state_dict(), broken("noscale", no_scale))
    bad_scale = dict(stored, **{key + "_scale_inv": torch.ones(3, 3)})
    with pytest.raises(InputError, match=r"scale has the wrong shape.*expected \(2, 2\) for weight \(48, 40\).*got \(3, 3\)"):
        adapter.from_hf(model.state_dict(), broken("badscale", bad_scale))
    odd_block = dict(config, quantization_config=dict(config["quantization_config"], weight_block_size=[128]))
    with pytest.raises(InputError, match="unsupported FP8 block size"):
        adapter.from_hf(model.state_dict(), broken("block", stored, odd_block))
    other = dict(config, quantization_config={"quant_method": "gptq"})
    with pytest.raises(InputError, match="unsupported quantization method"):
        adapter.from_hf(model.state_dict(), broken("gptq", stored, other))
