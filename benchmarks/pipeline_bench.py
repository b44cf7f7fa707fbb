"""Pipeline parallelism side by side with the layouts without it: export, MMLU, MMLU policies under EP.

One run, on CPU ranks (gloo), on one DeepSeek-V3-style model (``mmlu_bench.build_model`` of the
size flags; the default is about 66 MB in fp32, so the disk's share of the export is visible). Every
rank builds the same weights (seeded) and shards copies of them with the recipe's own functions
(``job.trainer.shard_model`` without PP, ``job.pipelined.shard_pipelined`` with PP: mesh
``("pp", ...)`` with "pp" outermost, stages from ``split_stages``, the strategy applied inside each
stage). All layouts live in the same spawned ranks at once, and their runs are interleaved, each
repeat starting at another layout, so a shared host's drifting load hits them alike.

1. **Export** (``export_hf_checkpoint``, no gather): ``fsdp`` = FSDP2 over every rank (mesh
   ``("dp_shard",)``) vs ``pp2_fsdp`` = 2 pipeline stages x FSDP2 inside each (mesh
   ``("pp", "dp_shard")``; the stage modules exported with their ``pp_group``). Per layout: the
   export's seconds (slowest rank, disk quiesced and ranks lined up before, ``export_methods.
   measured_run``; median of ``--repeat``, each into a fresh directory), the export's own
   ``step_seconds`` (per step the slowest rank, median over repeats), bytes each rank wrote
   (``ExportResult.rank_bytes_written``: max, mean, all, and whether they add up to the
   checkpoint's bytes, i.e. each byte written once); and the two checkpoints compared byte for byte
   (every file; the export id each export stamps into its headers and index is the one expected
   difference, so each file is compared with its export's id replaced by a placeholder of equal
   length).
2. **MMLU with and without PP** (``evaluate_mmlu`` on ``mmlu_bench``'s MMLU-shaped workload and
   word-level tokenizer; full prompts, ``shared_prefix=False``, since pipeline stages keep no KV
   cache; fixed batches of ``--batch-size`` rows, ``tokens_per_batch=0``, so every layout runs the
   same global batches): ``fsdp_dp{W}`` the unsplit model under FSDP2 on every rank vs
   ``pp2_fsdp_mb{M}`` the 2-stage model under FSDP2 (DP = W/2) with ``M`` microbatches per forward
   (``PipelinedCausalLM.n_microbatches``, one wrapper per count over the same sharded stages), with
   the theoretical bubble ``(stages - 1) / (M + stages - 1)`` beside each, and the ratio to
   ``fsdp_dp{W}`` (median of per-repeat ratios; they ran back to back).
3. **MMLU policies under EP**: ``ep{E}_{policy}`` expert parallelism over E = W/2 ranks without PP
   (``init_expert_parallel(E)`` + ``apply_expert_parallel``: DP = W, expert-DP = 2) vs
   ``pp2_ep{E}_{policy}`` 2 stages x EP over each stage's E ranks (mesh ``("pp", "edp", "ep")``
   with edp = 1: DP = 2, expert-DP = 1; ``--pp-ep-microbatches``), for ``lockstep`` and
   ``expert_dp``, with ``lockstep_speedup_over_expert_dp_x`` = expert_dp seconds / lockstep seconds
   (median of per-repeat ratios).

Every MMLU variant's predictions are compared with ``fsdp_dp{W}``'s (``mmlu_bench.agreement``:
same predictions, largest loglikelihood difference). Each figure's unit is in its key name
(``_seconds``, ``_bytes``, ``_per_s``, ``_x`` for ratios, ``_fraction``). Prints one JSON object;
``--out FILE`` also writes it. CPU only (``--device cuda`` is not supported).

    OMP_NUM_THREADS=1 python benchmarks/pipeline_bench.py --world-size 4 --repeat 3
    # quick: a small model and a few questions
    python benchmarks/pipeline_bench.py --world-size 4 --repeat 1 --hidden 64 --moe-inter 64 \\
        --experts 8 --questions-per-subject 1 --max-questions 16 --microbatches 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

from export_methods import measured_run  # noqa: E402
from mmlu_bench import K_SHOT, agreement, build_model, build_tokenizer, workload_stats, write_workload  # noqa: E402

PP_STAGES = 2
PARTS = ("export", "mmlu", "ep")


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a forward-only GPipe schedule: ``(stages - 1) / (microbatches + stages - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


def _layouts(base: Any, world: int, args: argparse.Namespace, parts: set[str]) -> dict[str, dict[str, Any]]:
    """Every layout the requested parts need, each a sharded copy of ``base``; built in the same
    order on every rank (each builds process groups: collectives over the world)."""
    from nemo_moe_export.config import ParallelConfig
    from nemo_moe_export.pipeline import PipelinedCausalLM
    from nemo_moe_export.job.pipelined import shard_pipelined
    from nemo_moe_export.job.trainer import _shard_other_dtype_modules, shard_model

    ep = world // PP_STAGES
    out: dict[str, dict[str, Any]] = {}
    if parts & {"export", "mmlu"}:
        model, layout = shard_model(copy.deepcopy(base), ParallelConfig(strategy="fsdp"))
        out["fsdp"] = dict(model=model, layout=layout, mesh={"dp_shard": world})
        cfg = ParallelConfig(strategy="fsdp", pp_size=PP_STAGES, microbatches=args.microbatches[0])
        wrapper, layout = shard_pipelined(base, cfg, world, shard_other_dtypes=_shard_other_dtype_modules)
        wrappers = {m: wrapper if m == wrapper.n_microbatches else
                    PipelinedCausalLM(list(wrapper.parts), wrapper.stage_ids, wrapper.n_stages,
                                      wrapper.pipeline_group, m) for m in args.microbatches}
        out["pp2_fsdp"] = dict(model=wrapper, wrappers=wrappers, layout=layout,
                               mesh={"pp": PP_STAGES, "dp_shard": world // PP_STAGES})
    if "ep" in parts:
        model, layout = shard_model(copy.deepcopy(base), ParallelConfig(strategy="ep", ep_size=ep))
        out["ep"] = dict(model=model, layout=layout, mesh={"edp": world // ep, "ep": ep})
        cfg = ParallelConfig(strategy="ep", ep_size=ep, pp_size=PP_STAGES, microbatches=args.pp_ep_microbatches)
        wrapper, layout = shard_pipelined(base, cfg, world)
        out["pp2_ep"] = dict(model=wrapper, layout=layout, mesh={"pp": PP_STAGES, "edp": 1, "ep": ep})
    return out


# --------------------------------------------------------------------------------------------------
# 1. Export
# --------------------------------------------------------------------------------------------------


def _exports(layouts: dict[str, Any], args: argparse.Namespace, root: str) -> dict[str, list[dict[str, Any]]]:
    """Each export layout ``--repeat`` times, alternating which goes first, each into a fresh
    directory; the first repeat's checkpoints are kept (compared by the parent), the others removed."""
    import torch.distributed as dist

    from nemo_moe_export.export import export_hf_checkpoint

    rank = dist.get_rank()

    def export(name: str, path: str) -> Any:
        entry = layouts[name]
        if name == "fsdp":
            return export_hf_checkpoint(path, entry["model"], max_shard_size=args.shard_size, timeout_s=600)
        wrapper = entry["model"]
        return export_hf_checkpoint(path, list(wrapper.parts), pp_group=wrapper.pipeline_group,
                                    max_shard_size=args.shard_size, timeout_s=600)

    runs: dict[str, list[dict[str, Any]]] = {"fsdp": [], "pp2_fsdp": []}
    for repeat in range(args.repeat):
        order = ["fsdp", "pp2_fsdp"] if repeat % 2 == 0 else ["pp2_fsdp", "fsdp"]
        for name in order:
            if rank == 0:
                print(f"[pipeline_bench] export {repeat + 1}/{args.repeat}: {name}", file=sys.stderr, flush=True)
            path = os.path.join(root, f"{name}-{repeat}")
            result, seconds, rss_mib, _ = measured_run(lambda: export(name, path), cuda=False)
            runs[name].append(dict(seconds=seconds, export_seconds=result.seconds,
                                   step_seconds=dict(result.step_seconds),
                                   rank_bytes_written=result.rank_bytes_written,
                                   checkpoint_bytes=result.checkpoint_bytes, files=result.files,
                                   tensors=result.tensors, peak_rss_growth_mib=rss_mib, path=path))
        dist.barrier()
        if rank == 0 and repeat > 0:
            for name in order:
                shutil.rmtree(os.path.join(root, f"{name}-{repeat}"), ignore_errors=True)
    return runs


