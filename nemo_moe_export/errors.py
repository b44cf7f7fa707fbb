"""One error type for every bad input this package refuses.

Each message says what is wrong, where (key, rank), what was expected, what was found, and what to
do, so a user reading one line of a 512-rank log can act on it. Errors are raised before anything is
changed or written.
"""

from __future__ import annotations

import signal
from typing import Any

import torch.distributed as dist

__all__ = ["ExportInputError", "InputError", "Stopped", "current_rank"]


def current_rank() -> int | None:
    """Global rank when torch.distributed is up, else None (single process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class InputError(ValueError):
    """Bad input, refused: to an adapter, a placement helper, the export, the evaluation, a recipe's
    config or the command line.

    The structured fields stay available as attributes so callers and tests can check them
    without parsing the message.
    """

    def __init__(
        self,
        problem: str,
        *,
        key: str | None = None,
        expected: Any = None,
        actual: Any = None,
        hint: str | None = None,
        rank: int | None = None,
    ) -> None:
        self.problem = problem
        self.key = key
        self.expected = expected
        self.actual = actual
        self.hint = hint
        self.rank = current_rank() if rank is None else rank
        where = []
        if key is not None:
            where.append(f"key '{key}'")
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        message = problem
        if where:
            message += f" ({', '.join(where)})"
        if expected is not None or actual is not None:
            message += f": expected {expected}, got {actual}"
        if hint:
            message += f". {hint}"
        super().__init__(message)


ExportInputError = InputError
"""The 0.1 name of :class:`InputError`, from when only the export raised it; kept so that existing
``except ExportInputError`` clauses still catch every refused input."""


class Stopped(KeyboardInterrupt):
    """The job was asked to stop by a signal (SIGINT, SIGTERM or SIGHUP).

    The recipe job raises it in its main thread when the signal arrives, so every ``finally`` runs
    and an export in flight removes its partial directory instead of publishing
    (docs/design.md#faults-and-how-each-is-reported). A ``KeyboardInterrupt``, so ``except
    Exception`` does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")
