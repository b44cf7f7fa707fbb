"""A rank failing inside an MMLU forward: every rank raises within seconds, naming the original error.

Real gloo ranks (4, expert parallelism over pairs [0, 1] and [2, 3], policy lockstep), the tiny
DeepSeek-V3 and MMLU files of ``test_mmlu_eval``. Rank 2 raises in the middle of its second
forward: after the first MoE layer's all-to-alls, before the second's, so its EP peer (rank 3) is
blocked in that all-to-all, and ranks 0 and 1 (the other EP pair) finish the step. The model's
groups and the agreements wait up to 120 s, so an error that came from a timeout would come far
too late for the bound asserted here (docs/design.md#faults-and-how-each-is-reported).

Each case is one spawn: the failing rank's process must end for its gloo connections to close
(gloo's ``ProcessGroup.abort`` does nothing), which is what ends the job after such a failure.
"""

from __future__ import annotations

import os
import time

import pytest

from nemo_moe_export.spawn import spawn
from test_mmlu_eval import BATCH, FULL_PROMPTS, K_SHOT, SHARED, build_model, build_tokenizer, load_split_data, \
    write_mmlu_csvs

WORLD = 4
FAIL_RANK = 2
BLOCKED_PEER = 3  # rank 2's EP peer
FAIL_AT_FORWARD = 2  # the evaluation's second step
LONG_TIMEOUT_S = 120.0  # model groups and agreements: a timeout would take this long
BOUND_S = 20.0  # every rank must have raised this soon after the fault


class _FailInsideForward:
    """Forward pre-hook of a late decoder layer: raises at that layer's ``n``-th call, i.e. in the
    middle of the ``n``-th forward, and notes the wall time of the fault."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.fault_at = n, 0, None

    def __call__(self, *_args) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.fault_at = time.time()
            raise RuntimeError("injected failure inside the forward")


def _worker(rank: int, world: int, data_dir: str, tok_dir: str, mode: dict, agree_every) -> dict:
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.parallel import PeerError, init_expert_parallel

    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(tok_dir, "single"))
    test, dev = load_split_data(data_dir)
    layout = init_expert_parallel(2, timeout_s=LONG_TIMEOUT_S)
    model = apply_expert_parallel(build_model(), layout)
    out = {"agreements": _count_agreements(model, tok, test, dev, layout, mode)}
    hook = _FailInsideForward(FAIL_AT_FORWARD)
    if rank == FAIL_RANK:  # layer 0 is dense, 1 and 2 are MoE: layer 1's all-to-alls have run
        model.model.layers[2].register_forward_pre_hook(hook)
    try:
        result = evaluate_mmlu(model, tok, test, dev, layout, k_shot=K_SHOT, batch_size=BATCH, policy="lockstep",
                               timeout_s=LONG_TIMEOUT_S, agree_every=agree_every, progress=False, **mode)
        out |= {"error": None, "steps": result.steps}
    except PeerError as exc:
        out |= {"error": str(exc), "ranks": exc.ranks}
    return out | {"raised_at": time.time(), "fault_at": hook.fault_at}


def _count_agreements(model, tok, test, dev, layout, mode) -> dict:
    """Healthy evaluations first: how many agreements each cadence makes, counted around the real
    ``Coordinator.agree`` (the steps a rank runs, and every agreement's collective, are unchanged)."""
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.parallel import Coordinator

    calls, agree = [], Coordinator.agree

    def counted(self, step, error=None, **shared):
        calls.append(step)
        return agree(self, step, error, **shared)

    Coordinator.agree = counted
    try:
        out = {}
        for every in (1, 2, None):
            calls.clear()
            result = evaluate_mmlu(model, tok, test, dev, layout, k_shot=K_SHOT, batch_size=BATCH, timeout_s=60,
                                   agree_every=every, progress=False, **mode)
            out[every] = (result.steps, list(calls))
        return out
    finally:
        Coordinator.agree = agree


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmlu_faults")
    data_dir, tok_dir = str(root / "data"), str(root / "tok")
    write_mmlu_csvs(data_dir)
    build_tokenizer().save_pretrained(os.path.join(tok_dir, "single"))
    return data_dir, tok_dir


# full prompts with agreements only before the first step and after the last (the default cadence
# on a 3-step plan), and shared prefixes with an agreement after every step
CASES = {"full_prompts": (FULL_PROMPTS, None), "shared_prefixes": (SHARED, 1)}


@pytest.fixture(scope="module")
def runs(inputs):
    """One spawn per case: rank 2's process must end to release its peer (see the module docstring)."""
    out = {}
    for case, (mode, agree_every) in CASES.items():
        started = time.monotonic()
        out[case] = spawn(_worker, WORLD, *inputs, mode, agree_every, timeout_s=LONG_TIMEOUT_S)
        print(f"\n{case}: whole run {time.monotonic() - started:.1f} s")
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_failing_inside_a_forward_ends_every_rank_within_seconds(runs, case):
    _, agree_every = CASES[case]
    per_rank = runs[case]
    fault_at = per_rank[FAIL_RANK]["fault_at"]
    assert fault_at is not None, "the fault was not injected"
    after_fault = [round(out["raised_at"] - fault_at, 2) for out in per_rank]
    print(f"\n{case}: seconds from the fault to each rank's error: {after_fault}")
    for rank, out in enumerate(per_rank):
        error = out["error"]
        assert error is not None, f"rank {rank} finished although rank {FAIL_RANK} failed"
        assert after_fault[rank] < BOUND_S, f"rank {rank} raised {after_fault[rank]} s after the fault: {error}"
        assert f"rank {FAIL_RANK}: MMLUStepError: mmlu step {FAIL_AT_FORWARD} of " in error, error
        assert "RuntimeError: injected failure inside the forward" in error, error
        assert FAIL_RANK in out["ranks"], (rank, out["ranks"])
    # the peer was blocked in the EP all-to-all and released when rank 2's connections closed, long
    # before the group's 120 s timeout
    assert "Connection closed" in per_rank[BLOCKED_PEER]["error"], per_rank[BLOCKED_PEER]["error"]
    assert "the model's process groups were aborted on this rank" in per_rank[FAIL_RANK]["error"]
    if agree_every == 1:  # the ranks that did not fail gave up at the agreement after the failing step
        for rank in (0, 1):
            assert f"failed at mmlu step {FAIL_AT_FORWARD} of " in per_rank[rank]["error"], per_rank[rank]["error"]


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_agree_before_the_first_step_every_n_steps_and_after_the_last(runs, case):
    """From the same runs' healthy evaluations: ``agree_every`` sets the agreements between prepare
    and gather, and every rank makes the same ones."""
    per_rank = runs[case]
    steps = per_rank[0]["agreements"][None][0]
    assert steps >= 3, "too few steps to tell the cadences apart"
    want = {1: [f"{s} of {steps}" for s in range(1, steps)], 2: [f"{s} of {steps}" for s in range(2, steps, 2)],
            None: []}
    for rank, out in enumerate(per_rank):
        for every, (n_steps, calls) in out["agreements"].items():
            assert n_steps == steps and calls == ["prepare", *want[every], "gather"], (rank, every, calls)


def test_agree_every_is_checked():
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.evaluate.options import MMLUOptions

    assert MMLUOptions(agree_every=None).agree_every is None and MMLUOptions(agree_every=3).agree_every == 3
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(InputError, match="agree_every"):
            MMLUOptions(agree_every=bad)
