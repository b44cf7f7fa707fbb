"""FP8 block-quantized export (docs/design.md#fp8-export), checked against this file's own
quantization of the unsharded model, on whole tensors in plain torch.

The reference states the rules from DeepSeek's ``README_WEIGHTS.md`` and the issue, independently of
the package: 128 x 128 blocks over ``[out, in]``, edge blocks zero-padded for the amax, scale =
amax / 448 in fp32 (1.0 for an all-zero block), ``ue8m0`` = the scale rounded up to a power of two
(here through float64 ``log2``, the package uses the float's exponent), weight = w / scale saturated
to +/-448 as ``float8_e4m3fn``. Which keys: the linear weights of attention and MLP (dense, shared,
routed experts, the MTP layer's blocks), nothing else.

Sharded exports on 4 gloo ranks (one process tree for every case): FSDP with an empty rank (5
experts on 4 ranks), HSDP 2x2, EP=2 x FSDP 2 (fused layout, rows split; AutoModel grouped layout,
columns split). Shapes are not multiples of 128 (hidden 200, expert width 136), so 4 FSDP ranks cut
400-row weights at rows 100, 200, 300, inside blocks; one 128 x 128 block and one edge block are
zero. Each export must equal the reference byte for byte, and load back through our FP8 loader
into a sharded model with every weight equal to the reference dequantized.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from bounds import Bound, check_figure
from nemo_moe_export.spawn import spawn
from checks import assert_serving_config, stored_tensors

SIZES = dict(hidden_size=200, moe_intermediate_size=136, vocab_size=64)
BLOCK = 128
# The list, written here rather than read from the package's tables.
FP8_RULE = re.compile(r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|k_proj|v_proj)"
                      r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$")
CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def reference_fp8(w: torch.Tensor, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole tensor quantized by the rules above."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.nn.functional.pad(w.float(), (0, nc * BLOCK - cols, 0, nr * BLOCK - rows))
    blocks = padded.reshape(nr, BLOCK, nc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale.double()))).float()
    q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).reshape(nr * BLOCK, nc * BLOCK)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * expanded


def mtp_extras() -> dict[str, torch.Tensor]:
    """An MTP layer (``model.layers.{num_hidden_layers}``) handed to the export as extra tensors: its
    attention block is quantized, ``eh_proj`` and its norm are not."""
    g = torch.Generator().manual_seed(7)
    return {"model.layers.2.self_attn.kv_b_proj.weight": torch.randn(400, 16, generator=g).bfloat16(),
            "model.layers.2.eh_proj.weight": torch.randn(200, 400, generator=g).bfloat16(),
            "model.layers.2.enorm.weight": torch.randn(200, generator=g).bfloat16()}


def tiny_bf16(n_experts: int, seed: int = 0, sizes: tuple = ()):
    """The test model, with one whole 128 x 128 block (rows 0-127: FSDP ranks 0 and 1) and one edge
    block of a dense weight set to zero."""
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", n_experts=n_experts, seed=seed, **{**SIZES, **dict(sizes)}).to(torch.bfloat16)
    if seed == 0:
        with torch.no_grad():
            weight = model.model.layers[0].mlp.gate_proj.weight  # [400, 200]
            weight[:128, :128] = 0
            weight[384:, 128:] = 0
    return model


@dataclass(frozen=True)
class Case:
    name: str
    mesh: str  # fsdp | hsdp | ep_fsdp | ep_fsdp_grouped
    n_experts: int
    scale_fmt: str | None
    options: tuple = ()  # extra export options, as (name, value) pairs
    sizes: tuple = ()  # model sizes replacing SIZES', as (name, value) pairs

    @property
    def extras(self) -> bool:
        return self.mesh == "fsdp"


CASES = [
    Case("fsdp-empty-rank", "fsdp", 5, None, (("staging_bytes", 8192),)),
    Case("hsdp", "hsdp", 5, "ue8m0"),
    Case("ep-fsdp-rows-local", "ep_fsdp", 6, None, (("filesystem", "local"), ("writer_ranks", [0]),
                                                    ("staging_bytes", 4096))),
    Case("ep-fsdp-grouped-columns", "ep_fsdp_grouped", 6, "ue8m0"),
    # Whole 128 x 128 blocks in every expert share (the common case at scale: the export's aligned
    # fast paths for the amax and the quantization), FSDP splitting the 3 experts unevenly.
    Case("hsdp-aligned-blocks", "hsdp", 3, None, sizes=(("hidden_size", 256), ("moe_intermediate_size", 128))),
]


def _sharded(case: Case, world: int, seed: int):
    """``(model or None, state dict, config)`` of the case's model, sharded as the case says."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from checks import to_grouped_layout

    model = tiny_bf16(case.n_experts, seed, case.sizes)
    if case.mesh in ("fsdp", "hsdp"):
        dims, names = ((world,), ("dp_shard",)) if case.mesh == "fsdp" else ((2, world // 2), ("dp_replicate", "dp_shard"))
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model.state_dict(), model.config
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "ep_shard"))
    sd = to_grouped_layout(model.state_dict()) if case.mesh == "ep_fsdp_grouped" else {
        k: v.detach() for k, v in model.state_dict().items()}
    sd = {k: distribute_tensor(v, mesh, [Shard(0), Shard(1)]) if ".experts." in k else v for k, v in sd.items()}
    return None, sd, model.config


