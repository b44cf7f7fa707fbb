"""CPU stand-ins for the CUDA-only calls megatron-core 0.16.1 makes, for rehearsals on gloo CPU ranks,
and for what it cannot do without Transformer Engine.

Only the tests and the recipe (``megatron/recipe.py``) apply these: on CPU ranks all of them, on
GPU ranks without Transformer Engine the :data:`TE_PATCHES`; nothing else in the package
imports this module, and the product code calls megatron-core as it is. Each patch names the call
it stands in for and why the substitute computes the same thing on a CPU rank
(docs/design.md#megatron-core-models). :func:`apply` is idempotent and process-wide: call it in each
rank before building a model.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import torch

__all__ = ["CUDA_PATCHES", "PATCHES", "TE_PATCHES", "apply", "apply_without_te", "have_transformer_engine"]

CUDA_PATCHES = (
    "tensor_parallel.random: the CUDA RNG tracker (model_parallel_cuda_manual_seed)",
    "torch.cuda.current_device (router.py weights and expert_bias, rotary embedding inv_freq)",
    "MoEAlltoAllTokenDispatcher: torch.cuda.Stream and the device-to-host split copies",
    "torch.cuda.synchronize (dist_checkpointing, pipeline p2p)",
    "pipeline_parallel/schedules.py: torch.zeros([], device=\"cuda\") (the token counter)",
    "language_module.py setup_embeddings_and_output_layer: weight.data.cuda() (pipeline embedding copy)",
)
# megatron-core 0.16.1 without Transformer Engine, on any device: its MoE router raises NameError
# and MLA takes TE-only paths; its torch norm refuses sequence parallelism. GPU ranks without TE
# need these as well (apply_without_te).
TE_PATCHES = (
    "moe_utils.te_general_gemm (undefined without Transformer Engine)",
    "multi_latent_attention.HAVE_TE (true without Transformer Engine)",
    "DotProductAttention(k_channels=, v_channels=) for MLA",
    "WrappedTorchNorm under sequence parallelism (refused without Transformer Engine)",
)
PATCHES = CUDA_PATCHES + TE_PATCHES

_applied: set[str] = set()


def apply() -> tuple[str, ...]:
    """Install every CPU stand-in (once per process); returns :data:`PATCHES`."""
    if "cuda" not in _applied:
        _rng_tracker()
        _current_device()
        _alltoall_host_copies()
        torch.cuda.synchronize = lambda *args, **kwargs: None  # nothing runs asynchronously on a CPU rank
        _schedule_token_counter()
        _embedding_copy_on_cpu()
        _applied.add("cuda")
    apply_without_te()
    return PATCHES


def apply_without_te() -> tuple[str, ...]:
    """Install the Transformer-Engine stand-ins only (once per process); returns :data:`TE_PATCHES`."""
    if "te" not in _applied:
        _router_gemm()
        _mla_without_te()
        _mla_core_attention()
        _sequence_parallel_torch_norm()
        _applied.add("te")
    return TE_PATCHES


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _rng_tracker() -> None:
    """``model_parallel_cuda_manual_seed`` seeds CUDA generators and the tracker's ``fork()`` swaps
    CUDA RNG states (attention dropout forks it on every forward). megatron's own inference tracker
    forks nothing; on a CPU rank dropout and initialisation draw from the CPU generator, so this
    changes no value (the tiny models have dropout 0 and initialise on the CPU)."""
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _current_device() -> None:
    """The router moves its weight to ``torch.cuda.current_device()`` on every forward and creates
    ``expert_bias`` there; rotary embeddings and the attention softmax offset too. On a CPU rank
    every tensor lives on the CPU, so the CPU is "the current device"."""
    torch.cuda.current_device = lambda: torch.device("cpu")


def _alltoall_host_copies() -> None:
    """``MoEAlltoAllTokenDispatcher`` creates a ``torch.cuda.Stream`` (only while its class
    attribute is None) and ``_maybe_dtoh_and_synchronize`` copies the split sizes to the host on
    it as numpy arrays; ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` leaves CPU tensors as
    tensors, which the all-to-all cannot take as split sizes. Here: no stream, and the same
    numpy arrays from tensors that are already in host memory."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()

    def host_splits(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_splits


def _schedule_token_counter() -> None:
    """Each of megatron's pipeline schedules starts its token counter with ``torch.zeros([],
    dtype=torch.int, device="cuda")``. The schedules module sees a ``torch`` whose ``zeros`` puts
    a ``"cuda"`` tensor on the CPU, where every other tensor of a CPU rank lives; every other name
    is torch's own."""
    from megatron.core.pipeline_parallel import schedules

    class TorchWithCpuZeros:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            return torch.zeros(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)

    schedules.torch = TorchWithCpuZeros()


def _embedding_copy_on_cpu() -> None:
    """Under pipeline parallelism with tied embeddings or an MTP layer, the last stage builds its
    own copy of the word embeddings, zeroes it and all-reduces it with the first stage's over the
    embedding group, after moving it with ``weight.data.cuda()``. On a CPU rank the copy stays on
    the CPU (gloo all-reduces CPU tensors), so ``Tensor.cuda`` is the identity while
    ``setup_embeddings_and_output_layer`` runs, and only then."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self: Any) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


def _router_gemm() -> None:
    """``moe_utils`` imports ``te_general_gemm`` with the fused kernels in one try block; without
    Transformer Engine the name is never bound and the router's ``router_gating_linear`` raises
    NameError. megatron's extensions module defines it as None without TE; None selects the
    router's own ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mla_without_te() -> None:
    """``multi_latent_attention`` sets ``HAVE_TE = True`` whenever megatron's extensions module
    imports, which it does without Transformer Engine (its classes are stubs), and then takes
    TE-only paths. Without TE the truth is False."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def _mla_core_attention() -> None:
    """MLA builds its core attention with ``k_channels`` / ``v_channels`` (query-key and value head
    sizes differ), which only TE's attention accepts. The local ``DotProductAttention`` computes
    ``q @ k^T`` at any head size and views its output as heads x ``kv_channels``, so it is exact
    when ``v_channels == kv_channels``; the stand-in asserts that and drops the two arguments."""
    from megatron.core.models import backends
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, config: Any, *args: Any, k_channels: int | None = None,
                     v_channels: int | None = None, **kwargs: Any) -> None:
            if v_channels is not None and v_channels != config.kv_channels:
                raise ValueError(f"the CPU stand-in needs v_head_dim == kv_channels ({v_channels} != "
                                 f"{config.kv_channels})")
            super().__init__(config, *args, **kwargs)

    backends.LocalSpecProvider.core_attention = lambda self: MLADotProductAttention


def _sequence_parallel_torch_norm() -> None:
    """The local spec's ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``; Transformer
    Engine's norms take it. A norm is per token, so on a rank's sequence shard it computes what it
    computes on the whole sequence; its weight is then the same on every TP rank and its gradient
    a partial sum, which megatron all-reduces over TP for weights tagged ``sequence_parallel``
    (``finalize_model_grads``), as TE's norms are tagged. So the norm is built with the flag off,
    and its weights tagged."""
    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__

    def build_for_sequence_parallel(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build(cls, plain, *args, **kwargs)
        for weight in norm.parameters():
            weight.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = build_for_sequence_parallel
