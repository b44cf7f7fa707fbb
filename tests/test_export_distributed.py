"""The no-gather export on 4 real gloo ranks, read back by transformers and by safetensors.

Each case: every rank builds the same tiny model, shards it for real, runs a forward (the logits a
user would see from the sharded model), and exports. The parent then loads the checkpoint with
``AutoModelForCausalLM.from_pretrained`` (no missing or unexpected keys), compares logits, compares
every tensor with what ``save_pretrained`` writes for the unsharded model, and runs ``verify``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from checks import assert_serving_config
import torch

from bounds import FP32_LOGITS, check_figure, relative_error
from nemo_moe_export.spawn import spawn

INPUT = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(5))


@dataclass(frozen=True)
class Case:
    family: str
    n_experts: int
    mesh: str  # fsdp | hsdp | ep_fsdp_grouped
    dtype: str | None = None
    writers: tuple[int, ...] | None = None  # filesystem="local": only these ranks touch the disk

    @property
    def name(self) -> str:
        return (f"{self.family}-{self.n_experts}e-{self.mesh}" + (f"-{self.dtype}" if self.dtype else "")
                + (f"-local{''.join(map(str, self.writers))}" if self.writers else ""))


CASES = [
    Case("deepseek_v3", 10, "fsdp"),
    Case("kimi_linear", 5, "fsdp"),
    Case("qwen3_moe", 6, "fsdp"),
    Case("deepseek_v3", 5, "hsdp"),
    Case("qwen3_moe", 5, "fsdp", "bfloat16"),
    Case("deepseek_v3", 6, "ep_fsdp_grouped"),
    Case("kimi_linear", 5, "fsdp", writers=(0,)),
    Case("deepseek_v3", 10, "hsdp", "bfloat16", writers=(1, 3)),
    Case("deepseek_v3", 6, "ep_fsdp_grouped", writers=(2,)),  # transposed, non-contiguous sources sent
]


def _export_worker(rank, world, cases, workdir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from checks import to_grouped_layout

    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    out = {}
    for case in cases:
        model = tiny_model(case.family, n_experts=case.n_experts, seed=0)
        target = os.path.join(workdir, case.name)
        if rank == 0:
            ref = tiny_model(case.family, n_experts=case.n_experts, seed=0)
            ref.save_pretrained(os.path.join(workdir, case.name + "-ref"))
            if case.dtype:  # what transformers writes for these weights loaded in that dtype
                from transformers import AutoModelForCausalLM

                os.rename(os.path.join(workdir, case.name + "-ref"), os.path.join(workdir, case.name + "-fp32"))
                AutoModelForCausalLM.from_pretrained(os.path.join(workdir, case.name + "-fp32"),
                                                     dtype=getattr(torch, case.dtype)).save_pretrained(
                    os.path.join(workdir, case.name + "-ref"))
        if case.mesh == "ep_fsdp_grouped":
            # AutoModel grouped experts on EP=2 x inner FSDP=2 with Shard(1): pieces become column runs.
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "ep_shard"))
            sd = {k: distribute_tensor(v, mesh, [Shard(0), Shard(1)]) if ".experts." in k else v
                  for k, v in to_grouped_layout(model.state_dict()).items()}
            local = dict(filesystem="local", writer_ranks=list(case.writers), staging_bytes=4096) if case.writers else {}
            result = export_hf_checkpoint(target, state_dict=sd, config=model.config,
                                          generation_config=model.generation_config, max_shard_size="16KB",
                                          timeout_s=60, **local)
            out[case.name] = dict(result=result, logits=model(INPUT).logits.detach())
            continue
        dims = (world,) if case.mesh == "fsdp" else (2, world // 2)
        names = ("dp_shard",) if case.mesh == "fsdp" else ("dp_replicate", "dp_shard")
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        logits = model(INPUT).logits.detach()
        local = dict(filesystem="local", writer_ranks=list(case.writers), staging_bytes=4096) if case.writers else {}
        result = export_hf_checkpoint(target, model, dtype=case.dtype, max_shard_size="16KB", timeout_s=60, **local)
        out[case.name] = dict(result=result, logits=logits)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("export"))
    return workdir, spawn(_export_worker, 4, CASES, workdir, timeout_s=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_export_loads_with_transformers_and_matches(case, exported):
    from transformers import AutoModelForCausalLM

    from nemo_moe_export.export import verify_checkpoint

    workdir, per_rank = exported
    path = os.path.join(workdir, case.name)
    results = [r[case.name]["result"] for r in per_rank]
    assert results[0].files > 1  # small shards: the index matters
    # Each byte written once: the ranks' writes add up to the checkpoint's tensor bytes.
    assert sum(r.rank_bytes_written for r in results) == results[0].checkpoint_bytes
    if case.writers:  # local filesystem: only the writer ranks touched the disk
        assert all(r.rank_bytes_written == 0 for i, r in enumerate(results) if i not in case.writers)
    assert not os.path.exists(os.path.join(workdir, f".{case.name}.partial"))

    report = verify_checkpoint(path, reference=os.path.join(workdir, case.name + "-ref"))
    assert report.ok, report.summary()
    assert report.compared == report.tensors
    # The sharded doors (FSDP2, HSDP, EP x FSDP2 grouped): config.json and every tensor's dtype as
    # save_pretrained writes them (docs/design.md#serving-engines).
    assert_serving_config(path, os.path.join(workdir, case.name + "-ref"))

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    if case.dtype is None:
        # Weights are bit-exact (compared above); logits may differ in the last bits only because the
        # sharded forward ran with other thread counts and reduction orders.
        check_figure(relative_error(model(INPUT).logits, per_rank[0][case.name]["logits"]), FP32_LOGITS, case.name)
    else:
        assert model.dtype == getattr(torch, case.dtype)
    assert os.path.exists(os.path.join(path, "generation_config.json"))


def _failing_worker(rank, world, workdir):
    """Rank 2's disk fails after a few writes (ENOSPC at the pwrite boundary)."""
    import errno

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nemo_moe_export.export import export_hf_checkpoint, writer
    from nemo_moe_export.parallel import PeerError
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", n_experts=10)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank == 2:
        real, calls = writer.os.pwrite, [0]

        def failing_pwrite(fd, data, offset):
            calls[0] += 1
            if calls[0] > 5:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real(fd, data, offset)

        writer.os.pwrite = failing_pwrite
    try:
        export_hf_checkpoint(os.path.join(workdir, "out"), model, max_shard_size="16KB", timeout_s=60)
    except PeerError as exc:
        return dict(step=exc.step, ranks=exc.ranks, message=str(exc))
    return None


