"""Core, Connector and inbox under interleavings found by review (each asserts the fix)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ev, make_core, read, reply

from pdfsm.commands import PostRead
from pdfsm.connector import Connector
from pdfsm.core import Core
from pdfsm.errors import InvalidInput
from pdfsm.events import (
    Collect,
    CoreConfig,
    EvictRequested,
    HandleDone,
    HandshakeDone,
    PeerAdded,
    PeerDisconnected,
)
from pdfsm.log import EventLog, Overflow
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport


def _hs(core: Core, pp: int, *, attempt: int | None = None, pp_size: int = 2, t: int = 0) -> None:
    """Answer the engine's current handshake attempt (a re-created engine numbers them higher)."""
    attempt = attempt if attempt is not None else core.engines[("P", pp)].attempt
    core.apply(ev(HandshakeDone, t, engine_id="P", pp_rank=pp, attempt=attempt,
                  reply=reply("P", pp_rank=pp, pp_size=pp_size)))
    core.apply(ev(PeerAdded, t, engine_id="P", pp_rank=pp, attempt=attempt))


def _pp2_connected(core: Core) -> None:
    """Both PP ranks of producer P connected, by one request run to the end."""
    core.apply(read("warm", remote_pp=2))
    _hs(core, 0)
    _hs(core, 1)
    for pp in (0, 1):
        core.apply(ev(HandleDone, request_id="warm", pp_rank=pp, tp_rank=0))
    core.apply(ev(Collect, step=0))
    core.take_commands()


def test_pp2_engine_connected_at_request_time_is_not_held_and_can_be_evicted_under_the_request() -> None:
    """PP 2 producer. pp0 connected, pp1 evicted (idle). A request arrives: it waits for pp1 only
    and does not hold pp0. pp0 is then evicted as idle (readers == 0). When pp1 connects the
    request posts reads to pp0: _post_reads indexes core.engines[(P, 0)] -> KeyError escapes
    apply() in production mode. Correct: the engine the request will read from is held (not
    evictable) from the moment the request counts on it, and nothing raises."""
    core = make_core(strict=False)
    _pp2_connected(core)
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=1))
    assert ("P", 1) not in core.engines
    core.apply(read("r1", remote_pp=2))
    assert core.consumers["r1"].state.name == "HANDSHAKING"
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))  # idle eviction: r1 will read from it
    # (the fix may keep it, or re-handshake it; either way nothing may raise)
    _hs(core, 1)  # KeyError here while the bug exists
    posted = [c for c in core.take_commands() if isinstance(c, PostRead)]
    assert len(posted) == 2


def test_pp2_engine_ready_then_disconnected_and_evicted_while_sibling_handshakes_does_not_crash() -> None:
    """PP 2 producer, nothing connected. r1 waits for both PP ranks; pp0 connects (r1 holds it,
    readers == 1), then NIXL reports pp0 disconnected (DISCONNECTED) and idle eviction evicts it:
    (DISCONNECTED, EvictRequested) goes to EVICTED whatever `readers` says, so the engine is
    forgotten under a request that holds it. When pp1 connects r1 posts reads to pp0:
    core.engines[(P, 0)] -> KeyError escapes apply() in production mode."""
    core = make_core(strict=False)
    core.apply(read("r1", remote_pp=2))
    _hs(core, 0)
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, detail="nic down"))
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))
    _hs(core, 1)  # KeyError here while the bug exists
    r1 = core.consumers.get("r1")
    # Correct: r1 fails (the peer went away; a remote fault) or re-handshakes pp0; it never
    # reads from an engine that is not connected.
    assert r1 is None or r1.state.name in ("HANDSHAKING", "FAILED")


