"""The producer side, leases, heartbeats and clocks, on both sides.

Each test drives pdfsm (a Core with events, or Connectors over the simulated transport on a fake
clock) and asserts what the docs promise: a producer's blocks are released exactly once (by the
full notification count or by the lease), never while a read the consumer trusts may still copy
them, and the consumer never trusts a read past what the producer promised.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers import LeaseWorld, RankedEngines, S, connected, ev, handshake, make_core, read, reply, tick

from pdfsm.commands import FinishedSending, HandOff, PostRead, SendNotification
from pdfsm.connector import Connector
from pdfsm.core import Core
from pdfsm.errors import ConnectorClosed, InvalidInput
from pdfsm.events import (
    PRODUCER,
    BlocksHeld,
    Collect,
    CoreConfig,
    HandleDone,
    HandleFailed,
    HandleFailure,
    Heartbeat,
    LeaseExpired,
    NotificationReceived,
    Tick,
)
from pdfsm.fsm import Fault
from pdfsm.producer import S as P
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

BB = 64  # bytes per simulated block


def _finished(core: Any) -> list[FinishedSending]:
    return [c for c in core.take_commands() if isinstance(c, FinishedSending)]


# --- consumer trust bound: sentinel values --------------------------------------------------------------


def test_trust_bound_of_exactly_zero_still_bounds_a_read() -> None:
    """The adapter's clock may read negative (decisions.md: a process-relative clock; the timer
    tests cover negative clocks). A read requested at t=-10 with a lease of margin+10 ns has its
    trust bound (lease start + lease - margin) at exactly t=0, and its deadline too. Its read is
    seen complete at t=50, after the bound: the producer may have reused the blocks, so the
    request must fail with its blocks invalid. pdfsm uses 0 as "no trust bound known" and trusts
    the read: it is handed back as received. (The core's own events stay before -10 too: a Tick or
    Collect at 0 applied first would make the request too late to read at all.)"""
    core = Core(CoreConfig(engine_id="D", compat_hash="h", lease_margin_ns=100), t_ns=-1000)
    core.apply(read("warm-up", t=-100))
    handshake(core, t=-100)
    core.apply(ev(HandleDone, -100, request_id="warm-up", pp_rank=0, tp_rank=0))
    core.apply(ev(Collect, -100, step=0))
    core.take_commands()
    core.apply(read("r", t=-10, lease_ns=110))
    assert any(isinstance(c, PostRead) for c in core.take_commands())
    core.apply(ev(HandleDone, 50, request_id="r", pp_rank=0, tp_rank=0))
    core.apply(ev(Collect, 60, step=1))
    offs = [c for c in core.take_commands() if isinstance(c, HandOff)]
    assert [o.outcome for o in offs] == ["failed"], f"a read completed after its trust bound was {offs}"
    assert offs[0].invalid_blocks == (1, 2)


def test_negative_trust_bound_still_means_the_lease_is_over_no_late_notice() -> None:
    """Negative clock again: a read requested at t=-1000 on a 500 ns lease with a 100 ns margin has
    its trust bound at t=-600. The read fails at t=-500, after it: the lease the params gave is
    over, so (decisions.md, vLLM PR 41269) no notification may be sent -- the producer released
    by itself and reads a late notice as "that read may have seen reused blocks". (pdfsm once took
    a trust bound <= 0 for "not known" and notified.)"""
    core = make_core(strict=False, lease_margin_ns=100)
    connected(core)
    core.apply(read("r", t=-1000, lease_ns=500))
    core.take_commands()
    core.apply(ev(HandleFailed, -500, request_id="r", pp_rank=0, tp_rank=0, why=HandleFailure.ERR))
    notes = [c for c in core.take_commands() if isinstance(c, SendNotification)]
    assert notes == [], f"late notice sent after the lease was over: {notes}"


def test_params_without_lease_ns_are_not_trusted_past_the_producers_lease() -> None:
    """A router that rebuilds kv_transfer_params from the keys it knows drops ``lease_ns`` and
    ``issued_wall_ns`` (pdfsm refuses a missing ``remote_tp_size`` for exactly this reason, vLLM
    router PR 191). The producer's lease is 4 s; decode's read timeout is the default 30 s. The
    read is seen complete 6 s after the params were minted, after the producer's lease expired
    and its blocks were reused. Decode must not report it received (refuse params without a
    lease, or bound trust some other way). pdfsm refuses them (it once trusted the read until the
    read timeout)."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    params = w.p.request_finished("p1", [1, 2]).to_dict()
    del params["lease_ns"], params["issued_wall_ns"]
    w.net.script("d1", 0, 0, ReadScript(polls=1))
    with pytest.raises(InvalidInput) as err:
        w.d.load("d1", [5, 6], params)
    assert err.value.field == "lease_ns"
    assert "d1" not in w.d.core.consumers


