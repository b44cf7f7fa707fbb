"""GPU pipeline benchmark: the recipe's train -> MMLU -> export on one or more GPUs, then measured.

It runs ``recipes/deepseek_v3_gpu.yaml`` (an 8.9 GB bf16 DeepSeek-V3-style MoE; one GPU per rank,
NCCL) through ``run_recipe`` exactly as the CLI does, and on the trained, still sharded model:

1. checks the recipe's export: every rank compares its shards with the bytes on disk
   (``compare_with_shards``), and rank 0 loads the directory with ``transformers``
   ``from_pretrained`` on its GPU, compares logits with the sharded model's on the same batch, and
   re-runs the MMLU evaluation on the loaded model; then the same for an FP8 export of the trained
   model loaded by transformers' own FP8 support (``fp8_export_check``);
2. times MMLU with each evaluation policy (``expert_dp`` and the default ``lockstep``) on the same
   questions and requires identical predictions; compares the recipe's shared-prefix predictions
   with full prompts' on the trained model, question for question, each disagreement with its
   margin (``shared_prefix_agreement``);
3. times the exports side by side (``export_methods.py``): ours in bf16 (1 and 4 writer threads
   per rank) and in FP8 (both scale formats), gather + ``save_pretrained``, torch DCP +
   consolidation, and the raw disk (O_DIRECT, 1 and 4 threads per rank) with peak GPU and host
   memory per rank.

Prints one JSON object (and writes it to ``--out``). One command per configuration:

    python benchmarks/gpu_pipeline_bench.py --nproc 1                                   # 1 GPU, FSDP
    python benchmarks/gpu_pipeline_bench.py --nproc 2 parallel=ep model.n_experts=62   # 2 GPUs, EP=2
    python benchmarks/gpu_pipeline_bench.py --nproc 2                                   # 2 GPUs, FSDP 31/30
    # CPU smoke run of the same code (gloo, a small model):
    python benchmarks/gpu_pipeline_bench.py --nproc 2 parallel.device=cpu model=deepseek_v3_tiny \\
        model.dtype=bfloat16 trainer.max_steps=3 data.n_test=20

Trailing arguments are Hydra overrides of the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
from output import emit  # noqa: E402  (benchmarks/output.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECIPE = "deepseek_v3_gpu"
# Rank 0's compared logits and MMLU scores, saved with --comparisons: agreement of two inexact
# computations is judged where the reference decides it (tests/test_gpu_pipeline_bench.py).
COMPARED: dict[str, Any] = {}


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1, help="ranks (one GPU each)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--run-dir", default=None, help="default: a temp dir (removed at the end)")
    parser.add_argument("--methods", default="fp8,gather,dcp,raw_disk", help="export methods beside ours")
    parser.add_argument("--writer-threads", default="1,4", help="ours: pwrite threads per rank, comma-separated")
    parser.add_argument("--repeat", type=int, default=1, help="runs per export method and MMLU policy (median)")
    parser.add_argument("--policies", default="expert_dp,lockstep")
    parser.add_argument("--logits-batch", type=int, default=8)
    parser.add_argument("--comparisons", default=None,
                        help="rank 0 saves the compared logits and MMLU scores here (torch.save), for a test "
                             "to judge agreement where the reference decides it")
    args, overrides = parser.parse_known_args(argv)
    args.overrides = overrides
    return args


def _environment() -> dict[str, Any]:
    import torch
    import transformers

    env = dict(date=time.strftime("%Y-%m-%d"), python=platform.python_version(), torch=torch.__version__,
               transformers=transformers.__version__, cpu_cores=os.cpu_count(), host=platform.node())
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(),
                   cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    return env


def _gather_objects(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _logits_batch(ctx: Any, n: int) -> tuple[Any, Any]:
    """The first ``n`` held-out MMLU prompts, right-padded: one fixed batch every rank feeds."""
    import torch

    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.evaluate.prompts import build_prompt

    questions = load_mmlu(ctx.data_root, splits=("test",))[:n]
    encoded = [ctx.tokenizer(build_prompt(q, []))["input_ids"] for q in questions]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), ctx.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(encoded):
        ids[i, : len(e)], mask[i, : len(e)] = torch.tensor(e), 1
    return ids, mask


def _sharded_logits(ctx: Any, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(ids, mask, logits)`` of the trained, sharded model on one batch (every rank): what both
    reloads are compared with."""
    import torch

    device = next(ctx.model.parameters()).device
    ids, mask = _logits_batch(ctx, args.logits_batch)
    with torch.no_grad():
        return ids, mask, ctx.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()


