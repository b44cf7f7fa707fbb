"""A fault in one rank of a recipe on pipeline stages ends every rank, and every survivor names it
(issue 42; docs/design.md#faults-and-how-each-is-reported; the measured table: docs/faults.md).

4 CPU ranks, stage 0 on ranks 0-1 and stage 1 on ranks 2-3 (``parallel=pp``: FSDP2 inside a stage;
``parallel=pp_ep``: EP2 inside a stage), one fault on rank 1 (stage 0; rank 0, its FSDP or EP peer,
hosts the rendezvous store when launched as plain processes), injected by ``tests/fault_rank.py``:
a stall (600 s of sleep) or a raise inside its first decoder layer, in training step 1 or during the
MMLU evaluation, or a stall, a raise or SIGKILL as the export's write step starts. Each case runs
the recipe's own command line on real gloo ranks, as 4 plain processes (the way srun starts them:
no torchrun agent ends the job, only our own timeouts), under torchrun's elastic agent, or (one
case) the torchrun command line. A megatron-core PP2 x EP2 model (``recipe=megatron_deepseek_v3_tiny``,
megatron-core's own groups) has the MMLU and export stall and raise, each as plain processes and
under torchrun's agent. What must hold: every rank ends within ``parallel.timeout_s`` + 60 s
of the fault; every survivor's error names the faulty rank and the step, and carries its exception
when it raised; a failed export publishes nothing, and the re-run with ``export.overwrite=replace``
verifies.

The cases run in the background two at a time (most of a case is waiting out a timeout), in the
tests' order, the longest first; each test waits for its own case and checks it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nemo_moe_export.export import verify_checkpoint

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
        tmp.mkdir(parents=True, exist_ok=True)
        self.record = tmp / "fault_at"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "NME_FAULT": json.dumps({"rank": FAULTY, **fault, "record": str(self.record)})}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        args = [f"run_dir={tmp / 'run'}", *QUICK, *overrides]  # a later run_dir= in overrides wins
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
    """The same recipe again in ``tmp / "run"``, without a fault (the same pre-imported launcher),
    replacing the target: it passes, leaves no partial directory, and the published checkpoint verifies."""
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


MMLU = ["stages=[train,mmlu]"]
EXPORT = ["mmlu.enabled=false", "stages=[train,export,verify]"]
TRAIN = ["mmlu.enabled=false", "stages=[train]"]
PHASES = {"mmlu": MMLU, "export": EXPORT, "train": TRAIN}
# What a survivor's error says, by phase and kind: the step, and what it says of the faulty rank.
STEP = {("mmlu", "stall"): "mmlu step '1 of 1'", ("mmlu", "raise"): "mmlu step 1 of 1",
        ("export", "stall"): "export step 'write'", ("export", "raise"): "export step 'write'",
        ("export", "kill"): "export step 'write'",
        ("train", "stall"): "train step '1 of 1'", ("train", "raise"): "train step '1 of 1'"}
SAYS = {"stall": f"ranks [{FAULTY}] sent no report", "kill": f"ranks [{FAULTY}] sent no report",
        "raise": f"RuntimeError: injected failure on rank {FAULTY}"}
# Every case: (phase, kind, parallel, launcher); "plain" is 4 plain processes, "agent" torchrun's
# elastic agent forked from a pre-imported launcher, "torchrun" the torchrun command line.
MATRIX = [  # the longest first (the exports as plain processes run as two chains), so none runs alone at the end
    ("export", "stall", "pp", "plain"), ("export", "stall", "pp_ep", "plain"),
    ("export", "raise", "pp", "plain"), ("export", "raise", "pp_ep", "plain"),
    ("export", "kill", "pp", "plain"),
    ("mmlu", "stall", "pp", "plain"), ("mmlu", "stall", "pp_ep", "plain"),
    ("mmlu", "stall", "pp", "agent"), ("mmlu", "stall", "pp_ep", "torchrun"),
    ("train", "stall", "pp", "plain"),
    ("export", "stall", "pp", "agent"), ("export", "stall", "pp_ep", "agent"),
    ("mmlu", "raise", "pp", "plain"), ("mmlu", "raise", "pp_ep", "plain"),
    ("mmlu", "raise", "pp", "agent"), ("mmlu", "raise", "pp_ep", "agent"),
    ("export", "raise", "pp", "agent"), ("export", "raise", "pp_ep", "agent"),
    ("train", "raise", "pp", "plain"),
]
# Also on a megatron-core PP2 x EP2 model, each phase and kind as plain processes and under torchrun's
# agent; the longest first: the export chain (stall, raise, then the re-run), then the stalls.
MEGATRON = [("export", "stall", "pp_ep", "plain"), ("export", "raise", "pp_ep", "plain"),
            ("mmlu", "stall", "pp_ep", "plain"), ("mmlu", "stall", "pp_ep", "agent"),
            ("export", "stall", "pp_ep", "agent"),
            ("mmlu", "raise", "pp_ep", "plain"), ("mmlu", "raise", "pp_ep", "agent"),
            ("export", "raise", "pp_ep", "agent")]
JOBS = int(os.environ.get("NME_FAULT_JOBS", "2"))  # cases run at once: mostly they wait out timeouts
WAIT_S = 900  # a test waits for its case, started after the cases before it: more than one case's 300 s


def _ids(case: tuple) -> str:
    return "-".join(case)


def _chains(keys: list[tuple]) -> list[list[tuple]]:
    """The cases in the order they run: one after another on one run_dir for the exports launched as
    plain processes of one layout (then one re-run verifies for all of them), else each alone."""
    chains: dict = {}
    for key in keys:
        phase, _, parallel, launcher, recipe = key
        chains.setdefault((parallel, recipe) if (phase, launcher) == ("export", "plain") else key, []).append(key)
    return list(chains.values())


def _run_chain(keys: list[tuple], tmp: Path) -> dict:
    """Each case of the chain (by key), on one run_dir: a failed export must publish nothing, and the
    next run, replacing the target, cleans what it left; a chain of exports ends with the re-run."""
    cases, overrides = {}, []
    for n, key in enumerate(keys):
        phase, kind, parallel, launcher, recipe = key
        overrides = [f"recipe={recipe}", *PHASES[phase], f"parallel={parallel}", f"run_dir={tmp / 'run'}"]
        fault = {"kind": kind, "where": phase, "call": 1 if phase == "train" else 2}
        case = Case(tmp / str(n), fault, [*overrides, *(["export.overwrite=replace"] if n else [])], launcher=launcher)
        case.rerun, case.published = None, (tmp / "run" / "hf").exists()
        cases[key] = case
    if (phase, launcher) == ("export", "plain"):
        try:
            _rerun_verifies(tmp, overrides)
        except BaseException as exc:  # reported by each case's test
            for case in cases.values():
                case.rerun = exc
    return cases


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Every case the session selected, started in the background ``JOBS`` at a time, in the tests'
    order (each test waits for its own): by key, the future of its chain's Cases (``_run_chain``)."""
    keys = [(*item.callspec.params["case"], item.callspec.params["recipe"])  # this module's cases only
            for item in request.session.items if getattr(item, "module", None) is request.module
            and getattr(item, "callspec", None) and "case" in item.callspec.params]
    pool = ThreadPoolExecutor(max_workers=JOBS)
    futures = {}
    for chain in _chains(keys):
        future = pool.submit(lambda c=chain: _run_chain(c, tmp_path_factory.mktemp(_ids(c[0]))))
        futures.update((key, future) for key in chain)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.timeout(WAIT_S)
