"""The report's pipeline part: per stage and per pipeline rank, bytes, files and predicted write
time, and how far the first and last stages stray from the others (docs/design.md#planner).

The ends differ by construction: stage 0 also holds the embedding, the last stage the final norm
and ``lm_head`` (``split_stages``). DeepSeek-V3's multi-token-prediction (MTP) layer
(``num_nextn_predict_layers``) is not a module of the transformers model a stage is cut from: the
export writes it only as pass-through slices that ``from_hf`` kept, each of the export group's
``W`` ranks a ``torch.chunk`` slice of dim 0 (docs/design.md#pass-through-tensors), so it sits on
no stage and is not counted in the stage bytes. Its size is reported beside them, with what it
would add per rank as pass-through (``1 / W`` of it) and on the last stage (``1 / S``), where
Megatron-style trainers hold it.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["mtp_estimate", "pipeline_report"]

_LAYER = re.compile(r"^(?:.*\.)?layers\.\d+\.")


def pipeline_report(simulation: Any, timing: dict, meta: Any) -> dict:
    """The ``pipeline`` section of the report (``simulation.stages`` is set)."""
    work, plan = simulation.stages, simulation.plan
    pipeline, world = work.pipeline, simulation.world_size
    stages = _stage_rows(plan, pipeline)
    by_rank = _pipeline_rank_rows(simulation, timing, stages)
    return dict(pp_size=pipeline.pp_size, stages_per_rank=pipeline.stages_per_rank, stages=pipeline.n_stages,
                ranks_per_stage=world // pipeline.pp_size, layers_per_stage=[len(ls) for ls in pipeline.layers],
                per_stage=stages, per_pipeline_rank=by_rank, imbalance=_imbalance(stages, by_rank),
                mtp=mtp_estimate(meta, plan, world, world // pipeline.pp_size),
                collectives=timing.get("pipeline", {}),
                catalogue=dict(largest_pickled_bytes=work.catalogue_bytes, merge_seconds=work.catalogue_seconds,
                               rank0_declared_check_seconds=work.declared_seconds))


def _stage_rows(plan: Any, pipeline: Any) -> list[dict]:
    rows = [dict(stage=s, pp_rank=s % pipeline.pp_size, layers=_span(ls), bytes=0, tensors=0, files=set(),
                 ends=[]) for s, ls in enumerate(pipeline.layers)]
    for key, planned in plan.tensors.items():
        row = rows[pipeline.stage_of(key)]
        row["bytes"] += planned.nbytes
        row["tensors"] += 1
        row["files"].add(planned.file)
        if _LAYER.match(key) is None:  # the embedding, the final norm, lm_head
            row["ends"].append(key)
    for row in rows:
        row["files"] = len(row["files"])
    return rows


def _span(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def _pipeline_rank_rows(simulation: Any, timing: dict, stages: list[dict]) -> list[dict]:
    work, world = simulation.stages, simulation.world_size
    per_stage = world // work.pipeline.pp_size
    seconds = {row["pp_rank"]: row["write_s"] for row in timing.get("pipeline", {}).get("by_pipeline_rank", [])}
    rows = []
    for pp_rank in range(work.pipeline.pp_size):
        ranks = simulation.ranks[pp_rank * per_stage:(pp_rank + 1) * per_stage]
        rank_bytes = [r.bytes for r in ranks]
        rows.append(dict(pp_rank=pp_rank, stages=[s["stage"] for s in stages if s["pp_rank"] == pp_rank],
                         ranks=f"{ranks[0].rank}-{ranks[-1].rank}", bytes=sum(rank_bytes),
                         max_rank_bytes=max(rank_bytes), mean_rank_bytes=sum(rank_bytes) / len(rank_bytes),
                         max_files_written=max(r.files_written for r in ranks),
                         files_touched=sum(s["files"] for s in stages if s["pp_rank"] == pp_rank),
                         write_s=seconds.get(pp_rank)))
    return rows


def _imbalance(stages: list[dict], by_rank: list[dict]) -> dict:
    """The first and last stages against the mean stage, and the pipeline ranks' spread: the write
    step lasts as long as the busiest node, so the heaviest pipeline rank sets it."""
    mean_stage = sum(s["bytes"] for s in stages) / len(stages)
    mean_rank = sum(r["bytes"] for r in by_rank) / len(by_rank)
    heaviest = max(by_rank, key=lambda r: r["max_rank_bytes"])
    return dict(first_stage_over_mean=round(stages[0]["bytes"] / mean_stage, 4),
                last_stage_over_mean=round(stages[-1]["bytes"] / mean_stage, 4),
                max_stage_over_mean=round(max(s["bytes"] for s in stages) / mean_stage, 4),
                max_pipeline_rank_over_mean=round(max(r["bytes"] for r in by_rank) / mean_rank, 4),
                first_stage_ends=stages[0]["ends"], last_stage_ends=stages[-1]["ends"],
                heaviest_pipeline_rank=heaviest["pp_rank"], heaviest_rank_bytes=heaviest["max_rank_bytes"])


def mtp_estimate(meta: Any, plan: Any, world: int, per_stage: int) -> dict | None:
    """The MTP layers a config declares, in the export's stored bytes, as the official DeepSeek-V3
    checkpoint lays each out: a decoder layer like the model's last, ``enorm``, ``hnorm``,
    ``shared_head.norm`` (hidden), ``eh_proj`` (hidden x 2 hidden) and copies of the embedding and
    the head (vocab x hidden). None when the config declares none."""
    text = meta.config.get_text_config() if hasattr(meta.config, "get_text_config") else meta.config
    n = getattr(text, "num_nextn_predict_layers", 0) or 0
    if n <= 0:
        return None
    last = f"model.layers.{text.num_hidden_layers - 1}."
    layer = [t for k, t in plan.tensors.items() if k.startswith(last)]
    largest = max(layer, key=lambda t: t.nbytes)  # in the export dtype (a router may stay float32)
    element = largest.nbytes // max(1, _numel(largest.shape))
    hidden, vocab = text.hidden_size, text.vocab_size
    extra = (3 * hidden + 2 * hidden * hidden + 2 * vocab * hidden) * element
    nbytes = n * (sum(t.nbytes for t in layer) + extra)
    return dict(layers=n, bytes=nbytes, counted=False,
                per_rank_as_passthrough=nbytes // world, per_last_stage_rank_if_held_there=nbytes // per_stage,
                how="not in the stage bytes: the export writes the MTP layer only as pass-through slices "
                    "from_hf kept, 1/W per rank of the export group (on no stage)")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