def test_pp2_engine_disconnected_while_sibling_handshakes_is_not_read_from() -> None:
    """PP 2 producer, nothing connected. r1 waits for both PP ranks; pp0 connects, then NIXL
    reports pp0 disconnected. pp1 connects: r1 posts a read to pp0 although it is DISCONNECTED
    (the engine table says a disconnected engine is never reused, only handshaken again). The
    transport has dropped the peer, so post_read raises and the request fails with a SETUP
    error, blamed on the local side, although the remote peer went away. Correct: no read is
    posted to an engine that is not CONNECTED; r1 re-handshakes pp0 (or fails, remote fault)."""
    core = make_core(strict=False)
    core.apply(read("r1", remote_pp=2))
    _hs(core, 0)
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, detail="nic down"))
    core.take_commands()
    _hs(core, 1)
    posted = [c for c in core.take_commands() if isinstance(c, PostRead)]
    to_pp0 = [c for c in posted if c.source.pp_rank == 0]
    assert not to_pp0, "a read was posted to a DISCONNECTED engine"
    assert core.engines[("P", 0)].state.name == "HANDSHAKING"  # handshaken again, for r1
    assert core.consumers["r1"].state.name == "HANDSHAKING"
    _hs(core, 0, attempt=2)
    posted = [c for c in core.take_commands() if isinstance(c, PostRead)]
    assert {c.source.pp_rank for c in posted} == {0, 1}  # read from both once both are connected


# --- the Connector over a bounded inbox --------------------------------------------------------


def _producer(log: EventLog, now: list[int]) -> Connector:
    net = SimNetwork()
    t = SimTransport(net, "P-0")
    t.fill(range(16))
    return Connector(CoreConfig(engine_id="P", compat_hash="h", lease_ns=1_000), t, SimHandshaker(net),
                     log=log, clock=lambda: now[0], port=9)


def test_connector_accepted_hold_is_never_lost_when_the_inbox_counts_overflow() -> None:
    """Connector over an EventLog(overflow=Overflow.COUNT) whose inbox is full: request_finished
    validates and returns params (accepted), but its BlocksHeld is refused by the inbox and only
    counted (a Dropped record). The request never exists in the core: it is never in
    finished_sending, not even by lease expiry, so the scheduler pins its blocks for ever. The
    same holds for load() (a consumer request never reported) and abort(). Correct: an event the
    Connector accepted from the scheduler (owner thread) is never dropped, or the call raises."""
    now = [0]
    p = _producer(EventLog(inbox_limit=1, overflow=Overflow.COUNT), now)
    p.request_finished("p1", [1])
    p.request_finished("p2", [2])  # accepted: returns params, no exception
    sent: set[str] = set()
    for step in range(1, 6):
        now[0] = step * 1_000
        sent |= p.get_finished()[0]
    assert sent == {"p1", "p2"}, "an accepted hold must be released (by notification or lease) exactly once"


def test_connector_owner_thread_submit_does_not_deadlock_on_a_full_blocking_inbox() -> None:
    """Connector over an EventLog with the default Overflow.BLOCK policy and a full inbox (other
    threads, e.g. a notification flood, filled it since the last step). The owner thread's own
    submit (request_finished, load, abort, the Tick in step(), HandleFailed(SETUP), PeerAdded,
    and a polled transport's progress()) waits for the owner to drain the inbox: the owner
    waits on itself, for ever. Correct: the owner thread never blocks on its own inbox."""
    now = [0]
    log = EventLog(inbox_limit=1)
    p = _producer(log, now)
    p.request_finished("p1", [1])  # the inbox is now full; only this (owner) thread ever pumps it

    def wait(timeout: float | None = None) -> bool:  # instead of waiting for ever: say so
        raise AssertionError("the owner thread waits for room in its own inbox: self-deadlock")

    log._room.wait = wait  # type: ignore[method-assign]
    p.request_finished("p2", [2])  # must return (queue it, or raise) without waiting on itself


# --- the consumer's lease bound ------------------------------------------------------------------



