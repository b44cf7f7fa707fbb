"""Compose a recipe's config: where recipes and config groups are found, and how.

Shared by the CLI main job (``cli.py``) and the NeMo-Run launcher (``integrations/nemo_run.py``),
so neither imports the other.

Search order, first match wins:

1. each ``--config-dir DIR`` on the command line, in the order given;
2. each directory in ``NEMO_MOE_EXPORT_CONFIG_PATH`` (separated by ``os.pathsep``), in order;
3. the installed package's ``recipes/`` and then ``conf/``, found with ``importlib.resources``.

``recipe=NAME`` is the first ``NAME.yaml`` in that order; group presets (``model: NAME``) are looked
up first in that recipe's own folder, then in the same order.

A user directory holds recipe YAMLs at its top level (``DIR/my_recipe.yaml``) and extra group presets
in group subfolders (``DIR/model/my_model.yaml``); its recipes can pick the package's ``base`` and
presets in their ``defaults`` list, since the package's folders stay on the search path behind it.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path
from typing import Any, NamedTuple

from hydra import compose, initialize_config_dir

from nemo_moe_export.config import register_configs, validate_config
from nemo_moe_export.errors import InputError

__all__ = [
    "CONFIG_PATH_ENV", "DEFAULT_RECIPE", "RecipeArgs", "find_recipe", "hydra_overrides", "hydra_search_path",
    "load_config", "packaged_dir", "parse_nproc", "split_recipe_args", "user_config_dirs",
]

PACKAGE = "nemo_moe_export"
CONFIG_PATH_ENV = "NEMO_MOE_EXPORT_CONFIG_PATH"
DEFAULT_RECIPE = "deepseek_v3_tiny"
# Read by earlier versions; refused rather than ignored, so a stale shell setting is noticed.
RETIRED_ENVS = ("NEMO_MOE_EXPORT_CONF", "NEMO_MOE_EXPORT_RECIPES")


class RecipeArgs(NamedTuple):
    """A recipe command line, split: what is ours, and what goes on to Hydra."""

    recipe: str
    overrides: list[str]
    nproc: int | None
    config_dirs: list[str]  # the --config-dir values as given, in order


def split_recipe_args(argv: list[str]) -> RecipeArgs:
    """``recipe=NAME``, ``--nproc N`` and ``--config-dir DIR`` out of a command line; the rest are
    Hydra overrides."""
    recipe, overrides, nproc, config_dirs = DEFAULT_RECIPE, [], None, []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg == "--nproc":
            nproc = parse_nproc(args.pop(0) if args else None)
        elif arg.startswith("--nproc="):
            nproc = parse_nproc(arg.split("=", 1)[1])
        elif arg == "--config-dir":
            if not args:
                raise InputError("--config-dir needs a value", key="--config-dir", expected="a directory",
                                 actual="nothing", hint="write --config-dir DIR")
            config_dirs.append(args.pop(0))
        elif arg.startswith("--config-dir="):
            config_dirs.append(arg.split("=", 1)[1])
        else:
            overrides.append(arg)
    return RecipeArgs(recipe, overrides, nproc, config_dirs)


def parse_nproc(value: str | None) -> int:
    """``--nproc N``: a positive integer (0 or -2 would otherwise run one rank or crash torchrun)."""
    try:
        nproc = int(value) if value is not None else None
    except ValueError:
        nproc = None
    if nproc is None or nproc < 1:
        raise InputError("--nproc must be a positive integer", key="--nproc", expected="an integer >= 1",
                         actual="nothing" if value is None else repr(value),
                         hint="--nproc N starts N local ranks; leave it out under torchrun or srun")
    return nproc


def packaged_dir(name: str) -> Path:
    """The installed package's ``conf`` or ``recipes`` folder, as a directory Hydra can read."""
    resource = files(PACKAGE) / name
    if not isinstance(resource, Path) or not resource.is_dir():
        raise InputError(
            "packaged config folder missing", key=f"{PACKAGE}/{name}", expected="a directory in the installed package",
            actual=str(resource),
            hint="reinstall the package (pip install --force-reinstall nemo-moe-export); zipped installs are not supported",
        )
    return resource


