"""The export's own code timed on the planned model (docs/design.md#planner): what ``timing.py`` takes
for the parts of an export that are not bytes on disk. ``catalogue_seconds``: the catalogue merge over
pipeline stages and rank 0's declared-tensor check; ``metadata_seconds``: ``plan.stamped`` and rank
0's metadata files and verify, on a skeleton of the checkpoint. Each is cached per model and options.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from typing import Any

from nemo_moe_export.export import stages
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan
from nemo_moe_export.export.step import cyclic_gc_paused, export_catalogue
from nemo_moe_export.export.target import export_id_of, new_export_id, write_metadata_files
from nemo_moe_export.export.verify import verify_checkpoint
from nemo_moe_export.export.writer import write_headers
from nemo_moe_export.parallel import RankGroup
from nemo_moe_export.planner.model import MetaModel
from nemo_moe_export.planner.pipeline import Pipeline

__all__ = ["catalogue_seconds", "metadata_seconds", "timed"]


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and its seconds, with Python's cycle collector paused as the export
    pauses it (``step.cyclic_gc_paused``), so a collection the planner's own objects trigger is
    not counted as the export's work."""
    with cyclic_gc_paused():
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        return out, time.perf_counter() - started


def catalogue_seconds(meta: MetaModel, pipeline: Pipeline, options: ExportOptions) -> tuple[float, int, float]:
    """Seconds of the export's own code for the catalogues, on this model (cached per options):

    * a rank's share of ``stages.merge_catalogues``: its stages' catalogue pickled, every pipeline
      rank's unpickled (``all_gather_object``) and merged key by key (``stages._add_stage_key``);
    * the largest pickled catalogue (``all_gather_object`` pads every rank's to it);
    * rank 0's ``stages.check_declared`` (transformers' model for the config on the meta device),
      with its per-process cache cleared, as the export's first call finds it.
    """
    key = ("catalogues", repr(options), pipeline)
    if key not in meta.plans:
        meta.plans[key] = _time_catalogues(meta, pipeline, options)
    return meta.plans[key]


def _time_catalogues(meta: MetaModel, pipeline: Pipeline, options: ExportOptions) -> tuple[float, int, float]:
    whole = export_catalogue(meta.adapter, meta.state_dict, options, model=meta.model, config=meta.config)
    parts = []
    for pp_rank in range(pipeline.pp_size):
        mine = {k: m for k, m in whole.metadata.items() if pipeline.pp_rank_of(k) == pp_rank}
        parts.append(stages.catalogue_of(mine, whole.float32 & set(mine), whole.exact, pp_rank))
    pickled = [timed(pickle.dumps, stages._portable(c)) for c in parts]
    group = RankGroup(0, pipeline.pp_size, tuple(range(pipeline.pp_size)))
    with cyclic_gc_paused():
        started = time.perf_counter()
        metadata: dict = {}
        holder: dict = {}
        for pp_rank, (blob, _) in enumerate(pickled):
            entries = pickle.loads(blob)[0]
            for k, (shape, dtype) in entries.items():
                stages._add_stage_key(metadata, holder, k, stages.TensorMeta(tuple(shape), dtype), pp_rank, group,
                                      False)
        merge_s = time.perf_counter() - started
    stages._declared.cache_clear()
    _, declared_s = timed(stages.check_declared, whole, meta.adapter, RankGroup(0, 1, (0,)))
    return (round(max(s for _, s in pickled) + merge_s, 4), max(len(b) for b, _ in pickled), round(declared_s, 4))


def metadata_seconds(meta: MetaModel, plan: ExportPlan, options: ExportOptions) -> tuple[float, float, float]:
    """Seconds of the export's own metadata code on this plan: ``plan.stamped`` (validate, every
    rank), and rank 0's ``target.write_metadata_files`` (headers step) and
    ``verify.verify_checkpoint`` (verify step) on a skeleton of the checkpoint: every planned file
    created at full size (sparse) with its header by ``writer.write_headers``, in memory
    (``/dev/shm`` where there is one, so the fsyncs cost nothing: the model counts file operations
    apart). Cached per model and options."""
    key = ("metadata seconds", repr(options))
    if key not in meta.plans:
        meta.plans[key] = _time_metadata(meta, plan, options)
    return meta.plans[key]


def _time_metadata(meta: MetaModel, plan: ExportPlan, options: ExportOptions) -> tuple[float, float, float]:
    stamped, stamp_s = timed(plan.stamped, export_id_of(new_export_id()))
    model = meta.model
    generation = model.generation_config if getattr(model, "can_generate", lambda: False)() else None
    memory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="nme-plan-", dir=memory) as folder:
        write_headers(stamped, folder, [f.name for f in stamped.files])
        _, index_s = timed(write_metadata_files, folder, stamped, meta.config, options.torch_dtype, generation)
        report, verify_s = timed(verify_checkpoint, folder)
    if not report.ok:  # the skeleton is the plan's checkpoint less its tensor bytes: it must verify
        raise RuntimeError("the planner's checkpoint skeleton failed verification (a planner defect):\n"
                           + report.summary())
    return round(stamp_s, 4), round(index_s, 4), round(verify_s, 4)
