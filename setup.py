"""Build: the hot path (the machines, their tables and the core's loop) compiled with mypyc.

The compiled modules are the very same typed sources (mypy strict passes on them), so the
package is correct without them: when mypyc or a C compiler is missing, or PDFSM_PURE_PYTHON=1
is set at build time, the build goes on pure Python and says so. A stamp of the sources the
extensions were built from lets ``pdfsm/__init__.py`` load them only while those sources are
unchanged: an edited module in an editable checkout is never shadowed by a stale build.
mypyc runs whenever pip finalizes build_ext (for metadata too, a few seconds each time).
See docs/decisions.md ("The hot path is compiled").
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The modules every applied event runs through. None may define a msgspec Struct: mypyc drops its
# class keywords (frozen=True, gc=False; tests/test_compiled.py checks).
HOT = ("core", "consumer", "producer", "engine", "fsm", "timers", "log", "topology")
STAMP = "_compiled.json"
PACKAGE = Path("pdfsm")


def stamp() -> str:
    """The compiled modules and the SHA-256 of every source of the package: mypyc copies other
    modules' ``Final`` constants and annotations into the compiled code, so an edit anywhere in
    the package may make it stale."""
    sources = {p.relative_to(PACKAGE).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in sorted(PACKAGE.rglob("*.py"))}
    return json.dumps({"modules": [f"pdfsm.{m}" for m in HOT], "sources": sources}, indent=1)


class BuildHotPath(build_ext):
    """Builds mypyc's extensions for ``HOT`` and writes the stamp beside them, after removing an
    earlier build's; any failure to compile leaves pure Python. It always runs (the placeholder
    extension stays when mypyc is not used), so a pure build never leaves an old one behind."""

    hot = False

    def finalize_options(self) -> None:
        if os.environ.get("PDFSM_PURE_PYTHON") == "1":
            print("pdfsm: PDFSM_PURE_PYTHON=1, building pure Python")
        else:
            try:
                from mypyc.build import mypycify

                self.distribution.ext_modules = mypycify([str(PACKAGE / f"{m}.py") for m in HOT],
                                                         group_name="pdfsm.hot")
                self.hot = True
            except (Exception, SystemExit) as exc:  # noqa: BLE001 (a failure to compile leaves a working package)
                print(f"pdfsm: mypyc failed ({type(exc).__name__}: {exc}); building pure Python")
        super().finalize_options()

    def run(self) -> None:
        out = PACKAGE if self.inplace else Path(self.build_lib, "pdfsm")
        (out / STAMP).unlink(missing_ok=True)
        for suffix in EXTENSION_SUFFIXES:  # an earlier build's, maybe of a module no longer compiled
            for old in out.glob(f"*{suffix}"):
                old.unlink()
        if not self.hot:
            return
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 (no C compiler, say: the package works without)
            print(f"pdfsm: the hot path was not compiled ({type(exc).__name__}: {exc}); building pure Python")
            return
        (out / STAMP).write_text(stamp())

    def get_outputs(self) -> list[str]:
        return super().get_outputs() if self.hot else []  # not the placeholder's, never built


setup(ext_modules=[Extension("pdfsm.hot__placeholder", sources=[])], cmdclass={"build_ext": BuildHotPath})
