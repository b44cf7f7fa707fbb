"""Tables for megatron-core ``GPTModel`` state dicts: DeepSeek-V3 (MLA) and Qwen3-MoE layouts.

In-memory names are megatron-core 0.16's, for both the local spec (``get_gpt_decoder_block_spec(...,
use_transformer_engine=False)``) and the Transformer Engine spec, which fuses norms into the next
linear (``linear_qkv.layer_norm_weight`` is the input norm, a dense layer's
``mlp.linear_fc1.layer_norm_weight`` its post-attention norm). HF names are what transformers 5
``save_pretrained`` writes; the mapping is Megatron-Bridge's (``deepseek/common.py``,
``qwen3_moe_bridge.py``). docs/design.md#megatron-core-models lists where each fact comes from.

Routed experts come in three layouts, all with the model's own global ids (``local_experts``):

* ``SequentialMLP``: ``experts.local_experts.{i}.linear_fc1.weight`` [2F, H] (gate rows, then up:
  ``mlp.py``'s glu takes ``chunk(x, 2)``) and ``linear_fc2.weight`` [H, F];
* ``TEGroupedMLP``: ``experts.linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``, same orientation;
* legacy ``GroupedMLP``: ``experts.weight1`` [H, L*2F] and ``weight2`` [L*F, H], which the module
  itself views as [L, H, 2F] and [L, F, H] (``experts.py``), so HF ``gate = weight1.view(L, H, -1)[e,
  :, :F].T``.

A DeepSeek-V3 multi-token-prediction (MTP) layer (``mtp.layers.{L}``, numbered by the view with the
global layer number megatron gives its decoder block, ``num_layers`` for the first) is stored as
HF's ``model.layers.{L}``: ``enorm``, ``hnorm``, ``eh_proj`` (megatron concatenates the normed
embedding first, then the normed hidden state, as DeepSeek's reference does), ``final_layernorm``
as ``shared_head.norm``, the output layer it projects through as ``shared_head.head``, and its
``transformer_layer`` under the same names as a decoder layer's (Megatron-Bridge's
``deepseek/common.py`` maps the same keys, less ``shared_head.head``; vLLM loads it).

Every key must match a rule (``require_rule``): megatron never uses transformers' names, so a key
passed through unchanged would be a silently wrong checkpoint.
"""

from __future__ import annotations

import re

from nemo_moe_export.adapters.engine import KeyRule, ModelTable
from nemo_moe_export.adapters.tables import DEEPSEEK_V3, QWEN3_MOE

__all__ = ["GLU_PARTS", "MEGATRON_DEEPSEEK_V3", "MEGATRON_QWEN3_MOE", "MEGATRON_TABLES", "NAMING"]

NAMING = "megatron_core"
"""The ``InMemoryFormat.naming`` of megatron-core state dicts; tables are ``"megatron_core:{model_type}"``."""

_LAYER = r"(?P<prefix>decoder\.layers\.(?P<layer>\d+))"
_MTP = r"mtp\.layers\.(?P<layer>\d+)"
_MTP_BLOCK = rf"(?P<prefix>{_MTP}\.transformer_layer)"  # an MTP layer's decoder block: a layer's names
_HF_LAYER = "model.layers.{layer}"
GLU_PARTS = ("_w", "_v")
"""Suffixes of a SwiGLU ``linear_fc1``'s gate and up pieces, megatron-core's own names for the two
ShardedTensors its GLU factory builds (``mlp.apply_swiglu_sharded_factory``): a TP rank holds
``[gate_r; up_r]``, two row ranges of two HF tensors, so the view presents them apart."""
_GLU_PART = r"(?P<part>_w|_v)?"
_VOCAB_ROWS = "vocab_size"  # megatron pads the vocabulary; HF's vocab_size is the unpadded count


def _renames(pairs: dict[str, str], layer: str = _LAYER) -> tuple[KeyRule, ...]:
    """One-to-one renames of per-layer tensors: megatron suffix -> HF suffix."""
    return tuple(KeyRule(rf"{layer}\.{re.escape(src)}", (f"{_HF_LAYER}.{dst}",)) for src, dst in pairs.items())


def _gated_mlp(src: str, dst: str, layer: str = _LAYER) -> tuple[KeyRule, ...]:
    """A gated MLP: ``linear_fc1`` [2F, H] is gate rows then up rows (or its ``_w`` / ``_v``
    pieces, :data:`GLU_PARTS`); ``linear_fc2`` is down."""
    return (
        KeyRule(rf"{layer}\.{re.escape(src)}\.linear_fc1\.weight{_GLU_PART}",
                (f"{_HF_LAYER}.{dst}.gate_proj.weight", f"{_HF_LAYER}.{dst}.up_proj.weight"), parts=GLU_PARTS),
        KeyRule(rf"{layer}\.{re.escape(src)}\.linear_fc2\.weight", (f"{_HF_LAYER}.{dst}.down_proj.weight",)),
    )


