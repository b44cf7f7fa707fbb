"""How a failed job ends on every rank, also without a launcher that ends it
(docs/design.md#faults-and-how-each-is-reported, "A failed job ends everywhere").

Launched as plain processes (srun, mpirun with ``env://``), nothing outside the ranks ends a job
one of whose ranks failed: torchrun's agent would, srun by default does not. Two things here make
the ranks do it themselves, through the rendezvous store (which outlives the process groups):

* :func:`report_job_failure`: a rank whose job raised posts its error once, first one wins, under
  ``nemo_moe_export/job/failed``. :func:`watch_job` (armed by the recipe on every rank) waits for
  that key on a connection of its own (a blocking wait on the store's server: no polling, nothing
  written while all is well). When it appears, a rank that has not failed by itself within
  :data:`WATCH_GRACE_S` (stalled in user code, or blocked in a collective whose timeout is longer)
  prints the first failure, which names the failing rank, its step and its exception, and ends.
* :func:`hold_store_for_peers`: the rank whose process hosts the store (rank 0 launched like srun)
  stays, at exit, until every rank is done with the store (:func:`mark_done`: it read the failure
  reports, or its watchdog ended it) or a deadline passed, so a survivor never learns less because
  the store's host failed first.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

__all__ = ["WATCH_GRACE_S", "finished", "hold_store_for_peers", "mark_done", "report_job_failure",
           "store_hosted_by_rank0", "watch_job"]

WATCH_GRACE_S = 15.0
"""How long a rank may still run after another rank's job failed: longer than a survivor's own
diagnosis (the report grace, 5 s, and its wait for reports), so a rank that reports by itself is
never cut short; ranks ended here are the stalled and the blocked."""
_FAILED = "nemo_moe_export/job/failed"
_DONE = "nemo_moe_export/job/done"
_WAIT_CHUNK = timedelta(hours=1)  # the store's wait needs a timeout: waited again while all is well
_state: dict[str, Any] = {"done": False, "finished": False, "failing": False, "hold": None}


def _job_store() -> Any:
    """The rendezvous TCPStore under the default group's prefixes, or None (a file store, no group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def store_hosted_by_rank0() -> bool:
    """Under torchrun the launcher's agent hosts the store; launched otherwise (srun, mpirun with
    ``env://``) the TCPStore server runs inside rank 0."""
    return _job_store() is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def report_job_failure(error: BaseException) -> None:
    """Post this rank's failure as the job's, unless a rank posted first; this rank is then done
    with the store. A best effort: the store's host may be gone."""
    _state["failing"] = True
    store = _job_store()
    if store is None:
        return
    text = f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
    try:
        store.compare_set(_FAILED, "", text[:4000])
    except Exception:  # the store's host died: the peers learn it from the store itself
        pass
    mark_done()


def finished() -> None:
    """This rank's job ended without an error: its watchdog must not take the store's host going
    away (rank 0 ending first) for a failure."""
    _state["finished"] = True


def mark_done() -> None:
    """This rank needs the store no more (it read the failure reports, or is ending): counted once."""
    store = _job_store()
    if store is None or _state["done"]:
        return
    _state["done"] = True
    try:
        store.add(_DONE, 1)
    except Exception:
        pass


def hold_store_for_peers(deadline: float) -> None:
    """On the store's host: at exit, wait until every rank is done with the store or ``deadline``
    (wall clock) passed. A later call moves the deadline; the wait is registered once."""
    if dist.get_rank() != 0 or not store_hosted_by_rank0():
        return
    if _state["hold"] is None:  # what the wait needs, taken now: at exit the group may be gone
        atexit.register(_hold, _job_store(), dist.get_world_size())
    _state["hold"] = max(deadline, _state["hold"] or 0.0)


def _hold(store: Any, world: int) -> None:
    deadline = _state["hold"]
    try:
        while store.add(_DONE, 0) < world and time.time() < deadline:
            time.sleep(0.05)
    except Exception:
        pass


def watch_job(grace_s: float = WATCH_GRACE_S) -> None:
    """Arm this rank's watchdog (once per process; nothing without a TCP rendezvous store): when
    another rank posts the job's failure, or the store's host is gone, and this rank has neither
    failed nor finished ``grace_s`` later, it prints why and ends with status 1."""
    store = _job_store()
    if store is None or _state.get("watching"):
        return
    _state["watching"] = True
    own = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False)
    threading.Thread(target=_watch, args=(own, dist.get_rank(), grace_s), daemon=True,
                     name="nemo_moe_export-watchdog").start()


def _watch(store: Any, rank: int, grace_s: float) -> None:
    reason = _wait_for_failure(store)
    time.sleep(grace_s)
    if _state["failing"] or _state["finished"]:
        return
    mark_done()
    print(f"nemo-moe-export: rank {rank} ended by its watchdog: {reason}, and this rank was still running "
          f"{grace_s:.0f} s later (stalled, or blocked in a collective that needs a failed rank)",
          file=sys.stderr, flush=True)
    os._exit(1)


def _wait_for_failure(store: Any) -> str:
    """Block until the job's failure is posted (its text) or the store is gone (why)."""
    while True:
        try:
            store.wait([_FAILED], _WAIT_CHUNK)
            return f"the job failed on {store.get(_FAILED).decode()}"
        except dist.DistStoreError:  # the wait's own timeout: all is still well
            continue
        except Exception as exc:
            return (f"the rendezvous store stopped answering ({type(exc).__name__}): its host (rank 0 when "
                    "launched without torchrun) has ended")
