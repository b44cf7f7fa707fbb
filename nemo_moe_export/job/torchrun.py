"""Local ranks for ``--nproc N``: torchrun started, watched and stopped with the job.

Stopping works on both sides (docs/design.md#faults-and-how-each-is-reported):

* the launcher (:func:`run_torchrun`) starts torchrun (quiet when stopped) in a process group of
  its own, so a terminal's Ctrl-C reaches only the launcher, which forwards SIGINT, SIGTERM or
  SIGHUP to torchrun exactly once (torchrun passes it to every rank and gives them 30 s before
  SIGKILL). It waits for torchrun and for the ranks it had when the signal came; after
  :data:`STOP_GRACE_S`, or at a second signal, it kills whatever is left. It never returns while
  one of its ranks still runs.
* each rank (:func:`stop_on_signals`) turns the first such signal into :class:`Stopped`, raised in
  its main thread, so an export in flight takes its failure path (the partial directory is
  removed, the target is untouched) instead of running on to publish; it ends at the latest
  :data:`STOP_CLEANUP_S` after the signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nemo_moe_export.errors import InputError, Stopped

__all__ = ["RANK0_SPEAKS_S", "STOP_CLEANUP_S", "STOP_GRACE_S", "STOP_SIGNALS", "check_local_resources",
           "leave_after_rank0", "run_torchrun", "stop_on_signals", "stopped_by"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 45.0  # torchrun's own grace for its ranks is 30 s; this is the launcher's, on top
STOP_CLEANUP_S = 10.0  # how long a stopped rank may take to unwind (clean up) before it just exits
RANK0_SPEAKS_S = 5.0  # how long a rank other than 0 that refused its input waits before it exits
_stopped_by: int | None = None  # the stop signal this rank received, if any
# torchrun itself (``torch.distributed.run``), minus the traceback it prints when a signal stops it:
# that stop is the user's, and the launcher reports it in one line. Inline, so torchrun starts
# without importing this package.
_QUIET_TORCHRUN = """import sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main
try:
    main(sys.argv[1:])
except SignalException as exc:
    sys.exit(128 + int(exc.sigval))
"""


def _say(message: str) -> None:
    print(f"nemo-moe-export: {message}", file=sys.stderr, flush=True)


# --- the launcher --------------------------------------------------------------------------------------


def check_local_resources(nproc: int, device: str) -> None:
    """Refuse more ranks than GPUs with ``parallel.device=cuda``; warn when ``nproc`` CPU ranks
    outnumber the visible cores (they would share cores and memory, each holding the full model
    until it is sharded)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < nproc:
        raise InputError("not enough GPUs for one per rank", key="--nproc",
                         expected=f"<= {gpus} (the visible GPUs) with parallel.device=cuda", actual=nproc)
    if device == "cuda" or (device == "auto" and gpus >= nproc):
        return
    if device == "auto" and gpus:
        _say(f"warning: --nproc {nproc} but only {gpus} GPU(s) visible: parallel.device=auto runs every rank "
             "on the CPU")
    if nproc > cores:
        _say(f"warning: --nproc {nproc} starts {nproc} CPU ranks on {cores} visible core(s): they will share cores "
             f"and memory (each builds the full model before sharding); --nproc {cores} or fewer fits this machine")


def run_torchrun(nproc: int, argv: list[str]) -> int:
    """Run ``python -m nemo_moe_export ARGV`` on ``nproc`` local ranks with torchrun (gloo on CPU)
    and return its exit status, or ``128 + signal`` when the job was stopped by a signal."""
    cmd = [sys.executable, "-c", _QUIET_TORCHRUN, "--standalone", f"--nproc-per-node={nproc}",
           "-m", "nemo_moe_export", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Its own process group: a terminal's Ctrl-C reaches only us, and torchrun hears it once, from us
    # (a second SIGINT during torchrun's shutdown would abort that shutdown and orphan the ranks).
    proc = subprocess.Popen(cmd, env=env, process_group=0)
    stop: dict = {}

    def forward(signum: int, frame: object) -> None:
        if stop:
            stop["now"] = True  # a second signal: no more waiting
            return
        stop.update(signum=signum, at=time.monotonic(), ranks=_descendants(proc.pid))
        _say(f"{signal.Signals(signum).name} received: stopping torchrun and its {len(stop['ranks'])} process(es)")
        _send(proc.pid, signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        status = _wait(proc, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not stop:
        return status
    killed = _kill_survivors(stop["ranks"])
    _say(f"stopped by {signal.Signals(stop['signum']).name}: every rank exited "
         f"{time.monotonic() - stop['at']:.1f} s after the signal" + (f" ({killed} killed)" if killed else ""))
    return 128 + stop["signum"]


def _wait(proc: subprocess.Popen, stop: dict) -> int:
    """torchrun's exit status; once stopping, torchrun and its ranks are killed at a second signal
    or after the grace period."""
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            if stop and (stop.get("now") or time.monotonic() - stop["at"] > STOP_GRACE_S):
                for pid, started in [(proc.pid, None), *stop["ranks"]]:
                    if started is None or _alive(pid, started):
                        _send(pid, signal.SIGKILL)


def _kill_survivors(ranks: list[tuple[int, str]], wait_s: float = 5.0) -> int:
    """Wait briefly for the ranks torchrun had to be gone; kill any that outlived it."""
    deadline = time.monotonic() + wait_s
    while any(_alive(*r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid, started in ranks if _alive(pid, started)]
    for pid in survivors:
        _send(pid, signal.SIGKILL)
    return len(survivors)


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name: [state, ppid, ..., starttime at 19]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str) -> bool:
    """``pid`` is still the process that started at ``started`` and has not exited (a zombie has)."""
    fields = _stat(pid)
    return fields is not None and fields[19] == started and fields[0] not in ("Z", "X")


def _descendants(root: int) -> list[tuple[int, str]]:
    """Every process below ``root`` as ``(pid, start time)``: torchrun's ranks and what they started."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry))
            starts[int(entry)] = fields[19]
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append((pid, starts[pid]))
        todo += children.get(pid, [])
    return found


# --- each rank -----------------------------------------------------------------------------------------


def leave_after_rank0() -> None:
    """On a rank other than 0 that refuses an input every rank refuses (rank 0 says why), wait
    :data:`RANK0_SPEAKS_S` before exiting: torchrun's agent ends every rank as soon as one fails,
    and rank 0, which may have started a second later, was once ended before it printed its line."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(RANK0_SPEAKS_S)


def stopped_by() -> int | None:
    """The stop signal this process received (under :func:`stop_on_signals`), if any."""
    return _stopped_by


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, the first SIGINT, SIGTERM or SIGHUP raises :class:`Stopped` in the main
    thread, and the process ends at the latest :data:`STOP_CLEANUP_S` later; a second one ends it
    at once."""
    def raise_stopped(signum: int, frame: object) -> None:
        global _stopped_by
        if _stopped_by is not None:
            os._exit(128 + signum)
        _stopped_by = signum
        # Unwinding may wait on peers (the export agrees on its failure before discarding its
        # partial directory); past this bound the rank ends regardless, well inside torchrun's 30 s.
        watchdog = threading.Timer(STOP_CLEANUP_S, os._exit, args=(128 + signum,))
        watchdog.daemon = True
        watchdog.start()
        raise Stopped(signum)

    previous = {s: signal.signal(s, raise_stopped) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