def _worker(rank, world, cases, workdir):
    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import export_hf_checkpoint

    out = {}
    for case in cases:
        model, sd, config = _sharded(case, world, seed=0)
        target = os.path.join(workdir, case.name)
        result = export_hf_checkpoint(target, model, state_dict=None if model is not None else sd, config=config,
                                      quantize="fp8_block", scale_fmt=case.scale_fmt, max_shard_size="64KB",
                                      timeout_s=60, extra=mtp_extras() if case.extras else None,
                                      **dict(case.options))
        # Load it back into a freshly initialised model sharded the same way (other weights: seed 1).
        _, loaded, config = _sharded(case, world, seed=1)
        adapter = get_adapter(config)
        report = adapter.from_hf(loaded, target)
        pieces = [(k, p.offsets, p.tensor.clone()) for k, p in adapter.to_hf(loaded).items()]
        pieces += [(k, p.offsets, p.tensor.clone()) for k, p in report.passthrough.items()]
        out[case.name] = dict(io=result.io, bytes=result.rank_bytes_written, total=result.checkpoint_bytes,
                              pieces=pieces)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("fp8-export"))
    return workdir, spawn(_worker, 4, CASES, workdir, timeout_s=600)


def _expected(case: Case) -> dict[str, torch.Tensor]:
    """What the export must hold: ``save_pretrained`` of the unsharded model (and the extras), the
    rule's keys quantized by :func:`reference_fp8`."""
    import tempfile

    with tempfile.TemporaryDirectory() as ref:
        tiny_bf16(case.n_experts, sizes=case.sizes).save_pretrained(ref)
        tensors = load_file(os.path.join(ref, "model.safetensors"))
    if case.extras:
        tensors.update(mtp_extras())
    out = {}
    for key, w in tensors.items():
        if FP8_RULE.search(key):
            out[key], out[key + "_scale_inv"] = reference_fp8(w, case.scale_fmt)
        else:
            out[key] = w
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sharded_fp8_export_equals_whole_tensor_quantization_byte_for_byte(case, exported):
    from nemo_moe_export.export import verify_checkpoint

    workdir, per_rank = exported
    path = os.path.join(workdir, case.name)
    expected, stored = _expected(case), stored_tensors(path)
    assert sorted(stored) == sorted(expected)
    assert sum(1 for t in stored.values() if t.dtype == torch.float8_e4m3fn) > 20
    for key, want in expected.items():
        got = stored[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), key
    with open(os.path.join(path, "config.json")) as f:
        declared = json.load(f)["quantization_config"]
    assert declared == {**CONFIG, **({"scale_fmt": case.scale_fmt} if case.scale_fmt else {})}
    # The FP8 door: a causal-LM class, the dtype of the weights not quantized (as DeepSeek's FP8
    # config declares bfloat16), the family's keys (docs/design.md#serving-engines).
    assert_serving_config(path)
    assert verify_checkpoint(path).ok, verify_checkpoint(path).summary()
    # Every byte written once (scales by their one owner each), from the shards.
    results = [r[case.name] for r in per_rank]
    assert sum(r["bytes"] for r in results) == results[0]["total"]
    # The boundary exchange ran: blocks crossing shard boundaries on some rank; the weights were
    # quantized and written in batches on every rank.
    assert sum(r["io"]["boundary_blocks"] for r in results) > 0
    assert all(r["io"]["batches"] >= 1 for r in results)
    if dict(case.options).get("staging_bytes"):
        assert results[0]["io"]["batches"] > 10


