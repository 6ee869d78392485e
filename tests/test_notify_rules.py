"""The notification rules around the trust bound and the lease.

The rules under review (pdfsm/consumer.py): a stopped request notifies the producer ranks it did
not read only while the lease the params gave is not over (``_notify_unread`` / ``_lease_ended``:
nothing at or after the trust bound, ``lease_start + lease_ns - lease_margin_ns``); a notify-only
request whose engine becomes ready after that point is dropped (``_drop_lease_over_when_ready``);
params are judged by the incarnation of the PP stage that minted them (``incarnation_pp``); and
``m.deadline`` / ``m.trust`` use None for "not armed".

Each test drives a Core with events (as tests/helpers.py does) or Connectors over the simulated
transport, across topologies (producer TP larger and smaller than the consumer's, MLA, a PP
producer read by a PP 1 consumer) and at the trust bound exactly, one ns before and one ns after.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import connected, ev, make_core, read, reply

from pdfsm.commands import HandOff, PostRead, SendNotification, StartHandshake
from pdfsm.connector import Connector
from pdfsm.core import Core
from pdfsm.events import (
    AbortRequested,
    CoreConfig,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    PeerAdded,
    PeerDisconnected,
    RankInfo,
    Tick,
)
from pdfsm.events import Collect as CollectEv
from pdfsm.fsm import Fault
from pdfsm.wire import Notification
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport

LEASE, MARGIN = 10_000, 100
TRUST = LEASE - MARGIN  # requests are loaded at t=0 with lease_start 0: the trust bound
BIG = 10**15
WHEN = {"before": TRUST - 1, "at": TRUST, "after": TRUST + 1}


# --- builders ----------------------------------------------------------------------------------------


def _core(*, d_tp: int = 1, mla: bool = False, timeout: int = BIG) -> Core:
    return make_core(strict=False, tp_size=d_tp, tp_rank=0, mla=mla, lease_margin_ns=MARGIN,
                     read_timeout_ns=timeout)


def _reply(core: Core, *, p_tp: int, pp_rank: int = 0, pp_size: int = 1, incarnation: str = "") -> Any:
    ranks = tuple(RankInfo(pp_rank=pp_rank, tp_rank=t, agent=f"P{incarnation}-{pp_rank}-{t}",
                           incarnation=incarnation) for t in range(p_tp))
    return reply("P", tp_size=p_tp, pp_size=pp_size, ranks=ranks, mla=core.config.mla,
                 block_size=core.config.block_size, num_blocks=64)


def _connect(core: Core, *, p_tp: int, pp_rank: int = 0, pp_size: int = 1, t: int = 0, attempt: int = 1,
             incarnation: str = "") -> None:
    core.apply(ev(HandshakeDone, t, engine_id="P", pp_rank=pp_rank, attempt=attempt,
                  reply=_reply(core, p_tp=p_tp, pp_rank=pp_rank, pp_size=pp_size, incarnation=incarnation)))
    core.apply(ev(PeerAdded, t, engine_id="P", pp_rank=pp_rank, attempt=attempt))


def _notes(cmds: list[Any]) -> list[tuple[int, int, str, int, int]]:
    return sorted((c.pp_rank, c.tp_rank, c.notification.request_id, c.notification.part, c.notification.of)
                  for c in cmds if isinstance(c, SendNotification))


def _offs(cmds: list[Any]) -> list[HandOff]:
    return [c for c in cmds if isinstance(c, HandOff)]


def _collect(core: Core, t: int) -> list[Any]:
    core.apply(ev(CollectEv, t, step=1))
    return core.take_commands()


# --- 1. a stopped read notifies a restarted producer for its predecessor's params ---------------------


@pytest.mark.parametrize("how", ["sibling-read-fails", "abort", "deadline"])
def test_read_stopping_after_its_engine_was_rehandshaken_to_a_restarted_producer_notifies_nobody(how: str) -> None:
    """Scenario: producer TP 2 read by decode TP 1; request d1's params were minted by incarnation
    X. d1 posts its two reads. Then (``how``) one read ends ERR, or d1 is aborted, or its read
    deadline passes: the other read is cancelled but, like a NIXL READ whose peer died, takes a
    while to stop. Meanwhile the producer process restarts under the same engine id: the transport
    reports the peer gone, a new request d2 (fresh params, incarnation Y) re-handshakes the engine
    and it is CONNECTED again, its reply now naming incarnation Y only. Then d1's last read stops.

    Expected (docs/decisions.md, "Params are checked against the handshake" and the incarnation
    rule; the review invariant "no notification is ever sent for params whose incarnation the
    minting stage's reply contradicts"): d1 sends no notification, since the connected engine's
    reply contradicts d1's params. A notice for "p-d1" reaches process Y, which never held it (a
    remote violation there) or, with request ids reused (vLLM PR 45688), releases Y's own hold of
    that id before its reader read it. pdfsm sends ``_notify_unread``'s notices without looking at
    the engine's current reply (only the stop-before-reading path checked ``disagreement`` then)."""
    core = _core(timeout=5_000 if how == "deadline" else BIG)
    core.apply(read("d1", remote_tp=2, incarnation="X", lease_ns=LEASE))
    _connect(core, p_tp=2, incarnation="X")
    assert sum(isinstance(c, PostRead) for c in core.take_commands()) == 2
    if how == "sibling-read-fails":
        core.apply(ev(HandleFailed, 1_000, request_id="d1", pp_rank=0, tp_rank=0, why=HandleFailure.ERR))
    elif how == "abort":
        core.apply(ev(AbortRequested, 1_000, request_id="d1"))
        core.apply(ev(HandleFailed, 1_000, request_id="d1", pp_rank=0, tp_rank=0, why=HandleFailure.CANCELLED))
    else:
        core.apply(ev(Tick, 5_000))
        core.apply(ev(HandleFailed, 5_000, request_id="d1", pp_rank=0, tp_rank=0, why=HandleFailure.CANCELLED))
    assert core.consumers["d1"].state.name in ("FAILING", "ABORTING")
    core.apply(ev(PeerDisconnected, 5_100, engine_id="P", pp_rank=0, attempt=1))
    core.apply(read("d2", t=5_200, blocks=(5, 6), remote_tp=2, incarnation="Y", lease_ns=LEASE))
    _connect(core, p_tp=2, t=5_300, attempt=2, incarnation="Y")
    assert core.engines[("P", 0)].state.name == "CONNECTED"
    core.take_commands()
    core.apply(ev(HandleFailed, 5_400, request_id="d1", pp_rank=0, tp_rank=1, why=HandleFailure.CANCELLED))
    cmds = core.take_commands() + _collect(core, 5_500)
    assert [o.request_id for o in _offs(cmds)] == ["d1"]
    assert _notes(cmds) == [], ("notices for incarnation X's params were sent to the engine now connected to "
                                "incarnation Y")


