"""The export and evaluation planner: what every rank of a job will do, before the job runs.

``plan_job(target, world, time_model)`` builds the model on the meta device, simulates every rank
of ``world`` under torch's fake process group with the export's own code (``simulate.py``),
predicts the export time (``timing.py``) and returns the report (``report.py``); ``nemo-moe-export
plan`` is its command line (docs/design.md#planner).
"""

from __future__ import annotations

from typing import Any

from nemo_moe_export.errors import InputError
from nemo_moe_export.planner.mmlu import plan_mmlu
from nemo_moe_export.planner.model import MetaModel, PlanTarget, build_meta_model
from nemo_moe_export.planner.model_parallel import model_parallel_of
from nemo_moe_export.planner.report import build_report, format_table
from nemo_moe_export.planner.simulate import RankPlan, Simulation, simulate
from nemo_moe_export.planner.timing import TimeModel, predict

__all__ = ["MetaModel", "PlanTarget", "RankPlan", "Simulation", "TimeModel", "build_meta_model", "format_table",
           "plan_job", "predict", "simulate"]


def plan_job(target: PlanTarget, world: int, time_model: TimeModel, *, device: str = "cpu",
             meta: MetaModel | None = None, per_rank: bool = True, mmlu: tuple[str, str] | None = None) -> dict:
    """The report for ``target`` on ``world`` ranks (``mmlu``: a question folder and a tokenizer)."""
    mp = model_parallel_of(target.parallel)
    if mmlu is not None and mp.tp * mp.cp > 1:  # TP / CP peers run every batch together: not planned yet
        raise InputError("MMLU is not planned under TP or CP", key="--mmlu", expected="tp_size = cp_size = 1",
                         actual=f"tp_size={mp.tp}, cp_size={mp.cp}", hint="plan the export alone")
    meta = meta or build_meta_model(target.config, target.dtype)
    simulation = simulate(meta, target.parallel, world, target.export, device=device)
    mmlu_plan: Any = None
    if mmlu is not None:
        mmlu_plan = plan_mmlu(mmlu[0], mmlu[1], target.parallel, world, meta, target.mmlu)
    return build_report(target, meta, simulation, predict(simulation, time_model), device=device,
                        per_rank=per_rank, mmlu=mmlu_plan)
