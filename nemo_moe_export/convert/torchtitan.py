"""torchtitan's DCP checkpoints (torchtitan 0.3.0): its native keys -> HF, for DeepSeek-V3 and Qwen3 MoE.

torchtitan's checkpointer saves the model's state dict flattened at the top level (``layers.{i}.``,
``tok_embeddings``, ``norm``, ``lm_head``; DeepSeek-V3's MTP blocks as ``mtp_layers.{i}.``) beside
``optimizer.*``, ``lr_scheduler``, ``dataloader`` and ``train_state``. Routed experts are one
grouped tensor per projection, ``moe.routed_experts.inner_experts.w1_EFD`` / ``w3_EFD`` of shape
``(E, F, D)`` and ``w2_EDF`` of ``(E, D, F)``: HF's ``experts.{e}.gate_proj`` / ``up_proj`` /
``down_proj`` rows of it. The names are those of torchtitan's own ``state_dict_adapter.py``, which
the tests use as the independent reference (docs/design.md#checkpoint-conversion).
"""

from __future__ import annotations

from typing import Any

from nemo_moe_export.convert.index import CheckpointIndex
from nemo_moe_export.convert.rules import Rule, RuleTable
from nemo_moe_export.errors import InputError

__all__ = ["TORCHTITAN_SKIP", "torchtitan_table"]

# What torchtitan's checkpointer saves beside the model: never read.
TORCHTITAN_SKIP = (r"optimizer\..*", r"lr_scheduler(\..*)?", r"dataloader(\..*)?", r"train_state(\..*)?",
                   r"rng_state(\..*)?")
_L = r"layers\.(\d+)\."
_HF = "model.layers.{0}."
_EXPERTS = [
    Rule(_L + r"moe\.routed_experts\.inner_experts\.w1_EFD", _HF + "mlp.experts.{expert}.gate_proj.weight", "experts"),
    Rule(_L + r"moe\.routed_experts\.inner_experts\.w3_EFD", _HF + "mlp.experts.{expert}.up_proj.weight", "experts"),
    Rule(_L + r"moe\.routed_experts\.inner_experts\.w2_EDF", _HF + "mlp.experts.{expert}.down_proj.weight", "experts"),
    Rule(_L + r"moe\.router\.gate\.weight", _HF + "mlp.gate.weight"),
]
_COMMON = [
    Rule(r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    Rule(r"norm\.weight", "model.norm.weight"),
    Rule(r"lm_head\.weight", "lm_head.weight"),
    Rule(_L + r"attention\.wo\.weight", _HF + "self_attn.o_proj.weight"),
    Rule(_L + r"attention_norm\.weight", _HF + "input_layernorm.weight"),
    Rule(_L + r"ffn_norm\.weight", _HF + "post_attention_layernorm.weight"),
    Rule(_L + r"feed_forward\.w1\.weight", _HF + "mlp.gate_proj.weight"),
    Rule(_L + r"feed_forward\.w3\.weight", _HF + "mlp.up_proj.weight"),
    Rule(_L + r"feed_forward\.w2\.weight", _HF + "mlp.down_proj.weight"),
    *_EXPERTS,
]
_QWEN3 = [
    *_COMMON,
    Rule(_L + r"attention\.(?:qkv_linear\.)?wq\.weight", _HF + "self_attn.q_proj.weight"),
    Rule(_L + r"attention\.(?:qkv_linear\.)?wk\.weight", _HF + "self_attn.k_proj.weight"),
    Rule(_L + r"attention\.(?:qkv_linear\.)?wv\.weight", _HF + "self_attn.v_proj.weight"),
    Rule(_L + r"attention\.q_norm\.weight", _HF + "self_attn.q_norm.weight"),
    Rule(_L + r"attention\.k_norm\.weight", _HF + "self_attn.k_norm.weight"),
]
# Qwen3-MoE's HF format has no expert bias (torchtitan's own adapter drops it too).
_QWEN3_DROP = (_L + r"moe\.expert_bias_E",)
_DEEPSEEK = [
    *_COMMON,
    Rule(_L + r"attention\.wq\.weight", _HF + "self_attn.q_proj.weight"),
    Rule(_L + r"attention\.wq_a\.weight", _HF + "self_attn.q_a_proj.weight"),
    Rule(_L + r"attention\.q_norm\.weight", _HF + "self_attn.q_a_layernorm.weight"),
    Rule(_L + r"attention\.wq_b\.weight", _HF + "self_attn.q_b_proj.weight"),
    Rule(_L + r"attention\.wkv_a\.weight", _HF + "self_attn.kv_a_proj_with_mqa.weight"),
    Rule(_L + r"attention\.kv_norm\.weight", _HF + "self_attn.kv_a_layernorm.weight"),
    Rule(_L + r"attention\.wkv_b\.weight", _HF + "self_attn.kv_b_proj.weight"),
    Rule(_L + r"moe\.expert_bias_E", _HF + "mlp.gate.e_score_correction_bias"),
    Rule(_L + r"moe\.shared_experts\.w1\.weight", _HF + "mlp.shared_experts.gate_proj.weight"),
    Rule(_L + r"moe\.shared_experts\.w3\.weight", _HF + "mlp.shared_experts.up_proj.weight"),
    Rule(_L + r"moe\.shared_experts\.w2\.weight", _HF + "mlp.shared_experts.down_proj.weight"),
]
_MTP_ONLY = [  # the MTP block's own modules (its attention and MoE follow the decoder layer's rules)
    Rule(_L + r"enorm\.weight", _HF + "enorm.weight"),
    Rule(_L + r"hnorm\.weight", _HF + "hnorm.weight"),
    Rule(_L + r"eh_proj\.weight", _HF + "eh_proj.weight"),
    Rule(_L + r"mtp_norm\.weight", _HF + "shared_head.norm.weight"),
]


def _mtp_rules(rules: list[Rule], n_layers: int) -> list[Rule]:
    """The MTP block ``mtp_layers.{i}.`` is HF layer ``n_layers + i``."""
    shift = lambda groups: (int(groups[0]) + n_layers, *groups[1:])  # noqa: E731 - one-line mapping
    return [Rule("mtp_" + r.pattern, r.hf, r.kind, shift) for r in [*rules, *_MTP_ONLY]]


def torchtitan_table(index: CheckpointIndex, hf_config: Any) -> RuleTable:
    """The table for a torchtitan checkpoint of a model of ``hf_config`` (DeepSeek-V3 or Qwen3 MoE)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    model_type = getattr(text, "model_type", None)
    tied = bool(getattr(text, "tie_word_embeddings", False))
    tied_drop = (r"lm_head\.weight",) if tied else ()  # torchtitan's adapter drops it too
    if model_type == "qwen3_moe":
        return RuleTable("torchtitan", _QWEN3, TORCHTITAN_SKIP, (*_QWEN3_DROP, *tied_drop))
    if model_type in ("deepseek_v3", "kimi_k2"):
        rules = [*_DEEPSEEK, *_mtp_rules(_DEEPSEEK, int(text.num_hidden_layers))]
        return RuleTable("torchtitan", rules, TORCHTITAN_SKIP, tied_drop)
    raise InputError("no torchtitan key table for this model type", key="model_type",
                     expected="qwen3_moe or deepseek_v3", actual=model_type)

