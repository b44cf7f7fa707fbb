"""One home for each default (docs/design.md#options-and-defaults).

``ExportOptions`` and ``MMLUOptions`` hold the export's and the evaluation's defaults; the config
groups' dataclasses (``config.py``) hold the rest. These tests fail when a default is declared a
second time with another value: a parameter of a public entry point, a command-line flag, a config
schema field, a YAML preset or a recipe. Each check is also run on a planted disagreement, so a
check that silently stopped looking would fail too.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

import nemo_moe_export
from nemo_moe_export import config as schemas
from nemo_moe_export.evaluate.options import MMLUOptions
from nemo_moe_export.export.options import ExportOptions

PACKAGE_DIR = Path(nemo_moe_export.__file__).parent
CONF_DIR = PACKAGE_DIR / "conf"
RECIPES_DIR = PACKAGE_DIR / "recipes"
# Which options dataclass a module's parameters are checked against, by module prefix.
OPTIONS_OF_MODULE = {"nemo_moe_export.export": ExportOptions, "nemo_moe_export.evaluate": MMLUOptions}
# The modules whose __all__ users import entry points from (re-exports are checked where defined).
PUBLIC_MODULES = ("nemo_moe_export", "nemo_moe_export.hooks", "nemo_moe_export.integrations",
                  "nemo_moe_export.export", "nemo_moe_export.evaluate")
# A recipe's identity, stated even where it equals the schema's default: the README tells users
# to read a recipe's stages from its file.
RECIPE_IDENTITY_KEYS = ("name", "stages")


# --- what the dataclasses declare ---------------------------------------------------------------


def defaults_of(cls: type) -> dict[str, Any]:
    """Each field's default (default_factory called); fields without one (MISSING) are left out."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return {k: v for k, v in out.items() if v != "???"}  # omegaconf.MISSING: required, no default


def _plain(value: Any) -> Any:
    """Compare values as YAML would write them: tuples as lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    return type(_plain(a)) is type(_plain(b)) and _plain(a) == _plain(b) or (
        isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
        and not isinstance(b, bool) and float(a) == float(b))


GROUP_SCHEMAS: dict[str, type] = {
    name: hint for name, hint in typing.get_type_hints(schemas.RecipeConfig).items() if dataclasses.is_dataclass(hint)
}


# --- parameters of entry points -----------------------------------------------------------------


def parameter_disagreements(func: Any, options: type) -> list[str]:
    """Parameters of ``func`` (a function, or a dataclass: its fields) named like a field of
    ``options`` whose default differs from it."""
    if dataclasses.is_dataclass(func):
        declared = defaults_of(func)
    else:
        declared = {name: p.default for name, p in inspect.signature(func).parameters.items()
                    if p.default is not inspect.Parameter.empty}
    defaults = defaults_of(options)
    return [f"{getattr(func, '__qualname__', func)}({name}={value!r}) but {options.__name__}.{name} = {defaults[name]!r}"
            for name, value in declared.items() if name in defaults and not _same(value, defaults[name])]


def _options_for(obj: Any) -> type | None:
    module = getattr(obj, "__module__", "") or ""
    return next((cls for prefix, cls in OPTIONS_OF_MODULE.items() if module.startswith(prefix)), None)


def _callables_of(obj: Any) -> list[Any]:
    """A function, or a class's constructor (a dataclass: the class) and the public methods it defines."""
    if inspect.isclass(obj):
        methods = [m for n, m in vars(obj).items() if inspect.isfunction(m) and not n.startswith("_")]
        constructor = [obj] if dataclasses.is_dataclass(obj) else [obj.__init__] if "__init__" in vars(obj) else []
        return [*constructor, *methods]
    return [obj] if inspect.isfunction(obj) else []


def public_entry_points() -> dict[str, Any]:
    """Every function or class in the public modules' ``__all__``, and in the ``__all__`` of every
    module of the export and evaluate packages, keyed by where it is defined."""
    modules = [importlib.import_module(m) for m in PUBLIC_MODULES]
    for package in ("nemo_moe_export.export", "nemo_moe_export.evaluate"):
        path = importlib.import_module(package).__path__
        modules += [importlib.import_module(f"{package}.{m.name}") for m in pkgutil.iter_modules(path)]
    found = {}
    for module in modules:
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and _options_for(obj) is not None:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


ENTRY_POINTS = public_entry_points()
# Disagreements in files other engineers are changing, each strict: the test fails as soon as one is
# fixed, so its entry here is removed with the fix.
PENDING: dict[str, str] = {}  # entry point -> why its disagreement is still open


