"""Problems a review of the race tester verified (pdfsm.testing, docs/race-testing.md), one test or
more each: scenarios that tested nothing, a consumer option no interleaving reached (the trust
bound between a deadline and its Tick), unreadable times, assert-style invariants, exhaust's
cost, crashes that left no record, drive's logs, and the fixture's budget from the environment."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfsm import consumer as C
from pdfsm.core import Core, Tables
from pdfsm.events import AbortRequested, CoreConfig, HandleDone, LeaseExpired, Reported, Tick
from pdfsm.filelog import read_log
from pdfsm.fsm import Fault, Go, on
from pdfsm.log import Outcome
from pdfsm.testing import InvariantViolation, Scenario, Variant, World, drive, exhaust, hunt
from pdfsm.testing.coverage import explore_options, instrumented
from pdfsm.testing.explore import DEFAULT_SCENARIOS, replay_choices
from pdfsm.testing.mutants import MUTANTS
from pdfsm.testing.plugin import Race, examples_from_env
from pdfsm.testing.world import STEP_NS, UNIT_NS

# --- 1. a scenario that would make every hunt pass is refused, naming the field ----------------------


@pytest.mark.parametrize(("fields", "match"), [
    ({"lease_ns": 0}, "lease_ns must be at least 1"),  # as CoreConfig's check: every read failed at once
    ({"lease_ns": -5}, "lease_ns must be at least 1"),
    ({"lease_ns": 5}, r"lease_ns \(5\) must be more than lease_margin_ns \(5\)"),  # no read ever trusted
    ({"lease_ns": 20, "lease_margin_ns": 30}, "must be more than lease_margin_ns"),
    ({"read_timeout_ns": 0}, "read_timeout_ns must be at least 1"),
    ({"lease_margin_ns": -1}, "lease_margin_ns must be at least 0"),
    ({"handshake_retry_ns": -1}, "handshake_retry_ns must be at least 0"),
    ({"cancel_grace_ns": -1}, "cancel_grace_ns must be at least 0"),
    ({"lease_ns": 60.0}, "lease_ns must be an int"),
    ({"policy": "retry"}, r"policy must be one of \('recompute', 'fail'\), got 'retry'"),
    ({"faults": "read-err"}, "faults must be a frozenset of fault names, got 'read-err'"),  # was a TypeError
    ({"faults": ["read-err"]}, "faults must be a frozenset of fault names"),
    # TP sizes that cannot exchange blocks: every request failed at once and every hunt passed (review)
    ({"consumer_tp": 3, "producer_tp": 2}, "consumer_tp 3 and producer_tp 2: TP sizes must divide"),
    ({"consumer_tp": 2, "producer_tp": 3}, "TP sizes must divide one another"),
    ({"prefix": "prefill: p0"}, "prefix must be a tuple of step names"),  # was "step 'p' is not enabled"
])
def test_a_scenario_that_would_test_nothing_is_refused_naming_the_field(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Scenario(requests=1, **fields)


def test_the_smallest_sound_times_are_accepted() -> None:
    s = Scenario(requests=1, lease_ns=6, read_timeout_ns=1, lease_margin_ns=5, policy="fail",
                 faults=frozenset({"read-err"}))
    assert not hunt(s, max_examples=20).found


# --- 2. a decode timer behind: reads past the trust bound, before the deadline's Tick --------------------


def _last_ignoring_trust(m: C.ConsumerRequest, ev: HandleDone, core: Core) -> bool:
    i = m.plan.position.get((ev.pp_rank, ev.tp_rank)) if m.plan is not None else None
    return i is not None and m.pending == 1 << i


# A consumer that trusts a read whenever it is the last in flight, however late (the review's TRUST_LATE).
TRUST_LATE = Variant(id="trust-late", summary="late reads trusted", tables=Tables(
    consumer=C.TABLE.patched("trust-late", on(C.S.READING, HandleDone,
                                              Go(C.S.NOTIFIED, C._read_done, when=_last_ignoring_trust),
                                              Go(C.S.READING, C._sibling_stopped)))))
LATE = Scenario(requests=1, faults=frozenset({"late-tick"}))
LATE_READ = ["prefill: p0 finishes prefill", "scheduler: D0 asks to read r0", "prefill worker P0.0: registers p0",
             "timer: D0's timer falls behind", "handshake: D0 gets the answer for (P, pp 0) #1",
             "timer: time passes to the next deadline", "transfer: D0 read of r0 from (0, 0) ends done"]
TRUSTED = ("consumer", "READING", "HandleDone", "-> FAILED (late last) when untrusted")


def test_a_read_ending_past_the_lease_before_the_late_tick_is_not_trusted() -> None:
    """The producer's lease runs out (its blocks reused) while D0's timer is behind; the read then
    ends done. The real consumer fails the request by its trust bound (the option no step reached
    while every time step ticked every core at once)."""
    hits: set[tuple[str, str, str, str]] = set()
    variant = Variant(id="pdfsm", tables=instrumented(hits))
    world, message = replay_choices(LATE_READ, LATE, variant, strict=True)
    assert not message
    assert TRUSTED in hits
    assert [off.outcome for off in world.hand_offs[(0, "r0")]] == ["failed"]
    assert any(isinstance(r.event, LeaseExpired) for r in world.records()["P0.0"])


def test_the_default_scenarios_decide_every_trust_bound_option() -> None:
    """The coverage tool (explore_options) over the default "decode timer behind" scenario."""
    hits = explore_options({"behind": DEFAULT_SCENARIOS["decode timer behind"]}, 300)
    late = {("consumer", "READING", "HandleDone", "-> FAILED (late last) when untrusted"),
            ("consumer", "READING", "HandleDone", "-> FAILING (late) when untrusted with siblings"),
            ("consumer", "ABORTING", "HandleDone", "-> ABORTED (late last) when untrusted"),
            ("consumer", "ABORTING", "HandleDone", "-> ABORTING (late stopped) when untrusted with siblings"),
            ("consumer", "HANDSHAKING", "EngineReady", "-> FAILED (timed out ready) when read past deadline")}
    assert late <= hits, sorted(late - hits)


def test_a_table_that_ignores_the_trust_bound_is_found_within_the_race_hunt_budget(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/race_hunt.py's budget (2000 examples, <= 12 steps); its logs diverge from the real
    tables at the late HandleDone; the real machines pass the same scenario."""
    found = hunt(LATE, TRUST_LATE, max_examples=2000)
    assert found.found and found.world is not None and found.steps <= 12, found.message
    assert "the bytes are not the request's" in found.message
    assert "timer: D0's timer falls behind" in found.world.chosen
    found.world.dump(tmp_path)
    capsys.readouterr()
    assert run_cli("replay", str(tmp_path / "D0"), "--timelines", "0") == 3
    assert "event=HandleDone" in capsys.readouterr().out
    assert not hunt(LATE, None, max_examples=200).found


