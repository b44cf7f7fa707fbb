"""Megatron-Bridge: a ``megatron.bridge.training.callbacks.Callback`` running the plugin's hooks.

    from megatron.bridge.training.pretrain import pretrain
    from nemo_moe_export.integrations import plugin_hooks
    from nemo_moe_export.integrations.megatron_bridge import megatron_bridge_callback

    hooks = plugin_hooks(mmlu=dict(data_path="data/mmlu", every_n_steps=500),
                         export=dict(output_dir="/ckpt/hf", dtype="bfloat16"))
    pretrain(config, forward_step, callbacks=[megatron_bridge_callback(hooks, tokenizer=tok)])

Bridge hands callbacks a ``CallbackContext`` whose ``model`` is the list of model chunks, each a
megatron-core ``GPTModel`` inside its wrappers (``DistributedDataParallel``, ``Float16Module``:
each keeps the model as ``.module``). :class:`BridgeEvents` unwraps the first chunk and wraps the
``GPTModel`` in :class:`~nemo_moe_export.megatron.MegatronCausalLM` (its groups from
``parallel_state``), so the MMLU callback evaluates it through megatron's own dispatchers and the
export writes its HF checkpoint with no gather (docs/design.md#megatron-core-models). Events:
``on_train_start`` -> ``on_setup``, ``on_train_step_end`` -> ``on_step_end(step)`` (the step's
``lm loss`` is recorded for the MMLU charts), ``on_train_end`` -> ``on_train_end``.

Megatron-Bridge overrides are Hydra grammar applied to its own dataclass config and unknown keys are
skipped, so the plugin's settings live in its own config (``conf/``), not in Bridge's. Megatron-Bridge
needs Python >= 3.12 and a GPU; on other machines this module imports and explains, and
:class:`BridgeEvents` (the translation itself) works without it.
"""

from __future__ import annotations

from typing import Any

from nemo_moe_export.evaluate.callback import LOSS_HISTORY_KEY
from nemo_moe_export.hooks import make_context
from nemo_moe_export.integrations._install_hint import missing
from nemo_moe_export.megatron import MegatronCausalLM, is_megatron_model

__all__ = ["BridgeEvents", "megatron_bridge_callback", "plugin_model"]

LOSS_KEY = "lm loss"  # the loss Megatron-Bridge's GPT step reports in CallbackContext.loss_dict


def plugin_model(chunks: Any, *, family: str | None = None) -> Any:
    """The model the hooks see: the first chunk without its wrappers, a megatron-core model wrapped
    in ``MegatronCausalLM`` (collective: every rank calls this)."""
    model = chunks[0] if isinstance(chunks, (list, tuple)) else chunks
    while hasattr(model, "module"):  # DistributedDataParallel, Float16Module, ...
        model = model.module
    if is_megatron_model(model):
        return MegatronCausalLM(model, family=family)
    return model


class BridgeEvents:
    """Bridge's callback events as the plugin's hook calls (the methods Bridge's ``Callback`` has)."""

    def __init__(self, hooks: Any, *, tokenizer: Any = None, layout: Any = None, family: str | None = None) -> None:
        super().__init__()
        self.hooks, self.tokenizer, self.layout, self.family = hooks, tokenizer, layout, family
        self.ctx: Any = None

    def on_train_start(self, context: Any) -> None:
        model = plugin_model(context.model, family=self.family)
        self.ctx = make_context(model, self.tokenizer, self.layout or getattr(model, "layout", None))
        self.hooks.on_setup(self.ctx)

    def on_train_step_end(self, context: Any) -> None:
        step = int(context.state.train_state.step)
        loss = (getattr(context, "loss_dict", None) or {}).get(LOSS_KEY)
        if loss is not None:
            self.ctx.results.setdefault(LOSS_HISTORY_KEY, []).append([step, float(loss)])
        self.hooks.on_step_end(self.ctx, step)

    def on_train_end(self, context: Any) -> None:
        self.hooks.on_train_end(self.ctx)


def megatron_bridge_callback(hooks: Any, *, tokenizer: Any = None, layout: Any = None, family: str | None = None) -> Any:
    """A Bridge ``Callback`` running ``hooks`` (:class:`BridgeEvents` on Bridge's base class).
    ``family``: the megatron-core model's HF family (default: DeepSeek-V3 for MLA, else Qwen3-MoE)."""
    try:
        from megatron.bridge.training.callbacks import Callback
    except ImportError as exc:
        raise missing("Megatron-Bridge", "pip install megatron-bridge (Python >= 3.12)") from exc

    class _MoEExportBridgeCallback(BridgeEvents, Callback):
        pass

    return _MoEExportBridgeCallback(hooks, tokenizer=tokenizer, layout=layout, family=family)
