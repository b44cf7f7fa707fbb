"""The Hugging Face config of a megatron-core ``GPTModel``: what the export writes as ``config.json``.

Built from the model's own ``TransformerConfig`` (``MLATransformerConfig`` for DeepSeek-V3) and its
modules: which layers are MoE is read from ``decoder.layers[i].mlp``, not from ``moe_layer_freq``
(under pipeline parallelism, from every stage's layers: the caller gathers them). A DeepSeek-V3
multi-token-prediction block (``mtp_num_layers``) is ``num_nextn_predict_layers``.
Field by field it is Megatron-Bridge's mapping (``deepseek/common.py``, ``qwen3_moe_bridge.py``;
docs/design.md#megatron-core-models). A model the HF architecture cannot express (biases, another
activation, zero-centred norms, a routing function the family does not use) is refused with an
``InputError`` naming the megatron field, before anything is evaluated or written.

The config is a subclass of the transformers config class that carries the model's
:class:`~nemo_moe_export.adapters.InMemoryFormat` (megatron-core names, the EP ranks' local experts)
as ``in_memory_format`` for :func:`~nemo_moe_export.adapters.get_adapter`; ``to_dict`` leaves it
out, so ``config.json`` is exactly the stock class's and loads with ``AutoConfig``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig

from nemo_moe_export.adapters import InMemoryFormat
from nemo_moe_export.errors import InputError
from nemo_moe_export.megatron.state import moe_layer_ids

__all__ = ["FAMILIES", "MegatronDeepseekV3Config", "MegatronQwen3MoeConfig", "hf_config_for", "infer_family",
           "stock_config_class"]

FAMILIES = ("deepseek_v3", "qwen3_moe")


class _CarriesInMemoryFormat:
    """``in_memory_format`` is for the adapter on this process only: never serialized."""

    in_memory_format: InMemoryFormat | None = None

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()  # type: ignore[misc]
        out.pop("in_memory_format", None)
        return out


class MegatronDeepseekV3Config(_CarriesInMemoryFormat, DeepseekV3Config):
    """``DeepseekV3Config`` of a megatron-core MLA model (``config.json`` is the stock class's)."""


class MegatronQwen3MoeConfig(_CarriesInMemoryFormat, Qwen3MoeConfig):
    """``Qwen3MoeConfig`` of a megatron-core GQA MoE model (``config.json`` is the stock class's)."""


def stock_config_class(config: Any) -> type:
    """The transformers config class a megatron config subclasses (what ``config.json`` names)."""
    return next(c for c in type(config).__mro__ if c.__module__.startswith("transformers."))


def infer_family(config: Any) -> str:
    """MLA models are DeepSeek-V3-style, the others Qwen3-MoE-style."""
    return "deepseek_v3" if getattr(config, "multi_latent_attention", False) else "qwen3_moe"


def hf_config_for(gpt_model: Any, family: str, layout: InMemoryFormat, moe_layers: list[int] | None = None,
                  *, vocab_size: int | None = None) -> Any:
    """The HF config of ``gpt_model`` as ``family``, carrying ``layout``; refuses what HF cannot
    express. ``moe_layers``: the global numbers of the model's MoE layers (default: this model's,
    the whole model without pipeline stages). ``vocab_size``: the HF vocabulary, without megatron's
    padding (default: the model's)."""
    if family not in FAMILIES:
        raise InputError("unsupported megatron-core model family", key="family", expected=FAMILIES,
                         actual=repr(family))
    cfg = gpt_model.config
    _require_common(gpt_model, cfg)
    moe = sorted(moe_layer_ids(gpt_model) if moe_layers is None else moe_layers)
    build = _deepseek_v3 if family == "deepseek_v3" else _qwen3_moe
    common = _common_fields(gpt_model, cfg)
    if vocab_size is not None:
        common["vocab_size"] = vocab_size
    config = build(gpt_model, cfg, moe, common)
    config.in_memory_format = layout
    return config


def _common_fields(gpt_model: Any, cfg: Any) -> dict[str, Any]:
    return dict(
        vocab_size=gpt_model.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_experts_per_tok=cfg.moe_router_topk,
        max_position_embeddings=gpt_model.max_sequence_length, rms_norm_eps=cfg.layernorm_epsilon,
        tie_word_embeddings=gpt_model.share_embeddings_and_output_weights, hidden_act="silu",
        attention_bias=False, dtype=str(cfg.params_dtype).removeprefix("torch."),
        rope_parameters={"rope_type": "default", "rope_theta": float(gpt_model.rotary_base)},
    )


def _deepseek_v3(gpt_model: Any, cfg: Any, moe: list[int], common: dict[str, Any]) -> Any:
    first_dense = moe[0] if moe else cfg.num_layers
    _require(moe == list(range(first_dense, cfg.num_layers)), "moe_layer_freq",
             "dense layers first, then only MoE layers (HF first_k_dense_replace)", f"MoE layers {moe}")
    _require(cfg.moe_router_score_function == "sigmoid", "moe_router_score_function", "'sigmoid'",
             cfg.moe_router_score_function)
    _require(cfg.moe_router_enable_expert_bias, "moe_router_enable_expert_bias",
             "True (HF keeps e_score_correction_bias)", cfg.moe_router_enable_expert_bias)
    _require(cfg.qk_layernorm, "qk_layernorm", "True (HF has q_a_layernorm / kv_a_layernorm)", cfg.qk_layernorm)
    _require(cfg.layernorm_epsilon == 1e-6, "layernorm_epsilon",
             "1e-6 (HF builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever rms_norm_eps says)",
             cfg.layernorm_epsilon)
    _require(getattr(cfg, "rope_type", "rope") == "rope", "rope_type", "'rope' (yarn is not mapped yet)",
             getattr(cfg, "rope_type", None))
    shared = cfg.moe_shared_expert_intermediate_size or 0
    _require(shared > 0 and shared % cfg.moe_ffn_hidden_size == 0, "moe_shared_expert_intermediate_size",
             f"a positive multiple of moe_ffn_hidden_size={cfg.moe_ffn_hidden_size}", shared)
    return MegatronDeepseekV3Config(
        **common, num_key_value_heads=cfg.num_attention_heads, n_routed_experts=cfg.num_moe_experts,
        n_shared_experts=shared // cfg.moe_ffn_hidden_size,
        routed_scaling_factor=float(cfg.moe_router_topk_scaling_factor or 1.0),
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
        qk_nope_head_dim=cfg.qk_head_dim, v_head_dim=cfg.v_head_dim, n_group=cfg.moe_router_num_groups or 1,
        topk_group=cfg.moe_router_group_topk or 1, first_k_dense_replace=first_dense,
        # megatron normalizes sigmoid top-k scores only when top-k > 1 (moe_utils.py)
        norm_topk_prob=cfg.moe_router_topk > 1, rope_interleave=True, architectures=["DeepseekV3ForCausalLM"],
        num_nextn_predict_layers=cfg.mtp_num_layers or 0,  # transformers' default is 1: say none when none
    )


def _qwen3_moe(gpt_model: Any, cfg: Any, moe: list[int], common: dict[str, Any]) -> Any:
    _require(not cfg.multi_latent_attention, "multi_latent_attention", "False for qwen3_moe", True)
    _require(cfg.moe_router_score_function == "softmax", "moe_router_score_function", "'softmax'",
             cfg.moe_router_score_function)
    _require(not cfg.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", "False", True)
    _require(not cfg.moe_shared_expert_intermediate_size, "moe_shared_expert_intermediate_size",
             "None (Qwen3-MoE has no shared experts)", cfg.moe_shared_expert_intermediate_size)
    _require(cfg.qk_layernorm, "qk_layernorm", "True (Qwen3 has q_norm / k_norm)", cfg.qk_layernorm)
    _require(not cfg.mtp_num_layers, "mtp_num_layers", "None (Qwen3-MoE has no MTP layer)", cfg.mtp_num_layers)
    return MegatronQwen3MoeConfig(
        **common, num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels,
        num_experts=cfg.num_moe_experts, decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe],
        # softmax over the top-k logits (megatron's default) is HF's normalized top-k softmax
        norm_topk_prob=not cfg.moe_router_pre_softmax, architectures=["Qwen3MoeForCausalLM"],
    )


def _require_common(gpt_model: Any, cfg: Any) -> None:
    """What both HF families assume: SwiGLU without biases, RMSNorm, plain RoPE, untied or tied."""
    _require(cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu, "activation_func",
             "SwiGLU (gated_linear_unit=True, activation_func=F.silu)",
             f"gated_linear_unit={cfg.gated_linear_unit}, {getattr(cfg.activation_func, '__name__', cfg.activation_func)}")
    _require(not cfg.add_bias_linear and not cfg.add_qkv_bias, "add_bias_linear", "False (and add_qkv_bias False)",
             f"add_bias_linear={cfg.add_bias_linear}, add_qkv_bias={cfg.add_qkv_bias}")
    _require(cfg.normalization == "RMSNorm" and not cfg.layernorm_zero_centered_gamma, "normalization",
             "'RMSNorm' without zero-centred gamma", f"{cfg.normalization}, zero_centered={cfg.layernorm_zero_centered_gamma}")
    _require(cfg.glu_linear_offset == 0 and cfg.activation_func_clamp_value is None, "glu_linear_offset",
             "0 and no activation clamp", f"{cfg.glu_linear_offset}, clamp {cfg.activation_func_clamp_value}")
    _require(gpt_model.rotary_percent == 1.0 and not cfg.rotary_interleaved and not gpt_model.rotary_scaling,
             "rotary_percent", "1.0, not interleaved, no rope scaling",
             f"{gpt_model.rotary_percent}, interleaved={cfg.rotary_interleaved}, scaling={gpt_model.rotary_scaling}")
    _require(cfg.num_moe_experts is not None, "num_moe_experts", "an MoE model", None)
    # the MTP layers project through the output layer, so they must sit on the stage that holds it
    _require(not gpt_model.mtp_process or gpt_model.post_process, "pipeline_model_parallel_layout",
             "the MTP layers on the last pipeline stage (with the output layer)", "MTP layers on another stage")


def _require(ok: Any, field: str, expected: str, actual: Any) -> None:
    if not ok:
        raise InputError("the megatron-core model has a feature its HF family cannot express",
                         key=f"megatron.{field}", expected=expected, actual=actual,
                         hint="see docs/design.md#megatron-core-models for what is mapped")
