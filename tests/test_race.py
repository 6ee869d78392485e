"""Property-based race testing: the real machines hold every invariant, every planted bug is found."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfsm.filelog import read_log
from pdfsm.replay import replay
from pdfsm.testing import Scenario, World, drive, exhaust, hunt
from pdfsm.testing.coverage import explore, unexplained, unreachable_reason
from pdfsm.testing.mutants import MUTANTS
from pdfsm.testing.plugin import Race

# The search budgets grow with the Hypothesis profile (HYPOTHESIS_PROFILE=long searches longer).
SCALE = max(1, settings().max_examples // 200)


@given(st.data())
def test_any_interleaving_of_two_requests_across_tp_keeps_every_invariant(data: st.DataObject) -> None:
    drive(data, Scenario(requests=2, producer_tp=2, consumer_tp=2))


def test_default_scenarios_reach_every_reachable_cell_and_break_nothing() -> None:
    reached = explore(300 * SCALE)  # raises with the counterexample if any invariant breaks
    assert not unexplained(reached), "cells neither reached nor explained by a rule"
    too_broad = sorted(c for c in reached if unreachable_reason(c))
    assert not too_broad, f"a rule calls these cells unreachable, yet the world reached them: {too_broad}"
    assert len(reached) >= 73  # (consumer FAILED, EngineFailed) left when requests stopped watching past a fail-fast


@pytest.mark.parametrize("mutant", sorted(MUTANTS), ids=lambda m: m.replace(" ", "-").replace("/", ""))
def test_every_planted_bug_is_found_with_a_short_counterexample(mutant: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Found, shrunk, told in plain words, and written as logs that `pdfsm replay` reads: the
    logs carry the machines' own names, so replaying them against the real tables either
    agrees (the planted cell was not on this core's path) or names the first record where the
    mutant's table decided differently (exit 3); never a crash."""
    variant = MUTANTS[mutant]
    found = hunt(variant.scenario, variant, max_examples=1000 * SCALE)
    assert found.found, f"{mutant} was not found"
    assert found.steps <= 12, found.message
    assert found.message.count("\n") >= found.steps  # the steps, in plain words
    assert found.world is not None
    logs = found.world.dump(tmp_path)
    codes = [run_cli("replay", str(log)) for log in logs]
    err = capsys.readouterr().err
    assert set(codes) <= {0, 3} and "Traceback" not in err, err
    assert all("divergence at seq" in line for line in err.splitlines() if line.startswith("pdfsm replay"))


@pytest.mark.parametrize("mutant", sorted(MUTANTS), ids=lambda m: m.replace(" ", "-").replace("/", ""))
def test_the_real_machines_pass_every_mutant_scenario(mutant: str) -> None:
    found = hunt(MUTANTS[mutant].scenario, None, max_examples=100 * SCALE)
    assert not found.found, found.message


def test_a_counterexample_is_a_production_log_that_replays(tmp_path: Path) -> None:
    def every_request_received(world: World) -> None:  # a user's invariant: stricter than ours
        for (rank, rid), offs in world.hand_offs.items():
            if offs[0].outcome != "received":
                world.fail(f"D{rank}: {rid} was {offs[0].outcome}")

    found = hunt(Scenario(requests=1, faults=frozenset({"read-err"})), invariants=[every_request_received],
                 max_examples=200)
    assert found.found and found.world is not None
    assert "was failed" in found.message
    for log in found.world.dump(tmp_path):
        records = read_log(log)
        assert records[0].seq == 0
        replay(records)  # the real machines made it: it replays without divergence


def test_exhaustive_search_clears_a_small_world_and_finds_a_planted_bug() -> None:
    small = Scenario(requests=1, faults=frozenset())
    clean = exhaust(small, depth=7)
    assert not clean.violation and clean.paths > 10
    planted = MUTANTS["NIXL PR 252"]
    found = exhaust(small, planted, depth=7)
    assert "the bytes are not the request's" in found.violation
    assert len(found.trace) <= 7


def test_the_race_fixture_reports_and_writes_the_counterexample(race: Race) -> None:
    variant = MUTANTS["vLLM PR 57570"]
    found = race.hunt(variant.scenario, variant)
    assert found.found
    assert (race.directory / "counterexample" / "D0").is_dir()
    with pytest.raises(pytest.fail.Exception, match="notify-only"):
        race.check(variant.scenario, variant)
