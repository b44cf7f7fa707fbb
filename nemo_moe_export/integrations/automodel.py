"""NeMo AutoModel: a recipe mixin and an AutoModel-style state-dict adapter.

AutoModel has no callback registry; a recipe subclass is the hook point:

    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction
    from nemo_moe_export.integrations.automodel import MoEExportRecipeMixin

    class Recipe(MoEExportRecipeMixin, TrainFinetuneRecipeForNextTokenPrediction):
        moe_export = dict(export=dict(output_dir="/ckpt/hf", dtype="bfloat16"))

        def setup(self):
            super().setup()
            self.moe_export_setup(self.model_parts[0], tokenizer=self.tokenizer, device_mesh=self.device_mesh)

        def run_train_validation_loop(self):
            super().run_train_validation_loop()
            self.moe_export_train_end()

Call ``self.moe_export_step_end(step)`` from the training loop for periodic MMLU. The adapter
(:class:`AutoModelStateDictAdapter`) follows AutoModel's ``to_hf`` / ``from_hf`` signatures over the
grouped layout (``gate_and_up_projs`` / ``down_projs``), for any sharding.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_moe_export.adapters import StateDictAdapter, get_table
from nemo_moe_export.hooks import make_context, plugin_hooks

__all__ = ["AutoModelStateDictAdapter", "MoEExportRecipeMixin"]


class MoEExportRecipeMixin:
    """Adds ``moe_export_setup`` / ``moe_export_step_end`` / ``moe_export_train_end`` to a recipe.

    Settings come from the class attribute ``moe_export = {"mmlu": {...}, "export": {...}}``
    (keyword arguments of ``MMLUCallback`` and ``ExportStep``, as :func:`~nemo_moe_export.hooks.plugin_hooks`
    takes them); what the hooks record is ``self.moe_export_results``.
    """

    moe_export: dict[str, Any] = {}

    def moe_export_setup(self, model: Any, *, tokenizer: Any = None, device_mesh: Any = None) -> None:
        from nemo_moe_export.parallel import discover_layout

        self._moe_hooks = plugin_hooks(**self.moe_export)
        self._moe_ctx = make_context(model, tokenizer, discover_layout(device_mesh))
        self._moe_hooks.on_setup(self._moe_ctx)

    def moe_export_step_end(self, step: int) -> None:
        self._moe_hooks.on_step_end(self._moe_ctx, step)

    def moe_export_train_end(self) -> None:
        self._moe_hooks.on_train_end(self._moe_ctx)

    @property
    def moe_export_results(self) -> dict[str, Any]:
        """``ctx.results``: ``"mmlu_during_training"``, ``"mmlu"``, ``"export"`` as the hooks ran."""
        return self._moe_ctx.results


class AutoModelStateDictAdapter(StateDictAdapter):
    """AutoModel's adapter interface on top of the shared engine.

    ``to_hf(state_dict)`` returns ``{hf_key: tensor}`` for the parts this rank holds (views, global
    expert ids); ``from_hf(hf_state_dict, device_mesh=None, target=None)`` fills ``target`` (the
    model's sharded state dict) from an HF-keyed dict, reading only this rank's slices.
    """

    def __init__(self, config: Any, model_type: str | None = None) -> None:
        model_type = model_type or getattr(config, "model_type", None) or config["model_type"]
        super().__init__(config, get_table(model_type))

    def to_hf(self, state_dict: Any, **_: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {key: shard.tensor for key, shard in super().to_hf(state_dict).items()}

    def from_hf(self, hf_state_dict: Any, device_mesh: Any = None, *, target: Any = None,  # type: ignore[override]
                **kwargs: Any) -> Any:
        if target is None:
            raise TypeError("pass target=model.state_dict() (the sharded tensors to fill)")
        super().from_hf(target, hf_state_dict, **kwargs)
        return target
