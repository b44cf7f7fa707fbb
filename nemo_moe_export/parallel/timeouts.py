"""How long the coordinator waits, and the bound on the model's own process groups
(docs/design.md#coordination-protocol, "The model's groups are bounded too").

A healthy agreement takes milliseconds; every wait below is what a broken one costs at most.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed.distributed_c10d import _set_pg_timeout

__all__ = ["ALARM_CHECK_AFTER_S", "ALARM_CHECK_EVERY_S", "HOST_LINGER_S", "LEAVE_GRACE_S", "REPORT_GRACE_S",
           "bound_groups", "model_group_timeout_s"]

# How an agreement waits (docs/design.md#coordination-protocol). A healthy agreement takes
# milliseconds, so only a slow one looks at the store, and then rarely: W ranks polling one store.
ALARM_CHECK_AFTER_S = 1.0
ALARM_CHECK_EVERY_S = 0.5
REPORT_GRACE_S = 5.0  # how long survivors wait for each other's reports once an agreement broke
# How long a rank that leaves after failing a step waits for reports: peers waiting at the agreement
# answer its alarm within about a second; peers blocked in a collective that needs it cannot answer
# before its process ends, which its waiting only delays.
LEAVE_GRACE_S = 2.0
# How long rank 0, when its process hosts the store (launched like srun), stays after reading the
# reports, so the survivors that read them at the same deadline find the store still there; at exit
# it stays longer, until every rank is done with the store (watchdog.hold_store_for_peers).
HOST_LINGER_S = 1.0
# The longest a wait of a model collective lasts (bound_groups): the longest a survivor blocked in
# one may take to report. None until a job bounds its groups.
_GROUP_TIMEOUT: dict[str, float | None] = {"s": None}


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


def model_group_timeout_s() -> float | None:
    """The longest bound :func:`bound_groups` set on a model group (None until a job bounds its
    groups): how long a survivor blocked in a model collective may take to report."""
    return _GROUP_TIMEOUT["s"]
