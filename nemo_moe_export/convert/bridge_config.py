"""The HF config of a Megatron-Bridge checkpoint from its ``run_config.yaml``
(docs/design.md#megatron-torch_dist-keys).

Megatron-Bridge saves its ``ConfigContainer`` beside each ``torch_dist`` checkpoint as YAML: every
dataclass a mapping with a ``_target_`` (the class's import path), functions and dtypes as
``{_target_: torch.nn.functional.silu, _call_: false}``. The file is read with ``yaml.safe_load``
(plain values only) and its ``_target_`` entries are compared as strings, never imported or called:
no code the file names runs. Its ``model`` section is the model provider, a ``TransformerConfig``
under megatron-core's own field names, which ``megatron/hf_config.py`` turns into the HF config as
for a live model. Nothing imports megatron or Megatron-Bridge.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
import yaml

from nemo_moe_export.errors import InputError

__all__ = ["RUN_CONFIG_FILE", "bridge_model", "read_run_config"]

RUN_CONFIG_FILE = "run_config.yaml"  # Megatron-Bridge's ConfigContainer, beside the checkpoint's files
# what a checkpoint that does not record its config asks for (here and megatron_config.py)
ASK_FOR_CONFIG = "pass the model's HF config (--config / convert_checkpoint(config=...))"
# The activations a run_config may name, by the import path Bridge writes; any other stays a string
# (hf_config_for then refuses it by name).
_FUNCTIONS = {"torch.nn.functional.silu": torch.nn.functional.silu,
              "torch.nn.functional.gelu": torch.nn.functional.gelu}


def read_run_config(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``run_config.yaml`` of a Megatron-Bridge checkpoint as plain values; ``None`` where the
    checkpoint has none (a Megatron-LM one)."""
    path = os.path.join(os.fspath(directory), RUN_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            run_config = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:  # a python/object tag lands here: never built
        reason = " ".join(str(exc).split())  # one line: the parser's message spans several
        raise InputError("Megatron-Bridge's run_config.yaml cannot be read", key=path,
                         expected="plain YAML (yaml.safe_load)", actual=f"{type(exc).__name__}: {reason}",
                         hint=ASK_FOR_CONFIG) from None
    model = run_config.get("model") if isinstance(run_config, dict) else None
    if not isinstance(model, dict):
        raise InputError("Megatron-Bridge's run_config.yaml holds no model section",
                         key=f"{RUN_CONFIG_FILE}:model",
                         expected="the model provider's fields (a mapping)",
                         actual=type(model).__name__ if model is not None else "missing", hint=ASK_FOR_CONFIG)
    return model


def _need(model: dict[str, Any], name: str) -> Any:
    if model.get(name) is None:
        raise InputError("Megatron-Bridge's run_config.yaml lacks a field the HF config needs",
                         key=f"{RUN_CONFIG_FILE}:model.{name}", expected="set", actual="missing", hint=ASK_FOR_CONFIG)
    return model[name]


def _target(value: Any) -> Any:
    """A ``{_target_: path, _call_: false}`` entry as its path (a string), other values as they are."""
    return value.get("_target_") if isinstance(value, dict) and value.get("_call_") is False else value


def _dtype(value: Any) -> Any:
    name = str(_target(value) or "torch.float32").removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError("Megatron-Bridge's params_dtype is not a torch dtype",
                         key=f"{RUN_CONFIG_FILE}:model.params_dtype",
                         expected="torch.float32, torch.bfloat16, ...", actual=repr(value), hint=ASK_FOR_CONFIG)
    return dtype


def bridge_model(model: dict[str, Any]) -> SimpleNamespace:
    """What ``hf_config_for`` reads of a ``GPTModel``, from the provider's fields (megatron-core's
    defaults where the file lacks an optional one)."""
    heads, hidden = int(_need(model, "num_attention_heads")), int(_need(model, "hidden_size"))
    mla = bool(model.get("multi_latent_attention"))
    activation = _target(model.get("activation_func", "torch.nn.functional.gelu"))
    optional = {name: model.get(name, default) for name, default in _OPTIONAL.items()}
    cfg = SimpleNamespace(
        **optional, num_layers=int(_need(model, "num_layers")), hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=model.get("ffn_hidden_size") or 4 * hidden,
        num_query_groups=model.get("num_query_groups") or heads,
        kv_channels=model.get("kv_channels") or hidden // heads,
        num_moe_experts=_need(model, "num_moe_experts"), multi_latent_attention=mla,
        rope_type=model.get("rope_type") or ("yarn" if mla else "rope"),
        activation_func=_FUNCTIONS.get(activation, activation), params_dtype=_dtype(model.get("params_dtype")),
    )
    return SimpleNamespace(
        config=cfg, vocab_size=int(_need(model, "vocab_size")), max_sequence_length=int(_need(model, "seq_length")),
        share_embeddings_and_output_weights=bool(model.get("share_embeddings_and_output_weights", True)),
        rotary_base=model.get("rotary_base", 10000), rotary_percent=model.get("rotary_percent", 1.0),
        rotary_scaling=bool(model.get("rope_scaling")), mtp_process=False, post_process=True,
    )


# megatron-core's TransformerConfig / MLATransformerConfig defaults of the fields hf_config_for reads
_OPTIONAL = dict(
    moe_ffn_hidden_size=None, moe_router_topk=2, moe_router_pre_softmax=False, moe_router_score_function="softmax",
    moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None, moe_router_num_groups=None,
    moe_router_group_topk=None, moe_shared_expert_intermediate_size=None, qk_layernorm=False, q_lora_rank=512,
    kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, mtp_num_layers=None,
    layernorm_epsilon=1e-5, normalization="LayerNorm", layernorm_zero_centered_gamma=False, gated_linear_unit=False,
    add_bias_linear=True, add_qkv_bias=False, glu_linear_offset=0.0, activation_func_clamp_value=None,
    rotary_interleaved=False,
)