# --- producer: expiry exactly once, around the tick ---------------------------------------------------


@pytest.mark.parametrize("first", ["notification", "tick"])
def test_notification_exactly_at_the_expiry_tick_releases_once(first: str) -> None:
    """The last notification and the lease's Tick carry the same t_ns (the deadline). Whichever is
    applied first decides (released, or expired); the blocks are released exactly once, and a
    notification after the expiry is a remote violation that changes nothing."""
    core = make_core(engine_id="P", strict=False, lease_ns=1000)
    core.apply(ev(BlocksHeld, 0, request_id="r", block_ids=(3,)))
    note = ev(NotificationReceived, 1000, request_id="r", part=0, of=1)
    events = [note, ev(Tick, 1000)] if first == "notification" else [ev(Tick, 1000), note]
    for e in events:
        core.apply(e)
    fin = _finished(core)
    assert len(fin) == 1 and fin[0].expired is (first == "tick")
    core.apply(ev(Tick, 10_000))
    assert _finished(core) == []
    assert core.remembered(PRODUCER, "r") is (P.EXPIRED if first == "tick" else P.RELEASED)
    if first == "tick":
        assert core.rejections[Fault.REMOTE] == 1


def test_heartbeat_in_every_producer_state() -> None:
    """Heartbeats in each producer state: NEW stages the promise; STAGED and HOLDING extend to
    arrival + extend_ns (never shorten); RELEASED ignores; EXPIRED records a remote violation and
    changes nothing; a DISCARDED id starts over as STAGED. No heartbeat ever releases blocks, and
    each hold is released exactly once, not before its promise."""
    core = make_core(engine_id="P", strict=False, lease_ns=1000)
    core.apply(ev(Heartbeat, 0, request_id="a", extend_ns=5000))  # NEW -> STAGED, promise 5000
    assert core.producers["a"].state is P.STAGED
    core.apply(ev(Heartbeat, 100, request_id="a", extend_ns=10))  # shorter: the promise stays
    core.apply(ev(BlocksHeld, 200, request_id="a", block_ids=(1,)))
    assert core.producers["a"].deadline == 5000
    core.apply(ev(Heartbeat, 300, request_id="a", extend_ns=6000))  # HOLDING: 6300
    core.apply(ev(Heartbeat, 400, request_id="a", extend_ns=1))  # never shortens
    core.apply(ev(Tick, 6299))
    assert _finished(core) == []
    core.apply(ev(Tick, 6300))
    assert [(f.request_id, f.expired) for f in _finished(core)] == [("a", True)]
    core.apply(ev(Heartbeat, 6400, request_id="a", extend_ns=1000))  # EXPIRED: remote, nothing changes
    assert core.rejections[Fault.REMOTE] == 1 and core.remembered(PRODUCER, "a") is P.EXPIRED
    core.apply(ev(BlocksHeld, 7000, request_id="b", block_ids=(2,)))
    core.apply(ev(NotificationReceived, 7001, request_id="b", part=0, of=1))
    core.apply(ev(Heartbeat, 7002, request_id="b", extend_ns=1000))  # RELEASED: ignored
    assert [f.request_id for f in _finished(core)] == ["b"] and "b" not in core.producers
    core.apply(ev(NotificationReceived, 8000, request_id="c", part=0, of=2))  # staged, never held
    core.apply(ev(Tick, 9000))  # discarded after a lease
    assert "c" not in core.producers and core.remembered(PRODUCER, "c") is None
    core.apply(ev(Heartbeat, 9001, request_id="c", extend_ns=10))
    assert core.producers["c"].state is P.STAGED
    core.apply(ev(Tick, 20_000))
    assert _finished(core) == []


