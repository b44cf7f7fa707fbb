"""Replica agreement: every tensor held by several ranks is compared across its holders before the
first byte is written (docs/design.md#replica-agreement).

Replicas drift when a training step updates a tensor without all-reducing it (the router-bias
update is the known case); an export that writes one holder's copy then says nothing. Here:

1. :func:`replica_sets` finds, for every tensor this rank holds, its replica groups: one per
   ``Replicate`` mesh dim of a DTensor (``mesh.get_group(dim)``: HSDP replicas, expert-DP replicas
   under EP), one per TP / CP dim of its root mesh it does not span (the weights TP leaves whole,
   CP copies: ``placement.unsplit_model_parallel_dims``), and the export group for a plain tensor
   (FSDP2 buffers such as ``e_score_correction_bias``, the dense part under EP). Pure apart from
   reading the groups' ranks.
2. :func:`compare_replicas` runs, per group and in one global order (sorted by the group's ranks,
   so no two ranks wait on each other crosswise), a header all-reduce (how many tensors, which)
   and one batched all-reduce of exact checksums (``checksum``: integer sums of each tensor's bits
   with position weights, on the tensor's device), MAX of ``[c, ~c]`` giving max and min at once.
   Only tensors whose checksums differ get the exact max |difference| (MAX/MIN all-reduce of the
   values) and the holders split into ranks with equal copies (a small all-gather).
3. :func:`settle_findings`: under ``replica_mismatch="error"`` the findings, shared over the export
   group when their count (summed on the export's agreement) is not zero, refuse the export
   on every rank with the same :class:`InputError`; ``"mean"`` writes the replicas' mean (a
   float64 all-reduce), ``"rank:N"`` global rank N's copy (a broadcast); each reconciled key is
   reported. The model's own tensors are never changed: reconciled copies are new tensors.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from nemo_moe_export.errors import InputError
from nemo_moe_export.parallel import Coordinator
from nemo_moe_export.placement import unsplit_model_parallel_dims

__all__ = ["ReplicaReport", "ReplicaSet", "checksum", "compare_replicas", "replica_sets", "settle_findings",
           "with_copies"]

_ROW = 512  # words per checksum row: row and column weights locate every word


@dataclass
class ReplicaSet:
    """The tensors one process group holds replicas of; ``names`` in the order every member uses."""

    ranks: tuple[int, ...]  # global ranks, in group-rank order
    group: Any
    export_group: bool  # the export's own (gloo) group: plain tensors held by every rank
    names: list[str] = field(default_factory=list)

    @property
    def order(self) -> tuple:
        return (self.ranks, 0 if self.export_group else 1)


@dataclass
class ReplicaReport:
    """What the check found on this rank (the same on every rank once shared)."""

    seconds: float = 0.0
    groups: int = 0
    tensors: int = 0
    bytes_checked: int = 0
    reconciled: list[dict[str, Any]] = field(default_factory=list)


def replica_sets(tensors: Mapping[str, torch.Tensor], coordinator: Coordinator) -> list[ReplicaSet]:
    """Every replica group this rank is in, with the (non-empty) tensors it holds replicas of, in
    the one global order. Refuses a group with ranks outside the export group (they would never
    join its collectives)."""
    export_ranks = tuple(coordinator.global_rank(r) for r in range(coordinator.world_size))
    sets: dict[tuple, ReplicaSet] = {}
    for name in sorted(tensors):
        tensor = tensors[name]
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0:
            continue
        for ranks, group, export_group in _groups_of(tensor, coordinator, export_ranks):
            outside = sorted(set(ranks) - set(export_ranks))
            if outside:
                raise InputError(
                    "a tensor's replicas sit on ranks outside the export group", key=name,
                    expected=f"replica ranks within {list(export_ranks)}", actual=f"also ranks {outside}",
                    hint="export on every rank of the model's device mesh (group= covering it)")
            entry = sets.setdefault((ranks, export_group), ReplicaSet(ranks, group, export_group))
            entry.names.append(name)
    return sorted(sets.values(), key=lambda s: s.order)


def _groups_of(tensor: torch.Tensor, coordinator: Coordinator, export_ranks: tuple[int, ...]):
    """``(ranks, group, is_export_group)`` of each replica group of ``tensor``."""
    if not isinstance(tensor, DTensor):
        if coordinator.active:
            yield export_ranks, coordinator.group, True
        return
    mesh = tensor.device_mesh
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate) and mesh.size(dim) > 1:
            group = mesh.get_group(dim)
            yield tuple(dist.get_process_group_ranks(group)), group, False
    for root, dim in unsplit_model_parallel_dims(mesh):  # TP / CP copies (placement.local_box numbers them too)
        group = root.get_group(dim)
        yield tuple(dist.get_process_group_ranks(group)), group, False


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Three exact integers (int64, on the tensor's device) from the tensor's bits, read as 64-bit
    words laid out in rows of ``_ROW`` words: their sum, their sum weighted by row and their sum
    weighted by column, all modulo 2**64 (integer addition wraps, so any summation order gives
    the same result). Equal tensors give equal checksums on any rank; a change of any one word, or
    two unequal words swapped, changes them. One pass over memory-bound reductions (no copy of a
    contiguous tensor), so it runs at memory speed."""
    flat = tensor.detach().reshape(-1)
    raw = _bytes_of(flat)
    n_words = raw.numel() // 8
    words, tail = raw[:n_words * 8].view(torch.int64), raw[n_words * 8:].to(torch.int64)
    full = n_words // _ROW
    rows, rest = words[:full * _ROW].view(full, _ROW), words[full * _ROW:]
    row_sums, col_sums = rows.sum(dim=1), rows.sum(dim=0)
    device = flat.device
    by_row = (row_sums * torch.arange(1, full + 1, dtype=torch.int64, device=device)).sum()
    by_col = (col_sums * torch.arange(1, _ROW + 1, dtype=torch.int64, device=device)).sum()
    rest_weights = torch.arange(1, rest.numel() + tail.numel() + 1, dtype=torch.int64, device=device)
    rest_all = torch.cat([rest, tail])
    total = row_sums.sum() + rest_all.sum()
    by_row = by_row + rest_all.sum() * (full + 1)
    by_col = by_col + (rest_all * rest_weights).sum()
    return torch.stack([total, by_row, by_col])


