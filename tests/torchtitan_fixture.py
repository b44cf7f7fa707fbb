"""torchtitan checkpoints for tests/test_convert.py, written by torchtitan's own code.

Run as a script in an interpreter that can import torchtitan 0.3.0 (``TORCHTITAN_PATH`` on
``sys.path``, see the Makefile): ``python tests/torchtitan_fixture.py OUT [FAMILY ...]``. For each family
(default: DeepSeek-V3, Qwen3 MoE, DeepSeek-V3 with one MTP block; ``qwen3_moe_serving`` and
``deepseek_v3_serving`` are Qwen3 MoE and DeepSeek-V3 at dims vLLM's CPU backend runs, for
tests/test_serving_vllm.py) it builds a tiny torchtitan model from torchtitan's own config builders,
shards it with ``fully_shard`` over 2 gloo ranks, takes one AdamW step with torchtitan's
``OptimizersContainer`` and saves what torchtitan's checkpointer saves (``dcp.save`` of the model's
state dict flattened at the top level, ``optimizer`` and ``train_state`` beside it,
``components/checkpointer/dcp.py``) to ``OUT/{family}/dcp``. Rank 0 then writes the reference:
torchtitan's own ``state_dict_adapter.py`` ``to_hf`` of the full state dict
(``OUT/{family}/reference.safetensors``) and the matching transformers config
(``OUT/{family}/config.json``).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAMILIES = ("deepseek_v3", "qwen3_moe", "deepseek_v3_mtp")  # the last: one MTP block, compared with to_hf only
SERVING = dict(vocab=128, head_dim=32)  # vLLM's CPU attention has no kernel for head_dim 8
# vLLM's CPU MLA kernels take only kv_lora_rank 512 with rope 64 (and no head dim 8)
DEEPSEEK_SERVING = dict(vocab=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16)
WORLD = 2
VOCAB, DIM, EXPERTS, MOE_HIDDEN = 64, 32, 4, 16


def _qwen3(vocab: int = VOCAB, head_dim: int = 8):
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    config = qwen3.Qwen3Model.Config(
        vocab_size=vocab, dim=DIM, norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=MOE_HIDDEN,
            num_experts=EXPERTS, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1e6)))
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(vocab_size=vocab, hidden_size=DIM, intermediate_size=2 * DIM, moe_intermediate_size=MOE_HIDDEN,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                        num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                        max_position_embeddings=64, rope_theta=1e6)
    return config, qwen3.Qwen3StateDictAdapter, hf


def _deepseek(mtp: int = 0, vocab: int = VOCAB, kv_lora_rank: int = 16, qk_rope_head_dim: int = 4,
              qk_nope_head_dim: int = 8, v_head_dim: int = 8):
    from torchtitan.models import deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.deepseek_v3 import ComplexRoPE, RMSNorm

    mla = dict(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, qk_nope_head_dim=qk_nope_head_dim,
               v_head_dim=v_head_dim)
    layers = ds._build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=2, q_lora_rank=0, **mla, mscale=0.7, dense_hidden_dim=48,
        moe_hidden_dim=MOE_HIDDEN, num_experts=EXPERTS, num_shared_experts=1, router_top_k=2,
        router_score_func="sigmoid", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=ComplexRoPE.Config(dim=qk_rope_head_dim, max_seq_len=64, theta=10000.0))
    config = ds.DeepSeekV3Model.Config(
        vocab_size=vocab, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=DIM, param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=vocab, param_init=ds._output_linear_init(DIM)),
        layers=layers, mtp_layers=ds._build_mtp_layers(layers[-1], dim=DIM, num_mtp_layers=mtp) if mtp else [])
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config(vocab_size=vocab, hidden_size=DIM, intermediate_size=48, moe_intermediate_size=MOE_HIDDEN,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=EXPERTS,
                          n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None, **mla,
                          n_group=1, topk_group=1, max_position_embeddings=64, num_nextn_predict_layers=mtp,
                          tie_word_embeddings=False)
    return config, ds.DeepSeekV3StateDictAdapter, hf


BUILDERS = {"qwen3_moe": _qwen3, "deepseek_v3": _deepseek, "deepseek_v3_mtp": lambda: _deepseek(mtp=1),
            "qwen3_moe_serving": lambda: _qwen3(**SERVING),
            "deepseek_v3_serving": lambda: _deepseek(**DEEPSEEK_SERVING)}


def _save_family(family: str, out: str, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    config, adapter_class, hf_config = BUILDERS[family]()
    torch.manual_seed(0)
    model = config.build()
    model.init_states() if hasattr(model, "init_states") else None
    with torch.no_grad():  # every parameter random (some initialise to ones / zeros), same on every rank
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    mesh = init_device_mesh("cpu", (WORLD,))
    blocks = [*model.layers.values()] if isinstance(model.layers, torch.nn.ModuleDict) else [*model.layers]
    blocks += list(getattr(model, "mtp_layers", None) or [])
    for layer in blocks:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop"), model_parts=[model])
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 1e-2
    optimizers.step()
    states = {"model": ModelWrapper(model), "optimizer": optimizers, "train_state": io.BytesIO(b"step=1")}
    flattened = {k: v for k, v in states.items() if k != "model"}
    flattened.update(states["model"].state_dict())  # as CheckpointManager._flattened_model_states_sd
    directory = os.path.join(out, family)
    import torch.distributed.checkpoint as dcp

    dcp.save(flattened, checkpoint_id=os.path.join(directory, "dcp"))
    # the full tensors (a collective); model.state_dict() as torchtitan's ModelWrapper takes it (Qwen3's fused
    # QKV gives its q/k/v keys through state-dict hooks, which get_model_state_dict does not know)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if rank == 0:
        from safetensors.torch import save_file

        reference = adapter_class(config, None).to_hf({k: v.contiguous() for k, v in full.items()})
        save_file({k: v.contiguous() for k, v in reference.items()}, os.path.join(directory, "reference.safetensors"))
        hf_config.save_pretrained(directory)
    dist.barrier()


def _rank(rank: int, out: str, store: str, families: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        for family in families:
            _save_family(family, out, rank)
    finally:
        dist.destroy_process_group()


def main(out: str, families: tuple[str, ...] = FAMILIES) -> None:
    import torchtitan.models.deepseek_v3  # noqa: F401 - imported once, before the ranks fork
    import torchtitan.models.qwen3  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(out, os.path.join(tmp, "store"), families), nprocs=WORLD, start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or FAMILIES)
