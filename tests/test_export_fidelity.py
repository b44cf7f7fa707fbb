"""What is written is what was trained (issue 13), on 4 real gloo ranks with real ``fully_shard``,
real expert parallelism and real transformers models.

* Casting like transformers: a bf16 export of an fp32 model equals ``save_pretrained`` of the same
  weights loaded by transformers in bf16 (``from_pretrained(..., dtype=torch.bfloat16)``), dtype
  and value, tensor for tensor: the router weights and biases stay float32.
* Replica agreement: one rank's copy perturbed by 1e-3 (an FSDP2 buffer, an HSDP-replicated
  parameter, an expert replica under EP=2 x expert-DP=2) is refused before any file exists,
  naming the key and the ranks; ``replica_mismatch="mean"`` writes the replicas' mean.
* Replicas share the writing: on FSDP, HSDP 2x2, EP=2 x expert-DP=2 and EP x FSDP the ranks'
  bytes add up to the checkpoint's, and replicas write within 20% of each other.
* Pass-through: a DeepSeek-V3 checkpoint with an MTP layer loads into a sharded model (each rank
  holding a slice of every MTP tensor) and exports with every MTP tensor bit-equal and indexed.

Everything runs in one 4-rank spawn; the parent builds the references with transformers.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from checks import assert_serving_config
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nemo_moe_export.spawn import spawn

CAST_FAMILIES = ("deepseek_v3", "kimi_linear", "qwen3_moe")
MESHES = ("fsdp", "hsdp", "ep", "ep_fsdp")  # recipe strategies: ep = EP=2 x expert-DP=2 on 4 ranks
N_EXPERTS = 8
# Which tensor each mesh perturbs on one rank, and the rank: an FSDP2 buffer (plain on every rank),
# an HSDP-replicated parameter, an expert replica under EP=2 x expert-DP=2.
PERTURB = {
    "fsdp": ("model.layers.1.mlp.gate.e_score_correction_bias", 1),
    "hsdp": ("model.embed_tokens.weight", 2),
    "ep": ("model.layers.1.mlp.experts.gate_up_proj", 3),
}
MTP_LAYER = 2  # num_hidden_layers of the tiny model: the MTP layer's index


def _fsdp(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _replica_copies(local, ranks):
    """Every rank's copy of ``local`` (an all-gather over the world), keeping the ``ranks``' ones."""
    import torch.distributed as dist

    copies = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, local.contiguous())
    return [copies[r] for r in ranks]


def _refusal(call):
    from nemo_moe_export.errors import InputError

    try:
        call()
    except InputError as exc:
        return dict(problem=exc.problem, key=exc.key, expected=exc.expected, actual=exc.actual, hint=exc.hint)
    return None


def _perturbed_exports(rank, world, model, mesh, workdir):
    """One rank's copy off by 1e-3: refused (nothing written), then written as the mean."""
    import torch.distributed as dist

    from nemo_moe_export.export import export_hf_checkpoint

    key, bad_rank = PERTURB[mesh]
    tensor = model.state_dict()[key]
    local = _local(tensor)
    saved = local.detach().clone()
    with torch.no_grad():
        if rank == bad_rank:
            local.view(-1)[0] += 1e-3
    group = {"fsdp": list(range(world)), "hsdp": [rank % 2, rank % 2 + 2], "ep": [rank % 2, rank % 2 + 2]}[mesh]
    copies = _replica_copies(local.detach(), group)
    expected = torch.stack(copies).double().mean(0).to(local.dtype)
    target = os.path.join(workdir, f"perturbed-{mesh}")
    refused = _refusal(lambda: export_hf_checkpoint(target, model, max_shard_size="16KB", timeout_s=60))
    dist.barrier()
    left = sorted(n for n in os.listdir(workdir) if f"perturbed-{mesh}" in n)
    mean = export_hf_checkpoint(target + "-mean", model, max_shard_size="16KB", timeout_s=60, replica_mismatch="mean")
    chosen = None
    if mesh == "fsdp":  # a named rank's copy instead of the mean
        export_hf_checkpoint(target + "-rank", model, max_shard_size="16KB", timeout_s=60,
                             replica_mismatch=f"rank:{bad_rank}")
        chosen = copies[group.index(bad_rank)]
    with torch.no_grad():
        local.copy_(saved)
    offsets = _offsets(tensor)
    return dict(refused=refused, left_after_refusal=left, reconciled=mean.reconciled, expected=expected,
                offsets=offsets, group=group, chosen=chosen)


