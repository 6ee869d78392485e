"""Time handling at the edges.

Events reach the owner from several threads, each stamping ``t_ns`` at its own moment, so they are
applied in inbox order, not in ``t_ns`` order (docs/architecture.md; docs/race-testing.md: "a
source's own events stay in order", nothing more). These tests apply events stamped before a Tick
after it, Ticks going backwards, times at exactly a bound, negative clocks, and compare the
wheel and the producer's leases with brute-force models. Which decisions use a stamp and which the
order of application: docs/decisions.md, "Events are judged in the order they are applied".
"""

from __future__ import annotations

from typing import Any

from helpers import connected, ev, make_core, read
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfsm.commands import FinishedSending, HandOff, SendNotification
from pdfsm.events import (
    BlocksHeld,
    HandleFailed,
    HandleFailure,
    Heartbeat,
    NotificationReceived,
    Tick,
)
from pdfsm.producer import S as P
from pdfsm.timers import Timers

SETTINGS = settings(derandomize=True, deadline=None, max_examples=200, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _offs(cmds: list[Any]) -> list[HandOff]:
    return [c for c in cmds if isinstance(c, HandOff)]


def _finished(core: Any) -> list[FinishedSending]:
    return [c for c in core.take_commands() if isinstance(c, FinishedSending)]


# --- consumer: a read's end stamped before a Tick past the lease, applied after it ---------------------------


def test_failed_read_stamped_before_trust_applied_after_a_tick_past_the_lease_sends_no_late_notice() -> None:
    """docs/decisions.md (vLLM PR 41269) and consumer._notify_unread: no notification "once the
    lease the params gave is over: the producer released by itself, and a notice now reads there
    as a read of reused blocks".

    Lease 1000 ns from t=0, margin 100: trust (and deadline) 900. A Tick at t=5000 (the producer's
    lease ended at 1000, long ago) fails the request, reads cancelled. Then the transfer thread's
    HandleFailed, stamped 800 but applied now, ends the last read. The core has already applied
    time 5000: the lease is over *now*, when the notice would be sent. Must: no SendNotification
    (the producer expired the hold at 1000 and would record a false corruption alarm)."""
    core = connected(make_core(strict=False, lease_margin_ns=100))
    core.apply(read("r", t=0, lease_ns=1000))
    core.take_commands()
    core.apply(ev(Tick, 5000))
    core.apply(ev(HandleFailed, 800, request_id="r", pp_rank=0, tp_rank=0, why=HandleFailure.ERR))
    sent = [c for c in core.take_commands() if isinstance(c, SendNotification)]
    assert sent == [], f"notice sent at core time 5000 for a lease that ended at 1000: {sent}"


# --- the wheel with ``now`` going backwards ------------------------------------------------------------

W_KEYS = [f"k{i}" for i in range(10)]
w_times = st.one_of(st.integers(-80, 80), st.sampled_from([-(1 << 20), -17, -16, -1, 0, 15, 16, 17, 1 << 20]))
w_ops = st.lists(st.one_of(
    st.tuples(st.just("arm"), st.sampled_from(W_KEYS), w_times),
    st.tuples(st.just("disarm"), st.sampled_from(W_KEYS), st.just(0)),
    st.tuples(st.just("due"), st.just(""), w_times),  # any ``now``: backwards too (a Tick from another thread)
    st.tuples(st.just("earliest"), st.just(""), st.just(0)),
), max_size=60)


@SETTINGS
@given(st.sampled_from([0, 3, 4, 24]), w_ops)
def test_wheel_agrees_with_a_dict_when_now_goes_backwards(shift: int, sequence: list[tuple[str, str, int]]) -> None:
    """timers.py: ``due(now)`` is "every (deadline, key) at or before now, earliest first". Ticks
    come from several threads, so ``now`` may go backwards between calls (the existing model
    tests only move it forward). Each call must still return exactly what is ripe at its ``now``."""
    wheel, model = Timers(shift=shift), dict[str, int]()
    for op, key, x in sequence:
        if op == "arm":
            if key in model:
                wheel.disarm(key, model.pop(key))
            wheel.arm(key, x)
            model[key] = x
        elif op == "disarm":
            if key in model:
                wheel.disarm(key, model.pop(key))
        elif op == "due":
            ripe = sorted((d, k) for k, d in model.items() if d <= x)
            assert wheel.due(x) == ripe, (x, model)
            for _, k in ripe:
                del model[k]
        else:
            assert wheel.earliest() == min(model.values(), default=None)
        assert len(wheel) == len(model)
    assert wheel.due(1 << 70) == sorted((d, k) for k, d in model.items())


# --- many producer leases, heartbeats and ticks in any stamp order, against a brute-force model ------

P_RIDS = [f"p{i}" for i in range(6)]
p_times = st.integers(0, 400)
p_ops = st.lists(st.one_of(
    st.tuples(st.just("hold"), st.sampled_from(P_RIDS), p_times, st.integers(1, 200)),
    st.tuples(st.just("hb"), st.sampled_from(P_RIDS), p_times, st.integers(1, 300)),
    st.tuples(st.just("note"), st.sampled_from(P_RIDS), p_times, st.just(0)),
    st.tuples(st.just("tick"), st.just(""), p_times, st.just(0)),
), max_size=50)


@SETTINGS
@given(st.sampled_from([2, 4, 24]), p_ops)
def test_producer_leases_with_heartbeats_match_a_brute_force_model(
        shift: int, sequence: list[tuple[str, str, int, int]]) -> None:
    """The vLLM PR 50789 shape (heartbeats reorder deadlines; an early-stopping scan skipped one),
    with stamps in any order. Model, applied in inbox order as the core applies events: a hold at t
    runs to ``t + lease`` (explicit per hold here: ``BlocksHeld.deadline``); a heartbeat on a live
    hold moves the deadline to ``max(deadline, t + extend)`` (producer.py: "never shortens"); the
    full notification releases it; a Tick at ``now`` expires every live hold whose deadline is at
    or before ``now`` (events.Tick), each exactly once. ``next_deadline`` is the earliest live one."""
    from pdfsm.core import Core
    from pdfsm.events import CoreConfig, Deadline

    core = Core(CoreConfig(engine_id="P", compat_hash="h", strict=False, lease_ns=1000, tombstones=0),
                timers=(Timers(shift), Timers(shift)))
    live: dict[str, int] = {}
    done: dict[str, bool] = {}  # rid -> expired
    reported: set[str] = set()
    for op, rid, t, x in sequence:
        if op == "hold":
            if rid in live or rid in done:
                continue
            core.apply(ev(BlocksHeld, t, request_id=rid, block_ids=(1,), deadline=Deadline("monotonic", t + x)))
            live[rid] = t + x
        elif op == "hb":
            if rid not in live:
                continue
            core.apply(ev(Heartbeat, t, request_id=rid, extend_ns=x))
            live[rid] = max(live[rid], t + x)
        elif op == "note":
            if rid not in live:
                continue
            core.apply(ev(NotificationReceived, t, request_id=rid, part=0, of=1))
            del live[rid]
            done[rid] = False
        else:
            core.apply(ev(Tick, t))
            for r in [r for r, d in live.items() if d <= t]:
                del live[r]
                done[r] = True
        got = {f.request_id: f.expired for f in _finished(core)}
        new = {r: e for r, e in done.items() if r not in reported}
        reported.update(done)
        assert got == new, (op, rid, t, x, got, new)
        assert core.next_deadline() == min(live.values(), default=None)
        assert {r: m.deadline for r, m in core.producers.items()} == live


# --- negative clocks: 0 is a time, not "none" ----------------------------------------------------------

T0 = -(10**12)  # a process-relative clock whose zero is 1000 s in the future (decisions.md: a real time)


def test_staged_then_held_request_on_a_negative_clock_expires_at_its_lease_not_at_zero() -> None:
    """docs/decisions.md "The read timeout is liveness; the lease is safety": "A deadline or trust
    bound that is 0 or negative is a real time (a process-relative clock): 'not armed' is None,
    never a value of the clock".

    A notification for part 0 of 2 arrives before the hold (staged), then BlocksHeld at T0 with a
    1 ms lease, no heartbeat anywhere. producer._hold_staged compares the default ``extended_to``
    (0, meaning "no promise") with the deadline T0 + 1 ms, finds 0 later, and moves the lease to t=0:
    1000 s later. Must: the hold expires at T0 + 1 ms like any other (the consumer's trust ended
    there; pinning the blocks for 1000 s is a leak). Same for a heartbeat whose promise (T0 + 100)
    is shorter than the staged lease: the lease stays at the staging deadline."""
    core = make_core(engine_id="P", strict=False, lease_ns=1_000_000)
    core.apply(ev(NotificationReceived, T0, request_id="a", part=0, of=2))
    core.apply(ev(BlocksHeld, T0, request_id="a", block_ids=(1,)))
    assert core.producers["a"].deadline == T0 + 1_000_000
    core.apply(ev(NotificationReceived, T0, request_id="b", part=0, of=2))
    core.apply(ev(Heartbeat, T0, request_id="b", extend_ns=100))  # a promise to T0 + 100 only
    assert core.producers["b"].deadline == T0 + 1_000_000
    core.apply(ev(Tick, T0 + 1_000_000))
    fin = _finished(core)
    assert [f.request_id for f in fin] == ["a"] and fin[0].expired
    assert "b" not in core.producers and core.next_deadline() is None  # "b", never held, went at the same time


def test_heartbeat_promise_ending_exactly_at_time_zero_is_still_a_promise() -> None:
    """docs/decisions.md "Staging overflow drops notifications before heartbeat promises": "one
    holding a heartbeat's promise goes only when nothing else is left". A heartbeat staged at
    t=-10_000 with extend 10_000 promises the lease until t=0; core.stage tests ``extended_to``
    for truth, so a promise ending exactly at 0 is filed with the notification-only entries and is
    dropped first. Must: with room for one, the later notification-only entry is dropped, the
    promise kept."""
    core = make_core(engine_id="P", strict=False, lease_ns=1000, max_staged=1)
    core.apply(ev(Heartbeat, -10_000, request_id="a", extend_ns=10_000))
    core.apply(ev(NotificationReceived, -9_000, request_id="b", part=0, of=2))
    assert "a" in core.producers and core.producers["a"].state is P.STAGED, "the heartbeat's promise was dropped"
    assert "b" not in core.producers


def test_replay_summary_last_t_ns_on_a_negative_clock_is_the_largest_time_recorded() -> None:
    """docs/replay-json.md: ``last_t_ns`` is "the largest ``t_ns`` up to ``last_seq``" (and the
    text report's span, and postmortem's "+X ms", are ``last_t_ns - first_t_ns``). On a clock that
    reads negative (decisions.md: a real time) every record is before 0, yet ``summarize`` starts
    the maximum at 0, so ``last_t_ns`` is 0, a time no record has, and the span is overstated
    (10 ms for a log that spans 6 ms here)."""
    from pdfsm.core import Core
    from pdfsm.events import CoreConfig
    from pdfsm.replay import render, summarize

    core = Core(CoreConfig(engine_id="P", compat_hash="h", lease_ns=1000), t_ns=-10_000_000)
    core.apply(ev(BlocksHeld, -9_000_000, request_id="r", block_ids=(1,)))
    core.apply(ev(NotificationReceived, -4_000_000, request_id="r", part=0, of=1))
    s = summarize(core.log.records())
    assert s.first_t_ns == -10_000_000
    assert s.last_t_ns == max(r.event.t_ns for r in core.log.records()) == -4_000_000, s.last_t_ns
    assert "6.0 ms" in next(render(s))
