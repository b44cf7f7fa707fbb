"""Step-by-step agreement between ranks under a timeout: :class:`Coordinator`
(docs/design.md#coordination-protocol).

Each ``agree(step, error)`` is one all-reduce of a status word under a timeout (cost growing like
log W), so that:

* a rank that raised makes every rank raise the same error, naming the failing ranks, the step and
  each failing rank's original exception;
* a rank that died or stalls makes every other rank raise (within the timeout, or within seconds
  when its connection closed), naming the ranks that sent no report, instead of hanging;
* a rank that failed inside a collective step, whose peers may be blocked in that step's
  collectives, can :meth:`Coordinator.leave` instead of agreeing: it reports through the store and
  raises at once, and its peers name it at their next agreement.

Coordination runs on a gloo group (a side group made once per job, connected lazily, when the
group given is not gloo), because gloo honours timeouts on CPU; its all-reduces are butterflies,
``log2 W`` exchanges (``collectives.py``). A broken agreement is diagnosed through the rendezvous
store (:mod:`.reports`); how long each wait lasts is :mod:`.timeouts`.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_export.collectives import all_same, butterfly_all_reduce, fingerprint_words, forget_gloo_group, gloo_group
from nemo_moe_export.errors import InputError
from nemo_moe_export.parallel.reports import (Incomplete, PeerError, StoreReports, describe, first_line,
                                              stopped_waiting)
from nemo_moe_export.parallel.timeouts import (ALARM_CHECK_AFTER_S, ALARM_CHECK_EVERY_S, LEAVE_GRACE_S,
                                               REPORT_GRACE_S)
from nemo_moe_export.parallel.world import dist_info

__all__ = ["Coordinator"]


class _Background(threading.Thread):
    """``fn(*args)`` in a daemon thread; :meth:`wait` returns as soon as it ended. A call that never
    ends (a peer died mid-exchange) is left to the gloo group's own timeout."""

    def __init__(self, fn: Any, *args: Any) -> None:
        super().__init__(daemon=True)
        self._call, self._done, self.error = (fn, args), threading.Event(), None
        self.start()

    def run(self) -> None:
        fn, args = self._call
        try:
            fn(*args)
        except BaseException as exc:  # handed to the waiting thread
            self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


