"""NeMo 2 / Lightning: a callback that runs the plugin's hooks inside ``Trainer.fit``.

    from nemo_moe_export.integrations import plugin_hooks
    from nemo_moe_export.integrations.nemo import MoEExportCallback

    callback = MoEExportCallback(
        plugin_hooks(mmlu=dict(data_path="data/mmlu", every_n_steps=500, output_dir="runs/x/mmlu"),
                     export=dict(output_dir="runs/x/hf", dtype="bfloat16")),
        tokenizer=tokenizer,
    )
    trainer = nl.Trainer(..., callbacks=[callback])   # or lightning.pytorch.Trainer

The Hugging Face model is found as ``pl_module.model`` (the usual wrapper attribute) or the module
itself; pass ``get_model`` for other layouts. Needs ``pip install 'nemo-toolkit[lightning]'``
(falls back to plain Lightning's ``Callback`` when only ``lightning`` is installed).

MMLU metrics go to the trainer's own loggers (``trainer.loggers``: TensorBoard, W&B, CSV ...) at
the training step, next to the loss, and each step's training loss (the ``loss`` of
``training_step``'s output) is recorded in ``ctx.results["train_loss"]`` for the MMLU charts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_moe_export.evaluate.callback import LOSS_HISTORY_KEY
from nemo_moe_export.hooks import make_context
from nemo_moe_export.integrations._install_hint import missing

try:
    from nemo.lightning.base_callback import BaseCallback as _Base
except ImportError:  # plain Lightning is enough for the hooks we use
    try:
        from lightning.pytorch import Callback as _Base
    except ImportError:
        _Base = None

__all__ = ["MoEExportCallback"]


def _default_model(pl_module: Any) -> Any:
    return getattr(pl_module, "model", pl_module)


def _trainer_loggers(trainer: Any) -> Callable[[dict[str, float], int | None], None]:
    """``log(metrics, step)`` into every logger of ``trainer`` (none: nothing), at ``step`` or, for
    an evaluation outside a step, the trainer's current step."""

    def log(metrics: dict[str, float], step: int | None) -> None:
        for logger in getattr(trainer, "loggers", None) or []:
            logger.log_metrics(metrics, step=int(trainer.global_step) if step is None else step)

    return log


if _Base is None:

    class MoEExportCallback:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise missing("NeMo / Lightning", "pip install 'nemo-toolkit[lightning]'")

else:

    class MoEExportCallback(_Base):  # type: ignore[misc,valid-type]
        """Lightning events -> plugin hooks: ``setup`` -> on_setup, each optimizer step ->
        on_step_end(global_step), ``on_train_end`` -> on_train_end (MMLU, export)."""

        def __init__(self, hooks: Any, *, tokenizer: Any = None, layout: Any = None,
                     get_model: Callable[[Any], Any] = _default_model) -> None:
            super().__init__()
            self.hooks, self.tokenizer, self.layout, self.get_model = hooks, tokenizer, layout, get_model
            self.ctx = None
            self._last_step = -1

        def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
            self.ctx = make_context(self.get_model(pl_module), self.tokenizer, self.layout,
                                    getattr(trainer, "default_root_dir", None))
            for hook in getattr(self.hooks, "hooks", [self.hooks]):
                if hasattr(hook, "add_metrics_logger") and not getattr(hook, "_lightning_logger_added", False):
                    hook.add_metrics_logger(_trainer_loggers(trainer))
                    hook._lightning_logger_added = True  # setup runs again for validate / test
            self.hooks.on_setup(self.ctx)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = int(trainer.global_step)
            if step != self._last_step:  # once per optimizer step, also with gradient accumulation
                self._last_step = step
                loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
                if loss is not None:
                    self.ctx.results.setdefault(LOSS_HISTORY_KEY, []).append([step, float(loss)])
                self.hooks.on_step_end(self.ctx, step)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.hooks.on_train_end(self.ctx)