def _retired_env_check() -> None:
    for name in RETIRED_ENVS:
        if name in os.environ:
            raise InputError(
                "environment variable no longer read", key=name, expected="unset", actual=repr(os.environ[name]),
                hint=f"unset it; add your own config folders with --config-dir DIR or {CONFIG_PATH_ENV}",
            )


def user_config_dirs(cli_dirs: list[str | os.PathLike] | tuple[str | os.PathLike, ...] = ()) -> list[Path]:
    """The user's config folders, resolved and checked: ``--config-dir`` ones first (the command line
    beats the environment), then ``NEMO_MOE_EXPORT_CONFIG_PATH``'s; duplicates keep their first place."""
    _retired_env_check()
    given = [("--config-dir", d) for d in cli_dirs]
    given += [(CONFIG_PATH_ENV, d) for d in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep) if d]
    dirs: list[Path] = []
    for source, raw in given:
        path = Path(raw).expanduser().resolve()
        if not path.is_dir():
            raise InputError("config folder not found", key=source, expected="an existing directory",
                             actual=repr(raw), hint="create it, or fix the path (relative paths start at the current directory)")
        if path not in dirs:
            dirs.append(path)
    return dirs


def hydra_search_path(recipe_file: Path, user_dirs: list[Path]) -> list[Path]:
    """What Hydra searches behind the recipe's own folder, in precedence order: the other user folders,
    then the package's recipes (a user recipe may build on one) and conf.

    The recipe's folder is Hydra's primary config folder, searched first: Hydra 1.3 does not find a
    primary config that only ``hydra.searchpath`` leads to.
    """
    everything = [*user_dirs, packaged_dir("recipes"), packaged_dir("conf")]
    return [folder for folder in everything if folder != recipe_file.parent]


def find_recipe(recipe: str, user_dirs: list[Path]) -> Path:
    """The file ``recipe=NAME`` names: the first ``NAME.yaml`` in the user folders, then the package's."""
    recipe_dirs = [*user_dirs, packaged_dir("recipes")]
    for folder in recipe_dirs:
        candidate = folder / f"{recipe}.yaml"
        if candidate.is_file():
            return candidate
    known = "; ".join(f"{folder}: {sorted(p.stem for p in folder.glob('*.yaml'))}" for folder in recipe_dirs)
    raise InputError(
        "unknown recipe", key="recipe", expected=f"a recipe in one of the searched folders ({known})",
        actual=repr(recipe), hint=f"add your own with --config-dir DIR (DIR/{recipe}.yaml) or {CONFIG_PATH_ENV}",
    )


def _hydra_quoted(path: Path) -> str:
    # Quoted, so a path with spaces, commas or '=' survives Hydra's override grammar.
    return "'file://" + str(path).replace("'", "\\'") + "'"


def hydra_overrides(search_path: list[Path], overrides: list[str] | tuple[str, ...]) -> list[str]:
    """The overrides Hydra gets: the search path first, then the user's own."""
    for override in overrides:
        if override.lstrip("+~").startswith("hydra.searchpath"):
            raise InputError(
                "hydra.searchpath is set by nemo-moe-export", key="hydra.searchpath",
                expected="no override of it", actual=repr(override),
                hint=f"add config folders with --config-dir DIR or {CONFIG_PATH_ENV} instead",
            )
    searchpath = ",".join(_hydra_quoted(d) for d in search_path)
    return [f"hydra.searchpath=[{searchpath}]", *overrides]


def load_config(recipe: str = DEFAULT_RECIPE, overrides: list[str] | tuple[str, ...] = (),
                config_dirs: list[str | os.PathLike] | tuple[str | os.PathLike, ...] = ()) -> Any:
    """Compose a recipe's config exactly as the CLI does (for tests, launchers and notebooks)."""
    user_dirs = user_config_dirs(config_dirs)
    recipe_file = find_recipe(recipe, user_dirs)
    register_configs()
    with initialize_config_dir(config_dir=str(recipe_file.parent), version_base="1.3"):
        cfg = compose(config_name=recipe_file.stem,
                      overrides=hydra_overrides(hydra_search_path(recipe_file, user_dirs), overrides))
    validate_config(cfg)
    return cfg