def test_the_entry_points_that_matter_are_checked():
    names = {k.rsplit(".", 1)[-1] for k in ENTRY_POINTS}
    assert {"evaluate_mmlu", "prepare_questions", "MMLUCallback", "export_hf_checkpoint", "ExportStep",
            "phase_coordinator"} <= names, sorted(names)


@pytest.mark.parametrize("qualified", [
    pytest.param(q, marks=pytest.mark.xfail(strict=True, reason=PENDING[q])) if q in PENDING else q
    for q in sorted(ENTRY_POINTS)])
def test_entry_point_parameters_take_the_options_defaults(qualified):
    obj = ENTRY_POINTS[qualified]
    problems = [p for func in _callables_of(obj) for p in parameter_disagreements(func, _options_for(obj))]
    assert not problems, "a default declared twice, with different values:\n" + "\n".join(problems)


def test_plugin_hooks_and_make_context_restate_no_options():
    """They pass settings through to the callback and the export step, never with defaults of their own."""
    from nemo_moe_export.hooks import make_context
    from nemo_moe_export.plugin import plugin_hooks

    fields = set(defaults_of(MMLUOptions)) | set(defaults_of(ExportOptions))
    for func in (plugin_hooks, make_context):
        assert not fields & set(inspect.signature(func).parameters), func


# --- command-line flags --------------------------------------------------------------------------


def flag_disagreements(source: str, where: str) -> list[str]:
    """``add_argument("--batch-size", default=8)`` calls whose flag names an options field with another default."""
    defaults = {**defaults_of(ExportOptions), **defaults_of(MMLUOptions)}
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args):
            continue
        flag = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
        name = str(flag).lstrip("-").replace("-", "_")
        default = next((k.value for k in node.keywords if k.arg == "default"), None)
        if name in defaults and isinstance(default, ast.Constant) and not _same(default.value, defaults[name]):
            out.append(f"{where}: {flag} default={default.value!r} but the options say {defaults[name]!r}")
    return out


def test_command_line_flags_take_the_options_defaults():
    problems = [p for path in sorted(PACKAGE_DIR.rglob("*.py"))
                for p in flag_disagreements(path.read_text(), str(path.relative_to(PACKAGE_DIR)))]
    assert not problems, "\n".join(problems)


# --- the config schemas --------------------------------------------------------------------------


@pytest.mark.parametrize("config,options,own", [
    (schemas.MMLUConfig, MMLUOptions, {"enabled", "data_path"}),
    (schemas.ExportConfig, ExportOptions, {"output_dir", "from_checkpoint"}),
])
def test_config_groups_extend_the_options_with_their_own_fields_only(config, options, own):
    assert issubclass(config, options)
    assert set(defaults_of(config)) - set(defaults_of(options)) == own
    inherited = {k: v for k, v in defaults_of(config).items() if k not in own}
    assert inherited == defaults_of(options), "a config group redeclares an option's default"


# --- YAML presets and recipes --------------------------------------------------------------------