def test_producer_clock_going_backwards_and_jumping_releases_each_hold_once() -> None:
    """The adapter's t_ns goes backwards between events (a heartbeat stamped before the hold, a
    Tick before the lease's start) and then jumps by 2**62: nothing is released early, a
    heartbeat from the past never shortens a lease, and the jump expires every hold exactly once."""
    core = make_core(engine_id="P", strict=False, lease_ns=1000)
    core.apply(ev(BlocksHeld, 10_000, request_id="a", block_ids=(1,)))
    core.apply(ev(BlocksHeld, 10_000, request_id="b", block_ids=(2,)))
    core.apply(ev(Heartbeat, 5_000, request_id="a", extend_ns=100))  # from the past: 5100 < 11000
    core.apply(ev(Tick, 3_000))
    core.apply(ev(Tick, 10_999))
    assert _finished(core) == []
    core.apply(ev(NotificationReceived, 9_000, request_id="b", part=0, of=1))
    assert [(f.request_id, f.expired) for f in _finished(core)] == [("b", False)]
    for _ in range(3):
        core.apply(ev(Tick, 1 << 62))
    assert [(f.request_id, f.expired) for f in _finished(core)] == [("a", True)]
    assert not core.producers and core.next_deadline() is None


# --- producer via the Connector: lease extremes, shutdown ------------------------------------------------


def test_one_ns_and_maximum_lease_overrides() -> None:
    """request_finished(lease_ns=1): the params say 1 ns; decode refuses to load them (not longer
    than its lease margin: no read of them could be trusted; before, the load was taken and failed
    at once with its blocks invalid), nothing is posted, and the producer expires the hold at the
    next step, reported once. lease_ns=2**62 (the documented maximum) is held, read and released
    by the notification; 2**62+1 is refused by name."""
    w = LeaseWorld()
    w.connect()
    p1 = w.p.request_finished("p1", [1], lease_ns=1)
    assert p1.lease_ns == 1
    with pytest.raises(InvalidInput, match="lease_margin_ns") as refused:
        w.d.load("d1", [5], p1)
    assert refused.value.field == "lease_ns"
    w.run(3, dt=1000)
    assert w.expired == ["p1"] and w.released == ["p1"]
    assert "d1" not in w.failed and "d1" not in w.received
    p2 = w.p.request_finished("p2", [2], lease_ns=1 << 62)
    w.now += 3600 * S
    w.d.load("d2", [6], p2)
    w.run(4, dt=1000)
    assert w.received == ["d2"] and w.released == ["p1", "p2"] and w.expired == ["p1"]
    assert w.read_bytes_ok([6], [2])
    with pytest.raises(InvalidInput) as exc:
        w.p.request_finished("p3", [3], lease_ns=(1 << 62) + 1)
    assert exc.value.field == "lease_ns"


def test_producer_shutdown_with_holds_outstanding() -> None:
    """Shutdown with one hold outstanding, one staged early notification and one hold whose
    notification is being delivered in the shutdown step: no exception; the released one is in
    the last report once, the outstanding hold is not reported (docs/embedding.md), and every
    later call but shutdown raises ConnectorClosed."""
    w = LeaseWorld()
    w.connect()
    w.p.request_finished("held", [1])
    p2 = w.p.request_finished("done", [2])
    w.run(1, dt=1000)
    w.d.load("d2", [6], p2)
    w.d.get_finished()
    w.d.get_finished()  # the read completes, its notification is in the producer's inbox
    last = w.p.shutdown()
    assert last.finished_sending == frozenset({"done"}) and not last.expired
    assert w.p.shutdown() is last
    for call in (w.p.get_finished, lambda: w.p.request_finished("x", [3])):
        with pytest.raises(ConnectorClosed):
            call()


def test_random_schedules_with_heartbeats_overrides_and_faulty_notifications_keep_both_contracts() -> None:
    """Random (seeded) schedules over one producer and one decode Connector: lease overrides from
    1 ns to 3 leases, loads after random delays, notify-only loads, heartbeats, aborts, reads that
    err or hang, notifications dropped/duplicated/delayed, small tombstone and staging bounds, and
    clock steps from 1 ns to 1000 leases. The producer overwrites a hold's blocks as soon as it
    reports them released. Every hold is reported once at most; no read of overwritten blocks is
    reported received (nor aborted with its blocks valid); no call raises."""
    for seed in range(200):
        _random_schedule(seed)