class Coordinator:
    """Step-by-step agreement between the ranks of ``group`` (default: the world), under a timeout.

    Each :meth:`agree` is one all-reduce of a status word (how many ranks failed the step, and any
    words the step shares), a butterfly of ``log2 W`` exchanges; only when some rank failed are the
    failures' messages gathered, so every rank's error carries every failing rank's original
    exception. When the all-reduce itself cannot finish (a rank died, stalls, or the group broke)
    the survivors diagnose through the rendezvous store instead of the broken group and name the
    ranks that sent no report, on every survivor
    (docs/design.md#coordination-protocol).
    """

    def __init__(self, group: Any = None, *, timeout_s: float = 600.0, name: str = "export") -> None:
        self.name = name
        self.timeout = timedelta(seconds=timeout_s)
        info = dist_info(group)
        self.rank, self.world_size = info.rank, info.world_size
        self.active = info.initialized and info.world_size > 1
        self.group = group
        self._broken_at: str | None = None
        if self.active and (group is None or dist.get_backend(group) != "gloo"):
            # A gloo side group over the same ranks, made once per job (collectives.gloo_group): CPU
            # collectives that honour our timeout, also beside NCCL, connected only where used. Like
            # any new_group, every rank of the world constructs the job's first Coordinator of a group.
            ranks = None if group is None else tuple(dist.get_process_group_ranks(group))
            self.group = gloo_group(ranks, self.timeout)
        self._reports = StoreReports(self) if self.active else None

    def global_rank(self, group_rank: int) -> int:
        if not self.active:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def agree(self, step: str, error: BaseException | None = None, *,
              sums: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every rank calls this after ``step``; raises on every rank unless all succeeded in time.

        ``sums`` (int64 words) ride on the same all-reduce: their sum over the ranks is returned
        once every rank succeeded (a rank that failed sends zeros). Checks that compare or count
        across ranks share the agreement this way instead of paying a collective each."""
        words = torch.zeros(1 + (0 if sums is None else sums.numel()), dtype=torch.int64)
        words[0] = 0 if error is None else 1
        if sums is not None and error is None:
            words[1:] = sums.reshape(-1)
        if not self.active:
            if error is not None:
                raise PeerError(f"{self.name} step '{step}' failed on rank {self.rank}: {describe(error)}",
                                step=step, ranks=[self.rank]) from error
            return None if sums is None else words[1:].reshape(sums.shape)
        self._reduce_in_time(step, words, "sum", error)
        if int(words[0]) != 0:
            raise self._failure(step, error)
        return None if sums is None else words[1:].reshape(sums.shape)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, step: str = "all-reduce") -> torch.Tensor:
        """Reduce a CPU tensor over the group in place (``op``: sum, max or min; log2 W rounds,
        under the coordinator's timeout); every rank gets the same bits. Returns it."""
        if self.active:
            self._reduce_in_time(step, tensor, op, None)
        return tensor

    def _reduce_in_time(self, step: str, tensor: torch.Tensor, op: str, error: BaseException | None) -> None:
        if self._broken_at is not None:
            raise PeerError(f"{self.name} step '{step}': coordination already broke at step '{self._broken_at}'",
                            step=step, ranks=[])
        try:
            self._all_reduce_in_time(tensor, op)
        except Incomplete as incomplete:
            self._broken_at = step
            forget_gloo_group(self.group)  # its pairs may hold this agreement's stray messages
            raise self._reports.diagnose(step, error, incomplete) from (error or incomplete.cause)

    def leave(self, step: str, error: BaseException) -> PeerError:
        """The error to raise on a rank that failed inside a collective step and will not attend
        the next agreement (docs/design.md#coordination-protocol).

        Its peers may be blocked in a collective that needs it, which nothing ends but this rank's
        process ending (or the collective's timeout): waiting at the agreement would keep every rank
        waiting for that timeout. So the rank posts its failure as its report to the next agreement
        and raises that agreement's alarm (peers waiting there give up within about a second and
        name it), waits up to the report grace for the others' reports, and the caller raises what
        this returns. The coordinator is broken afterwards.
        """
        if not self.active:
            return PeerError(f"{self.name} step '{step}' failed on rank {self.rank}: {describe(error)}",
                             step=step, ranks=[self.rank])
        self._reports.next_agreement()
        self._broken_at = step
        me = self._reports.me
        if stopped_waiting(error):  # the peers blocked by the same culprit give up in the same window
            leaving = Incomplete("its wait for them timed out or a connection closed",
                                  alarm=f"rank {me} stopped waiting for its peers during {self.name} step '{step}'")
            head = f"{self.name} step '{step}' did not complete (seen from rank {me}, which stopped waiting for its peers)"
            return self._reports.diagnose(step, error, leaving, grace_s=REPORT_GRACE_S, head=head)
        leaving = Incomplete("its peers may be blocked in a collective that needs it",
                              alarm=f"rank {me} failed during {self.name} step '{step}' and left without agreeing")
        head = f"{self.name} step '{step}' failed on rank {me}, which left without agreeing"
        return self._reports.diagnose(step, error, leaving, grace_s=LEAVE_GRACE_S, head=head)

    def _all_reduce_in_time(self, tensor: torch.Tensor, op: str) -> None:
        """Reduce ``tensor`` over the group, or raise ``Incomplete`` at the timeout, on a broken
        connection, or as soon as a peer reports (through the store) that this agreement broke.

        The all-reduce runs in a helper thread (:class:`_Background`) and this thread waits on its
        completion, woken the moment it ends: no polling delay. Only a slow agreement looks at the
        store, and then rarely (W ranks polling one store)."""
        self._reports.next_agreement()
        done = _Background(butterfly_all_reduce, tensor, self.group, op)
        started = time.monotonic()
        deadline = started + self.timeout.total_seconds()
        wait_s = ALARM_CHECK_AFTER_S
        while not done.wait(min(wait_s, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise Incomplete(self._late())
            try:
                alarm = self._reports.alarm()
            except Exception as exc:  # the store's host died (rank 0 when launched like srun)
                raise Incomplete(f"the rendezvous store stopped answering ({first_line(exc)})", cause=exc) from exc
            if alarm is not None:
                raise Incomplete(alarm)
            wait_s = ALARM_CHECK_EVERY_S
        if done.error is not None:  # gloo's own timeout (the group's is ours), or a closed connection
            if "Timed out" in str(done.error):
                raise Incomplete(self._late(), cause=done.error) from done.error
            raise Incomplete(f"the agreement collective broke ({first_line(done.error)})",
                              cause=done.error) from done.error

    def _late(self) -> str:
        return f"not every rank arrived within {self.timeout.total_seconds():.0f} s"

    def _failure(self, step: str, error: BaseException | None) -> PeerError:
        """Every rank arrived and some failed: gather the failures' messages (rare, so the cost of
        an object all-gather is paid only here) and name them on every rank."""
        statuses = self.all_gather(None if error is None else describe(error))
        failing = {self.global_rank(r): s for r, s in enumerate(statuses) if s is not None}
        details = "; ".join(f"rank {r}: {s}" for r, s in failing.items())
        return PeerError(f"{self.name} step '{step}' failed on ranks {list(failing)}: {details}",
                         step=step, ranks=list(failing))

    def all_gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank of the group, by group rank (``[obj]`` when alone)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def require_same(self, what: str, value: Any, *, key: str, hint: str | None = None,
                     summed: torch.Tensor | None = None) -> None:
        """Refuse, on every rank, unless every rank computed the same ``value`` (a plan digest, a
        fingerprint): ranks that built different plans would otherwise drift out of step or write
        different bytes. Compared through a fixed-size sum (``collectives.fingerprint_words``; pass
        ``summed`` when those words already rode on an agreement); only when they differ are the
        values gathered, so the error names which ranks hold which value."""
        if summed is None:
            summed = self.all_reduce(fingerprint_words(value), step=f"compare {what}")
        if not self.active or all_same(summed, self.world_size):
            return
        values = self.all_gather(value)
        by_value: dict[Any, list[int]] = {}
        for r, v in enumerate(values):
            by_value.setdefault(v, []).append(self.global_rank(r))
        raise InputError(
            f"ranks computed different {what}", key=key, expected=f"one {what} on every rank",
            actual="; ".join(f"ranks {ranks}: {v}" for v, ranks in by_value.items()),
            hint=hint or "every rank must run the same model, data and options",
        )
