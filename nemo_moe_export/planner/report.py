"""The plan as JSON (for tools) and as a readable table."""

from __future__ import annotations

from typing import Any

from nemo_moe_export.planner.stage_report import pipeline_report

__all__ = ["build_report", "format_bytes", "format_table"]

_RANK_FIELDS = ("bytes", "runs", "files_owned", "files_written", "header_bytes", "staged_bytes",
                "staging_peak_bytes", "replica_bytes_checked", "replica_allreduce_bytes", "exchanged_bytes",
                "row_exchanges", "exchange_peak_bytes")


def format_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _spread(values: list[int]) -> dict[str, Any]:
    mean = sum(values) / len(values)
    top = max(range(len(values)), key=values.__getitem__)
    return dict(min=min(values), mean=mean, max=max(values), max_rank=top,
                max_over_mean=round(max(values) / mean, 4) if mean else None)


def build_report(target: Any, meta: Any, simulation: Any, timing: dict, *, device: str,
                 per_rank: bool = True, mmlu: dict | None = None) -> dict:
    """Everything the planner found, as plain data."""
    parallel, plan, ranks = target.parallel, simulation.plan, simulation.ranks
    digests = set(simulation.digests)
    report = dict(
        model=dict(name=target.name, model_type=getattr(meta.config, "model_type", None),
                   parameters=sum(t.numel() for k, t in meta.state_dict.items() if k not in meta.buffers),
                   dtype=str(target.dtype).replace("torch.", ""),
                   layer_groups={str(k): len(v) for k, v in meta.members.items()}),
        layout=dict(strategy=parallel.strategy, world_size=simulation.world_size,
                    replicate=parallel.replicate if parallel.strategy == "hsdp" else None,
                    ep_size=parallel.ep_size if parallel.strategy in ("ep", "ep_fsdp") else None, device=device,
                    **_pipeline_layout(parallel, simulation), **_model_parallel_layout(simulation)),
        export=dict(dtype=target.export.dtype, max_shard_size=target.export.max_shard_size,
                    staging_bytes=target.export.staging_bytes, writer_threads=target.export.writer_threads),
        checkpoint=dict(bytes=plan.total_tensor_bytes, files=len(plan.files), tensors=len(plan.tensors),
                        index_bytes=ranks[0].index_bytes),
        checks=dict(every_element_one_writer=simulation.coverage_ok, boxes_tile_exactly=simulation.tiling_ok,
                    rank_bytes_sum_to_checkpoint=simulation.total_bytes == plan.total_tensor_bytes,
                    plan_digest_identical=len(digests) == 1, plan_digest=plan.digest()),
        ranks_writing_nothing=sum(1 for r in ranks if r.bytes == 0),
        summary={f: _spread([getattr(r, f) for r in ranks]) for f in _RANK_FIELDS},
        validate=dict(coverage_allreduce_bytes=simulation.coverage_allreduce_bytes),
        time=timing,
        simulation_seconds=simulation.seconds,
    )
    if simulation.stages is not None:
        report["pipeline"] = pipeline_report(simulation, timing, meta)
    if per_rank:
        report["ranks"] = [{"rank": r.rank, **{f: getattr(r, f) for f in _RANK_FIELDS}} for r in ranks]
    if mmlu is not None:
        report["mmlu"] = mmlu
    return report


def _pipeline_layout(parallel: Any, simulation: Any) -> dict:
    """The pipeline's part of the layout (nothing without pipeline stages, as before them)."""
    if simulation.stages is None:
        return {}
    p = simulation.stages.pipeline
    return dict(pp_size=p.pp_size, stages_per_rank=p.stages_per_rank,
                layers_per_stage=[len(ls) for ls in p.layers])


def _model_parallel_layout(simulation: Any) -> dict:
    """TP / CP / ETP / SP sizes (nothing when all are 1 and SP is off, as before them)."""
    mp = simulation.model_parallel
    if mp is None or (mp.tp, mp.cp, mp.etp, mp.sequence_parallel) == (1, 1, 1, False):
        return {}
    return mp.describe()