def _check_export(ctx: Any, cfg: Any, logits: tuple[Any, Any, Any], trained_predictions: list[str]) -> dict[str, Any]:
    """Bytes equal the shards (every rank), then transformers loads it and the logits match (rank 0)."""
    import torch
    import torch.distributed as dist

    from nemo_moe_export.export import compare_with_shards

    path = ctx.results["export"]["path"]
    started = time.perf_counter()
    report = compare_with_shards(path, ctx.model)
    equality = dict(pieces_compared=report.compared, bytes_compared=report.tensor_bytes,
                    problems=report.problems[:5], seconds=round(time.perf_counter() - started, 2))
    per_rank = _gather_objects(equality)
    out: dict[str, Any] = {"tensor_equal_on_every_rank": all(not r["problems"] for r in per_rank),
                           "readback_per_rank": per_rank}

    device = next(ctx.model.parameters()).device
    ids, mask, sharded = logits
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        started = time.perf_counter()
        loaded, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.bfloat16,
                                                            device_map={"": device})
        load_seconds = time.perf_counter() - started
        loaded.eval()
        with torch.no_grad():
            reference = loaded(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        real = mask.to(device).bool()
        diff = (reference - sharded)[real]
        reloaded = _evaluate_alone(loaded, ctx, cfg)
        same = sum(a == b for a, b in zip(reloaded.predictions, trained_predictions))
        out.update(
            load_seconds=round(load_seconds, 2),
            missing_keys=len(info["missing_keys"]), unexpected_keys=len(info["unexpected_keys"]),
            mismatched_keys=len(info["mismatched_keys"]),
            logits_max_abs_diff=float(diff.abs().max()),
            logits_rel_l2=float(diff.norm() / reference[real].norm()),
            logits_exactly_equal=bool(torch.equal(reference, sharded)),
            argmax_agreement=float((reference.argmax(-1) == sharded.argmax(-1))[real].float().mean()),
            reloaded_mmlu_same_predictions=f"{same}/{len(trained_predictions)}",
            reloaded_accuracy=reloaded.metrics["overall"]["acc"],
        )
        COMPARED.update(mask=mask, sharded_logits=sharded.cpu(), bf16_reload_logits=reference.cpu(),
                        bf16_reload_mmlu_scores=[r["scores"] for r in reloaded.records])
        del loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    return out


def _evaluate_alone(model: Any, ctx: Any, cfg: Any) -> Any:
    """The recipe's MMLU evaluation of a model loaded on this rank alone (rank 0's reloads)."""
    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.parallel import ParallelLayout, RankGroup

    alone = RankGroup.alone()
    questions = load_mmlu(ctx.data_root, splits=("dev", "test"))
    return evaluate_mmlu(model, ctx.tokenizer, [q for q in questions if q.split == "test"],
                         [q for q in questions if q.split == "dev"],
                         layout=ParallelLayout(dp=alone, ep=alone, edp=alone, source="world"),
                         k_shot=cfg.mmlu.k_shot, batch_size=cfg.mmlu.batch_size,
                         tokens_per_batch=cfg.mmlu.tokens_per_batch, shared_prefix=cfg.mmlu.shared_prefix,
                         progress=False)


def _check_fp8_export(ctx: Any, cfg: Any, logits: tuple[Any, Any, Any],
                      trained_predictions: list[str]) -> dict[str, Any]:
    """The trained model exported in FP8 (every rank), loaded by transformers' own FP8 support on
    rank 0 (its FP8 kernels, or where they do not load, its dequantize-on-load path): logits
    against the sharded bf16 model on one batch, and the MMLU predictions against the trained model's."""
    import shutil

    import torch
    import torch.distributed as dist

    from nemo_moe_export.export import export_hf_checkpoint

    path = os.path.join(ctx.run_dir, "fp8_check")
    export_hf_checkpoint(path, ctx.model, max_shard_size=cfg.export.max_shard_size, quantize="fp8_block")
    device = next(ctx.model.parameters()).device
    ids, mask, sharded = logits
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM, FineGrainedFP8Config

        load = dict(dtype=torch.bfloat16, device_map={"": device})

        def load_and_forward(**quantization: Any) -> tuple[Any, Any]:
            model = AutoModelForCausalLM.from_pretrained(path, **quantization, **load).eval()
            with torch.no_grad():  # the FP8 kernels load at the first forward, not at from_pretrained
                return model, model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()

        try:
            loaded, got = load_and_forward()
            out["path"] = "fp8 kernels" if device.type == "cuda" else "dequantized on load (CPU)"
        except Exception as exc:  # no `kernels` package, no Hub access
            out["fp8_kernel_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if device.type == "cuda":
                torch.cuda.empty_cache()
            loaded, got = load_and_forward(quantization_config=FineGrainedFP8Config(dequantize=True))
            out["path"] = "dequantized on load"
        real = mask.to(device).bool()
        diff = (got - sharded)[real]
        evaluated = _evaluate_alone(loaded, ctx, cfg)
        same = sum(a == b for a, b in zip(evaluated.predictions, trained_predictions))
        out.update(logits_rel_l2=float(diff.norm() / sharded[real].norm()),
                   argmax_agreement=float((got.argmax(-1) == sharded.argmax(-1))[real].float().mean()),
                   mmlu_same_predictions=f"{same}/{len(trained_predictions)}",
                   mmlu_agreement=same / len(trained_predictions),
                   accuracy={"fp8": evaluated.metrics["overall"]["acc"]})
        COMPARED.update(fp8_reload_logits=got.cpu(), fp8_reload_mmlu_scores=[r["scores"] for r in evaluated.records])
        del loaded
        shutil.rmtree(path)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    return out


def _time_mmlu(ctx: Any, cfg: Any, policies: list[str], trained_predictions: list[str],
               repeat: int) -> dict[str, Any]:
    """Each policy on the same held-out questions, after a warm-up, ``repeat`` times (the median is
    reported); predictions must agree."""
    import torch
    import torch.distributed as dist

    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu, phase_coordinator
    from nemo_moe_export.evaluate.prepare import prepare_questions

    loaded = load_mmlu(ctx.data_root, splits=("dev", "test"))
    test, dev = [q for q in loaded if q.split == "test"], [q for q in loaded if q.split == "dev"]
    prepared = prepare_questions(ctx.tokenizer, test, dev, k_shot=cfg.mmlu.k_shot)
    coordinator = phase_coordinator(ctx.layout, timeout_s=cfg.mmlu.timeout_s)
    warm = prepare_questions(ctx.tokenizer, test[: 4 * cfg.mmlu.batch_size * dist.get_world_size()], dev,
                             k_shot=cfg.mmlu.k_shot)
    cuda = next(ctx.model.parameters()).is_cuda
    out: dict[str, Any] = {}
    predictions = {}
    for policy in policies:
        evaluate_mmlu(ctx.model, ctx.tokenizer, warm, layout=ctx.layout, batch_size=cfg.mmlu.batch_size,
                      tokens_per_batch=cfg.mmlu.tokens_per_batch, shared_prefix=cfg.mmlu.shared_prefix,
                      policy=policy, coordinator=coordinator, progress=False)
        runs = []
        for _ in range(repeat):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
            result = evaluate_mmlu(ctx.model, ctx.tokenizer, prepared, layout=ctx.layout,
                                   batch_size=cfg.mmlu.batch_size, tokens_per_batch=cfg.mmlu.tokens_per_batch,
                                   shared_prefix=cfg.mmlu.shared_prefix, policy=policy, coordinator=coordinator,
                                   progress=False)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            runs.append(time.perf_counter() - started)
        seconds = sorted(runs)[len(runs) // 2]
        predictions[policy] = result.predictions
        COMPARED[f"{policy}_mmlu_scores"] = [r["scores"] for r in result.records]
        out[policy] = dict(seconds=round(seconds, 3), runs_seconds=[round(r, 3) for r in runs],
                           questions=len(result.records), questions_per_s=round(len(result.records) / seconds, 2),
                           steps=result.steps, padding_waste=round(result.padding["waste"], 4),
                           accuracy=result.metrics["overall"]["acc"])
    out["shared_prefix_agreement"] = _prefix_agreement(ctx, cfg, test, dev, coordinator)
    first = predictions[policies[0]]
    out["predictions_identical_across_policies"] = all(p == first for p in predictions.values())
    out["predictions_identical_to_recipe_stage"] = first == trained_predictions
    out["predictions_identical_on_every_rank"] = all(p == first for p in _gather_objects(first))
    if "expert_dp" in out and "lockstep" in out:
        out["lockstep_over_expert_dp"] = round(out["expert_dp"]["seconds"] / out["lockstep"]["seconds"], 2)
    return out


def _prefix_agreement(ctx: Any, cfg: Any, test: list[Any], dev: list[Any], coordinator: Any) -> dict[str, Any]:
    """The trained model on the held-out questions 5-shot (the recipe trains 0-shot, where nothing is
    shared): shared prefixes against full prompts, question for question, with the margins."""
    from mmlu_bench import agreement

    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.evaluate.prepare import prepare_questions

    prepared = prepare_questions(ctx.tokenizer, test, dev, k_shot=5)
    runs = {}
    for shared in (True, False):
        started = time.perf_counter()
        runs[shared] = evaluate_mmlu(ctx.model, ctx.tokenizer, prepared, layout=ctx.layout, shared_prefix=shared,
                                     policy=cfg.mmlu.policy, coordinator=coordinator, progress=False)
        runs[shared].timing["bench_seconds"] = round(time.perf_counter() - started, 3)
    shared, full = runs[True], runs[False]
    COMPARED.update(shared_prefix_mmlu_scores=[r["scores"] for r in shared.records],
                    full_prompts_mmlu_scores=[r["scores"] for r in full.records])
    return dict(k_shot=5, prefix_attention=shared.scoring["prefix_attention"],
                seconds={"shared_prefix": shared.timing["bench_seconds"], "full_prompts": full.timing["bench_seconds"]},
                accuracy={"shared_prefix": shared.metrics["overall"]["acc"], "full_prompts": full.metrics["overall"]["acc"]},
                **agreement([r["scores"] for r in shared.records], [r["scores"] for r in full.records]))


def _measure(ctx: Any, cfg: Any, args: argparse.Namespace) -> None:
    import shutil

    import torch.distributed as dist

    from export_methods import measure_exports, summarize

    trained_predictions = ctx.results["mmlu_predictions"]
    bench: dict[str, Any] = {"environment": _environment()}
    logits = _sharded_logits(ctx, args)  # one forward of the trained model, compared with both reloads
    bench["export_check"] = _check_export(ctx, cfg, logits, trained_predictions)
    bench["fp8_export_check"] = _check_fp8_export(ctx, cfg, logits, trained_predictions)
    policies = [p for p in args.policies.split(",") if p]
    if dist.get_world_size() == 1:
        policies = [cfg.mmlu.policy]  # one rank: the policies plan the same single stream
    bench["mmlu"] = _time_mmlu(ctx, cfg, policies, trained_predictions, args.repeat)
    if dist.get_rank() == 0:  # room on the disk for the comparisons
        shutil.rmtree(ctx.results["export"]["path"], ignore_errors=True)
    dist.barrier()
    root = os.path.join(ctx.run_dir, "export_bench")
    os.makedirs(root, exist_ok=True)
    ranks = _gather_objects(measure_exports(
        ctx.model, root, methods=[m for m in args.methods.split(",") if m], repeat=args.repeat,
        shard_size=cfg.export.max_shard_size, writer_threads=tuple(int(t) for t in args.writer_threads.split(",")), raw_threads=(1, 4)))
    bench["export"] = summarize(ranks)
    ctx.results["measurements"] = bench
    if args.comparisons and dist.get_rank() == 0:
        import torch

        torch.save({**COMPARED, "trained_predictions": trained_predictions, "policies": policies}, args.comparisons)


def _rank_main(args: argparse.Namespace) -> None:
    from nemo_moe_export.job.compose import load_config
    from nemo_moe_export.job.stages import run_recipe

    cfg = load_config(RECIPE, [f"run_dir={args.run_dir}", *args.overrides])
    results = run_recipe(cfg, after=lambda ctx: _measure(ctx, cfg, args))
    if int(os.environ.get("RANK", "0")) == 0:
        from omegaconf import OmegaConf

        results.pop("mmlu_predictions", None)
        report = dict(benchmark="gpu_pipeline", recipe=RECIPE, overrides=args.overrides,
                      world_size=int(os.environ.get("WORLD_SIZE", "1")),
                      config={k: OmegaConf.to_container(cfg[k]) for k in ("model", "parallel", "trainer", "export")},
                      **results)
        with open(os.path.join(args.run_dir, "benchmark.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if "LOCAL_RANK" in os.environ:  # a rank started by torchrun
        _rank_main(args)
        return 0
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="nme-gpu-bench-")
    forwarded = [f"--run-dir={run_dir}", f"--methods={args.methods}", f"--repeat={args.repeat}",
                 f"--policies={args.policies}", f"--logits-batch={args.logits_batch}",
                 f"--writer-threads={args.writer_threads}",
                 *([f"--comparisons={os.path.abspath(args.comparisons)}"] if args.comparisons else []), *args.overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), *forwarded]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4"),
           "PYTHONPATH": os.pathsep.join([os.path.join(HERE, ".."), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    code = subprocess.call(cmd, env=env)
    path = os.path.join(run_dir, "benchmark.json")
    if code == 0 and os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
        report["wall_s"] = round(time.perf_counter() - started, 1)
        emit(report, args.out)
    if not args.run_dir:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