def test_cancelled_reads_outliving_the_grace_mark_their_engine_stalled() -> None:
    """CoreConfig.cancel_grace_ns came after the world: the "cancelled reads hang" default scenario
    makes cancelled reads outlive the grace, so FAILING/ABORTING x DeadlinePassed mark the stage
    stalled, and no invariant breaks."""
    hits = explore_options({"hang": DEFAULT_SCENARIOS["cancelled reads hang"]}, 300)
    hung = {("consumer", state, "DeadlinePassed", f"-> {state} (hung) when hung reads connected")
            for state in ("FAILING", "ABORTING")}
    assert hung <= hits, sorted(hung - hits)


def test_late_tick_is_opt_in_so_the_default_searches_stay_as_they_were() -> None:
    assert not any("falls behind" in c.name for c in World(Scenario(requests=1)).enabled())


# --- 3. times: readable, strictly increasing, and the same decisions ---------------------------------------


def test_every_step_moves_the_cores_clock_forward_by_at_least_a_microsecond() -> None:
    rng, world = random.Random(7), World(Scenario(requests=2, producer_tp=2))
    times = [world.t_ns]
    for _ in range(30):
        world.choose(rng.choice(world.enabled()))
        times.append(world.t_ns)
    assert all(b - a >= STEP_NS for a, b in itertools.pairwise(times))


