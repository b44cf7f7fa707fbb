"""megatron-core ``torch_dist`` checkpoints written by megatron-core itself, for the conversion tests.

One spawn of 4 gloo CPU ranks writes every layout of both tiny families
(``nemo_moe_export.megatron.tiny``): a DeepSeek-V3-style model (MLA, a dense first layer, a
multi-token-prediction layer) and a Qwen3-MoE-style one (homogeneous layers, which megatron stacks
along a layer axis), under

* ``tp2_ep2_sp``: TP2 x EP2 with sequence parallelism (expert-TP follows TP: 2);
* ``pp2_ep2``: PP2 x EP2 (one decoder layer per stage; the MTP layer on the last);
* ``etp2``: TP1 x EP2 with expert-tensor parallelism 2 (four ``linear_fc1`` chunks per expert);
* ``etp2_pre014``: the same, saved as megatron-core before 0.14 did (``singleton_local_shards``:
  every layer per key, each expert and each GLU half under its own key).

Saved with Megatron-LM's ``sharded_state_dict`` metadata (``_build_sharded_state_dict_metadata``).

Each checkpoint is what Megatron-LM's ``save_checkpoint`` hands ``dist_checkpointing.save``: the
model's ``sharded_state_dict()``, the optimizer's (megatron's ``FP32Optimizer`` over torch's Adam
after one step: on CPU megatron's ``DistributedOptimizer`` refuses non-CUDA parameters), a
per-rank RNG ``ShardedObject``, and ``args`` (an ``argparse.Namespace``) / ``iteration`` in
``common.pt``. Weights are drawn from their HF names (``init_by_hf_name``), then moved by the
Adam step.

The expected export of each checkpoint is made in the same spawn the way a job would: a fresh model
(other seed) on the same layout loads the checkpoint with megatron's own ``dist_checkpointing.load``
(Megatron-LM keeps the model under ``"model"``) and ``export_hf_checkpoint`` writes it, in float32
(the model's dtype), cast to bfloat16, and FP8 block-quantized (``quantize="fp8_block"``).
"""

from __future__ import annotations

import argparse
import os

import torch

from nemo_moe_export.spawn import spawn

HF_VOCAB = 62  # megatron pads it to 128 * TP rows
HIDDEN, LAYERS, EXPERTS = 32, 2, 4
FAMILIES = ("deepseek_v3", "qwen3_moe")
LAYOUTS = {
    "tp2_ep2_sp": dict(tp=2, pp=1, ep=2, etp=None, sp=True),
    "pp2_ep2": dict(tp=1, pp=2, ep=2, etp=None, sp=False),
    "etp2": dict(tp=1, pp=1, ep=2, etp=2, sp=False),
    "etp2_pre014": dict(tp=1, pp=1, ep=2, etp=2, sp=False, singleton=True),
}
EXPORT_DTYPES = ("float32", "bfloat16")  # the model's own, and the cast transformers makes
FP8 = "fp8_block"  # export_dir's name of the in-job FP8 export (bfloat16 where not quantized)
CASES = [(layout, family) for layout in LAYOUTS for family in FAMILIES]


def checkpoint_dir(root: str, layout: str, family: str) -> str:
    return os.path.join(root, f"{layout}-{family}", "torch_dist")


def export_dir(root: str, layout: str, family: str, dtype: str = "float32") -> str:
    return os.path.join(root, f"{layout}-{family}", f"export-{dtype}")


def write_checkpoints(root: str, timeout_s: float = 600.0) -> dict:
    """Every case's checkpoint and expected export under ``root`` (one spawn of 4 ranks); returns
    rank 0's record: per case, the model's ``args`` as saved."""
    os.environ["OMP_NUM_THREADS"] = "1"
    return spawn(_worker, 4, root, timeout_s=timeout_s)[0]


def _worker(rank: int, world: int, root: str) -> dict:
    from megatron.core import parallel_state as ps

    from nemo_moe_export.megatron import cpu_patches

    cpu_patches.apply()
    out = {}
    for layout, sizes in LAYOUTS.items():
        ps.initialize_model_parallel(tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
                                     expert_model_parallel_size=sizes["ep"],
                                     expert_tensor_parallel_size=sizes["etp"])
        for family in FAMILIES:
            out[(layout, family)] = _save(family, sizes, checkpoint_dir(root, layout, family))
            _export(family, sizes, checkpoint_dir(root, layout, family), root, layout)
        ps.destroy_model_parallel()
    return out


def _model(family: str, sizes: dict, seed: int):
    from megatron.core import parallel_state as ps

    from nemo_moe_export.megatron import MegatronCausalLM
    from nemo_moe_export.megatron.tiny import build_gpt, init_by_hf_name, padded_vocab_size, tiny_transformer_config

    extra = {"mtp_num_layers": 1} if family == "deepseek_v3" else {}
    config = tiny_transformer_config(family, n_experts=EXPERTS, hidden_size=HIDDEN, num_layers=LAYERS,
                                     pipeline_size=sizes["pp"], sequence_parallel=sizes["sp"],
                                     dispatcher="allgather", **extra)
    gpt = build_gpt(config, vocab_size=padded_vocab_size(HF_VOCAB, ps.get_tensor_model_parallel_world_size()))
    model = MegatronCausalLM(gpt, vocab_size=HF_VOCAB)
    init_by_hf_name(model, seed=seed)
    return model