def _bytes_of(flat: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a uint8 view whose start is 8-byte aligned (a copy only when it is
    not contiguous or not aligned)."""
    if not flat.is_contiguous() or (flat.storage_offset() * flat.element_size()) % 8:
        flat = flat.clone()
    return flat.view(torch.uint8)


def _comm_device(group: Any, tensor: torch.Tensor) -> torch.device:
    """Where a collective's tensors live: the CPU on gloo groups, the tensors' device otherwise."""
    return torch.device("cpu") if "gloo" in str(dist.get_backend(group)) else tensor.device


def _min_max(values: torch.Tensor, entry: ReplicaSet, coordinator: Coordinator) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise max and min over the group in one all-reduce: MAX of ``[v, flip(v)]``, where
    ``flip`` reverses the order without overflow (``-v`` for floats, ``~v = -v - 1`` for integers).
    Over the export group through the coordinator (log2 W rounds, under its timeout)."""
    flip = torch.neg if values.is_floating_point() else torch.bitwise_not
    both = torch.cat([values, flip(values)])
    if entry.export_group:
        coordinator.all_reduce(both, "max", step="validate replicas")
    else:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=entry.group)
    n = values.numel()
    return both[:n], flip(both[n:])


@dataclass
class _Finding:
    name: str
    ranks: tuple[int, ...]
    copies: list[list[int]]  # holders split by equal checksums, largest first
    max_abs_diff: float | None
    problem: str = "differ"  # differ | layout (the holders do not hold the same tensors)
    reconciled: str | None = None  # how, when reconciled
    refusal: str | None = None  # why it could not be reconciled


def _check_set(entry: ReplicaSet, current: dict[str, torch.Tensor], policy: str, report: ReplicaReport,
               coordinator: Coordinator) -> list[_Finding]:
    """The collectives of one replica group; every member takes the same path (verdicts are
    all-reduced). Reconciled copies replace entries of ``current``."""
    locals_ = [_local(current[name]) for name in entry.names]
    device = _comm_device(entry.group, locals_[0])
    fingerprint = zlib.crc32("\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in zip(entry.names, locals_))
                             .encode())
    high, low = _min_max(torch.tensor([len(locals_), fingerprint], dtype=torch.int64, device=device), entry,
                         coordinator)
    if not torch.equal(high, low):
        return [_Finding(entry.names[0], entry.ranks, [], None, problem="layout")]
    sums = torch.stack([checksum(t) for t in locals_]).to(device)
    report.tensors += len(locals_)
    report.bytes_checked += sum(t.numel() * t.element_size() for t in locals_)
    high, low = _min_max(sums.reshape(-1), entry, coordinator)
    differing = (high != low).reshape(-1, 3).any(dim=1).nonzero().flatten().tolist()
    if not differing:
        return []
    copies = _copies(sums[differing], entry)
    findings = []
    for i, holders in zip(differing, copies):
        name = entry.names[i]
        finding = _Finding(name, entry.ranks, holders, _max_abs_diff(locals_[i], entry, coordinator, device))
        if policy != "error":
            _reconcile(finding, current, entry, policy, device)
        findings.append(finding)
    return findings


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copies(sums: torch.Tensor, entry: ReplicaSet) -> list[list[list[int]]]:
    """Per differing tensor, its holders grouped by equal checksums (one all-gather)."""
    gathered = [torch.empty_like(sums) for _ in entry.ranks]
    dist.all_gather(gathered, sums.contiguous(), group=entry.group)
    out = []
    for i in range(sums.shape[0]):
        by_copy: dict[tuple[int, ...], list[int]] = {}
        for member, rank in enumerate(entry.ranks):
            by_copy.setdefault(tuple(gathered[member][i].tolist()), []).append(rank)
        out.append(sorted(by_copy.values(), key=lambda ranks: (-len(ranks), ranks)))
    return out


