"""How every benchmark hands its report over: JSON on stdout, and in ``--out`` when given."""

from __future__ import annotations

import json
from typing import Any


def emit(report: Any, out: str | None = None, *, indent: int = 1) -> None:
    """Print ``report`` as JSON; also write it to the file ``out`` when given."""
    text = json.dumps(report, indent=indent)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
