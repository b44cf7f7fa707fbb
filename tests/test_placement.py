"""The range helpers against torch.chunk, and the placement reader against real DTensors."""

import pytest
import torch

from nemo_moe_export.errors import InputError
from nemo_moe_export.placement import get_ep_expert_range, get_sharded_expert_range
from nemo_moe_export.spawn import spawn


def test_sharded_range_equals_torch_chunk_exhaustively():
    for n in range(0, 301):
        data = torch.arange(n)
        for shards in range(1, 65):
            chunks = torch.chunk(data, shards)
            for idx in range(shards):
                start, end = get_sharded_expert_range(n, shards, idx)
                if idx < len(chunks) and len(chunks[idx]):
                    assert (start, end) == (int(chunks[idx][0]), int(chunks[idx][-1]) + 1), (n, shards, idx)
                else:
                    assert start == end == n, (n, shards, idx)


@pytest.mark.parametrize(
    "n,world,sizes",
    [(5, 4, [2, 2, 1, 0]), (10, 4, [3, 3, 3, 1]), (6, 4, [2, 2, 2, 0]), (10, 3, [4, 4, 2]),
     (60, 8, [8] * 7 + [4]), (64, 24, [3] * 21 + [1, 0, 0])],
)
def test_sharded_range_matches_observed_fsdp2_sizes(n, world, sizes):
    got = [end - start for start, end in (get_sharded_expert_range(n, world, r) for r in range(world))]
    assert got == sizes


def test_ep_range_is_balanced_and_refuses_indivisible_counts():
    assert [get_ep_expert_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(InputError, match="divide by the EP size.*n_experts=60"):
        get_ep_expert_range(60, 8, 0)
    with pytest.raises(InputError, match="ep_rank"):
        get_ep_expert_range(8, 4, 4)


def _placements_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from nemo_moe_export.placement import local_box, local_expert_range

    results = {}
    cases = {
        "fsdp": (init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",)), [Shard(0)], 5),
        "hsdp": (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")),
                 [Replicate(), Shard(0)], 5),
        "ep": (init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), [Shard(0)], 8),
        "ep_fsdp": (init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "ep_shard")),
                    [Shard(0), Shard(1)], 6),
    }
    for name, (mesh, placements, n) in cases.items():
        torch.manual_seed(0)
        full = torch.randn(n, 6, 4)
        dt = distribute_tensor(full, mesh, placements)
        box = local_box(dt)
        region = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.local.shape))]
        results[name] = dict(
            experts=local_expert_range(dt), rows=(box.offsets[1], box.offsets[1] + box.local.shape[1]),
            primary=box.primary, replica=(box.replica, box.replicas), data_matches=torch.equal(region, box.local),
            is_view=box.local.untyped_storage().data_ptr() == dt.to_local().untyped_storage().data_ptr(),
        )
    # A balanced split (the seed's bug) declared as Shard(0): refused with a clear error.
    from torch.distributed.tensor import DTensor

    from nemo_moe_export.errors import InputError

    balanced = [2, 1, 1, 1][rank]
    bad = DTensor.from_local(torch.zeros(balanced, 6, 4), cases["fsdp"][0], [Shard(0)], run_check=False,
                             shape=torch.Size([5, 6, 4]), stride=(24, 4, 1))
    try:
        local_box(bad, key="layers.1.experts.gate_up_proj")
        results["balanced_error"] = None
    except InputError as exc:
        results["balanced_error"] = str(exc)
    return results


def test_local_expert_range_reads_real_placements():
    results = spawn(_placements_worker, 4)
    chunk5_2 = [c.tolist() for c in torch.chunk(torch.arange(5), 2)]
    chunk5_4 = [c.tolist() for c in torch.chunk(torch.arange(5), 4)] + [[]]
    for rank, res in enumerate(results):
        assert all(r["data_matches"] and r["is_view"] for n, r in res.items() if n != "balanced_error")
        fsdp = chunk5_4[rank]
        assert res["fsdp"]["experts"] == ((fsdp[0], fsdp[-1] + 1) if fsdp else (5, 5))
        assert res["fsdp"]["primary"]
        shard = chunk5_2[rank % 2]  # mesh (2, 2): rank = replica * 2 + shard
        assert res["hsdp"]["experts"] == (shard[0], shard[-1] + 1)
        assert res["hsdp"]["primary"] == (rank // 2 == 0)
        assert res["hsdp"]["replica"] == (rank // 2, 2)  # holder index = coordinate on the Replicate dim
        assert res["fsdp"]["replica"] == res["ep"]["replica"] == res["ep_fsdp"]["replica"] == (0, 1)
        assert res["ep"]["experts"] == (2 * rank, 2 * rank + 2)
        ep, inner = divmod(rank, 2)
        assert res["ep_fsdp"]["experts"] == (3 * ep, 3 * ep + 3)
        assert res["ep_fsdp"]["rows"] == (3 * inner, 3 * inner + 3)
        assert res["ep_fsdp"]["primary"]
        if [2, 1, 1, 1][rank] == len(chunk5_4[rank]):
            assert res["balanced_error"] is None  # the layouts agree on this rank
        else:
            assert f"rank {rank}" in res["balanced_error"] and "layers.1.experts.gate_up_proj" in res["balanced_error"]
            assert f"expected ({len(chunk5_4[rank])}, 6, 4)" in res["balanced_error"]