def _wide(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The values in float64 (floating) or int64, on the collective's device."""
    return tensor.detach().to(device=device, dtype=torch.float64 if tensor.is_floating_point() else torch.int64)


def _max_abs_diff(tensor: torch.Tensor, entry: ReplicaSet, coordinator: Coordinator, device: torch.device) -> float:
    high, low = _min_max(_wide(tensor, device).reshape(-1), entry, coordinator)
    return float((high - low).abs().max()) if high.numel() else 0.0


def _reconcile(finding: _Finding, current: dict[str, torch.Tensor], entry: ReplicaSet, policy: str,
               device: torch.device) -> None:
    """Replace this rank's copy by the replicas' mean or by one rank's copy, identically everywhere."""
    local = _local(current[finding.name])
    if policy == "mean":
        if not local.is_floating_point():
            finding.refusal = f"{local.dtype} values have no mean; use replica_mismatch='rank:N'"
            return
        total = _wide(local, device).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=entry.group)
        agreed = (total / len(entry.ranks)).to(device=local.device, dtype=local.dtype)
    else:
        source = int(policy.split(":", 1)[1])
        if source not in entry.ranks:
            finding.refusal = f"rank {source} holds no copy (its holders are ranks {list(entry.ranks)})"
            return
        agreed = local.detach().to(device).clone()
        dist.broadcast(agreed, src=source, group=entry.group)
        agreed = agreed.to(local.device)
    current[finding.name] = _with_local(current[finding.name], agreed)
    finding.reconciled = policy


def _with_local(tensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``tensor`` with ``local`` as this rank's data (same mesh, placements, global shape)."""
    if not isinstance(tensor, DTensor):
        return local
    return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def compare_replicas(sets: list[ReplicaSet], tensors: Mapping[str, torch.Tensor], coordinator: Coordinator,
                     policy: str) -> tuple[dict[str, torch.Tensor], ReplicaReport, list[_Finding]]:
    """Compare every replica group's copies: the tensors to write (reconciled copies in place of
    differing ones under ``policy`` "mean" / "rank:N"), the report, and this rank's findings. Each
    group's verdict is known to its members only: :func:`settle_findings` shares them, after the
    count of findings has been summed over the export group (the caller's agreement carries it)."""
    started = time.perf_counter()
    report = ReplicaReport(groups=len(sets))
    current = dict(tensors)
    findings = [f for entry in sets for f in _check_set(entry, current, policy, report, coordinator)]
    report.seconds = round(time.perf_counter() - started, 4)
    return current, report, findings


def settle_findings(findings: list[_Finding], total: int, coordinator: Coordinator, policy: str,
                    report: ReplicaReport) -> None:
    """With ``total`` findings over the export group (none: nothing to do, the common case), share
    them (an object all-gather), then refuse on every rank alike when replicas differ and may not
    (or cannot) be reconciled, else record what was reconciled in ``report``."""
    if not total:
        return
    shared = _unique(f for per_rank in coordinator.all_gather([vars(f) for f in findings]) for f in per_rank)
    refused = [f for f in shared if f["reconciled"] is None]
    if refused:
        raise _refusal(refused, policy)
    report.reconciled = [dict(key=f["name"], ranks=list(f["ranks"]), copies=f["copies"],
                              max_abs_diff=f["max_abs_diff"], policy=f["reconciled"]) for f in shared]


def _unique(findings) -> list[dict[str, Any]]:
    seen: dict[tuple, dict[str, Any]] = {}
    for f in findings:
        seen.setdefault((f["name"], tuple(f["ranks"])), f)
    return [seen[k] for k in sorted(seen)]


def _refusal(refused: list[dict[str, Any]], policy: str) -> InputError:
    first = refused[0]
    keys = ", ".join(f["name"] for f in refused[:6]) + (f", ... ({len(refused) - 6} more)" if len(refused) > 6 else "")
    if first["problem"] == "layout":
        return InputError(
            "replicas hold different tensors", key=first["name"],
            expected=f"the same tensors, shapes and dtypes on ranks {list(first['ranks'])}",
            actual="a different set on some of them",
            hint="every replica must hold the same model; check the mesh and placements")
    copies = "; ".join(f"ranks {ranks}" for ranks in first["copies"])
    why = f" ({first['refusal']})" if first["refusal"] else ""
    return InputError(
        f"{len(refused)} tensors differ between their replicas: {keys}", key=first["name"],
        expected=f"identical copies on ranks {list(first['ranks'])}",
        actual=f"{len(first['copies'])} different copies, held by {copies}; max |difference| "
               f"{first['max_abs_diff']:.3g}{why}",
        hint="a training step updated this tensor without all-reducing it over its replicas (the "
             "router-bias update is the known case): fix the step, or export with "
             "replica_mismatch='mean' (write the replicas' mean) or 'rank:N' (write rank N's copy)"
             + ("" if policy == "error" else f"; replica_mismatch={policy!r} could not reconcile it"))


def with_copies(tensors: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with the entries ``current`` replaced (reconciled copies), in the same order."""
    return {name: current.get(name, tensor) for name, tensor in tensors.items()}