def _layout_text(layout: dict) -> str:
    w = layout["world_size"]
    pp = layout.get("pp_size", 1)
    s = w // pp  # the ranks a stage is sharded over
    tp, cp = layout.get("tp_size", 1), layout.get("cp_size", 1)
    split = (f"TP {tp}" + (" + SP" if layout.get("sequence_parallel") else "") if tp > 1 else "",
             f"CP {cp}" if cp > 1 else "")
    model_parallel = " x ".join(p for p in split if p)
    if model_parallel:
        dp = s // (tp * cp)
        inner = (f"{model_parallel} x " + (f"EP {layout['ep_size']} (ETP {layout.get('etp_size', 1)}, expert-DP "
                                            f"{s // layout['ep_size']}), dense DP {dp}" if layout["strategy"] == "ep"
                                            else f"FSDP {dp}"))
    elif layout["strategy"] == "hsdp":
        inner = f"HSDP {layout['replicate']} x {s // layout['replicate']}"
    elif layout["strategy"] in ("ep", "ep_fsdp"):
        extra = " + FSDP of the dense part" if layout["strategy"] == "ep_fsdp" else ""
        inner = f"EP {layout['ep_size']} x expert-DP {s // layout['ep_size']}{extra}"
    else:
        inner = "FSDP"
    if pp == 1:
        return f"{inner} on {w} ranks"
    virtual = f", {layout['stages_per_rank']} virtual stages per rank" if layout["stages_per_rank"] > 1 else ""
    return f"PP {pp}{virtual} x {inner} on {w} ranks ({s} per stage)"


def format_table(report: dict) -> str:
    """The report as a few readable lines and a per-rank summary table."""
    m, c, t = report["model"], report["checkpoint"], report["time"]
    a = t["assumptions"]
    lines = [
        f"{m['name']} ({m['model_type']}, {m['parameters'] / 1e9:.1f} B parameters): "
        f"{_layout_text(report['layout'])}, device {report['layout']['device']}",
        f"checkpoint: {format_bytes(c['bytes'])} in {c['files']} files, {c['tensors']} tensors "
        f"(dtype {report['export']['dtype'] or m['dtype']}, max_shard_size {report['export']['max_shard_size']})",
        "",
        f"{'per rank':<34}{'min':>12}{'mean':>12}{'max':>12}  max rank",
    ]
    labels = dict(bytes="bytes to write", runs="byte runs (pwrite streams)", files_owned="files owned (headers)",
                  files_written="files written into", header_bytes="header bytes",
                  staged_bytes="bytes through staging", staging_peak_bytes="peak staging memory",
                  replica_bytes_checked="replica check: bytes read",
                  replica_allreduce_bytes="replica check: all-reduce bytes")
    if report["summary"]["row_exchanges"]["max"]:
        labels.update(exchanged_bytes="TP row exchange: bytes sent", row_exchanges="TP row exchange: all-to-alls",
                      exchange_peak_bytes="TP row exchange: peak buffers")
    for field, label in labels.items():
        s = report["summary"][field]
        as_bytes = field.endswith("bytes") or field.endswith("bytes_checked")
        fmt = format_bytes if as_bytes else (lambda v: f"{v:.1f}" if isinstance(v, float) else str(v))
        lines.append(f"{label:<34}{fmt(s['min']):>12}{fmt(s['mean']):>12}{fmt(s['max']):>12}  {s['max_rank']}")
    checks = report["checks"]
    bytes_spread = report["summary"]["bytes"]["max_over_mean"]
    lines += [
        "",
        f"max/mean rank bytes {bytes_spread}; ranks writing nothing: {report['ranks_writing_nothing']}; "
        f"rank 0 also writes the index ({format_bytes(c['index_bytes'])})",
        f"validate: coverage all-reduce {format_bytes(report['validate']['coverage_allreduce_bytes'])} per rank",
        f"predicted export time: {t['seconds']:.1f} s at {format_bytes(a['node_bandwidth'])}/s per node, "
        f"{a['ranks_per_node']} ranks per node ({t['nodes']} nodes): write {t['write_s']:.1f} s, replica check "
        f"{t['replica_check_s']:.2f} s, plan + shares {t['validate_compute_s']:.2f} s, coverage {t['coverage_s']:.2f} s, "
        f"agreements {t['agreements_s']:.2f} s" + (f", row exchange {t['row_exchange_s']:.2f} s"
                                                     if t.get("row_exchange_s") else "")
        + f"; coordination {t['coordination_s']:.2f} s ({100 * t['coordination_share']:.0f}%)",
        f"checks: every element has one writer: {_yes(checks['every_element_one_writer'])}; boxes tile every "
        f"tensor: {_yes(checks['boxes_tile_exactly'])}; rank bytes sum to the checkpoint: "
        f"{_yes(checks['rank_bytes_sum_to_checkpoint'])}; plan digest identical on every rank: "
        f"{_yes(checks['plan_digest_identical'])}",
    ]
    if "pipeline" in report:
        lines += _pipeline_lines(report["pipeline"])
    if "mmlu" in report:
        mm = report["mmlu"]
        lines.append(f"MMLU: {mm['questions']} questions, {mm['rows']} rows, {mm['batches']} forwards "
                     f"(tokens_per_batch {mm['tokens_per_batch']}, {mm['shared_prefixes']} shared prefixes)")
        for policy, p in mm["policies"].items():
            lines.append(f"  {policy:<10} {p['steps']} steps on every rank, {p['shards']} shards; rows per rank "
                         f"min {p['rows_min']} mean {p['rows_mean']:.1f} max {p['rows_max']} "
                         f"(rows computed in all: {p['rows_total']})")
    return "\n".join(lines)