def _sharded_model(gpt, sizes: dict) -> dict:
    """``gpt.sharded_state_dict()`` with the metadata Megatron-LM passes (``singleton_local_shards``
    True: what ``--dist-ckpt-save-pre-mcore-014`` asked for)."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True,
                "singleton_local_shards": bool(sizes.get("singleton"))}
    return gpt.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(metadata))


def _save(family: str, sizes: dict, path: str) -> dict:
    from megatron.core import dist_checkpointing

    model = _model(family, sizes, seed=0)
    optimizer = _stepped_optimizer(model.gpt)
    sharded = _sharded_model(model.gpt, sizes)
    args = _args(model.gpt, sizes)
    state = {"model": sharded, "optimizer": optimizer.sharded_state_dict(sharded), "rng_state": _rng_state(),
             "args": args, "iteration": 1, "checkpoint_version": 3.0}
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path)
    return vars(args)


def _stepped_optimizer(gpt):
    """megatron's ``FP32Optimizer`` over torch's Adam after one step on a gradient drawn from each
    weight itself (the same on every replica, so replicas stay equal)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    params = [p for p in gpt.parameters() if p.requires_grad]
    adam = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.sin(p.detach() * 7.0)
    adam.step()
    # FP32Optimizer.__init__ is its base's plus a loss scale it puts on "cuda" (unused here): the
    # base's, then the scale on the CPU
    optimizer = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(optimizer, adam, OptimizerConfig(optimizer="adam", lr=1e-3), None)
    optimizer._scale, optimizer.is_stub_optimizer = torch.tensor([1.0]), False
    return optimizer


def _rng_state():
    """Megatron-LM's per-rank RNG record: a ``ShardedObject`` over (PP, TP), replicated over DP."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", [state], shape, offset, replica_id=ps.get_data_parallel_rank())


def _args(gpt, sizes: dict) -> argparse.Namespace:
    """The model fields of Megatron-LM's training arguments (its names), as its checkpoints keep them."""
    from megatron.core.transformer.enums import AttnBackend

    cfg = gpt.config
    fields = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, group_query_attention=cfg.num_query_groups != cfg.num_attention_heads,
        num_experts=cfg.num_moe_experts, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_topk=cfg.moe_router_topk, moe_layer_freq=cfg.moe_layer_freq,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_router_score_function=cfg.moe_router_score_function,
        moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
        moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
        moe_router_num_groups=cfg.moe_router_num_groups, moe_router_group_topk=cfg.moe_router_group_topk,
        multi_latent_attention=cfg.multi_latent_attention, qk_layernorm=cfg.qk_layernorm,
        q_lora_rank=getattr(cfg, "q_lora_rank", None), kv_lora_rank=getattr(cfg, "kv_lora_rank", None),
        qk_head_dim=getattr(cfg, "qk_head_dim", None), qk_pos_emb_head_dim=getattr(cfg, "qk_pos_emb_head_dim", None),
        v_head_dim=getattr(cfg, "v_head_dim", None), rope_type=getattr(cfg, "rope_type", None),
        mtp_num_layers=cfg.mtp_num_layers,
        normalization=cfg.normalization, norm_epsilon=cfg.layernorm_epsilon, swiglu=True,
        add_bias_linear=cfg.add_bias_linear, position_embedding_type="rope", rotary_base=int(gpt.rotary_base),
        max_position_embeddings=gpt.max_sequence_length, seq_length=gpt.max_sequence_length,
        untie_embeddings_and_output_weights=not gpt.share_embeddings_and_output_weights,
        padded_vocab_size=gpt.vocab_size, vocab_size=HF_VOCAB, make_vocab_size_divisible_by=128,
        params_dtype=cfg.params_dtype, bf16=cfg.bf16, fp16=cfg.fp16,
        tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
        expert_model_parallel_size=sizes["ep"], expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
        sequence_parallel=sizes["sp"], ckpt_format="torch_dist", iteration=1,
        attention_backend=AttnBackend.auto,  # an enum of megatron's: not a global torch.load admits
    )
    return argparse.Namespace(**fields)


def _export(family: str, sizes: dict, path: str, root: str, layout: str) -> None:
    from megatron.core import dist_checkpointing

    from nemo_moe_export.export import export_hf_checkpoint

    model = _model(family, sizes, seed=1)
    # megatron's own load of the model's part (Megatron-LM keeps it under "model")
    loaded = dist_checkpointing.load({"model": _sharded_model(model.gpt, sizes)}, path)
    model.gpt.load_state_dict(loaded["model"])
    model.sync_embedding_copy()
    for dtype in EXPORT_DTYPES:
        export_hf_checkpoint(export_dir(root, layout, family, dtype), model, dtype=dtype, timeout_s=60)
    # the in-job FP8 export (its blocks span the TP / expert-TP shards: exchanged between ranks)
    export_hf_checkpoint(export_dir(root, layout, family, FP8), model, dtype="bfloat16", quantize="fp8_block",
                         timeout_s=60)
