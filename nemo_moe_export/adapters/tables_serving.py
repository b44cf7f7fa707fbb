"""What ``config.json`` carries for serving engines, one table per family, beside the key tables.

transformers' ``save_pretrained`` writes ``architectures`` from the model's class and ``dtype``; the
export writes both for every door, ``architectures`` from transformers' causal-LM class of the
``model_type`` (a model built with ``from_config`` has none in its config). The official
checkpoints of each family also carry keys that a config built by transformers lacks and the
engines read (vLLM, SGLang); :data:`SERVING_KEYS` lists them: ``fixed`` values are what
transformers' model computes whatever the config says (a config claiming another value is
refused), ``derived`` values restate, in the official spelling, what transformers' own keys say.
docs/design.md#serving-engines. The tests compare each with the published configs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from nemo_moe_export.errors import InputError

__all__ = ["SERVING_KEYS", "ServingKeys", "causal_lm_class", "serving_keys", "serving_table"]


@dataclass(frozen=True)
class ServingKeys:
    model_types: tuple[str, ...]
    transformers_type: str  # the model type whose transformers classes build these
    fixed: Mapping[str, Any] = field(default_factory=dict)
    derived: Mapping[str, Callable[[Mapping[str, Any]], Any]] = field(default_factory=dict)
    # Official keys deliberately not written, with why (the tests hold the published configs to this).
    not_needed: Mapping[str, str] = field(default_factory=dict)
    # Keys without which an engine computes another model (its default differs): verify requires them.
    required: tuple[str, ...] = ()


def _rope_theta(config: Mapping[str, Any]) -> Any:
    return (config.get("rope_parameters") or {}).get("rope_theta", _SKIP)


def _rope_scaling(config: Mapping[str, Any]) -> Any:
    """transformers 5 keeps RoPE scaling in ``rope_parameters``; engines on transformers 4 read
    ``rope_scaling`` (null for plain RoPE, else its parameters with ``type``)."""
    params = dict(config.get("rope_parameters") or {})
    kind = params.pop("rope_type", "default")
    if kind == "default":
        return None
    params.pop("rope_theta", None)
    params.pop("type", None)
    return {**params, "type": kind}


def _first_k_dense(config: Mapping[str, Any]) -> int:
    """Kimi Linear's official config names dense layers by count (they come first); transformers by
    a per-layer list, which may say more than the count can."""
    kinds = list(config.get("mlp_layer_types") or [])
    count = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    if any(kind != "sparse" for kind in kinds[count:]):
        raise InputError("the engines' Kimi Linear config names dense MLP layers only as the first K",
                         key="mlp_layer_types", expected="'dense' layers first, then only 'sparse'",
                         actual=kinds, hint="train with the dense layers first to serve the export")
    return count


def _linear_attn_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Kimi Linear's official per-layer attention kinds, 1-indexed (transformers reads them back
    the same way in ``KimiLinearConfig.__post_init__``)."""
    kinds = list(config.get("layer_types") or [])
    return {
        "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"],
        "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
        "head_dim": config.get("linear_head_dim"),
        "num_heads": config.get("linear_num_heads"),
        "short_conv_kernel_size": config.get("linear_conv_kernel_dim"),
    }


_SKIP = object()  # a derived key with nothing to restate is not written
_ROPE = {"rope_theta": _rope_theta, "rope_scaling": _rope_scaling}

SERVING_KEYS = (
    # transformers' DeepseekV3 router is DeepSeek's noaux_tc with sigmoid scores; vLLM creates
    # e_score_correction_bias only for noaux_tc and defaults to softmax, SGLang reads topk_method
    # with no default. Every layer from first_k_dense_replace on is MoE (moe_layer_freq 1).
    ServingKeys(
        model_types=("deepseek_v3", "kimi_k2"), transformers_type="deepseek_v3",
        fixed={"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1},
        derived=_ROPE, required=("topk_method", "scoring_func"),
        not_needed={"ep_size": "DeepSeek's remote code's expert-parallel size at inference, not the weights'"},
    ),
    # transformers 5 writes the expert count as num_local_experts; the official key is num_experts.
    ServingKeys(
        model_types=("qwen3_moe",), transformers_type="qwen3_moe",
        derived={"num_experts": lambda c: c.get("num_local_experts", _SKIP), **_ROPE},
        not_needed={"max_window_layers": "read only with use_sliding_window, which Qwen3-MoE leaves off"},
    ),
    # transformers' Kimi Linear: MLA without RoPE, sigmoid router over expert groups (vLLM's
    # KimiLinearConfig reads these keys, with the official spelling of the layer kinds).
    ServingKeys(
        model_types=("kimi_linear",), transformers_type="kimi_linear",
        fixed={"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
               "moe_layer_freq": 1},
        derived={"linear_attn_config": _linear_attn_config, "first_k_dense_replace": _first_k_dense},
        # vLLM defaults mla_use_nope to false (it would rotate) and, without linear_attn_config, builds
        # every layer as MLA.
        required=("mla_use_nope", "linear_attn_config"),
    ),
)


def serving_table(model_type: str | None) -> ServingKeys | None:
    return next((t for t in SERVING_KEYS if model_type in t.model_types), None)


def causal_lm_class(model_type: str | None) -> Any:
    """transformers' causal-LM class for ``model_type`` (``kimi_k2``: DeepSeek-V3's), or None."""
    table = serving_table(model_type)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(table.transformers_type if table else model_type)
    return getattr(transformers, name, None) if name else None


def serving_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """The official keys of ``config``'s family (``config``: the full dict of a transformers config)
    that the export adds to ``config.json``. A fixed key the config states otherwise is refused."""
    table = serving_table(config.get("model_type"))
    if table is None:
        return {}
    for key, value in table.fixed.items():
        if key in config and config[key] != value:
            raise InputError(f"the config states {key}, but transformers' model computes another",
                             key=key, expected=value, actual=config[key],
                             hint=f"a server would read {key}={config[key]!r} and compute another model: "
                                  "drop the key, or export a model that computes it")
    keys = dict(table.fixed)
    for key, derive in table.derived.items():
        value = derive(config)
        if value is not _SKIP:
            keys[key] = value
    return keys
