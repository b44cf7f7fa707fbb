"""Progress of a long loop (training steps, evaluation steps), shown on global rank 0 only.

One bar for the whole job, not one per rank: every other rank, and any progress that is not
``enabled``, shows nothing. The bar is tqdm's when tqdm is importable (it is not a dependency);
without it a plain line goes to stderr about every 10% of the way, so a log file still shows
how far the loop got.

>>> with Progress(100, "train") as bar:
...     for step in range(100):
...         bar.update(1, postfix=f"loss={0.5:.3f}")
"""

from __future__ import annotations

import sys
from typing import Any

from nemo_moe_export.parallel import is_global_rank0

__all__ = ["Progress"]

_PLAIN_LINES = 10  # without tqdm: about this many lines over the whole loop


class Progress:
    """Counts ``total`` units of ``desc``; ``update`` after each, ``close`` (or ``with``) at the end.

    ``postfix`` (e.g. ``"loss=0.123"``) is shown after the count: in the bar, or at the end of
    the plain line. ``min_interval_s`` is the least time between two bar refreshes.
    """

    def __init__(self, total: int, desc: str, *, enabled: bool = True, unit: str = "step",
                 min_interval_s: float = 0.1) -> None:
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0
        self.enabled = enabled and is_global_rank0()
        self._bar = _tqdm_bar(total, desc, unit, min_interval_s) if self.enabled else None
        self._next_line = 0  # the count at which the plain fallback prints next

    def update(self, n: int = 1, *, postfix: str | None = None) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            if postfix is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(n)
        elif self.done >= self._next_line or self.done == self.total:
            line = f"{self.desc}: {self.unit} {self.done}/{self.total}"
            print(line if postfix is None else f"{line} {postfix}", file=sys.stderr, flush=True)
            self._next_line = self.done + max(1, self.total // _PLAIN_LINES)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar, self.enabled = None, False  # closed: later updates only count

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _tqdm_bar(total: int, desc: str, unit: str, min_interval_s: float) -> Any:
    """A tqdm bar on stderr that disappears when done, or None when tqdm is not importable."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True,
                mininterval=min_interval_s)