class _Pair:
    """A producer and a consumer Connector over the simulated network, on one shared clock."""

    def __init__(self, *, p_lease_ns: int, d_config: dict[str, Any]) -> None:
        self.net, self.now = SimNetwork(), 0
        self.pt = SimTransport(self.net, "P-0")
        self.pt.fill(range(16))
        self.p = Connector(CoreConfig(engine_id="P", compat_hash="h", lease_ns=p_lease_ns), self.pt,
                           SimHandshaker(self.net), clock=lambda: self.now, wall_clock=lambda: self.now, port=9)
        pt = self.pt
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(pt.rank_info(),)))
        self.dt = SimTransport(self.net, "D-0")
        self.d = Connector(CoreConfig(engine_id="D", compat_hash="h", **d_config), self.dt,
                           SimHandshaker(self.net), clock=lambda: self.now, wall_clock=lambda: self.now)

    def run(self, steps: int = 6) -> tuple[set[str], set[str]]:
        recv: set[str] = set()
        sent: set[str] = set()
        for _ in range(steps):
            recv |= self.d.get_finished()[1]
            sent |= self.p.get_finished()[0]
        return recv, sent


def test_load_refuses_a_lease_start_in_the_future_such_as_a_wall_clock_time() -> None:
    """load(..., lease_start_ns=X) is 'when the params arrived, on the connector's clock'. A
    value after the connector's now cannot be that, and is what an embedder passing
    time.time_ns() (wall clock) instead of the monotonic clock gives (vLLM PR 50326's mix-up):
    times_of then computes start + lease - margin far in the future, so the lease bound is
    silently disabled and a read that completes after the producer reused its blocks is
    trusted. load() accepts it. Correct: InvalidInput naming lease_start_ns."""
    pair = _Pair(p_lease_ns=10_000, d_config={"lease_margin_ns": 100})
    pair.now = 5_000
    params = pair.p.request_finished("p1", [1, 2])
    with pytest.raises(InvalidInput, match="lease_start_ns"):
        pair.d.load("d1", [5, 6], params, lease_start_ns=1_700_000_000_000_000_000)


def test_lease_start_after_a_short_heartbeat_never_trusts_a_read_after_the_producer_released() -> None:
    """Connector.load's docstring once said lease_start_ns is 'the params' arrival, or the last
    heartbeat'. But a heartbeat extends the producer's lease to arrival + extend_ns, not to
    arrival + lease_ns (producer._extend), so with extend_ns < lease_ns the consumer's bound
    (lease_start + lease_ns - margin) lies past the producer's real expiry. Scenario: P lease
    10 us from t=0; D heartbeats at t=8 us with extend_ns=1 us (P's lease stays 10 us), loads
    with lease_start_ns=8 us as documented; the read completes at t=12 us, after P's lease
    expired (its blocks released for reuse at t=10 us). D reports the request received.
    Correct: the request fails (a read completing after the producer may have reused the blocks
    is never trusted)."""
    pair = _Pair(p_lease_ns=10_000, d_config={"lease_margin_ns": 100, "read_timeout_ns": 1_000_000})
    warm = pair.p.request_finished("p0", [3])
    pair.d.load("d0", [7], warm)
    recv, sent = pair.run()
    assert recv == {"d0"} and sent == {"p0"}  # D and P connected
    params = pair.p.request_finished("p1", [1, 2])  # lease until t = 10_000
    pair.now = 8_000
    assert pair.d.heartbeat(params, extend_ns=1_000) == 1
    pair.run(2)  # P applies the heartbeat: its lease stays at 10_000
    pair.net.script("d1", 0, 0, ReadScript(polls=10_000, end="done"))
    # Connector.load's contract: the later of the arrival (0) and t + extend_ns - lease_ns.
    pair.d.load("d1", [5, 6], params, lease_start_ns=max(0, 8_000 + 1_000 - 10_000))
    outcome = None
    for now in (8_000, 8_000, 11_000, 11_000, 12_000, 12_000):
        pair.now = now
        if now == 12_000:
            for rd in pair.dt.reads.values():
                rd.polls = 0  # the read completes now, after P's lease ran out at 10_000
        if "d1" in pair.d.get_finished()[1]:
            outcome = bool(pair.d.last.failed) and 5 in pair.d.get_block_ids_with_load_errors()
            break
        pair.p.get_finished()
    assert outcome is True, "a read that completed after the producer's lease expired was trusted"