def _export_id(path: str) -> str | None:
    """The export id a checkpoint's files carry in their safetensors header metadata."""
    from nemo_moe_export.safetensors_format import EXPORT_ID_KEY

    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                meta = json.loads(f.read(size)).get("__metadata__") or {}
            if EXPORT_ID_KEY in meta:
                return meta[EXPORT_ID_KEY]
    return None


def compare_checkpoints(a: str, b: str) -> dict[str, Any]:
    """Every file of two checkpoints byte for byte, each export's own id (stamped into its headers
    and index) replaced by a placeholder of its length first; also the tensor data alone."""
    id_a, id_b = _export_id(a), _export_id(b)
    files_a, files_b = sorted(os.listdir(a)), sorted(os.listdir(b))
    differing, compared, ids_replaced = [], 0, 0
    for name in sorted(set(files_a) & set(files_b)):
        with open(os.path.join(a, name), "rb") as f:
            data_a = f.read()
        with open(os.path.join(b, name), "rb") as f:
            data_b = f.read()
        if data_a != data_b and id_a and id_b and len(id_a) == len(id_b):
            ids_replaced += data_a.count(id_a.encode())
            data_a = data_a.replace(id_a.encode(), b"#" * len(id_a))
            data_b = data_b.replace(id_b.encode(), b"#" * len(id_b))
        compared += len(data_a)
        if data_a != data_b:
            differing.append(name)
    only = sorted(set(files_a) ^ set(files_b))
    return {"equal": not differing and not only, "files": len(files_a),
            "files_compared": len(set(files_a) & set(files_b)),
            "bytes_compared": compared, "differing_files": differing, "files_in_one_only": only,
            "export_ids": [id_a, id_b], "export_id_occurrences_replaced": ids_replaced}


