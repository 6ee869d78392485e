"""Idle eviction of CONNECTED engines (commit 89e60ed): races and edge cases.

A CONNECTED engine nobody has read from for ``CoreConfig.idle_engine_ns`` is evicted by the core
(the idle timer derives ``EvictRequested``; the CONNECTED + EvictRequested cell drops the peer).
Checked here: the boundary time, idle_engine_ns=0, reads pushing the eviction back, a read and
the due timer in one pump (both orders, fast and slow path, single and multi-PP), reads in
flight, a multi-PP request holding one stage while it handshakes the other, notifications owed
(notify-only, MLA's skipped ranks, a request stopping before it reads), a handshake running when
the timer fires, quarantine / disconnect / reconnect (one timer per engine, no stale timer
evicting a new connection), engines forgotten and re-created under the same key, negative and
huge clocks, replay (and replay of logs written before the field existed), the race tester's
world, and Connectors over the simulated transport.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import (
    SimPair,
    collect,
    ev,
    make_core,
    read,
    reply,
    run_cli_captured,
    tick,
    write_worker_log,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfsm import engine
from pdfsm.commands import DropPeer, PostRead, SendNotification, StartHandshake
from pdfsm.connector import Connector
from pdfsm.core import Core
from pdfsm.errors import InvalidInput
from pdfsm.events import (
    AbortRequested,
    Collect,
    CoreConfig,
    EvictRequested,
    HandleDone,
    HandshakeDone,
    HandshakeFailed,
    PeerAdded,
    PeerDisconnected,
    Source,
    Tick,
)
from pdfsm.filelog import encode_frame, encode_header, read_log, segment_name
from pdfsm.log import MemorySink, Record
from pdfsm.replay import replay
from pdfsm.testing import explore
from pdfsm.testing.invariants import END_INVARIANTS
from pdfsm.testing.world import Scenario, World
from transports.sim import SimHandshaker, SimNetwork, SimTransport, pattern

ROOT = Path(__file__).resolve().parents[1]
S = 1_000_000_000
IDLE = 1_000  # the idle period of the core-level tests (ns; times are multiplied by a scale)
SCALES = pytest.mark.parametrize("k", [1, S], ids=["one-timer-slot", "many-timer-slots"])


# --- rigs ---------------------------------------------------------------------------------------


def core_(**cfg: Any) -> Core:
    return make_core(**{"idle_engine_ns": IDLE, **cfg})


def hs(core: Core, pp: int = 0, *, attempt: int = 1, t: int = 0, pp_size: int = 1, tp_size: int = 1,
       engine_id: str = "P") -> None:
    """Answer the handshake of (engine_id, pp) attempt ``attempt``; the transport adds the peer."""
    core.apply(ev(HandshakeDone, t, engine_id=engine_id, pp_rank=pp, attempt=attempt,
                  reply=reply(engine_id, pp_rank=pp, pp_size=pp_size, tp_size=tp_size, mla=core.config.mla)))
    core.apply(ev(PeerAdded, t, engine_id=engine_id, pp_rank=pp, attempt=attempt))


def connect_at(core: Core, t: int, *, engine_id: str = "P", remote_tp: int = 1) -> None:
    """Connect ``engine_id`` at ``t`` by running a warm-up request through it, all stamped ``t``."""
    rid = f"warm-{engine_id}-{t}"
    core.apply(read(rid, engine=engine_id, remote_tp=remote_tp, t=t))
    cmds = core.take_commands()
    (start,) = [c for c in cmds if isinstance(c, StartHandshake)]
    hs(core, attempt=start.attempt, t=t, tp_size=remote_tp, engine_id=engine_id)
    for src in core.plan(remote_tp, 1).sources:
        core.apply(ev(HandleDone, t, request_id=rid, pp_rank=src.pp_rank, tp_rank=src.tp_rank))
    core.apply(ev(Collect, t, step=0))
    core.take_commands()


def connect_pp2_at(core: Core, t: int) -> None:
    """Connect both stages of a PP-2 producer P at ``t`` (one warm-up request, read to the end)."""
    core.apply(read("warm", remote_pp=2, t=t))
    core.take_commands()
    for pp in (0, 1):
        hs(core, pp, t=t, pp_size=2)
    for src in core.plan(1, 2).sources:
        core.apply(ev(HandleDone, t, request_id="warm", pp_rank=src.pp_rank, tp_rank=src.tp_rank))
    core.apply(ev(Collect, t, step=0))
    core.take_commands()


def armed(core: Core, key: tuple[str, int]) -> list[int]:
    """The idle timers armed for one engine key (the wheel's own entries)."""
    name = f"{key[1]}:{key[0]}"
    return sorted(d for slot in core.idle._slots.values() for k, d in slot.items() if k == name)


def state(core: Core, key: tuple[str, int] = ("P", 0)) -> Any:
    e = core.engines.get(key)
    return None if e is None else e.state


def drops(cmds: list[Any], pp: int | None = None) -> list[DropPeer]:
    return [c for c in cmds if isinstance(c, DropPeer) and (pp is None or c.pp_rank == pp)]


def pump(core: Core, *events: Any) -> list[Any]:
    """Submit ``events`` in order, apply them in one pump; the commands that came of them."""
    for e in events:
        core.submit(e)
    core.pump()
    return core.take_commands()


def idle_evictions(records: list[Record]) -> list[Record]:
    """Connected engines the core evicted (not failed ones it forgot: a handshake unanswered past
    handshake_timeout_ns fails, and a failed engine is forgotten, whatever idle_engine_ns says)."""
    return [r for r in records if isinstance(r.event, EvictRequested) and r.event.source == Source.CORE
            and r.before == "CONNECTED" and r.state == "EVICTED"]


# --- the timer itself ---------------------------------------------------------------------------


@SCALES
def test_connected_engine_is_evicted_exactly_at_the_idle_boundary_and_not_a_nanosecond_before(k: int) -> None:
    """Scenario: P connects at c; Ticks at c+IDLE-1, then c+IDLE. Expected: still CONNECTED with
    no DropPeer at the first; at the second, one derived EvictRequested (cause: the Tick) evicts
    it, DropPeer is emitted, the engine and its timer are gone."""
    core = core_(idle_engine_ns=IDLE * k)
    c = 7 * k
    connect_at(core, c)
    assert armed(core, ("P", 0)) == [c + IDLE * k] and core.next_deadline() == c + IDLE * k
    tick(core, c + IDLE * k - 1)
    assert state(core) is engine.S.CONNECTED and not drops(core.take_commands())
    seq = core.log.next_seq
    tick(core, c + IDLE * k)
    assert drops(core.take_commands()) == [DropPeer(engine_id="P", pp_rank=0)]
    assert core.engines == {} and len(core.idle) == 0 and core.engines_forgotten == 1
    (rec,) = [r for r in core.log.records() if isinstance(r.event, EvictRequested)]
    assert rec.cause == seq and rec.event.source == Source.CORE and rec.state == "EVICTED"


def test_idle_engine_ns_zero_never_evicts_a_connected_engine_nor_arms_a_timer() -> None:
    """Scenario: idle_engine_ns=0; P connects, disconnects (forget timer), reconnects. Expected: no
    idle timer while connected; Ticks up to 2**62 leave it CONNECTED."""
    core = core_(idle_engine_ns=0, tombstone_ns=50, handshake_retry_ns=20)
    connect_at(core, 0)
    assert len(core.idle) == 0 and core.next_deadline() is None
    core.apply(ev(PeerDisconnected, 10, engine_id="P", pp_rank=0, attempt=1, detail="gone"))
    assert armed(core, ("P", 0)) == [60]
    core.apply(read("r", t=20))
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    hs(core, attempt=start.attempt, t=30)
    assert armed(core, ("P", 0)) == [] and len(core.idle) == 0  # the forget timer went with the reconnect
    core.apply(ev(HandleDone, 31, request_id="r", pp_rank=0, tp_rank=0))
    for t in (60, 10**12, 1 << 62):
        tick(core, t)
    assert state(core) is engine.S.CONNECTED and not drops(core.take_commands())


@SCALES
def test_reads_push_the_eviction_back_to_the_last_read_plus_the_period(k: int) -> None:
    """Scenario: P connects at 0; a read at IDLE-1 (fast path), done at IDLE-1; Ticks at IDLE,
    2*IDLE-2, 2*IDLE-1. Expected: evicted at the last only (one timer armed throughout)."""
    core = core_(idle_engine_ns=IDLE * k)
    connect_at(core, 0)
    t = IDLE * k - 1
    core.apply(read("r", t=t))
    assert [type(c) for c in core.take_commands()] == [PostRead]
    core.apply(ev(HandleDone, t, request_id="r", pp_rank=0, tp_rank=0))
    tick(core, IDLE * k)
    assert state(core) is engine.S.CONNECTED and armed(core, ("P", 0)) == [t + IDLE * k]
    tick(core, t + IDLE * k - 1)
    assert state(core) is engine.S.CONNECTED and not drops(core.take_commands())
    tick(core, t + IDLE * k)
    assert state(core) is None and len(drops(core.take_commands())) == 1


# --- a read and the due timer in one pump --------------------------------------------------------


@pytest.mark.parametrize("path", ["fast", "slow"])
def test_read_applied_before_the_due_tick_in_one_pump_keeps_the_engine(path: str) -> None:
    """Scenario: P connected at 0; one pump holds ReadRequested (stamped IDLE) then the Tick at
    IDLE that makes the idle timer due. ``slow``: the layout's plan is not cached, so the request
    takes the long road. Expected: the read is posted on the existing connection, no DropPeer,
    no new handshake; the engine goes only IDLE after the read (and after it completed)."""
    core = core_()
    connect_at(core, 0)
    if path == "slow":
        core.plans.clear()
    cmds = pump(core, read("r", t=IDLE), ev(Tick, IDLE))
    assert [type(c) for c in cmds] == [PostRead]
    assert state(core) is engine.S.CONNECTED and core.engines[("P", 0)].readers == 1
    tick(core, 5 * IDLE)  # reads in flight: never evicted
    assert state(core) is engine.S.CONNECTED and not drops(core.take_commands())
    core.apply(ev(HandleDone, 5 * IDLE, request_id="r", pp_rank=0, tp_rank=0))
    tick(core, 6 * IDLE - 1)  # held at the look at 5 IDLE: looked at again a period later
    assert state(core) is engine.S.CONNECTED
    tick(core, 6 * IDLE)
    assert state(core) is None and len(drops(core.take_commands())) == 1


@pytest.mark.parametrize("path", ["fast", "slow"])
def test_due_tick_applied_before_a_read_in_one_pump_evicts_then_the_read_handshakes_afresh(path: str) -> None:
    """Scenario: as above with the Tick first in the inbox. Expected: DropPeer, then a new
    handshake (an attempt numbered above the forgotten machine's); nothing is posted until the
    new peer is added; then the read is posted and completes."""
    core = core_()
    connect_at(core, 0)
    if path == "slow":
        core.plans.clear()
    cmds = pump(core, ev(Tick, IDLE), read("r", t=IDLE))
    assert [type(c) for c in cmds] == [DropPeer, StartHandshake]
    attempt = cmds[1].attempt
    assert attempt == (1 << 32) + 1 and state(core) is engine.S.HANDSHAKING
    core.apply(ev(PeerAdded, IDLE + 1, engine_id="P", pp_rank=0, attempt=1))  # the old attempt: stale
    assert state(core) is engine.S.HANDSHAKING and not core.take_commands()
    hs(core, attempt=attempt, t=IDLE + 2)
    assert [type(c).__name__ for c in core.take_commands()] == ["AddPeer", "PostRead"]
    core.apply(ev(HandleDone, IDLE + 3, request_id="r", pp_rank=0, tp_rank=0))
    assert [r for r in collect(core, IDLE + 4) if getattr(r, "outcome", "") == "received"]


def test_pp2_read_and_due_timers_in_one_pump_both_orders() -> None:
    """Scenario: both stages of a PP-2 producer connected at 0 (multi-PP: always the long road);
    a read and the Tick at IDLE in one pump, read first, then (another core) Tick first.
    Expected: read first: both reads posted, no DropPeer. Tick first: both stages dropped before
    two new handshakes start, and no read is posted before they connect."""
    core = core_()
    connect_pp2_at(core, 0)
    cmds = pump(core, read("r", remote_pp=2, t=IDLE), ev(Tick, IDLE))
    assert sorted(c.source.pp_rank for c in cmds if isinstance(c, PostRead)) == [0, 1] and not drops(cmds)
    core = core_()
    connect_pp2_at(core, 0)
    cmds = pump(core, ev(Tick, IDLE), read("r", remote_pp=2, t=IDLE))
    kinds = [type(c).__name__ for c in cmds]
    assert kinds == ["DropPeer", "DropPeer", "StartHandshake", "StartHandshake"], kinds
    starts = [c for c in cmds if isinstance(c, StartHandshake)]
    hs(core, 0, attempt=starts[0].attempt, t=IDLE + 1, pp_size=2)
    assert not [c for c in core.take_commands() if isinstance(c, PostRead)]  # stage 1 not connected yet
    hs(core, 1, attempt=starts[1].attempt, t=IDLE + 2, pp_size=2)
    assert sorted(c.source.pp_rank for c in core.take_commands() if isinstance(c, PostRead)) == [0, 1]


def test_engine_with_reads_in_flight_is_never_evicted_and_keeps_one_timer() -> None:
    """Scenario: a read stays in flight from 0 while Ticks pass 1, 5 and 100 periods later.
    Expected: never evicted, no DropPeer, no EvictRequested recorded (the core does not even ask),
    one timer armed; evicted one period after the read ends."""
    core = core_(read_timeout_ns=10**6 * IDLE)
    connect_at(core, 0)
    core.apply(read("r", t=0))
    core.take_commands()
    for t in (IDLE, 5 * IDLE, 100 * IDLE):
        tick(core, t)
        assert state(core) is engine.S.CONNECTED and len(armed(core, ("P", 0))) == 1 and len(core.idle) == 1
    assert not drops(core.take_commands())
    assert not [r for r in core.log.records() if isinstance(r.event, EvictRequested)]
    core.apply(ev(HandleDone, 100 * IDLE + 5, request_id="r", pp_rank=0, tp_rank=0))
    tick(core, 101 * IDLE)  # looked at again one period after the last look, the engine free now
    assert state(core) is None and len(drops(core.take_commands())) == 1


# --- multi-PP: one stage held while the other handshakes ---------------------------------------------


def _pp2_stage1_lost_then_request(core: Core, t_request: int) -> int:
    """Both stages connected at 0; stage 1 disconnects at 5; request "r" (PP 2) at
    ``t_request`` holds stage 0 and handshakes stage 1 again; returns that attempt."""
    connect_pp2_at(core, 0)
    core.apply(ev(PeerDisconnected, 5, engine_id="P", pp_rank=1, attempt=1, detail="gone"))
    core.take_commands()
    core.apply(read("r", remote_pp=2, t=t_request))
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert core.engines[("P", 0)].readers == 1
    return start.attempt


def test_stage_held_by_a_request_handshaking_its_sibling_is_not_evicted_and_is_read_after() -> None:
    """Scenario: stage 0 idle-due at IDLE while request r holds it and stage 1 handshakes; Ticks at
    IDLE and 3*IDLE; then stage 1 connects. Expected: stage 0 never dropped; both reads posted on
    live peers and the request completes."""
    core = core_(read_timeout_ns=10 * IDLE, tombstone_ns=10 * IDLE)
    attempt = _pp2_stage1_lost_then_request(core, 10)
    for t in (IDLE, 3 * IDLE):
        tick(core, t)
        assert state(core, ("P", 0)) is engine.S.CONNECTED
    assert not drops(core.take_commands(), pp=0)
    hs(core, 1, attempt=attempt, t=3 * IDLE + 1, pp_size=2)
    assert sorted(c.source.pp_rank for c in core.take_commands() if isinstance(c, PostRead)) == [0, 1]
    for pp in (0, 1):
        core.apply(ev(HandleDone, 3 * IDLE + 2, request_id="r", pp_rank=pp, tp_rank=0))
    assert [c for c in collect(core, 3 * IDLE + 3) if getattr(c, "outcome", "") == "received"]


def test_a_stage_read_in_a_multi_pp_request_is_not_evicted_before_a_period_after_that_read() -> None:
    """Scenario: stage 0 connected at 0; request r arrives at 10, holds stage 0 and handshakes
    stage 1, which connects at 900: both stages are read at 900 (done at 901). Ticks at 1000,
    1010 and 1899 (IDLE = 1000).
    Expected: stage 0, read at 900, stays CONNECTED until 1900 (nobody has read from it for
    idle_engine_ns only then), as stage 1 does.
    Found in review: it was evicted at 1010, 110 ns after it was read: consumer._post_reads set
    ``e.idle_since = req.t_ns`` (10, when the request arrived), moving idle_since back past the
    read it is recording."""
    core = core_(read_timeout_ns=10 * IDLE)
    attempt = _pp2_stage1_lost_then_request(core, 10)
    hs(core, 1, attempt=attempt, t=900, pp_size=2)
    assert sorted(c.source.pp_rank for c in core.take_commands() if isinstance(c, PostRead)) == [0, 1]
    for pp in (0, 1):
        core.apply(ev(HandleDone, 901, request_id="r", pp_rank=pp, tp_rank=0))
    collect(core, 901)
    for t in (1000, 1010, 1899):
        tick(core, t)
        assert state(core, ("P", 0)) is engine.S.CONNECTED, (t, core.engines)
    tick(core, 1900)
    assert core.engines == {}


# --- notifications still owed -----------------------------------------------------------------------


def _sent_before_drop(cmds: list[Any], pp: int) -> None:
    """Every notification to stage ``pp`` comes before its DropPeer, if any."""
    kinds = [("note" if isinstance(c, SendNotification) else "drop") for c in cmds
             if isinstance(c, (SendNotification, DropPeer)) and c.pp_rank == pp]
    assert "note" in kinds and kinds == sorted(kinds, key=lambda x: x == "drop"), kinds


def test_notify_only_request_due_with_the_timer_notifies_before_the_peer_is_dropped() -> None:
    """Scenario: P connected at 0; a notify-only request (no blocks) and the Tick at IDLE in one
    pump, both orders. Expected: request first: its notification goes out on the connection, then
    the engine (a notification is no read) is dropped. Tick first: the engine is dropped, a new
    handshake starts, and the notification goes only once the new peer is added."""
    core = core_()
    connect_at(core, 0)
    cmds = pump(core, read("n", blocks=(), t=IDLE), ev(Tick, IDLE))
    _sent_before_drop(cmds, 0)
    core = core_()
    connect_at(core, 0)
    cmds = pump(core, ev(Tick, IDLE), read("n", blocks=(), t=IDLE))
    assert [type(c) for c in cmds] == [DropPeer, StartHandshake]
    hs(core, attempt=cmds[1].attempt, t=IDLE + 1)
    assert [type(c).__name__ for c in core.take_commands()] == ["AddPeer", "SendNotification"]


def test_mla_skipped_rank_is_notified_before_an_eviction_due_in_the_same_pump() -> None:
    """Scenario: MLA, producer TP 2 (one rank read, the other skipped: notify-only); the read
    completes in the same pump as the Tick that makes the idle timer due. Expected: both ranks
    notified (the read's own notification travels with it; the skipped rank gets a
    SendNotification) before DropPeer."""
    core = core_(mla=True)
    connect_at(core, 0, remote_tp=2)
    core.apply(read("r", remote_tp=2, t=0))
    assert len([c for c in core.take_commands() if isinstance(c, PostRead)]) == 1
    cmds = pump(core, ev(HandleDone, IDLE, request_id="r", pp_rank=0, tp_rank=0), ev(Tick, IDLE))
    assert [(c.pp_rank, c.tp_rank) for c in cmds if isinstance(c, SendNotification)] == [(0, 1)]
    _sent_before_drop(cmds, 0)
    assert state(core) is None


@pytest.mark.parametrize("stop", ["handshake-fails", "abort", "deadline"])
@pytest.mark.parametrize("order", ["stop-first", "tick-first"])
def test_request_stopping_before_it_reads_notifies_the_held_stage_before_it_is_evicted(stop: str, order: str) -> None:
    """Scenario: request r holds stage 0 (idle-due at IDLE) while stage 1 handshakes; r stops
    before reading (stage 1's handshake fails, an abort, or its deadline, which is also IDLE) in
    the same pump as the Tick at IDLE, either order. Expected: stage 0's rank is told r's blocks
    may go (connected_only) while the peer is still there; any DropPeer of stage 0 comes after;
    stage 0 is evicted by IDLE after r let it go at the latest."""
    core = core_(read_timeout_ns=IDLE - 10, tombstone_ns=10 * IDLE)
    attempt = _pp2_stage1_lost_then_request(core, 10)
    stopping = {"handshake-fails": ev(HandshakeFailed, IDLE, engine_id="P", pp_rank=1, attempt=attempt,
                                      error="connection refused"),
                "abort": ev(AbortRequested, IDLE, request_id="r"),
                "deadline": None}[stop]
    events = [e for e in ((stopping, ev(Tick, IDLE)) if order == "stop-first" else (ev(Tick, IDLE), stopping))
              if e is not None]
    cmds = pump(core, *events)
    cmds += collect(core, IDLE)
    tick(core, 2 * IDLE)
    cmds += core.take_commands()
    notes = [(c.pp_rank, c.notification.request_id) for c in cmds if isinstance(c, SendNotification)]
    assert notes == [(0, "p-r")], notes
    _sent_before_drop(cmds, 0)
    assert state(core, ("P", 0)) is None


# --- handshakes, quarantine, disconnect, reconnect --------------------------------------------------


@SCALES
@pytest.mark.parametrize("was", ["disconnected", "failed"])
def test_timer_firing_while_a_handshake_runs_evicts_nothing_and_its_outcome_arms_one_timer(k: int, was: str) -> None:
    """Scenario: P connected at 0 then lost at 10 (disconnected, or its re-handshake failed:
    forget timer at 10+F); a request at 10+F-1 starts a handshake; the forget timer fires at 10+F
    while it runs (HANDSHAKING, then CONNECTING). Expected: nothing evicted, no timer left
    armed; the handshake's outcome arms exactly one: connected at 10+F+1 -> evicted at
    10+F+1+IDLE, not before."""
    f = 50 * k
    core = core_(idle_engine_ns=IDLE * k, tombstone_ns=f, handshake_retry_ns=20 * k, read_timeout_ns=10 * IDLE * k)
    connect_at(core, 0)
    t0 = 10 * k
    if was == "disconnected":
        core.apply(ev(PeerDisconnected, t0, engine_id="P", pp_rank=0, attempt=1, detail="gone"))
    else:
        core.apply(ev(PeerDisconnected, t0 - 2, engine_id="P", pp_rank=0, attempt=1, detail="gone"))
        core.apply(read("x", t=t0 - 1))
        (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
        core.apply(ev(HandshakeFailed, t0, engine_id="P", pp_rank=0, attempt=start.attempt, error="refused"))
        collect(core, t0)
    core.take_commands()
    assert armed(core, ("P", 0)) == [t0 + f]
    core.apply(read("r", t=t0 + f - 1))
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    tick(core, t0 + f)
    # Only the attempt's own bound (handshake_timeout_ns: twice the read timeout) stays armed.
    assert state(core) is engine.S.HANDSHAKING and armed(core, ("P", 0)) == [t0 + f - 1 + 20 * IDLE * k]
    core.apply(ev(HandshakeDone, t0 + f + 1, engine_id="P", pp_rank=0, attempt=start.attempt, reply=reply("P")))
    tick(core, t0 + f + 1)  # a Tick while CONNECTING
    assert state(core) is engine.S.CONNECTING
    core.apply(ev(PeerAdded, t0 + f + 1, engine_id="P", pp_rank=0, attempt=start.attempt))
    assert armed(core, ("P", 0)) == [t0 + f + 1 + IDLE * k] and len(core.idle) == 1
    core.apply(ev(HandleDone, t0 + f + 2, request_id="r", pp_rank=0, tp_rank=0))
    collect(core, t0 + f + 2)
    # the read's stamp (t0+f-1, the request's) is before the connection: idle since the connection
    tick(core, t0 + f + IDLE * k)
    assert state(core) is engine.S.CONNECTED
    tick(core, t0 + f + 1 + IDLE * k)
    assert state(core) is None


@SCALES
@pytest.mark.parametrize("loss", ["disconnect", "quarantine"])
def test_reconnected_engine_has_one_timer_and_the_old_connections_timer_never_evicts_it(k: int, loss: str) -> None:
    """Scenario: connected at 0 (idle timer at IDLE); lost at 10 (PeerDisconnected, or quarantined
    by the core); handshaken again and connected at 30 (timer at 30+IDLE). Expected: exactly one
    timer armed for the key at each stage; Ticks at the old deadlines (IDLE, and the forget
    deadline) leave the new connection alone; evicted at 30+IDLE exactly."""
    core = core_(idle_engine_ns=IDLE * k, tombstone_ns=50 * k, handshake_retry_ns=20 * k, strict=False)
    connect_at(core, 0)
    assert armed(core, ("P", 0)) == [IDLE * k]
    if loss == "disconnect":
        core.apply(ev(PeerDisconnected, 10 * k, engine_id="P", pp_rank=0, attempt=1, detail="gone"))
        assert state(core) is engine.S.DISCONNECTED
    else:
        from pdfsm.events import EngineQuarantined
        core.apply(ev(EngineQuarantined, 10 * k, engine_id="P", pp_rank=0, reason="test"))
        assert state(core) is engine.S.FAILED
    assert drops(core.take_commands()) and armed(core, ("P", 0)) == [60 * k]
    core.apply(read("r", t=30 * k))
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    bound = 2 * core.config.read_timeout_ns  # handshake_timeout_ns's default: the attempt's bound
    assert armed(core, ("P", 0)) == [30 * k + bound]
    hs(core, attempt=start.attempt, t=30 * k)
    assert armed(core, ("P", 0)) == [30 * k + IDLE * k] and len(core.idle) == 1
    core.apply(ev(HandleDone, 30 * k, request_id="r", pp_rank=0, tp_rank=0))
    for t in (60 * k, IDLE * k, 30 * k + IDLE * k - 1):
        tick(core, t)
        assert state(core) is engine.S.CONNECTED, t
    tick(core, 30 * k + IDLE * k)
    assert state(core) is None and len(core.idle) == 0


@SCALES
@pytest.mark.parametrize("how", ["operator-evicts-connected", "failed-and-forgotten"])
def test_engine_recreated_under_the_same_key_is_not_evicted_by_the_forgotten_machines_timer(k: int, how: str) -> None:
    """Scenario: P's first machine leaves a timer armed when it is forgotten (an operator's
    EvictRequested while CONNECTED, timer at IDLE; or FAILED and evicted by an operator, forget
    timer at 5+F); a new machine under the same key connects at 20 (timer at 20+IDLE).
    Expected: the stale timers are skipped (the new machine stays CONNECTED until 20+IDLE
    exactly), its attempts are numbered above the old one's (the old attempt's late PeerAdded is
    stale), and the wheel ends empty."""
    core = core_(idle_engine_ns=IDLE * k, tombstone_ns=50 * k, handshake_retry_ns=1)
    if how == "operator-evicts-connected":
        connect_at(core, 0)
        core.apply(ev(EvictRequested, 5 * k, source=Source.SCHEDULER, engine_id="P", pp_rank=0))
        stale = [IDLE * k]
    else:
        core.apply(read("x", t=0))
        core.take_commands()
        core.apply(ev(HandshakeFailed, 5 * k, engine_id="P", pp_rank=0, attempt=1, error="refused"))
        collect(core, 5 * k)
        core.apply(ev(EvictRequested, 6 * k, source=Source.SCHEDULER, engine_id="P", pp_rank=0))
        stale = [55 * k]
    assert state(core) is None and core.engines_forgotten == 1
    core.apply(read("r", t=20 * k))
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert start.attempt == (1 << 32) + 1
    hs(core, attempt=start.attempt, t=20 * k)
    core.apply(ev(PeerAdded, 20 * k, engine_id="P", pp_rank=0, attempt=1))  # the old machine's: stale
    core.apply(ev(HandleDone, 20 * k, request_id="r", pp_rank=0, tp_rank=0))
    for t in (*stale, 20 * k + IDLE * k - 1):
        tick(core, t)
        assert state(core) is engine.S.CONNECTED, t
    tick(core, 20 * k + IDLE * k)
    assert state(core) is None and len(core.idle) == 0 and core.next_deadline() is None


def test_many_engines_read_over_and_over_keep_one_timer_each() -> None:
    """Scenario: 30 engines connected, each read 20 times, some disconnected and reconnected.
    Expected: the idle wheel holds one entry per engine (reads move idle_since, they arm
    nothing); all go one period after their last use."""
    core = core_(tombstone_ns=10, handshake_retry_ns=1)
    for i in range(30):
        connect_at(core, i, engine_id=f"E{i}")
    t = 100
    for round_ in range(20):
        for i in range(30):
            rid = f"r{round_}-{i}"
            core.apply(read(rid, engine=f"E{i}", t=t))
            cmds = core.take_commands()
            for c in cmds:
                if isinstance(c, StartHandshake):
                    hs(core, attempt=c.attempt, t=t, engine_id=f"E{i}")
            core.apply(ev(HandleDone, t, request_id=rid, pp_rank=0, tp_rank=0))
            if round_ % 7 == 3 and i % 5 == 0:
                core.apply(ev(PeerDisconnected, t, engine_id=f"E{i}", pp_rank=0, attempt=0, detail="gone"))
            t += 1
        collect(core, t)
        assert len(core.idle) == len(core.engines) == 30, (len(core.idle), len(core.engines))
    tick(core, t + IDLE)
    assert core.engines == {} and len(core.idle) == 0


# --- clocks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", [-(10**15), -IDLE // 2, (1 << 62) - 3], ids=["negative", "straddling-zero", "huge"])
def test_idle_eviction_on_negative_and_huge_clocks_lands_exactly_at_the_boundary(base: int) -> None:
    """Scenario: a clock whose readings are negative (process-relative), straddle zero, or near
    2**62; P connects at ``base``, is read at base+1. Expected: CONNECTED at base+1+IDLE-1,
    evicted at base+1+IDLE (a reading 0 or below is a real time, never "not armed")."""
    core = Core(CoreConfig(engine_id="D", compat_hash="h", strict=True, idle_engine_ns=IDLE), t_ns=base)
    connect_at(core, base)
    core.apply(read("r", t=base + 1))
    core.apply(ev(HandleDone, base + 1, request_id="r", pp_rank=0, tp_rank=0))
    collect(core, base + 1)
    tick(core, base + IDLE)
    tick(core, base + IDLE)  # twice at one time: nothing more
    assert state(core) is engine.S.CONNECTED
    tick(core, base + 1 + IDLE)
    assert state(core) is None and len(core.idle) == 0


# --- replay ---------------------------------------------------------------------------------------------


def _log_with_idle_evictions(sink: MemorySink, **cfg: Any) -> Core:
    """A decode core's log: P connects, is read, idles out, is handshaken again, read again, idles
    out again; a PP-2 producer Q keeps one stage held while the other idles out."""
    core = make_core(strict=False, sink=sink, **{"idle_engine_ns": IDLE, **cfg})
    connect_at(core, 0)
    core.apply(read("a", t=IDLE - 1))
    core.apply(ev(HandleDone, IDLE - 1, request_id="a", pp_rank=0, tp_rank=0))
    collect(core, IDLE - 1)
    tick(core, IDLE)
    tick(core, 2 * IDLE - 1)
    core.apply(read("b", t=2 * IDLE + 5))
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    hs(core, attempt=start.attempt, t=2 * IDLE + 6)
    core.apply(ev(HandleDone, 2 * IDLE + 7, request_id="b", pp_rank=0, tp_rank=0))
    collect(core, 2 * IDLE + 7)
    tick(core, 4 * IDLE)
    core.log.flush()
    return core


def test_a_log_with_idle_evictions_replays_without_divergence(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: a decode log holding two idle evictions (derived, with the Tick as cause) and a
    re-handshake between them, replayed in memory and by `pdfsm replay` from a segment.
    Expected: no divergence, exit 0, the rebuilt core has no engine."""
    sink = MemorySink()
    _log_with_idle_evictions(sink)
    assert len(idle_evictions(sink.records)) == 2
    rebuilt = replay(sink.records)
    assert rebuilt.engines == {} and rebuilt.engines_forgotten == 2
    log = write_worker_log(tmp_path / "decode-pp0-tp0", sink.records)
    code, out, err = run_cli_captured(capsys, "replay", str(log), "--timelines", "0")
    assert code == 0 and "replayed, no divergence" in out, out + err


def test_a_log_written_before_idle_engine_ns_existed_replays_without_divergence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: a decode log written by pdfsm before 89e60ed: its Started config has no
    ``idle_engine_ns`` field (CoreConfig is a map in the log), and that pdfsm kept a connected
    engine for ever: P connected at 0, read at 1, and a Tick two hours later evicts nothing. The
    records are made by a core with idle_engine_ns=0 (exactly the older behaviour), the field then
    removed from the Started row as the older writer laid it out.
    Expected: replays with no divergence (docs/log-format.md: "A field's meaning must not change
    under an old default ... a row written before the field existed decodes with the default, and
    a replay judges it by today's rules"; the default must mean what the older writer did): the
    frame says schema 2, and the upcaster to schema 3 gives the config 0 (never)."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink, idle_engine_ns=0)
    connect_at(core, 0)
    core.apply(read("r", t=1))
    core.apply(ev(HandleDone, 1, request_id="r", pp_rank=0, tp_rank=0))
    collect(core, 1)
    tick(core, 2 * 3_600 * S)
    core.apply(read("r2", t=2 * 3_600 * S + 1))  # read over the same connection, two hours on
    core.apply(ev(HandleDone, 2 * 3_600 * S + 2, request_id="r2", pp_rank=0, tp_rank=0))
    core.log.flush()
    assert not idle_evictions(sink.records)
    rows: list[list[Any]] = msgspec.msgpack.decode(msgspec.msgpack.encode(sink.records))
    assert rows[0][1][0] == "Started"
    del rows[0][1][3]["idle_engine_ns"]  # the older writer's config had no such field
    log = tmp_path / "decode-pp0-tp0"
    log.mkdir()
    header, prev = encode_header(rows[0][0], bytes(8), {"engine_id": "D"})
    payload = msgspec.msgpack.encode(rows)
    head, _ = encode_frame(payload, len(rows), rows[0][0], prev, wall_ns=0, mono_ns=0, schema=2)
    (log / segment_name(rows[0][0])).write_bytes(header + head + payload)
    assert len(read_log(log)) == len(sink.records)
    code, out, err = run_cli_captured(capsys, "replay", str(log), "--timelines", "0")
    assert code == 0 and "replayed, no divergence" in out, out + err


# --- the race tester's world ------------------------------------------------------------------------


class _Watched(World):
    """The race tester's world, also noting every read posted and every notification sent to a
    peer the consumer's transport does not hold (dropped by an eviction, or never added)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.strays: list[tuple[Any, ...]] = []

    def _send(self, name: str, engine_id: str, pp: int, tp: int, note: Any) -> None:
        if (int(name[1:]), engine_id, pp) not in self.peers and not self.disconnected:
            self.strays.append(("send", name, engine_id, pp, tp, note.request_id))
        super()._send(name, engine_id, pp, tp, note)

    def _post(self, name: str, cmd: PostRead) -> None:
        if (int(name[1:]), cmd.engine_id, cmd.source.pp_rank) not in self.peers:
            self.strays.append(("post", name, cmd.request_id, cmd.source.pp_rank))
        super()._post(name, cmd)


_NO_LOSS = frozenset({"abort", "read-err", "handshake-refuse", "handshake-timeout", "notify-drop", "heartbeat",
                      "evict", "peer-refused"})
_SHAPES = {
    "basic": Scenario(requests=3, idle_engine_ns=3, faults=_NO_LOSS),
    "PP 2": Scenario(producer_pp=2, idle_engine_ns=3, faults=_NO_LOSS),
    "MLA": Scenario(producer_tp=2, mla=True, idle_engine_ns=2, faults=_NO_LOSS),
    "PP 2 notify-only": Scenario(producer_pp=2, notify_only=(0,), idle_engine_ns=2, faults=_NO_LOSS),
    "peer added async": Scenario(add_peer_async=True, idle_engine_ns=1, faults=_NO_LOSS),
    "with disconnects": Scenario(consumer_tp=2, idle_engine_ns=2),
}


@pytest.mark.parametrize("shape", list(_SHAPES))
def test_race_world_with_short_idle_periods_keeps_every_invariant_and_replays(shape: str) -> None:
    """Scenario: the race tester's world with idle periods of 1-3 ns (engines idle out between
    almost any two steps), Hypothesis choosing interleavings and faults. Expected: every step and
    end invariant holds (the world fails on a DropPeer with reads in flight); with no loss faults,
    no read is posted and no notification sent to a peer the transport does not hold; idle
    evictions happen; each core's log replays without divergence."""
    scenario = _SHAPES[shape]
    seen = {"evictions": 0}

    @settings(max_examples=100, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: st.DataObject) -> None:
        w = _Watched(scenario)
        explore._choose(w, data)
        w.drain()
        for invariant in END_INVARIANTS:
            invariant(w)
        if scenario.faults == _NO_LOSS:
            assert not w.strays, (w.strays, "\n".join(w.journal))
        for records in w.records().values():
            seen["evictions"] += len(idle_evictions(records))
            replay(records)

    run()
    assert seen["evictions"] > 20, seen


def test_race_world_idle_engine_ns_zero_never_evicts() -> None:
    """Scenario: the world with idle_engine_ns=0 and no operator evictions or disconnects, settled.
    Expected: no idle eviction in any log; the consumer's engine is still CONNECTED at the end."""
    faults = _NO_LOSS - {"evict", "handshake-refuse", "handshake-timeout", "peer-refused"}

    @settings(max_examples=30, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: st.DataObject) -> None:
        w = World(Scenario(idle_engine_ns=0, faults=faults))
        explore._choose(w, data)
        w.drain()
        assert not any(idle_evictions(r) for r in w.records().values())
        assert all(e.state is engine.S.CONNECTED for e in w.consumers[0].engines.values())

    run()


# --- Connectors over the simulated transport ---------------------------------------------------------


def _watch_transport(t: SimTransport) -> list[str]:
    """Wrap ``t`` so that a read posted to a peer it does not hold, or a peer dropped under a read
    in flight, is noted."""
    bad: list[str] = []
    post, drop = t.post_read, t.drop_peer

    def post_read(cmd: PostRead) -> None:
        if (cmd.engine_id, cmd.source.pp_rank) not in t.peers:
            bad.append(f"read {cmd.request_id} posted to dropped peer {cmd.engine_id}")
        post(cmd)

    def drop_peer(key: tuple[str, int]) -> None:
        if any(r.cmd.engine_id == key[0] and k[1] == key[1] for k, r in t.reads.items()):
            bad.append(f"{key} dropped with reads in flight")
        drop(key)

    t.post_read = post_read  # type: ignore[method-assign]
    t.drop_peer = drop_peer  # type: ignore[method-assign]
    return bad


def _handshakes(conn: Connector) -> int:
    return sum(isinstance(r.event, HandshakeDone) for r in conn.core.log.records())


def test_connector_rehandshakes_after_an_idle_eviction_and_reads_the_right_bytes() -> None:
    """Scenario: decode and producer Connectors over the sim network, idle_engine_ns=5 us; a load
    completes, the decode side then idles 8 us (the peer is dropped from the transport), then two
    more loads, 20 us apart (each after an eviction). Expected: each load handshakes afresh and is
    received whole (the right bytes); the producer releases each; no read goes to a dropped peer
    and no peer is dropped under a read."""
    pair = SimPair(d_config={"idle_engine_ns": 5_000})
    bad = _watch_transport(pair.cons)
    for n, (local, remote) in enumerate((([3, 4], [1, 2]), ([5, 6], [7, 8]), ([9, 10], [11, 12]))):
        params = pair.p.request_finished(f"p{n}", remote)
        pair.d.load(f"c{n}", local, params)
        recv, sent, failed = pair.run(4)
        assert recv == [f"c{n}"] and sent == [f"p{n}"] and not failed, (recv, sent, failed)
        assert all(pair.cons.block(lb) == pattern(pair.prod.agent, rb, 64)
                   for lb, rb in zip(local, remote, strict=True))
        assert ("P", 0) in pair.cons.peers
        pair.run(20)
        assert ("P", 0) not in pair.cons.peers and pair.d.core.engines == {}
        assert _handshakes(pair.d) == n + 1
    assert not bad, bad


def test_connector_load_in_the_step_its_engine_is_due_reuses_the_connection() -> None:
    """Scenario: the engine's idle timer is due at exactly the time of the step that applies a new
    load (the load is queued before the step's Tick). Expected: the load reads over the existing
    connection (one handshake in all), completes, and the engine goes IDLE after that load."""
    pair = SimPair(d_config={"idle_engine_ns": 5_000})
    bad = _watch_transport(pair.cons)
    pair.d.load("c0", [3], pair.p.request_finished("p0", [1]))
    pair.run(4)
    (e,) = pair.d.core.engines.values()
    due = e.idle_at
    assert due is not None and pair.now < due
    pair.now = due
    pair.d.load("c1", [4], pair.p.request_finished("p1", [2]))
    pair.now -= 1_000  # run() moves the clock 1 us first: the step runs at the due time
    recv, sent, failed = pair.run(3)
    assert recv == ["c1"] and sent == ["p1"] and not failed
    assert _handshakes(pair.d) == 1 and ("P", 0) in pair.cons.peers
    pair.run(2)
    assert ("P", 0) in pair.cons.peers  # read at `due`: kept until due + 5 us, exactly
    pair.run(1)
    assert pair.now == due + 5_000 and ("P", 0) not in pair.cons.peers
    assert not bad, bad


def test_connector_pp2_after_both_stages_idle_out_rehandshakes_both_and_reads() -> None:
    """Scenario: a PP-2 producer (one Connector per stage) and a decode Connector, idle 5 us; a
    load, 20 us of idleness, another load. Expected: both stages dropped while idle, both
    handshaken again, the second load received whole."""
    from helpers import RankedEngines

    w = RankedEngines(1, 1, p_pp=2, d_config={"idle_engine_ns": 5_000})
    d = w.d[(0, 0)]
    bad = _watch_transport(w.dt[(0, 0)])

    def run(steps: int) -> set[str]:
        got: set[str] = set()
        for _ in range(steps):
            w.now += 1_000
            got |= d.get_finished()[1]
            assert not d.last.failed, d.last.failed
            for p in w.p.values():
                p.get_finished()
        return got

    for n in range(2):
        params = [p.request_finished(f"p{n}", [n + 1]) for p in w.p.values()]
        d.load(f"c{n}", [n + 10], params[-1])
        assert run(6) == {f"c{n}"}
        assert len(w.dt[(0, 0)].peers) == 2
        run(20)
        assert w.dt[(0, 0)].peers == {} and d.core.engines == {}
    assert _handshakes(d) == 4 and not bad, bad


@pytest.mark.parametrize("value", [-1, 1 << 64, 1.5e12], ids=["negative", "over-2**62", "float"])
def test_connector_refuses_an_idle_engine_ns_out_of_range(value: Any) -> None:
    """Scenario: a Connector built with idle_engine_ns negative, over the 2**62 bound every other
    duration has (the log's 64 bits), or not an int.
    Expected: InvalidInput naming idle_engine_ns (docs/embedding.md: "The CoreConfig is checked
    when the Connector is built (... sizes and times in range ...)"; tombstone_ns and
    handshake_retry_ns are checked so).
    Found in review: accepted (connector._check_config did not check it). Then: negative, each engine's
    timer is armed in the past and, while a read is in flight, re-armed at now-1 at every Tick:
    every step runs its 16 rounds, each applying and recording a Tick; 2**64: the Started record
    cannot be encoded and a FileSink log holds no record at all; a float: TypeError in the timer
    wheel at the first connection."""
    net = SimNetwork()
    t = SimTransport(net, "D-0")
    with pytest.raises(InvalidInput, match="idle_engine_ns"):
        Connector(CoreConfig(engine_id="D", compat_hash="h", idle_engine_ns=value), t, SimHandshaker(net))


def test_sim_transport_drop_peer_forgets_the_loss_report_and_a_new_connections_loss_is_reported() -> None:
    """Scenario: the sim transport holds P (attempt 1), its agent dies, a send reports it gone;
    the core drops it; P is added again (attempt 2, the agent back) and dies again. Expected: after
    drop_peer nothing of the key is kept; the second loss is reported too, naming attempt 2."""
    net = SimNetwork()
    d, p = SimTransport(net, "D-0"), SimTransport(net, "P-0")
    events: list[Any] = []
    d.bind(events.append, lambda: 0)
    r = reply("P", ranks=(p.rank_info(),))
    from pdfsm.wire import Notification

    for attempt in (1, 2):
        net.revive("P-0")
        d.add_peer(("P", 0), r, attempt)
        net.kill("P-0")
        with pytest.raises(Exception, match="unreachable"):
            d.send(("P", 0), 0, Notification("x", 0, 1))
        d.drop_peer(("P", 0))
        assert ("P", 0) not in d.peers and ("P", 0) not in d._disconnected and ("P", 0) not in d._attempts
    assert [e.attempt for e in events if isinstance(e, PeerDisconnected)] == [1, 2]


# --- docs --------------------------------------------------------------------------------------------


def test_embedding_doc_no_longer_says_connected_engines_stay_until_they_disconnect() -> None:
    """Claim checked: docs/decisions.md ("A CONNECTED engine nobody has read from for
    idle_engine_ns ... is evicted"). Expected: docs/embedding.md, the embedder's guide, says the
    same. Found in review: it still said "connected ones stay until they disconnect" (its list of
    guarantees, under "Engines that failed or disconnected ... are forgotten")."""
    text = (ROOT / "docs" / "embedding.md").read_text()
    assert "connected ones stay until they disconnect" not in text
