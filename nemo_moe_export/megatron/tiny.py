"""Tiny megatron-core MoE ``GPTModel`` s of both supported families, built offline from configs.

Used by the megatron-core recipe and the tests, and public like ``tiny_models``
(docs/design.md#megatron-core-models). Every structural feature the adapter maps is kept: DeepSeek-V3's
MLA with a low-rank query, a dense first layer, a shared expert and sigmoid routing with
``expert_bias``; Qwen3-MoE's grouped-query attention with q/k norms. Call after
``parallel_state.initialize_model_parallel`` (the experts are split over its EP group; under
pipeline parallelism each rank builds its own stage, with megatron's own split of the layers:
even, or ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` /
``pipeline_model_parallel_layout`` passed as overrides). A DeepSeek-V3-style multi-token-prediction
layer (``mtp_num_layers=1``) is built on the last stage with the local spec.

:func:`init_by_hf_name` gives every weight a value that depends only on its HF name and a seed, so
the same model on any EP size holds the same weights (megatron initialises each rank's local
experts from one stream: global experts 0 and 3 would start equal on EP=2).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from nemo_moe_export.adapters import get_adapter
from nemo_moe_export.errors import InputError

__all__ = ["DISPATCHERS", "build_gpt", "init_by_hf_name", "padded_vocab_size", "tiny_transformer_config"]

DISPATCHERS = ("alltoall", "allgather")


def tiny_transformer_config(family: str, *, n_experts: int = 4, hidden_size: int = 32, moe_ffn_hidden_size: int = 16,
                            num_layers: int = 2, dispatcher: str = "alltoall", dtype: torch.dtype = torch.float32,
                            pipeline_size: int = 1, expert_parallel_size: int | None = None,
                            sequence_parallel: bool = False, **overrides: Any) -> Any:
    """A ``TransformerConfig`` (``MLATransformerConfig`` for ``deepseek_v3``) of a tiny MoE model.

    DeepSeek-V3: layer 0 dense, the rest MoE, one shared expert. Qwen3-MoE: every layer MoE.
    ``pipeline_size`` must be ``parallel_state``'s pipeline size; ``expert_parallel_size``
    (default: ``parallel_state``'s EP size, 1 before it is initialised) becomes megatron's
    ``expert_model_parallel_size``, from which its linear layers mark expert weights
    ``allreduce=False`` (only when > 1): the mark that tells a data-parallel gradient average
    (megatron's DDP, the recipe's trainer) to take experts over the expert-data-parallel group, not
    over data-parallel ranks that hold other experts. ``tensor_model_parallel_size`` and
    ``expert_tensor_parallel_size`` are ``parallel_state``'s (megatron's layers split by its
    groups; the config's sizes must agree); ``sequence_parallel`` needs TP > 1. Other megatron
    fields (an uneven split, ``mtp_num_layers``) come as ``overrides``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    initialised = ps.model_parallel_is_initialized()
    if expert_parallel_size is None:
        expert_parallel_size = ps.get_expert_model_parallel_world_size() if initialised else 1
    tp = ps.get_tensor_model_parallel_world_size() if initialised else 1
    etp = ps.get_expert_tensor_parallel_world_size() if initialised else 1

    if dispatcher not in DISPATCHERS:
        raise InputError("unknown megatron-core token dispatcher", key="model.dispatcher",
                         expected=DISPATCHERS, actual=repr(dispatcher))
    common = dict(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=4, ffn_hidden_size=2 * hidden_size,
        num_moe_experts=n_experts, moe_ffn_hidden_size=moe_ffn_hidden_size, moe_router_topk=min(2, n_experts),
        moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="none", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, kv_channels=8,
        pipeline_model_parallel_size=pipeline_size, pipeline_dtype=dtype,  # what the stages exchange
        expert_model_parallel_size=expert_parallel_size, tensor_model_parallel_size=tp,
        expert_tensor_parallel_size=etp, sequence_parallel=sequence_parallel,
    )
    if family == "deepseek_v3":
        common.update(
            moe_layer_freq=[0] + [1] * (num_layers - 1), q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
            qk_pos_emb_head_dim=8, v_head_dim=8, rope_type="rope", moe_shared_expert_intermediate_size=moe_ffn_hidden_size,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=2.5, layernorm_epsilon=1e-6,
        )
        common.update(overrides)
        return MLATransformerConfig(**common)
    if family == "qwen3_moe":
        common.update(num_query_groups=2)
        common.update(overrides)
        return TransformerConfig(**common)
    raise InputError("unknown megatron-core tiny family", key="model.family",
                     expected=["deepseek_v3", "qwen3_moe"], actual=repr(family))


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int, divisible_by: int = 128) -> int:
    """The vocabulary megatron builds for a tokenizer of ``vocab_size`` tokens: rounded up to a
    multiple of ``divisible_by * tensor_parallel_size`` (megatron's training arguments,
    ``make_vocab_size_divisible_by``; its ``VocabParallelEmbedding`` needs a multiple of TP)."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def build_gpt(config: Any, *, vocab_size: int, max_sequence_length: int = 512) -> Any:
    """This rank's ``GPTModel`` (its pipeline stage: embeddings on the first, the output layer and
    any MTP layer on the last) with megatron-core's local (no Transformer Engine) layer specs."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
    return GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    mtp_block_spec=mtp)


def init_by_hf_name(model: Any, seed: int = 0, std: float = 0.02) -> None:
    """Give every tensor of ``model`` (a ``MegatronCausalLM``) a value drawn from its HF name and
    ``seed``: norms 1, router biases N(0, 0.05), the rest N(0, std). Each rank fills only its own
    slices, through the adapter's ``from_hf``, so the values do not depend on the EP size."""
    view = model.state_dict()
    adapter = get_adapter(model.config)
    weights = {key: _seeded(key, meta.shape, meta.dtype, seed, std) for key, meta in adapter.hf_metadata(view).items()}
    adapter.from_hf(view, weights)
    model.sync_embedding_copy()


def _seeded(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, std: float) -> torch.Tensor:
    if key.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    scale = 0.05 if key.endswith("e_score_correction_bias") else std
    return (torch.randn(shape, generator=generator) * scale).to(dtype)
