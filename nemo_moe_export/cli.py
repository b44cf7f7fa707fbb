"""The command line.

    nemo-moe-export [recipe=NAME] [hydra overrides...] [--nproc N] [--config-dir DIR]...   run a recipe
    nemo-moe-export verify DIR [--reference REF]                     check an HF checkpoint
    nemo-moe-export launch [recipe=NAME] [overrides...] [--nproc N] [--config-dir DIR]... [--slurm ...]
                                                                     the same as a NeMo-Run job

The recipe job is a Hydra main: ``recipe=NAME`` picks ``NAME.yaml`` among the packaged recipes
(default ``deepseek_v3_tiny``, the embedded demo), config groups come from the packaged ``conf/``, and
any override in Hydra's grammar applies (``trainer.max_steps=300 parallel=ep export.dtype=bfloat16``);
types and unknown keys are checked by Hydra against the schemas in ``nemo_moe_export/config.py``. It
runs under ``torchrun`` (one process per rank), or launches itself locally with ``--nproc N``.

Your own recipes and presets need no change to the package: ``--config-dir DIR`` (repeatable) or
``NEMO_MOE_EXPORT_CONFIG_PATH=DIR1:DIR2`` puts folders ahead of the packaged ones; each holds recipes at
its top level (``DIR/my_recipe.yaml``, whose ``defaults`` may name the package's ``base`` and presets)
and group presets in subfolders (``DIR/model/my_model.yaml``). ``--config-dir`` folders come first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# Config composition lives a layer down (recipe/compose.py), shared with the NeMo-Run launcher, so
# neither imports the other. load_config stays importable from here for scripts that used it.
from nemo_moe_export.recipe.compose import (find_recipe, hydra_overrides, hydra_search_path, load_config,
                                            split_recipe_args, user_config_dirs)

__all__ = ["load_config", "main"]


def _hydra_main(recipe_file: Path, overrides: list[str], user_dirs: list[Path]) -> int:
    import hydra

    from nemo_moe_export.config import register_configs
    from nemo_moe_export.recipe.stages import run_recipe

    register_configs()

    @hydra.main(version_base="1.3", config_path=str(recipe_file.parent), config_name=recipe_file.stem)
    def _main(cfg: Any) -> None:
        run_recipe(cfg)

    sys.argv = [sys.argv[0], *hydra_overrides(hydra_search_path(recipe_file, user_dirs), overrides)]
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
    recipe, overrides, nproc, config_dirs = split_recipe_args(argv)
    if os.environ.get("NEMO_MOE_EXPORT_OVERRIDES"):  # set by the NeMo-Run job (integrations/nemo_run.py)
        import json

        overrides += json.loads(os.environ["NEMO_MOE_EXPORT_OVERRIDES"])
    user_dirs = user_config_dirs(config_dirs)
    recipe_file = find_recipe(recipe, user_dirs)  # an unknown recipe fails once, before any rank starts
    if nproc and "LOCAL_RANK" not in os.environ:
        # The --config-dir folders made absolute, so the ranks see the same ones whatever their working
        # directory; NEMO_MOE_EXPORT_CONFIG_PATH reaches them through the environment.
        cli_dirs = [f"--config-dir={Path(d).expanduser().resolve()}" for d in config_dirs]
        return _relaunch_with_torchrun(nproc, [f"recipe={recipe}", *cli_dirs, *overrides])
    return _hydra_main(recipe_file, overrides, user_dirs)


if __name__ == "__main__":
    raise SystemExit(main())