def test_mla_read_completing_after_a_rehandshake_to_a_restarted_producer_tells_no_skipped_rank() -> None:
    """Scenario: MLA, producer TP 2 read by decode TP 1: d1 reads P rank 0 and, once that read
    completes, tells P rank 1 (replicated latent: not read) that it may release. The read's
    completion is seen only after the producer restarted under the same engine id and a new
    request re-handshook it (the engine's reply now names incarnation Y, d1's params X).

    Expected: no notice for X's params to the ranks of incarnation Y (as in the test above).
    pdfsm's ``_read_done`` sends P rank 1 the notice via ``_notify_unread`` unchecked."""
    core = _core(mla=True)
    core.apply(read("d1", remote_tp=2, incarnation="X", lease_ns=LEASE))
    _connect(core, p_tp=2, incarnation="X")
    assert sum(isinstance(c, PostRead) for c in core.take_commands()) == 1
    core.apply(ev(PeerDisconnected, 100, engine_id="P", pp_rank=0, attempt=1))
    core.apply(read("d2", t=200, blocks=(5, 6), remote_tp=2, incarnation="Y", lease_ns=LEASE))
    _connect(core, p_tp=2, t=300, attempt=2, incarnation="Y")
    core.take_commands()
    core.apply(ev(HandleDone, 400, request_id="d1", pp_rank=0, tp_rank=0))
    cmds = core.take_commands()
    assert _notes(cmds) == [], "a notice for incarnation X's params went to incarnation Y's rank 1"


# --- 2. heartbeats past the lease the params gave ------------------------------------------------------


