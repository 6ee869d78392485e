"""The compiled hot path (setup.py, docs/decisions.md "The hot path is compiled"): it changes
nothing a user sees, and a stale build is never loaded."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import child_env

import pdfsm
from pdfsm.topology import Layout, read_plan

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(pdfsm.__file__).parent


def _hot_modules() -> tuple[str, ...]:
    """setup.py's HOT, read without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "HOT" for t in node.targets):
            value: tuple[str, ...] = ast.literal_eval(node.value)
            return value
    raise AssertionError("setup.py names no HOT modules")


def _python(code: str, cwd: Path, *, pythonpath: Path | None = None, pure: bool = False) -> str:
    """Run ``code`` in a new interpreter in ``cwd``, outside the checkout (whose ``pdfsm`` would come
    first)."""
    env = child_env(pythonpath) if pythonpath is not None else dict(os.environ)
    env.pop("PDFSM_PURE_PYTHON", None)
    if pure:
        env["PDFSM_PURE_PYTHON"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return out.stdout.strip()


def test_no_compiled_module_defines_a_class_with_class_keywords() -> None:
    """mypyc compiles a msgspec Struct defined in a compiled module without its class keywords: a
    ``frozen=True`` plan came out mutable (found when topology.py was first compiled)."""
    for name in _hot_modules():
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert not node.keywords and not any("Struct" in b for b in bases), (
                    f"pdfsm/{name}.py class {node.name}({', '.join(bases)}): a compiled module may not define it")


def test_pure_python_on_request_at_run_time(tmp_path: Path) -> None:
    out = _python("import pdfsm, pdfsm.core; print(pdfsm.COMPILED, pdfsm.HOT_PATH, pdfsm.core.__file__)", tmp_path,
                  pure=True)
    assert out.startswith("False pure Python (PDFSM_PURE_PYTHON=1)") and out.endswith("core.py"), out


@pytest.mark.skipif(not pdfsm.COMPILED, reason=f"this install is not compiled: {pdfsm.HOT_PATH}")
@pytest.mark.parametrize(("edited", "old", "new"), [
    ("consumer.py", "", "\nEDITED = True\n"),
    # Not compiled itself, but mypyc copied its Final constants into core (found by review).
    ("events.py", "CONSUMER: Final = 1\n", "CONSUMER: Final = 11\n"),
])
def test_an_edited_source_is_loaded_instead_of_its_stale_compiled_build(tmp_path: Path, edited: str, old: str,
                                                                          new: str) -> None:
    """A developer edits a module in an editable checkout and runs the tests without
    reinstalling: the edit is what runs, every hot module from source (they call each other
    natively, so one stale module cannot be mixed with fresh ones)."""
    copy = tmp_path / "pdfsm"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("import pdfsm, pdfsm.core, pdfsm.consumer, pdfsm.events; "
             "print(pdfsm.HOT_PATH, pdfsm.core.__file__, pdfsm.consumer.__file__); "
             "print(sorted(pdfsm.core.Core(pdfsm.events.CoreConfig(engine_id='D'))._remembered))")
    assert _python(probe, tmp_path, pythonpath=tmp_path).startswith("compiled with mypyc")
    source = (copy / edited).read_text()
    assert old in source
    (copy / edited).write_text(source.replace(old, new, 1) if old else source + new)
    out = _python(probe, tmp_path, pythonpath=tmp_path).split("\n")
    assert out[0].startswith(f"pure Python ({edited} changed since the build"), out
    assert out[0].endswith(f"{copy / 'core.py'} {copy / 'consumer.py'}"), out
    if edited == "events.py":
        assert out[1] == "[2, 3, 11]", out  # the core keys its tombstones by the edited constant


def test_logs_of_one_build_replay_without_divergence_in_the_other(tmp_path: Path) -> None:
    """Both builds make the same records from the same events: the compiled build's logs of a
    run with a planted fault replay in pure Python (every record recomputed and compared), and
    the other way round."""
    for writer_pure in (False, True):
        logs = tmp_path / ("pure" if writer_pure else "compiled")
        _python("from pdfsm.cli import main; raise SystemExit(main(['demo-sim', '--requests', '12', "
                f"'--prefill-tp', '2', '--decode-tp', '1', '--quiet', '--log-dir', {str(logs)!r}, "
                "'--fault', 'duplicate-notification']))", tmp_path, pure=writer_pure)
        out = _python(f"from pdfsm.cli import main; raise SystemExit(main(['replay', {str(logs)!r}]))", tmp_path,
                      pure=not writer_pure)  # exit 0: no record differs (3 would name the first that does)
        assert "decode-tp0" in out and "prefill-tp1" in out, out


@pytest.mark.skipif(not pdfsm.COMPILED, reason=f"this install is not compiled: {pdfsm.HOT_PATH}")
def test_a_read_plan_shared_by_every_request_cannot_be_changed() -> None:
    """One plan serves every request between two layouts (read_plan caches it): its fields are
    ``Final``, which mypy checks, and which the compiled build enforces (a Struct did, before
    topology was compiled)."""
    plan = read_plan(Layout(1, 1, 0, 0), Layout(1, 1, 0, 0), False)
    assert read_plan(Layout(1, 1, 0, 0), Layout(1, 1, 0, 0), False) is plan
    with pytest.raises(AttributeError):
        plan.part = 1  # type: ignore[misc]
    assert plan.part == 0
