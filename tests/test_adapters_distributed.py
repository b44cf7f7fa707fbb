"""to_hf / from_hf on real FSDP2, HSDP and EP shardings, against what transformers writes.

Each rank builds the same tiny model (same seed); rank 0 writes the reference with transformers'
own ``save_pretrained``. The model is then sharded for real (``fully_shard`` or
``distribute_tensor``), every rank returns its ``to_hf`` pieces, and the parent assembles them and
compares with the reference file, key for key and element for element, requiring every element to
be written by exactly one primary. ``from_hf`` then loads the reference into a differently seeded,
identically sharded model, which must equal the original exactly; bytes read per rank must equal
the rank's ``torch.chunk`` share of the experts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from checks import assert_pieces_tile_reference, to_grouped_layout
from nemo_moe_export.spawn import spawn


@dataclass(frozen=True)
class Case:
    family: str
    n_experts: int
    mesh: str  # fsdp | hsdp | ep | ep_fsdp
    layout: str = "fused"  # fused (transformers 5) | grouped (NeMo AutoModel)

    @property
    def name(self) -> str:
        return f"{self.family}-{self.n_experts}e-{self.mesh}-{self.layout}"


CASES_4 = [
    *(Case(f, n, "fsdp") for f in ("deepseek_v3", "qwen3_moe", "kimi_linear") for n in (5, 6, 10)),
    Case("kimi_k2", 5, "fsdp"),
    Case("deepseek_v3", 5, "hsdp"),
    Case("qwen3_moe", 6, "hsdp"),
    Case("kimi_linear", 10, "hsdp"),
    Case("deepseek_v3", 8, "ep"),
    Case("qwen3_moe", 6, "ep_fsdp"),
    Case("deepseek_v3", 5, "fsdp", "grouped"),
    Case("deepseek_v3", 8, "ep", "grouped"),
    Case("kimi_linear", 6, "ep_fsdp", "grouped"),
]
CASES_8 = [Case("deepseek_v3", 60, "fsdp")]


def _sharded_state_dict(case, seed, world):
    """The model's state dict, sharded the way ``case.mesh`` says, with real DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from nemo_moe_export.tiny_models import tiny_model

    family = "deepseek_v3" if case.family == "kimi_k2" else case.family
    model = tiny_model(family, n_experts=case.n_experts, seed=seed)
    if case.mesh in ("fsdp", "hsdp") and case.layout == "fused":
        if case.mesh == "fsdp":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        else:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model.state_dict()
    # Expert-parallel meshes: experts become DTensors on the EP mesh (as EP frameworks place them);
    # the rest stays replicated as plain tensors.
    if case.mesh == "fsdp":
        mesh, placements = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)), [Shard(0)]
    elif case.mesh == "ep":
        mesh, placements = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), [Shard(0)]
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "ep_shard"))
        placements = [Shard(0), Shard(1)]
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if case.layout == "grouped":
        sd = to_grouped_layout(sd)
    return model, {
        k: distribute_tensor(v, mesh, placements) if ".experts." in k else v for k, v in sd.items()
    }


def _cases_worker(rank, world, cases, workdir):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.placement import local_box

    results = {}
    for case in cases:
        ref_dir = os.path.join(workdir, case.name)
        model, sd = _sharded_state_dict(case, seed=0, world=world)
        if rank == 0:
            # The reference: transformers' own writer on the unsharded model.
            from nemo_moe_export.tiny_models import tiny_model

            family = "deepseek_v3" if case.family == "kimi_k2" else case.family
            tiny_model(family, n_experts=case.n_experts, seed=0).save_pretrained(ref_dir)
        adapter = get_adapter(model.config, case.family)
        pieces = adapter.to_hf(sd)
        for p in pieces.values():  # views of the local shard, never copies
            local = local_box(sd[p.source_key]).local
            assert p.tensor.untyped_storage().data_ptr() == local.untyped_storage().data_ptr(), p.key
        dump = [(k, p.offsets, p.global_shape, p.primary, p.expert, p.tensor.clone()) for k, p in pieces.items()]
        dist.barrier()

        original = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in sd.items()}
        _, fresh = _sharded_state_dict(case, seed=1, world=world)
        report = adapter.from_hf(fresh, ref_dir)
        mismatched = [
            k for k, v in fresh.items()
            if not torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, original[k])
        ]
        results[case.name] = dict(dump=dump, mismatched=mismatched, expert_bytes=report.expert_bytes_read,
                                  bytes=report.bytes_read)
        dist.barrier()
    return results


def _run(cases, world, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("adapters"))
    per_rank = spawn(_cases_worker, world, cases, workdir, timeout_s=600)
    return workdir, per_rank


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    return _run(CASES_4, 4, tmp_path_factory)


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
    return _run(CASES_8, 8, tmp_path_factory)


def _expected_local_experts(case, rank, world):
    """Experts (and the fraction of each expert's elements) a rank holds, from torch.chunk."""
    n = case.n_experts
    if case.mesh == "fsdp":
        chunks = torch.chunk(torch.arange(n), world)
        return (len(chunks[rank]) if rank < len(chunks) else 0), 1.0
    if case.mesh == "hsdp":
        return len(torch.chunk(torch.arange(n), world // 2)[rank % (world // 2)]), 1.0
    if case.mesh == "ep":
        return n // world, 1.0
    return n // 2, 1 / (world // 2)  # ep_fsdp: EP=2 blocks, rows halved over ep_shard


def _check(case, workdir, per_rank, world):
    ref = load_file(os.path.join(workdir, case.name, "model.safetensors"))
    results = [r[case.name] for r in per_rank]
    for rank, res in enumerate(results):
        assert not res["mismatched"], f"rank {rank}: from_hf left wrong values in {res['mismatched']}"

    # Union over ranks of to_hf == save_pretrained, each element written by exactly one primary.
    assert_pieces_tile_reference(
        [[(k, o, g, p, t) for k, o, g, p, _e, t in res["dump"]] for res in results], ref)

    # Bytes read: each rank's share of the experts, from torch.chunk, exactly.
    per_expert_bytes = sum(
        v.numel() * v.element_size() for k, v in ref.items() if ".experts.0." in k
    )
    total_expert_bytes = per_expert_bytes * case.n_experts
    for rank, res in enumerate(results):
        count, fraction = _expected_local_experts(case, rank, world)
        assert res["expert_bytes"] == int(count * per_expert_bytes * fraction), (rank, res["expert_bytes"])
    replicas = 2 if case.mesh == "hsdp" else 1  # HSDP replicas each read their own copy
    assert sum(r["expert_bytes"] for r in results) == replicas * total_expert_bytes


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.name)
def test_four_ranks(case, run4):
    workdir, per_rank = run4
    _check(case, workdir, per_rank, 4)


@pytest.mark.parametrize("case", CASES_8, ids=lambda c: c.name)
def test_eight_ranks(case, run8):
    workdir, per_rank = run8
    _check(case, workdir, per_rank, 8)
