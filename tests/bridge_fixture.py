"""Megatron-Bridge ``run_config.yaml`` files for tests/test_convert_megatron.py, written by
Megatron-Bridge 0.3.1's own code.

Run as a script in an interpreter that finds Megatron-Bridge (``.megatron-bridge``, ``make
setup-bridge``) and triton (``.torchtitan``) on ``sys.path``: ``python tests/bridge_fixture.py OUT``.
For each family of ``megatron_checkpoints.py`` it builds Bridge's model provider
(``DeepSeekV3ModelProvider``, ``Qwen3MoEModelProvider``) holding the fields of the
``TransformerConfig`` those checkpoints were saved from, puts it in Bridge's ``ConfigContainer`` and
writes ``OUT/{family}/run_config.yaml`` with ``ConfigContainer.to_yaml``, the call Bridge's
``save_checkpoint`` makes beside every checkpoint.

Megatron-Bridge's package ``__init__`` files import ``AutoBridge``, whose LoRA layers import
Transformer Engine at module level; TE's PyTorch extension builds only against a CUDA torch, so on
this CPU machine the packages are entered without running those ``__init__`` files (``_enter``): the
modules the file's writing uses (the providers, ``training/config.py``, its YAML representers) are
Bridge's own, unchanged. megatron-core's Mamba layer specs, which ``training/config.py`` imports,
need triton, which ``.torchtitan`` brings.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_checkpoints import EXPERTS, FAMILIES, HF_VOCAB, HIDDEN, LAYERS  # noqa: E402

MAX_SEQUENCE_LENGTH = 512  # build_gpt's default, which megatron_checkpoints.py keeps


def _enter() -> None:
    """Bridge's packages as bare modules (module doc): their submodules import as usual."""
    import megatron

    root = os.path.join(next(p for p in sys.path if os.path.isdir(os.path.join(p, "megatron", "bridge"))),
                        "megatron", "bridge")
    for name in ("", ".models", ".models.deepseek", ".models.qwen", ".peft", ".training", ".utils", ".data"):
        module = types.ModuleType("megatron.bridge" + name)
        module.__path__ = [os.path.join(root, *name.split(".")[1:])]
        sys.modules[module.__name__] = module
    megatron.bridge = sys.modules["megatron.bridge"]
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.models.t5_provider import T5ModelProvider

    # what training/config.py takes from the package's namespace
    sys.modules["megatron.bridge.models"].GPTModelProvider = GPTModelProvider
    sys.modules["megatron.bridge.models"].T5ModelProvider = T5ModelProvider


def _provider(family: str):
    """Bridge's provider of ``family`` with every field of the checkpoints' ``TransformerConfig``."""
    from megatron.bridge.models.deepseek.deepseek_provider import DeepSeekV3ModelProvider
    from megatron.bridge.models.qwen.qwen_provider import Qwen3MoEModelProvider

    from nemo_moe_export.megatron.tiny import tiny_transformer_config

    extra = {"mtp_num_layers": 1} if family == "deepseek_v3" else {}
    config = tiny_transformer_config(family, n_experts=EXPERTS, hidden_size=HIDDEN, num_layers=LAYERS,
                                     dispatcher="allgather", **extra)
    cls = DeepSeekV3ModelProvider if family == "deepseek_v3" else Qwen3MoEModelProvider
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init and f.name in names}
    # what build_gpt gives the GPTModel beside its config (megatron-core's rotary_base default)
    fields.update(vocab_size=HF_VOCAB, make_vocab_size_divisible_by=128, seq_length=MAX_SEQUENCE_LENGTH,
                  position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=False)
    return cls(**fields)


def _container(model):
    from megatron.bridge.training import config as C
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    return C.ConfigContainer(
        train=C.TrainingConfig(train_iters=1, global_batch_size=1, micro_batch_size=1), model=model,
        optimizer=C.OptimizerConfig(optimizer="adam", lr=1e-3), scheduler=C.SchedulerConfig(),
        dataset=C.GPTDatasetConfig(random_seed=0, sequence_length=MAX_SEQUENCE_LENGTH, reset_position_ids=False,
                                   reset_attention_mask=False, eod_mask_loss=False),
        logger=C.LoggerConfig(), tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=HF_VOCAB),
        checkpoint=C.CheckpointConfig(),
    )


def main(out: str) -> None:
    torch.set_num_threads(1)
    _enter()
    for family in FAMILIES:
        os.makedirs(os.path.join(out, family), exist_ok=True)
        _container(_provider(family)).to_yaml(os.path.join(out, family, "run_config.yaml"))


if __name__ == "__main__":
    main(sys.argv[1])
