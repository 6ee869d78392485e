"""Found by review: the timer wheel against a reference model, and everything the core keeps that must
stay bounded in a long-running server (tombstones, staging, idle engines, the timers themselves).

Part 1 compares :class:`~pdfsm.timers.Timers` with a dict of key -> deadline over random arms,
re-arms (disarmed first, as the core does), disarms with the right and a wrong deadline, ``due``
with ``now`` non-decreasing (often equal) and ``earliest``: huge, negative and equal deadlines,
crowded slots, several slot widths.

Part 2 drives one Core, as an adapter would, through long random lifecycles: consumer requests
(handshakes that succeed, fail or are refused, disconnects, producers restarting under new
engine ids, reads that complete, fail or are cancelled, aborts, deadlines) and producer requests
(held, early notifications and heartbeats, duplicates, late news, leases expiring). After every
step each bounded structure is within its bound and every live machine still has what keeps it
alive (its timer, its staging entry); at the end, with everything answered and time far past
every bound, the structures are empty but for what is documented to stay.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from helpers import reply
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdfsm import consumer, engine, producer
from pdfsm.commands import AddPeer, CancelRead, DropPeer, FinishedSending, HandOff, PostRead, StartHandshake
from pdfsm.core import Core
from pdfsm.events import (
    PRODUCER,
    AbortRequested,
    BlocksHeld,
    Collect,
    CoreConfig,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    Heartbeat,
    NotificationReceived,
    PeerAdded,
    PeerDisconnected,
    ReadRequested,
    Tick,
)
from pdfsm.log import EventLog
from pdfsm.records import Tombstone
from pdfsm.timers import Timers

SETTINGS = settings(derandomize=True, deadline=None, max_examples=150, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def armed(w: Timers) -> dict[str, list[int]]:
    """What the wheel holds, key -> deadlines (a key armed twice shows twice)."""
    out: dict[str, list[int]] = {}
    for keys in w._slots.values():
        for k, d in keys.items():
            out.setdefault(k, []).append(d)
    return out


# --- part 1: the wheel against a model -----------------------------------------------------------

KEYS = [f"k{i}" for i in range(12)]
SPECIAL = [-(2**70), -(2**40), -(1 << 24) - 1, -(1 << 24), -17, -16, -15, -1, 0, 1, 15, 16, 17,
           (1 << 24) - 1, 1 << 24, 2**40, 2**63, 2**70]
deadlines = st.one_of(st.integers(-300, 300), st.sampled_from(SPECIAL))
wheel_ops = st.lists(st.one_of(
    st.tuples(st.just("arm"), st.sampled_from(KEYS), deadlines),
    st.tuples(st.just("arm_rel"), st.sampled_from(KEYS), st.integers(-40, 60)),  # near now
    st.tuples(st.just("arm_same"), st.sampled_from(KEYS), st.just(0)),  # again, at the same deadline
    st.tuples(st.just("disarm"), st.sampled_from(KEYS), st.just(0)),  # at its deadline
    st.tuples(st.just("disarm_wrong"), st.sampled_from(KEYS), deadlines),
    st.tuples(st.just("due"), st.just(""), st.one_of(st.just(0), st.integers(0, 40), st.sampled_from(SPECIAL))),
    st.tuples(st.just("earliest"), st.just(""), st.just(0)),
), max_size=80)


def _run_wheel(shift: int, start: int, sequence: list[tuple[str, str, int]]) -> None:
    wheel, model = Timers(shift=shift), dict[str, int]()
    now = start
    for op, key, arg in sequence:
        x = now + arg if op == "arm_rel" else arg
        if op in ("arm", "arm_rel"):
            if key in model:  # the documented protocol: disarm the old deadline, arm the new
                wheel.disarm(key, model.pop(key))
            wheel.arm(key, x)
            model[key] = x
        elif op == "arm_same":
            if key in model:
                wheel.arm(key, model[key])
        elif op == "disarm":
            if key in model:
                wheel.disarm(key, model.pop(key))
        elif op == "disarm_wrong":
            wheel.disarm(key, x)
            if model.get(key) == x:
                del model[key]
        elif op == "due":
            now = max(now, now + x if abs(x) < 1000 else x)  # never backwards; often unchanged
            ripe = sorted((d, k) for k, d in model.items() if d <= now)
            got = wheel.due(now)
            assert got == ripe, (now, got, ripe)
            for _, k in ripe:
                del model[k]
        else:
            assert wheel.earliest() == min(model.values(), default=None)
        assert len(wheel) == len(model)
        for k in KEYS:
            assert (k in wheel) == (k in model)
    assert wheel.due(2**80) == sorted((d, k) for k, d in model.items())
    assert wheel.earliest() is None and len(wheel) == 0


@SETTINGS
@given(st.sampled_from([0, 2, 4, 24]), st.just(0), wheel_ops)
def test_wheel_matches_model_nonnegative_start(shift: int, start: int, sequence: list[tuple[str, str, int]]) -> None:
    """Deadlines anywhere (negative and huge included), ``now`` starting at 0."""
    _run_wheel(shift, start, sequence)


@SETTINGS
@given(st.sampled_from([0, 2, 4, 24]), st.sampled_from([-(2**40), -100, -40, -1]), wheel_ops)
@example(4, -40, [("arm_rel", "k0", 8), ("arm_rel", "k1", 35), ("due", "", 8), ("arm_rel", "k2", 29),
                  ("earliest", "", 0)])  # found by a longer random search; see the explicit test below
def test_wheel_matches_model_negative_clock(shift: int, start: int, sequence: list[tuple[str, str, int]]) -> None:
    """The same, on a clock whose readings are negative (``time.monotonic_ns`` has no defined origin)."""
    _run_wheel(shift, start, sequence)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 2**30)), max_size=60),
       st.lists(st.integers(0, 2**24), max_size=20))
def test_wheel_nonnegative_times_agree(arms: list[tuple[str, int]], steps: list[int]) -> None:
    """The core's own use: non-negative times only, re-arms disarmed first, interleaved with due."""
    wheel, model, now = Timers(), dict[str, int](), 0
    for i, (k, d) in enumerate(arms):
        if k in model:
            wheel.disarm(k, model.pop(k))
        wheel.arm(k, now + d)
        model[k] = now + d
        if i < len(steps):
            now += steps[i]
            ripe = sorted((dd, kk) for kk, dd in model.items() if dd <= now)
            assert wheel.due(now) == ripe
            for _, kk in ripe:
                del model[kk]
            assert wheel.earliest() == min(model.values(), default=None)


