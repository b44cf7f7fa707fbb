"""Thin, import-guarded adapters from training frameworks to the plugin's hooks (``nemo_moe_export.hooks``).

* ``nemo``            NeMo 2 / Lightning: :class:`MoEExportCallback` (``nemo.lightning.base_callback.BaseCallback``)
* ``megatron_bridge`` Megatron-Bridge: :func:`megatron_bridge_callback` (``megatron.bridge.training.callbacks.Callback``)
* ``automodel``       NeMo AutoModel: :class:`MoEExportRecipeMixin` for a recipe subclass
* ``nemo_run``        NeMo-Run: the launcher job (``nemo-moe-export launch``)

Each module imports its framework only when used, and says what to install when it is missing.
What every integration is built from is re-exported here: ``plugin_hooks`` (the hooks from plain
settings) and ``make_context`` (the context the hooks share).
"""

from nemo_moe_export.hooks import Hook, HookList, RecipeContext, make_context
from nemo_moe_export.plugin import AdapterHook, plugin_hooks

__all__ = ["AdapterHook", "Hook", "HookList", "RecipeContext", "make_context", "plugin_hooks"]