def test_failed_engines_of_unreachable_producers_are_forgotten_eventually() -> None:
    """Every distinct producer engine id a request names gets an engine machine in
    core.engines. One whose handshake failed (the producer is dead or was replaced by one under a
    new engine id, as `pdfsm soak` restarts do) stays FAILED for ever: only EvictRequested
    forgets it, and nothing submits EvictRequested (the Connector has no eviction, and
    docs/embedding.md does not mention any). With producers restarting under new ids, or a router
    naming bad ids, core.engines grows without bound. Correct: an engine with no waiter and no
    reader is forgotten after a bounded time (like tombstones), or the Connector evicts it."""
    net, now = SimNetwork(), [0]
    d = Connector(CoreConfig(engine_id="D", compat_hash="h"), SimTransport(net, "D-0"), SimHandshaker(net),
                  clock=lambda: now[0])
    for i in range(50):
        d.load(f"d{i}", [1], {"lease_ns": 60_000_000_000, "remote_engine_id": f"P{i}", "remote_request_id": f"p{i}",
                             "remote_port": 1000 + i, "remote_block_ids": [1], "remote_tp_size": 1})
        for _ in range(3):
            d.get_finished()
    assert len(d.core.consumers) == 0  # every request failed and was reported
    now[0] = 10 * d.core._tombstone_ns  # long after anything could still concern those engines
    for _ in range(3):
        d.get_finished()
    assert len(d.core.engines) < 50, f"{len(d.core.engines)} dead engines kept for ever"


def test_an_aborted_request_whose_read_completed_late_reports_its_blocks_invalid() -> None:
    """A read that completed after the deadline is not trusted (the request fails); an abort that
    follows must not turn those blocks valid because every read 'completed'."""
    from helpers import handshake

    from pdfsm.commands import HandOff
    from pdfsm.events import AbortRequested, Collect, Deadline, HandleDone

    core = make_core(strict=False)
    core.apply(read("r1", deadline=Deadline("monotonic", 100)))
    handshake(core)
    core.apply(ev(HandleDone, 200, request_id="r1", pp_rank=0, tp_rank=0))  # late: not trusted
    core.apply(ev(AbortRequested, 210, request_id="r1"))
    core.take_commands()
    core.apply(ev(Collect, 220, step=1))
    (off,) = [c for c in core.take_commands() if isinstance(c, HandOff)]
    assert off.outcome == "aborted" and off.invalid_blocks == (1, 2)


# --- a disconnect report names its connection ----------------------------------------------------


def _reconnecting(core: Core) -> None:
    """P connected by attempt 1, lost, and handshaken again: attempt 2 is CONNECTING."""
    core.apply(read("r1"))
    _hs(core, 0, pp_size=1)
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, detail="link down", attempt=1))
    core.apply(read("r2"))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=2, reply=reply("P")))
    assert core.engines[("P", 0)].state.name == "CONNECTING"


def test_a_late_disconnect_of_the_replaced_connection_does_not_fail_the_new_one() -> None:
    """The transport reports the old connection (attempt 1) gone; the report is still in the inbox
    when attempt 2 reaches CONNECTING. It names attempt 1, so it is ignored with a reason; the
    new connection completes and r2 reads (it used to fail attempt 2, retried after the pause)."""
    core = make_core()
    _reconnecting(core)
    seq = core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, detail="link down", attempt=1))
    rec = core.log.records()[seq - core.log.evicted]
    assert rec.outcome.name == "IGNORED" and "another attempt" in rec.reason
    core.apply(ev(PeerAdded, engine_id="P", pp_rank=0, attempt=2))
    assert core.engines[("P", 0)].state.name == "CONNECTED"
    assert any(isinstance(c, PostRead) and c.request_id == "r2" for c in core.take_commands())
    # The same stale report once connected changes nothing either; the current one disconnects.
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, attempt=1))
    assert core.engines[("P", 0)].state.name == "CONNECTED"
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, attempt=2))
    assert core.engines[("P", 0)].state.name == "DISCONNECTED"


def test_a_disconnect_without_an_attempt_is_taken_as_the_current_connection() -> None:
    """attempt 0 (logs of schema 1, adapters that do not track it): the old behaviour, the
    connecting attempt fails, so replaying an old log recomputes what it recorded."""
    core = make_core()
    _reconnecting(core)
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, detail="link down"))
    assert core.engines[("P", 0)].state.name == "FAILED"
