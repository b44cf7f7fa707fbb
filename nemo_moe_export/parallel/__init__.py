"""Process groups and hang-free coordination between ranks, one module per concern:

* :mod:`.world`: this process's rank, world size and device; the default process group
  (:func:`init_distributed`, :func:`resolve_device`, :func:`dist_info`).
* :mod:`.layout`: which ranks share a data-parallel, expert-parallel, expert-data-parallel,
  pipeline, tensor- or context-parallel group (:class:`RankGroup`, :class:`ParallelLayout`,
  :func:`discover_layout` from Megatron, a named DeviceMesh or the plain world;
  :func:`init_expert_parallel` creates Megatron's EP layout without Megatron; :func:`model_groups`).
* :mod:`.coordinator`: :class:`Coordinator`, how multi-step collective work (export, evaluation)
  agrees, step by step and under a timeout, that every rank succeeded.
* :mod:`.reports`: :class:`PeerError`, and how the survivors of a broken agreement exchange reports
  through the rendezvous store and name the ranks that failed or stalled.
* :mod:`.timeouts`: how long each of those waits lasts, and :func:`bound_groups`, the bound on the
  model's own process groups.

Every name is importable from ``nemo_moe_export.parallel`` (docs/design.md#coordination-protocol).
"""

from nemo_moe_export.parallel.coordinator import Coordinator
from nemo_moe_export.parallel.layout import (
    CP_DIM,
    DENSE_DP_DIMS,
    EP_DIM,
    EXPERT_DP_DIMS,
    MODEL_PARALLEL_DIMS,
    PP_DIM,
    TP_DIM,
    ParallelLayout,
    RankGroup,
    discover_layout,
    expert_parallel_groups,
    init_expert_parallel,
    model_groups,
)
from nemo_moe_export.parallel.reports import PeerError, stopped_waiting
from nemo_moe_export.parallel.timeouts import bound_groups
from nemo_moe_export.parallel.world import DEVICES, DistInfo, dist_info, init_distributed, is_global_rank0, resolve_device

__all__ = [
    "CP_DIM",
    "DENSE_DP_DIMS",
    "DEVICES",
    "EP_DIM",
    "EXPERT_DP_DIMS",
    "MODEL_PARALLEL_DIMS",
    "PP_DIM",
    "TP_DIM",
    "Coordinator",
    "DistInfo",
    "ParallelLayout",
    "PeerError",
    "RankGroup",
    "bound_groups",
    "discover_layout",
    "dist_info",
    "expert_parallel_groups",
    "init_distributed",
    "init_expert_parallel",
    "is_global_rank0",
    "model_groups",
    "resolve_device",
    "stopped_waiting",
]
