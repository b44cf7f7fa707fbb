"""The step agreement (``parallel.Coordinator``) on real gloo ranks: every failure is named, on
every rank, with the original exception; a stalled or killed rank is named by every survivor
within seconds, also when the job was launched like srun (rank 0 hosts the rendezvous store).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from nemo_moe_export.spawn import spawn

STALL_TIMEOUT_S = 2.0


def _protocol_cases(rank: int, world: int) -> dict:
    """One process tree, three cases: a raising rank, a stalled rank, a clean agreement after."""
    from nemo_moe_export.parallel import Coordinator, PeerError

    out = {}
    raising = Coordinator(None, timeout_s=30, name="job")
    try:
        raising.agree("load", ValueError("bad shard 7") if rank == 2 else None)
        out["raised"] = None
    except PeerError as exc:
        out["raised"] = {"ranks": exc.ranks, "step": exc.step, "message": str(exc)}

    stalling = Coordinator(None, timeout_s=STALL_TIMEOUT_S, name="job")
    stalling.agree("warm up")
    started = time.monotonic()
    if rank == 1:
        time.sleep(4 * STALL_TIMEOUT_S)
    try:
        stalling.agree("write")
        out["stalled"] = None
    except PeerError as exc:
        out["stalled"] = {"ranks": exc.ranks, "message": str(exc), "seconds": time.monotonic() - started}

    fresh = Coordinator(None, timeout_s=30, name="next")
    fresh.agree("after")  # a broken coordinator does not poison a new one
    # nor the next one of the same ranks and timeout: the broken one's group was dropped, a new one made
    again = Coordinator(None, timeout_s=STALL_TIMEOUT_S, name="again")
    out["fresh"] = "ok" if again.group is not stalling.group and again.agree("after the stall") is None else "reused"
    return out


def test_failures_and_stalls_are_named_on_every_rank():
    per_rank = spawn(_protocol_cases, 4, timeout_s=120)
    for outcome in per_rank:
        raised = outcome["raised"]
        assert raised["ranks"] == [2] and raised["step"] == "load", raised
        assert "rank 2: ValueError: bad shard 7" in raised["message"]  # the original exception, everywhere
        assert outcome["fresh"] == "ok"
    for rank in (0, 2, 3):
        stalled = per_rank[rank]["stalled"]
        assert stalled["ranks"] == [1], stalled  # every survivor names the stalled rank, not only rank 0
        assert f"not every rank arrived within {STALL_TIMEOUT_S:.0f} s" in stalled["message"]
        assert stalled["seconds"] < 4 * STALL_TIMEOUT_S, stalled  # gave up before rank 1 woke
    late = per_rank[1]["stalled"]
    assert late["ranks"] == [1] and "arrived after its peers had given up" in late["message"], late


def test_fingerprint_words_summed_over_ranks_tell_equal_values_from_different_ones():
    from nemo_moe_export.collectives import all_same, butterfly_rounds, fingerprint_words

    def summed(values):
        return sum(fingerprint_words(v) for v in values)

    assert all_same(summed(["plan-a"] * 1024), 1024)
    assert not all_same(summed(["plan-a"] * 1023 + ["plan-b"]), 1024)
    assert not all_same(summed(["plan-a", "plan-b"]), 2)
    assert [butterfly_rounds(w) for w in (1, 2, 3, 4, 5, 8, 1000, 1024)] == [0, 1, 3, 2, 4, 3, 11, 10]


# --------------------------------------------------------------------------------------------------
# A rank killed in the export's write step, launched like srun (no torchrun: rank 0 hosts the store)
# --------------------------------------------------------------------------------------------------

_KILLED_WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch.distributed as dist
    from nemo_moe_export.export import SharedFilesystemWriter, export_hf_checkpoint
    from nemo_moe_export.parallel import PeerError
    from nemo_moe_export.tiny_models import tiny_model

    rank, victim, target, report = int(os.environ["RANK"]), int(sys.argv[1]), sys.argv[2], sys.argv[3]
    delay = float(sys.argv[4])  # seconds into the write step
    dist.init_process_group("gloo")
    model = tiny_model("qwen3_moe", n_experts=4)
    real_write = SharedFilesystemWriter.write

    def write(self, *args, **kwargs):
        if rank == victim:  # killed as its write starts, or `delay` seconds into it (its peers wait)
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)
        with open(report + ".fault", "w") as f:
            f.write(str(time.time()))
        return real_write(self, *args, **kwargs)

    SharedFilesystemWriter.write = write
    try:
        export_hf_checkpoint(target, model, timeout_s=60)
        outcome = {"error": None}
    except PeerError as exc:
        outcome = {"step": exc.step, "ranks": exc.ranks, "message": str(exc), "at": time.time()}
    with open(f"{report}.{rank}", "w") as f:
        json.dump(outcome, f)
    os._exit(0)  # the group is broken: skip destroy_process_group's goodbyes
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_like_srun(tmp_path, victim: int, world: int = 4, delay: float = 0.0) -> list[dict | None]:
    script = tmp_path / "worker.py"
    script.write_text(_KILLED_WORKER)
    report = str(tmp_path / "report")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [subprocess.Popen([sys.executable, str(script), str(victim), str(tmp_path / "hf"), report, str(delay)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path)
             for r in range(world)]
    for p in procs:
        try:
            p.wait(timeout=150)
        except subprocess.TimeoutExpired:
            p.kill()
    assert procs[victim].returncode == -signal.SIGKILL
    fault_at = float(open(report + ".fault").read())
    outcomes = []
    for r in range(world):
        path = f"{report}.{r}"
        outcome = json.load(open(path)) if os.path.exists(path) else None
        if outcome and "at" in outcome:
            outcome["seconds_after_fault"] = outcome.pop("at") - fault_at
        outcomes.append(outcome)
    return outcomes


def test_a_killed_rank_is_named_by_every_survivor(tmp_path):
    outcomes = _launch_like_srun(tmp_path, victim=2)
    for rank in (0, 1, 3):
        outcome = outcomes[rank]
        assert outcome is not None and outcome["step"] == "write", outcome
        assert outcome["ranks"] == [2], outcome
        assert "ranks [2] sent no report" in outcome["message"]
        assert outcome["seconds_after_fault"] < 15, outcome  # seconds, not the 60 s timeout
    assert not os.path.exists(tmp_path / "hf")
    assert [n for n in os.listdir(tmp_path) if n.startswith(".hf")] == []


@pytest.mark.parametrize("delay", [0.0, 0.3], ids=["at_write", "0.3s_into_write"])
def test_a_killed_rank_0_is_named_although_it_hosted_the_store(tmp_path, delay):
    outcomes = _launch_like_srun(tmp_path, victim=0, delay=delay)
    for rank in (1, 2, 3):
        outcome = outcomes[rank]
        assert outcome is not None and outcome["step"] == "write", outcome
        assert outcome["ranks"] == [0], outcome
        assert "rendezvous store is unreachable" in outcome["message"] and "rank 0" in outcome["message"]
        assert outcome["seconds_after_fault"] < 15, outcome
    assert not os.path.exists(tmp_path / "hf")
    left = [n for n in os.listdir(tmp_path) if n.startswith(".hf")]
    assert left == [], f"the survivors must clean what rank 0 could not: {left}"


# --------------------------------------------------------------------------------------------------
# Launched like srun, rank 0 keeps the store until every rank has read the reports (issue 42)
# --------------------------------------------------------------------------------------------------

_LATE_READER = textwrap.dedent("""
    import json, os, sys, time
    import torch.distributed as dist
    from nemo_moe_export.parallel import Coordinator, PeerError

    rank, report = int(os.environ["RANK"]), sys.argv[1]
    dist.init_process_group("gloo")
    coordinator = Coordinator(None, timeout_s=30, name="mmlu")
    coordinator.agree("prepare")
    if rank == 2:  # blocked in a collective with a live peer, released by a closed connection, late
        time.sleep(15)
    error = (RuntimeError("injected failure on rank 1") if rank == 1 else
             RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
    outcome = {"message": str(coordinator.leave("3 of 5", error)), "read_at": time.time()}
    with open(f"{report}.{rank}", "w") as f:
        json.dump(outcome, f)
    sys.exit(1)  # a normal exit: what runs at exit runs
""")


def test_the_store_host_stays_until_a_late_survivor_has_read_the_reports(tmp_path):
    """Rank 1 fails, ranks 0 and 3 stop waiting at once, rank 2 only 15 s later (its collective
    ended late): rank 0, which hosts the store, reads the reports at the 2-5 s deadline but stays
    until rank 2 has read them too. Before, it left 1 s after the deadline, and rank 2 could only
    say that the store was unreachable."""
    script = tmp_path / "worker.py"
    script.write_text(_LATE_READER)
    report = str(tmp_path / "report")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "4",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [subprocess.Popen([sys.executable, str(script), report], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(4)]
    ended = [None] * 4
    deadline = time.monotonic() + 150
    while None in ended and time.monotonic() < deadline:
        ended = [time.time() if e is None and p.poll() is not None else e for e, p in zip(ended, procs)]
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    outcomes = [json.load(open(f"{report}.{r}")) for r in range(4)]
    print(f"\nrank 2 read the reports at {outcomes[2]['read_at'] - outcomes[1]['read_at']:.1f} s after rank 1 "
          f"left; rank 0 ended {ended[0] - outcomes[2]['read_at']:.1f} s after that")
    late = outcomes[2]["message"]
    assert "unreachable" not in late and "rank 1: RuntimeError: injected failure on rank 1" in late, late
    assert ended[0] >= outcomes[2]["read_at"], "rank 0 ended before rank 2 had read the reports"
    assert ended[0] - outcomes[2]["read_at"] < 10, "rank 0 stayed well past the last reader"
