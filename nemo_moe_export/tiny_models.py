"""Tiny models of the supported families, built offline from transformers config classes.

A public utility: the demo recipes train them (:func:`build_model` builds the recipe's model from
its ``model`` group), and your own CPU tests of the plugin can use them as ours do
(:func:`tiny_model`). Sizes are small enough to run on CPU ranks but keep every structural
feature: dense first layers, shared experts, routers with correction bias, Kimi Linear's
linear-attention layers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, KimiLinearConfig, Qwen3MoeConfig

from nemo_moe_export.config import ModelConfig, architecture, model_dtype

__all__ = ["FAMILIES", "build_model", "tiny_config", "tiny_model"]

FAMILIES = ("deepseek_v3", "kimi_k2", "kimi_linear", "qwen3_moe")


def tiny_config(
    family: str,
    *,
    n_experts: int = 5,
    hidden_size: int = 32,
    moe_intermediate_size: int = 16,
    num_layers: int = 2,
    vocab_size: int = 64,
    **overrides: Any,
) -> Any:
    """A transformers config of ``family`` with ``n_experts`` routed experts.

    ``kimi_k2`` is the DeepSeek-V3 architecture (as the released checkpoints are); only its
    adapter lookup name differs, so it returns a DeepSeek-V3 config.
    """
    heads = max(1, hidden_size // 8)
    if architecture(family) == "deepseek_v3":
        kw = dict(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=n_experts,
            n_shared_experts=1, num_experts_per_tok=min(2, n_experts), first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            n_group=1, topk_group=1, max_position_embeddings=512,
            # transformers builds no MTP module, so a config declaring one (its default is 1) would
            # claim a layer no export of this model holds (docs/design.md#pass-through-tensors).
            num_nextn_predict_layers=0,
        )
        kw.update(overrides)
        return DeepseekV3Config(**kw)
    if family == "qwen3_moe":
        kw = dict(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=8,
            num_experts=n_experts, num_experts_per_tok=min(2, n_experts), max_position_embeddings=512,
        )
        kw.update(overrides)
        return Qwen3MoeConfig(**kw)
    if family == "kimi_linear":
        layer_types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        kw = dict(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=heads, num_experts=n_experts,
            num_experts_per_token=min(2, n_experts), num_shared_experts=1, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8,
            linear_num_heads=heads, head_dim=8, qk_head_dim=16,
            mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1), layer_types=layer_types,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, model_max_length=512,
        )
        kw.update(overrides)
        return KimiLinearConfig(**kw)
    raise ValueError(f"unknown tiny model family {family!r}; expected one of {FAMILIES}")


def tiny_model(family: str, *, seed: int = 0, dtype: Any = None, **config_kwargs: Any) -> Any:
    """A randomly initialised ``AutoModelForCausalLM`` of ``family`` (same seed -> same weights).

    Built on the current default device (``with torch.device("cuda"): ...`` builds it on the GPU);
    ``dtype`` is the parameter dtype (default float32).
    """
    config = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    # Random router biases, so a test notices if they are dropped or mixed up.
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf))
    return model


def build_model(cfg: ModelConfig, vocab_size: int, *, pad_token_id: int | None = None,
                device: str = "cpu") -> Any:
    """The recipe's unsharded model from its ``model`` group, identical on every rank (same seed),
    built and initialised on ``device`` (``meta``: shapes only, as the recipe's checks use it).

    On GPUs the full model is created on each rank's GPU and sharded right after (``shard_model``
    frees what the rank does not keep): the initialisation runs at GPU speed and every rank draws
    the same numbers from the same seed.
    """
    family = architecture(cfg.family)
    extra = {"pad_token_id": pad_token_id, "bos_token_id": 1, "eos_token_id": 2} if family == "kimi_linear" else {}
    with torch.device(device):
        return tiny_model(family, n_experts=cfg.n_experts, hidden_size=cfg.hidden_size,
                          moe_intermediate_size=cfg.moe_intermediate_size, num_layers=cfg.num_layers,
                          vocab_size=vocab_size, seed=cfg.seed, dtype=model_dtype(cfg), **extra)