def test_zero_blocks_get_scale_one_and_decode_to_zero(exported):
    workdir, _ = exported
    stored = stored_tensors(os.path.join(workdir, CASES[0].name))
    key = "model.layers.0.mlp.gate_proj.weight"
    scale = stored[key + "_scale_inv"]
    assert scale.shape == (4, 2) and scale[0, 0] == 1.0 and scale[3, 1] == 1.0  # the two zero blocks
    assert bool((stored[key][:128, :128].float() == 0).all()) and bool((stored[key][384:, 128:].float() == 0).all())
    assert bool((scale[1:3] != 1.0).all())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fp8_export_loads_back_into_the_sharded_model_as_the_reference_dequantized(case, exported):
    _, per_rank = exported
    expected = _expected(case)
    checked = set()
    for rank, res in enumerate(per_rank):
        for key, offsets, tensor in res[case.name]["pieces"]:
            box = tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))
            if key + "_scale_inv" in expected:
                want = dequantized(expected[key], expected[key + "_scale_inv"])[box]
            else:
                want = expected[key][box].to(torch.float32 if tensor.dtype == torch.float32 else tensor.dtype)
            assert torch.equal(tensor, want.to(tensor.dtype)), f"rank {rank}: {key} at {offsets}"
            checked.add(key)
    assert checked == {k for k in expected if not k.endswith("_scale_inv")}


# --- one process: transformers' own FP8 support, the tables, refusals, verify ---------------------

# Whole blocks everywhere, 6 experts in one process: every expert share is reduced in a run with
# others of its fused tensor (docs/design.md#fp8-export), so a run that put one share's amaxes in
# another's place shows in the bytes. Exact scales, not ue8m0: the power-of-two scales of random
# blocks mostly agree, and would hide such a swap.
RUN_CASE = Case("runs", "one process", 6, None, sizes=(("hidden_size", 256), ("moe_intermediate_size", 128)))