def _stated(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    return {k: v for k, v in data.items() if k != "defaults"}


def restated_keys(stated: dict[str, Any], schema: type, defaults: dict[str, Any], where: str) -> list[str]:
    """Keys of a preset or recipe group that ``schema`` does not declare, or that equal what they
    would be without them (``defaults``)."""
    declared = {f.name for f in dataclasses.fields(schema)}
    out = []
    for key, value in stated.items():
        if key not in declared:
            out.append(f"{where}: unknown key {key!r}")
        elif key in defaults and _same(value, defaults[key]):
            out.append(f"{where}: {key}: {value!r} restates the default")
    return out


def _presets() -> list[Path]:
    return sorted(p for p in CONF_DIR.glob("*/*.yaml") if p.parent.name in GROUP_SCHEMAS)


def test_every_group_has_presets_checked():
    assert {p.parent.name for p in _presets()} >= {"model", "parallel", "trainer", "mmlu", "export"}


@pytest.mark.parametrize("preset", _presets(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_presets_state_only_what_differs_from_the_schema(preset):
    group = preset.parent.name
    schema = GROUP_SCHEMAS[group]
    problems = restated_keys(_stated(preset), schema, defaults_of(schema), f"{group}/{preset.stem}")
    assert not problems, "presets state only what differs from the schema:\n" + "\n".join(problems)


def test_top_level_conf_files_state_no_schema_defaults():
    recipe_defaults = defaults_of(schemas.RecipeConfig)
    for path in sorted(CONF_DIR.glob("*.yaml")):
        stated = {k: v for k, v in _stated(path).items() if k != "hydra"}
        assert not restated_keys(stated, schemas.RecipeConfig, recipe_defaults, path.name), path


def _recipe_presets(recipe: Path) -> dict[str, str]:
    """The preset each group takes in a recipe's defaults list (``- model: deepseek_v3_tiny``)."""
    entries = yaml.safe_load(recipe.read_text()).get("defaults", [])
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items() if k in GROUP_SCHEMAS}


def _before_recipe(recipe: Path, group: str) -> dict[str, Any]:
    """A group's values from its schema and its preset: what the recipe's own keys change."""
    values = defaults_of(GROUP_SCHEMAS[group])
    preset = _recipe_presets(recipe).get(group)
    if preset is not None:
        values.update(_stated(CONF_DIR / group / f"{preset}.yaml"))
    return values


RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_state_only_what_differs_from_their_presets(recipe):
    stated = _stated(recipe)
    problems = []
    for group in GROUP_SCHEMAS:
        problems += restated_keys(stated.get(group) or {}, GROUP_SCHEMAS[group], _before_recipe(recipe, group),
                                  f"{recipe.stem}: {group}")
    top = {k: v for k, v in stated.items() if k not in GROUP_SCHEMAS and k not in RECIPE_IDENTITY_KEYS}
    problems += restated_keys(top, schemas.RecipeConfig, defaults_of(schemas.RecipeConfig), recipe.stem)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_composed_recipe_is_the_schema_defaults_plus_what_presets_and_recipe_state(recipe):
    """Nothing else sets a value: no hidden default in base.yaml, the CLI or the composition."""
    from omegaconf import OmegaConf

    from nemo_moe_export.job.compose import load_config

    composed = OmegaConf.to_container(load_config(recipe.stem), resolve=True)
    stated = _stated(recipe)
    for group in GROUP_SCHEMAS:
        expected = {**_before_recipe(recipe, group), **(stated.get(group) or {})}
        got = composed[group]
        wrong = {k: (got.get(k), expected.get(k)) for k in {*got, *expected} if not _same(got.get(k), expected.get(k))}
        assert not wrong, f"{recipe.stem}.{group}: composed vs expected {wrong}"


def test_the_default_recipe_is_checked():
    from nemo_moe_export.job.compose import DEFAULT_RECIPE

    assert DEFAULT_RECIPE in {r.stem for r in RECIPES}


# --- the checks catch a planted disagreement ----------------------------------------------------


def test_checks_catch_planted_disagreements():
    def evaluate(model, *, batch_size=8, timeout_s=600.0, k_shot=5):  # batch_size: MMLUOptions says 16
        pass

    assert parameter_disagreements(evaluate, MMLUOptions) == [
        "test_checks_catch_planted_disagreements.<locals>.evaluate(batch_size=8) but MMLUOptions.batch_size = 16"]

    def export(path, *, overwrite="replace", keep_dtype=(), max_shard_size="5GB"):
        pass

    assert [p.split(" but")[0].rsplit("(", 1)[1] for p in parameter_disagreements(export, ExportOptions)] == [
        "overwrite='replace')"]
    assert flag_disagreements('p.add_argument("--timeout-s", type=float, default=300.0)', "x.py") == [
        "x.py: --timeout-s default=300.0 but the options say 600.0"]
    export, trainer = schemas.ExportConfig, schemas.TrainerConfig
    assert restated_keys({"overwrite": "replace", "max_shard_size": "5GB"}, export, defaults_of(export),
                         "export/planted") == ["export/planted: max_shard_size: '5GB' restates the default"]
    assert restated_keys({"lr": 3.0e-3, "batch_size": 16}, trainer, defaults_of(trainer), "trainer/planted") == [
        "trainer/planted: lr: 0.003 restates the default", "trainer/planted: batch_size: 16 restates the default"]
    assert restated_keys({"learning_rate": 1.0}, trainer, defaults_of(trainer), "trainer/planted") == [
        "trainer/planted: unknown key 'learning_rate'"]


def test_same_compares_as_yaml_does():
    assert _same(3.0e-3, 0.003) and _same((), []) and _same(None, None) and _same(16, 16.0)
    assert not _same(True, 1) and not _same("5GB", "5 GB") and not _same(None, []) and not _same(0, None)
