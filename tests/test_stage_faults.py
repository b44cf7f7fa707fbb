"""A fault in one rank of a recipe on pipeline stages ends every rank, and every survivor names it
(issue 42; docs/design.md#faults-and-how-each-is-reported).

4 CPU ranks, stage 0 on ranks 0-1 and stage 1 on ranks 2-3 (``parallel=pp``: FSDP2 inside a stage;
``parallel=pp_ep``: EP2 inside a stage), one fault on rank 1 (stage 0; rank 0, its FSDP or EP peer,
hosts the rendezvous store when launched as plain processes), injected by ``tests/fault_rank.py``:
a stall (600 s of sleep) or a raise inside its first decoder layer during the MMLU evaluation, or a
raise as the export's write step starts. Each case runs the recipe's own command line on real gloo
ranks, as 4 plain processes (the way srun starts them: no torchrun agent ends the job, only our own
timeouts) or under torchrun. What must hold: every rank ends within ``parallel.timeout_s`` + 60 s
of the fault; every survivor's error names the faulty rank and the step, and carries its exception
when it raised; a failed export publishes nothing, and the re-run with ``export.overwrite=replace``
verifies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_moe_export.export import verify_checkpoint
from test_recipe import run_cli

WORLD = 4
FAULTY = 1  # stage 0, beside rank 0 (the store's host when launched as plain processes)
TIMEOUT_S = 8  # parallel.timeout_s: every model group's
AGREE_S = 12  # mmlu.timeout_s and export.timeout_s: above the model groups' (docs/design.md)
BOUND_S = TIMEOUT_S + 60  # the bound on any rank's end after the fault
RANK_SCRIPT = Path(__file__).with_name("fault_rank.py")
QUICK = ["trainer.max_steps=1", "trainer.progress=false", "trainer.save_checkpoint=false", "mmlu.progress=false",
         "data.n_train=16", "data.n_test=4", f"parallel.timeout_s={TIMEOUT_S}", f"mmlu.timeout_s={AGREE_S}",
         f"export.timeout_s={AGREE_S}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Case:
    """One recipe run with one fault: per rank, its output, exit status and seconds from the fault to its end.

    ``launcher``: "plain" (4 plain processes, the way srun starts them), "agent" (torchrun's own
    elastic agent: ``tests/fault_rank.py --agent``) or "torchrun" (the ``torchrun`` command line)."""

    def __init__(self, tmp: Path, fault: dict, overrides: list[str], *, launcher: str) -> None:
        self.record = tmp / "fault_at"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "NME_FAULT": json.dumps({"rank": FAULTY, **fault, "record": str(self.record)})}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        args = [f"run_dir={tmp / 'run'}", *QUICK, *overrides]
        started = time.time()
        if launcher == "torchrun":
            self.run_torchrun(env, args, tmp)
        else:
            self.run_forked(env, args, tmp, launcher)
        self.seconds = time.time() - started
        self.fault_at = float(self.record.read_text()) if self.record.exists() else None

    def run_forked(self, env: dict, args: list[str], tmp: Path, launcher: str) -> None:
        env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        cmd = [sys.executable, str(RANK_SCRIPT), f"--{launcher}", str(WORLD), str(tmp), *args]
        started = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            started.wait(timeout=300)
        finally:
            if started.poll() is None:  # the session this test started: the launcher and its ranks
                os.killpg(started.pid, signal.SIGKILL)
                started.wait()
        ended = json.loads((tmp / "ended.json").read_text())
        self.ended = [ended[str(r)][0] for r in range(WORLD)]
        self.status = [ended[str(r)][1] for r in range(WORLD)]
        self.out = [(tmp / f"rank{r}.out").read_text() for r in range(WORLD)]

    def run_torchrun(self, env: dict, args: list[str], tmp: Path) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               "--tee=3", f"--log-dir={tmp / 'torchrun'}", str(RANK_SCRIPT), *args]
        with open(tmp / "torchrun.out", "w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            self.ended = self._watch([proc], deadline_s=240) * WORLD
            log.seek(0)
            text = log.read()
        self.status = [proc.returncode] * WORLD
        self.out = [text] * WORLD  # torchrun prefixes each rank's lines with [default<rank>]

    @staticmethod
    def _watch(procs: list, deadline_s: float) -> list[float]:
        """Wall time at which each process ended (polled every 50 ms); kills what is left at the deadline."""
        ended = [None] * len(procs)
        stop = time.monotonic() + deadline_s
        while None in ended and time.monotonic() < stop:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if ended[i] is None:
                p.kill()
                p.wait()
                ended[i] = float("inf")
        return ended

    def after_fault(self) -> list[float]:
        return [round(t - self.fault_at, 1) for t in self.ended]

    def summary(self, name: str) -> str:
        return f"{name}: whole run {self.seconds:.0f} s, each rank ended {self.after_fault()} s after the fault"


def _named_by(case: Case, ranks: tuple[int, ...], step: str, says: str) -> None:
    """Each of ``ranks`` ended with an error naming the faulty rank, the step and ``says``."""
    for rank in ranks:
        out = case.out[rank]
        assert case.status[rank] != 0, (rank, out[-3000:])
        assert _names(out, step, says), f"rank {rank} does not name rank {FAULTY}, {step!r} and {says!r}:\n{out[-4000:]}"


def _names(out: str, step: str, says: str) -> bool:
    return any((f"ranks [{FAULTY}]" in line or f"rank {FAULTY}:" in line) and step in line and says in line
               for line in out.splitlines())


def _within_bound(case: Case, name: str) -> None:
    assert case.fault_at is not None, "the fault was not injected: " + case.out[FAULTY][-3000:]
    print("\n" + case.summary(name))
    late = [(rank, s) for rank, s in enumerate(case.after_fault()) if s > BOUND_S]
    assert not late, f"ranks ended later than {BOUND_S} s after the fault: {late}"


def _rerun_verifies(tmp: Path, overrides: list[str]) -> None:
    """The same recipe again, without a fault (the same pre-imported launcher), replacing the target:
    it passes, leaves no partial directory, and the published checkpoint verifies."""
    again = tmp / "again"
    again.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "NME_FAULT": json.dumps({"rank": -1, "record": str(again / "none")})}
    cmd = [sys.executable, str(RANK_SCRIPT), "--plain", str(WORLD), str(again), f"run_dir={tmp / 'run'}", *QUICK,
           *overrides, "export.overwrite=replace"]
    subprocess.run(cmd, env=env, timeout=300, check=True)
    ended = json.loads((again / "ended.json").read_text())
    assert all(status == 0 for _, status in ended.values()), [(again / f"rank{r}.out").read_text()[-3000:]
                                                               for r in range(WORLD)]
    run_dir = tmp / "run"
    assert not [n for n in os.listdir(run_dir) if "partial" in n], os.listdir(run_dir)
    assert verify_checkpoint(str(run_dir / "hf")).ok


MMLU = ["recipe=deepseek_v3_tiny", "stages=[train,mmlu]"]
EXPORT = ["recipe=deepseek_v3_tiny", "mmlu.enabled=false", "stages=[train,export,verify]"]
TRAIN = ["recipe=deepseek_v3_tiny", "mmlu.enabled=false", "stages=[train]"]
PHASES = {"mmlu": MMLU, "export": EXPORT, "train": TRAIN}
# What a survivor's error says, by phase and kind: the step, and what it says of the faulty rank.
STEP = {("mmlu", "stall"): "mmlu step '1 of 1'", ("mmlu", "raise"): "mmlu step 1 of 1",
        ("export", "stall"): "export step 'write'", ("export", "raise"): "export step 'write'",
        ("export", "kill"): "export step 'write'",
        ("train", "stall"): "train step '1 of 1'", ("train", "raise"): "train step '1 of 1'"}
SAYS = {"stall": f"ranks [{FAULTY}] sent no report", "kill": f"ranks [{FAULTY}] sent no report",
        "raise": f"RuntimeError: injected failure on rank {FAULTY}"}
# The cases, (phase, kind, parallel, launcher); the matrix's other cases are the tests below this one.
MATRIX = [
    ("mmlu", "stall", "pp_ep", "plain"), ("mmlu", "stall", "pp", "agent"),
    ("mmlu", "raise", "pp", "plain"), ("mmlu", "raise", "pp", "agent"), ("mmlu", "raise", "pp_ep", "agent"),
    ("export", "stall", "pp", "plain"), ("export", "stall", "pp_ep", "plain"),
    ("export", "stall", "pp", "agent"), ("export", "stall", "pp_ep", "agent"),
    ("export", "raise", "pp", "plain"), ("export", "raise", "pp", "agent"), ("export", "raise", "pp_ep", "agent"),
    ("export", "kill", "pp", "plain"),
    ("train", "stall", "pp", "plain"), ("train", "raise", "pp", "plain"),
]


@pytest.mark.parametrize("phase,kind,parallel,launcher", MATRIX, ids=["-".join(c) for c in MATRIX])
def test_a_fault_is_named_by_every_survivor_and_ends_every_rank(phase, kind, parallel, launcher, tmp_path):
    """Plain processes: every survivor names the rank and the step (and carries its exception when
    it raised); a stalled rank is ended by its watchdog. Under the agent, which stops every rank
    once one ended, the first to end names it. A failed export publishes nothing; the re-run verifies."""
    overrides = [*PHASES[phase], f"parallel={parallel}"]
    case = Case(tmp_path, {"kind": kind, "where": phase, "call": 1 if phase == "train" else 2}, overrides,
                launcher=launcher)
    _within_bound(case, f"{kind} in {phase}, {parallel}, {launcher}")
    step, says = STEP[phase, kind], SAYS[kind]
    if launcher == "agent":
        assert any(_names(out, step, says) for out in case.out), "\n".join(out[-3000:] for out in case.out)
    else:
        survivors = tuple(r for r in range(WORLD) if r != FAULTY or kind == "raise")
        _named_by(case, survivors, step, says)
        if kind == "stall":
            assert f"rank {FAULTY} ended by its watchdog" in case.out[FAULTY], case.out[FAULTY][-3000:]
        if kind == "kill":
            assert case.status[FAULTY] == -signal.SIGKILL
    if phase == "export":
        run_dir = tmp_path / "run"
        assert not (run_dir / "hf").exists()
        if launcher == "plain":
            _rerun_verifies(tmp_path, overrides)


@pytest.mark.parametrize("parallel,torchrun", [("pp", False), ("pp_ep", True)], ids=["pp-plain", "pp_ep-torchrun"])
def test_a_rank_stalled_in_an_mmlu_forward_is_named_by_every_survivor(parallel, torchrun, tmp_path):
    """Its FSDP (or EP) peer waits in an all-gather (all-to-all), stage 1 in a receive: each gives up
    at parallel.timeout_s, and the coordinator, spanning the pipeline, names the rank that sent no report."""
    case = Case(tmp_path, {"kind": "stall", "where": "mmlu"}, [*MMLU, f"parallel={parallel}"],
                launcher="torchrun" if torchrun else "plain")
    _within_bound(case, f"stall, {parallel}, {'torchrun' if torchrun else 'plain processes'}")
    if torchrun:  # the agent ends the ranks once one fails: at least one survivor's report is printed
        said = [line for line in case.out[0].splitlines() if f"ranks [{FAULTY}] sent no report" in line]
        assert said and all("did not reach the end of step '1 of 1'" in line for line in said), case.out[0][-4000:]
        return
    # every survivor, blocked in an FSDP all-gather (rank 0) or a pipeline receive (ranks 2, 3)
    _named_by(case, (0, 2, 3), "step '1 of 1'", f"ranks [{FAULTY}] sent no report")
    assert f"rank {FAULTY} ended by its watchdog" in case.out[FAULTY], case.out[FAULTY][-3000:]


def test_a_rank_raising_in_an_mmlu_forward_is_carried_by_every_survivor(tmp_path):
    """Plain processes: rank 0, the store's host, is released first (its EP peer's process ended) and
    stays until rank 2, blocked in a receive from it, has read rank 1's report."""
    case = Case(tmp_path, {"kind": "raise", "where": "mmlu"}, [*MMLU, "parallel=pp_ep"], launcher="plain")
    _within_bound(case, "raise, pp_ep, plain processes")
    _named_by(case, tuple(range(WORLD)), "mmlu step 1 of 1", f"RuntimeError: injected failure on rank {FAULTY}")
    assert not any("rendezvous store is unreachable" in out for out in case.out), case.out


