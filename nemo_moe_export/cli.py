"""The command line.

    nemo-moe-export [recipe=NAME] [hydra overrides...] [--nproc N] [--config-dir DIR]... [--debug]   run a recipe
    nemo-moe-export verify DIR [--reference REF] [--tp 1,2,4,8]      check an HF checkpoint (--tp: servable)
    nemo-moe-export plan (--config CONFIG.json | --model-preset NAME | --recipe NAME [overrides...])
                    --world W [--strategy fsdp|hsdp|ep|ep_fsdp] [--replicate R] [--ep E] [--pp P]
                    [--stages-per-rank V] [--layers-per-stage 4,4,3,...] [--json] ...
                                                                     what every rank will write, and how long
    nemo-moe-export plan --convert (--config CONFIG.json | --model-preset NAME) --world W [--read-bandwidth 2GB]
                    [--node-bandwidth 2GB] [--ranks-per-node R] [--json]
                                                                     what converting a checkpoint will read, write, take
    nemo-moe-export launch [recipe=NAME] [overrides...] [--nproc N] [--config-dir DIR]... [--slurm ...]
                                                                     the same as a NeMo-Run job
    nemo-moe-export launch convert SRC OUT --config HF_CONFIG [...] [--nproc N]   the conversion as a NeMo-Run job
    nemo-moe-export convert SRC OUT --config HF_CONFIG [--dtype D] [--tokenizer DIR] [--overwrite replace]
                    [--nproc N]                                      a training checkpoint -> HF, no model

The recipe job is a Hydra main: ``recipe=NAME`` picks ``NAME.yaml`` among the packaged recipes
(default ``deepseek_v3_tiny``, the embedded demo), config groups come from the packaged ``conf/``, and
any override in Hydra's grammar applies (``trainer.max_steps=300 parallel=ep export.dtype=bfloat16``);
types and unknown keys are checked by Hydra against the schemas in ``nemo_moe_export/config.py``. It
runs under ``torchrun`` (one process per rank), or launches itself locally with ``--nproc N``.

Your own recipes and presets need no change to the package: ``--config-dir DIR`` (repeatable) or
``NEMO_MOE_EXPORT_CONFIG_PATH=DIR1:DIR2`` puts folders ahead of the packaged ones; each holds recipes at
its top level (``DIR/my_recipe.yaml``, whose ``defaults`` may name the package's ``base`` and presets)
and group presets in subfolders (``DIR/model/my_model.yaml``). ``--config-dir`` folders come first.

Faults (docs/design.md#faults-and-how-each-is-reported): the whole config is checked before any rank
starts work (once, in the ``--nproc`` launcher, before torchrun; on every rank under torchrun, where
only rank 0 prints). A bad command line or config is one message on stderr and exit status 2, with
no traceback unless ``--debug`` or ``NEMO_MOE_EXPORT_DEBUG=1`` asks for it; an ``InputError``
raised while the job runs is one message from the rank that raised it and exit status 1. SIGINT,
SIGTERM or SIGHUP stops the job: the launcher forwards it to torchrun and waits for every rank, each
rank stops where it is (an export in flight is discarded, its target untouched), and the exit
status is 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from nemo_moe_export.config import ParallelConfig, register_configs
from nemo_moe_export.convert.command import convert_main
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.options import ExportOptions, parse_dtype, parse_size
from nemo_moe_export.export.verify import verify_checkpoint
from nemo_moe_export.integrations.nemo_run import launch_main
from nemo_moe_export.serving.vllm_logprobs import check_with_vllm, vllm_python
from nemo_moe_export.job.checks import STRATEGIES
# Config composition lives a layer down (job/compose.py), shared with the NeMo-Run launcher
# (integrations/nemo_run.py).
from nemo_moe_export.job.compose import (find_recipe, hydra_overrides, hydra_search_path, load_config,
                                         split_recipe_args, user_config_dirs)
from nemo_moe_export.job.stages import check_recipe, run_recipe
from nemo_moe_export.job.torchrun import (check_local_resources, leave_after_rank0, run_torchrun, stop_on_signals,
                                         stopped_by)
from nemo_moe_export.planner import TimeModel, format_table, plan_job
from nemo_moe_export.planner.convert import ConversionModel, format_conversion, plan_conversion
from nemo_moe_export.planner.model import from_config_file, from_preset, from_recipe

__all__ = ["DEBUG_ENV", "main"]

DEBUG_ENV = "NEMO_MOE_EXPORT_DEBUG"  # "1": tracebacks instead of one-line errors (as --debug)
USAGE_ERROR, JOB_ERROR = 2, 1  # exit statuses: a bad command line or config; an input refused while running


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say(message: str) -> None:
    print(f"nemo-moe-export: {message}", file=sys.stderr, flush=True)


def _one_line(exc: BaseException) -> str:
    """The error's message, with its cause's where that says more (Hydra puts the reason there)."""
    text = str(exc).strip() or type(exc).__name__
    cause = str(exc.__cause__ or "").strip()
    return f"{text}: {cause}" if cause and cause not in text else text


def _usage_errors() -> tuple[type[BaseException], ...]:
    """What a bad command line or config raises: ours, Hydra's and OmegaConf's."""
    return InputError, HydraException, OmegaConfBaseException


def _run_checked(checked: Any) -> int:
    """Run a recipe this rank composed and checked once (no second composition by ``hydra.main``:
    the recipe keeps its config, logs and results in ``run_dir``, Hydra writes nothing of its own),
    or a config ``hydra.main`` composed; the exit status."""
    try:
        with stop_on_signals():
            run_recipe(checked)
    except BaseException as exc:  # noqa: BLE001 - sorted out by _job_failure, which re-raises the rest
        return _job_failure(exc)
    return 0


def _hydra_main(recipe_file: Path, overrides: list[str], user_dirs: list[Path]) -> int:
    """Hydra's own command line (``--cfg job``, ``--help``, ``-m``): Hydra prints or sweeps."""
    register_configs()

    @hydra.main(version_base="1.3", config_path=str(recipe_file.parent), config_name=recipe_file.stem)
    def _main(cfg: Any) -> None:
        status = _run_checked(cfg)  # a multirun job stops on signals and reports errors as a plain run does
        if status:
            raise SystemExit(status)

    sys.argv = [sys.argv[0], *hydra_overrides(hydra_search_path(recipe_file, user_dirs), overrides)]
    _main()
    return 0


