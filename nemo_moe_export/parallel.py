"""Process groups and hang-free coordination between ranks.

:class:`Coordinator` is how multi-step collective work (export, evaluation) agrees, step by step,
that every rank succeeded. Each ``agree(step, error)`` is one all-reduce of a status word under a
timeout (cost growing like log W), so that:

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
store, which outlives the group (docs/design.md#coordination-protocol).

:class:`ParallelLayout` / :func:`discover_layout` say which ranks share a data-parallel,
expert-parallel and expert-data-parallel group (from Megatron, a named DeviceMesh or the plain
world); :func:`init_expert_parallel` creates Megatron's EP layout without Megatron.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout
from torch.distributed.tensor import DTensor

from nemo_moe_export.collectives import all_same, butterfly_all_reduce, fingerprint_words, forget_gloo_group, gloo_group
from nemo_moe_export.errors import InputError
from nemo_moe_export.watchdog import hold_store_for_peers, mark_done, store_hosted_by_rank0

__all__ = [
    "DEVICES",
    "Coordinator",
    "ParallelLayout",
    "PeerError",
    "RankGroup",
    "bound_groups",
    "discover_layout",
    "dist_info",
    "is_global_rank0",
    "expert_parallel_groups",
    "init_distributed",
    "init_expert_parallel",
    "model_groups",
    "resolve_device",
]


class PeerError(RuntimeError):
    """A collective step failed on some rank, or some rank did not reach it in time."""

    def __init__(self, message: str, *, step: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    initialized: bool


def dist_info(group: Any = None) -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(group), dist.get_world_size(group), True)
    return DistInfo(0, 1, False)


def is_global_rank0() -> bool:
    """True on the world's rank 0, and in a process with no process group (the one rank there is)."""
    return dist_info().rank == 0


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(requested: str = "auto") -> str:
    """``"cuda"`` or ``"cpu"`` for this rank.

    ``auto`` takes one GPU per local rank when the machine has a GPU for every local rank
    (``LOCAL_WORLD_SIZE``, set by torchrun), else the CPU. ``cuda`` without enough GPUs is refused
    rather than silently run on the CPU.
    """
    if requested not in DEVICES:
        raise InputError("unknown device", key="parallel.device", expected=DEVICES, actual=repr(requested))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu" or (requested == "auto" and gpus < local_ranks):
        return "cpu"
    if gpus < local_ranks:
        raise InputError("not enough GPUs for one per local rank", key="parallel.device",
                         expected=f"{local_ranks} visible GPUs", actual=gpus,
                         hint="run fewer ranks per node, or parallel.device=cpu")
    return "cuda"


def init_distributed(device: str, timeout_s: float) -> None:
    """Initialise the default process group from torchrun's environment, if not yet done.

    NCCL when ranks run on GPUs (each on ``cuda:LOCAL_RANK``), gloo on CPUs. Coordination steps
    still run on a gloo side group (:class:`Coordinator`), which honours timeouts.
    """
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if device == "cuda":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                                **kwargs)


# How an agreement waits (docs/design.md#coordination-protocol). A healthy agreement takes
# milliseconds, so only a slow one looks at the store, and then rarely: W ranks polling one store.
_ALARM_CHECK_AFTER_S = 1.0
_ALARM_CHECK_EVERY_S = 0.5
_REPORT_GRACE_S = 5.0  # how long survivors wait for each other's reports once an agreement broke
# How long a rank that leaves after failing a step waits for reports: peers waiting at the agreement
# answer its alarm within about a second; peers blocked in a collective that needs it cannot answer
# before its process ends, which its waiting only delays.
_LEAVE_GRACE_S = 2.0
# How long rank 0, when its process hosts the store (launched like srun), stays after reading the
# reports, so the survivors that read them at the same deadline find the store still there; at exit
# it stays longer, until every rank is done with the store (watchdog.hold_store_for_peers).
_HOST_LINGER_S = 1.0
# A report that says "this rank only stopped waiting for its peers" (a timeout, a closed connection),
# as opposed to a failure of its own: such ranks are not the culprits of the step.
_WAITED = "waited|"
# The longest a wait of a model collective lasts (bound_groups): the longest a survivor blocked in
# one may take to report. None until a job bounds its groups.
_GROUP_TIMEOUT: dict[str, float | None] = {"s": None}


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


