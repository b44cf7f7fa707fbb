"""The no-gather export of a model split into pipeline stages, on 4 real gloo ranks.

Each case splits a tiny model into stages the AutoModel/torchtitan way (each stage a copy keeping
only its layers, under their original names: ``nemo_moe_export.pipeline.split_stages``), gives each
rank its stages (several with virtual stages, "loop" order), shards them for real inside the stage
(FSDP2 over the "dp" mesh dim, or expert parallelism over "ep") and exports the rank's stage modules.
The parent loads the checkpoint with ``from_pretrained`` (no missing or unexpected keys), compares
every tensor, dtype and value, with ``save_pretrained`` of the unsplit model, checks the index lists
every key and that the ranks' writes add up to the checkpoint's bytes (each byte written once).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
from checks import assert_serving_config
import torch

from nemo_moe_export.spawn import spawn

INPUT = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(3))


@dataclass(frozen=True)
class Case:
    family: str
    mesh: str  # pp_fsdp | pp_ep
    n_experts: int = 5
    layers: int = 4
    stages_per_rank: int = 1  # virtual stages
    split: tuple[int, ...] | None = None  # layers per stage (uneven); default even
    dtype: str | None = None

    @property
    def name(self) -> str:
        split = "-split" + "".join(map(str, self.split)) if self.split else ""
        dtype = f"-{self.dtype}" if self.dtype else ""
        return f"{self.family}-{self.mesh}-v{self.stages_per_rank}{split}{dtype}"

    @property
    def inner(self) -> str:
        return "ep" if self.mesh == "pp_ep" else "dp"


CASES = [
    Case("deepseek_v3", "pp_fsdp"),                       # 5 experts on 2 FSDP ranks: [3, 2]
    Case("qwen3_moe", "pp_ep", n_experts=4),
    Case("deepseek_v3", "pp_fsdp", stages_per_rank=2),  # 4 stages, loop order: rank r holds r, r+2
    Case("qwen3_moe", "pp_fsdp", layers=3, split=(1, 2)),
    Case("deepseek_v3", "pp_ep", n_experts=6, dtype="bfloat16"),  # the fp32 router kept across stages
]


def _my_stages(case, model, mesh):
    """This rank's stage modules, sharded inside the stage."""
    from torch.distributed.fsdp import fully_shard

    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.parallel import discover_layout
    from nemo_moe_export.pipeline.stages import split_stages, stage_ids

    pp = mesh["pp"]
    stages = split_stages(model, pp.size() * case.stages_per_rank, layers_per_stage=case.split)
    mine = [stages[i] for i in stage_ids(pp.get_local_rank(), pp.size(), case.stages_per_rank)]
    for part in mine:
        if case.inner == "ep":
            apply_expert_parallel(part, discover_layout(mesh))
            continue
        for layer in part.model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
    return mine


def _export_worker(rank, world, cases, workdir):
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    out = {}
    for case in cases:
        model = tiny_model(case.family, n_experts=case.n_experts, num_layers=case.layers, seed=0)
        if rank == 0:
            _save_reference(case, os.path.join(workdir, case.name + "-ref"), workdir)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", case.inner))
        parts = _my_stages(case, model, mesh)
        result = export_hf_checkpoint(os.path.join(workdir, case.name), parts, pp_group=mesh["pp"].get_group(),
                                      dtype=case.dtype, max_shard_size="16KB", timeout_s=60)
        out[case.name] = result
    out["refusals"] = _refusals(rank, workdir)
    out["tied"] = _tied(rank, workdir)
    out["reload"] = _reload(CASES[0], workdir)
    return out


