"""The plugin's one hook protocol, used by the recipe's trainer and by every framework callback.

A training loop calls, on every rank, ``on_setup(ctx)`` once the model is built and sharded,
``on_step_end(ctx, step)`` after each optimizer step and ``on_train_end(ctx)`` once, where ``ctx``
is a :class:`RecipeContext`. The adapter (:class:`~nemo_moe_export.plugin.AdapterHook`), the MMLU
evaluation (:class:`~nemo_moe_export.evaluate.callback.MMLUCallback`) and the export
(:class:`~nemo_moe_export.export.ExportStep`) are hooks themselves, built on this protocol and
assembled by :mod:`nemo_moe_export.plugin`; the integrations (``nemo_moe_export/integrations``)
translate NeMo/Lightning, Megatron-Bridge and AutoModel events into these three calls
(docs/design.md#hooks).

    from nemo_moe_export.hooks import make_context
    from nemo_moe_export.plugin import plugin_hooks

    hooks = plugin_hooks(mmlu=dict(data_path="data/mmlu", every_n_steps=500, output_dir="out/mmlu"),
                         export=dict(output_dir="out/hf", dtype="bfloat16"))
    ctx = make_context(model, tokenizer)   # discovers the DP / EP / expert-DP groups
    hooks.on_setup(ctx)
    ...                                    # after each optimizer step:
    hooks.on_step_end(ctx, step)
    ...
    hooks.on_train_end(ctx)                # MMLU, then the export; results in ctx.results
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nemo_moe_export.parallel import discover_layout

__all__ = ["Hook", "HookList", "RecipeContext", "make_context"]


@dataclass
class RecipeContext:
    """What hooks see and share: the live model, its parallel layout, the tokenizer, the state-dict
    adapter (set by :class:`~nemo_moe_export.plugin.AdapterHook`, reused by the export) and the results hooks record."""

    model: Any
    layout: Any
    tokenizer: Any = None
    run_dir: str = "."
    data_root: str = ""
    adapter: Any = None
    results: dict[str, Any] = field(default_factory=dict)


class Hook:
    """No-op base of the protocol: override what you need. Every method runs on every rank."""

    def on_setup(self, ctx: RecipeContext) -> None:
        pass

    def on_step_end(self, ctx: RecipeContext, step: int) -> None:
        pass

    def on_train_end(self, ctx: RecipeContext) -> None:
        pass


class HookList(Hook):
    """Hooks run in order: the adapter first, then the evaluation, then the export."""

    def __init__(self, hooks: Iterable[Hook]) -> None:
        self.hooks = list(hooks)

    def on_setup(self, ctx: RecipeContext) -> None:
        for hook in self.hooks:
            hook.on_setup(ctx)

    def on_step_end(self, ctx: RecipeContext, step: int) -> None:
        for hook in self.hooks:
            hook.on_step_end(ctx, step)

    def on_train_end(self, ctx: RecipeContext) -> None:
        for hook in self.hooks:
            hook.on_train_end(ctx)


def make_context(model: Any, tokenizer: Any = None, layout: Any = None, run_dir: str | None = None) -> RecipeContext:
    """A context for ``model``; ``layout`` defaults to the groups discovered from megatron-core, a
    named device mesh or the plain world (:func:`~nemo_moe_export.parallel.discover_layout`)."""
    return RecipeContext(model=model, layout=layout if layout is not None else discover_layout(),
                         tokenizer=tokenizer, run_dir=run_dir or os.getcwd())