class _World:
    """A producer and a decode Connector over one simulated network, one clock for both hosts."""

    def __init__(self, *, p_lease_ns: int, margin: int) -> None:
        self.net, self.now = SimNetwork(), 1_000_000
        self.prod = SimTransport(self.net, "P-0")
        self.prod.fill(range(64))
        self.p = Connector(CoreConfig(engine_id="P", compat_hash="h", lease_ns=p_lease_ns), self.prod,
                           SimHandshaker(self.net), clock=lambda: self.now, wall_clock=lambda: self.now, port=9)
        prod = self.prod
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(prod.rank_info(),), num_blocks=64))
        self.cons = SimTransport(self.net, "D-0")
        self.d = Connector(CoreConfig(engine_id="D", compat_hash="h", lease_margin_ns=margin), self.cons,
                           SimHandshaker(self.net), clock=lambda: self.now, wall_clock=lambda: self.now)

    def run(self, steps: int = 3, dt: int = 1_000) -> tuple[set[str], set[str]]:
        sent: set[str] = set()
        expired: set[str] = set()
        for _ in range(steps):
            self.now += dt
            self.d.get_finished()
            sent |= self.p.get_finished()[0]
            expired |= self.p.last.expired
        return sent, expired

    def connect(self) -> None:
        self.d.load("warm", [63], self.p.request_finished("warm", [63]))
        sent, _ = self.run(3)
        assert sent == {"warm"}

    def producer_violations(self) -> list[str]:
        """Reasons of the producer's records that carry a fault (its own lease expiry is one)."""
        return [r.reason for r in self.p.core.log.records() if r.fault is not None]


def test_heartbeat_inside_the_lease_extends_the_hold_and_a_load_inside_the_trust_bound_reads() -> None:
    """Scenario: the same queue, but the heartbeat comes well inside the lease: it reaches the
    producer (told == 1) and extends its hold; the load that follows, still before the trust bound
    of the params' own lease, reads the bytes and releases the producer by its notification, once,
    with no violation on either side."""
    w = _World(p_lease_ns=50_000, margin=5_000)
    w.connect()
    params = w.p.request_finished("p1", [1, 2])
    w.now += 10_000
    assert w.d.heartbeat(params, 200_000) == 1
    w.run(1)
    w.d.load("d1", [5, 6], params)
    sent, expired = w.run(3)
    assert sent == {"p1"} and expired == set()
    assert w.producer_violations() == [] and not any(w.d.core.violations.values())
    assert w.cons.block(5) == w.prod.block(1) and w.cons.block(6) == w.prod.block(2)


# --- 3. the trust bound exactly: stops while reading, across topologies -------------------------------

TOPOLOGIES = {  # name: (decode TP, producer TP, MLA, producer PP; the decode side has PP 1)
    "P2-D1": (1, 2, False, 1),
    "P1-D2": (2, 1, False, 1),
    "P4-D1-mla": (1, 4, True, 1),
    "P4-D2-mla": (2, 4, True, 1),
    "P1-D2-mla": (2, 1, True, 1),
    "P2xPP2-D1": (1, 2, False, 2),
    "P2xPP2-D1-mla": (1, 2, True, 2),
}


def _reading_plan_sources(topo: str) -> tuple[Any, ...]:
    d_tp, p_tp, mla, p_pp = TOPOLOGIES[topo]
    return tuple(_core(d_tp=d_tp, mla=mla).plan(p_tp, p_pp).sources)


def _reading(topo: str, timeout: int = BIG) -> tuple[Core, Any]:
    d_tp, p_tp, mla, p_pp = TOPOLOGIES[topo]
    core = _core(d_tp=d_tp, mla=mla, timeout=timeout)
    core.apply(read("r", remote_tp=p_tp, remote_pp=p_pp, lease_ns=LEASE, incarnation="X", incarnation_pp=p_pp - 1))
    for pp in range(p_pp):
        _connect(core, p_tp=p_tp, pp_rank=pp, pp_size=p_pp, incarnation="X")
    core.take_commands()
    assert core.consumers["r"].state.name == "READING"
    return core, core.plan(p_tp, p_pp)


_HOWS = ("read-fails", "sibling-fails", "abort", "deadline", "quarantine")
_STOPS = [(topo, how) for topo in TOPOLOGIES for how in _HOWS
          if how != "sibling-fails" or len(_reading_plan_sources(topo)) > 1]