def test_many_keys_in_one_slot_equal_deadlines_come_out_in_key_order() -> None:
    wheel = Timers()
    for i in range(2000):
        wheel.arm(f"r{i:04d}", 5 if i % 2 else 7)
    for i in range(0, 2000, 4):  # disarm a quarter, some with the wrong deadline (kept)
        wheel.disarm(f"r{i:04d}", 7)
        wheel.disarm(f"r{i + 1:04d}", 7)
    assert wheel.earliest() == 5
    assert wheel.due(4) == []
    five = wheel.due(5)
    assert five == sorted((5, f"r{i:04d}") for i in range(1, 2000, 2))
    assert wheel.due(6) == []
    assert wheel.due(7) == sorted((7, f"r{i:04d}") for i in range(2, 2000, 4))
    assert wheel.earliest() is None and len(wheel) == 0


def test_rearmed_key_never_fires_for_its_old_deadline() -> None:
    wheel = Timers(shift=4)
    wheel.arm("a", 10)
    wheel.earliest()  # slot 0 sorted into the run
    wheel.disarm("a", 10)
    wheel.arm("a", 12)  # the same slot: the run holds a stale (10, a)
    wheel.disarm("a", 12)
    wheel.arm("a", 100)  # another slot
    assert wheel.earliest() == 100
    assert wheel.due(50) == []
    assert wheel.due(100) == [(100, "a")]


def test_negative_deadline_armed_after_the_run_slot_was_dropped_is_not_late() -> None:
    """FINDING. ``_run_slot = -1`` means "no slot sorted", but -1 is also the slot of every
    deadline in [-2**shift, -1]. Once the sorted slot is dropped (``_drop_front``), an arm into
    slot -1 is insorted into the empty run as if slot -1 were sorted, and ``_sorted_run`` then
    trusts that run: entries armed into slot -1 before are invisible to ``earliest`` and ``due``
    until ``now`` passes the whole slot."""
    wheel = Timers(shift=4)
    wheel.arm("y", -32)  # slot -2
    wheel.arm("a", -5)  # slot -1, not in any run
    assert wheel.due(-32) == [(-32, "y")]  # slot -2 sorted, consumed, dropped: _run_slot back to -1
    wheel.arm("b", -3)  # slot -1 == _run_slot: insorted into the empty run
    assert wheel.earliest() == -5  # got -3
    assert wheel.due(-4) == [(-5, "a")]  # got []


