"""Generated docs stay in step with the tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdfsm.diagram import markdown

ROOT = Path(__file__).resolve().parent.parent


def test_state_machine_docs_are_generated_from_the_tables() -> None:
    committed = (ROOT / "docs" / "state-machines.md").read_text()
    fix = "run `pdfsm diagram --markdown -o docs/state-machines.md`"
    assert committed == markdown(), f"docs/state-machines.md is stale: {fix}"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1
    assert f"\n{ci[0]}\n" in (ROOT / "README.md").read_text()


def test_scheduler_loop_example_runs_every_path_it_shows() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "scheduler_loop.py")], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert "decoding: ['req-0', 'req-1', 'req-2', 'req-4', 'req-5', 'req-6']" in out
    assert "recompute: ['req-3']" in out and "aborted: ['req-7']" in out
    assert "prefill blocks still held: 0" in out