def test_a_lease_of_60_units_expires_at_the_tick_of_60_ms_and_logs_in_the_order_things_happened() -> None:
    """The merged timeline sorts by t_ns: the producer's lease expiry (and its reuse of the blocks)
    must come before the read that ended after it, not tie with it."""
    world, _ = replay_choices(LATE_READ, LATE, TRUST_LATE, strict=True)
    records = world.records()
    expired = next(r for r in records["P0.0"] if isinstance(r.event, LeaseExpired))
    done = next(r for r in records["D0"] if isinstance(r.event, HandleDone))
    assert expired.event.t_ns // UNIT_NS == 60 == world.now
    assert expired.event.t_ns < done.event.t_ns


# --- 4. an invariant may assert ---------------------------------------------------------------------------


def every_request_received(world: World) -> None:
    for (rank, rid), offs in world.hand_offs.items():
        assert offs[0].outcome == "received", f"D{rank}: {rid} was {offs[0].outcome}"


def test_an_asserting_invariant_shrinks_and_writes_its_counterexample_logs(tmp_path: Path) -> None:
    race = Race(tmp_path, 50)
    found = race.hunt(Scenario(requests=1, faults=frozenset({"read-err"})), None, [every_request_received])
    assert found.found and found.world is not None
    assert found.message.startswith("invariant every_request_received failed: D0: r0 was failed")
    assert "after 4 chosen steps" in found.message  # minimized by name, as a world.fail would be
    assert (tmp_path / "counterexample" / "D0").is_dir()
    with pytest.raises(pytest.fail.Exception, match="counterexample logs"):
        race.check(Scenario(requests=1, faults=frozenset({"read-err"})), None, [every_request_received])


def test_an_invariant_that_crashes_propagates_with_a_note_naming_it() -> None:
    def broken(world: World) -> None:
        if world.step_no == 2:
            raise KeyError("oops")

    world = World(Scenario(requests=1), invariants=[broken])
    world.choose(world.enabled()[0])
    with pytest.raises(KeyError) as info:
        world.choose(world.enabled()[0])
    assert any("raised by invariant broken" in note for note in getattr(info.value, "__notes__", []))


# --- 5. exhaust has a node budget and says when it cut the search --------------------------------------


def test_exhaust_stops_at_its_node_budget_and_says_so() -> None:
    cut = exhaust(Scenario(requests=1), depth=12, max_nodes=40)
    assert cut.cut and cut.nodes == 40 and not cut.violation
    whole = exhaust(Scenario(requests=1, faults=frozenset()), depth=4)
    assert not whole.cut and whole.nodes < 20_000
    with pytest.raises(ValueError, match="max_nodes"):
        exhaust(Scenario(requests=1), max_nodes=0)


# --- 6. a guard or action that raises is in the logs ------------------------------------------------------


def _boom(m: C.ConsumerRequest, ev: HandleDone, core: Core) -> None:
    raise KeyError("my bug")


RAISER = Variant(id="raiser", tables=Tables(consumer=C.TABLE.patched("raiser", on(
    C.S.READING, HandleDone, Go(C.S.NOTIFIED, _boom)))))


def test_a_crashing_action_is_recorded_where_it_happened_and_replay_diverges_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    found = hunt(Scenario(requests=1), RAISER, max_examples=50)
    assert found.found and found.world is not None
    assert "D0 crashed applying HandleDone: KeyError: 'my bug'" in found.message
    found.world.dump(tmp_path)
    crash = read_log(tmp_path / "D0")[-1]
    assert isinstance(crash.event, HandleDone) and f"at seq {crash.seq}" in found.message
    assert (crash.machine, crash.before, crash.state) == ("consumer", "READING", "READING")
    assert (crash.outcome, crash.fault, crash.reason) == (Outcome.REJECTED, Fault.LOCAL, "crashed: KeyError: 'my bug'")
    capsys.readouterr()
    assert run_cli("replay", str(tmp_path / "D0"), "--timelines", "0") == 3
    assert f"divergence at seq {crash.seq}" in capsys.readouterr().err