def test_a_failed_export_publishes_nothing_and_the_rerun_verifies(tmp_path):
    export = [*EXPORT, "parallel=pp_ep"]
    case = Case(tmp_path, {"kind": "raise", "where": "export"}, export, launcher="plain")
    _within_bound(case, "raise in the export's write, pp_ep, plain processes")
    _named_by(case, tuple(range(WORLD)), "step 'write'", f"RuntimeError: injected failure on rank {FAULTY}")
    run_dir = tmp_path / "run"
    assert not (run_dir / "hf").exists() and not [n for n in os.listdir(run_dir) if "partial" in n]
    run_cli([*export, f"run_dir={run_dir}", *QUICK, "export.overwrite=replace", "--nproc", str(WORLD)])
    assert verify_checkpoint(str(run_dir / "hf")).ok


def test_a_rank_stalled_in_a_megatron_core_stage_is_named_by_every_survivor(tmp_path):
    """megatron-core PP2 x EP2 (parallel_state's groups, made with parallel.timeout_s), plain processes."""
    overrides = ["recipe=megatron_deepseek_v3_tiny", "parallel=pp_ep", "stages=[train,mmlu]"]
    case = Case(tmp_path, {"kind": "stall", "where": "mmlu"}, overrides, launcher="plain")
    _within_bound(case, "stall, megatron-core pp_ep, plain processes")
    _named_by(case, (0, 2, 3), "step '1 of 1'", f"ranks [{FAULTY}] sent no report")