@pytest.mark.parametrize("when", list(WHEN))
@pytest.mark.parametrize(("topo", "how"), _STOPS)
def test_stop_while_reading_notifies_exactly_the_unread_ranks_only_before_the_trust_bound(
        topo: str, how: str, when: str) -> None:
    """Scenario: a request reads (producer TP above, below or equal to the consumer's, MLA or not)
    and stops at TRUST-1, exactly at TRUST or at TRUST+1: its read fails, a sibling fails after
    another read completed, it is aborted, its read deadline passes, or it is quarantined (a local
    fault: a completion for a rank it does not read). Every read has stopped at that time.

    Expected: handed back once, failed (aborted for an abort), its blocks invalid; each producer
    rank that was not read (and MLA's skipped ranks) is told with this consumer rank's part and
    count iff the stop is before the trust bound; nothing at or after it; ranks whose reads
    completed are not told again."""
    t = WHEN[when]
    core, plan = _reading(topo, timeout=t if how == "deadline" and t < TRUST else BIG)
    srcs = [(s.pp_rank, s.tp_rank) for s in plan.sources]
    done: set[tuple[int, int]] = set()
    if how == "sibling-fails":
        core.apply(ev(HandleDone, 10, request_id="r", pp_rank=srcs[0][0], tp_rank=srcs[0][1]))
        done.add(srcs[0])
        core.apply(ev(HandleFailed, t, request_id="r", pp_rank=srcs[1][0], tp_rank=srcs[1][1],
                      why=HandleFailure.ERR))
    elif how == "read-fails":
        core.apply(ev(HandleFailed, t, request_id="r", pp_rank=srcs[0][0], tp_rank=srcs[0][1],
                      why=HandleFailure.ERR))
    elif how == "abort":
        core.apply(ev(AbortRequested, t, request_id="r"))
    elif how == "deadline":
        core.apply(ev(Tick, t))
    else:
        core.apply(ev(HandleDone, t, request_id="r", pp_rank=0, tp_rank=999))
    for pp, tp in srcs:  # whatever is still in flight stops now, cancelled
        if core.consumers["r"].pending & (1 << plan.position[(pp, tp)]):
            core.apply(ev(HandleFailed, t, request_id="r", pp_rank=pp, tp_rank=tp, why=HandleFailure.CANCELLED))
    cmds = core.take_commands() + _collect(core, t + 1)
    offs = _offs(cmds)
    assert len(offs) == 1 and offs[0].outcome == ("aborted" if how == "abort" else "failed")
    assert offs[0].invalid_blocks == (1, 2)
    told = [k for k in srcs if k not in done] + list(plan.notify_only)
    want = sorted((pp, tp, "p-r", plan.part, plan.of) for pp, tp in told) if t < TRUST else []
    assert _notes(cmds) == want
    assert "r" not in core.consumers or core.consumers["r"].state.name == "RELEASED"


@pytest.mark.parametrize("when", list(WHEN))
@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_last_read_completing_around_the_trust_bound(topo: str, when: str) -> None:
    """Scenario: every read completes, the last one at TRUST-1, TRUST or TRUST+1.

    Expected: before the bound the request is received (no invalid blocks) and only MLA's skipped
    ranks are told (the reads carried the other notices); at or after it the request fails with
    its blocks invalid and nobody is told."""
    t = WHEN[when]
    core, plan = _reading(topo)
    srcs = [(s.pp_rank, s.tp_rank) for s in plan.sources]
    for pp, tp in srcs[:-1]:
        core.apply(ev(HandleDone, 10, request_id="r", pp_rank=pp, tp_rank=tp))
    core.apply(ev(HandleDone, t, request_id="r", pp_rank=srcs[-1][0], tp_rank=srcs[-1][1]))
    cmds = core.take_commands() + _collect(core, t + 1)
    (off,) = _offs(cmds)
    if t < TRUST:
        assert (off.outcome, off.invalid_blocks) == ("received", ())
        assert _notes(cmds) == sorted((pp, tp, "p-r", plan.part, plan.of) for pp, tp in plan.notify_only)
    else:
        assert (off.outcome, off.invalid_blocks) == ("failed", (1, 2))
        assert _notes(cmds) == []


# --- 4. the trust bound exactly: stops while a PP producer's stage 1 still handshakes ------------------