@pytest.mark.parametrize("recipe", ["megatron_deepseek_v3_tiny"])
@pytest.mark.parametrize("case", MEGATRON, ids=[_ids(c) for c in MEGATRON])
def test_a_fault_in_a_megatron_core_stage_is_named_by_every_survivor(case, recipe, launched):
    """megatron-core PP2 x EP2 (parallel_state's groups, made with parallel.timeout_s), as plain
    processes and under torchrun's agent."""
    _check(case, recipe, launched)


@pytest.mark.timeout(WAIT_S)
@pytest.mark.parametrize("recipe", ["deepseek_v3_tiny"])
@pytest.mark.parametrize("case", MATRIX, ids=[_ids(c) for c in MATRIX])
def test_a_fault_is_named_by_every_survivor_and_ends_every_rank(case, recipe, launched):
    _check(case, recipe, launched)


def _check(case: tuple, recipe: str, launched: dict) -> None:
    """Every rank ends within parallel.timeout_s + 60 s of the fault. Plain processes: every survivor
    names the rank and the step (and carries its exception when it raised), also when rank 0, the
    store's host, ends first; a stalled rank is ended by its watchdog. Under torchrun, which stops
    every rank once one ended, a rank that ended by itself names it. A failed export publishes
    nothing, and (plain processes) the re-run with export.overwrite=replace verifies."""
    phase, kind, parallel, launcher = case
    result = launched[(*case, recipe)].result()[(*case, recipe)]
    _within_bound(result, f"{kind} in {phase}, {parallel}, {launcher}, {recipe}")
    step, says = STEP[phase, kind], SAYS[kind]
    if launcher != "plain":
        assert any(_names(out, step, says) for out in result.out), "\n".join(out[-3000:] for out in result.out)
    else:
        survivors = tuple(r for r in range(WORLD) if r != FAULTY or kind == "raise")
        _named_by(result, survivors, step, says)
        assert not any("rendezvous store is unreachable" in out for out in result.out), result.out
        if kind == "stall":
            assert f"rank {FAULTY} ended by its watchdog" in result.out[FAULTY], result.out[FAULTY][-3000:]
        if kind == "kill":
            assert result.status[FAULTY] == -signal.SIGKILL
    if phase == "export":
        assert not result.published
        if result.rerun is not None:
            raise result.rerun


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
