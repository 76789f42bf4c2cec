"""The repository's scripts and benchmarks as modules, for tests (scripts/ and benchmarks/ are not packages)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """``relative`` (e.g. ``scripts/build_warm_start.py``) imported as a module named after its file. It is
    registered in `sys.modules` while it runs, because dataclasses look their module up there; the caller's
    previous entry of that name, if any, is restored afterwards."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    before = sys.modules.get(path.stem)
    sys.modules[path.stem] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        if before is None:
            sys.modules.pop(path.stem, None)
        else:
            sys.modules[path.stem] = before
    return mod


def defaults(fn) -> dict:
    """``fn``'s keyword defaults by name (what a kept artefact's recorded recipe is compared with)."""
    return {
        k: v.default for k, v in inspect.signature(fn).parameters.items() if v.default is not inspect.Parameter.empty
    }
