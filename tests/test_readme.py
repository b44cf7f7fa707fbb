"""The README and every page of docs/ are real: every block is checked against the package, and run
where it can be.

* ```python blocks import only public modules and names (no ``_private`` module, every imported name
  in its module's ``__all__``), every ``nemo_moe_export...`` attribute they use exists, and each block
  runs, on one real gloo rank, with what a training script has at hand:

  - ``model``: a tiny DeepSeek-V3 MoE (64 experts) sharded with ``fully_shard``, so its parameters
    are DTensors; ``dtensor_param``: one of its expert weights;
  - ``tokenizer`` (also ``tok``): the word-level tokenizer of the synthetic corpus;
  - ``max_steps``: a short training loop's length;
  - ``unsplit_model``: a tiny DeepSeek-V3 MoE as built, before any sharding (to split into stages);
  - in the working directory: ``data/mmlu`` (a synthetic MMLU-format corpus) and
    ``path/to/hf_checkpoint`` (the model saved by ``save_pretrained``).

  Each block gets a fresh working directory, so two blocks may write the same ``out/`` paths.
* ```bash blocks: every ``nemo-moe-export`` subcommand and ``--flag`` exists (read from the CLI's own
  ``--help``), and every recipe command composes with its overrides (Hydra parses and type-checks
  them); ``make`` targets, ``python path.py`` scripts and the files other commands name exist, and
  ``pip install`` lines are the Makefile's pins. A command that needs GPUs says so in its comment.
* Each docs page opens with when you need it and one command; those commands run, on the tiny
  models, in one scratch directory (recipe runs first, so ``verify runs/...`` finds their export):
  each recipe or script in its own process, ``verify`` / ``plan`` / ``python -c`` together in one.
  A comment ``# exit N: ...`` states a command's expected exit status; ``prints `X``` after the
  block states what its output holds.
* ```yaml blocks whose first line names a file (``# my_conf/my_moe.yaml``) are written there, so the
  commands that use them compose against them; a recipe among them composes.
* Inline ``config.key=value`` spans name declared config keys, ``module.attr`` spans exist, and
  package paths exist; relative links and ``docs/design.md#anchor`` citations resolve.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

import nemo_moe_export
from nemo_moe_export.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
PACKAGE_DIR = Path(nemo_moe_export.__file__).parent
CLI = [sys.executable, "-m", "nemo_moe_export"]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


class Block(NamedTuple):
    page: str
    lang: str
    line: int  # 1-based line of the opening fence
    text: str


def page_blocks(page: Path, lang: str | None = None) -> list[Block]:
    """The fenced blocks of ``page`` in ``lang`` (every language when None)."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^```(\w*)\s*$", lines[i])
        if match:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if lang is None or match.group(1) == lang:
                blocks.append(Block(_name(page), match.group(1), i + 1, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


PYTHON = [b for page in PAGES for b in page_blocks(page, "python")]
BASH = [b for page in PAGES for b in page_blocks(page, "bash")]
YAML = [b for page in PAGES for b in page_blocks(page, "yaml")]


def _ids(blocks: list[Block]) -> list[str]:
    return [f"{b.page}:{b.line}" for b in blocks]


def test_the_readme_has_code_to_check():
    readme = [b for b in PYTHON + BASH + YAML if b.page == "README.md"]
    assert {b.lang for b in readme} == {"python", "bash", "yaml"}
    assert len(PYTHON) >= 8 and len(BASH) >= 15 and YAML


# --- python: public imports and attributes -------------------------------------------------------


def _is_public_module(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def _resolve(dotted: str) -> Any:
    """``nemo_moe_export.a.b.c``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def import_problems(source: str) -> list[str]:
    """What a block imports or uses from nemo_moe_export that is private or does not exist."""
    problems = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nemo_moe_export":
            if not _is_public_module(node.module):
                problems.append(f"imports from the private module {node.module}")
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    problems.append(f"{node.module} has no {alias.name}")
                elif alias.name not in getattr(module, "__all__", ()):
                    problems.append(f"{alias.name} is not in {node.module}.__all__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nemo_moe_export":
                    if not _is_public_module(alias.name):
                        problems.append(f"imports the private module {alias.name}")
                    else:
                        importlib.import_module(alias.name)
        elif isinstance(node, ast.Attribute) and (_dotted(node) or "").startswith("nemo_moe_export."):
            try:
                _resolve(_dotted(node))
            except (ImportError, AttributeError):
                problems.append(f"{_dotted(node)} does not exist")
    return problems


@pytest.mark.parametrize("block", PYTHON, ids=_ids(PYTHON))
def test_python_block_uses_only_public_names_that_exist(block):
    problems = import_problems(block.text)
    assert not problems, f"{block.page}:{block.line}: " + "; ".join(problems)


def test_the_import_check_catches_private_and_missing_names():
    assert import_problems("from nemo_moe_export.integrations._common import plugin_hooks") == [
        "imports from the private module nemo_moe_export.integrations._common"]
    assert import_problems("from nemo_moe_export import export_hf_checkpointt") == [
        "nemo_moe_export has no export_hf_checkpointt"]
    assert import_problems("import nemo_moe_export\nnemo_moe_export.hooks.plugin_hookz") == [
        "nemo_moe_export.hooks.plugin_hookz does not exist"]
    assert import_problems("from nemo_moe_export.export.step import plan_export") == [
        "plan_export is not in nemo_moe_export.export.step.__all__"]


# --- python: the blocks run ----------------------------------------------------------------------


def _prepare_assets(root: Path) -> dict[str, Any]:
    """The namespace a page's block runs in (see the module docstring); files under ``root``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nemo_moe_export.job.data import build_tokenizer, write_synthetic_mmlu
    from nemo_moe_export.tiny_models import tiny_model

    data = write_synthetic_mmlu(root / "data" / "mmlu", n_train=8, n_dev=5, n_test=3)
    tokenizer = build_tokenizer(data)
    model = tiny_model("deepseek_v3", n_experts=64, vocab_size=len(tokenizer))
    model.save_pretrained(root / "path" / "to" / "hf_checkpoint")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dtensor_param = model.model.layers[1].mlp.experts.gate_up_proj
    assert isinstance(dtensor_param, torch.distributed.tensor.DTensor)
    unsplit_model = tiny_model("deepseek_v3", n_experts=8, vocab_size=len(tokenizer))
    return dict(model=model, tokenizer=tokenizer, tok=tokenizer, max_steps=3, dtensor_param=dtensor_param,
                unsplit_model=unsplit_model)


def _run_blocks(rank: int, world: int, sources: list[str], root: str) -> list[str | None]:
    """On one gloo rank: each block in a fresh directory holding the assets; its traceback or None."""
    import contextlib
    import io
    import traceback

    assets_dir = Path(root) / "assets"
    namespace = _prepare_assets(assets_dir)
    outcomes: list[str | None] = []
    for i, source in enumerate(sources):
        cwd = Path(root) / f"block{i}"
        (cwd / "data").mkdir(parents=True)
        (cwd / "data" / "mmlu").symlink_to(assets_dir / "data" / "mmlu")
        (cwd / "path").symlink_to(assets_dir / "path")
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(source, f"block {i}", "exec"), dict(namespace))
            outcomes.append(None)
        except BaseException:  # reported by the test of that block
            outcomes.append(traceback.format_exc())
    return outcomes


@pytest.fixture(scope="module")
def block_outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    return spawn(_run_blocks, 1, [b.text for b in PYTHON], str(root), timeout_s=240)[0]


@pytest.mark.parametrize("index", range(len(PYTHON)), ids=_ids(PYTHON))
def test_python_block_runs(block_outcomes, index):
    block = PYTHON[index]
    assert block_outcomes[index] is None, f"{block.page}:{block.line} failed:\n{block_outcomes[index]}"


# --- bash: subcommands, flags, overrides ---------------------------------------------------------


def _help(*args: str) -> str:
    proc = subprocess.run([*CLI, *args, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def cli_help() -> dict[str | None, str]:
    """The help text of the main job and of each subcommand the main help lists."""
    main = _help()
    subcommands = set(re.findall(r"^\s*nemo-moe-export ([a-z][a-z_-]*)\b(?!=)", main, flags=re.M))
    return {None: main, **{sub: _help(sub) for sub in sorted(subcommands)}}


def _flags(help_text: str) -> dict[str, bool]:
    """``--flag`` -> whether it takes a value, from usage and help lines (``--nproc N``)."""
    return {m.group(1): bool(m.group(2)) for m in re.finditer(r"(--[a-z][\w-]*)(?:[ =]([A-Z][A-Z_]*|\.\.\.))?",
                                                               help_text)}


class Command(NamedTuple):
    page: str
    line: int
    argv: list[str]
    comment: str  # what follows `` # `` on the command's line


def block_commands(block: Block) -> list[Command]:
    commands = []
    text = block.text.replace("\\\n", " ")
    for offset, raw in enumerate(text.splitlines()):
        argv = shlex.split(raw, comments=True)
        if argv:
            match = re.search(r"\s#\s+(.*)$", raw)
            comment = match.group(1) if match and shlex.split(raw[:match.start()]) == argv else ""
            commands.append(Command(block.page, block.line + 1 + offset, argv, comment))
    return commands


def bash_commands() -> list[Command]:
    return [c for block in BASH for c in block_commands(block)]


def _cid(command: Command) -> str:
    return f"{command.page}:{command.line}"


def _package_args(argv: list[str]) -> list[str] | None:
    """The arguments of ``nemo-moe-export ...``, ``python -m nemo_moe_export ...`` or
    ``torchrun ... -m nemo_moe_export ...``; None for other commands."""
    if argv[0] == "nemo-moe-export":
        return argv[1:]
    if "-m" in argv and argv[argv.index("-m") + 1] == "nemo_moe_export":
        return argv[argv.index("-m") + 2:]
    return None


PACKAGE_COMMANDS = [c for c in bash_commands() if _package_args(c.argv) is not None]
OTHER_COMMANDS = [c for c in bash_commands() if _package_args(c.argv) is None]


def test_bash_blocks_name_package_commands():
    assert len(PACKAGE_COMMANDS) >= 20, PACKAGE_COMMANDS


def _scratch_with_yaml_files(root: Path) -> Path:
    """``root`` holding every yaml block that names its file on its first line."""
    for block in YAML:
        match = re.match(r"#\s*(\S+\.yaml)\s*$", block.text.splitlines()[0])
        if match:
            path = root / match.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.text)
    return root


def _split_own_flags(args: list[str], own: dict[str, bool]) -> tuple[list[str], list[str]]:
    """A subcommand's own ``--flag [value]`` tokens, and the rest (recipe args for the main job)."""
    mine, rest, args = [], [], list(args)
    while args:
        arg = args.pop(0)
        flag = arg.split("=", 1)[0]
        if flag in own:
            mine.append(arg)
            if own[flag] and "=" not in arg and args:
                mine.append(args.pop(0))
        else:
            rest.append(arg)
    return mine, rest


@pytest.mark.parametrize("command", PACKAGE_COMMANDS, ids=[_cid(c) for c in PACKAGE_COMMANDS])
def test_bash_command_flags_exist_and_overrides_compose(command, cli_help, tmp_path, monkeypatch):
    from nemo_moe_export.job.compose import load_config, split_recipe_args

    where = _cid(command)
    args = _package_args(command.argv)
    sub = args[0] if args and args[0] in cli_help else None
    if sub is None and args and not args[0].startswith("-") and "=" not in args[0]:
        pytest.fail(f"{where}: unknown subcommand {args[0]!r}; known: {sorted(k for k in cli_help if k)}")
    if sub == "launch" and args[1:2] == ["convert"]:  # the conversion as a NeMo-Run job: convert's flags
        sub, args = "convert", args[1:]
    args = args[1:] if sub else args
    known = {**_flags(cli_help[None]), **_flags(cli_help[sub])}
    unknown = [a for a in args if a.startswith("--") and a.split("=", 1)[0] not in known]
    assert not unknown, f"{where}: unknown flags {unknown}; known: {sorted(known)}"
    if sub not in (None, "launch"):
        return  # verify and the like take paths that exist only after a run
    own = {f: v for f, v in _flags(cli_help[sub]).items() if f not in _flags(cli_help[None])} if sub else {}
    _, recipe_args = _split_own_flags(args, own)
    monkeypatch.chdir(_scratch_with_yaml_files(tmp_path))
    recipe, overrides, _nproc, config_dirs = split_recipe_args(recipe_args)
    load_config(recipe, overrides, config_dirs)  # Hydra parses, type-checks and composes


def _makefile_value(name: str) -> list[str]:
    return re.search(rf"^{name}\s*\?=\s*(.+)$", (ROOT / "Makefile").read_text(), flags=re.M)[1].split()


@pytest.mark.parametrize("command", OTHER_COMMANDS, ids=[_cid(c) for c in OTHER_COMMANDS])
def test_other_bash_commands_name_what_exists(command):
    argv, where = command.argv, _cid(command)
    if argv[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert set(argv[1:]) <= targets, f"{where}: make {argv[1:]}; targets {sorted(targets)}"
    elif argv[0] == "python" and argv[1] == "-c":
        problems = import_problems(argv[2])
        assert not problems, f"{where}: " + "; ".join(problems)
    elif argv[0] == "python" and argv[1].endswith(".py"):
        assert (ROOT / argv[1]).is_file(), f"{where}: {argv[1]} not found"
    elif argv[:2] == ["pip", "install"]:  # the Makefile's pins (torch, AutoModel), or this package itself
        allowed = (["."], _makefile_value("TORCH"), ["--no-deps", *_makefile_value("AUTOMODEL")])
        assert argv[2:] in allowed, f"{where}: pip install {argv[2:]}; the Makefile installs {allowed}"
    elif argv[0] == "automodel":  # AutoModel's own launcher, on a recipe file of this repository
        assert (ROOT / argv[1]).is_file(), f"{where}: {argv[1]} not found"
    else:
        pytest.fail(f"{where}: a command this test does not know how to check: {argv[0]}")


# --- bash: the commands that need GPUs say so -----------------------------------------------------

_GPU_ONLY = ("parallel.device=cuda", "recipe=deepseek_v3_gpu", "--slurm-account")


def needs_gpus(argv: list[str]) -> bool:
    """A command that runs only on GPUs (or too slowly without): the GPU recipe or device, Slurm, more
    ranks than a CPU test machine holds, AutoModel's CUDA launcher, a GPU benchmark."""
    if argv[0] == "automodel" or any(a in _GPU_ONLY for a in argv):
        return True
    if (_package_args(argv) or [None])[0] == "plan":
        return False  # the planner simulates every rank in one process
    for flag in ("--nproc", "--nproc-per-node"):
        if flag in argv and int(argv[argv.index(flag) + 1]) > 4:
            return True
    script = next((a for a in argv if a.endswith(".py")), "")
    return "gpu" in Path(script).name and "parallel.device=cpu" not in argv


@pytest.mark.parametrize("command", bash_commands(), ids=[_cid(c) for c in bash_commands()])
def test_commands_that_need_gpus_say_so(command):
    if needs_gpus(command.argv):
        assert "gpu" in command.comment.lower(), f"{_cid(command)}: needs GPUs; its comment must say so"


# --- each page's command runs ---------------------------------------------------------------------


class PageCommand(NamedTuple):
    command: Command
    prints: str | None  # what its output holds, from the ``prints `X``` line after its block


def page_command(page: Path) -> PageCommand:
    """The command a docs page opens with: the first line of its first block, which is bash."""
    first = page_blocks(page)[0]
    assert first.lang == "bash", f"{_name(page)}:{first.line}: the page's first block is not bash"
    after = page.read_text().splitlines()[first.line + first.text.count("\n"):]
    said = next((line for line in after if line.strip()), "")
    prints = re.match(r"prints `([^`]+)`", said)
    if prints:
        return PageCommand(block_commands(first)[0], prints.group(1))
    shown = [b for b in page_blocks(page) if b.line > first.line][:1]
    if said.startswith("prints") and shown and shown[0].lang == "text":  # prints ...:  then the output
        return PageCommand(block_commands(first)[0], shown[0].text.splitlines()[0])
    return PageCommand(block_commands(first)[0], None)


MANUAL = [page for page in DOCS if page.name != "design.md"]
PAGE_COMMANDS = {_name(page): page_command(page) for page in MANUAL}


@pytest.mark.parametrize("page", MANUAL, ids=[_name(p) for p in MANUAL])
def test_each_page_opens_with_when_you_need_it_then_a_command(page):
    lines = [line for line in page.read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# "), f"{_name(page)}: no title"
    assert lines[1].startswith("**When you need it:**"), f"{_name(page)}: the title is not followed by when you need it"
    assert PAGE_COMMANDS[_name(page)].command  # page_command checked the first block is bash


def _expected_status(command: Command) -> int:
    match = re.match(r"exit (\d+):", command.comment)
    return int(match.group(1)) if match else 0


def _kind(argv: list[str]) -> str:
    """``recipe`` (a run or a launch: its own process, first), ``script`` (its own process), or
    ``inline`` (``verify``, ``plan``, ``python -c``: one process for all, after the runs)."""
    args = _package_args(argv)
    if args is not None:
        return "inline" if args and args[0] in ("verify", "plan") else "recipe"
    return "inline" if argv[:2] == ["python", "-c"] else "script"


RUNNABLE = sorted({tuple(pc.command.argv): pc.command for pc in PAGE_COMMANDS.values()
                   if not needs_gpus(pc.command.argv)}.values(),
                  key=lambda c: ["recipe", "script", "inline"].index(_kind(c.argv)))


def _run_inline(commands: list[list[str]]) -> list[tuple[int, str]]:
    """In this process, one after another: each ``verify`` / ``plan`` through the CLI's ``main``, each
    ``python -c`` through ``exec``; the exit status and output of each."""
    import contextlib
    import io

    from nemo_moe_export.cli import main

    outcomes = []
    for argv in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                status = main(_package_args(argv)) if _package_args(argv) is not None else exec(argv[2], {}) or 0
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # reported by the test of that command
                import traceback

                traceback.print_exc()
                status = 1
        outcomes.append((status, out.getvalue()))
    return outcomes


def _argv_to_run(argv: list[str]) -> list[str]:
    args = _package_args(argv)
    if args is not None:
        return [*CLI, *args]
    return [sys.executable, str(ROOT / argv[1]), *argv[2:]]  # python benchmarks/x.py ...


class PageRunner:
    """Runs the page commands in one scratch directory, each once: a recipe or script in its own
    process when its test asks; every ``inline`` one together, in one process, when the first of
    them is asked for (the tests ask in ``RUNNABLE`` order, so the recipe runs come first)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch, self.outcomes = scratch, {}
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}

    def outcome(self, argv: list[str]) -> tuple[int, str]:
        if tuple(argv) not in self.outcomes:
            if _kind(argv) == "inline":
                self._run_inline()
            else:
                proc = subprocess.run(_argv_to_run(argv), capture_output=True, text=True, timeout=280,
                                      cwd=self.scratch, env=self.env)
                self.outcomes[tuple(argv)] = (proc.returncode, proc.stdout + proc.stderr)
        return self.outcomes[tuple(argv)]

    def _run_inline(self) -> None:
        inline = [c.argv for c in RUNNABLE if _kind(c.argv) == "inline"]
        code = (f"import json, os, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); os.chdir({str(self.scratch)!r}); "
                f"from test_readme import _run_inline; print(json.dumps(_run_inline({inline!r})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280, env=self.env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        self.outcomes.update(zip(map(tuple, inline), map(tuple, json.loads(proc.stdout.splitlines()[-1]))))


@pytest.fixture(scope="module")
def page_runner(tmp_path_factory) -> PageRunner:
    return PageRunner(tmp_path_factory.mktemp("pages"))


def test_most_page_commands_run():
    assert len(RUNNABLE) >= 8, RUNNABLE


def _pages_of(command: Command) -> list[str]:
    return [page for page, pc in PAGE_COMMANDS.items() if pc.command.argv == command.argv]


@pytest.mark.parametrize("command", RUNNABLE, ids=["+".join(_pages_of(c)) for c in RUNNABLE])
def test_page_command_runs(command, page_runner):
    status, output = page_runner.outcome(command.argv)
    for page in _pages_of(command):
        mine, prints = PAGE_COMMANDS[page]
        assert status == _expected_status(mine), f"{_cid(mine)}: exit {status}\n{output[-4000:]}"
        assert prints is None or prints in output, f"{_cid(mine)}: printed no {prints!r}\n{output[-4000:]}"


@pytest.mark.parametrize("page", list(PAGE_COMMANDS), ids=list(PAGE_COMMANDS))
def test_a_page_command_that_does_not_run_needs_gpus(page):
    command = PAGE_COMMANDS[page].command
    assert any(c.argv == command.argv for c in RUNNABLE) or needs_gpus(command.argv)


def test_yaml_recipes_compose(tmp_path, monkeypatch):
    from nemo_moe_export.job.compose import load_config

    root = _scratch_with_yaml_files(tmp_path)
    recipes = [p for p in root.rglob("*.yaml") if "base" in (yaml.safe_load(p.read_text()).get("defaults") or [])]
    assert recipes, "a recipe example names its file on its first line (# my_conf/my_moe.yaml)"
    monkeypatch.chdir(root)
    for path in recipes:
        cfg = load_config(path.stem, [], [str(path.parent)])
        assert cfg.name == yaml.safe_load(path.read_text())["name"]


# --- inline spans ---------------------------------------------------------------------------------


def _config_groups() -> dict[str, type]:
    from nemo_moe_export.config import RecipeConfig

    hints = typing.get_type_hints(RecipeConfig)
    return {name: hint for name, hint in hints.items() if dataclasses.is_dataclass(hint)}


FILE_SUFFIXES = (".json", ".py", ".yaml", ".md", ".safetensors", ".png", ".toml", ".csv", ".partial")
PACKAGE_PARTS = {p.stem for p in PACKAGE_DIR.iterdir() if not p.name.startswith("_")}
PATH_ROOTS = ("nemo_moe_export", "benchmarks", "tests", "docs")


def inline_span_problems(markdown: str) -> list[str]:
    groups = _config_groups()
    problems = []
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    for span in re.findall(r"`([^`\n]+)`", prose):
        for token in span.split():
            token = re.sub(r"\(.*$", "", token)
            key = token.split("=", 1)[0]
            head = key.split(".")[0]
            if "/" in key:
                key = key.split("#")[0]  # docs/design.md#anchor: the anchors have their own test
                if key.split("/")[0] in PATH_ROOTS or key.split("/")[0] in PACKAGE_PARTS:
                    clean = key.rstrip("/")
                    if not any(next(base.glob(clean), None) for base in (ROOT, PACKAGE_DIR)):
                        problems.append(f"path {key} does not exist")
                continue
            if not re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", key) or key.endswith(FILE_SUFFIXES):
                continue
            if head in groups and key.count(".") == 1 and key.split(".")[1] in {
                    f.name for f in dataclasses.fields(groups[head])}:
                continue  # a config key, e.g. export.overwrite=replace
            if head in PACKAGE_PARTS or head == "nemo_moe_export":
                try:
                    _resolve(key if head == "nemo_moe_export" else f"nemo_moe_export.{key}")
                except (ImportError, AttributeError):
                    problems.append(f"{key} is neither a config key nor a nemo_moe_export attribute")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_inline_spans_name_config_keys_attributes_and_paths_that_exist(page):
    problems = inline_span_problems(page.read_text())
    assert not problems, f"{_name(page)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_relative_links_resolve(page):
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text())
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, f"{_name(page)}: links to {missing}"


def test_the_readme_links_every_page():
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", README.read_text()))
    assert linked == {_name(p) for p in DOCS}, sorted({_name(p) for p in DOCS} ^ linked)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _design_citations() -> dict[str, str]:
    """Every ``docs/design.md#anchor`` (and ``#anchor, "Paragraph"``) cited in the repository's code,
    tests, benchmarks, examples and pages, with one file citing it."""
    cited = {}
    paths = [README] + [path for base in ("nemo_moe_export", "tests", "benchmarks", "docs", "examples")
                        for path in sorted((ROOT / base).rglob("*"))
                        if path.suffix in (".py", ".md", ".yaml") and path.is_file() and path.name != "test_readme.py"]
    for path in paths:
        for anchor, paragraph in re.findall(r'design\.md#([\w-]+)(?:, "([^"]+)")?', path.read_text()):
            cited.setdefault((anchor, paragraph), path.relative_to(ROOT).as_posix())
    return cited


def test_design_anchors_cited_anywhere_exist():
    """A cited section must have a heading, and a cited paragraph (``#section, "Its title"``) must
    open with that bold title inside the section."""
    text = (ROOT / "docs" / "design.md").read_text()
    sections = {_anchor(h): body for h, body in re.findall(r"^#+ (.*)\n((?:(?!^#).*\n?)*)", text, flags=re.M)}
    cited = _design_citations()
    missing = {f"{a}, {p!r}" if p else a: where for (a, p), where in cited.items()
               if a not in sections or (p and f"**{p}" not in sections[a])}
    assert not missing, f"design.md has no heading or paragraph for {missing}"
    assert ("coordination-protocol", "The model's groups are bounded too") in cited  # the check reads them


def _layout_entries(tree: str) -> dict[str, str]:
    """The package tree of docs/layout.md by entry: ``{"parallel/": its lines, "cli.py": ...}`` (an
    entry is a line indented two spaces and the deeper lines under it)."""
    entries: dict[str, str] = {}
    current = None
    for line in tree.splitlines()[1:]:
        if match := re.match(r"^  ([\w.]+/?)", line):
            current = match.group(1)
            entries[current] = line
        elif re.match(r"^\S", line):
            current = None  # the next top-level folder (examples/, tests/): not the package
        elif current:
            entries[current] += "\n" + line
    return entries


def _layout_problems(entries: dict[str, str]) -> list[str]:
    """What the layout's entries get wrong about the package as it is on disk: an entry that is not
    in the package or the reverse, a module of a folder its entry does not name, a module an entry
    names that is neither in that folder nor at the package's top."""
    package = {p.name + ("/" if p.is_dir() else "") for p in PACKAGE_DIR.iterdir()
               if not p.name.startswith("_") and p.name != "__pycache__"}
    problems = [f"{name}: listed, not in the package" for name in sorted(set(entries) - package)]
    problems += [f"{name}: in the package, not listed" for name in sorted(package - set(entries))]
    for name, text in sorted(entries.items()):
        folder = PACKAGE_DIR / name
        if not name.endswith("/") or not folder.is_dir():
            continue
        problems += [f"{name}{m.name}: not named in its folder's entry" for m in sorted(folder.glob("*.py"))
                     if m.name != "__init__.py" and not re.search(rf"(?<![\w/]){re.escape(m.name)}\b", text)]
        problems += [f"{name}: names {module}, which does not exist" for module in
                     sorted(set(re.findall(r"(?<![\w/.])([a-z_]+\.py)\b", text)))
                     if not (folder / module).exists() and not (PACKAGE_DIR / module).exists()]
    return problems


def test_the_layout_lists_every_module_of_the_package():
    tree = next(b.text for b in page_blocks(ROOT / "docs" / "layout.md", "text") if b.text.startswith("nemo_moe_export/"))
    problems = _layout_problems(_layout_entries(tree))
    assert not problems, "docs/layout.md's tree differs from the package:\n" + "\n".join(problems)


def test_the_layout_check_catches_a_missing_and_a_stale_module():
    tree = "nemo_moe_export/\n  parallel/          world.py, layout.py, gone.py\n  cli.py  the CLI\ntests/  x.py\n"
    entries = _layout_entries(tree)
    assert entries["parallel/"].endswith("gone.py") and "tests/" not in entries
    problems = _layout_problems(entries)
    assert "parallel/coordinator.py: not named in its folder's entry" in problems
    assert "parallel/: names gone.py, which does not exist" in problems
    assert "adapters/: in the package, not listed" in problems


def test_the_span_check_catches_stale_names():
    assert inline_span_problems("set `export.overwrit=replace` or `mmlu.batch_size=16`") == [
        "export.overwrit is neither a config key nor a nemo_moe_export attribute"]
    assert inline_span_problems("see `integrations.nemo.MoEExportCallbak(hooks)` and `job/hooks.py`") == [
        "integrations.nemo.MoEExportCallbak is neither a config key nor a nemo_moe_export attribute",
        "path job/hooks.py does not exist"]


# --- the public API the README teaches ------------------------------------------------------------


@pytest.mark.parametrize("module", ["nemo_moe_export", "nemo_moe_export.hooks", "nemo_moe_export.integrations",
                                    "nemo_moe_export.parallel"])
def test_public_all_lists_names_that_exist(module):
    mod = importlib.import_module(module)
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing and len(set(mod.__all__)) == len(mod.__all__), missing


def test_the_main_entry_points_are_importable_from_the_package_and_loaded_lazily():
    names = ["export_hf_checkpoint", "ExportOptions", "ExportStep", "MMLUOptions", "MMLUCallback", "evaluate_mmlu",
             "plugin_hooks", "make_context", "RecipeContext", "Hook"]
    assert set(names) <= set(nemo_moe_export.__all__)
    code = ("import sys, nemo_moe_export as n; heavy = [m for m in ('nemo_moe_export.evaluate', "
            "'nemo_moe_export.export', 'transformers') if m in sys.modules]; "
            f"assert not heavy, heavy; [getattr(n, x) for x in {names!r}]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
