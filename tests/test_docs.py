"""Generated docs stay in step with the tables."""

from __future__ import annotations

from pathlib import Path

from pdfsm.diagram import markdown

ROOT = Path(__file__).resolve().parent.parent


def test_state_machine_docs_are_generated_from_the_tables() -> None:
    committed = (ROOT / "docs" / "state-machines.md").read_text()
    fix = "run `pdfsm diagram --markdown -o docs/state-machines.md`"
    assert committed == markdown(), f"docs/state-machines.md is stale: {fix}"
