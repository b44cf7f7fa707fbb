"""Run a recipe: ordered stages ``train -> mmlu -> export -> verify`` on every rank.

Data flow, from a recipe YAML to the bytes on disk:

0. ``checks`` : before any process group or model exists (``check_recipe``): the whole config
               (``job/checks.py``: stages, parallel layout against the world size and the
               expert count, paths that must exist), every stage's options (``MMLUOptions`` /
               ``ExportOptions`` built from the ``mmlu`` / ``export`` groups, so a bad value is
               refused here) and the export target (an existing one is refused with
               ``export.overwrite=error``, rather than after training).
1. ``setup``  : process group (under torchrun), ``run_dir``, the synthetic MMLU corpus (rank 0 writes
               it unless ``mmlu.data_path`` is given), the word-level tokenizer, the model built
               from ``model`` and sharded as ``parallel`` says (or restored from
               ``export.from_checkpoint``), and the hooks' ``on_setup``: the adapter hook builds
               the state-dict adapter into the context, where the export finds it.
2. ``train``  : ``job/trainer.py`` calls ``hooks.on_step_end(ctx, step)``: the MMLU callback
               evaluates every ``mmlu.every_n_steps``; a sharded torch DCP training checkpoint is
               saved to ``{run_dir}/checkpoint``.
3. ``mmlu``   : the MMLU callback's ``on_train_end(ctx)`` (``evaluate/``; skipped with
               ``mmlu.at_train_end=false``).
4. ``export`` : the export step's ``on_train_end(ctx)`` writes ``{run_dir}/hf`` (``export/``), no gather.
5. ``verify`` : ``verify_checkpoint`` from the bytes, then a fresh process reloads the checkpoint
               with ``transformers`` and re-evaluates MMLU; its accuracy must equal the trained
               model's.

Everything a run produces stays in ``run_dir``: config, logs, results JSON, checkpoints. The
hooks are the one protocol of ``nemo_moe_export.hooks`` (docs/design.md#hooks).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from nemo_moe_export.config import model_dtype
from nemo_moe_export.evaluate.agreement import coarsest_dtype, compare_answers
from nemo_moe_export.evaluate.callback import MMLUCallback
from nemo_moe_export.evaluate.options import MMLUOptions
from nemo_moe_export.evaluate.scoring import results_to_markdown
from nemo_moe_export.evaluate.task import Task, load_task
from nemo_moe_export.export import ExportStep, verify_checkpoint
from nemo_moe_export.export.config_json import CONFIG_FILE
from nemo_moe_export.export.options import ExportOptions, parse_dtype
from nemo_moe_export.hooks import HookList, RecipeContext
from nemo_moe_export.job.checks import check_config, check_export_target, export_target
from nemo_moe_export.job.data import build_tokenizer, write_synthetic_mmlu
from nemo_moe_export.job.foreign import convert_stage, foreign_format
from nemo_moe_export.job.trainer import build_sharded_model, train
from nemo_moe_export.megatron import MegatronCausalLM
from nemo_moe_export.megatron.checkpoint import load_training_checkpoint, save_training_checkpoint
from nemo_moe_export.parallel import dist_info, init_distributed, resolve_device
from nemo_moe_export.plugin import AdapterHook
from nemo_moe_export.serving.vllm_logprobs import check_with_vllm, vllm_python
from nemo_moe_export.watchdog import finished, report_job_failure, watch_job

__all__ = ["CheckedRecipe", "check_recipe", "run_recipe"]


@dataclass(frozen=True)
class CheckedRecipe:
    """A recipe's config, checked once on this rank, with every stage's hook built from it: the
    MMLU callback (None when ``mmlu.enabled`` is false) and the export step (None without the
    export stage). :func:`run_recipe` runs exactly this, so no option is parsed twice."""

    cfg: Any
    stages: list[str]
    run_dir: str
    mmlu_options: MMLUOptions  # also formats the training prompts (k_shot) when MMLU is off
    mmlu: MMLUCallback | None
    export: ExportStep | None
    foreign: str | None = None  # export.from_checkpoint's format when another framework saved it (job/foreign.py)


def check_recipe(cfg: Any, world_size: int | None = None) -> CheckedRecipe:
    """Every check a config can fail before any work, on ``world_size`` ranks (None: one process):
    the config itself (``job/checks.py``), then every stage's options and the export target, by
    building the stages' hooks."""
    stages = check_config(cfg, world_size)
    run_dir = os.path.abspath(cfg.run_dir)
    mmlu_options = MMLUOptions.of(cfg.mmlu)
    mmlu, export = _stage_hooks(cfg, run_dir, stages, mmlu_options)
    foreign = foreign_format(cfg.export.from_checkpoint) if cfg.export.from_checkpoint else None
    return CheckedRecipe(cfg, stages, run_dir, mmlu_options, mmlu, export, foreign)


