"""Expert parallelism and parallel-layout discovery on real gloo ranks with real tiny models.

Equivalence: every rank builds the same full model (same seed), keeps a reference copy, and swaps
the experts for its EP share. Ranks feed different inputs (batch sizes and sequence lengths
differ, one rank has a single token), so the all-to-all splits are uneven and some are zero. The
EP model must reproduce the reference logits of the rank's own input; gradients of everything but
the experts must equal the reference gradient of the rank's own loss; the local expert gradients
must equal the matching slice of the reference gradient summed over the EP peers' losses (the
experts see every peer's tokens). The rank computes those peer references itself from the peers'
inputs, so no collective under test enters the reference. ``to_hf`` of the EP model, unioned over
ranks, must equal ``save_pretrained`` of the original, each element written by one primary.

Expected groups are written out here (Megatron's layout, docs/design.md#placement-rules), never read from
the code under test.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from bounds import FP32_GRADS, FP32_LOGITS, FP32_SCORES, check_figure, relative_error
from checks import assert_pieces_tile_reference
from nemo_moe_export.spawn import spawn

WORLD = 4
# Per-rank input shapes (batch, seq): all different; rank 3 has one token, so with EP=4 and top-2
# routing at least two of its peers receive nothing from it.
INPUT_SHAPES = {0: (2, 5), 1: (1, 7), 2: (3, 3), 3: (1, 1)}
STALL_TIMEOUT_S = 2.0
STALL_MAX_WAIT_S = 30.0
# fp32, the experts' sums in another order (tests/bounds.py): logits and gradients relative to their
# largest magnitude, the loss as a score.


@dataclass(frozen=True)
class Case:
    family: str
    n_experts: int
    ep: int
    num_layers: int = 2

    @property
    def name(self) -> str:
        return f"{self.family}-{self.n_experts}e-ep{self.ep}"


CASES = [
    Case("deepseek_v3", 8, 2, num_layers=3),
    Case("deepseek_v3", 8, 4, num_layers=3),
    Case("qwen3_moe", 4, 2),
    Case("kimi_linear", 6, 2),
]


def expected_ep_peers(rank: int, ep: int) -> list[int]:
    """Contiguous EP blocks: [0, 1], [2, 3] for EP=2 on 4 ranks."""
    first = rank // ep * ep
    return list(range(first, first + ep))


def expected_edp_peers(rank: int, ep: int, world: int = WORLD) -> list[int]:
    """One rank of each EP block: [0, 2], [1, 3] for EP=2 on 4 ranks."""
    return list(range(rank % ep, world, ep))


# --------------------------------------------------------------------------------------------------
# Workers (run on the spawned ranks)
# --------------------------------------------------------------------------------------------------


def _model(case: Case):
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model(case.family, n_experts=case.n_experts, num_layers=case.num_layers, seed=0)
    # tiny_model's N(0, 1) router biases outweigh the sigmoid scores, so every token would pick the
    # same experts and most EP ranks would receive nothing; smaller biases make routing depend on
    # the token (still non-zero, so a dropped bias would show).
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.mul_(0.05)
    return model


def _batch(case: Case, rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s input ids and loss targets; any rank can rebuild any rank's batch."""
    gen = torch.Generator().manual_seed(1000 * rank + 7 * case.n_experts + case.ep + len(case.family))
    shape = INPUT_SHAPES[rank]
    return torch.randint(3, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen)


