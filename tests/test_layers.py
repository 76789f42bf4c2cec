"""The package's layers import in one direction only, function-level imports included.

Lowest first: rewards and data, readers, envs, rollout, eval, then train and inference; cli and demo
on top. A module may import its own layer and the layers below it, never one above; so there is no
import cycle between subpackages either.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "coordrl"

# Each unit and the units it may import (besides itself). Top-level helper modules are units too.
ALLOWED: dict[str, set[str]] = {
    "rewards": set(),
    "software": set(),
    "data": {"rewards"},
    "rundir": {"data"},
    "readers": {"data", "rewards"},
    "testing": {"readers"},
    "envs": {"data", "rewards", "readers", "rundir"},
    "rollout": {"data", "rewards", "readers", "envs", "software"},
    "train": {"data", "rewards", "readers", "envs", "rollout", "rundir", "software"},
    "eval": {"data", "rewards", "readers", "envs", "rollout", "rundir"},
    "inference": {"data", "rewards", "readers", "envs", "rollout"},
}
TOP = {"cli", "demo", "__init__", "__main__"}  # entry points: may import anything


def _unit(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "coordrl" and len(parts) > 1 and not parts[1].startswith("_"):
                found.add(parts[1])
    return found


def test_only_cli_holds_argparse_code():
    """Flags and subcommands live in `coordrl.cli` (declared once); the layers below take plain arguments."""
    found = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if _unit(path) != "cli" and "argparse" in _imports_of_any(path)
    )
    assert found == []


def _imports_of_any(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_import_points_down():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        if unit in TOP:
            continue
        assert unit in ALLOWED, f"{path.relative_to(PACKAGE)}: unit {unit!r} has no place in the layer table"
        wrong += [
            f"{path.relative_to(PACKAGE)} imports coordrl.{v}"
            for v in sorted(_imports(path) - ALLOWED[unit] - {unit} - {"__version__"})
        ]
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_function_level_imports_say_why():
    """Below the entry points an internal import sits at the top of its module, where the layer order
    is visible; one inside a function is allowed only to keep a heavy dependency off a light path, and
    its comment (``# Lazy: ...`` on the line before) says which."""
    silent = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _unit(path) in TOP or path.name == "__init__.py":  # package __init__s load their parts on demand
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for func in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                internal = (
                    isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("coordrl.")
                )
                if internal and not lines[node.lineno - 2].strip().startswith("# Lazy:"):
                    silent.append(f"{path.relative_to(PACKAGE)}:{node.lineno} from {node.module} import ...")
    assert not silent, "function-level imports without a '# Lazy:' reason:\n" + "\n".join(sorted(set(silent)))


def test_the_layer_table_itself_has_no_cycle():
    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(v == b or (v not in seen and reaches(v, b, seen | {v})) for v in ALLOWED.get(a, ()))

    assert not [u for u in ALLOWED if reaches(u, u, set())]