def _job_failure(exc: BaseException) -> int:
    """The exit status of a job that raised ``exc``, after one line on stderr; re-raises what is
    neither a stop nor a refused input (Hydra then prints its traceback), and everything with --debug."""
    signum = stopped_by()
    if signum is not None:  # whatever the stop raised on the way out (a peer's error, too) is the stop
        if _is_rank0():
            _say(f"stopped by {signal.Signals(signum).name}")
        # The stack has unwound (the export discarded its partial directory); exit now rather than
        # join worker threads still busy with work nobody will read, or wait on a dead peer's sockets.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(128 + signum)
    if isinstance(exc, SystemExit) or _debug() or not isinstance(exc, InputError):
        raise exc
    _say(f"error: {exc}")
    return JOB_ERROR


def _check_before_start(recipe: str, overrides: list[str], config_dirs: list[str], nproc: int | None) -> Any:
    """Compose and check the whole config once before anything starts: in the ``--nproc`` launcher
    for ``nproc`` ranks (and the machine for them), else for the ranks torchrun started. Returns
    the checked recipe (``job/stages.py``'s ``CheckedRecipe``), which a rank then runs."""
    cfg = load_config(recipe, overrides, config_dirs)
    if nproc is not None:
        check_local_resources(nproc, cfg.parallel.device)
    world = nproc if nproc is not None else (int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
    return check_recipe(cfg, world)


def _tp_sizes(text: str) -> list[int]:
    """``--tp 1,2,4,8``: positive integers, comma-separated."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,2,4,8, got {text!r}")
    return sizes


def verify_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nemo-moe-export verify",
                                     description="Check an HF safetensors checkpoint from its bytes.")
    parser.add_argument("path", help="checkpoint directory")
    parser.add_argument("--reference", help="checkpoint directory to compare every tensor with")
    parser.add_argument("--tp", type=_tp_sizes, metavar="1,2,4,8",
                        help="serve check: tensor-parallel sizes at which every FP8 weight must split into whole "
                             "blocks, and the MTP layer the config declares must be present")
    parser.add_argument("--engine", choices=("vllm",),
                        help="also serve the export with this engine as written and compare its prompt logprobs "
                             "with transformers on the same files (docs/design.md#serving-engines)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="the python of vLLM's own environment (default: $NEMO_MOE_EXPORT_VLLM_PYTHON, else "
                             "this python if vLLM imports here); `make setup-vllm` builds .venv-vllm")
    args = parser.parse_args(argv)
    report = verify_checkpoint(args.path, reference=args.reference, tp=args.tp)
    print(report.summary())
    if args.engine is None:
        return 0 if report.ok else 1
    python = vllm_python(args.vllm_python)
    if python is None:
        raise InputError("vLLM is not installed here", key="--vllm-python", expected="the python of a vLLM "
                         "environment (make setup-vllm builds .venv-vllm)", actual=None,
                         hint="pass --vllm-python PATH or set NEMO_MOE_EXPORT_VLLM_PYTHON")
    served = check_with_vllm(args.path, python)
    print(served.summary())
    return 0 if report.ok and (served.ok or served.skipped) else 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _layer_counts(text: str) -> list[int]:
    """``4,4,3``: decoder layers per pipeline stage."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected layer counts such as 4,4,3, got {text!r}")
    return counts