# --------------------------------------------------------------------------------------------------
# 2 and 3. MMLU
# --------------------------------------------------------------------------------------------------


def _mmlu_variants(layouts: dict[str, Any], world: int, args: argparse.Namespace, parts: set[str]
                   ) -> list[list[tuple[str, str, Any, dict[str, Any]]]]:
    """Groups of (variant, layout name, model, overrides); a group's members run back to back."""
    groups: list[list[tuple[str, str, Any, dict[str, Any]]]] = []
    if "mmlu" in parts:
        group = [(f"fsdp_dp{world}", "fsdp", layouts["fsdp"]["model"], {})]
        group += [(f"pp2_fsdp_mb{m}", "pp2_fsdp", w, {}) for m, w in layouts["pp2_fsdp"]["wrappers"].items()]
        groups.append(group)
    if "ep" in parts:
        ep = world // PP_STAGES
        for name, prefix in (("ep", f"ep{ep}"), ("pp2_ep", f"pp2_ep{ep}")):
            groups.append([(f"{prefix}_{policy}", name, layouts[name]["model"], {"policy": policy})
                           for policy in ("lockstep", "expert_dp")])
    return groups


def _run_order(groups: list[list[Any]], repeat: int, repeats: int) -> list[Any]:
    """Repeat ``repeat``'s order: groups rotated, each group reversed on odd repeats."""
    start = repeat * len(groups) // repeats
    return [v for group in groups[start:] + groups[:start] for v in (group[::-1] if repeat % 2 else group)]


