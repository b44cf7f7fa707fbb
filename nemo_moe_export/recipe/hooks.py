"""The plugin's one small hook interface, and the three hooks a recipe installs.

A training framework calls ``on_setup`` once the model is built and sharded, ``on_step_end`` after
each optimizer step and ``on_train_end`` once. The integrations (``nemo_moe_export/integrations``)
translate NeMo/Lightning, Megatron-Bridge and AutoModel events into these three calls, so the
adapter, the MMLU evaluation and the export behave the same whichever framework trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AdapterHook", "ExportHook", "Hook", "HookList", "MMLUHook", "RecipeContext"]


@dataclass
class RecipeContext:
    """What hooks see: the live model, its parallel layout, tokenizer, and where outputs go."""

    model: Any
    layout: Any
    tokenizer: Any = None
    run_dir: str = "."
    data_root: str = ""
    adapter: Any = None
    results: dict[str, Any] = field(default_factory=dict)


class Hook:
    """No-op base: override what you need."""

    def on_setup(self, ctx: RecipeContext) -> None:
        pass

    def on_step_end(self, ctx: RecipeContext, step: int) -> None:
        pass

    def on_train_end(self, ctx: RecipeContext) -> None:
        pass


class HookList(Hook):
    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = list(hooks)

    def on_setup(self, ctx: RecipeContext) -> None:
        for h in self.hooks:
            h.on_setup(ctx)

    def on_step_end(self, ctx: RecipeContext, step: int) -> None:
        for h in self.hooks:
            h.on_step_end(ctx, step)

    def on_train_end(self, ctx: RecipeContext) -> None:
        for h in self.hooks:
            h.on_train_end(ctx)


class AdapterHook(Hook):
    """Installs the state-dict adapter for the model's family at setup (fails fast if unsupported)."""

    def on_setup(self, ctx: RecipeContext) -> None:
        from nemo_moe_export.adapters import get_adapter

        ctx.adapter = get_adapter(ctx.model.config)
        ctx.adapter.hf_metadata(ctx.model.state_dict())  # validates expert tensors up front


class MMLUHook(Hook):
    """Runs the MMLU callback every N steps and/or at the end of training."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def on_step_end(self, ctx: RecipeContext, step: int) -> None:
        metrics = self.callback.on_step_end(step, ctx.model, ctx.tokenizer, ctx.layout)
        if metrics:
            ctx.results.setdefault("mmlu_during_training", []).append({"step": step, **metrics})

    def on_train_end(self, ctx: RecipeContext) -> None:
        if self.callback.on_train_end(ctx.model, ctx.tokenizer, ctx.layout):
            ctx.results["mmlu"] = self.callback.last_result.metrics


class ExportHook(Hook):
    """Writes the HF checkpoint at the end of training with an :class:`ExportStep`."""

    def __init__(self, step: Any) -> None:
        self.step = step

    def on_train_end(self, ctx: RecipeContext) -> None:
        ctx.results["export"] = self.step(ctx.model, tokenizer=ctx.tokenizer)