def _bandwidth(text: str) -> float:
    """``2GB`` (per second), ``500MiB``, or bytes per second."""
    try:
        return float(parse_size(text.removesuffix("/s")))
    except InputError:
        raise argparse.ArgumentTypeError(f"expected a bandwidth such as 2GB (per second), got {text!r}") from None


def _plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nemo-moe-export plan",
        description="Simulate every rank of an export (and MMLU) on the meta device: bytes, files, memory, time.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="an HF config.json (or its directory)")
    source.add_argument("--model-preset", help="a preset of nemo_moe_export/conf/model, e.g. deepseek_v3_tiny")
    source.add_argument("--recipe", help="a recipe name; Hydra overrides may follow")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the recipe (with --recipe)")
    parser.add_argument("--config-dir", action="append", default=[], help="recipe folders ahead of the packaged ones")
    parser.add_argument("--world", type=_positive_int, required=True, help="number of ranks")
    parser.add_argument("--strategy", choices=STRATEGIES,
                        help="parallel.strategy: default the recipe's, else fsdp")
    parser.add_argument("--replicate", type=_positive_int, help="HSDP replicas (R of R x W/R)")
    parser.add_argument("--ep", type=_positive_int, help="expert-parallel size (EP x expert-DP)")
    parser.add_argument("--pp", type=_positive_int, help="pipeline-parallel size: W = PP x the ranks of a stage, "
                        "the layout applying inside each stage (default: the recipe's, else 1)")
    parser.add_argument("--stages-per-rank", type=_positive_int, help="virtual stages per pipeline rank (loop order)")
    parser.add_argument("--layers-per-stage", type=_layer_counts, metavar="4,4,3,...",
                        help="decoder layers of each stage (default: even, earlier stages taking the remainder)")
    parser.add_argument("--tp", type=_positive_int, help="tensor-parallel size, innermost: torch TP (column "
                        "Shard(0), row Shard(1)) inside each stage, then the layout over the rest (fsdp, ep)")
    parser.add_argument("--etp", type=_positive_int, help="expert tensor-parallel size (1, as in the "
                        "Megatron-Bridge recipes: routed experts are not split by TP)")
    parser.add_argument("--cp", type=_positive_int, help="context-parallel size: every weight copied on its CP ranks")
    parser.add_argument("--sp", action="store_true", default=None,
                        help="sequence parallelism (with --tp; moves activations only: reported, no byte changes)")
    parser.add_argument("--dtype", help="export dtype (e.g. bfloat16); default: the recipe's, else the model's")
    parser.add_argument("--max-shard-size", help="per file, e.g. 5GB")
    parser.add_argument("--staging-bytes", type=_positive_int, help="per staging buffer")
    parser.add_argument("--writer-threads", type=_positive_int, help="pwrite threads per rank")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                        help="where the shards live (cuda: every byte goes through pinned staging)")
    parser.add_argument("--node-bandwidth", type=_bandwidth, default=2e9, help="write bandwidth of one node (2GB)")
    parser.add_argument("--ranks-per-node", type=_positive_int, default=8)
    parser.add_argument("--checksum-bandwidth", type=_bandwidth, help="bytes/s a rank checksums (cuda 1TB, cpu 5GB)")
    parser.add_argument("--file-op-seconds", type=float, default=2e-3,
                        help="one small file written and fsynced on the target filesystem (0.002)")
    parser.add_argument("--mmlu", help="MMLU question folder: plan the evaluation too (needs --tokenizer)")
    parser.add_argument("--tokenizer", help="tokenizer directory for --mmlu")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--per-rank", action="store_true", help="with --json: every rank's numbers")
    convert = parser.add_argument_group("a checkpoint's conversion (docs/convert.md), instead of an export")
    convert.add_argument("--convert", action="store_true",
                         help="predict `nemo-moe-export convert` of a checkpoint of this model on --world CPU ranks")
    convert.add_argument("--source-dtype", default="bfloat16", help="the checkpoint's weights' dtype (bfloat16)")
    convert.add_argument("--read-bandwidth", type=_bandwidth, default=ConversionModel().read_bandwidth,
                         help="read bandwidth of one node (2GB)")
    convert.add_argument("--decode-bandwidth", type=_bandwidth, default=ConversionModel().decode_bandwidth,
                         help="bytes/s one rank decodes and casts (600MB: benchmarks/convert_bench.py, one rank)")
    return parser