@pytest.mark.parametrize("when", list(WHEN))
@pytest.mark.parametrize("how", ["handshake-fails", "abort", "deadline", "quarantine"])
@pytest.mark.parametrize("notify_only", [False, True])
def test_pp_stop_while_stage_1_handshakes_tells_stage_0_only_before_the_trust_bound(
        how: str, when: str, notify_only: bool) -> None:
    """Scenario: producer PP 2 x TP 2 read by a PP 1 decode; stage 0 is connected (and held),
    stage 1 still handshakes; the request (reading, or notify-only) stops at TRUST-1, TRUST or
    TRUST+1: stage 1's handshake fails, an abort, its deadline, or a quarantine.

    Expected: stage 0's two ranks are told iff the stop is before the trust bound; stage 1 is never
    told (no connection); a reading request is handed back once, blocks invalid; a notify-only one
    is never handed back."""
    t = WHEN[when]
    core = _core(d_tp=1, timeout=t if how == "deadline" and t < TRUST else BIG)
    core.apply(read("r", remote_pp=2, remote_tp=2, lease_ns=LEASE, blocks=() if notify_only else (1, 2)))
    _connect(core, p_tp=2, pp_rank=0, pp_size=2)
    core.take_commands()
    assert core.consumers["r"].state.name == "HANDSHAKING"
    if how == "handshake-fails":
        core.apply(ev(HandshakeFailed, t, engine_id="P", pp_rank=1, attempt=1, error="connection refused"))
    elif how == "abort":
        core.apply(ev(AbortRequested, t, request_id="r"))
    elif how == "deadline":
        core.apply(ev(Tick, t))
    else:
        core.apply(ev(HandleDone, t, request_id="r", pp_rank=0, tp_rank=0))  # no read posted: a local fault
    cmds = core.take_commands() + _collect(core, t + 1)
    offs = _offs(cmds)
    if notify_only:
        assert offs == []
    else:
        assert len(offs) == 1 and offs[0].invalid_blocks == (1, 2)
    want = [(0, 0, "p-r", 0, 1), (0, 1, "p-r", 0, 1)] if t < TRUST else []
    assert _notes(cmds) == want
    assert core.engines[("P", 0)].readers == 0


# --- 5. a notify-only request whose (last) engine becomes ready around the trust bound -----------------


@pytest.mark.parametrize("when", list(WHEN))
@pytest.mark.parametrize("pp", [1, 2])
def test_notify_only_engine_ready_around_the_trust_bound(pp: int, when: str) -> None:
    """Scenario: a notify-only request (full local prefix hit) against producer TP 2 (PP 1, or PP 2
    whose stage 0 connected at once); the last engine's handshake result is applied at TRUST-1,
    TRUST or TRUST+1, before the deadline's tick.

    Expected: every rank of every stage told (part 0 of 1) iff before the bound; at or after it
    nothing is sent and the request is dropped; never handed back; no engine left held."""
    t = WHEN[when]
    core = _core()
    core.apply(read("r", remote_pp=pp, remote_tp=2, lease_ns=LEASE, blocks=()))
    if pp == 2:
        _connect(core, p_tp=2, pp_rank=0, pp_size=2)
    core.take_commands()
    _connect(core, p_tp=2, pp_rank=pp - 1, pp_size=pp, t=t)
    cmds = core.take_commands() + _collect(core, t + 1)
    assert _offs(cmds) == []
    want = sorted((s, tp, "p-r", 0, 1) for s in range(pp) for tp in range(2)) if t < TRUST else []
    assert _notes(cmds) == want
    assert all(e.readers == 0 for e in core.engines.values())


def test_notify_only_whose_lost_stage_is_found_after_the_lease_starts_no_handshake() -> None:
    """Scenario: notify-only against a PP 2 producer; stage 0 connects, then its connection is lost;
    stage 1 connects only after the trust bound (before the deadline's tick is applied).

    Expected: the request is over (the producer released by itself; nothing may be sent), so it is
    dropped without asking for a new handshake with stage 0 that nobody needs. pdfsm's
    ``_held_engine_lost`` option comes before ``_lease_over_notify_only_when_ready`` and re-watches
    stage 0, starting a handshake (and keeping the request waiting) for a request whose lease is
    already over."""
    core = _core()
    core.apply(read("r", remote_pp=2, remote_tp=2, lease_ns=LEASE, blocks=()))
    _connect(core, p_tp=2, pp_rank=0, pp_size=2)
    core.apply(ev(PeerDisconnected, 100, engine_id="P", pp_rank=0, attempt=1))
    core.take_commands()
    _connect(core, p_tp=2, pp_rank=1, pp_size=2, t=TRUST + 1)
    cmds = core.take_commands()
    assert _notes(cmds) == []
    started = [c for c in cmds if isinstance(c, StartHandshake)]
    assert started == [], "a handshake started for a request whose lease is over"
    assert "r" not in core.consumers or core.consumers["r"].state.name == "RELEASED"


