"""pdfsm.testing as a race-testing user drives it (docs/race-testing.md): my own planted bugs (not in
the corpus) found, shrunk, replayed and agreed on by exhaust(); every fault actually fires;
determinism across processes; the pytest plugin's counterexample directory."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from pdfsm import consumer as C
from pdfsm import producer as P
from pdfsm.core import Tables
from pdfsm.events import BlocksHeld, HandleDone, NotificationReceived
from pdfsm.filelog import read_log
from pdfsm.fsm import Fault, Go, Illegal, on
from pdfsm.testing import EXTRA_FAULTS, FAULTS, InvariantViolation, Scenario, Variant, World, exhaust, hunt
from pdfsm.testing.explore import replay_choices
from pdfsm.testing.mutants import MUTANTS
from pdfsm.testing.plugin import Race

ROOT = Path(__file__).resolve().parent.parent

# --- my own planted bugs (not in bug-corpus.md) --------------------------------------------------------

# A consumer that reports the request at the first read that ends done, whatever its siblings do.
EARLY_REPORT = Variant(id="early-report", summary="reported at the first done read", tables=Tables(
    consumer=C.TABLE.patched("early-report", on(C.S.READING, HandleDone, C._not_in_flight_illegal,
                                                Go(C.S.NOTIFIED, C._read_done)))))
EARLY_SCENARIO = Scenario(requests=1, producer_tp=2, faults=frozenset())

# A producer that releases at the first notification, whatever ``of`` says.
FIRST_NOTE = Variant(id="first-note", summary="released at the first notification", tables=Tables(
    producer=P.TABLE.patched("first-note", on(P.S.HOLDING, NotificationReceived, P._bad_part, P._dup,
                                              Go(P.S.RELEASED, P._count_and_release)))))
FIRST_SCENARIO = Scenario(requests=1, consumer_tp=2, faults=frozenset())


def _release_keeping_staged(m: P.ProducerRequest, ev: BlocksHeld, core: object) -> None:
    core.leases.disarm(m.request_id, m.deadline)  # type: ignore[attr-defined]
    P._hold(m, ev, core)  # type: ignore[arg-type]
    P._release(m, False, ev.t_ns, core)  # type: ignore[arg-type]  # the bug: never unstaged


# A producer that releases a staged-complete request at registration but leaves it in staging: the
# staging bound later evicts a released request (needs a second request's early notification).
KEEP_STAGED = Variant(id="keep-staged", summary="released from staging without leaving it", tables=Tables(
    producer=P.TABLE.patched("keep-staged", on(
        P.S.STAGED, BlocksHeld,
        Illegal(Fault.LOCAL, "deadline is on another clock: rebase it first", when=P._foreign_deadline),
        Go(P.S.RELEASED, _release_keeping_staged, when=P._staged_complete), Go(P.S.HOLDING, P._hold_staged)))))
STAGED_SCENARIO = Scenario(requests=2, max_staged=1, faults=frozenset())


@pytest.mark.parametrize(("variant", "scenario", "log", "cell"), [
    (EARLY_REPORT, EARLY_SCENARIO, "D0", ("consumer", "READING", HandleDone)),
    (FIRST_NOTE, FIRST_SCENARIO, "P0.0", ("producer", "HOLDING", NotificationReceived)),
], ids=["early-report", "first-note"])
def test_my_planted_bug_is_found_replays_at_the_planted_cell_and_exhaust_agrees(
        variant: Variant, scenario: Scenario, log: str, cell: tuple[str, str, type], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """docs/race-testing.md 'Counterexamples': a mutant's counterexample 'diverges under the real tables
    at the first planted cell it used' (pdfsm replay exit 3, docs/postmortem.md); 'exhaust ... tries every
    interleaving up to a depth' so it finds the same bug; the real machines pass the same scenario."""
    found = hunt(scenario, variant, max_examples=100)
    assert found.found and found.world is not None and found.steps <= 12, found.message
    found.world.dump(tmp_path)
    capsys.readouterr()
    assert run_cli("replay", str(tmp_path), "--timelines", "0") == 3
    out = capsys.readouterr().out
    seq = int(re.search(rf"{re.escape(log)}: DIVERGENCE.*\n.*\n  error: divergence at seq (\d+)", out)[1])  # type: ignore[index]
    planted = next(r for r in read_log(tmp_path / log) if r.seq == seq)
    assert (planted.machine, planted.before, type(planted.event)) == cell
    ex = exhaust(scenario, variant, depth=7)
    assert ex.violation.splitlines()[0] == found.message.splitlines()[0]
    assert replay_choices(ex.trace, scenario, variant, strict=True)[1] == ex.violation  # the trace replays
    assert not hunt(scenario, None, max_examples=50).found


def test_exhaust_agrees_with_hunt_on_a_bug_needing_two_requests_and_the_staging_bound() -> None:
    """Choices on different requests still share a producer's staging bound; exhaust's sleep sets must
    not prune the one order that shows the bug (docs: 'sound: this explores more orders, never fewer')."""
    found = hunt(STAGED_SCENARIO, KEEP_STAGED, max_examples=100)
    assert found.found and "StagedDropped in RELEASED" in found.message
    ex = exhaust(STAGED_SCENARIO, KEEP_STAGED, depth=len(found.world.chosen) if found.world else 9)
    assert "StagedDropped in RELEASED" in ex.violation
    assert not hunt(STAGED_SCENARIO, None, max_examples=50).found