def test_failure_on_one_rank_mid_write_leaves_nothing_and_reports_everywhere(tmp_path):
    per_rank = spawn(_failing_worker, 4, str(tmp_path), timeout_s=300)
    for outcome in per_rank:
        assert outcome is not None, "export claimed success despite a failed write"
        assert outcome["step"] == "write" and outcome["ranks"] == [2], outcome
        assert "No space left on device" in outcome["message"]
    assert os.listdir(tmp_path) == [], "a failed export must leave neither target nor partial directory"


def _stalling_worker(rank, world, workdir):
    """Rank 1 stalls before writing; the others must error out within the timeout, naming the step."""
    import time

    from nemo_moe_export.export import SharedFilesystemWriter, export_hf_checkpoint
    from nemo_moe_export.parallel import PeerError
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", n_experts=4)
    if rank == 1:
        def stall(*args, **kwargs):
            time.sleep(20)
            raise RuntimeError("woke up too late")

        SharedFilesystemWriter.write = stall  # this rank's storage writer never returns in time
    t0 = time.monotonic()
    try:
        export_hf_checkpoint(os.path.join(workdir, "out"), model, timeout_s=5)
    except PeerError as exc:
        return dict(step=exc.step, ranks=exc.ranks, message=str(exc), seconds=time.monotonic() - t0)
    return None


def test_a_stalled_rank_is_an_error_on_the_others_not_a_hang(tmp_path):
    per_rank = spawn(_stalling_worker, 3, str(tmp_path), timeout_s=120)
    for rank in (0, 2):
        outcome = per_rank[rank]
        assert outcome is not None and outcome["step"] == "write", outcome
        assert outcome["seconds"] < 19, outcome  # the timeout fired well before rank 1 woke up
        assert "not every rank arrived within 5 s" in outcome["message"]
        assert outcome["ranks"] == [1] and "ranks [1] sent no report" in outcome["message"], outcome  # named on every survivor
    assert not os.path.exists(tmp_path / "out")


