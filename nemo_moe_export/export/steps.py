"""The steps after ``validate``, shared by the export and the checkpoint conversion.

Each step's body is closed by ``Coordinator.agree`` (one all-reduce of a status word under a
timeout, so a failure or stall on any rank becomes the same clear error on every rank; the words a
step shares ride on it; docs/design.md#coordination-protocol). :func:`run_after_validate` runs
``prepare`` -> ``headers`` -> ``write`` -> ``verify`` -> ``publish`` for a job that validated
(docs/design.md#export-plan-and-invariants): the export (``step.py``) and the conversion
(``convert/engine.py``, docs/design.md#checkpoint-conversion) differ only in what their job writes.
On any failure rank 0 removes the temporary directory; the target is untouched until publish.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan
from nemo_moe_export.export.target import ExportTarget
from nemo_moe_export.export.verify import verify_checkpoint
from nemo_moe_export.export.writer import WriteStats, write_headers
from nemo_moe_export.parallel import Coordinator, PeerError

__all__ = ["Shared", "StepJob", "Steps", "cyclic_gc_paused", "rank0_lost", "run_after_validate"]


@dataclass
class Shared:
    """Words a step's body shares with every rank on its closing agreement (``Steps.agreed``)."""

    sums: torch.Tensor | None = None  # this rank's int64 words
    totals: torch.Tensor | None = None  # their sum over the ranks, once agreed


class Steps:
    """Runs the steps on this rank: each body is closed by an agreement of every rank, and timed."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    @contextmanager
    def agreed(self, name: str, words: int = 0) -> Iterator[Shared]:
        """Run the body, then agree with every rank on how it went: an exception here, or on any
        peer, becomes the same PeerError on every rank. ``words`` int64 words the body puts in
        ``shared.sums`` ride on the agreement (a rank that failed sends as many zeros: every rank
        must send the same size); their sum over the ranks is ``shared.totals`` afterwards."""
        error, shared = None, Shared(torch.zeros(words, dtype=torch.int64) if words else None)
        try:
            yield shared
            if words and shared.sums.shape != (words,):
                raise AssertionError(f"step '{name}' shares {tuple(shared.sums.shape)} words, not ({words},)")
        except BaseException as exc:  # reported to every rank by agree
            error = exc
        shared.totals = self.coordinator.agree(name, error, sums=shared.sums)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Record the step's wall time (since the previous step ended) once its body succeeded."""
        yield
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 4)
        self._last = now

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        with self.timed(name), self.agreed(name):
            yield


class StepJob:
    """What the steps after validate read of a validated job (the same on every rank): the export's
    and the conversion's jobs are dataclasses of these fields and this base."""

    coordinator: Coordinator
    options: ExportOptions
    target: ExportTarget
    plan: ExportPlan
    owners: dict[str, int]  # file -> global rank that creates it

    @property
    def on_rank0(self) -> bool:
        return self.coordinator.rank == 0

    def my_files(self) -> list[str]:
        me = self.coordinator.global_rank(self.coordinator.rank)
        return [name for name, owner in self.owners.items() if owner == me]

    def write_small_files(self, directory: str) -> None:
        """Rank 0's files beside the tensors: index, config.json, generation config, tokenizer."""
        raise NotImplementedError


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cycle collector off for the export. The export makes hundreds of thousands of
    short-lived objects (plan entries, shares, header dicts), freed by reference counting, inside a
    training process that tracks many more; each full collection they trigger walks all of them
    (0.2-0.27 s on a CPU rank with a 61-expert model, about one per export). Restored after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def rank0_lost(exc: BaseException) -> bool:
    return isinstance(exc, PeerError) and 0 in exc.ranks


def run_after_validate(steps: Steps, job: StepJob, write: Callable[[], WriteStats]) -> WriteStats:
    """prepare -> headers -> write (``write()`` is this rank's body) -> verify -> publish; on any
    failure rank 0 (or, if it died, its survivors) removes the partial directory."""
    try:
        _prepare(steps, job)
        _write_headers(steps, job)
        with steps.step("write"):
            stats = write()
        _verify_from_bytes(steps, job)
        _publish(steps, job)
    except BaseException as exc:
        if job.on_rank0 or rank0_lost(exc):
            job.target.discard()
        raise
    return stats


def _prepare(steps: Steps, job: StepJob) -> None:
    """Step 2: rank 0 creates a fresh partial directory beside the target."""
    with steps.step("prepare"):
        if job.on_rank0:
            job.target.prepare()


def _write_headers(steps: Steps, job: StepJob) -> None:
    """Step 3: each owner creates its files with their headers; rank 0 adds the small files."""
    with steps.step("headers"):
        write_headers(job.plan, job.target.partial, job.my_files())
        if job.on_rank0:
            job.write_small_files(job.target.partial)


def _verify_from_bytes(steps: Steps, job: StepJob) -> None:
    """Step 5: rank 0 checks the checkpoint from its bytes, then makes the directory durable."""
    with steps.step("verify"):
        if job.on_rank0:
            if job.options.verify:
                report = verify_checkpoint(job.target.partial)
                if not report.ok:
                    raise RuntimeError("the written checkpoint failed verification:\n" + report.summary())
            job.target.seal()


def _publish(steps: Steps, job: StepJob) -> None:
    """Step 6: rank 0 renames the checkpoint into place."""
    with steps.step("publish"):
        if job.on_rank0:
            job.target.publish(job.options.overwrite)