def _random_schedule(seed: int) -> None:
    rnd = random.Random(seed)
    net, now = SimNetwork(), [S]
    lease = rnd.choice([50_000, 200_000, 1_000_000])
    prod = SimTransport(net, "P-0", block_bytes=BB)
    p = Connector(CoreConfig(engine_id="P", compat_hash="h", lease_ns=lease, tombstones=rnd.choice([0, 1, 4, 65536]),
                             max_staged=rnd.choice([0, 1, 4096])),
                  prod, SimHandshaker(net), clock=lambda: now[0], wall_clock=lambda: now[0], port=9)
    net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(prod.rank_info(),)))
    cons = SimTransport(net, "D-0", block_bytes=BB)
    d = Connector(CoreConfig(engine_id="D", compat_hash="h", lease_margin_ns=rnd.choice([0, 1000, 10_000]),
                             read_timeout_ns=rnd.choice([20_000, 10**7])),
                  cons, SimHandshaker(net), clock=lambda: now[0], wall_clock=lambda: now[0])
    free, dfree = list(range(64)), list(range(64))
    held: dict[str, list[int]] = {}
    sent: dict[str, int] = {}
    params: dict[str, Any] = {}
    loads: dict[str, tuple[list[int], list[int], Any, str]] = {}
    n = 0
    for step in range(rnd.randint(20, 80)):
        op = rnd.random()
        if op < 0.3 and len(free) >= 2:
            rid = f"r{n}"
            n += 1
            blocks = [free.pop(rnd.randrange(len(free))) for _ in range(rnd.randint(1, 2))]
            for b in blocks:
                prod.memory[b * BB:(b + 1) * BB] = pattern(rid, b, BB)
            params[rid] = p.request_finished(rid, blocks, lease_ns=rnd.choice([None, None, 1, lease // 3, 3 * lease]))
            held[rid] = blocks
        elif op < 0.6 and params:
            rid = rnd.choice(list(params))
            pa = params.pop(rid)
            local = [dfree.pop() for _ in pa.remote_block_ids] if rnd.random() < 0.9 else []
            if rnd.random() < 0.3:
                net.fault_notification(rid, rnd.choice(["drop", "duplicate", "delay"]), rnd.randint(1, 4))
            net.script("d" + rid, 0, 0, ReadScript(polls=rnd.randint(0, 6),
                                                   end=rnd.choice(("done",) * 5 + ("err", "hang"))))
            if local and pa.lease_ns <= d.config.lease_margin_ns:  # no read of them could be trusted
                with pytest.raises(InvalidInput, match="lease_margin_ns"):
                    d.load("d" + rid, local, pa)
                dfree.extend(local)
                continue
            d.load("d" + rid, local, pa)
            loads["d" + rid] = (local, list(pa.remote_block_ids), pa, rid)
        elif op < 0.7 and loads:
            d.heartbeat(loads[rnd.choice(list(loads))][2], rnd.choice([1000, lease, 10 * lease]))
        elif op < 0.75 and loads:
            d.abort(rnd.choice(list(loads)))
        now[0] += rnd.choice([1, 1000, 10_000, lease // 2, lease, 3 * lease, 1000 * lease])
        for c in (d, p) if rnd.random() < 0.5 else (p, d):
            sending, recving = c.get_finished()
            if c is p:
                for rid in sending:
                    sent[rid] = sent.get(rid, 0) + 1
                    for b in held[rid]:
                        prod.memory[b * BB:(b + 1) * BB] = pattern("reused", b + step, BB)
                    free += held.pop(rid)
                continue
            bad = {o.request_id for o in d.last.failed}
            invalid = d.get_block_ids_with_load_errors()
            for rid in recving:
                local, remote, _, prid = loads.pop(rid)
                valid = rid not in bad and not (set(local) & invalid)
                if local and valid:
                    for lb, rb in zip(local, remote[len(remote) - len(local):], strict=True):
                        assert cons.block(lb) == pattern(prid, rb, BB), (seed, rid, "reused bytes trusted")
                dfree += local
    assert all(v == 1 for v in sent.values()), (seed, sent)


def test_tombstone_pushed_out_while_notifications_still_arrive() -> None:
    """tombstones=1: an expired hold is remembered until the next terminal state pushes it out. A
    late notification while remembered is a remote violation "after the lease expired"; after it
    was pushed out, the same late notification is staged as early news and discarded one lease
    later, again a remote violation. Neither releases anything a second time."""
    core = make_core(engine_id="P", strict=False, lease_ns=1000, tombstones=1)
    core.apply(ev(BlocksHeld, 0, request_id="a", block_ids=(1,)))
    tick(core, 1000)
    assert [f.expired for f in _finished(core)] == [True]
    core.apply(ev(NotificationReceived, 1100, request_id="a", part=0, of=1))
    assert core.rejections[Fault.REMOTE] == 1
    core.apply(ev(BlocksHeld, 1200, request_id="b", block_ids=(2,)))
    core.apply(ev(NotificationReceived, 1300, request_id="b", part=0, of=1))  # pushes "a" out
    assert [f.request_id for f in _finished(core)] == ["b"] and core.remembered(PRODUCER, "a") is None
    core.apply(ev(NotificationReceived, 1400, request_id="a", part=0, of=1))
    assert core.producers["a"].state is P.STAGED
    tick(core, 2400)
    assert _finished(core) == [] and "a" not in core.producers
    assert core.violations[Fault.REMOTE] >= 3
    assert not any(isinstance(r.event, LeaseExpired) and r.event.request_id == "b" for r in core.log.records())


@pytest.mark.parametrize("lag_s", [0.5, 1.5, 3.0, 4.9])
def test_a_rank_that_holds_before_the_minting_rank_keeps_its_blocks_while_reads_of_them_are_trusted(
        lag_s: float) -> None:
    """Prefill TP 2: rank 1 calls request_finished ``lag_s`` before rank 0, whose params (and
    issue stamp) the router passes on; within hold_skew_ns, as the docs allow. The consumer
    counts the lease from rank 0's stamp, so rank 1's own lease ran out first: its blocks were
    reused while a slow read of them was still trusted, and the request was reported received
    with another request's bytes (found by review). A self-stamped hold of a multi-rank producer
    is held hold_skew_ns longer: the read either fails (not trusted) or copies rank 1's bytes."""
    e = RankedEngines(2, 1, p_config={"lease_ns": 10 * S}, d_config={"lease_margin_ns": S})
    e.now = 100 * S
    p0, p1, d = e.p[(0, 0)], e.p[(0, 1)], e.d[(0, 0)]
    p1.request_finished("r", [3, 4])
    e.now += int(lag_s * S)
    params = p0.request_finished("r", [3, 4])
    e.net.script("dr", 0, 1, ReadScript(end="hang"))  # the read of rank 1 is slow
    d.load("dr", [10, 11], params)
    d.get_finished()
    outcome = ""
    for t in (104, 105, 108, 110.2, 110.4, 110.6):
        e.now = int(t * S)
        if t == 110.4:  # the slow read completes: before the consumer's trust bound when lag > margin
            read_ = e.dt[(0, 0)].reads.get(("dr", 0, 1))
            if read_ is not None:
                read_.script = ReadScript(polls=0, end="done")
        for k, c in ((0, p0), (1, p1)):
            c.get_finished()
            if "r" in c.last.expired:  # the scheduler frees them; another request overwrites them
                tr = e.pt[(0, k)]
                for b in (3, 4):
                    tr.memory[b * tr.block_bytes:(b + 1) * tr.block_bytes] = pattern("other", b, tr.block_bytes)
        if "dr" in d.get_finished()[1]:
            outcome = "failed" if d.last.failed else "received"
    assert outcome
    if outcome == "received":
        half, tr1 = e.dt[(0, 0)].block_bytes // 2, e.pt[(0, 1)]
        assert all(e.dt[(0, 0)].block(lb)[half:] == pattern("P0.1", rb, tr1.block_bytes)
                   for lb, rb in ((10, 3), (11, 4)))
    assert not [r for r in p1.core.log.records() if r.fault]  # no notice after its lease


def test_a_multi_rank_producer_with_hold_skew_off_needs_one_stamp_for_every_ranks_hold() -> None:
    """hold_skew_ns=0 ("not checked") left the lag between ranks' self-stamped holds unbounded,
    so no extension could keep an earlier rank's blocks past the consumer's trust (found by
    review: received with another request's bytes). Such a hold is refused by name; with the
    scheduler's one stamp it is accepted."""
    e = RankedEngines(2, 1, p_config={"hold_skew_ns": 0})
    p1 = e.p[(0, 1)]
    with pytest.raises(InvalidInput) as exc:
        p1.request_finished("r", [3, 4])
    assert exc.value.field == "issued_wall_ns" and not p1.core.producers
    p1.request_finished("r", [3, 4], issued_wall_ns=123)
