"""Real expert parallelism (EP) for the transformers 5 MoE models we support.

:func:`apply_expert_parallel` swaps every fused experts module (``DeepseekV3Experts``,
``Qwen3MoeExperts``, ``KimiLinearExperts``: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
for an :class:`ExpertParallelExperts` that keeps only this EP rank's ``E / ep`` contiguous experts
(Megatron / NeMo AutoModel ownership, :func:`nemo_moe_export.placement.get_ep_expert_range`) and sends
each token to the ranks that own its experts with an all-to-all. The router, shared experts and
every other module stay as they are; only the experts computation is distributed, so the MoE block
that calls ``self.experts(hidden, top_k_index, top_k_weights)`` does not change.

The new expert weights are DTensors ``Shard(0)`` on an ``"ep"`` mesh dim (with ``Replicate()`` on
an ``"edp"`` dim in front when there are expert-DP replicas), so the state-dict adapter reads the
global expert ids, and which replica writes them, from the placements alone.

Every rank of an EP group must call forward (and backward) the same number of times, in the same
order: each MoE layer runs collectives over the EP group. A rank that skips a batch, or stops
early, leaves its peers blocked in the all-to-all; with groups from
:func:`nemo_moe_export.parallel.init_expert_parallel` they raise after the group timeout instead of
hanging, but the run is lost either way. Give EP peers the same batches and shard data only over
the expert-DP group (this is the MMLU hang).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from nemo_moe_export.errors import InputError
from nemo_moe_export.parallel import ParallelLayout
from nemo_moe_export.placement import get_ep_expert_range

__all__ = ["ExpertParallelExperts", "apply_expert_parallel", "experts_modules", "expert_mesh"]

_EXPERTS_CLASS_NAMES = ("DeepseekV3Experts", "Qwen3MoeExperts", "KimiLinearExperts")


def _supported_experts_classes() -> tuple[type[nn.Module], ...]:
    """The transformers experts classes whose math :class:`ExpertParallelExperts` reproduces."""
    return DeepseekV3Experts, Qwen3MoeExperts, KimiLinearExperts


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Fully qualified name -> fused experts module, for every MoE layer of ``model``."""
    classes = _supported_experts_classes()
    return {name: m for name, m in model.named_modules() if isinstance(m, classes)}


def expert_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """The DeviceMesh the expert DTensors live on, built from the layout's existing groups.

    1-D ``("ep",)`` when there are no expert-DP replicas; otherwise 2-D ``("edp", "ep")`` so that
    placements ``(Replicate(), Shard(0))`` mark only replica 0 as the writer of each expert (a
    1-D mesh would make every replica a "primary" and an export would write each expert
    ``edp`` times). Collective over the expert-DP group (it learns the replicas' EP ranks).
    """
    if layout.ep.group is None:
        raise InputError("expert parallelism needs an EP process group",
                         expected="layout.ep.group", actual=None)
    if layout.edp.size == 1:
        return DeviceMesh.from_group(layout.ep.group, device_type, mesh_dim_names=("ep",))
    replicas: list[Any] = [None] * layout.edp.size
    dist.all_gather_object(replicas, list(layout.ep.ranks), group=layout.edp.group)
    return DeviceMesh.from_group(
        [layout.edp.group, layout.ep.group], device_type, mesh=torch.tensor(replicas, dtype=torch.int),
        mesh_dim_names=("edp", "ep"),
    )


