"""Tensor parallelism (torch TP) for transformers DeepSeek-V3 (MLA) and Qwen3-MoE, torchtitan style
(docs/design.md#tensor-and-context-parallelism-torch-tp).

``parallelize_tp(model, tp_mesh)`` applies ``parallelize_module`` to a transformers CausalLM:

* the layers ``config.base_model_tp_plan`` declares ``"colwise"`` / ``"rowwise"`` outside the routed
  experts get torch's ``ColwiseParallel`` (weight ``Shard(0)``) / ``RowwiseParallel`` (``Shard(1)``):
  the dense MLP and the shared experts of both families, Qwen3-MoE's q/k/v and o projections;
* DeepSeek-V3's MLA attention, which its plan leaves out: ``q_proj`` (or ``q_b_proj`` with a
  ``q_lora_rank``) and ``kv_b_proj`` column-parallel, ``o_proj`` row-parallel; the down projections
  ``q_a_proj`` / ``kv_a_proj_with_mqa`` and their norms stay whole on every TP rank (as torchtitan
  and megatron-core keep them: they are small and shared by every head);
* MLA's rotary key ``k_rot`` comes out of ``kv_a_proj_with_mqa`` whole and is shared by every head,
  so on each rank its gradient sums this rank's heads only: that slice of the projection's output
  passes through an identity whose backward all-reduces over TP (megatron's "copy to the tensor
  parallel region"; torchtitan gets the same from keeping ``k`` a DTensor, which transformers'
  attention cannot: it mixes plain rotary tensors in). The compressed ``kv`` slice needs none: it
  enters ``kv_b_proj``, whose column-parallel input all-reduces its gradient already;
* norms the plan marks ``"replicated_with_grad_allreduce"`` (Qwen3-MoE's per-head ``q_norm`` /
  ``k_norm``, applied to this rank's heads only) become ``Replicate`` DTensors over TP that take
  their input as sharded on the head dim (torch's ``SequenceParallel`` with ``sequence_dim=2``), so
  their weight gradient, summed over this rank's heads only, is all-reduced over TP;
* the word embeddings row-parallel (vocabulary rows split, output all-reduced) and ``lm_head``
  column-parallel with its logits gathered (``Replicate``), as torchtitan without loss parallelism.

**Routed experts stay whole under TP** (the plan's ``packed_colwise`` / ``moe_tp_experts``
entries are not applied): each TP rank runs every routed expert on the same tokens, and FSDP (or
expert parallelism) splits them over the data-parallel ranks. So do the router, the norms and
every other weight TP leaves out: after ``fully_shard`` over ``mesh["dp"]`` they are
DTensors on the "dp" mesh only, identical on the TP ranks, which the export treats as replicas
(``placement.unsplit_model_parallel_dims``: checked equal, writing shared).

**Heads.** Both attentions view their projections as ``(batch, seq, -1, head_dim)``, so a rank's
local heads (half of them at TP2) need no change to the module; torchtitan instead rewrites its
modules' head count because its own attention views with ``n_heads``. transformers' attention
reads ``num_key_value_groups`` (query heads per KV head), which a split of both by TP keeps, so
GQA works on local heads as long as TP divides the KV head count (checked).

Sequence parallelism is not applied (transformers' decoder layers take the rotary cos/sin and the
masks of the whole sequence from the model; megatron-core's SP is the supported one).

Use it as torchtitan does, TP inside each data-parallel replica and FSDP2 over ``"dp"``
(:func:`parallelize_tp_fsdp` does both)::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_tp_fsdp(model, mesh)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from nemo_moe_export.errors import InputError

__all__ = ["MLA_TYPES", "parallelize_tp", "parallelize_tp_fsdp", "tp_plan"]

MLA_TYPES = ("deepseek_v3", "kimi_k2")
"""Model types with DeepSeek's multi-head latent attention (transformers' DeepseekV3Attention)."""

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
_HEAD_NORM = "replicated_with_grad_allreduce"  # a norm over head_dim, applied to this rank's heads
_ROUTED_EXPERTS = ".mlp.experts"  # left to FSDP / EP (module docstring)


def tp_plan(model: Any) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of one decoder layer (keys relative to the layer), read
    from the config's ``base_model_tp_plan`` plus DeepSeek-V3's MLA attention."""
    config = model.config
    declared = getattr(config, "base_model_tp_plan", None) or {}
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in declared.items():
        if not pattern.startswith("layers.*.") or _ROUTED_EXPERTS in "." + pattern:
            continue
        name = pattern.removeprefix("layers.*.")
        if style in _STYLES:
            plan[name] = _STYLES[style]()
        elif style == _HEAD_NORM:
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if config.model_type in MLA_TYPES:
        lora = getattr(config, "q_lora_rank", None) is not None  # a low-rank query: q_a_proj, then q_b_proj
        query, absent = ("self_attn.q_b_proj", "self_attn.q_proj") if lora else ("self_attn.q_proj", "self_attn.q_b_proj")
        # transformers 5.25's plan lists both MLA query projections; the config has one of them
        plan.pop(absent, None)
        plan.update({query: ColwiseParallel(), "self_attn.kv_b_proj": ColwiseParallel(),
                     "self_attn.o_proj": RowwiseParallel()})
    return plan


