"""The integrations' private helper: the error for a framework that is not installed."""

from __future__ import annotations


def missing(framework: str, install: str) -> ImportError:
    return ImportError(f"{framework} is not installed; install it with `{install}` to use this integration")