def _offsets(tensor):
    from nemo_moe_export.placement import local_box

    return local_box(tensor).offsets


def _mesh_exports(rank, world, workdir):
    from nemo_moe_export.config import ParallelConfig
    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.job.trainer import shard_model
    from nemo_moe_export.tiny_models import tiny_model

    out = {}
    for mesh in MESHES:
        model = tiny_model("deepseek_v3", n_experts=N_EXPERTS, seed=0)
        cfg = ParallelConfig(strategy=mesh, ep_size=2 if mesh.startswith("ep") else 1,
                             replicate=2 if mesh == "hsdp" else 1, timeout_s=60)
        model, _ = shard_model(model, cfg)
        result = export_hf_checkpoint(os.path.join(workdir, f"mesh-{mesh}"), model, max_shard_size="16KB",
                                      timeout_s=60)
        out[mesh] = dict(result=result)
        if mesh in PERTURB:
            out[mesh].update(_perturbed_exports(rank, world, model, mesh, workdir))
    return out


def _cast_exports(rank, world, workdir):
    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    out = {}
    for family in CAST_FAMILIES:
        model = _fsdp(tiny_model(family, n_experts=5, seed=0), world)
        out[family] = export_hf_checkpoint(os.path.join(workdir, f"cast-{family}"), model, dtype="bfloat16",
                                           max_shard_size="16KB", timeout_s=60)
    return out


def _mtp_export(rank, world, workdir):
    """Load the MTP checkpoint into a 4-rank FSDP model, export it with the adapter that loaded it."""
    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    model = _fsdp(tiny_model("deepseek_v3", n_experts=4, num_nextn_predict_layers=1, seed=7), world)
    adapter = get_adapter(model.config)
    report = adapter.from_hf(model.state_dict(), os.path.join(workdir, "mtp-checkpoint"))
    held = {k: (tuple(p.tensor.shape), p.tensor.numel() * p.tensor.element_size()) for k, p in report.passthrough.items()}
    result = export_hf_checkpoint(os.path.join(workdir, "mtp-export"), model, adapter=adapter,
                                  max_shard_size="16KB", timeout_s=60)
    # The opt-out, and a framework's own tensor (plain, on every rank) handed beside the model.
    framework = {"mtp.framework_state": torch.arange(40, dtype=torch.float32).reshape(10, 4)}
    # Opting out while config.json would still declare the MTP layer is refused before any file exists;
    # with the config saying 0 MTP layers, the checkpoint is consistent and written.
    try:
        export_hf_checkpoint(os.path.join(workdir, "mtp-contradiction"), model, adapter=adapter,
                             passthrough=False, timeout_s=60)
        contradiction = None
    except Exception as exc:
        contradiction = f"{type(exc).__name__}: {exc}"
    no_mtp = copy.deepcopy(model.config)
    no_mtp.num_nextn_predict_layers = 0
    opted_out = export_hf_checkpoint(os.path.join(workdir, "mtp-optout"), model, adapter=adapter, config=no_mtp,
                                     passthrough=False, extra=framework, timeout_s=60)
    return dict(held=held, keys=sorted(report.passthrough), result=result, opted_out=opted_out,
                contradiction=contradiction, contradiction_written=os.path.exists(os.path.join(workdir, "mtp-contradiction")))


def _worker(rank, world, workdir):
    return dict(cast=_cast_exports(rank, world, workdir), meshes=_mesh_exports(rank, world, workdir),
                mtp=_mtp_export(rank, world, workdir))


def _mtp_tensors():
    """The MTP layer as an official checkpoint stores it: its own norms and projections (some in
    bf16) and a full MoE decoder block (taken from a 3-layer model's layer 2)."""
    import tempfile

    from nemo_moe_export.tiny_models import tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tiny_model("deepseek_v3", n_experts=4, num_layers=3, seed=3).save_pretrained(tmp)
        donor = load_file(os.path.join(tmp, "model.safetensors"))
    prefix = f"model.layers.{MTP_LAYER}."
    tensors = {k: v for k, v in donor.items() if k.startswith(prefix)}
    g = torch.Generator().manual_seed(11)
    tensors.update({
        prefix + "enorm.weight": torch.randn(32, generator=g),
        prefix + "hnorm.weight": torch.randn(32, generator=g),
        prefix + "eh_proj.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16),
        prefix + "shared_head.norm.weight": torch.randn(32, generator=g),
        prefix + "shared_head.head.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
    })
    return tensors


