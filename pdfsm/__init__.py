"""pdfsm: KV-cache transfer for prefill/decode disaggregated serving, correct by construction.

The hot path may be compiled with mypyc (setup.py). The compiled modules are loaded only while
every source of the package is the one they were built from (the build's stamp says which): an
edited source, or ``PDFSM_PURE_PYTHON=1`` at run time, loads the ``.py`` files instead.
``HOT_PATH`` says which.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

_HERE: Final = Path(__file__).parent


def _built_modules() -> set[str]:
    """The modules of this package with a build for this interpreter beside their source."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # the one mypyc builds (cpython-311-...so)
    return {f"{__name__}.{p.name[:-len(suffix)]}" for p in _HERE.glob(f"*{suffix}")
            if (_HERE / f"{p.name[:-len(suffix)]}.py").exists()}


def _stale(built: set[str]) -> str:
    """Why the compiled build must not be loaded, or "" when it may. Every source of the package
    counts, not only the compiled ones: mypyc copies other modules' constants into them."""
    if os.environ.get("PDFSM_PURE_PYTHON") == "1":
        return "PDFSM_PURE_PYTHON=1"
    try:
        stamped = json.loads((_HERE / "_compiled.json").read_text())
        modules, sources = set(stamped["modules"]), dict(stamped["sources"])
    except (OSError, ValueError, KeyError, TypeError):
        return "no stamp of the sources it was built from"
    if modules != built:
        return "the compiled modules are not the ones stamped"
    now = {p.relative_to(_HERE).as_posix(): p for p in _HERE.rglob("*.py")}
    for name in sorted(now.keys() | sources.keys()):
        if name not in now or name not in sources or \
                hashlib.sha256(now[name].read_bytes()).hexdigest() != sources[name]:
            return f"{name} changed since the build (reinstall to compile it again)"
    return ""


class _Sources(importlib.abc.MetaPathFinder):
    """Finds the named modules' ``.py`` files ahead of their compiled build."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        return importlib.util.spec_from_file_location(fullname, _HERE / f"{fullname.rpartition('.')[2]}.py")


def _choose() -> str:
    built = _built_modules()
    if not built:
        return "pure Python (not compiled)"
    why = _stale(built)
    if not why:
        return f"compiled with mypyc ({len(built)} modules)"
    sys.meta_path.insert(0, _Sources(built))
    return f"pure Python ({why})"


HOT_PATH: Final = _choose()
COMPILED: Final = HOT_PATH.startswith("compiled")