def _disagreeing_worker(rank, world, workdir):
    """Checks across ranks run after the validate agreement and refuse the same way on every rank."""
    import torch.distributed as dist

    from nemo_moe_export.errors import InputError
    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.tiny_models import tiny_model

    import torch

    from nemo_moe_export.parallel import Coordinator

    # The coordinator's butterfly on 3 ranks (not a power of two: rank 2 folds into rank 0): the
    # same bits on every rank, and words shared on an agreement summed
    coordinator = Coordinator(None, timeout_s=60, name="butterfly")
    values = torch.tensor([0.1 * (rank + 1), 1e16 if rank == 0 else 1.0, -rank], dtype=torch.float64)
    out = dict(sum=coordinator.all_reduce(values.clone()).tolist(),
               max=coordinator.all_reduce(values.clone(), "max").tolist(),
               shared=coordinator.agree("count", sums=torch.tensor([rank, 1])).tolist())
    model = tiny_model("qwen3_moe", n_experts=4)
    try:  # rank 1 plans other file sizes than its peers
        export_hf_checkpoint(os.path.join(workdir, "plans"), model, max_shard_size="16KB" if rank == 1 else "32KB",
                             timeout_s=60)
    except InputError as exc:
        out["plans"] = dict(problem=exc.problem, key=exc.key, actual=exc.actual)
    # Sharded over all three ranks but exported by ranks 1 and 2: rank 0's shards have no writer.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    without_rank0 = dist.new_group([1, 2], backend="gloo")
    if rank in (1, 2):
        try:
            export_hf_checkpoint(os.path.join(workdir, "coverage"), model, group=without_rank0, timeout_s=60)
        except InputError as exc:
            out["coverage"] = dict(problem=exc.problem, key=exc.key, expected=exc.expected, actual=exc.actual)
    return out


def test_different_plans_and_missing_writers_are_refused_on_every_rank(tmp_path):
    per_rank = spawn(_disagreeing_worker, 3, str(tmp_path), timeout_s=300)
    assert all(r["sum"] == per_rank[0]["sum"] for r in per_rank), per_rank  # bitwise, floats included
    assert per_rank[0]["sum"] == pytest.approx([0.6, 1e16 + 2, -3], rel=1e-15)
    assert all(r["max"] == [0.30000000000000004, 1e16, 0.0] for r in per_rank)
    assert all(r["shared"] == [3, 3] for r in per_rank)
    plans = [r["plans"] for r in per_rank]
    assert all(p == plans[0] for p in plans), plans  # the same verdict everywhere
    assert plans[0]["problem"] == "ranks computed different export plans" and plans[0]["key"] == "plan"
    assert "ranks [0, 2]: " in plans[0]["actual"] and "ranks [1]: " in plans[0]["actual"]
    assert "coverage" not in per_rank[0]
    coverage = [per_rank[1]["coverage"], per_rank[2]["coverage"]]
    assert coverage[0] == coverage[1], coverage
    assert coverage[0]["problem"].endswith("tensors would not be written exactly once")
    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import plan_export
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", n_experts=4)
    plan = plan_export(get_adapter(model.config).hf_metadata(model.state_dict()))
    first = next(iter(plan.tensors.values()))
    # Only experts 2 and 3 (rank 1's torch.chunk share of 4 over 3 ranks) are complete without rank 0.
    complete = [k for k in plan.tensors if ".experts.2." in k or ".experts.3." in k]
    assert coverage[0]["problem"] == f"{len(plan.tensors) - len(complete)} tensors would not be written exactly once"
    assert coverage[0]["key"] == first.key
    assert coverage[0]["expected"] == f"{first.numel} elements with one writer each"
    rank0_rows = -(-first.shape[0] // 3)  # torch.chunk: rank 0 holds the first ceil(n / 3) rows
    missing = rank0_rows * (first.numel // first.shape[0])
    assert coverage[0]["actual"] == f"{first.numel - missing} written by primaries across ranks", coverage[0]
    assert os.listdir(tmp_path) == [], "a refused export must write nothing"