def _loss(model, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _compare_case(case: Case, rank: int, layout, workdir: str) -> dict:
    from torch.distributed.tensor import DTensor

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.expert_parallel import ExpertParallelExperts, apply_expert_parallel

    reference, ep_model = _model(case), _model(case)
    if rank == 0:
        reference.save_pretrained(os.path.join(workdir, case.name))
    apply_expert_parallel(ep_model, layout)
    vocab = reference.config.vocab_size
    ids, targets = _batch(case, rank, vocab)

    ep_logits, ep_loss = _loss(ep_model, ids, targets)
    ep_loss.backward()

    ref_logits, ref_loss = _loss(reference, ids, targets)
    ref_loss.backward()
    own_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    for peer in expected_ep_peers(rank, case.ep):  # experts also see every EP peer's tokens
        if peer != rank:
            _loss(reference, *_batch(case, peer, vocab))[1].backward()
    peer_sum_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    per_rank = case.n_experts // case.ep
    start = layout.ep.rank * per_rank
    grad_diffs, missing_grads, expert_params = {}, [], 0
    for name, param in ep_model.named_parameters():
        if param.grad is None:
            missing_grads.append(name)
            continue
        if isinstance(param, DTensor):
            expert_params += 1
            want = peer_sum_grads[name][start:start + per_rank]
            got = param.grad.to_local()
        else:
            want, got = own_grads.get(name, torch.zeros_like(param)), param.grad
        grad_diffs[name] = (_max_diff(got, want), float(want.abs().max()))
    ep_layers = [m for m in ep_model.modules() if isinstance(m, ExpertParallelExperts)]
    pieces = get_adapter(ep_model.config).to_hf(ep_model.state_dict())
    return dict(
        logits_diff=relative_error(ep_logits, ref_logits),
        loss_diff=abs(float(ep_loss.detach() - ref_loss.detach())),
        grad_diffs=grad_diffs,
        missing_grads=missing_grads,
        param_names=sorted(n for n, _ in ep_model.named_parameters()),
        ref_param_names=sorted(n for n, _ in reference.named_parameters()),
        expert_params=expert_params,
        n_ep_layers=len(ep_layers),
        local_ranges=[(m.local_start, m.local_end) for m in ep_layers],
        splits=[m.last_splits for m in ep_layers],
        dump=[(k, p.offsets, p.global_shape, p.primary, p.tensor.clone()) for k, p in pieces.items()],
    )


def _equivalence_worker(rank: int, world: int, cases: list[Case], workdir: str) -> dict:
    import torch.distributed as dist

    from nemo_moe_export.parallel import init_expert_parallel

    layouts = {ep: init_expert_parallel(ep, timeout_s=60) for ep in sorted({c.ep for c in cases})}
    results = {}
    for case in cases:
        results[case.name] = _compare_case(case, rank, layouts[case.ep], workdir)
        dist.barrier()  # rank 0's save_pretrained is on disk before the parent reads it
    return results


def _groups(layout) -> dict:
    """A picklable summary: (rank, size, global ranks) per group, and the source."""
    return {k: (g.rank, g.size, list(g.ranks)) for k, g in
            (("dp", layout.dp), ("ep", layout.ep), ("edp", layout.edp))} | {"source": layout.source}


def _layout_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_moe_export.errors import InputError
    from nemo_moe_export.parallel import discover_layout, init_expert_parallel

    out = {"world": _groups(discover_layout())}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    out["mesh_edp_ep"] = _groups(discover_layout(mesh))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    out["mesh_hsdp"] = _groups(discover_layout(hsdp))
    out["init_ep2"] = _groups(init_expert_parallel(2, timeout_s=30))
    errors = {}
    for label, call in (("ep3", lambda: init_expert_parallel(3)),
                        ("ep0", lambda: init_expert_parallel(0)),
                        ("bad_mesh", lambda: discover_layout(init_device_mesh("cpu", (4,), mesh_dim_names=("x",))))):
        try:
            call()
            errors[label] = None
        except InputError as exc:
            errors[label] = str(exc)
    out["errors"] = errors

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        out["megatron"] = _groups(discover_layout(mesh))  # Megatron wins over a mesh
        out["mesh_without_megatron"] = _groups(discover_layout(mesh, use_megatron=False))
        out["megatron_logits_diff"] = _megatron_ep_forward(rank, discover_layout())
    finally:
        parallel_state.destroy_model_parallel()
    out["after_megatron"] = _groups(discover_layout())
    return out


def _megatron_ep_forward(rank: int, layout) -> float:
    """EP on Megatron's groups: logits of the EP model equal the reference on this rank's input."""
    from nemo_moe_export.expert_parallel import apply_expert_parallel

    case = Case("deepseek_v3", 8, 2)
    reference, ep_model = _model(case), apply_expert_parallel(_model(case), layout)
    ids, _ = _batch(case, rank, reference.config.vocab_size)
    with torch.no_grad():
        return relative_error(ep_model(input_ids=ids).logits, reference(input_ids=ids).logits)


def _stall_worker(rank: int, world: int, workdir: str) -> dict:
    """Rank 1 skips the second forward; its EP peer (rank 0) must raise within the group timeout.

    Rank 1 stays alive until rank 0 has returned (it waits for rank 0's marker file), so rank 0
    cannot be released by rank 1 exiting and closing its connections: only the timeout can.
    """
    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.parallel import init_expert_parallel

    case = Case("deepseek_v3", 4, 2)
    layout = init_expert_parallel(2, timeout_s=STALL_TIMEOUT_S)
    model = apply_expert_parallel(_model(case), layout)
    ids, _ = _batch(case, rank, model.config.vocab_size)
    marker = os.path.join(workdir, "rank0-returned")
    with torch.no_grad():
        model(input_ids=ids)  # everyone in step: fine
        if rank == 1:
            deadline = time.monotonic() + STALL_MAX_WAIT_S
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            return {"skipped": True, "saw_rank0_return": os.path.exists(marker)}
        started = time.monotonic()
        try:
            model(input_ids=ids)
            outcome = {"error": None, "elapsed": time.monotonic() - started}
        except Exception as exc:  # the timeout surfaces as a RuntimeError/DistBackendError
            outcome = {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - started}
    if rank == 0:
        open(marker, "w").close()
    return outcome


# --------------------------------------------------------------------------------------------------
# Tests (parent side)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("ep"))
    return workdir, spawn(_equivalence_worker, WORLD, CASES, workdir, timeout_s=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_backward_match_the_unsharded_model(case, equivalence):
    _, per_rank = equivalence
    for rank, results in enumerate(per_rank):
        res = results[case.name]
        assert res["n_ep_layers"] > 0, "no experts module was replaced"
        assert res["param_names"] == res["ref_param_names"], "EP changed the parameter names"
        assert res["expert_params"] == 2 * res["n_ep_layers"], "expert weights are not DTensors"
        assert not res["missing_grads"], f"rank {rank}: no gradient for {res['missing_grads']}"
        check_figure(res["logits_diff"], FP32_LOGITS, f"rank {rank} logits")
        check_figure(res["loss_diff"], FP32_SCORES, f"rank {rank} loss")
        # Relative to the tensor's largest |gradient|, or where that vanishes (a 1-token rank's query
        # projection: one key, a constant softmax) to a hundredth of the model's largest: the rounding
        # of its sums is that of the terms summed, of the model's magnitude.
        floor = 1e-2 * max(scale for _, scale in res["grad_diffs"].values())
        for name, (diff, scale) in res["grad_diffs"].items():
            check_figure(diff / max(scale, floor), FP32_GRADS, f"rank {rank} gradient of {name}")
        per_rank_experts = case.n_experts // case.ep
        ep_rank = expected_ep_peers(rank, case.ep).index(rank)
        want_range = (ep_rank * per_rank_experts, (ep_rank + 1) * per_rank_experts)
        assert set(res["local_ranges"]) == {want_range}, res["local_ranges"]


def test_uneven_and_zero_splits_were_exercised(equivalence):
    """Guards the claim of the equivalence tests: the splits really were uneven, some zero."""
    _, per_rank = equivalence
    splits = [s for results in per_rank for s in results["deepseek_v3-8e-ep4"]["splits"]]
    sends = [send for send, _ in splits]
    assert any(0 in send for send in sends), sends
    assert any(len(set(send)) > 1 for send in sends), sends
    rank3 = per_rank[3]["deepseek_v3-8e-ep4"]["splits"]
    assert all(sum(send) == 2 for send, _ in rank3), rank3  # one token, top-2


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_to_hf_union_after_ep_equals_save_pretrained(case, equivalence):
    workdir, per_rank = equivalence
    ref = load_file(os.path.join(workdir, case.name, "model.safetensors"))
    assert_pieces_tile_reference([results[case.name]["dump"] for results in per_rank], ref)


@pytest.fixture(scope="module")
def layouts():
    pytest.importorskip("megatron.core")
    return spawn(_layout_worker, WORLD, timeout_s=180)


def test_discover_layout_of_the_plain_world(layouts):
    for rank, out in enumerate(layouts):
        assert out["world"] == {"dp": (rank, 4, [0, 1, 2, 3]), "ep": (0, 1, [rank]),
                                "edp": (rank, 4, [0, 1, 2, 3]), "source": "world"}


def _expected_ep2(rank: int, source: str) -> dict:
    ep, edp = expected_ep_peers(rank, 2), expected_edp_peers(rank, 2)
    return {"dp": (rank, 4, [0, 1, 2, 3]), "ep": (ep.index(rank), 2, ep),
            "edp": (edp.index(rank), 2, edp), "source": source}


def test_discover_layout_of_a_named_mesh(layouts):
    for rank, out in enumerate(layouts):
        assert out["mesh_edp_ep"] == _expected_ep2(rank, "device_mesh")
        assert out["mesh_without_megatron"] == _expected_ep2(rank, "device_mesh")
        # HSDP dims are both dense data-parallel: flattened into one DP group; no EP.
        assert out["mesh_hsdp"] == {"dp": (rank, 4, [0, 1, 2, 3]), "ep": (0, 1, [rank]),
                                    "edp": (rank, 4, [0, 1, 2, 3]), "source": "device_mesh"}


def test_init_expert_parallel_matches_megatron_layout(layouts):
    for rank, out in enumerate(layouts):
        assert out["init_ep2"] == _expected_ep2(rank, "init_expert_parallel")
        assert out["megatron"] == _expected_ep2(rank, "megatron")
        assert out["after_megatron"]["source"] == "world"  # destroyed Megatron state is not read


def test_expert_parallel_on_megatron_groups(layouts):
    for rank, out in enumerate(layouts):
        check_figure(out["megatron_logits_diff"], FP32_LOGITS, f"rank {rank} on megatron's groups")


def test_bad_layout_input_is_a_clear_error(layouts):
    for out in layouts:
        errors = out["errors"]
        assert errors["ep3"] and "divide the world size" in errors["ep3"], errors
        assert errors["ep0"] and "ep_size=0" in errors["ep0"], errors
        assert errors["bad_mesh"] and "'x'" in errors["bad_mesh"], errors


def test_stalled_ep_peer_is_an_error_not_a_hang(tmp_path):
    results = spawn(_stall_worker, WORLD, str(tmp_path), timeout_s=60)
    assert results[1] == {"skipped": True, "saw_rank0_return": True}, results[1]
    waiting = results[0]
    assert waiting["error"] is not None, "rank 0 ran a forward without its EP peer"
    assert "timed out" in waiting["error"].lower(), waiting["error"]
    assert STALL_TIMEOUT_S - 0.5 <= waiting["elapsed"] <= STALL_TIMEOUT_S + 3, waiting
    for rank in (2, 3):  # the other EP group is unaffected
        assert results[rank]["error"] is None, results[rank]


def test_ep_size_must_divide_the_expert_count():
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.placement import get_ep_expert_range
    from nemo_moe_export.parallel import expert_parallel_groups

    with pytest.raises(InputError, match="divide"):
        get_ep_expert_range(6, 4, 0)
    with pytest.raises(InputError, match="divide the world size"):
        expert_parallel_groups(6, 4)
    assert expert_parallel_groups(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])


def test_apply_expert_parallel_refuses_an_indivisible_expert_count():
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.parallel import ParallelLayout, RankGroup
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", n_experts=6)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    four = RankGroup(0, 4, (0, 1, 2, 3))
    layout = ParallelLayout(dp=four, ep=four, edp=RankGroup(0, 1, (0,)), source="test")
    with pytest.raises(InputError, match="divide by the EP size"):
        apply_expert_parallel(model, layout)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