def parallelize_tp(model: Any, tp_mesh: Any) -> Any:
    """Apply tensor parallelism over ``tp_mesh`` (a 1-D mesh, e.g. ``mesh["tp"]``) to a transformers
    DeepSeek-V3 / Kimi K2 / Qwen3-MoE CausalLM, in place, before ``fully_shard``; returns ``model``."""
    tp = tp_mesh.size()
    _check_divides(model.config, tp)
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    layer_plan = tp_plan(model)
    for layer in model.model.layers:
        modules = dict(layer.named_modules())  # dense and MoE layers differ: mlp.gate_proj vs mlp.shared_experts.*
        present = {name: style for name, style in layer_plan.items() if name in modules}
        parallelize_module(layer, tp_mesh, present)
        if model.config.model_type in MLA_TYPES:
            layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(_RotaryKeyGradient(model.config, tp_mesh))
    return model


def parallelize_tp_fsdp(model: Any, mesh: Any, *, fsdp: bool = True) -> Any:
    """torchtitan's layout of ``model`` on ``mesh`` (dims ``"dp"`` and, where used, ``"cp"`` and
    ``"tp"``): :func:`parallelize_tp` over ``mesh["tp"]`` when the mesh has that dim, then, with
    ``fsdp``, ``fully_shard`` of each decoder layer and of the model over ``mesh["dp"]``. In place;
    returns ``model``."""
    if "tp" in (mesh.mesh_dim_names or ()):
        parallelize_tp(model, mesh["tp"])
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


class _RotaryKeyGradient:
    """Forward hook of ``kv_a_proj_with_mqa``: its output's last ``qk_rope_head_dim`` values (the
    rotary key, shared by every head) unchanged forward, their gradient all-reduced over TP backward
    (module docstring)."""

    def __init__(self, config: Any, tp_mesh: Any) -> None:
        self.rope = config.qk_rope_head_dim
        self.mesh = tp_mesh

    def __call__(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        latent, rotary = output.split([output.shape[-1] - self.rope, self.rope], dim=-1)
        # from_local(Replicate) then to_local(grad_placements=Partial): nothing moves forward; backward
        # turns the Partial gradient into a Replicate one, an all-reduce.
        rotary = DTensor.from_local(rotary, self.mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])
        return torch.cat([latent, rotary], dim=-1)


def _check_divides(config: Any, tp: int) -> None:
    """Refuse a TP size that does not split the heads (or the KV heads, or the vocabulary) evenly:
    torch TP would give ranks unequal heads and the attention's local view would be wrong."""
    sizes = {"num_attention_heads": config.num_attention_heads, "vocab_size": config.vocab_size}
    if config.model_type not in MLA_TYPES:
        sizes["num_key_value_heads"] = config.num_key_value_heads
    for field, value in sizes.items():
        if value % tp:
            raise InputError("the tensor-parallel size must divide the model's heads and vocabulary",
                             key=field, expected=f"a multiple of tp={tp}", actual=value,
                             hint="choose a TP size that divides the attention and KV heads and the vocabulary")
