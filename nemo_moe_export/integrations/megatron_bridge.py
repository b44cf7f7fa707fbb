"""Megatron-Bridge: a ``megatron.bridge.training.callbacks.Callback`` running the plugin's hooks.

    from megatron.bridge.training.pretrain import pretrain
    from nemo_moe_export.integrations import plugin_hooks
    from nemo_moe_export.integrations.megatron_bridge import megatron_bridge_callback

    hooks = plugin_hooks(export=dict(output_dir="/ckpt/hf", dtype="bfloat16"))
    pretrain(config, forward_step, callbacks=[megatron_bridge_callback(hooks, tokenizer=tok)])

Megatron-Bridge overrides are Hydra grammar applied to its own dataclass config and unknown keys are
skipped, so the plugin's settings live in its own config (``conf/``), not in Bridge's. Megatron-Bridge
needs Python >= 3.12 and a GPU; on other machines this module imports and explains.
"""

from __future__ import annotations

from typing import Any

from nemo_moe_export.hooks import make_context
from nemo_moe_export.integrations._install_hint import missing

__all__ = ["megatron_bridge_callback"]


def _model_of(context: Any) -> Any:
    model = getattr(context, "model", None)
    if isinstance(model, (list, tuple)):  # Bridge passes the list of model chunks
        model = model[0]
    return getattr(model, "module", model)


def megatron_bridge_callback(hooks: Any, *, tokenizer: Any = None, layout: Any = None) -> Any:
    """A Bridge ``Callback``: on_train_start -> on_setup, on_train_step_end -> on_step_end(step),
    on_train_end -> on_train_end."""
    try:
        from megatron.bridge.training.callbacks import Callback
    except ImportError as exc:
        raise missing("Megatron-Bridge", "pip install megatron-bridge (Python >= 3.12)") from exc

    class _MoEExportBridgeCallback(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.ctx = None

        def on_train_start(self, context: Any) -> None:
            self.ctx = make_context(_model_of(context), tokenizer, layout)
            hooks.on_setup(self.ctx)

        def on_train_step_end(self, context: Any) -> None:
            hooks.on_step_end(self.ctx, int(context.state.train_state.step))

        def on_train_end(self, context: Any) -> None:
            hooks.on_train_end(self.ctx)

    return _MoEExportBridgeCallback()
