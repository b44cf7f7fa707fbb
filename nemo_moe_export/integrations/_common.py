"""What every integration needs: build the plugin's hooks from plain settings, and a context."""

from __future__ import annotations

import os
from typing import Any

from nemo_moe_export.recipe.hooks import AdapterHook, ExportHook, Hook, HookList, MMLUHook, RecipeContext


def plugin_hooks(*, mmlu: dict[str, Any] | None = None, export: dict[str, Any] | None = None) -> HookList:
    """The adapter hook, plus the MMLU callback and/or the export step when their settings are given.

    ``mmlu``: keyword arguments of :class:`nemo_moe_export.evaluate.callback.MMLUCallback`;
    ``export``: keyword arguments of :class:`nemo_moe_export.export.ExportStep`.
    """
    hooks: list[Hook] = [AdapterHook()]
    if mmlu is not None:
        from nemo_moe_export.evaluate.callback import MMLUCallback

        hooks.append(MMLUHook(MMLUCallback(**mmlu)))
    if export is not None:
        from nemo_moe_export.export import ExportStep

        hooks.append(ExportHook(ExportStep(**export)))
    return HookList(hooks)


def make_context(model: Any, tokenizer: Any = None, layout: Any = None, run_dir: str | None = None) -> RecipeContext:
    from nemo_moe_export.parallel import discover_layout

    return RecipeContext(model=model, layout=layout or discover_layout(), tokenizer=tokenizer,
                         run_dir=run_dir or os.getcwd())


def missing(framework: str, install: str) -> ImportError:
    return ImportError(f"{framework} is not installed; install it with `{install}` to use this integration")