class ExpertParallelExperts(nn.Module):
    """This EP rank's contiguous block of experts; tokens reach it through an all-to-all.

    Same call signature and math as the transformers fused experts it replaces
    (``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``;
    ``act(x @ gate.T) * (x @ up.T) @ down.T`` per expert, weighted by the router). Steps:

    1. group the ``T * k`` (token, expert) assignments by expert, hence by owning rank;
    2. exchange per-expert counts (one small all-to-all), which gives the uneven splits;
    3. all-to-all the token rows to their owners (autograd), run the local experts;
    4. all-to-all the results back (autograd), weight them by the router locally (so the router's
       gradient stays local) and sum them per token.

    Every local expert runs even on zero rows, so its gradient is zeros rather than None and all
    ranks have the same set of gradients (later gradient reductions stay in step).
    ``last_splits`` keeps the (send, receive) row counts per EP peer of the last forward for
    diagnostics.
    """

    def __init__(self, original: nn.Module, layout: ParallelLayout, mesh: DeviceMesh) -> None:
        super().__init__()
        _check_experts_math(original)
        self.num_experts = int(original.num_experts)
        self.ep_size, self.ep_rank = layout.ep.size, layout.ep.rank
        self.ep_group = layout.ep.group
        self.local_start, self.local_end = get_ep_expert_range(self.num_experts, self.ep_size, self.ep_rank)
        self.num_local_experts = self.local_end - self.local_start
        self.act_fn = original.act_fn
        placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
        self.gate_up_proj = self._local_parameter(original.gate_up_proj, mesh, placements)
        self.down_proj = self._local_parameter(original.down_proj, mesh, placements)
        self.last_splits: tuple[list[int], list[int]] = ([], [])

    def _local_parameter(self, full: torch.Tensor, mesh: DeviceMesh, placements: list[Any]) -> nn.Parameter:
        """A copy of this rank's experts ``[start, end)`` of ``full``, as a DTensor over the EP mesh."""
        local = full.detach()[self.local_start:self.local_end].clone()
        dtensor = DTensor.from_local(local, mesh, placements, run_check=False,
                                     shape=full.shape, stride=full.stride())
        return nn.Parameter(dtensor, requires_grad=full.requires_grad)

    def extra_repr(self) -> str:
        return (f"experts {self.local_start}:{self.local_end} of {self.num_experts} "
                f"(ep rank {self.ep_rank} of {self.ep_size})")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        flat_experts = top_k_index.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # by expert, hence by owning rank
        token_of_row = order // top_k
        send_counts = torch.bincount(flat_experts, minlength=self.num_experts)
        recv_counts = self._exchange_counts(send_counts)  # [ep, local experts]: rows from each peer
        send_splits = send_counts.view(self.ep_size, -1).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        self.last_splits = (send_splits, recv_splits)

        received = funcol.all_to_all_single_autograd(
            hidden_states[token_of_row], recv_splits, send_splits, self.ep_group)
        expert_out = self._run_local_experts(received, recv_counts)
        returned = funcol.all_to_all_single_autograd(expert_out, send_splits, recv_splits, self.ep_group)

        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        weighted = (returned * weights).to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token_of_row, weighted)

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """Per peer, how many rows it sends for each of my experts (experts are contiguous per rank)."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.ep_group)
        return recv.view(self.ep_size, self.num_local_experts)

    def _run_local_experts(self, rows: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Rows arrive per peer, each peer's block sorted by expert; regroup by expert, run, restore."""
        local_ids = torch.arange(self.num_local_experts, device=rows.device).repeat(self.ep_size)
        row_expert = torch.repeat_interleave(local_ids, recv_counts.reshape(-1))
        by_expert = torch.argsort(row_expert, stable=True)
        per_expert = recv_counts.sum(0).tolist()
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        outputs = []
        for expert, chunk in enumerate(torch.split(rows[by_expert], per_expert)):
            gate, up = nn.functional.linear(chunk, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(nn.functional.linear(self.act_fn(gate) * up, down[expert]))
        grouped = torch.cat(outputs) if outputs else rows[:0]
        return torch.empty_like(grouped).index_copy(0, by_expert, grouped)


def _check_experts_math(module: nn.Module) -> None:
    """Refuse variants whose weights mean something else (interleaved, transposed, biased)."""
    variant = {name: getattr(module, name, default) for name, default in
               (("is_concatenated", True), ("is_transposed", False), ("has_bias", False),
                ("has_gate", True), ("has_post_expert_norm", False))}
    expected = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
                "has_post_expert_norm": False}
    if variant != expected:
        raise InputError("unsupported experts variant for expert parallelism",
                         key=type(module).__name__, expected=expected, actual=variant)


def apply_expert_parallel(model: nn.Module, layout: ParallelLayout) -> nn.Module:
    """Replace every MoE layer's experts of ``model`` (in place) by this EP rank's share; return it.

    Every rank must start from the same full model (same weights) and call this together: each
    keeps the slice ``get_ep_expert_range(E, ep, ep_rank)`` of the full weights. Requires
    ``E % layout.ep.size == 0``. With ``layout.ep.size == 1`` nothing changes. Afterwards every
    EP peer must run the same sequence of forwards and backwards (see the module docstring).
    """
    if layout.ep.size == 1:
        return model
    targets = experts_modules(model)
    if not targets:
        raise InputError(
            "no supported experts module in the model",
            expected=f"modules of type {list(_EXPERTS_CLASS_NAMES)}",
            actual=type(model).__name__,
        )
    for name, module in targets.items():  # validate everything before changing anything
        _check_experts_math(module)
        get_ep_expert_range(int(module.num_experts), layout.ep.size, layout.ep.rank)
    device_type = next(iter(targets.values())).gate_up_proj.device.type
    mesh = expert_mesh(layout, device_type)
    for name, module in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ExpertParallelExperts(module, layout, mesh))
    return model
