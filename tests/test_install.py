"""The package installs like any other plugin (issue #12).

The wheel and the sdist are built from a copy of this checkout; the wheel is installed, not
editable, into a fresh virtual environment that borrows this environment's installed dependencies;
the installed ``nemo-moe-export`` then runs from an empty folder: ``verify`` on a real checkpoint, a
packaged recipe on two ranks, and a user recipe from a ``--config-dir`` folder. The second half
checks the config-folder search order in process (``nemo_moe_export/job/compose.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from nemo_moe_export.errors import InputError
from nemo_moe_export.job.compose import CONFIG_PATH_ENV, load_config, split_recipe_args

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "nemo_moe_export"
# Small enough to run in seconds; the stage code is the same as in the full recipe.
QUICK = ["trainer.max_steps=2", "trainer.progress=false", "trainer.save_checkpoint=false", "data.n_train=16",
         "data.n_test=4", "mmlu.max_questions=4", "mmlu.every_n_steps=null"]


def _config_files() -> set[str]:
    """Every YAML the CLI needs, as paths inside a wheel: the config groups and the recipes."""
    found = {p for folder in ("conf", "recipes") for p in (PACKAGE_DIR / folder).rglob("*.yaml")}
    return {f"nemo_moe_export/{p.relative_to(PACKAGE_DIR).as_posix()}" for p in found}


def _run(cmd: list, *, timeout: int = 240, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check:
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def build_root(tmp_path_factory) -> Path:
    """A copy of the checkout to build from: building in place would write build/ and *.egg-info into
    a checkout others use, and a stale build/lib could put files in the wheel the source no longer has."""
    root = tmp_path_factory.mktemp("build")
    shutil.copytree(REPO, root / "src", ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "runs", "outputs", "*.egg-info", "__pycache__", ".pytest_cache"))
    return root


@pytest.fixture(scope="module")
def wheel(build_root) -> Path:
    out = build_root / "wheel"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", out, build_root / "src"])
    (built,) = out.glob("nemo_moe_export-*.whl")
    return built


@pytest.fixture(scope="module")
def sdist(build_root) -> Path:
    # The PEP 517 hook that `python -m build --sdist` calls; `build` itself is not installed here.
    out = build_root / "sdist"
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
          out], cwd=build_root / "src")
    (built,) = out.glob("nemo_moe_export-*.tar.gz")
    return built


@pytest.fixture(scope="module")
def fresh(wheel, tmp_path_factory) -> dict:
    """A fresh venv with the wheel installed; its other imports come from this environment's site
    folders, listed in a .pth file. Only the folders: the .pth files inside them (among them the
    editable install's finder) are not run, so the checkout cannot leak in."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    # Installed before the .pth exists, so pip sees an empty environment and removes nothing.
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    borrowed = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "_borrowed_dependencies.pth").write_text("".join(f"{p}\n" for p in borrowed))
    empty = tmp_path_factory.mktemp("empty-cwd")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "NEMO_MOE_EXPORT_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false", PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return {"python": python, "cli": venv / "bin" / "nemo-moe-export", "site": site, "cwd": empty, "env": env}


def _cli(fresh: dict, *args, **kwargs) -> subprocess.CompletedProcess:
    """The installed console script, run from an empty folder."""
    assert not any(fresh["cwd"].iterdir()), "the working folder must stay empty"
    return _run([fresh["cli"], *args], cwd=fresh["cwd"], env=fresh["env"], **kwargs)


def _write_user_recipe(folder: Path) -> None:
    """A recipe of the user's own: the package's base and presets plus a model preset of its own."""
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "one_layer_qwen.yaml").write_text("defaults:\n  - schema\n\nfamily: qwen3_moe\nnum_layers: 1\n")
    (folder / "my_tiny.yaml").write_text(
        "defaults:\n  - base\n  - model: one_layer_qwen\n  - parallel: fsdp\n  - trainer: default\n"
        "  - mmlu: default\n  - export: default\n  - _self_\n\nname: my_tiny\nstages: [train, export]\n")


# -- the built artefacts ---------------------------------------------------------------------------

def test_wheel_carries_every_config_file(wheel):
    expected = _config_files()
    assert {"nemo_moe_export/conf/base.yaml", "nemo_moe_export/recipes/deepseek_v3_tiny.yaml"} <= expected
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert "License-Expression: Apache-2.0" in metadata


def test_sdist_carries_every_config_file(sdist):
    with tarfile.open(sdist) as tf:
        names = {name.split("/", 1)[1] for name in tf.getnames() if "/" in name}
    expected = _config_files()
    assert expected <= names, f"missing from the sdist: {sorted(expected - names)}"
    assert {"pyproject.toml", "README.md"} <= names


# -- the installed command, from an empty folder ---------------------------------------------------

def test_the_import_is_the_wheel_not_the_checkout(fresh):
    probe = ("import json, sys, nemo_moe_export; from nemo_moe_export.job.compose import packaged_dir; "
             "print(json.dumps({'file': nemo_moe_export.__file__, 'path': sys.path, "
             "'conf': str(packaged_dir('conf')), 'recipes': str(packaged_dir('recipes'))}))")
    seen = json.loads(_run([fresh["python"], "-c", probe], cwd=fresh["cwd"], env=fresh["env"]).stdout)
    site = str(fresh["site"])
    assert seen["file"].startswith(site + os.sep), seen["file"]
    assert seen["conf"].startswith(site + os.sep) and seen["recipes"].startswith(site + os.sep)
    assert str(REPO) not in seen["path"] and str(PACKAGE_DIR) not in seen["path"]


