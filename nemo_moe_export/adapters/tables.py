"""One small declarative table per model family.

In-memory names are those of transformers 5 (fused ``experts.gate_up_proj`` / ``experts.down_proj``)
or NeMo AutoModel (grouped ``experts.gate_and_up_projs`` / ``experts.down_projs``); both layouts are
covered by :func:`expert_rules`. HF names are what transformers 5 ``save_pretrained`` writes
(docs/design.md#key-names); the tests compare against ``save_pretrained`` itself.
"""

from __future__ import annotations

from nemo_moe_export.adapters.engine import KeyRule, ModelTable, expert_rules

_LAYER = r"(?P<prefix>model\.layers\.\d+)"

# What the official FP8 checkpoints (DeepSeek-V3 / Kimi K2, Qwen3 FP8) store block-quantized: the
# linear weights of attention and MLP, in dense layers, shared and routed experts and the MTP
# layer's blocks (``model.layers.{num_hidden_layers}``). Embeddings, ``lm_head``, norms, the router
# (``mlp.gate.weight``, ``e_score_correction_bias``) and the MTP ``eh_proj`` / ``shared_head`` stay as
# they are. The same modules transformers' FP8 integration swaps for FP8 layers (its ``nn.Linear``
# modules but ``lm_head``, and the experts); the tests check both.
_FP8_MLP = r"\.mlp\.(?:shared_experts\.|experts\.\d+\.)?(?:gate_proj|up_proj|down_proj)\.weight$"
_FP8_MLA = r"\.self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight$"
_FP8_GQA = r"\.self_attn\.(?:q_proj|k_proj|v_proj|o_proj)\.weight$"

# DeepSeek-V3 and Kimi K2 (same architecture and key names). Only routed experts change names;
# shared experts, the router ``gate.weight`` and ``gate.e_score_correction_bias`` keep theirs.
DEEPSEEK_V3 = ModelTable(
    model_types=("deepseek_v3", "kimi_k2"),
    rules=expert_rules(
        rf"{_LAYER}\.mlp\.experts", "{prefix}.mlp.experts",
        gate="gate_proj", up="up_proj", down="down_proj",
    ),
    num_experts_fields=("n_routed_experts", "num_experts"),
    description="DeepSeek-V3 / Kimi K2: model.layers.L.mlp.experts.E.{gate,up,down}_proj",
    fp8_weights=(_FP8_MLA, _FP8_MLP),
)

QWEN3_MOE = ModelTable(
    model_types=("qwen3_moe",),
    rules=DEEPSEEK_V3.rules,
    num_experts_fields=("num_experts", "num_local_experts"),
    description="Qwen3-MoE: model.layers.L.mlp.experts.E.{gate,up,down}_proj",
    fp8_weights=(_FP8_GQA, _FP8_MLP),
)

# Kimi Linear renames more than experts (transformers' conversion mapping for kimi_linear):
# every layer's ``mlp`` is ``block_sparse_moe`` on disk, the stacked ``conv1d`` is stored as
# q/k/v parts (concatenated on dim 0 in memory), and the forget gate lives under ``self_attn``.
KIMI_LINEAR = ModelTable(
    model_types=("kimi_linear",),
    rules=(
        *expert_rules(
            rf"{_LAYER}\.mlp\.experts", "{prefix}.block_sparse_moe.experts",
            gate="w1", up="w3", down="w2",
        ),
        KeyRule(rf"{_LAYER}\.mlp\.(?P<rest>.+)", ("{prefix}.block_sparse_moe.{rest}",)),
        KeyRule(
            rf"{_LAYER}\.self_attn\.conv1d\.weight",
            ("{prefix}.self_attn.q_conv1d.weight", "{prefix}.self_attn.k_conv1d.weight",
             "{prefix}.self_attn.v_conv1d.weight"),
            split_dim=0,
        ),
        KeyRule(rf"{_LAYER}\.self_attn\.forget_gate\.(?P<rest>.+)", ("{prefix}.self_attn.{rest}",)),
    ),
    num_experts_fields=("num_experts", "n_routed_experts"),
    description="Kimi Linear: model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}",
)

# Kimi K3-style checkpoints: the text model sits under ``language_model.``, MoE blocks are
# ``block_sparse_moe`` with w1/w3/w2 experts. Experts may work in a latent size smaller than the
# hidden size; nothing here assumes the expert width equals ``hidden_size``.
_K3_LAYER = r"(?P<prefix>language_model\.model\.layers\.\d+)"
KIMI_K3 = ModelTable(
    model_types=("kimi_k3",),
    rules=(
        *expert_rules(
            rf"{_K3_LAYER}\.(?:mlp|block_sparse_moe)\.experts", "{prefix}.block_sparse_moe.experts",
            gate="w1", up="w3", down="w2",
        ),
        KeyRule(rf"{_K3_LAYER}\.mlp\.(?P<rest>.+)", ("{prefix}.block_sparse_moe.{rest}",)),
    ),
    num_experts_fields=("num_experts", "n_routed_experts"),
    tied_keys=("language_model.lm_head.weight",),
    description="Kimi K3-style: language_model.model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}",
)

TABLES: tuple[ModelTable, ...] = (DEEPSEEK_V3, QWEN3_MOE, KIMI_LINEAR, KIMI_K3)
