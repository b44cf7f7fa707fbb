"""The HF config of a megatron-core ``torch_dist`` checkpoint when the user gives none
(docs/design.md#megatron-torch_dist-keys): Megatron-Bridge's ``run_config.yaml`` where the
checkpoint has one (``bridge_config.py``), else Megatron-LM's ``common.pt``.

Megatron-LM keeps its training arguments (``args``, an ``argparse.Namespace``) in the checkpoint's
``common.pt``. torch's ``weights_only`` load refuses a Namespace, and a file a user hands us is never
unpickled with arbitrary globals: ``common.pt`` is read with ``weights_only=True`` and an allowlist,
the Namespace admitted and every other global the file names (an enum such as
``AttnBackend.auto``, say) replaced by an inert stand-in that only records its arguments, so no
code of the checkpoint's runs. The arguments become the model's ``TransformerConfig`` fields
(Megatron-LM's ``core_transformer_config_from_args`` names), which ``megatron/hf_config.py``
turns into the HF config exactly as for a live model; which layers are MoE is read from the
checkpoint's keys, not from ``moe_layer_freq``. Nothing imports megatron.
"""

from __future__ import annotations

import argparse
import os
import re
from types import SimpleNamespace
from typing import Any

import torch

from nemo_moe_export.adapters import InMemoryFormat
from nemo_moe_export.adapters.tables_megatron import NAMING
from nemo_moe_export.convert.bridge_config import ASK_FOR_CONFIG, bridge_model, read_run_config
from nemo_moe_export.errors import InputError
from nemo_moe_export.megatron.hf_config import hf_config_for, stock_config_class

__all__ = ["COMMON_FILE", "config_from_checkpoint", "read_common"]

COMMON_FILE = "common.pt"  # megatron dist_checkpointing's non-sharded state (rank 0 writes it)


class _Inert:
    """What an unknown global of ``common.pt`` becomes: its arguments and state, kept as data."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def read_common(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``common.pt`` of a megatron checkpoint, read through an allowlist (module doc)."""
    path = os.path.join(os.fspath(directory), COMMON_FILE)
    if not os.path.isfile(path):
        raise InputError("the megatron checkpoint has no common.pt to derive the HF config from", key=path,
                         expected="megatron dist_checkpointing's common.pt", actual="missing", hint=ASK_FOR_CONFIG)
    try:
        unknown = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        stand_ins = [(type(name, (_Inert,), {}), name) for name in unknown if name != "argparse.Namespace"]
        with torch.serialization.safe_globals([argparse.Namespace, *stand_ins]):
            common = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # any unreadable file is the same refusal, naming torch's reason
        raise InputError("megatron's common.pt cannot be read", key=path, expected="a torch.save archive",
                         actual=_reason(exc), hint=ASK_FOR_CONFIG) from None
    if not isinstance(common, dict):
        raise InputError("megatron's common.pt is not a dict", key=path, expected="a dict",
                         actual=type(common).__name__, hint=ASK_FOR_CONFIG)
    return common


def _reason(exc: Exception) -> str:
    """torch's reason, without its advice to load with ``weights_only=False`` (never taken here)."""
    refused = re.search(r"GLOBAL [\w.]+", str(exc))
    return f"it names {refused[0]}, which torch refuses" if refused else f"{type(exc).__name__}: {exc}"


def config_from_checkpoint(index: Any) -> Any:
    """The HF config (the stock transformers class) of the megatron checkpoint ``index``: from
    Megatron-Bridge's ``run_config.yaml`` where the checkpoint has one, else from ``common.pt``'s
    ``args``; refused, asking for a config, where neither holds it."""
    bridge = read_run_config(index.directory)
    if bridge is not None:
        model = bridge_model(bridge)
        family = "deepseek_v3" if model.config.multi_latent_attention else "qwen3_moe"
        return _hf_config(model, family, index, model.vocab_size)
    common = read_common(index.directory)
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        raise InputError("megatron's common.pt holds no training arguments", key="common.pt:args",
                         expected="Megatron-LM's args (an argparse.Namespace)",
                         actual=type(args).__name__ if args is not None else "none", hint=ASK_FOR_CONFIG)
    fields = vars(args)
    family = "deepseek_v3" if fields.get("multi_latent_attention") else "qwen3_moe"
    return _hf_config(_model_of(fields, index), family, index, _vocab_size(fields))


def _hf_config(model: SimpleNamespace, family: str, index: Any, vocab_size: int) -> Any:
    config = hf_config_for(model, family, InMemoryFormat(NAMING), _moe_layers(index, model.config.num_layers),
                           vocab_size=vocab_size)
    return stock_config_class(config).from_dict(config.to_dict())