# --- 6. end to end: decode TP above producer TP, one rank stops just before, one just after -----------


def test_decode_tp2_one_rank_fails_before_trust_other_after_producer_released_once_no_violation() -> None:
    """Scenario (Connectors over the sim transport, producer TP 1 read by decode TP 2: the producer
    rank expects two parts): decode rank 0 reads and completes at once; decode rank 1's read ends
    ERR after the trust bound. Rank 1 must not notify (the lease is over); the producer is
    released exactly once, by its lease, and records only its own expiry as a violation (no
    "notification after the lease expired"); rank 0 reports received, rank 1 failed with its
    blocks invalid."""
    net, now = SimNetwork(), [1_000_000]
    prod = SimTransport(net, "P-0")
    prod.fill(range(64))
    p = Connector(CoreConfig(engine_id="P", compat_hash="h", lease_ns=50_000), prod, SimHandshaker(net),
                  clock=lambda: now[0], wall_clock=lambda: now[0], port=9)
    net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(prod.rank_info(),), num_blocks=64))
    dts = [SimTransport(net, f"D-{r}", tp_rank=r, block_bytes=32) for r in range(2)]
    ds = [Connector(CoreConfig(engine_id="D", compat_hash="h", tp_size=2, tp_rank=r, lease_margin_ns=5_000),
                    dts[r], SimHandshaker(net), clock=lambda: now[0], wall_clock=lambda: now[0]) for r in range(2)]
    params = p.request_finished("p1", [1, 2])
    net.script("d1", 0, 0, ReadScript(end="hang"))  # the first rank to post (rank 1) hangs until cancelled
    ds[0].load("d1", [5, 6], params)
    ds[1].load("d1", [5, 6], params)
    recv: list[list[str]] = [[], []]
    invalid: list[set[int]] = [set(), set()]
    sent: list[str] = []
    for _ in range(60):
        now[0] += 1_000
        for r in (1, 0):
            got = ds[r].get_finished()[1]
            recv[r] += sorted(got)
            invalid[r] |= ds[r].get_block_ids_with_load_errors()
        sent += sorted(p.get_finished()[0])
    assert sent == ["p1"]
    assert recv == [["d1"], ["d1"]]
    assert invalid == [set(), {5, 6}]
    late = [r.reason for r in p.core.log.records() if r.reason and "after the lease" in r.reason]
    assert late == []
    assert any(isinstance(m, Notification) for _, m in dts[0].sent)
    assert not any(isinstance(m, Notification) for _, m in dts[1].sent)


@pytest.mark.parametrize("layout", [{"remote_tp": 3}, {"remote_blocks": (1,)}])
def test_a_notify_only_request_whose_layout_cannot_be_planned_is_dropped_not_handed_back(
        layout: dict[str, Any]) -> None:
    """Found by review: it went NEW -> FAILED and the next collect handed the scheduler a failed
    request it never waited for (notify-only requests are never reported, vLLM PR 57570), unlike
    every other refusal of a notify-only request. It is dropped as a local fault, nothing sent."""
    core = make_core(strict=False, tp_size=2)
    core.apply(read("n1", blocks=(), **{"remote_blocks": (), **layout}))
    assert "n1" not in core.consumers and not core.ready_ids
    core.apply(ev(CollectEv, 10, step=1))
    assert not [c for c in core.take_commands() if isinstance(c, (HandOff, SendNotification, StartHandshake))]
    (rec,) = [r for r in core.log.records() if r.machine == "consumer"]
    assert rec.state == "RELEASED" and rec.fault is Fault.LOCAL and "layouts" in rec.reason


