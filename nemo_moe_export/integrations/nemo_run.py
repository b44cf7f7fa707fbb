"""NeMo-Run launcher job: ``nemo-moe-export launch [recipe=NAME] [overrides] [--nproc N] [--slurm ...]``.

Locally it runs the recipe main job through ``run.Script`` with a torchrun ``LocalExecutor``:

    import nemo_run as run
    task = run.Script(path="nemo_moe_export", m=True, entrypoint="python",
                      args=["recipe=deepseek_v3_tiny", "trainer.max_steps=300"])
    with run.Experiment("moe-export") as exp:
        exp.add(task, executor=run.LocalExecutor(ntasks_per_node=4, launcher="torchrun"))
        exp.run(sequential=True, detach=False, tail_logs=True)

On a cluster, swap the executor for a ``run.SlurmExecutor`` (see :func:`slurm_executor`). The config
is composed and validated here first (Hydra's own errors), so a typo fails before anything is queued.
``--config-dir DIR`` and ``NEMO_MOE_EXPORT_CONFIG_PATH`` add config folders as for the main job
(``job/compose.py``); on a cluster they must be paths the nodes can read.
Needs ``pip install nemo-run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from nemo_moe_export.convert.command import convert_parser, without_nproc
from nemo_moe_export.convert.index import read_index
from nemo_moe_export.integrations._install_hint import missing
from nemo_moe_export.job.compose import CONFIG_PATH_ENV, load_config, split_recipe_args, user_config_dirs
from nemo_moe_export.job.stages import check_recipe

__all__ = ["OVERRIDES_ENV", "convert_task", "launch_main", "local_executor", "recipe_task", "slurm_executor"]

OVERRIDES_ENV = "NEMO_MOE_EXPORT_OVERRIDES"


def _run() -> Any:
    try:
        import nemo_run as run
    except ImportError as exc:
        raise missing("NeMo-Run", "pip install nemo-run") from exc
    return run


def recipe_task(recipe: str, overrides: list[str], config_dirs: list[Path] | tuple[Path, ...] = ()) -> Any:
    """The recipe main job as a ``run.Script`` (``python -m nemo_moe_export recipe=...``).

    Overrides travel as JSON in ``NEMO_MOE_EXPORT_OVERRIDES``: NeMo-Run quotes script arguments for
    a shell, and an override like ``stages=[train,export]`` would reach Hydra with literal quotes.
    The user's config folders (absolute, in precedence order) travel in ``NEMO_MOE_EXPORT_CONFIG_PATH``
    for the same reason.
    """
    env = {OVERRIDES_ENV: json.dumps(list(overrides))}
    if config_dirs:
        env[CONFIG_PATH_ENV] = os.pathsep.join(str(d) for d in config_dirs)
    return _run().Script(path="nemo_moe_export", m=True, entrypoint="python", args=[f"recipe={recipe}"], env=env)


def convert_task(argv: list[str]) -> Any:
    """``nemo-moe-export convert ARGV`` as a ``run.Script``: run once per rank by the executor's torchrun
    (docs/convert.md#launchers)."""
    return _run().Script(path="nemo_moe_export", m=True, entrypoint="python", args=["convert", *argv])


def local_executor(nproc: int, job_dir: str = "") -> Any:
    return _run().LocalExecutor(ntasks_per_node=nproc, launcher="torchrun", job_dir=job_dir)


def slurm_executor(*, account: str, partition: str, nodes: int, gpus_per_node: int, time: str = "04:00:00",
                   container_image: str | None = None, **kwargs: Any) -> Any:
    """A ``run.SlurmExecutor`` for clusters, one task per GPU, torchrun inside each node."""
    run = _run()
    return run.SlurmExecutor(account=account, partition=partition, nodes=nodes, ntasks_per_node=gpus_per_node,
                             gpus_per_node=gpus_per_node, time=time, container_image=container_image,
                             launcher="torchrun", **kwargs)


def launch_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nemo-moe-export launch", description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="nemo-moe-export")
    parser.add_argument("--job-dir", default="")
    parser.add_argument("--slurm-account")
    parser.add_argument("--slurm-partition")
    parser.add_argument("--nodes", type=int, default=1)
    known, rest = parser.parse_known_args(argv)
    if rest and rest[0] == "convert":
        return _launch_convert(known, rest[1:])
    recipe, overrides, nproc, config_dirs = split_recipe_args(rest)
    user_dirs = user_config_dirs(config_dirs)
    # Validate now, for the world the job will have: Hydra's errors and the recipe checks (stages,
    # options, paths, EP size against the ranks and experts) before anything is launched.
    world = (nproc or 8) * known.nodes if known.slurm_account else (nproc or 1)
    check_recipe(load_config(recipe, overrides, config_dirs), world)
    _launch(known, nproc, recipe_task(recipe, overrides, user_dirs), recipe)
    return 0


def _launch_convert(known: argparse.Namespace, argv: list[str]) -> int:
    """``launch convert SRC OUT ... [--nproc N]``: the command's flags and the checkpoint's index are
    checked here, before anything is launched; each rank runs the command without ``--nproc``."""
    args = convert_parser().parse_args(argv)
    read_index(args.src)  # a checkpoint the conversion cannot read fails here
    _launch(known, args.nproc, convert_task(without_nproc(argv)), "convert")
    return 0


def _launch(known: argparse.Namespace, nproc: int | None, task: Any, name: str) -> None:
    run = _run()
    # torchx's local scheduler looks torchrun up on PATH: make it the one beside this interpreter,
    # also when the virtual environment was not activated.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    if known.slurm_account:
        executor = slurm_executor(account=known.slurm_account, partition=known.slurm_partition,
                                  nodes=known.nodes, gpus_per_node=nproc or 8)
    else:
        executor = local_executor(nproc or 1, known.job_dir)
    with run.Experiment(known.name, base_dir=known.job_dir or None) as exp:
        exp.add(task, executor=executor, name=name)
        exp.run(sequential=True, detach=False, tail_logs=True)