# --- part 2: a core driven through long random lifecycles --------------------------------------------

MS = 1_000_000
CFG: dict[str, Any] = dict(engine_id="D", compat_hash="h", strict=False, read_timeout_ns=50 * MS, lease_ns=200 * MS,
           lease_margin_ns=10 * MS, handshake_retry_ns=20 * MS, tombstones=8, tombstone_ns=300 * MS, max_staged=3)
WINDOW = 256
LIVE_C = (consumer.S.HANDSHAKING, consumer.S.READING)
AFTER_READS = set(consumer.AFTER_READS)


class Adapter:
    """What an embedder does with the commands: handshakes, peers, reads; and what a scheduler and
    a producer-side peer send. Choices come from the op list, details from a seeded RNG."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0
        self.core = Core(CoreConfig(**CFG), EventLog(window=WINDOW), t_ns=0)
        self.gen = 0  # producer engine generation: a restart comes back under a new engine id
        self.hs: dict[tuple[str, int], int] = {}  # handshakes under way -> attempt
        self.adding: dict[tuple[str, int], int] = {}  # AddPeer given, PeerAdded not yet
        self.peers: dict[tuple[str, int], int] = {}  # connected -> attempt
        self.reads: dict[tuple[str, int, int], bool] = {}  # in flight -> cancelled
        self.c_ids: list[str] = []
        self.handed: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.p_ids = [f"q{i}" for i in range(12)]
        self.holds: Counter[str] = Counter()  # BlocksHeld sent per producer id
        self.n = 0
        self.engine_ids_seen: set[str] = set()

    # layouts: generation g -> engine id, TP and PP fixed per id
    def layout(self, eid: str) -> tuple[int, int]:
        g = int(eid[1:].split("-", maxsplit=1)[0])
        return 1 + (g % 2), 1 + (g % 3 == 2)

    def eid(self, g: int | None = None) -> str:
        return f"E{self.gen if g is None else g}"

    def apply(self, e: Any) -> None:
        self.core.apply(e)
        self.take()

    def take(self) -> None:
        for c in self.core.take_commands():
            if isinstance(c, StartHandshake):
                self.hs[(c.engine_id, c.pp_rank)] = c.attempt
            elif isinstance(c, AddPeer):
                self.hs.pop((c.engine_id, c.pp_rank), None)
                self.adding[(c.engine_id, c.pp_rank)] = c.attempt
            elif isinstance(c, DropPeer):
                self.adding.pop((c.engine_id, c.pp_rank), None)
                self.peers.pop((c.engine_id, c.pp_rank), None)
            elif isinstance(c, PostRead):
                self.reads[(c.request_id, c.source.pp_rank, c.source.tp_rank)] = False
            elif isinstance(c, CancelRead):
                k = (c.request_id, c.pp_rank, c.tp_rank)
                if k in self.reads:
                    self.reads[k] = True
            elif isinstance(c, HandOff):
                self.handed[c.request_id] += 1
            elif isinstance(c, FinishedSending):
                self.finished[c.request_id] += 1

    def ev(self, cls: type, **kw: Any) -> Any:
        return cls(source="test", t_ns=self.now, **kw)

    # --- the ops ---
    # op codes weighted: the consumer's road (reads, handshakes, peers) more often than noise
    CODES = (0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 4, 4, 4, 4, 4, 4, 5, 6, 6, 7, 7, 8, 9, 10, 10, 11, 11,
             12, 13, 14, 15)

    def op(self, code: int, arg: int) -> None:
        r = self.rng
        code = self.CODES[code % len(self.CODES)]
        if code == 0:  # a new consumer request against the current producer engine (or an older one)
            g = self.gen if arg % 4 else max(0, self.gen - 1)
            eid = self.eid(g)
            self.engine_ids_seen.add(eid)
            tp, pp = self.layout(eid)
            if arg % 7 == 3:  # params whose layout contradicts the engine's: refused once connected
                tp = 3 - tp
            rid = f"c{self.n}"
            self.n += 1
            self.c_ids.append(rid)
            blocks = () if arg % 9 == 0 else (1, 2)
            lease = 0 if arg % 3 else 200 * MS
            self.apply(ReadRequested(source="test", t_ns=self.now, request_id=rid, remote_request_id=f"p-{rid}",
                                     engine_id=eid, remote_tp=tp, remote_pp=pp, local_blocks=blocks,
                                     remote_blocks=blocks, lease_ns=lease))
        elif code == 1 and self.hs:  # a handshake answers: valid, refused (compat), or fails
            (eid, pp), att = r.choice(sorted(self.hs.items()))
            tp, pps = self.layout(eid)
            kind = arg % 8
            if kind <= 5:
                rep = reply(eid, tp_size=tp, pp_rank=pp, pp_size=pps, compat_hash="h" if kind else "bad")
                self.apply(self.ev(HandshakeDone, engine_id=eid, pp_rank=pp, attempt=att, reply=rep))
                self.hs.pop((eid, pp), None)
            else:
                self.hs.pop((eid, pp), None)
                self.apply(self.ev(HandshakeFailed, engine_id=eid, pp_rank=pp, attempt=att, error="refused"))
        elif code == 2 and self.adding:  # the transport added the peer (or lost it while adding)
            (eid, pp), att = r.choice(sorted(self.adding.items()))
            del self.adding[(eid, pp)]
            if arg % 6:
                self.peers[(eid, pp)] = att
                self.apply(self.ev(PeerAdded, engine_id=eid, pp_rank=pp, attempt=att))
            else:
                self.apply(self.ev(PeerDisconnected, engine_id=eid, pp_rank=pp, attempt=att, detail="gone"))
        elif code == 3 and self.peers:  # a connected peer goes away
            (eid, pp), att = r.choice(sorted(self.peers.items()))
            del self.peers[(eid, pp)]
            self.apply(self.ev(PeerDisconnected, engine_id=eid, pp_rank=pp, attempt=att, detail="gone"))
        elif code == 4 and self.reads:  # a read stops: done, failed, or cancelled as asked
            k = r.choice(sorted(self.reads))
            cancelled = self.reads.pop(k)
            rid, pp, tp = k
            if cancelled and arg % 2:
                self.apply(self.ev(HandleFailed, request_id=rid, pp_rank=pp, tp_rank=tp, why=HandleFailure.CANCELLED))
            elif arg % 5 == 0:
                why = (HandleFailure.ERR, HandleFailure.DISCONNECTED, HandleFailure.RAISED)[arg % 3]
                self.apply(self.ev(HandleFailed, request_id=rid, pp_rank=pp, tp_rank=tp, why=why))
            else:
                self.apply(self.ev(HandleDone, request_id=rid, pp_rank=pp, tp_rank=tp))
        elif code == 5 and self.c_ids:  # an abort, of any request ever made (late ones included)
            self.apply(self.ev(AbortRequested, request_id=self.c_ids[arg % len(self.c_ids)]))
        elif code == 6:
            self.apply(self.ev(Collect, step=self.n))
        elif code in (7, 8):  # time passes
            self.now += (arg % 40) * MS + (arg % 3)
            self.apply(self.ev(Tick))
        elif code == 9:  # the producer restarts under a new engine id: its connections go
            for (eid, pp), att in sorted(self.peers.items()):
                if eid == self.eid():
                    del self.peers[(eid, pp)]
                    self.apply(self.ev(PeerDisconnected, engine_id=eid, pp_rank=pp, attempt=att, detail="restart"))
            self.gen += 1
        elif code == 10:  # producer side: blocks held for a request (maybe with early news staged)
            rid = self.p_ids[arg % len(self.p_ids)]
            self.holds[rid] += 1
            self.apply(self.ev(BlocksHeld, request_id=rid, block_ids=(1, 2)))
        elif code in (11, 12):  # a notification: expected, early, duplicate, late or for a fresh id
            if arg % 5 == 0:
                rid = f"x{self.n}"
                self.n += 1
            else:
                rid = self.p_ids[arg % len(self.p_ids)]
            of = 1 + (arg // 7) % 2
            self.apply(self.ev(NotificationReceived, request_id=rid, part=(arg // 3) % of, of=of))
        elif code == 13:  # a heartbeat
            rid = self.p_ids[arg % len(self.p_ids)] if arg % 4 else f"h{self.n}"
            self.n += 1
            self.apply(self.ev(Heartbeat, request_id=rid, extend_ns=(arg % 500) * MS))
        elif code == 14:  # a big jump: past every bound
            self.now += 400 * MS + arg
            self.apply(self.ev(Tick))
        elif code == 15:  # reuse a producer id after a while (new blocks for an old id)
            rid = self.p_ids[arg % len(self.p_ids)]
            self.holds[rid] += 1
            self.apply(self.ev(BlocksHeld, request_id=rid, block_ids=(3,)))

    # --- invariants ---
    def check(self) -> None:
        core = self.core
        cfg = core.config
        assert len(core._remembered_order) <= cfg.tombstones
        for kind in core._remembered.values():
            assert len(kind) <= cfg.tombstones
        assert len(core._staged) + len(core._promised) <= cfg.max_staged
        assert len(core.log.window) <= WINDOW
        for m in core.consumers.values():
            assert not m.state.terminal, m
        for p in core.producers.values():
            assert not p.state.terminal, p
        for e in core.engines.values():
            assert e.state is not engine.S.EVICTED, e
        # no timer for a machine that is gone; each live key once; what must fire is armed
        dl, ls = armed(core.deadlines), armed(core.leases)
        for k, ds in dl.items():
            assert k in core.consumers, f"deadline armed for gone consumer {k}: {ds}"
            assert len(ds) == 1, (k, ds)
        for k, ds in ls.items():
            assert k in core.producers, f"lease armed for gone producer {k}: {ds}"
            assert len(ds) == 1, (k, ds)
        for rid, m in core.consumers.items():
            if m.state in LIVE_C:
                assert dl.get(rid) == [m.deadline], (m, m.deadline, dl.get(rid))
        for rid, p in core.producers.items():
            assert ls.get(rid) == [p.deadline], (p, p.deadline, ls.get(rid))
        staged = {rid for rid, p in core.producers.items() if p.state is producer.S.STAGED}
        assert set(core._staged) | set(core._promised) == staged
        assert not set(core._staged) & set(core._promised)
        idle = armed(core.idle)
        for (eid, pp), e in core.engines.items():
            if e.state in (engine.S.FAILED, engine.S.DISCONNECTED):
                assert f"{pp}:{eid}" in idle, f"idle engine {e} not armed for forgetting"
        # holds and waits are accounted for
        holds: Counter[int] = Counter()
        for m in core.consumers.values():
            for e in m.engines:
                holds[id(e)] += 1
                assert core.engines.get(e.key) is e, f"{m} holds {e}, which the core no longer has"
        for e in core.engines.values():
            assert e.readers == holds[id(e)], (e, e.readers, holds[id(e)])
            for rid in e.waiters:
                assert rid in core.consumers and core.consumers[rid].state is consumer.S.HANDSHAKING, (e, rid)
        for rid in core.ready_ids:
            assert rid in core.consumers and core.consumers[rid].state in AFTER_READS
        for rid, n in self.handed.items():
            assert n == 1, (rid, n)

    def drain(self) -> None:
        """Answer everything still owed, then let time pass far beyond every bound."""
        for _ in range(50):
            if not (self.hs or self.adding or self.reads):
                break
            for (eid, pp), att in sorted(self.hs.items()):
                del self.hs[(eid, pp)]
                self.apply(self.ev(HandshakeFailed, engine_id=eid, pp_rank=pp, attempt=att, error="shutdown"))
            for (eid, pp), att in sorted(self.adding.items()):
                del self.adding[(eid, pp)]
                self.apply(self.ev(PeerDisconnected, engine_id=eid, pp_rank=pp, attempt=att, detail="shutdown"))
            for k in sorted(self.reads):
                if k in self.reads:
                    del self.reads[k]
                    self.apply(self.ev(HandleFailed, request_id=k[0], pp_rank=k[1], tp_rank=k[2],
                                       why=HandleFailure.CANCELLED))
            self.apply(self.ev(Collect, step=0))
            self.now += 100 * MS
            self.apply(self.ev(Tick))
            self.check()
        for _ in range(6):
            self.now += 10_000 * MS
            self.apply(self.ev(Tick))
            self.apply(self.ev(Collect, step=0))
            self.check()


@settings(SETTINGS, max_examples=400)
@given(st.integers(0, 2**16), st.lists(st.tuples(st.integers(0, 33), st.integers(0, 2**16)), min_size=20,
                                       max_size=250))
def test_core_structures_stay_bounded_and_drain(seed: int, ops: list[tuple[int, int]]) -> None:
    a = Adapter(seed)
    for code, arg in ops:
        a.op(code, arg)
        a.check()
    a.drain()
    core = a.core
    assert not a.hs and not a.adding and not a.reads
    assert core.consumers == {}, core.consumers
    assert core.producers == {}, core.producers
    assert all(e.state is engine.S.CONNECTED for e in core.engines.values()), core.engines
    assert len(core.deadlines) == 0 and len(core.leases) == 0
    # Connected engines stay until nobody has read from them for idle_engine_ns, then go too.
    a.now += core.config.idle_engine_ns
    a.apply(a.ev(Tick))
    assert core.engines == {}, core.engines
    assert len(core.idle) == 0, armed(core.idle)
    assert not core._staged and not core._promised and not core.ready_ids
    assert core.next_deadline() is None
    assert len(core._remembered_order) <= core.config.tombstones
    for rid in a.c_ids:  # every consumer request with blocks was handed back exactly once, or notified
        assert a.handed[rid] <= 1
    for rid, n in a.finished.items():
        assert n <= a.holds[rid], (rid, n)  # blocks released at most once per registration


def test_tombstones_zero_forgets_every_terminal_state_without_crashing() -> None:
    """FINDING. ``tombstones=0`` (remember no terminal state) passes the Connector's config check
    (``_check_int(..., low=0)``), but the trimming loop in ``Core._drain`` pops the only entry and
    then reads ``order[0]`` of the empty deque: IndexError out of the hot loop on the first
    request that ends RELEASED or EXPIRED (its machine already deleted, its record never made)."""
    from pdfsm.connector import Connector
    from transports.sim import SimHandshaker, SimNetwork, SimTransport

    net = SimNetwork()
    conn = Connector(CoreConfig(engine_id="P", compat_hash="h", tombstones=0), SimTransport(net, "P-0"),
                     SimHandshaker(net))  # accepted: 0 is within the checked range
    core = conn.core
    core.apply(BlocksHeld(source="test", t_ns=1, request_id="p1", block_ids=(1,)))
    core.apply(NotificationReceived(source="test", t_ns=2, request_id="p1", part=0, of=1))  # IndexError
    assert core.producers == {} and core.remembered(PRODUCER, "p1") is None
    assert core.log.records()[-1].state == "RELEASED"


def test_tombstones_are_trimmed_by_age_when_the_next_one_is_added() -> None:
    """Documented: bounded by count and by age; the age bound is applied as tombstones are added
    (a quiet core keeps at most ``tombstones`` of them)."""
    a = Adapter(0)
    for i in range(20):
        rid = f"q{i}"
        a.apply(a.ev(BlocksHeld, request_id=rid, block_ids=(1,)))
        a.apply(a.ev(NotificationReceived, request_id=rid, part=0, of=1))
        a.check()
    assert len(a.core._remembered_order) == a.core.config.tombstones
    assert a.core.remembered(PRODUCER, "q19") is producer.S.RELEASED
    assert a.core.remembered(PRODUCER, "q0") is None
    a.now += 1_000 * MS
    a.apply(a.ev(Tick))
    a.apply(a.ev(BlocksHeld, request_id="last", block_ids=(1,)))
    a.apply(a.ev(NotificationReceived, request_id="last", part=0, of=1))
    assert list(a.core._remembered_order) == [Tombstone(a.now, PRODUCER, "last")]
    assert a.core.remembered(PRODUCER, "q19") is None


def test_staging_overflow_keeps_every_staged_producer_timed() -> None:
    """Over ``max_staged`` the oldest notification-only entry is dropped (DISCARDED, lease timer
    disarmed); promised ones stay; the staged set never exceeds the bound."""
    a = Adapter(0)
    a.apply(a.ev(Heartbeat, request_id="h0", extend_ns=500 * MS))
    for i in range(10):
        a.apply(a.ev(NotificationReceived, request_id=f"s{i}", part=0, of=2))
        a.check()
    assert "h0" in a.core._promised
    assert set(a.core._staged) == {"s8", "s9"}
    assert set(armed(a.core.leases)) == {"h0", "s8", "s9"}


def test_failed_engines_are_forgotten_across_restarts() -> None:
    """A producer restarting under new ids, each old id failing its handshake: every failed
    engine is forgotten once idle past the bound; the idle wheel ends empty."""
    a = Adapter(0)
    for g in range(30):
        a.gen = g
        a.op(0, 1)  # a request to E{g}
        for (eid, pp), att in sorted(a.hs.items()):
            del a.hs[(eid, pp)]
            a.apply(a.ev(HandshakeFailed, engine_id=eid, pp_rank=pp, attempt=att, error="refused"))
        a.apply(a.ev(Collect, step=g))
        a.now += 30 * MS
        a.apply(a.ev(Tick))
        a.check()
        assert len(a.core.engines) <= 12  # forget after 300 ms, one engine (or two PP ranks) per 30 ms
    a.now += 10_000 * MS
    a.apply(a.ev(Tick))
    assert a.core.engines == {} and len(a.core.idle) == 0