# --- every fault does something ---------------------------------------------------------------------------


def _names(scenario: Scenario, seeds: int) -> set[str]:
    out: set[str] = set()
    for seed in range(seeds):
        rng, world = random.Random(seed), World(scenario)
        try:
            for _ in range(30):
                choice = rng.choice(world.enabled())
                out.add(re.sub(r"\d", "#", choice.name))
                world.choose(choice)
        except InvariantViolation as exc:
            pytest.fail(f"the real machines broke an invariant: {exc}")
    return out


def test_every_fault_named_in_a_scenario_offers_choices_of_its_own() -> None:
    """'the faults allowed' (docs, Scenario): naming a fault must add choices no fault-free world has;
    a fault that never fires would be a silent gap in the search."""
    shape = {"requests": 2, "producer_pp": 2}
    base = _names(Scenario(**shape, faults=frozenset()), 40)  # type: ignore[arg-type]
    silent = [f for f in sorted(FAULTS | EXTRA_FAULTS)
              if not _names(Scenario(**shape, faults=frozenset({f})), 40) - base]  # type: ignore[arg-type]
    assert not silent, silent


def test_a_misspelt_fault_name_is_refused_not_silently_ignored() -> None:
    """docs/race-testing.md refuses a misspelt `prefix` step 'so a misspelt seed is never silently
    skipped'; a misspelt fault ('read-error' is pdfsm demo-sim's name for 'read-err') is the same
    trap: the search explores a fault-free world and reports nothing found."""
    with pytest.raises(ValueError):
        hunt(Scenario(requests=1, producer_tp=2, faults=frozenset({"read-error"})), max_examples=3)


# --- determinism across processes -----------------------------------------------------------------------

_PROBE = """
import hashlib
from pdfsm.testing import Scenario, hunt, FAULTS, EXTRA_FAULTS
def inv(world):
    for (rank, rid), offs in world.hand_offs.items():
        if offs[0].outcome != "received":
            world.fail(f"D{rank}: {rid} was {offs[0].outcome}")
f = hunt(Scenario(requests=2, producer_tp=2, consumer_tp=2, faults=FAULTS | EXTRA_FAULTS), None, [inv],
         max_examples=60)
print(f.found, f.examples, f.steps, hashlib.sha256(f.message.encode()).hexdigest())
"""


def test_same_settings_give_the_same_counterexample_in_another_process() -> None:
    """'a run is reproducible' (docs, Profiles; hunt derandomizes): also across interpreter runs,
    whatever PYTHONHASHSEED (set iteration in the machines must not leak into the interleaving)."""
    outs = {subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1 and next(iter(outs)).startswith("True "), outs


# --- the pytest plugin ------------------------------------------------------------------------------------


def test_a_second_race_hunt_leaves_only_its_own_counterexample_logs(tmp_path: Path) -> None:
    """plugin.py: 'every core's log of the counterexample is written under the test's tmp_path in the
    production format, ready for pdfsm replay' (the failure message names that directory). A second
    search in the same test must not leave the first counterexample's cores beside its own: replaying
    the directory would mix two unrelated runs (here P0.1 of a producer-TP-2 world in a TP-1 one)."""
    race = Race(tmp_path, 300)
    first, second = MUTANTS["vLLM PR 56104"], MUTANTS["SGLang issue 39846"]  # producer TP 2; consumer TP 2
    assert race.hunt(first.scenario, first, max_examples=200).found
    found = race.hunt(second.scenario, second, max_examples=200)
    assert found.found and found.world is not None
    assert sorted(p.name for p in (tmp_path / "counterexample").iterdir()) == sorted(found.world.sinks)


# --- found by review (stop 19) ---------------------------------------------------------------------


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Scenario(consumer_tp=0), "consumer_tp must be at least 1"),  # no decode rank: every hunt passed
    (lambda: Scenario(producer_tp=0), "producer_tp must be at least 1"),  # an IndexError mid-search
    (lambda: Scenario(requests=1, notify_only=(5,)), r"notify_only \[5\]"),  # silently ignored
    (lambda: Variant(quirks=frozenset({"notify-on-posts"})), "unknown quirks"),  # silently the real adapter
    (lambda: Scenario(producer_tp=4, kv_heads=3), "kv_heads 3: the model's 3 KV heads do not divide TP 4"),
    (lambda: Scenario(mla=True, kv_heads=1), "kv_heads 1: mla is one head"),  # every request failed at once
    (lambda: Scenario(kv_heads=True), "kv_heads must be an int"),  # CoreConfig's check refuses it
])
def test_a_scenario_or_variant_that_would_test_nothing_is_refused_when_built(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


def test_a_hunt_that_finds_nothing_leaves_no_earlier_hunt_s_logs(tmp_path: Path) -> None:
    """docs/race-testing.md: counterexample/ is "emptied first: a second hunt in one test leaves
    only its own logs"; it was emptied only when the second hunt found something."""
    race = Race(tmp_path, 50)
    lax = Tables(consumer=C.TABLE.patched("lax", {}))
    first = race.hunt(Scenario(requests=1, faults=frozenset()), Variant(tables=lax),
                      [lambda w: w.fail("always") if w.hand_offs else None])
    assert first.found and (tmp_path / "counterexample").exists()
    assert not race.hunt(Scenario(requests=1, faults=frozenset())).found
    assert not (tmp_path / "counterexample").exists()
