"""The command line.

    nemo-moe-export [recipe=NAME] [hydra overrides...] [--nproc N]   run a recipe (Hydra main job)
    nemo-moe-export verify DIR [--reference REF]                     check an HF checkpoint
    nemo-moe-export launch [recipe=NAME] [overrides...] [--nproc N] [--slurm ...]  NeMo-Run job

The recipe job is a Hydra main: ``recipe=NAME`` picks ``recipes/NAME.yaml`` (default
``deepseek_v3_tiny``, the embedded demo), config groups come from ``conf/``, and any override in
Hydra's grammar applies (``trainer.max_steps=300 parallel=ep export.dtype=bfloat16``); types and
unknown keys are checked by Hydra against the schemas in ``nemo_moe_export/config.py``. It runs
under ``torchrun`` (one process per rank), or launches itself locally with ``--nproc N``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent
CONF_DIR = Path(os.environ.get("NEMO_MOE_EXPORT_CONF", PACKAGE / "conf"))
RECIPES_DIR = Path(os.environ.get("NEMO_MOE_EXPORT_RECIPES", PACKAGE / "recipes"))
DEFAULT_RECIPE = "deepseek_v3_tiny"

__all__ = ["load_config", "main", "split_recipe_args"]


def split_recipe_args(argv: list[str]) -> tuple[str, list[str], int | None]:
    """``(recipe, hydra overrides, nproc)`` from a command line."""
    recipe, overrides, nproc = DEFAULT_RECIPE, [], None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg == "--nproc":
            nproc = int(args.pop(0))
        elif arg.startswith("--nproc="):
            nproc = int(arg.split("=", 1)[1])
        else:
            overrides.append(arg)
    return recipe, overrides, nproc


def _check_recipe(recipe: str) -> None:
    from nemo_moe_export.errors import ExportInputError

    if not (RECIPES_DIR / f"{recipe}.yaml").exists():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise ExportInputError("unknown recipe", key="recipe", expected=f"one of {known}", actual=repr(recipe),
                               hint=f"recipes live in {RECIPES_DIR}")


def load_config(recipe: str = DEFAULT_RECIPE, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose a recipe's config exactly as the CLI does (for tests, launchers and notebooks)."""
    from hydra import compose, initialize_config_dir

    from nemo_moe_export.config import register_configs

    _check_recipe(recipe)
    register_configs()
    from nemo_moe_export.config import validate_config

    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
        cfg = compose(config_name=recipe, overrides=[f"hydra.searchpath=[file://{CONF_DIR}]", *overrides])
    validate_config(cfg)
    return cfg


def _hydra_main(recipe: str, overrides: list[str]) -> int:
    import hydra

    from nemo_moe_export.config import register_configs
    from nemo_moe_export.recipe.stages import run_recipe

    register_configs()

    @hydra.main(version_base="1.3", config_path=str(RECIPES_DIR), config_name=recipe)
    def _main(cfg: Any) -> None:
        run_recipe(cfg)

    sys.argv = [sys.argv[0], f"hydra.searchpath=[file://{CONF_DIR}]", *overrides]
    _main()
    return 0


def _relaunch_with_torchrun(nproc: int, argv: list[str]) -> int:
    """Run this same command on ``nproc`` local ranks with torchrun (gloo on CPU)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "nemo_moe_export", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def verify_main(argv: list[str]) -> int:
    import argparse

    from nemo_moe_export.export.verify import verify_checkpoint

    parser = argparse.ArgumentParser(prog="nemo-moe-export verify",
                                     description="Check an HF safetensors checkpoint from its bytes.")
    parser.add_argument("path", help="checkpoint directory")
    parser.add_argument("--reference", help="checkpoint directory to compare every tensor with")
    args = parser.parse_args(argv)
    report = verify_checkpoint(args.path, reference=args.reference)
    print(report.summary())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "verify":
        return verify_main(argv[1:])
    if argv and argv[0] == "launch":
        from nemo_moe_export.integrations.nemo_run import launch_main

        return launch_main(argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    recipe, overrides, nproc = split_recipe_args(argv)
    if os.environ.get("NEMO_MOE_EXPORT_OVERRIDES"):  # set by the NeMo-Run job (integrations/nemo_run.py)
        import json

        overrides += json.loads(os.environ["NEMO_MOE_EXPORT_OVERRIDES"])
    _check_recipe(recipe)
    if nproc and "LOCAL_RANK" not in os.environ:
        return _relaunch_with_torchrun(nproc, [f"recipe={recipe}", *overrides])
    return _hydra_main(recipe, overrides)


if __name__ == "__main__":
    raise SystemExit(main())