def _mmlu(layouts: dict[str, Any], world: int, args: argparse.Namespace, parts: set[str], data_dir: str,
          tok: Any, phases: dict[str, float]) -> dict[str, Any]:
    import torch.distributed as dist

    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu, phase_coordinator
    from nemo_moe_export.evaluate.prepare import prepare_questions

    rank = dist.get_rank()
    loaded = load_mmlu(data_dir)
    test, dev = [q for q in loaded if q.split == "test"], [q for q in loaded if q.split == "dev"]
    if args.max_questions:
        test = test[:: max(1, len(test) // args.max_questions)][: args.max_questions]  # spread over subjects
    prepared = prepare_questions(tok, test, dev, k_shot=K_SHOT, max_length=4096, vocab_size=len(tok))
    warm = prepare_questions(tok, test[: args.warmup_questions], dev, k_shot=K_SHOT, max_length=4096,
                             vocab_size=len(tok)) if args.warmup_questions else None
    groups = _mmlu_variants(layouts, world, args, parts)
    names = sorted({layout for group in groups for _, layout, _, _ in group}, key=list(layouts).index)
    coordinators = {name: phase_coordinator(layouts[name]["layout"], timeout_s=900) for name in names}
    options = dict(tokens_per_batch=0, batch_size=args.batch_size, shared_prefix=False, progress=False)

    def evaluate(layout: str, model: Any, questions: Any, overrides: dict[str, Any]) -> Any:
        return evaluate_mmlu(model, tok, questions, layout=layouts[layout]["layout"],
                             coordinator=coordinators[layout], **options, **overrides)

    phases["mmlu_setup"] = time.perf_counter()
    for group in groups if warm is not None else ():
        for _, layout, model, overrides in group:
            evaluate(layout, model, warm, overrides)
    phases["mmlu_warmup"] = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    scores: dict[str, Any] = {}
    for repeat in range(args.repeat):
        for variant, layout, model, overrides in _run_order(groups, repeat, args.repeat):
            if rank == 0:
                print(f"[pipeline_bench] mmlu {repeat + 1}/{args.repeat}: {variant}", file=sys.stderr, flush=True)
            dist.barrier()
            started = time.perf_counter()
            result = evaluate(layout, model, prepared, overrides)
            dist.barrier()
            seconds = time.perf_counter() - started
            scores[variant] = [r["scores"] for r in result.records]
            runs.setdefault(variant, []).append(dict(
                seconds=seconds, steps=result.steps, policy=result.policy, layout=layout,
                dp_size=layouts[layout]["layout"].dp.size, edp_size=layouts[layout]["layout"].edp.size,
                ep_size=layouts[layout]["layout"].ep.size, pp_size=layouts[layout]["layout"].pp.size,
                microbatches=getattr(model, "n_microbatches", None), fed_tokens=result.padding["fed_tokens"],
                real_tokens=result.padding["real_tokens"], shared_prefix=result.scoring.get("shared_prefix"),
                batches=result.scoring.get("batches")))
    return {"runs": runs, "scores": scores if rank == 0 else None,
            "workload": workload_stats(prepared) if rank == 0 else None}


# --------------------------------------------------------------------------------------------------
# The worker (every rank)
# --------------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, args: argparse.Namespace, data_dir: str, tok_dir: str, export_root: str
            ) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    phases = {"start": time.perf_counter()}
    parts = set(args.parts)
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    base = build_model(args, len(tok), "cpu")  # the same weights on every rank (seeded)
    model_info = {"parameters": sum(p.numel() for p in base.parameters()),
                  "parameter_bytes": sum(p.numel() * p.element_size() for p in base.parameters()),
                  "vocab_size": base.config.vocab_size, "model_type": base.config.model_type}
    phases["model"] = time.perf_counter()
    layouts = _layouts(base, world, args, parts)
    phases["layouts"] = time.perf_counter()
    out: dict[str, Any] = {"rank": rank, "model": model_info,
                           "meshes": {name: entry["mesh"] for name, entry in layouts.items()}}
    if "export" in parts:
        out["export"] = _exports(layouts, args, export_root)
        phases["export"] = time.perf_counter()
    if parts & {"mmlu", "ep"}:
        out["mmlu"] = _mmlu(layouts, world, args, parts, data_dir, tok, phases)
        phases["mmlu"] = time.perf_counter()
    names = list(phases)
    out["phase_seconds"] = {f"{b}_seconds": round(phases[b] - phases[a], 3) for a, b in zip(names, names[1:])}
    return out


# --------------------------------------------------------------------------------------------------
# Report (the parent)
# --------------------------------------------------------------------------------------------------


def _median_ratio(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> float:
    return statistics.median(n["seconds"] / d["seconds"] for n, d in zip(num, den))


def _export_report(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, mesh in (("fsdp", ranks[0]["meshes"]["fsdp"]), ("pp2_fsdp", ranks[0]["meshes"]["pp2_fsdp"])):
        per_rank = [r["export"][name] for r in ranks]  # [rank][repeat]
        repeats = len(per_rank[0])
        seconds = [max(per_rank[r][i]["seconds"] for r in range(len(ranks))) for i in range(repeats)]
        steps = list(dict.fromkeys(s for runs in per_rank for run in runs for s in run["step_seconds"]))
        step_seconds = {s: statistics.median(max(per_rank[r][i]["step_seconds"].get(s, 0.0) for r in range(len(ranks)))
                                             for i in range(repeats)) for s in steps}
        written = [per_rank[r][0]["rank_bytes_written"] for r in range(len(ranks))]
        checkpoint = per_rank[0][0]["checkpoint_bytes"]
        out[name] = {
            "mesh": mesh, "export_seconds_median": statistics.median(seconds),
            "export_seconds_all": [round(s, 4) for s in seconds],
            "export_own_seconds_median": statistics.median(
                max(per_rank[r][i]["export_seconds"] for r in range(len(ranks))) for i in range(repeats)),
            "step_seconds_median": step_seconds,
            "checkpoint_bytes": checkpoint, "files": per_rank[0][0]["files"], "tensors": per_rank[0][0]["tensors"],
            "rank_bytes_written_max": max(written), "rank_bytes_written_mean": statistics.mean(written),
            "rank_bytes_written_all": written,
            "rank_bytes_written_sum_equals_checkpoint_bytes": all(
                sum(per_rank[r][i]["rank_bytes_written"] for r in range(len(ranks))) == checkpoint
                for i in range(repeats)),
            "checkpoint_mb_per_s": checkpoint / 1e6 / statistics.median(seconds),
            "peak_rss_growth_mib_max": max(run["peak_rss_growth_mib"] for runs in per_rank for run in runs),
        }
    fsdp_runs = [max(r["export"]["fsdp"][i]["seconds"] for r in ranks) for i in range(len(ranks[0]["export"]["fsdp"]))]
    pp_runs = [max(r["export"]["pp2_fsdp"][i]["seconds"] for r in ranks) for i in range(len(fsdp_runs))]
    out["pp2_fsdp_vs_fsdp_export_seconds_x"] = statistics.median(p / f for p, f in zip(pp_runs, fsdp_runs))
    out["pp2_fsdp_vs_fsdp_rank_bytes_written_max_x"] = (out["pp2_fsdp"]["rank_bytes_written_max"]
                                                        / out["fsdp"]["rank_bytes_written_max"])
    out["checkpoints_compared"] = compare_checkpoints(ranks[0]["export"]["fsdp"][0]["path"],
                                                      ranks[0]["export"]["pp2_fsdp"][0]["path"])
    return out


def _variant_summary(runs: list[dict[str, Any]], questions: int) -> dict[str, Any]:
    seconds = statistics.median(r["seconds"] for r in runs)
    first = runs[0]
    return {"questions_per_s": questions / seconds, "seconds_median": seconds,
            "seconds_all": [round(r["seconds"], 4) for r in runs], "policy": first["policy"],
            "dp_size": first["dp_size"], "edp_size": first["edp_size"], "ep_size": first["ep_size"],
            "pp_stages": first["pp_size"], "microbatches": first["microbatches"], "steps": first["steps"],
            "batches": first["batches"], "fed_tokens": first["fed_tokens"], "real_tokens": first["real_tokens"],
            "shared_prefix": first["shared_prefix"]}


def _mmlu_report(rank0: dict[str, Any], world: int, args: argparse.Namespace) -> dict[str, Any]:
    runs, scores, work = rank0["runs"], rank0["scores"], rank0["workload"]
    entries = {name: _variant_summary(r, work["questions"]) for name, r in runs.items()}
    out: dict[str, Any] = {"workload": work, "batch_size_rows": args.batch_size, "tokens_per_batch": 0,
                           "shared_prefix": False, "k_shot": K_SHOT}
    reference = f"fsdp_dp{world}" if f"fsdp_dp{world}" in entries else sorted(entries)[0]
    if f"fsdp_dp{world}" in entries:
        pp = {}
        for name, entry in entries.items():
            if name.startswith("pp2_fsdp_mb"):
                entry["bubble_fraction_theoretical"] = bubble_fraction(PP_STAGES, entry["microbatches"])
                entry["vs_fsdp_dp_questions_per_s_x"] = _median_ratio(runs[reference], runs[name])
                pp[name] = entry
        out["pp_vs_no_pp"] = {"reference": reference, reference: entries[reference], **pp}
    ep = world // PP_STAGES
    if f"ep{ep}_lockstep" in entries:
        section: dict[str, Any] = {"ep_size": ep}
        for prefix in (f"ep{ep}", f"pp2_ep{ep}"):
            lock, edp = f"{prefix}_lockstep", f"{prefix}_expert_dp"
            section[lock], section[edp] = entries[lock], entries[edp]
            section[f"{prefix}_lockstep_speedup_over_expert_dp_x"] = _median_ratio(runs[edp], runs[lock])
        out["policies_under_ep"] = section
    agree = {name: {k: v for k, v in agreement(scores[name], scores[reference]).items() if k != "disagreements"}
             for name in scores if name != reference}
    out["predictions"] = {"reference": reference, "questions": work["questions"], "variants": agree,
                          "all_equal": all(a["same_predictions"] == a["questions"] for a in agree.values()),
                          "scores": scores}  # per variant and question: agreement is judged on these
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="CPU ranks (gloo); even: 2 stages x W/2")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="export: FSDP2 vs PP2 x FSDP2; mmlu: the same under MMLU; ep: the policies under EP")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="PipelinedCausalLM n_microbatches measured for PP2 x FSDP2")
    parser.add_argument("--pp-ep-microbatches", type=int, default=2 * PP_STAGES,
                        help="microbatches of PP2 x EP (the recipe's default: twice the stages)")
    parser.add_argument("--questions-per-subject", type=int, default=4, help="57 subjects")
    parser.add_argument("--max-questions", type=int, default=0, help="evaluate only this many (spread), 0: all")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per MMLU forward (tokens_per_batch=0)")
    parser.add_argument("--warmup-questions", type=int, default=8,
                        help="questions every MMLU variant evaluates once before the timed runs (0: none)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--experts", type=int, default=24)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--init-range", type=float, default=0.5, help="larger than 0.02: answers depend on the input")
    parser.add_argument("--shard-size", default="16MB", help="the export's max_shard_size")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temp dir)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    args.model_preset, args.device = None, "cpu"  # what mmlu_bench.build_model reads
    ep = args.world_size // PP_STAGES
    if args.world_size < 2 * PP_STAGES or args.world_size % PP_STAGES:
        parser.error(f"--world-size must be a multiple of {PP_STAGES} (pipeline stages), at least {2 * PP_STAGES}")
    if "ep" in args.parts and args.experts % ep:
        parser.error(f"--experts ({args.experts}) must divide by the EP size {ep} (world / {PP_STAGES})")
    if args.layers < PP_STAGES:
        parser.error(f"--layers must be at least {PP_STAGES}")
    return args


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    """The benchmark: spawn the ranks, measure, return the JSON object (also written to ``--out``)."""
    import torch
    import transformers

    from nemo_moe_export.spawn import spawn

    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as tmp, \
            tempfile.TemporaryDirectory(prefix="pipeline-bench-ckpt-", dir=args.dir) as export_root:
        data_dir, tok_dir = os.path.join(tmp, "data"), os.path.join(tmp, "tok")
        write_workload(data_dir, args.questions_per_subject, args.seed)
        build_tokenizer(tok_dir)
        ranks = spawn(_worker, args.world_size, args, data_dir, tok_dir, export_root, timeout_s=7200,
                      pg_timeout_s=900, threads_per_rank=args.threads_per_rank)
        exported = _export_report(ranks) if "export" in args.parts else None  # reads the checkpoints
    world = args.world_size
    config = {k: v for k, v in vars(args).items() if k not in ("model_preset", "device")}
    report: dict[str, Any] = {
        "benchmark": "pipeline",
        "command": shlex.join([sys.executable, os.path.relpath(os.path.abspath(__file__)),
                               *(sys.argv[1:] if argv is None else argv)]),
        "world_size": world, "pp_stages": PP_STAGES, "ep_size": world // PP_STAGES, "cpu_cores": os.cpu_count(),
        "threads_per_rank": args.threads_per_rank, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__, "device": "cpu",
        "loadavg_before_1_5_15min": list(load_before), "loadavg_after_1_5_15min": list(os.getloadavg()),
        "wall_seconds": time.perf_counter() - started,
        "sizes": {"hidden": args.hidden, "moe_inter": args.moe_inter, "experts": args.experts, "layers": args.layers,
                  "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype, **ranks[0]["model"]},
        "meshes": ranks[0]["meshes"], "rank0_phase_seconds": ranks[0]["phase_seconds"], "config": config,
    }
    if exported is not None:
        report["export"] = exported
    if "mmlu" in ranks[0]:
        report["mmlu"] = _mmlu_report(ranks[0]["mmlu"], world, args)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(json.dumps(run(args, argv), indent=1))


if __name__ == "__main__":
    main()