def _world_size() -> int | None:
    """The ranks this run will have: the process group's, torchrun's ``WORLD_SIZE``, else None."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def _stage_hooks(cfg: Any, run_dir: str, stages: list[str], mmlu_options: Any) -> tuple[Any, Any]:
    """The MMLU callback (None when ``mmlu.enabled`` is false) and the export step (None without
    the export stage), built from their options: every option is validated here, before work."""
    export_options = ExportOptions.of(cfg.export)
    mmlu = (MMLUCallback(_data_root(cfg, run_dir), mmlu_options, output_dir=os.path.join(run_dir, "mmlu"))
            if cfg.mmlu.enabled else None)
    export = None
    if "export" in stages:
        target = export_target(cfg, run_dir)
        check_export_target(target, export_options.overwrite)
        export = ExportStep(target, export_options)
    return mmlu, export


def _data_root(cfg: Any, run_dir: str) -> str:
    """Where the evaluation reads its task's documents: ``mmlu.data_path``, else the synthetic corpus."""
    return cfg.mmlu.data_path or _synthetic_root(run_dir)


def _synthetic_root(run_dir: str) -> str:
    return os.path.join(run_dir, "data")


def _training_root(cfg: Any, run_dir: str, task: Task) -> str:
    """Where the reference trainer reads its MMLU-format train split: the evaluation's data when that
    is MMLU-format, else the synthetic corpus (a task of another format has no train split it reads)."""
    return cfg.mmlu.data_path if cfg.mmlu.data_path and task.dataset_format == "mmlu" else _synthetic_root(run_dir)


def _task_words(callback: MMLUCallback | None) -> str:
    """The prompts and choices the callback evaluates, for the word-level tokenizer's vocabulary when
    its task is not MMLU-format (the tokenizer reads MMLU-format files itself)."""
    if callback is None or callback.task.dataset_format == "mmlu":
        return ""
    task = callback.task
    return " ".join(task.context(q, []) + " " + " ".join(task.continuations(q))
                    for split in callback.questions() for q in split)


