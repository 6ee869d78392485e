"""pytest integration: a ``race`` fixture that hunts interleavings and reports what it found.

Installed as a pytest plugin (entry point ``pytest11``), so a project with pdfsm installed can
write::

    def test_my_policy(race):
        race.check(Scenario(requests=2, producer_tp=2), Variant(tables=my_tables),
                   invariants=[my_invariant])

On a failure the test fails with the shrunk steps in plain words, and every core's log of the
counterexample is written under the test's ``tmp_path`` in the production format, ready for
``pdfsm replay``. Hypothesis is imported only when the fixture is used.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pdfsm.testing.explore import Found
    from pdfsm.testing.world import Scenario, Variant, World

__all__ = ["Race", "race"]


@dataclass
class Race:
    """Hunts races for one test; ``examples`` comes from ``PDFSM_RACE_EXAMPLES`` (default 300, at least 1)."""

    directory: Path
    examples: int

    def hunt(self, scenario: Scenario | None = None, variant: Variant | None = None,
             invariants: Iterable[Callable[[World], None]] = (), *, max_examples: int | None = None) -> Found:
        """Search and return what was found (a failure is not raised: see :meth:`check`)."""
        from pdfsm.testing.explore import hunt

        found = hunt(scenario, variant, invariants, max_examples=max_examples or self.examples)
        logs = self.directory / "counterexample"
        shutil.rmtree(logs, ignore_errors=True)  # an earlier hunt's logs would pass for this one's
        if found.found and found.world is not None:
            found.world.dump(logs)
        return found

    def check(self, scenario: Scenario | None = None, variant: Variant | None = None,
              invariants: Iterable[Callable[[World], None]] = (), *, max_examples: int | None = None) -> None:
        """Fail the test if any interleaving breaks an invariant."""
        found = self.hunt(scenario, variant, invariants, max_examples=max_examples)
        if found.found:
            logs = self.directory / "counterexample"
            pytest.fail(f"{found.message}\n\ncounterexample logs (pdfsm replay them): {logs}", pytrace=False)


def examples_from_env() -> int:
    """``PDFSM_RACE_EXAMPLES`` (default 300), checked: 0 or a non-number surfaced as a raw
    Hypothesis error at fixture setup, naming neither the variable nor what it should be."""
    raw = os.environ.get("PDFSM_RACE_EXAMPLES", "300")
    try:
        examples = int(raw)
    except ValueError:
        examples = 0
    if examples < 1:
        pytest.fail(f"PDFSM_RACE_EXAMPLES must be a whole number of examples, at least 1; got {raw!r}",
                    pytrace=False)
    return examples


@pytest.fixture
def race(tmp_path: Path) -> Race:
    """Property-based race testing of pdfsm machines or of your own policy."""
    return Race(tmp_path, examples_from_env())
