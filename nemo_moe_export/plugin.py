"""The plugin's hooks, assembled: the adapter hook, the MMLU callback and the export step.

:mod:`nemo_moe_export.hooks` is the protocol they implement (and nothing else, so the hooks can
import it); this module sits above all three and builds them from plain settings, for the
integrations and for training loops of your own (docs/design.md#hooks):

    from nemo_moe_export.hooks import make_context
    from nemo_moe_export.plugin import plugin_hooks

    hooks = plugin_hooks(mmlu=dict(data_path="data/mmlu", every_n_steps=500, output_dir="out/mmlu"),
                         export=dict(output_dir="out/hf", dtype="bfloat16"))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_moe_export.adapters import get_adapter
from nemo_moe_export.evaluate.callback import MMLUCallback
from nemo_moe_export.export import ExportStep
from nemo_moe_export.hooks import Hook, HookList, RecipeContext

__all__ = ["AdapterHook", "plugin_hooks"]


class AdapterHook(Hook):
    """Builds the state-dict adapter for the model's family once, at setup, into ``ctx.adapter``.

    It fails fast: an unsupported family or malformed expert tensors are refused before the first
    training step rather than at the export hours later.
    """

    def on_setup(self, ctx: RecipeContext) -> None:
        ctx.adapter = get_adapter(ctx.model.config)
        ctx.adapter.hf_metadata(ctx.model.state_dict())  # validates the expert tensors up front


def plugin_hooks(*, mmlu: Mapping[str, Any] | None = None, export: Mapping[str, Any] | None = None) -> HookList:
    """The adapter hook, plus the MMLU callback and/or the export step when their settings are given.

    ``mmlu``: keyword arguments of :class:`~nemo_moe_export.evaluate.callback.MMLUCallback`
    (``data_path``, ``output_dir`` and any :class:`~nemo_moe_export.evaluate.options.MMLUOptions`
    field, or ``options=``); ``export``: keyword arguments of
    :class:`~nemo_moe_export.export.ExportStep` (``output_dir`` and any
    :class:`~nemo_moe_export.export.options.ExportOptions` field, or ``options=``).
    """
    hooks: list[Hook] = [AdapterHook()]
    if mmlu is not None:
        hooks.append(MMLUCallback(**mmlu))
    if export is not None:
        hooks.append(ExportStep(**export))
    return HookList(hooks)