def _reload(case, workdir):
    """``from_hf`` into freshly built stage modules (other weights), sharded as for the export: every
    local tensor equals the exporting stages' own, and each rank reads only its slices."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.tiny_models import tiny_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", case.inner))
    exported = _my_stages(case, tiny_model(case.family, n_experts=case.n_experts, num_layers=case.layers, seed=0), mesh)
    fresh = _my_stages(case, tiny_model(case.family, n_experts=case.n_experts, num_layers=case.layers, seed=1), mesh)
    report = get_adapter(fresh[0].config).from_hf(fresh, os.path.join(workdir, case.name), pp_group=mesh["pp"].get_group())
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    want = {k: local(v) for part in exported for k, v in part.state_dict().items()}
    got = {k: local(v) for part in fresh for k, v in part.state_dict().items()}
    return dict(equal=sorted(k for k in want if torch.equal(want[k], got[k])), keys=sorted(want),
                bytes_read=report.bytes_read, passthrough=sorted(report.passthrough))


def _tied(rank, workdir):
    """Tied embeddings held by two stages (the embedding on the first, lm_head's copy on the last):
    equal copies are written once, as save_pretrained writes a tied model; drifted ones are refused."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.pipeline.stages import split_stages
    from nemo_moe_export.tiny_models import tiny_model

    tied = tiny_model("qwen3_moe", n_experts=4, num_layers=2, seed=0, tie_word_embeddings=True)
    if rank == 0:
        tied.save_pretrained(os.path.join(workdir, "tied-ref"))
    untied = tiny_model("qwen3_moe", n_experts=4, num_layers=2, seed=0)
    untied.load_state_dict(tied.state_dict())  # lm_head.weight: a copy of the embedding
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out = {}
    for name, drift in (("tied", 0.0), ("tied-drifted", 1e-3)):
        part = split_stages(copy.deepcopy(untied), 2)[mesh["pp"].get_local_rank()]
        if drift and part.lm_head is not None:
            with torch.no_grad():
                part.lm_head.weight[0, 0] += drift
        fully_shard(part, mesh=mesh["dp"])
        try:
            out[name] = export_hf_checkpoint(os.path.join(workdir, name), [part], config=tied.config,
                                             pp_group=mesh["pp"].get_group(), max_shard_size="16KB", timeout_s=60)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _save_reference(case, path, workdir):
    """What ``save_pretrained`` writes for the unsplit model (loaded in the export's dtype)."""
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.tiny_models import tiny_model

    ref = tiny_model(case.family, n_experts=case.n_experts, num_layers=case.layers, seed=0)
    if case.dtype is None:
        ref.save_pretrained(path)
        return
    ref.save_pretrained(path + "-fp32")
    AutoModelForCausalLM.from_pretrained(path + "-fp32", dtype=getattr(torch, case.dtype)).save_pretrained(path)


def _refusals(rank, workdir):
    """A stage built without one of its layers, and pipeline stages exported without their group:
    both refused on every rank before any file exists."""
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.pipeline.stages import split_stages
    from nemo_moe_export.tiny_models import tiny_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    messages = {}
    for name, drop, group in (("missing-layer", "1", mesh["pp"].get_group()), ("no-pp-group", None, None)):
        stages = split_stages(tiny_model("deepseek_v3", n_experts=4, num_layers=4, seed=0), 2)
        if drop is not None:
            del stages[0].model.layers[drop]
        try:
            export_hf_checkpoint(os.path.join(workdir, name), [stages[pp_rank]], pp_group=group, timeout_s=60)
            messages[name] = None
        except Exception as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
        messages[name + "-written"] = os.path.exists(os.path.join(workdir, name))
    return messages


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("export-pp"))
    return workdir, spawn(_export_worker, 4, CASES, workdir, timeout_s=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pipeline_export_equals_save_pretrained_of_the_unsplit_model(case, exported):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.export import verify_checkpoint

    workdir, per_rank = exported
    path, reference = os.path.join(workdir, case.name), os.path.join(workdir, case.name + "-ref")
    results = [r[case.name] for r in per_rank]
    assert sum(r.rank_bytes_written for r in results) == results[0].checkpoint_bytes  # each byte once
    assert all(r.rank_bytes_written > 0 for r in results)  # every stage wrote its own part
    report = verify_checkpoint(path, reference=reference)  # every tensor: dtype and value
    assert report.ok and report.compared == report.tensors, report.summary()
    assert_serving_config(path, reference)  # the pipeline door's config.json (docs/design.md#serving-engines)

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    ref_keys = set()
    for name in os.listdir(reference):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(reference, name), "pt") as f:
                ref_keys |= set(f.keys())
    assert set(weight_map) == ref_keys  # the index lists every stage's keys, and only those

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    if case.dtype:
        assert model.dtype == getattr(torch, case.dtype)


def test_a_stage_built_without_one_of_its_layers_is_refused_before_writing(exported):
    _, per_rank = exported
    for rank, r in enumerate(per_rank):
        message = r["refusals"]["missing-layer"]
        assert message is not None and "layer 1 is held by no pipeline stage" in message, (rank, message)
        assert "pipeline rank 0" in message, message  # the stage that should hold it
        assert not r["refusals"]["missing-layer-written"]


def test_stages_exported_without_their_pipeline_group_are_refused(exported):
    _, per_rank = exported
    for rank, r in enumerate(per_rank):
        message = r["refusals"]["no-pp-group"]
        assert message is not None and "held by no pipeline stage" in message, (rank, message)
        assert not r["refusals"]["no-pp-group-written"]


def test_tied_embeddings_on_two_stages_are_written_once_and_must_agree(exported):
    from nemo_moe_export.export import verify_checkpoint

    workdir, per_rank = exported
    results = [r["tied"]["tied"] for r in per_rank]
    assert sum(r.rank_bytes_written for r in results) == results[0].checkpoint_bytes
    report = verify_checkpoint(os.path.join(workdir, "tied"), reference=os.path.join(workdir, "tied-ref"))
    assert report.ok and report.compared == report.tensors, report.summary()  # no lm_head.weight, as save_pretrained
    for rank, r in enumerate(per_rank):
        message = r["tied"]["tied-drifted"]
        assert isinstance(message, str) and "tied weights' copies on two pipeline stages differ" in message, (rank, message)
    assert not os.path.exists(os.path.join(workdir, "tied-drifted"))


def test_from_hf_fills_stage_modules_reading_only_their_slices(exported):
    workdir, per_rank = exported
    total = CASES[0]
    for rank, r in enumerate(per_rank):
        reload = r["reload"]
        assert reload["equal"] == reload["keys"], (rank, sorted(set(reload["keys"]) - set(reload["equal"])))
        assert not reload["passthrough"]  # the other stages' keys are theirs, not pass-through tensors
    checkpoint_bytes = per_rank[0][total.name].checkpoint_bytes
    assert all(r["reload"]["bytes_read"] < checkpoint_bytes / 2 for r in per_rank)  # one stage, one FSDP shard
