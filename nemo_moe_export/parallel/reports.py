"""What a rank raises when an agreement fails, and how the survivors of a broken agreement find out
who failed (docs/design.md#coordination-protocol).

:class:`PeerError` names the step, the failing ranks and each one's exception. When the agreement's
all-reduce itself cannot finish (a rank died, stalls, or the group broke), :class:`StoreReports`
exchanges reports through the rendezvous store, which outlives the group: each survivor posts
"ok" or its own failure, raises the alarm, and waits for the others' reports up to one deadline
shared by all. The stall is attributed by :func:`_verdict`: ranks that failed by themselves first,
then ranks that sent no report, then ranks that only stopped waiting (:func:`stopped_waiting`).
Rank 0, when its process hosts the store, holds it until every survivor could read the reports.
"""

from __future__ import annotations

import re
import time
from typing import Any

from torch.distributed.distributed_c10d import _get_default_store

from nemo_moe_export.parallel.timeouts import HOST_LINGER_S, REPORT_GRACE_S, model_group_timeout_s
from nemo_moe_export.watchdog import hold_store_for_peers, mark_done, store_hosted_by_rank0

__all__ = ["Incomplete", "PeerError", "StoreReports", "describe", "first_line", "stopped_waiting"]


class PeerError(RuntimeError):
    """A collective step failed on some rank, or some rank did not reach it in time."""

    def __init__(self, message: str, *, step: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks


# A report that says "this rank only stopped waiting for its peers" (a timeout, a closed connection),
# as opposed to a failure of its own: such ranks are not the culprits of the step.
_WAITED = "waited|"


class Incomplete(Exception):
    """The agreement's all-reduce did not finish: timeout, a broken connection, or a peer's alarm."""

    def __init__(self, reason: str, cause: BaseException | None = None, alarm: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.cause, self.alarm = reason, cause, alarm


def describe(error: BaseException) -> str:
    """``Type: message``, without the C++ source locations gloo puts before its messages (a report
    is read by a person: "Connection closed by peer" says it, ``[/.../pair.cc:553]`` does not)."""
    return f"{type(error).__name__}: " + re.sub(r"\[/[^\]]*:\d+\] ", "", str(error))


def first_line(exc: BaseException) -> str:
    """The gist of a transport error: gloo's source location and boilerplate advice removed."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(" This is typically caused", 1)[0][:300]


class StoreReports:
    """Diagnosis of a broken agreement through the rendezvous store, which outlives the group.

    Keys live under ``nemo_moe_export/<group name>/<agreement number>/``: ``alarm`` (set by the
    first rank that found the agreement broken, so peers still waiting give up at once) and one
    ``report/<rank>`` per survivor ("ok" or its own failure). Nothing is written while all is well.
    """

    _per_group: dict[str, int] = {}

    def __init__(self, coordinator: Any) -> None:  # the Coordinator whose agreements it diagnoses
        self.coordinator = coordinator
        self.store = _get_default_store()
        # Coordinators may share a group (the evaluator reuses one per DP group): number them per
        # group, in construction order, which is the same on every rank.
        name = coordinator.group.group_name
        StoreReports._per_group[name] = instance = StoreReports._per_group.get(name, 0) + 1
        self.base = f"nemo_moe_export/{name}/{instance}"
        self.agreement = 0
        self.me = coordinator.global_rank(coordinator.rank)

    def next_agreement(self) -> None:
        self.agreement += 1

    def _key(self, *parts: Any) -> str:
        return "/".join([self.base, str(self.agreement), *map(str, parts)])

    def alarm(self) -> str | None:
        key = self._key("alarm")
        return self.store.get(key).decode() if self.store.check([key]) else None

    def diagnose(self, step: str, error: BaseException | None, incomplete: Incomplete, *,
                 head: str | None = None, grace_s: float = REPORT_GRACE_S) -> PeerError:
        coordinator = self.coordinator
        head = head or f"{coordinator.name} step '{step}' could not be agreed (seen from rank {self.me})"
        try:
            reports, grace_s = self._exchange_reports(error, incomplete, grace_s)
        except Exception as exc:  # the store's host is gone too
            host = 0 if store_hosted_by_rank0() else None
            return PeerError(f"{head}: {incomplete.reason}; the rendezvous store is unreachable as well "
                             f"({first_line(exc)}): its host ({'rank 0' if host == 0 else 'the launcher'}) "
                             "has likely died", step=step, ranks=[] if host is None else [host])
        everyone = [coordinator.global_rank(r) for r in range(coordinator.world_size)]
        missing = [r for r in everyone if r not in reports]
        waited = {r: text[len(_WAITED):] for r, text in reports.items() if text.startswith(_WAITED)}
        failed = {r: text for r, text in reports.items() if text != "ok" and r not in waited}
        if not missing and not failed and not waited:  # every peer had reported: they gave up waiting for this rank
            alarm = self.alarm() or "no reason given"
            return PeerError(f"{head}: this rank arrived after its peers had given up ({alarm})",
                             step=step, ranks=[self.me])
        culprits = sorted(failed) or missing or sorted(waited)  # a rank that failed by itself first
        return PeerError(_verdict(head, step, incomplete.reason, missing, failed, waited, grace_s), step=step,
                         ranks=culprits)

    def _exchange_reports(self, error: BaseException | None, incomplete: Incomplete,
                          grace_s: float) -> tuple[dict[int, str], float]:
        """Post this rank's report, raise the alarm, wait up to the grace for the others' reports;
        the reports and the grace the deadline was set with (the first survivor's)."""
        store = self.store
        store.set(self._key("report", self.me), _report(error))
        if not store.check([self._key("alarm")]):
            store.set(self._key("alarm"), incomplete.alarm or f"rank {self.me} found this agreement broken: "
                                                              f"{incomplete.reason}")
        count = store.add(self._key("reported"), 1)
        # One deadline for every survivor, the first one's (wall clock): a survivor that noticed
        # late still reads the reports before the others, the store's host among them, move on.
        deadline, grace_s = map(float, store.compare_set(self._key("deadline"), "",
                                                         f"{time.time() + grace_s!r} {grace_s!r}").decode().split())
        world = self.coordinator.world_size
        while count < world and time.time() < deadline:
            time.sleep(0.05)
            count = store.add(self._key("reported"), 0)
        everyone = [self.coordinator.global_rank(r) for r in range(world)]
        keys = {r: self._key("report", r) for r in everyone}
        reports = {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}
        mark_done()  # this rank read what it needs from the store
        if self.me == 0 and store_hosted_by_rank0():  # its store ends with its process
            time.sleep(HOST_LINGER_S)
            hold_store_for_peers(deadline + self._blocked_s(reports) + REPORT_GRACE_S)
        return reports, grace_s

    def _blocked_s(self, reports: dict[int, str]) -> float:
        """How long after the reports' deadline a survivor may still be blocked in a model collective
        and come to read them: when a rank failed by itself, its peers blocked in a collective with a
        live rank wait for that group's timeout; when every report is a wait, they already waited it."""
        if all(text == "ok" or text.startswith(_WAITED) for text in reports.values()):
            return 0.0
        return model_group_timeout_s() or self.coordinator.timeout.total_seconds()


def _report(error: BaseException | None) -> str:
    """This rank's report: "ok", a wait that ended (tagged: it names no culprit), or its failure."""
    if error is None:
        return "ok"
    return (_WAITED if stopped_waiting(error) else "") + describe(error)


def _verdict(head: str, step: str, reason: str, missing: list[int], failed: dict[int, str],
             waited: dict[int, str], grace_s: float) -> str:
    """The message every survivor raises: the culprits first (ranks that failed by themselves, ranks
    that never reached the step), then the ranks that only stopped waiting for them."""
    parts = [f"{head}: {reason}"]
    if failed:
        parts.append(f"failed on ranks {sorted(failed)}: "
                     + "; ".join(f"rank {r}: {t}" for r, t in sorted(failed.items())))
    if missing and failed:  # most likely still blocked in a collective with a failed rank
        parts.append(f"ranks {missing} sent no report within {grace_s:.0f} s of the first (blocked in a collective "
                     "that needs a failed rank, or stalled, or dead)")
    elif missing:  # every report only waited for them: they are the culprits
        parts.append(f"ranks {missing} sent no report within {grace_s:.0f} s of the first: they did not reach the end "
                     f"of step '{step}' (stalled or dead)")
    if waited:
        parts.append(f"ranks {sorted(waited)} stopped waiting for them ("
                     + "; ".join(f"rank {r}: {t[:300]}" for r, t in sorted(waited.items())) + ")")
    return "; ".join(parts)


def stopped_waiting(error: BaseException | None) -> bool:
    """Whether ``error`` only says that this rank stopped waiting for its peers: its root cause is a
    collective's timeout or a peer's closed connection (gloo's words), not a failure of its own."""
    seen: set[int] = set()
    root = None
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        root, error = error, error.__cause__ or error.__context__
    text = str(root or "")
    return any(words in text for words in ("Timed out", "Connection closed", "Connection reset", "Broken pipe"))