def _routed_experts(layer: str = _LAYER, block: str = "") -> tuple[KeyRule, ...]:
    """The three megatron-core experts layouts, to HF ``mlp.experts.{e}.{gate,up,down}_proj``.
    ``block`` tells the rule groups of another kind of layer apart (a group must be complete)."""
    moe = rf"(?P<moe>{layer}\.mlp)"
    per = f"{_HF_LAYER}.mlp.experts.{{expert}}"
    gate_up = (f"{per}.gate_proj.weight", f"{per}.up_proj.weight")
    down = (f"{per}.down_proj.weight",)
    return (
        KeyRule(rf"{moe}\.experts\.local_experts\.(?P<local>\d+)\.linear_fc1\.weight{_GLU_PART}", gate_up,
                local_experts=True, group=f"sequential{block}", parts=GLU_PARTS),
        KeyRule(rf"{moe}\.experts\.local_experts\.(?P<local>\d+)\.linear_fc2\.weight", down,
                local_experts=True, group=f"sequential{block}"),
        KeyRule(rf"{moe}\.experts\.linear_fc1\.weight(?P<local>\d+)", gate_up, local_experts=True,
                group=f"te_grouped{block}"),
        KeyRule(rf"{moe}\.experts\.linear_fc2\.weight(?P<local>\d+)", down, local_experts=True,
                group=f"te_grouped{block}"),
        KeyRule(rf"{moe}\.experts\.weight1", gate_up, per_expert=True, local_experts=True,
                experts_view=("hidden_size", -1), split_dim=1, transpose=True, group=f"legacy_grouped{block}"),
        KeyRule(rf"{moe}\.experts\.weight2", down, per_expert=True, local_experts=True,
                experts_view=(-1, "hidden_size"), transpose=True, group=f"legacy_grouped{block}"),
    )


_MTP_OWN = {  # what only an MTP layer has, around its decoder block
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
# the view's name of the output layer an MTP layer projects through (padded vocabulary rows)
_MTP_HEAD = KeyRule(rf"{_MTP}\.output_layer\.weight", (f"{_HF_LAYER}.shared_head.head.weight",),
                    rows_field=_VOCAB_ROWS)

_MODEL_RULES = (
    KeyRule(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), rows_field=_VOCAB_ROWS),
    KeyRule(r"decoder\.final_layernorm\.weight", ("model.norm.weight",)),
    KeyRule(r"output_layer\.weight", ("lm_head.weight",), rows_field=_VOCAB_ROWS),
)

_NORMS_AND_ROUTER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",  # MoE layers (and local-spec dense ones)
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE dense layers
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}

_MLA_ATTENTION = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",  # q_lora_rank None
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",  # TE
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",  # TE
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}

_GQA_ATTENTION = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}

# ``linear_qkv`` [groups * (heads/groups + 2) * head_dim, H] holds, per query group, that group's
# query heads, then its key head, then its value head (attention.py splits it so); HF keeps q, k, v
# apart, so q is every group's first part, in group order.
_QKV = KeyRule(
    rf"{_LAYER}\.self_attention\.linear_qkv\.weight",
    (f"{_HF_LAYER}.self_attn.q_proj.weight", f"{_HF_LAYER}.self_attn.k_proj.weight",
     f"{_HF_LAYER}.self_attn.v_proj.weight"),
    split_groups="num_key_value_heads",
    split_units=("num_attention_heads", "num_key_value_heads", "num_key_value_heads"),
)


def _deepseek_v3_layer(layer: str, block: str = "") -> tuple[KeyRule, ...]:
    """Every rule of one DeepSeek-V3 decoder layer (or an MTP layer's decoder block) at ``layer``."""
    return (
        *_routed_experts(layer, block),
        *_gated_mlp("mlp.shared_experts", "mlp.shared_experts", layer),
        *_gated_mlp("mlp", "mlp", layer),
        *_renames(_NORMS_AND_ROUTER, layer),
        *_renames(_MLA_ATTENTION, layer),
    )

MEGATRON_DEEPSEEK_V3 = ModelTable(
    model_types=(f"{NAMING}:deepseek_v3", f"{NAMING}:kimi_k2"),
    rules=(
        *_MODEL_RULES,
        *_deepseek_v3_layer(_LAYER),
        *_deepseek_v3_layer(_MTP_BLOCK, ":mtp"),
        *_renames(_MTP_OWN, _MTP),
        _MTP_HEAD,
    ),
    num_experts_fields=("n_routed_experts",),
    tied_keys=("output_layer.weight",),
    description="megatron-core DeepSeek-V3 (MLA): decoder.layers.L.mlp.experts.local_experts.i, "
                "mtp.layers.L.{enorm,hnorm,eh_proj,final_layernorm,output_layer,transformer_layer.*}",
    require_rule=True,
    fp8_weights=DEEPSEEK_V3.fp8_weights,  # over HF names: the same checkpoint format
)

MEGATRON_QWEN3_MOE = ModelTable(
    model_types=(f"{NAMING}:qwen3_moe",),
    rules=(
        *_MODEL_RULES,
        *_routed_experts(),
        *_gated_mlp("mlp", "mlp"),
        *_renames(_NORMS_AND_ROUTER),
        *_renames(_GQA_ATTENTION),
        _QKV,
    ),
    num_experts_fields=("num_experts",),
    tied_keys=("output_layer.weight",),
    description="megatron-core Qwen3-MoE: decoder.layers.L.mlp.experts.local_experts.i",
    require_rule=True,
    fp8_weights=QWEN3_MOE.fp8_weights,
)

MEGATRON_TABLES: tuple[ModelTable, ...] = (MEGATRON_DEEPSEEK_V3, MEGATRON_QWEN3_MOE)