def test_the_evaluators_coordinator_joins_the_pipeline_peers():
    """Under pp on 4 ranks the stages' data-parallel groups [0, 1], [2, 3] and the pipelines [0, 2],
    [1, 3] make one coordinated group; without pipeline peers each data-parallel group stays alone."""
    from nemo_moe_export.evaluate.evaluator import _coupled

    assert _coupled([[0, 1], [0, 2], [0, 1], [1, 3], [2, 3], [0, 2], [2, 3], [1, 3]]) == [[0, 1, 2, 3]]
    assert _coupled([[0, 1], [0], [0, 1], [1], [2, 3], [2], [2, 3], [3]]) == [[0, 1], [2, 3]]


def test_a_wait_that_ended_is_told_from_a_failure():
    from nemo_moe_export.parallel import stopped_waiting

    def chained(root: BaseException) -> BaseException:
        try:
            try:
                raise root
            except BaseException as exc:
                raise RuntimeError("pipeline stage 1 on rank 2 failed") from exc
        except BaseException as outer:
            return outer

    assert stopped_waiting(chained(RuntimeError("[/x/unbound_buffer.cc:78] Timed out waiting 8000ms for recv")))
    assert stopped_waiting(chained(RuntimeError("[/x/pair.cc:553] Connection closed by peer [127.0.0.1]:1")))
    assert not stopped_waiting(chained(RuntimeError("injected failure on rank 1")))
    assert not stopped_waiting(None)