class _Incomplete(Exception):
    """The agreement's all-reduce did not finish: timeout, a broken connection, or a peer's alarm."""

    def __init__(self, reason: str, cause: BaseException | None = None, alarm: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.cause, self.alarm = reason, cause, alarm


def _describe(error: BaseException) -> str:
    """``Type: message``, without the C++ source locations gloo puts before its messages (a report
    is read by a person: "Connection closed by peer" says it, ``[/.../pair.cc:553]`` does not)."""
    return f"{type(error).__name__}: " + re.sub(r"\[/[^\]]*:\d+\] ", "", str(error))


def _first_line(exc: BaseException) -> str:
    """The gist of a transport error: gloo's source location and boilerplate advice removed."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(" This is typically caused", 1)[0][:300]


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
        self._reports = _StoreReports(self) if self.active else None

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
                raise PeerError(f"{self.name} step '{step}' failed on rank {self.rank}: {_describe(error)}",
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
        except _Incomplete as incomplete:
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
            return PeerError(f"{self.name} step '{step}' failed on rank {self.rank}: {_describe(error)}",
                             step=step, ranks=[self.rank])
        self._reports.next_agreement()
        self._broken_at = step
        me = self._reports.me
        if stopped_waiting(error):  # the peers blocked by the same culprit give up in the same window
            leaving = _Incomplete("its wait for them timed out or a connection closed",
                                  alarm=f"rank {me} stopped waiting for its peers during {self.name} step '{step}'")
            head = f"{self.name} step '{step}' did not complete (seen from rank {me}, which stopped waiting for its peers)"
            return self._reports.diagnose(step, error, leaving, grace_s=_REPORT_GRACE_S, head=head)
        leaving = _Incomplete("its peers may be blocked in a collective that needs it",
                              alarm=f"rank {me} failed during {self.name} step '{step}' and left without agreeing")
        head = f"{self.name} step '{step}' failed on rank {me}, which left without agreeing"
        return self._reports.diagnose(step, error, leaving, grace_s=_LEAVE_GRACE_S, head=head)

    def _all_reduce_in_time(self, tensor: torch.Tensor, op: str) -> None:
        """Reduce ``tensor`` over the group, or raise ``_Incomplete`` at the timeout, on a broken
        connection, or as soon as a peer reports (through the store) that this agreement broke.

        The all-reduce runs in a helper thread (:class:`_Background`) and this thread waits on its
        completion, woken the moment it ends: no polling delay. Only a slow agreement looks at the
        store, and then rarely (W ranks polling one store)."""
        self._reports.next_agreement()
        done = _Background(butterfly_all_reduce, tensor, self.group, op)
        started = time.monotonic()
        deadline = started + self.timeout.total_seconds()
        wait_s = _ALARM_CHECK_AFTER_S
        while not done.wait(min(wait_s, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise _Incomplete(self._late())
            try:
                alarm = self._reports.alarm()
            except Exception as exc:  # the store's host died (rank 0 when launched like srun)
                raise _Incomplete(f"the rendezvous store stopped answering ({_first_line(exc)})", cause=exc) from exc
            if alarm is not None:
                raise _Incomplete(alarm)
            wait_s = _ALARM_CHECK_EVERY_S
        if done.error is not None:  # gloo's own timeout (the group's is ours), or a closed connection
            if "Timed out" in str(done.error):
                raise _Incomplete(self._late(), cause=done.error) from done.error
            raise _Incomplete(f"the agreement collective broke ({_first_line(done.error)})",
                              cause=done.error) from done.error

    def _late(self) -> str:
        return f"not every rank arrived within {self.timeout.total_seconds():.0f} s"

    def _failure(self, step: str, error: BaseException | None) -> PeerError:
        """Every rank arrived and some failed: gather the failures' messages (rare, so the cost of
        an object all-gather is paid only here) and name them on every rank."""
        statuses = self.all_gather(None if error is None else _describe(error))
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


class _StoreReports:
    """Diagnosis of a broken agreement through the rendezvous store, which outlives the group.

    Keys live under ``nemo_moe_export/<group name>/<agreement number>/``: ``alarm`` (set by the
    first rank that found the agreement broken, so peers still waiting give up at once) and one
    ``report/<rank>`` per survivor ("ok" or its own failure). Nothing is written while all is well.
    """

    _per_group: dict[str, int] = {}

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.store = _get_default_store()
        # Coordinators may share a group (the evaluator reuses one per DP group): number them per
        # group, in construction order, which is the same on every rank.
        name = coordinator.group.group_name
        _StoreReports._per_group[name] = instance = _StoreReports._per_group.get(name, 0) + 1
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

    def diagnose(self, step: str, error: BaseException | None, incomplete: _Incomplete, *,
                 head: str | None = None, grace_s: float = _REPORT_GRACE_S) -> PeerError:
        coordinator = self.coordinator
        head = head or f"{coordinator.name} step '{step}' could not be agreed (seen from rank {self.me})"
        try:
            reports, grace_s = self._exchange_reports(error, incomplete, grace_s)
        except Exception as exc:  # the store's host is gone too
            host = 0 if store_hosted_by_rank0() else None
            return PeerError(f"{head}: {incomplete.reason}; the rendezvous store is unreachable as well "
                             f"({_first_line(exc)}): its host ({'rank 0' if host == 0 else 'the launcher'}) "
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

    def _exchange_reports(self, error: BaseException | None, incomplete: _Incomplete,
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
            time.sleep(_HOST_LINGER_S)
            hold_store_for_peers(deadline + self._blocked_s(reports) + _REPORT_GRACE_S)
        return reports, grace_s

    def _blocked_s(self, reports: dict[int, str]) -> float:
        """How long after the reports' deadline a survivor may still be blocked in a model collective
        and come to read them: when a rank failed by itself, its peers blocked in a collective with a
        live rank wait for that group's timeout; when every report is a wait, they already waited it."""
        if all(text == "ok" or text.startswith(_WAITED) for text in reports.values()):
            return 0.0
        return _GROUP_TIMEOUT["s"] or self.coordinator.timeout.total_seconds()


