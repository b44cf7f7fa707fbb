"""megatron-core support: evaluate and export the ``GPTModel`` s Megatron recipes train.

* ``model.py``: :class:`MegatronCausalLM`, a thin wrapper that presents a megatron-core
  ``GPTModel`` transformers-style to the MMLU evaluator (megatron's own token dispatchers run the
  forwards, under ``parallel_state``'s groups) and to the hooks and the no-gather export;
* ``hf_config.py``: the HF config (``config.json``) built from the model's ``TransformerConfig``;
* ``state.py``: the export's view of the model's tensors (DTensors over their replica groups, under
  global layer numbers) and the EP ranks' ``local_expert_indices``;
* ``pipeline.py``: the forward of a model split into pipeline stages (megatron's own schedule; the
  last stage's logits on every rank);
* ``tiny.py``: tiny DeepSeek-V3-style (MLA) and Qwen3-MoE-style models for the recipe and tests;
* ``recipe.py``: the recipe's model (``model.backend: megatron_core``): ``parallel_state``, build, wrap;
* ``checkpoint.py``: training checkpoints with megatron's own ``dist_checkpointing``;
* ``cpu_patches.py``: stand-ins for megatron-core's CUDA-only calls, applied only by the tests and
  the recipe on CPU ranks.

The key mapping lives with the other families' in ``adapters/tables_megatron.py``. Importing this
package imports megatron-core lazily (only ``model.py``'s checks and ``tiny.py`` need it), so
``nemo_moe_export`` itself never pays megatron's import time. docs/design.md#megatron-core-models.
"""

from __future__ import annotations

from nemo_moe_export.megatron.hf_config import FAMILIES, hf_config_for, infer_family
from nemo_moe_export.megatron.model import MegatronCausalLM, attention_mask_for

__all__ = ["FAMILIES", "MegatronCausalLM", "attention_mask_for", "hf_config_for", "infer_family", "is_megatron_model"]


def is_megatron_model(model: object) -> bool:
    """Whether ``model`` is a megatron-core module (a ``GPTModel`` a framework hands us), by its class."""
    return type(model).__module__.startswith("megatron.core.")