def _need(fields: dict[str, Any], name: str) -> Any:
    if fields.get(name) is None:
        raise InputError("megatron's args lack a field the HF config needs", key=f"args.{name}",
                         expected="set", actual="missing", hint=ASK_FOR_CONFIG)
    return fields[name]


def _vocab_size(fields: dict[str, Any]) -> int:
    """The tokenizer's vocabulary: ``args.vocab_size`` (megatron's embeddings are padded; the
    padded count is not the HF one)."""
    return int(_need(fields, "vocab_size"))


def _model_of(fields: dict[str, Any], index: Any) -> SimpleNamespace:
    """What ``hf_config_for`` reads of a ``GPTModel``, from Megatron-LM's argument names."""
    heads = int(_need(fields, "num_attention_heads"))
    hidden = int(_need(fields, "hidden_size"))
    mla = bool(fields.get("multi_latent_attention"))
    swiglu = bool(fields.get("swiglu"))
    cfg = SimpleNamespace(
        num_layers=int(_need(fields, "num_layers")), hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=fields.get("ffn_hidden_size") or 4 * hidden,
        num_query_groups=fields.get("num_query_groups") if fields.get("group_query_attention") else heads,
        kv_channels=fields.get("kv_channels") or hidden // heads,
        num_moe_experts=fields.get("num_experts"), moe_ffn_hidden_size=fields.get("moe_ffn_hidden_size"),
        moe_router_topk=fields.get("moe_router_topk", 2), moe_router_pre_softmax=fields.get("moe_router_pre_softmax", False),
        moe_router_score_function=fields.get("moe_router_score_function", "softmax"),
        moe_router_enable_expert_bias=fields.get("moe_router_enable_expert_bias", False),
        moe_router_topk_scaling_factor=fields.get("moe_router_topk_scaling_factor"),
        moe_router_num_groups=fields.get("moe_router_num_groups"), moe_router_group_topk=fields.get("moe_router_group_topk"),
        moe_shared_expert_intermediate_size=fields.get("moe_shared_expert_intermediate_size"),
        multi_latent_attention=mla, qk_layernorm=bool(fields.get("qk_layernorm")),
        q_lora_rank=fields.get("q_lora_rank"), kv_lora_rank=fields.get("kv_lora_rank", 32),
        qk_head_dim=fields.get("qk_head_dim", 128), qk_pos_emb_head_dim=fields.get("qk_pos_emb_head_dim", 64),
        v_head_dim=fields.get("v_head_dim", 128), mtp_num_layers=fields.get("mtp_num_layers"),
        # megatron-core's defaults where Megatron-LM's args may lack a field: MLA's RoPE is yarn
        rope_type=fields.get("rope_type") or ("yarn" if mla else "rope"),
        layernorm_epsilon=fields.get("norm_epsilon", 1e-5), normalization=fields.get("normalization", "LayerNorm"),
        layernorm_zero_centered_gamma=bool(fields.get("apply_layernorm_1p")),
        gated_linear_unit=swiglu, activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        add_bias_linear=fields.get("add_bias_linear", True), add_qkv_bias=bool(fields.get("add_qkv_bias")),
        glu_linear_offset=fields.get("glu_linear_offset", 0.0) or 0,
        activation_func_clamp_value=fields.get("activation_func_clamp_value"),
        rotary_interleaved=bool(fields.get("rotary_interleaved")), params_dtype=_params_dtype(fields),
    )
    return SimpleNamespace(
        config=cfg, vocab_size=int(fields.get("padded_vocab_size") or _vocab_size(fields)),
        max_sequence_length=int(fields.get("max_position_embeddings") or _need(fields, "seq_length")),
        share_embeddings_and_output_weights=not fields.get("untie_embeddings_and_output_weights", False),
        rotary_base=fields.get("rotary_base", 10000), rotary_percent=fields.get("rotary_percent", 1.0),
        rotary_scaling=bool(fields.get("use_rope_scaling")), mtp_process=False, post_process=True,
    )


def _params_dtype(fields: dict[str, Any]) -> torch.dtype:
    dtype = fields.get("params_dtype")
    if isinstance(dtype, torch.dtype):
        return dtype
    return torch.bfloat16 if fields.get("bf16") else torch.float16 if fields.get("fp16") else torch.float32


def _moe_layers(index: Any, num_layers: int) -> list[int]:
    """The decoder layers with routed experts, as the checkpoint stores them: every layer when
    they are stacked, else the per-layer keys that hold experts."""
    keys = index.tensors
    if any(k.startswith("decoder.layers.mlp.experts.") for k in keys):
        return list(range(num_layers))
    return sorted({int(k.split(".")[2]) for k in keys
                   if k.startswith("decoder.layers.") and ".mlp.experts." in k and k.split(".")[2].isdigit()})