def test_a_notify_only_request_stamped_before_a_tick_past_its_lease_sends_nothing_on_a_connected_engine() -> None:
    """Scenario: the engine is connected; a Tick at 5000 has been applied; then a notify-only
    request stamped 0 (lease 1000 from 0, margin 100: trust bound 900) is applied. Expected:
    nothing is sent: a notice is judged at the latest time the core has applied (decisions.md,
    "Events are judged in the order they are applied"), and the producer released the hold at
    1000, so a notice now would record a false "read may have seen reused blocks" there (vLLM PR
    41269). Before: judged at its own stamp, it went to the producer; the path through a
    handshake already sent nothing."""
    core = connected(make_core(strict=False, lease_margin_ns=100))
    core.apply(ev(Tick, 5000))
    core.take_commands()
    core.apply(read("r", t=0, blocks=(), lease_ns=1000, lease_start_ns=0))
    assert not [c for c in core.take_commands() if isinstance(c, SendNotification)]
    assert "r" not in core.consumers  # dropped, never reported


@pytest.mark.parametrize("stage1", ["after-the-deadline", "contradicting"])
def test_a_read_whose_lost_stage_is_found_past_its_deadline_or_contradicted_fails_without_a_handshake(
        stage1: str) -> None:
    """Scenario: a read from a PP-2 producer; stage 0 connects, then is lost; stage 1 becomes ready
    after the read's deadline (before its Tick), or with a reply that contradicts the params (TP
    2 against TP 1). Expected: the read fails at once and no handshake starts for stage 0 (the
    read twin of the notify-only rule above). Before: stage 0 was handshaken again first, the
    request kept waiting until the Tick, or until stage 0 reconnected to report the
    contradiction."""
    lease, margin = 10_000, 100
    core = make_core(strict=False, lease_margin_ns=margin, read_timeout_ns=10**15)
    core.apply(read("r", remote_pp=2, remote_tp=1, lease_ns=lease))

    def connect(pp: int, t: int, tp_size: int = 1) -> None:
        core.apply(ev(HandshakeDone, t, engine_id="P", pp_rank=pp, attempt=1,
                      reply=reply("P", tp_size=tp_size, pp_rank=pp, pp_size=2, num_blocks=64)))
        core.apply(ev(PeerAdded, t, engine_id="P", pp_rank=pp, attempt=1))

    connect(0, 0)
    core.apply(ev(PeerDisconnected, 100, engine_id="P", pp_rank=0, attempt=1))
    core.take_commands()
    if stage1 == "after-the-deadline":
        connect(1, lease - margin + 1)
    else:
        connect(1, 200, tp_size=2)
    assert not [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert core.consumers["r"].state.name == "FAILED"


def test_a_producer_that_moved_within_the_retry_pause_has_every_pp_stage_handshaken_at_once() -> None:
    """Scenario: both stages of a PP-2 producer fail their handshake at port 9; within the retry
    pause a request names port 10 (the producer moved). Expected: both stages are handshaken at
    port 10 at once (the pause holds only for the address that failed, engine._retry_later).
    Before: the watch loop stopped at stage 0 as if it would fail fast, so stage 1 was handshaken
    only after stage 0 answered: handshake latency doubled."""
    core = make_core(strict=False, handshake_retry_ns=10**9)
    core.apply(read("a", remote_pp=2, port=9))
    for pp in (0, 1):
        core.apply(ev(HandshakeFailed, 10, engine_id="P", pp_rank=pp, attempt=1, error="refused"))
    core.apply(ev(CollectEv, 20, step=1))
    core.take_commands()
    core.apply(read("b", remote_pp=2, port=10, t=100))
    started = sorted((c.pp_rank, c.port) for c in core.take_commands() if isinstance(c, StartHandshake))
    assert started == [(0, 10), (1, 10)]


def test_a_read_stamped_before_a_tick_past_its_lease_posts_nothing_on_a_connected_engine() -> None:
    """Scenario: as the notify-only case above, but a read with blocks (lease 1000 from 0, margin
    100, deadline 900) applied after a Tick at 5000. Expected: refused before any read (the lease
    may be over), so no READ of released blocks and no late notification reaches the producer.
    Before (found by review): judged at its stamp, a PostRead went out; the request then failed
    as untrusted, and the READ's notice reached a producer that had released."""
    core = connected(make_core(strict=False, lease_margin_ns=100))
    core.apply(ev(Tick, 5000))
    core.take_commands()
    core.apply(read("r", t=0, lease_ns=1000, lease_start_ns=0))
    assert not [c for c in core.take_commands() if isinstance(c, (PostRead, SendNotification))]
    assert core.consumers["r"].state.name == "FAILED"


@pytest.mark.parametrize("connects", ["inside-the-lease", "after-the-lease"])
def test_a_request_aborted_while_its_handshake_runs_notifies_the_producer_once_it_connects(connects: str) -> None:
    """Scenario: a read is aborted while the engine still handshakes (client disconnects while the
    prefill instance is being reached, vLLM PR 41269); the handshake then completes. Expected: the
    request is handed back aborted at once, and the producer is told as soon as the engine
    connects, so its blocks do not wait out the lease; not once the lease is over (a late notice
    reads there as a read of reused blocks). Before (found by review): nobody told it, and its
    blocks stayed pinned the whole lease (120 s by default)."""
    core = make_core(strict=False, lease_margin_ns=100)
    core.apply(read("r", lease_ns=1000, lease_start_ns=0))
    core.apply(ev(AbortRequested, 10, request_id="r"))
    core.apply(ev(CollectEv, 10, step=1))
    assert [(h.request_id, h.outcome) for h in core.take_commands() if isinstance(h, HandOff)] == [("r", "aborted")]
    t = 20 if connects == "inside-the-lease" else 950
    core.apply(ev(HandshakeDone, t, engine_id="P", pp_rank=0, attempt=1, reply=reply()))
    core.apply(ev(PeerAdded, t, engine_id="P", pp_rank=0, attempt=1))
    notes = [c.notification.request_id for c in core.take_commands() if isinstance(c, SendNotification)]
    assert notes == (["p-r"] if connects == "inside-the-lease" else [])
    assert not core.engines[("P", 0)].notices


def _pp_reply(pp: int, incarnation: str) -> Any:
    ranks = (RankInfo(pp_rank=pp, tp_rank=0, agent=f"P{incarnation}-{pp}-0", incarnation=incarnation),)
    return reply("P", pp_rank=pp, pp_size=2, ranks=ranks)


def _owed_to_incarnation_b(incarnation_pp: int | None) -> list[SendNotification]:
    """PP-2 params of incarnation A, aborted while both stages handshake; both connect to B."""
    core = make_core(strict=False)
    core.apply(read("r", remote_pp=2, incarnation="A", incarnation_pp=incarnation_pp, lease_ns=10**12))
    core.apply(ev(AbortRequested, 10, request_id="r"))
    sent = []
    for pp in (0, 1):
        core.apply(ev(HandshakeDone, 20, engine_id="P", pp_rank=pp, attempt=1, reply=_pp_reply(pp, "B")))
        core.apply(ev(PeerAdded, 20, engine_id="P", pp_rank=pp, attempt=1))
        sent += [c for c in core.take_commands() if isinstance(c, SendNotification)]
    return sent


def test_no_notice_is_owed_that_a_stage_connecting_alone_could_not_check() -> None:
    """Scenario: two requests stop (abort) while their engine still handshakes: PP-2 params minted
    by incarnation A that do not say their stage (an older producer), whose stages then connect to
    incarnation B; and params with no lease, whose engine connects ten minutes later. Expected:
    nothing is sent: stage-less PP params are judged against every stage at once, which one stage
    connecting cannot do, and a notice with no lease to bound it could land on any later hold.
    Before (found by review): both notices to B went out, and the lease-less one ten minutes on."""
    assert _owed_to_incarnation_b(incarnation_pp=None) == []
    core = make_core(strict=False)
    core.apply(read("r"))  # lease_ns 0: not said
    core.apply(ev(AbortRequested, 10, request_id="r"))
    core.apply(ev(HandshakeDone, 59 * 10**9, engine_id="P", pp_rank=0, attempt=1, reply=reply()))
    core.apply(ev(Tick, 600 * 10**9))
    core.apply(ev(PeerAdded, 600 * 10**9, engine_id="P", pp_rank=0, attempt=1))
    assert not [c for c in core.take_commands() if isinstance(c, SendNotification)]


def test_an_owed_notice_is_not_sent_once_the_minting_stage_shows_the_params_stale() -> None:
    """Scenario: PP-2 params minted by stage 0 of incarnation A; the request is aborted while both
    stages handshake; the producer restarted as incarnation B; stage 0 connects, then stage 1.
    Expected: nothing is sent: stage 0's reply shows the params are of a process since replaced,
    as a notice sent now would be judged over every connected stage. Before (found by review):
    stage 1's owed notice went to B, which never held the request."""
    assert _owed_to_incarnation_b(incarnation_pp=0) == []