@pytest.mark.parametrize("layout,expert_runs", [("fused", 2), ("grouped", 7)])
def test_expert_shares_reduced_in_runs_equal_the_reference(layout, expert_runs, tmp_path):
    """Fused ``[E, 2I, H]`` / ``[E, H, I]``: gate and up shares interleave at one step (one run),
    down is another. AutoModel's grouped layout (transposed views): gate and up alternate two
    steps, so they pair up (6 runs), and down is one run. Dense weights are their own runs."""
    from checks import to_grouped_layout

    from nemo_moe_export.export import export_hf_checkpoint

    model = tiny_bf16(RUN_CASE.n_experts, sizes=RUN_CASE.sizes)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    result = export_hf_checkpoint(tmp_path / "fp8", state_dict=sd if layout == "fused" else to_grouped_layout(sd),
                                  config=model.config, quantize="fp8_block", scale_fmt=RUN_CASE.scale_fmt)
    expected, stored = _expected(RUN_CASE), stored_tensors(str(tmp_path / "fp8"))
    assert sorted(stored) == sorted(expected)
    for key, want in expected.items():
        assert torch.equal(stored[key].contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), key
    quantized = [k for k, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    experts = [k for k in quantized if ".experts." in k]
    assert len(experts) == 3 * RUN_CASE.n_experts
    assert result.io["amax_runs"] == len(quantized) - len(experts) + expert_runs


# Dims that are multiples of 128 or below it: transformers 5.24's CPU path (dequantize=True) takes
# the block size as rows // scale_rows, which is only right for such shapes (an FP8 loader limit
# of transformers, not of the format: 400 rows in 4 scale rows would be read as blocks of 100).
TF_SIZES = dict(hidden_size=256, moe_intermediate_size=128, vocab_size=128)
# Relative L2 of the logits of transformers' FP8 load against the bf16 model's.
FP8_LOGITS_L2 = Bound(0.15, "e4m3 keeps 3 mantissa bits (2**-4 relative per weight); measured 0.05-0.06 on "
                            "these random models")


@pytest.mark.parametrize("family,scale_fmt", [("deepseek_v3", None), ("qwen3_moe", "ue8m0")])
def test_fp8_export_loads_in_transformers_with_the_reference_weights(family, scale_fmt, tmp_path):
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model(family, **TF_SIZES).to(torch.bfloat16)
    export_hf_checkpoint(tmp_path / "fp8", model, quantize="fp8_block", scale_fmt=scale_fmt)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16,
                                                        output_loading_info=True)
    assert not any(info.values()), info
    stored, weights = stored_tensors(str(tmp_path / "fp8")), loaded.state_dict()
    ours = {k[: -len("_scale_inv")] for k in stored if k.endswith("_scale_inv")}
    assert ours and all(stored[k].dtype == torch.float8_e4m3fn for k in ours)
    for key in ours & set(weights):  # per-expert keys are fused in memory; the dense ones compare directly
        assert torch.equal(weights[key], dequantized(stored[key], stored[key + "_scale_inv"]).to(torch.bfloat16)), key
    ids = torch.randint(3, 120, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(ids).logits.float(), loaded(ids).logits.float()
    rel = float((got - want).norm() / want.norm())
    print(f"{family} {scale_fmt}: logits of transformers' FP8 load vs the bf16 model, relative L2 {rel:.4f}")
    check_figure(rel, FP8_LOGITS_L2, f"{family} {scale_fmt}: FP8 load vs bf16, relative L2")


def _transformers_fp8_keys(model, adapter) -> set[str]:
    """The HF keys whose in-memory tensors transformers' FP8 integration turns into FP8 layers (its
    own module selection, with its own default exclusions)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, replace_with_fp8_linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config())
    skip = quantizer.get_modules_to_not_convert(model, None, model._keep_in_fp32_modules)
    sources = adapter.hf_source_keys(model.state_dict())
    replace_with_fp8_linear(model, modules_to_not_convert=skip, quantization_config=quantizer.quantization_config,
                            pre_quantized=True)
    converted = {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))
                 for p in ("weight", "gate_up_proj", "down_proj")}
    return {hf for hf, source in sources.items() if source in converted}


@pytest.mark.parametrize("family,overrides", [("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": 16}),
                                              ("qwen3_moe", {})])
def test_the_tables_quantize_what_transformers_fp8_converts(family, overrides):
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import ExportOptions, plan_export
    from nemo_moe_export.export.quantize import quantized_keys
    from nemo_moe_export.tiny_models import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    adapter = get_adapter(model.config)
    plan = plan_export(adapter.hf_metadata(model.state_dict()))
    ours = quantized_keys(plan, adapter, ExportOptions(quantize="fp8_block"))
    assert ours == _transformers_fp8_keys(model, adapter)
    assert ours == {k for k in plan.tensors if FP8_RULE.search(k)}  # and the list


def test_bad_fp8_inputs_are_refused_before_anything_is_written(tmp_path):
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.export import ExportOptions, export_hf_checkpoint
    from nemo_moe_export.parallel import PeerError
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", n_experts=4)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 5, 3] = float("nan")
    with pytest.raises(PeerError, match=r"NaN or inf \(key 'model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight'"):
        export_hf_checkpoint(tmp_path / "nan", model, quantize="fp8_block")
    kimi = tiny_model("kimi_linear", n_experts=4)
    with pytest.raises(PeerError, match=r"declares no FP8 weights \(key 'kimi_linear'.*quantize_keys"):
        export_hf_checkpoint(tmp_path / "kimi", kimi, quantize="fp8_block")
    with pytest.raises(PeerError, match=r"only 2-D floating weights.*input_layernorm"):
        export_hf_checkpoint(tmp_path / "norm", kimi, quantize="fp8_block", quantize_keys=[r"layernorm"])
    assert os.listdir(tmp_path) == []
    for bad in (dict(quantize="fp8"), dict(scale_fmt="ue8m0"), dict(quantize="fp8_block", scale_fmt="e8m0"),
                dict(quantize="fp8_block", quantize_keys="experts")):
        with pytest.raises(InputError):
            ExportOptions(**bad)
    # Given regexes replace the table's list; keep_dtype keys are never quantized.
    result = export_hf_checkpoint(tmp_path / "kimi", kimi, quantize="fp8_block", quantize_keys=[r"\.experts\.\d+\."],
                                  keep_dtype=[r"\.w2\."])
    stored = stored_tensors(str(tmp_path / "kimi"))
    quantized = sorted(k for k, t in stored.items() if t.dtype == torch.float8_e4m3fn)
    assert quantized and all(re.search(r"\.experts\.\d+\.w[13]\.weight$", k) for k in quantized)
    assert result.tensors == len(stored)


def _rewrite(path, change=None, config=None):
    """Rewrite the checkpoint's one file with ``change(tensors)`` applied, and/or its config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = next(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if change is not None:
        with safe_open(os.path.join(path, name), "pt") as f:
            metadata = f.metadata()  # kept: verify also checks what the export wrote there
        tensors = load_file(os.path.join(path, name))
        change(tensors)
        save_file(tensors, os.path.join(path, name), metadata=metadata)
    if config is not None:
        with open(os.path.join(path, "config.json")) as f:
            data = json.load(f)
        config(data)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(data, f)


def test_verify_checks_fp8_structure_and_serving(tmp_path, capsys):
    import shutil

    from nemo_moe_export.cli import verify_main
    from nemo_moe_export.export import export_hf_checkpoint, verify_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    # Expert width 256: 128 per shard at tp=2, 64 at tp=4 (what vLLM refuses); an MTP layer beside.
    model = tiny_model("deepseek_v3", hidden_size=256, moe_intermediate_size=256, vocab_size=128,
                       num_nextn_predict_layers=1).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    mtp = {f"model.layers.2.{m}.weight": torch.randn(*s, generator=g).bfloat16()
           for m, s in (("enorm", (256,)), ("hnorm", (256,)), ("eh_proj", (256, 512)))}
    good = tmp_path / "good"
    export_hf_checkpoint(good, model, quantize="fp8_block", extra=mtp)
    assert verify_checkpoint(good, tp=[1, 2]).ok, verify_checkpoint(good, tp=[1, 2]).summary()
    assert verify_main([str(good), "--tp", "1,2,4"]) == 1
    lines = capsys.readouterr().out.splitlines()
    experts = [l for l in lines if ".experts.N." in l]
    assert experts and all(l.lstrip("- ").startswith("tp=4:") and "shards 64 wide" in l for l in experts), lines
    assert not any("MTP" in l for l in lines)
    key = "model.layers.1.mlp.experts.3.up_proj.weight"

    def broken(name, change=None, config=None):
        path = tmp_path / name
        shutil.copytree(good, path)
        _rewrite(path, change, config)
        return verify_checkpoint(path).problems

    assert broken("shape", lambda t: t.__setitem__(key + "_scale_inv", torch.ones(3, 2))) == [
        f"scale '{key}_scale_inv' has shape [3, 2], expected [2, 2] for weight [256, 256] in [128, 128] blocks"]
    assert broken("dtype", lambda t: t.__setitem__(key + "_scale_inv", t[key + "_scale_inv"].half())) == [
        f"scale '{key}_scale_inv' is F16, expected one of ['F32', 'BF16']"]
    assert f"FP8 weight '{key}' has no '{key}_scale_inv'" in broken("noscale", lambda t: t.pop(key + "_scale_inv"))
    no_config = broken("noconfig", config=lambda c: c.pop("quantization_config"))
    assert len(no_config) == 1 and "declares no quantization_config" in no_config[0]
    assert broken("mtp", lambda t: t.pop("model.layers.2.hnorm.weight")) != []  # the index names it too
    mtp_missing = verify_checkpoint(tmp_path / "mtp", tp=[1]).problems
    assert any("num_nextn_predict_layers=1, but the MTP layer model.layers.2.* lacks ['hnorm.weight']" in p
               for p in mtp_missing)


def test_block_scales_are_the_correctly_rounded_division_by_448():
    """``amax / 448`` exactly as IEEE fp32 division rounds it (float64 division rounded once to
    fp32 gives the same value), not a multiplication by the reciprocal, which CUDA substitutes for
    a division by a Python scalar and which is an ulp off for about half of all values."""
    from nemo_moe_export.adapters.fp8 import block_scales

    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 8
    want = (amax.double() / 448).float()
    assert torch.equal(block_scales(amax), want)
    assert not torch.equal(amax * (1 / 448), want)  # the substitute this guards against differs