def _report(error: BaseException | None) -> str:
    """This rank's report: "ok", a wait that ended (tagged: it names no culprit), or its failure."""
    if error is None:
        return "ok"
    return (_WAITED if stopped_waiting(error) else "") + _describe(error)


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


def bound_groups(groups: Any, timeout_s: float) -> None:
    """Every process group in ``groups`` waits at most ``timeout_s`` in a collective
    (``_set_pg_timeout``: gloo and NCCL): a group a mesh or a framework made otherwise keeps torch's
    30-minute default, so a stalled peer would hold its partners that long. gloo keeps a group's
    point-to-point receives at the timeout it was made with: a group that carries them (the
    pipeline's) must be made with it, as ``job/pipelined.py`` does
    (docs/design.md#coordination-protocol, "The model's groups are bounded too"). The longest such
    bound is kept: it is how long a survivor blocked in a model collective may take to report."""
    timeout = timedelta(seconds=timeout_s)
    for group in groups:
        _set_pg_timeout(timeout, group)
    _GROUP_TIMEOUT["s"] = max(timeout_s, _GROUP_TIMEOUT["s"] or 0.0)


def model_groups(model: Any, layout: "ParallelLayout") -> list[Any]:
    """The process groups a model's forwards and steps run collectives on, each once: the layout's
    (the pipeline group's transfers included) and those of the DeviceMeshes of its DTensor
    parameters (FSDP2's shard groups, the EP experts' mesh)."""
    groups = [g.group for g in (layout.dp, layout.ep, layout.edp, *layout.model_parallel_groups().values())
              if g.group is not None]
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    for mesh in meshes.values():
        groups.extend(mesh.get_all_groups())
    return list({g.group_name: g for g in groups}.values())


# --------------------------------------------------------------------------------------------------
# Parallel layout discovery: data-parallel, expert-parallel and expert-data-parallel groups
# --------------------------------------------------------------------------------------------------
#
# Expert parallelism (EP) splits the routed experts of every MoE layer over the ranks of an EP
# group; the ranks that hold the *same* experts form an expert-data-parallel (expert-DP) group.
# Dense (non-expert) weights are replicated over the whole dense data-parallel (DP) group, which
# contains the EP groups (Megatron's layout, docs/design.md#placement-rules): on 4 ranks with EP=2 the EP
# groups are [0, 1], [2, 3], the expert-DP groups [0, 2], [1, 3] and the dense DP group [0..3].
#
# Why it matters: an EP forward is a collective over the EP group, so EP peers must run the same
# forwards in lockstep, while only expert-DP replicas may take disjoint batches (the MMLU hang).

