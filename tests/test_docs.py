"""Generated docs stay in step with the tables."""

from __future__ import annotations

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
