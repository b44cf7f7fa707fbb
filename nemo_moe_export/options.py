"""What every options dataclass shares: build from a config node or a mapping, and checked fields.

Each component's options (``export/options.py``, ``evaluate/options.py``) is a dataclass whose
field defaults are the one home of that component's defaults; the Hydra config groups extend
them (``config.py``) and the library entry points read them, so no default is written twice.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

from nemo_moe_export.errors import InputError

__all__ = ["Options", "require"]

T = TypeVar("T", bound="Options")


class Options:
    """Base of the options dataclasses (no fields of its own)."""

    what = "option"  # named in errors: "unknown export option"

    @classmethod
    def of(cls: type[T], options: Any = None, **overrides: Any) -> T:
        """``options`` (an instance, a config node or a mapping; fields this class does not have
        are ignored) with ``overrides`` applied, validated on construction."""
        if isinstance(options, cls) and not overrides:
            return options
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise InputError(f"unknown {cls.what}", key=unknown[0], expected=f"one of {sorted(names)}",
                             actual=repr(unknown[0]))
        source: Any = options if isinstance(options, dict) else {
            n: getattr(options, n) for n in names if options is not None and hasattr(options, n)}
        base = {k: v for k, v in source.items() if k in names}
        return cls(**{**base, **overrides})


def require(ok: bool, what: str, key: str, expected: str, actual: Any) -> None:
    """Raise ``InputError("bad <what>")`` naming the key, what was expected and what was given."""
    if not ok:
        raise InputError(f"bad {what}", key=key, expected=expected, actual=repr(actual))