def plan_main(argv: list[str]) -> int:
    """``nemo-moe-export plan``: the planner (docs/design.md#planner); input errors are one line, status 2."""
    parser = _plan_parser()
    args = parser.parse_args(argv)
    if args.overrides and not args.recipe:
        parser.error("overrides apply to --recipe only")
    if bool(args.mmlu) != bool(args.tokenizer):
        parser.error("--mmlu and --tokenizer go together")
    if args.convert:
        report = _conversion_report(args)
        print(json.dumps(report, indent=1) if args.json else format_conversion(report))
        return 0
    report = _plan_report(args)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


def _plan_target(args: Any) -> Any:
    """What ``plan`` plans: a recipe (with its overrides), an HF config or a preset."""
    if args.recipe:
        return from_recipe(args.recipe, args.overrides, args.config_dir)
    return (from_config_file if args.config else from_preset)(args.config or args.model_preset, ParallelConfig(),
                                                               ExportOptions())


def _conversion_report(args: Any) -> dict:
    """``plan --convert``: the conversion's bytes per rank and time (planner/convert.py)."""
    target = _plan_target(args)
    model = ConversionModel(args.read_bandwidth, args.node_bandwidth, args.decode_bandwidth, args.ranks_per_node)
    return plan_conversion(target.config, args.world, model, source_dtype=parse_dtype(args.source_dtype),
                           dtype=args.dtype or "bfloat16")


def _plan_report(args: Any) -> dict:
    target = _plan_target(args)
    parallel = replace(target.parallel, strategy=args.strategy or target.parallel.strategy)
    if args.replicate:
        parallel = replace(parallel, replicate=args.replicate)
    if args.ep:
        parallel = replace(parallel, ep_size=args.ep)
    sizes = dict(pp_size=args.pp, stages_per_rank=args.stages_per_rank, layers_per_stage=args.layers_per_stage,
                 tp_size=args.tp, etp_size=args.etp, cp_size=args.cp, sequence_parallel=args.sp)
    parallel = replace(parallel, **{k: v for k, v in sizes.items() if v is not None})
    overrides = {k: v for k, v in dict(dtype=args.dtype, max_shard_size=args.max_shard_size,
                                       staging_bytes=args.staging_bytes, writer_threads=args.writer_threads).items()
                 if v is not None}
    target = replace(target, parallel=parallel, export=ExportOptions.of(target.export, **overrides))
    checksum = args.checksum_bandwidth or (1e12 if args.device == "cuda" else 5e9)
    model = TimeModel(args.node_bandwidth, args.ranks_per_node, checksum_bandwidth=checksum,
                      file_op_s=args.file_op_seconds)
    mmlu = (args.mmlu, args.tokenizer) if args.mmlu else None
    return plan_job(target, args.world, model, device=args.device, per_rank=args.per_rank, mmlu=mmlu)


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "verify":
        return verify_main(argv[1:])
    if argv and argv[0] == "plan":
        return plan_main(argv[1:])
    if argv and argv[0] == "launch":
        return launch_main(argv[1:])
    if argv and argv[0] == "convert":
        return convert_main(argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    recipe, overrides, nproc, config_dirs = split_recipe_args(argv)
    if os.environ.get("NEMO_MOE_EXPORT_OVERRIDES"):  # set by the NeMo-Run job (integrations/nemo_run.py)
            overrides += json.loads(os.environ["NEMO_MOE_EXPORT_OVERRIDES"])
    user_dirs = user_config_dirs(config_dirs)
    recipe_file = find_recipe(recipe, user_dirs)  # an unknown recipe fails once, before any rank starts
    if any(o.startswith("-") for o in overrides):
        return _hydra_main(recipe_file, overrides, user_dirs)  # Hydra's own flags: Hydra handles them
    launching = nproc is not None and "LOCAL_RANK" not in os.environ
    checked = _check_before_start(recipe, overrides, config_dirs, nproc if launching else None)
    if launching:
        # The --config-dir folders made absolute, so the ranks see the same ones whatever their working
        # directory; NEMO_MOE_EXPORT_CONFIG_PATH (and NEMO_MOE_EXPORT_DEBUG) reach them through the environment.
        cli_dirs = [f"--config-dir={Path(d).expanduser().resolve()}" for d in config_dirs]
        return run_torchrun(nproc, [f"recipe={recipe}", *cli_dirs, *overrides])
    return _run_checked(checked)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ[DEBUG_ENV] = "1"  # the ranks --nproc starts inherit it
    try:
        return _run(argv)
    except KeyboardInterrupt:
        if _debug():
            raise
        _say("interrupted")
        return 130
    except _usage_errors() as exc:
        if _debug():
            raise
        if _is_rank0():  # every rank checks the same config: one of them says so
            _say(f"error: {_one_line(exc)}")
            _say(f"(pass --debug or set {DEBUG_ENV}=1 for the traceback)")
        leave_after_rank0()
        return USAGE_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