def _pipeline_lines(p: dict) -> list[str]:
    """Per pipeline rank (its stages together), the ends' imbalance, the MTP layer and the stage collectives."""
    lines = ["", f"pipeline: {p['stages']} stages ({p['layers_per_stage']} layers), {p['ranks_per_stage']} ranks per "
             "stage", f"{'pp rank':<9}{'stages':<14}{'ranks':<12}{'bytes':>11}{'max/rank':>11}{'files':>7}{'write s':>9}"]
    for r in p["per_pipeline_rank"]:
        stages = ",".join(str(s) for s in r["stages"])
        seconds = "" if r["write_s"] is None else f"{r['write_s']:.2f}"
        lines.append(f"{r['pp_rank']:<9}{stages:<14}{r['ranks']:<12}{format_bytes(r['bytes']):>11}"
                     f"{format_bytes(r['max_rank_bytes']):>11}{r['files_touched']:>7}{seconds:>9}")
    i = p["imbalance"]
    lines.append(f"first stage {i['first_stage_over_mean']}x the mean stage ({', '.join(i['first_stage_ends'])}), last "
                 f"{i['last_stage_over_mean']}x ({', '.join(i['last_stage_ends'])}); heaviest pipeline rank "
                 f"{i['heaviest_pipeline_rank']} ({format_bytes(i['heaviest_rank_bytes'])} on its busiest rank)")
    if p["mtp"]:
        m = p["mtp"]
        lines.append(f"MTP layer ({m['layers']}): {format_bytes(m['bytes'])}, not in the stage bytes: written as "
                     f"pass-through, {format_bytes(m['per_rank_as_passthrough'])} per rank; on the last stage it "
                     f"would add {format_bytes(m['per_last_stage_rank_if_held_there'])} per rank")
    c = p["collectives"]
    if c:
        lines.append(f"stage work: peers' group {c['stage_group_setup_s']:.2f} s, pipeline ranks gather "
                     f"{c['pipeline_ranks_gather_s']:.2f} s, catalogue merge {c['catalogue_merge_s']:.2f} s, "
                     f"validate stages {c['validate_stages_s']:.2f} s")
    return lines


def _yes(value: Any) -> str:
    return {True: "yes", False: "NO", None: "not checked (boxes not 1-D)"}[value]