def test_verify_a_real_checkpoint(fresh, tmp_path):
    from nemo_moe_export.tiny_models import tiny_model

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "ckpt")
    proc = _cli(fresh, "verify", tmp_path / "ckpt")
    assert "OK" in proc.stdout


def test_packaged_recipe_on_two_ranks(fresh, tmp_path):
    run_dir = tmp_path / "run"
    _cli(fresh, "recipe=deepseek_v3_tiny", *QUICK, f"run_dir={run_dir}", "--nproc", "2", timeout=280)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["train"]["steps"] == 2 and results["verify"]["ok"]
    assert list((run_dir / "hf").glob("*.safetensors"))
    assert (run_dir / "logs" / "rank1.log").exists()


def test_user_recipe_from_a_config_dir(fresh, tmp_path):
    user = tmp_path / "my conf"  # a space on purpose: the path goes through Hydra's override grammar
    _write_user_recipe(user)
    run_dir = tmp_path / "run"
    _cli(fresh, "recipe=my_tiny", "--config-dir", user, *QUICK, f"run_dir={run_dir}")
    results = json.loads((run_dir / "results.json").read_text())
    assert results["train"]["steps"] == 2 and "mmlu" not in results
    hf_config = json.loads((run_dir / "hf" / "config.json").read_text())
    assert hf_config["num_hidden_layers"] == 1 and hf_config["model_type"] == "qwen3_moe"


def test_unknown_recipe_names_every_searched_folder(fresh, tmp_path):
    _write_user_recipe(tmp_path / "user")
    proc = _cli(fresh, "recipe=mixtral_tiny", f"--config-dir={tmp_path / 'user'}", check=False, timeout=120)
    assert proc.returncode != 0
    assert "unknown recipe" in proc.stderr and "'mixtral_tiny'" in proc.stderr
    assert f"{tmp_path / 'user'}: ['my_tiny']" in proc.stderr
    assert f"{fresh['site'] / 'nemo_moe_export' / 'recipes'}: [" in proc.stderr and "deepseek_v3_tiny" in proc.stderr


def test_the_launcher_does_not_import_the_cli():
    # nemo_run.py and cli.py share job/compose.py instead of importing each other.
    probe = ("import sys, nemo_moe_export.integrations.nemo_run; "
             "assert 'nemo_moe_export.cli' not in sys.modules, 'nemo_run imports cli'")
    _run([sys.executable, "-c", probe], timeout=120)


# -- the search order, in process ------------------------------------------------------------------

def _recipe(folder: Path, name: str, recipe_name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{recipe_name}.yaml").write_text(f"defaults:\n  - deepseek_v3_tiny\n  - _self_\n\nname: {name}\n")
    return folder


def test_split_recipe_args_takes_config_dirs():
    args = split_recipe_args(["recipe=x", "--config-dir", "a", "trainer.max_steps=3", "--config-dir=b", "--nproc=2"])
    assert args == ("x", ["trainer.max_steps=3"], 2, ["a", "b"])


def test_a_user_recipe_builds_on_a_packaged_one(tmp_path):
    cfg = load_config("mine", ["trainer.max_steps=5"], [_recipe(tmp_path / "u", "mine", "mine")])
    assert (cfg.name, cfg.model.family, cfg.trainer.max_steps) == ("mine", "deepseek_v3", 5)


def test_user_folders_shadow_the_package(tmp_path):
    user = _recipe(tmp_path / "u", "from_the_package_recipe", "qwen3_moe_tiny")
    (user / "trainer").mkdir()
    (user / "trainer" / "default.yaml").write_text("defaults:\n  - schema\n\nlr: 0.125\n")
    # A recipe of the user's named like a packaged one wins; so does a preset, for packaged recipes too.
    shadowed = load_config("qwen3_moe_tiny", [], [user])
    assert shadowed.name == "from_the_package_recipe" and shadowed.model.family == "deepseek_v3"
    assert load_config("deepseek_v3_tiny", [], [user]).trainer.lr == 0.125
    assert load_config("deepseek_v3_tiny").trainer.lr != 0.125


def test_command_line_folders_come_before_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_PATH_ENV, os.pathsep.join([str(_recipe(tmp_path / "env1", "env1", "r")),
                                                         str(_recipe(tmp_path / "env2", "env2", "only_env2"))]))
    assert load_config("r").name == "env1"
    assert load_config("only_env2").name == "env2"
    assert load_config("r", [], [_recipe(tmp_path / "cli", "cli", "r")]).name == "cli"


@pytest.mark.parametrize(
    "setup,pattern",
    [
        (lambda tmp, mp: ([str(tmp / "nowhere")], []), r"config folder not found \(key '--config-dir'\).*nowhere"),
        (lambda tmp, mp: mp.setenv(CONFIG_PATH_ENV, str(tmp / "gone")) or ([], []),
         rf"config folder not found \(key '{CONFIG_PATH_ENV}'\).*gone"),
        (lambda tmp, mp: mp.setenv("NEMO_MOE_EXPORT_CONF", str(tmp)) or ([], []),
         rf"no longer read \(key 'NEMO_MOE_EXPORT_CONF'\).*--config-dir"),
        (lambda tmp, mp: ([], ["hydra.searchpath=[file:///x]"]), r"key 'hydra.searchpath'.*--config-dir"),
    ],
    ids=["missing-cli-folder", "missing-env-folder", "retired-env", "searchpath-override"],
)
def test_config_folder_errors_say_what_to_do(setup, pattern, tmp_path, monkeypatch):
    config_dirs, overrides = setup(tmp_path, monkeypatch)
    with pytest.raises(InputError, match=pattern):
        load_config("deepseek_v3_tiny", overrides, config_dirs)