# DeviceMesh dim names and what they mean to :func:`discover_layout`.
EP_DIM = "ep"
"""Expert-parallel dim: ranks along it hold different experts."""
EXPERT_DP_DIMS = ("edp", "ep_shard", "ep_replicate")
"""Expert-data-parallel dims (NeMo AutoModel calls the FSDP axis over experts ``ep_shard``)."""
DENSE_DP_DIMS = ("dp", "dp_replicate", "dp_shard", "dp_shard_cp")
"""Dense data-parallel dims (HSDP splits DP into ``dp_replicate`` x ``dp_shard``)."""
MODEL_PARALLEL_DIMS = ("tp", "pp", "cp", "etp")
"""Dims that split one model replica; they are in none of the three data groups."""
PP_DIM = "pp"
"""The pipeline dim: its ranks hold different stages of one replica (``ParallelLayout.pp``)."""
TP_DIM = "tp"
"""The tensor-parallel dim: its ranks hold different slices of the same layers (``ParallelLayout.tp``)."""
CP_DIM = "cp"
"""The context-parallel dim: its ranks hold the same weights and split each sequence (``ParallelLayout.cp``)."""


@dataclass(frozen=True)
class RankGroup:
    """This rank's place in one process group.

    ``ranks`` are the global ranks of the group in group-rank order, so ``ranks[rank]`` is this
    rank. ``group`` is None only for a group of one rank that no framework created (the EP group
    without expert parallelism, or everything in a single process): nothing to communicate.
    """

    rank: int
    size: int
    ranks: tuple[int, ...]
    group: Any = None

    @staticmethod
    def of(group: Any) -> "RankGroup":
        """Read rank, size and member ranks from an existing process group."""
        ranks = tuple(dist.get_process_group_ranks(group))
        return RankGroup(dist.get_rank(group), len(ranks), ranks, group)

    @staticmethod
    def alone() -> "RankGroup":
        """A group of just this rank (no process group needed)."""
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return RankGroup(0, 1, (me,), None)


@dataclass(frozen=True)
class ParallelLayout:
    """Dense data-parallel, expert-parallel, expert-data-parallel and pipeline groups of this rank.

    ``source`` says where the groups came from: ``"megatron"``, ``"device_mesh"``, ``"world"`` or
    ``"init_expert_parallel"``. Batches may differ only between ranks of different EP groups, i.e.
    shard data over ``edp`` (not ``dp``) whenever ``ep.size > 1``. ``pp`` is this rank's pipeline
    group (one rank per pipeline stage position, in stage order; alone without pipeline
    parallelism): its ranks hold different layers of one model replica, so they run every batch
    together and the export gathers the key catalogue over it (docs/design.md#pipeline-stages).
    ``tp`` (tensor parallel, sequence parallel rides on it) and ``cp`` (context parallel) also
    split one replica: their ranks take every batch together, and neither is in a data group.
    """

    dp: RankGroup
    ep: RankGroup
    edp: RankGroup
    source: str
    pp: RankGroup = field(default_factory=RankGroup.alone)
    tp: RankGroup = field(default_factory=RankGroup.alone)
    cp: RankGroup = field(default_factory=RankGroup.alone)

    def model_parallel_groups(self) -> dict[str, RankGroup]:
        """The groups that split one replica and have more than one rank, by name."""
        return {name: g for name, g in (("pp", self.pp), ("tp", self.tp), ("cp", self.cp)) if g.size > 1}


def discover_layout(device_mesh: Any = None, *, use_megatron: bool = True) -> ParallelLayout:
    """The DP / EP / expert-DP layout this process runs under, read from what set it up.

    Sources, in order:

    1. megatron-core ``parallel_state`` when ``use_megatron``, the module has been imported and
       ``model_parallel_is_initialized()``. (A module that was never imported cannot have been
       initialised, so this never pays megatron's multi-second import.)
    2. a named ``device_mesh``: ``"ep"`` is expert-parallel; ``"edp"``/``"ep_shard"``/
       ``"ep_replicate"`` are expert-data-parallel; ``"dp"``/``"dp_replicate"``/``"dp_shard"``/
       ``"dp_shard_cp"`` are dense data-parallel; ``"tp"``/``"pp"``/``"cp"``/``"etp"`` split one
       replica and belong to none. Dims are orthogonal, so expert-DP is every data-parallel dim
       other than ``"ep"`` and dense DP is every data-parallel dim including ``"ep"`` (EP sits
       inside dense DP, as in Megatron). Several dims of one kind are flattened into one group
       (``DeviceMesh._flatten``: a collective, every rank of the mesh must call this).
    3. the plain world: dense DP = expert-DP = world, EP = 1.
    """
    if use_megatron:
        layout = _megatron_layout()
        if layout is not None:
            return layout
    if device_mesh is not None:
        return _mesh_layout(device_mesh)
    return _world_layout()