def _setup_logging(run_dir: str, rank: int) -> logging.Logger:
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    logger = logging.getLogger(f"nemo_moe_export.job.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    fh = logging.FileHandler(os.path.join(run_dir, "logs", f"rank{rank}.log"))
    fh.setFormatter(logging.Formatter("%(asctime)s rank%(name)s %(message)s".replace("%(name)s", str(rank))))
    logger.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(logging.Formatter("[nemo-moe-export] %(message)s"))
        logger.addHandler(sh)
    logger.propagate = False
    return logger


def _to_plain(cfg: Any) -> Any:
    if is_dataclass(cfg):
        return asdict(cfg)
    return OmegaConf.to_container(cfg, resolve=True)


def run_recipe(recipe: CheckedRecipe | Any, *, after: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Run the recipe's stages on every rank; returns (on every rank) the results summary.

    ``recipe`` is what :func:`check_recipe` returned (the CLI checks once, then runs it), or a
    config, checked here first, before any process group or model. ``after(ctx)`` runs on every
    rank once the stages are done, with the live :class:`~nemo_moe_export.hooks.RecipeContext`
    (the GPU benchmark measures the trained model there); what it puts in ``ctx.results`` is saved
    with the rest.
    """
    checked = recipe if isinstance(recipe, CheckedRecipe) else check_recipe(recipe, _world_size())
    device = resolve_device(checked.cfg.parallel.device)
    init_distributed(device, checked.cfg.parallel.timeout_s)
    watch_job()  # launched without torchrun, nothing else would end this rank when another one fails
    try:
        results = _run_stages(checked, device, after)
    except KeyboardInterrupt:  # a stop signal reaches every rank by itself
        raise
    except BaseException as exc:
        report_job_failure(exc)  # the first failure is what a rank its watchdog ends prints
        raise
    finished()
    return results


def _run_stages(checked: CheckedRecipe, device: str, after: Callable[[Any], None] | None) -> dict[str, Any]:
    cfg, stages, run_dir = checked.cfg, checked.stages, checked.run_dir
    mmlu_callback, export_step = checked.mmlu, checked.export
    torch.manual_seed(cfg.trainer.seed)
    info = dist_info()
    os.makedirs(run_dir, exist_ok=True)
    log = _setup_logging(run_dir, info.rank)
    if info.rank == 0:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(_to_plain(cfg), f, indent=2)
    log.info(f"recipe {cfg.name}: stages {stages}, {info.world_size} rank(s) on {device}, run dir {run_dir}")

    if checked.foreign is not None:  # converted into the export's directory, no model (job/foreign.py)
        return _run_converted(checked, info, log, after)
    ctx, hooks = _setup(checked, info, log, device)
    results: dict[str, Any] = ctx.results
    if "train" in stages:
        _train_stage(checked, ctx, hooks, log)
    if "mmlu" in stages and mmlu_callback is not None:
        mmlu_callback.on_train_end(ctx)
        if mmlu_callback.last_result is not None:
            results["mmlu_predictions"] = mmlu_callback.last_result.predictions
            results["mmlu_scores"] = [r["scores"] for r in mmlu_callback.last_result.records]
    if export_step is not None:
        _export_stage(ctx, export_step, log)
    if "verify" in stages:
        results["verify"] = _verify_stage(checked, ctx, results, info, log)
    if after is not None:
        after(ctx)
    return _save_results(checked, results, info, log)


def _run_converted(checked: CheckedRecipe, info: Any, log: Any, after: Callable[[Any], None] | None) -> dict[str, Any]:
    """Stages export (a conversion of another framework's checkpoint) and verify; no model, no context."""
    results: dict[str, Any] = {}
    if checked.export is not None:
        results["export"] = convert_stage(checked.cfg, checked.export.output_dir, checked.export.options, log)
    if "verify" in checked.stages:
        results["verify"] = _verify_stage(checked, None, results, info, log)
    if after is not None:
        after(None)
    return _save_results(checked, results, info, log)


def _save_results(checked: CheckedRecipe, results: dict[str, Any], info: Any, log: Any) -> dict[str, Any]:
    if info.rank == 0:
        with open(os.path.join(checked.run_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)
        log.info(_summary(results, checked.run_dir, checked.mmlu_options.task))
    if info.initialized:
        dist.barrier()
    return results


def _train_stage(checked: CheckedRecipe, ctx: Any, hooks: Any, log: Any) -> None:
    cfg = checked.cfg
    state = train(ctx.model, ctx.layout, ctx.tokenizer, ctx.data_root, cfg.trainer,
                  k_shot=checked.mmlu_options.k_shot, hooks=hooks, ctx=ctx, log=log.info)
    ctx.results["train"] = {"steps": state.step, "first_loss": state.losses[0], "last_loss": state.losses[-1],
                            "seconds": round(state.seconds, 2)}
    checkpoint = os.path.join(ctx.run_dir, "checkpoint")
    if cfg.trainer.save_checkpoint:
        _save_checkpoint(ctx, checkpoint)
    log.info(f"trained {state.step} steps in {state.seconds:.1f} s: loss {state.losses[0]:.3f} -> "
             f"{state.losses[-1]:.3f}" + (f"; checkpoint {checkpoint}" if cfg.trainer.save_checkpoint else ""))


def _export_stage(ctx: Any, export_step: Any, log: Any) -> None:
    """The export step's hook writes with ``ctx.adapter``; its result becomes the JSON summary."""
    export_step.on_train_end(ctx)
    result = ctx.results["export"]
    ctx.results["export"] = {"path": result.path, "files": result.files, "bytes": result.checkpoint_bytes,
                             "seconds": result.seconds, "step_seconds": result.step_seconds, "io": result.io}
    log.info(f"exported {result.checkpoint_bytes / 1e6:.1f} MB in {result.files} files "
             f"to {result.path} in {result.seconds:.2f} s")


def _setup(checked: CheckedRecipe, info: Any, log: Any, device: str) -> tuple[Any, Any]:
    cfg, run_dir, mmlu_callback = checked.cfg, checked.run_dir, checked.mmlu
    task = load_task(checked.mmlu_options.task)
    data_root = _training_root(cfg, run_dir, task)
    if data_root == _synthetic_root(run_dir) and info.rank == 0:
        write_synthetic_mmlu(data_root, seed=cfg.data.seed, n_train=cfg.data.n_train, n_dev=cfg.data.n_dev,
                             n_test=cfg.data.n_test, subjects=cfg.data.subjects)
    if info.initialized:
        dist.barrier()
    from_checkpoint = cfg.export.from_checkpoint
    if from_checkpoint:
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(from_checkpoint, "tokenizer"))
    else:
        tokenizer = build_tokenizer(data_root, extra_text=_task_words(mmlu_callback))
    model, layout = build_sharded_model(cfg.model, cfg.parallel, vocab_size=len(tokenizer),
                                        pad_token_id=tokenizer.pad_token_id, device=device)
    if from_checkpoint:
        _load_checkpoint(model, from_checkpoint)
        log.info(f"restored the model from {from_checkpoint}")
    ctx = RecipeContext(model=model, layout=layout, tokenizer=tokenizer, run_dir=run_dir, data_root=data_root)
    hooks = HookList([AdapterHook(), *([mmlu_callback] if mmlu_callback is not None else [])])
    hooks.on_setup(ctx)
    return ctx, hooks


def _load_checkpoint(model: Any, path: str) -> None:
    """Restore what :func:`_save_checkpoint` wrote: torch DCP, or megatron-core's own
    ``dist_checkpointing`` for a megatron-core model (docs/design.md#megatron-core-models)."""
    if isinstance(model, MegatronCausalLM):
        load_training_checkpoint(model, path)
        return
    dcp.load(model.state_dict(), checkpoint_id=path)


def _save_checkpoint(ctx: Any, path: str) -> None:
    """A sharded checkpoint of the model plus the tokenizer: what ``from_checkpoint`` reads (torch
    DCP; megatron-core's ``dist_checkpointing`` for a megatron-core model, whose export view must
    never go to DCP: one local expert name is a different expert on each EP rank)."""
    if isinstance(ctx.model, MegatronCausalLM):
        save_training_checkpoint(ctx.model, path)
    else:
        dcp.save(ctx.model.state_dict(), checkpoint_id=path)
    if dist_info().rank == 0:
        ctx.tokenizer.save_pretrained(os.path.join(path, "tokenizer"))
    if dist_info().initialized:
        dist.barrier()


def _verify_stage(checked: CheckedRecipe, ctx: Any, results: dict[str, Any], info: Any, log: Any) -> dict[str, Any]:
    """Bytes-level verify, then a fresh single process reloads with transformers and re-evaluates
    with the same MMLU options, handed over whole (``job/reload.py``)."""
    path = export_target(checked.cfg, checked.run_dir)
    outcome: dict[str, Any] = {"path": path}
    if info.rank == 0:
        report = verify_checkpoint(path)
        outcome.update(ok=report.ok, summary=report.summary())
        log.info(report.summary())
        if report.ok and checked.mmlu is not None:
            out = os.path.join(checked.run_dir, "reload_mmlu.json")
            options = os.path.join(checked.run_dir, "reload_mmlu_options.json")
            with open(options, "w") as f:
                json.dump(asdict(checked.mmlu_options), f, indent=1)
            cmd = [sys.executable, "-m", "nemo_moe_export.job.reload", path, str(checked.mmlu.data_path), out,
                   "--options", options]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if proc.returncode != 0:
                outcome.update(ok=False, reload_error=proc.stderr[-4000:])
            else:
                with open(out) as f:
                    reloaded = json.load(f)
                trained = (results.get("mmlu") or {}).get("overall", {})
                outcome["reloaded_accuracy"] = reloaded["overall"]["acc"]
                outcome["reload_seconds"] = round(time.perf_counter() - t0, 2)
                if trained and "mmlu_scores" in results:
                    outcome["trained_accuracy"] = trained.get("acc")
                    outcome["answers"] = compare_answers(results["mmlu_scores"], reloaded["scores"],
                                                         _compared_dtype(checked, path))
                    outcome["ok"] = outcome["ok"] and outcome["answers"]["ok"]
        if report.ok:
            _serve_with_vllm(path, outcome, log)
    if info.initialized:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if not outcome.get("ok"):
        raise RuntimeError(f"verify stage failed: {json.dumps(outcome, indent=2, default=str)}")
    return outcome


def _compared_dtype(checked: CheckedRecipe, path: str) -> torch.dtype:
    """The coarser dtype of the trained model's and the export's as the reload reads it: its
    config.json, which verify has checked against the files (FP8 exports: e4m3), also when this
    run did not write the export."""
    with open(os.path.join(path, CONFIG_FILE)) as f:
        written = json.load(f)
    export_dtype = torch.float8_e4m3fn if "quantization_config" in written else parse_dtype(written.get("dtype"))
    return coarsest_dtype(model_dtype(checked.cfg.model), export_dtype)


def _serve_with_vllm(path: str, outcome: dict[str, Any], log: Any) -> None:
    """Where a vLLM environment is present ($NEMO_MOE_EXPORT_VLLM_PYTHON, or vLLM here), serve the
    export with it as written and compare its prompt logprobs with transformers on the same files
    (docs/design.md#serving-engines); a model vLLM's backend here cannot run is said, not failed."""
    python = vllm_python()
    if python is None:
        return
    served = check_with_vllm(path, python)
    outcome["vllm"] = served.summary()
    outcome["ok"] = outcome["ok"] and (served.ok or served.skipped is not None)
    log.info(served.summary())


def _summary(results: dict[str, Any], run_dir: str, task: str) -> str:
    lines = ["", "=" * 72, "summary"]
    if "train" in results:
        t = results["train"]
        lines.append(f"  train  : {t['steps']} steps, loss {t['first_loss']:.3f} -> {t['last_loss']:.3f} "
                     f"({t['seconds']} s)")
    mmlu = results.get("mmlu")
    if mmlu:
        lines.append(f"  eval   : {load_task(task).display_name} overall acc {mmlu['overall']['acc']:.3f} "
                     f"({mmlu['overall'].get('n', '?')} held-out questions)")
        lines.append(results_to_markdown(mmlu, task))
    if "export" in results:
        e = results["export"]
        lines.append(f"  export : {e['path']} ({e['bytes'] / 1e6:.1f} MB, {e['files']} files, {e['seconds']} s)")
    if "verify" in results:
        v = results["verify"]
        extra = (f", reloaded acc {v['reloaded_accuracy']:.3f} (trained {v.get('trained_accuracy')})"
                 if "reloaded_accuracy" in v else "")
        if "answers" in v:
            a = v["answers"]
            extra += (f", answers {a['same_answers']}/{a['questions']} equal ({a['decided']} decided beyond "
                      f"{a['dtype']} rounding, {len(a['differ_decided'])} of them differ)")
        lines.append(f"  verify : {'OK' if v.get('ok') else 'FAILED'}{extra}")
        if v.get("vllm"):
            lines.append(f"  serve  : {v['vllm']}")
    lines.append(f"  run dir: {run_dir}")
    lines.append("=" * 72)
    return "\n".join(lines)
