"""The package's import structure (docs/design.md#options-and-defaults, "Imports and layers"):
no import cycle, counting imports inside functions, and imports inside functions only for the
optional frameworks, version probes (an import guarded by ``except ImportError``) and the reload
subprocess's offline set-up. Read from the source with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nemo_moe_export

PACKAGE = Path(nemo_moe_export.__file__).parent
# What may be imported inside a function: frameworks the package runs without.
OPTIONAL = ("megatron.core", "megatron.bridge", "nemo.", "nemo_run", "nemo_automodel", "tqdm", "matplotlib",
            "pyarrow", "importlib.util")
# Modules that import inside a function on purpose, for a reason their docstring gives.
LOCAL_BY_DESIGN = {"nemo_moe_export.job.reload"}  # HF_HUB_OFFLINE is set before transformers loads


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text())
    return found


def _imports(tree: ast.Module) -> list[tuple[ast.AST, bool]]:
    """Every import statement of a module, and whether it sits inside a function (not counting a
    version probe: an import in a ``try`` that catches ``ImportError``)."""
    out: list[tuple[ast.AST, bool]] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, in_function and not _probe(node)))
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    walk(tree, False)
    return out


def _probe(node: ast.AST) -> bool:
    return isinstance(node, ast.Try) and any(
        isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers)


def _targets(node: ast.AST, modules: dict[str, ast.Module]) -> list[str]:
    """The package modules an import statement loads (``from pkg import submodule`` loads the submodule)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.module:
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                 for a in node.names]
    else:
        names = []
    return sorted({n for n in names if n in modules})


def _graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    return {name: {t for node, _ in _imports(tree) for t in _targets(node, modules) if t != name}
            for name, tree in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[name] = 2
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_cycle_even_through_imports_inside_functions():
    assert _cycle(_graph(_modules())) is None, " -> ".join(_cycle(_graph(_modules())))


def test_the_checks_find_a_cycle_and_a_local_import():
    local = ast.parse("def f():\n    import json\n    try:\n        import yaml\n    except ImportError:\n        pass\n")
    assert [(n.names[0].name, inside) for n, inside in _imports(local)] == [("json", True), ("yaml", False)]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_inside_functions_are_only_optional_frameworks():
    local = []
    for name, tree in sorted(_modules().items()):
        if name in LOCAL_BY_DESIGN:
            continue
        for node, in_function in _imports(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if in_function and not (module or "").startswith(OPTIONAL):
                local.append(f"{name}:{node.lineno} imports {module}")
    assert not local, "imports inside functions (move them to the module's top):\n" + "\n".join(local)


# The longest a function of the package may be, its docstring included (docs/design.md#options-and-defaults,
# "Imports and layers"): a longer one is split into parts a reader finds by name.
MAX_FUNCTION_LINES = 60


def _long_functions(tree: ast.Module, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of every function of ``tree`` (methods and nested ones too)
    longer than ``limit`` lines, decorators not counted."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit]


def test_the_length_check_finds_a_long_function():
    lines = [f"x{i} = {i}" for i in range(60)]
    method = "".join(f"        {line}\n" for line in lines)
    tree = ast.parse(f"def short():\n    return 1\n\nclass C:\n    def long(self):\n{method}")
    assert _long_functions(tree) == [("long", 5, 61)]
    assert _long_functions(ast.parse("def f():\n" + "".join(f"    {line}\n" for line in lines[1:]))) == []


def test_no_function_of_the_package_is_over_60_lines():
    long = [f"{name}.{fn}:{line} is {n} lines" for name, tree in sorted(_modules().items())
            for fn, line, n in _long_functions(tree)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named parts):\n" + "\n".join(long)