def _megatron_layout() -> ParallelLayout | None:
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return ParallelLayout(
        dp=RankGroup.of(parallel_state.get_data_parallel_group()),
        ep=RankGroup.of(parallel_state.get_expert_model_parallel_group()),
        edp=RankGroup.of(parallel_state.get_expert_data_parallel_group()),
        source="megatron",
        pp=RankGroup.of(parallel_state.get_pipeline_model_parallel_group()),
        tp=RankGroup.of(parallel_state.get_tensor_model_parallel_group()),
        cp=RankGroup.of(parallel_state.get_context_parallel_group()),
    )


def _mesh_layout(mesh: Any) -> ParallelLayout:
    names = tuple(mesh.mesh_dim_names or ())
    known = (EP_DIM, *EXPERT_DP_DIMS, *DENSE_DP_DIMS, *MODEL_PARALLEL_DIMS)
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise InputError(
            "cannot tell the parallel layout from this DeviceMesh's dim names",
            expected=f"named dims among {list(known)}",
            actual=f"mesh_dim_names={names or None}",
            hint="name the mesh dims (init_device_mesh(..., mesh_dim_names=...)) with the names above",
        )
    data_dims = [n for n in names if n not in MODEL_PARALLEL_DIMS]
    return ParallelLayout(
        dp=_mesh_group(mesh, data_dims),
        ep=_mesh_group(mesh, [n for n in names if n == EP_DIM]),
        edp=_mesh_group(mesh, [n for n in data_dims if n != EP_DIM]),
        source="device_mesh",
        pp=_mesh_group(mesh, [n for n in names if n == PP_DIM]),
        tp=_mesh_group(mesh, [n for n in names if n == TP_DIM]),
        cp=_mesh_group(mesh, [n for n in names if n == CP_DIM]),
    )


def _mesh_group(mesh: Any, dims: list[str]) -> RankGroup:
    """The group spanning ``dims`` of ``mesh`` (flattened if several; alone if none)."""
    if not dims:
        return RankGroup.alone()
    sub = mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]._flatten("_".join(dims))
    return RankGroup.of(sub.get_group())


def _world_layout() -> ParallelLayout:
    if not (dist.is_available() and dist.is_initialized()):
        alone = RankGroup.alone()
        return ParallelLayout(dp=alone, ep=alone, edp=alone, source="world")
    world = RankGroup.of(dist.group.WORLD)
    return ParallelLayout(dp=world, ep=RankGroup.alone(), edp=world, source="world")


def expert_parallel_groups(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Megatron's rank lists for EP and expert-DP on a world of ``world_size`` (no TP/PP/CP).

    EP groups are contiguous blocks (``[0, 1], [2, 3]`` for EP=2 on 4 ranks), so EP peers sit close
    together (same node); expert-DP groups take one rank of each block (``[0, 2], [1, 3]``).
    """
    if ep_size < 1 or world_size < 1 or world_size % ep_size:
        raise InputError(
            "the expert-parallel size must divide the world size",
            expected=f"ep_size >= 1 dividing world_size={world_size}",
            actual=f"ep_size={ep_size}",
            hint="pick an EP size that divides the number of ranks (and the expert count)",
        )
    replicas = world_size // ep_size
    ep_groups = [[r * ep_size + i for i in range(ep_size)] for r in range(replicas)]
    edp_groups = [[r * ep_size + i for r in range(replicas)] for i in range(ep_size)]
    return ep_groups, edp_groups


def init_expert_parallel(ep_size: int, *, timeout_s: float = 600.0, backend: str | None = None) -> ParallelLayout:
    """Create EP, expert-DP and dense-DP groups on the world without Megatron; Megatron's layout.

    Every rank must call this (group creation is collective). All groups are created with
    ``timeout_s``: gloo honours it for every collective, so a stalled or missing EP peer makes the
    others raise after ``timeout_s`` instead of hanging. ``backend`` defaults to the world's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise InputError(
            "torch.distributed is not initialised",
            expected="dist.init_process_group(...) before init_expert_parallel",
            actual="no default process group",
        )
    world_size = dist.get_world_size()
    ep_groups, edp_groups = expert_parallel_groups(world_size, ep_size)
    timeout = timedelta(seconds=timeout_s)
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_groups, timeout=timeout, backend=backend)
    edp_group, _ = dist.new_subgroups_by_enumeration(edp_groups, timeout=timeout, backend=backend)
    dp_group = dist.new_group(ranks=list(range(world_size)), timeout=timeout, backend=backend)
    return ParallelLayout(
        dp=RankGroup.of(dp_group), ep=RankGroup.of(ep_group), edp=RankGroup.of(edp_group),
        source="init_expert_parallel",
    )