def test_a_crash_in_a_derived_event_is_recorded_with_its_cause(tmp_path: Path) -> None:
    """vLLM PR 41853's mutant crashes in the Reported a Collect derives."""
    variant = MUTANTS["vLLM PR 41853"]
    found = hunt(variant.scenario, variant, max_examples=200)
    assert found.found and found.world is not None
    crash = found.world.records()["D0"][-1]
    assert isinstance(crash.event, Reported) and crash.reason.startswith("crashed: KeyError")
    assert crash.machine == "consumer" and crash.cause is not None


_REUSED = KeyError("reused")  # one exception object, raised by every crash: Core.crash must not keep the first


def _raise_reused(m: Any, ev: Any, core: Any) -> None:
    raise _REUSED


def test_a_reused_exception_object_is_attributed_to_the_event_that_raised_it_last() -> None:
    """Core.crash (what the race tester records a crash from) was kept from the first crash when
    a later one raised the same exception object: it named request a for b's crash (found by
    review)."""
    tables = Tables(consumer=C.TABLE.patched("reuser", on(C.S.NEW, AbortRequested, Go(C.S.ABORTED, _raise_reused))))
    core = Core(CoreConfig(engine_id="D"), tables=tables)
    for rid in ("a", "b"):
        with pytest.raises(KeyError):
            core.apply(AbortRequested(source="scheduler", t_ns=1, request_id=rid))
        assert core.crash is not None and core.crash[0] is _REUSED
        assert core.crash[1].request_id == rid  # type: ignore[attr-defined]
    core.apply(Tick(source="timer", t_ns=2))
    assert core.crash is None  # the next apply starts clean


# --- 7. drive writes the counterexample's logs when asked ----------------------------------------------------


def test_drive_writes_the_failing_interleavings_logs(tmp_path: Path) -> None:
    variant, logs = MUTANTS["vLLM PR 32255"], tmp_path / "logs"  # an abort frees blocks under a read

    @settings(max_examples=200, derandomize=True, database=None, deadline=None, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: st.DataObject) -> None:
        drive(data, variant.scenario, variant, logs=logs)

    with pytest.raises(InvariantViolation, match="counterexample logs") as info:
        run()
    assert sorted(p.name for p in logs.iterdir()) == ["D0", "P0.0"]
    journal = read_log(logs / "D0")  # the logs are the reported run's: its last step is in them
    assert journal and str(logs) in str(info.value)


# --- 8. PDFSM_RACE_EXAMPLES is checked -----------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["0", "abc", "-3", ""])
def test_a_bad_race_examples_variable_is_refused_by_name(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDFSM_RACE_EXAMPLES", raw)
    with pytest.raises(pytest.fail.Exception, match="PDFSM_RACE_EXAMPLES must be a whole number"):
        examples_from_env()


def test_race_examples_variable_sets_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDFSM_RACE_EXAMPLES", "25")
    assert examples_from_env() == 25
    monkeypatch.delenv("PDFSM_RACE_EXAMPLES")
    assert examples_from_env() == 300


def test_quirks_given_as_a_string_are_refused_by_name() -> None:
    """``Variant(quirks="notify-on-post")`` failed with "unsupported operand type(s) for -" (review)."""
    from pdfsm.testing.world import Variant

    with pytest.raises(ValueError, match="quirks must be a frozenset of quirk names"):
        Variant(quirks="notify-on-post")  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [
    Scenario(requests=14, consumer_tp=4, producer_tp=4, producer_pp=2, faults=frozenset()),
    Scenario(requests=25, consumer_tp=4, producer_tp=4, faults=frozenset())])
def test_a_larger_world_with_no_faults_settles(shape: Scenario) -> None:
    """Valid worlds of 14 requests over TP 4 and PP 2 (417 steps) or 25 over TP 4 were reported as
    "the world did not settle within 400 steps", a false counterexample (found by a helper): the
    step limit grows with the world."""
    w = World(shape)
    w.drain()
    assert w.step_no > 400