def _write_mtp_checkpoint(path):
    from nemo_moe_export.tiny_models import tiny_model

    tiny_model("deepseek_v3", n_experts=4, num_nextn_predict_layers=1, seed=0).save_pretrained(path)
    tensors = {**load_file(os.path.join(path, "model.safetensors")), **_mtp_tensors()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("fidelity"))
    _write_mtp_checkpoint(os.path.join(workdir, "mtp-checkpoint"))
    return workdir, spawn(_worker, 4, workdir, timeout_s=600)


def _read(path):
    """Every tensor of the checkpoint in ``path``."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


# --- casting like transformers -----------------------------------------------------------------


@pytest.mark.parametrize("family", CAST_FAMILIES)
def test_bf16_export_equals_transformers_bf16_save_pretrained(family, run, tmp_path):
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.export import verify_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    workdir, _ = run
    tiny_model(family, n_experts=5, seed=0).save_pretrained(tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    report = verify_checkpoint(os.path.join(workdir, f"cast-{family}"), reference=str(tmp_path / "bf16"))
    assert report.ok and report.compared == report.tensors, report.summary()
    # config.json as save_pretrained writes it, the causal-LM class and the files' dtype included
    # (docs/design.md#serving-engines): the sharded FSDP2 door.
    assert_serving_config(os.path.join(workdir, f"cast-{family}"), str(tmp_path / "bf16"))
    kept = {k for k, v in _read(str(tmp_path / "bf16")).items() if v.dtype == torch.float32}
    if family == "qwen3_moe":
        assert not kept  # a family that keeps nothing in fp32: the plain cast
    else:
        assert any(k.endswith("gate.e_score_correction_bias") for k in kept)
        assert any(k.endswith("gate.weight") for k in kept), kept
        assert family != "kimi_linear" or any(k.endswith("dt_bias") for k in kept), kept


# --- replica agreement ---------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", sorted(PERTURB))
def test_perturbed_replica_is_refused_before_any_file_then_reconciled_as_the_mean(mesh, run):
    workdir, per_rank = run
    key, bad_rank = PERTURB[mesh]
    outcomes = [r["meshes"][mesh] for r in per_rank]
    refusals = [o["refused"] for o in outcomes]
    assert refusals[0] is not None and all(r == refusals[0] for r in refusals), refusals  # same everywhere
    refusal = refusals[0]
    assert refusal["key"] == key and "differ between their replicas" in refusal["problem"], refusal
    group = outcomes[bad_rank]["group"]
    others = [r for r in group if r != bad_rank]
    assert f"ranks {others}" in refusal["actual"] and f"ranks [{bad_rank}]" in refusal["actual"], refusal
    assert "max |difference| 0.001" in refusal["actual"], refusal
    assert "replica_mismatch='mean'" in refusal["hint"]
    assert all(o["left_after_refusal"] == [] for o in outcomes), "a refused export must leave nothing"

    reconciled = outcomes[0]["reconciled"]
    assert [r["key"] for r in reconciled] == [key] and reconciled[0]["policy"] == "mean", reconciled
    assert abs(reconciled[0]["max_abs_diff"] - 1e-3) < 1e-4  # the planted 1e-3, read back in fp32 (ulp 1e-7)
    written = _read(os.path.join(workdir, f"perturbed-{mesh}-mean"))
    for o in outcomes:  # every rank's box holds the mean of its replicas' copies
        expected = o["expected"]
        if mesh == "ep":  # per-expert HF tensors: this rank's first expert's gate rows
            expert, inter = o["offsets"][0], expected.shape[1] // 2
            got = written[f"model.layers.1.mlp.experts.{expert}.gate_proj.weight"]
            assert torch.equal(got, expected[0, :inter]), o["offsets"]
        else:
            box = tuple(slice(s, s + n) for s, n in zip(o["offsets"], expected.shape))
            assert torch.equal(written[key][box], expected), o["offsets"]


def test_a_named_ranks_copy_can_be_written_instead(run):
    workdir, per_rank = run
    key, bad_rank = PERTURB["fsdp"]
    written = _read(os.path.join(workdir, "perturbed-fsdp-rank"))[key]
    chosen = per_rank[0]["meshes"]["fsdp"]["chosen"]
    assert torch.equal(written, chosen)
    assert not torch.equal(written, per_rank[0]["meshes"]["fsdp"]["expected"])  # not the mean


def test_unperturbed_exports_pass_the_check_and_report_its_time(run):
    _, per_rank = run
    for r in per_rank:
        for mesh in MESHES:
            result = r["meshes"][mesh]["result"]
            assert result.reconciled == [] and result.replica_check["tensors"] > 0, (mesh, result.replica_check)
            assert 0 < result.replica_seconds < result.seconds


# --- replicas share the writing ------------------------------------------------------------------


def _replica_pairs(mesh):
    """Ranks holding the same boxes: HSDP replicas and EP expert-DP replicas are ``r`` and ``r + 2``."""
    return [(0, 2), (1, 3)] if mesh in ("hsdp", "ep") else []


@pytest.mark.parametrize("mesh", MESHES)
def test_every_holder_writes_a_share_and_each_byte_once(mesh, run, tmp_path):
    from nemo_moe_export.export import verify_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    workdir, per_rank = run
    results = [r["meshes"][mesh]["result"] for r in per_rank]
    written = [r.rank_bytes_written for r in results]
    assert sum(written) == results[0].checkpoint_bytes, written
    for a, b in _replica_pairs(mesh):
        assert min(written[a], written[b]) >= 0.8 * max(written[a], written[b]), (mesh, written)
    tiny_model("deepseek_v3", n_experts=N_EXPERTS, seed=0).save_pretrained(tmp_path)
    report = verify_checkpoint(os.path.join(workdir, f"mesh-{mesh}"), reference=str(tmp_path))
    assert report.ok and report.compared == report.tensors, report.summary()


# --- pass-through tensors ------------------------------------------------------------------------


def test_mtp_layer_is_kept_sliced_and_written_back_bit_exact(run):
    from nemo_moe_export.export import verify_checkpoint

    workdir, per_rank = run
    mtp = _mtp_tensors()
    source = os.path.join(workdir, "mtp-checkpoint")
    exported = os.path.join(workdir, "mtp-export")
    for r in per_rank:
        assert r["mtp"]["keys"] == sorted(mtp), "the load report lists every pass-through key"
        assert sorted(r["mtp"]["result"].passthrough_keys) == sorted(mtp)
    total = sum(v.numel() * v.element_size() for v in mtp.values())
    for key, value in mtp.items():  # every rank holds a slice; none holds a whole tensor
        rows = [r["mtp"]["held"][key][0][0] for r in per_rank]
        assert sum(rows) == value.shape[0] and max(rows) < value.shape[0], (key, rows)
    assert all(sum(n for _, n in r["mtp"]["held"].values()) < total for r in per_rank)

    report = verify_checkpoint(exported, reference=source)  # every tensor, MTP included: dtype and value
    assert report.ok and report.compared == report.tensors, report.summary()
    written = _read(exported)
    for key, value in mtp.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key
    weight_map = json.loads(open(os.path.join(exported, "model.safetensors.index.json")).read())["weight_map"]
    assert set(mtp) <= set(weight_map)
    assert json.loads(open(os.path.join(exported, "config.json")).read())["num_nextn_predict_layers"] == 1


def test_passthrough_opt_out_and_framework_extra_tensors(run):
    workdir, per_rank = run
    written = _read(os.path.join(workdir, "mtp-optout"))
    assert not any(k.startswith(f"model.layers.{MTP_LAYER}.") for k in written)
    assert torch.equal(written["mtp.framework_state"], torch.arange(40, dtype=torch.float32).reshape(10, 4))
    assert per_rank[0]["mtp"]["opted_out"].passthrough_keys == ["mtp.framework_state"]
    assert json.loads(open(os.path.join(workdir, "mtp-optout", "config.json")).read())["num_nextn_predict_layers"] == 0


def test_a_config_declaring_mtp_layers_the_export_lacks_is_refused_before_writing(run):
    _, per_rank = run
    for r in per_rank:
        message = r["mtp"]["contradiction"]
        assert message is not None and "multi-token-prediction" in message, message
        assert f"model.layers.{MTP_LAYER}.*" in message and "num_nextn_predict_layers = 0" in message, message
        assert not r["mtp"]["contradiction_written"]
