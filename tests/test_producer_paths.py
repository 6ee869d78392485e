"""The producer (prefill) side driven through Connectors over the simulated transport.

Each test asserts what docs/embedding.md, docs/decisions.md or pdfsm/producer.py promise."""

from __future__ import annotations

import pytest
from helpers import LeaseWorld, S, ev, make_core, read, tick

from pdfsm import producer
from pdfsm.events import BlocksHeld, Heartbeat, NotificationReceived, StagedDropped
from pdfsm.fsm import Fault
from pdfsm.log import Record
from pdfsm.wire import HeartbeatMessage, Notification, notify_codec
from transports.sim import ReadScript


def _note(w: LeaseWorld, rid: str, part: int = 0, of: int = 1, sender: str = "D-0") -> None:
    w.net.deliver(sender, "P-0", notify_codec.encode(Notification(rid, part, of)), rid)


def _beat(w: LeaseWorld, rid: str, extend_ns: int, sender: str = "D-0") -> None:
    w.net.deliver(sender, "P-0", notify_codec.encode(HeartbeatMessage(rid, extend_ns)), rid)


def _records(w: LeaseWorld, kind: type) -> list[Record]:
    return [r for r in w.p.core.log.records() if isinstance(r.event, kind)]


def test_abort_called_on_a_producer_hold_keeps_blocks_until_the_reader_notifies() -> None:
    """The client cancels a prefilled request while the decode still reads (vLLM PR 25067's race):
    the Connector has no producer abort; ``abort`` of the held id must neither release the blocks
    while a read is in flight nor raise nor blame anyone; the hold is reported once, by the
    reader's notification (embedding.md: finished_sending exactly once)."""
    w = LeaseWorld()
    w.connect()
    params = w.p.request_finished("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(polls=4))
    w.d.load("d1", [5, 6], params)
    w.run(2, dt=1000)
    w.p.abort("p1")
    w.run(1, dt=1000)
    assert w.released == [], "blocks released while the decode still reads them"
    w.run(6, dt=1000)
    assert w.received == ["d1"] and w.released == ["p1"] and w.expired == []
    assert w.read_bytes_ok([5, 6], [1, 2])
    assert w.p.core.violations == {Fault.LOCAL: 0, Fault.REMOTE: 0}


def test_late_duplicate_notification_is_one_remote_violation_and_never_a_second_release() -> None:
    """The transport delivers the reader's notification twice: released once; the duplicate is a
    remote violation ("already released"), attributed to the sender (producer.py)."""
    w = LeaseWorld()
    w.connect()
    params = w.p.request_finished("p1", [1])
    w.net.fault_notification("p1", "duplicate")
    w.d.load("d1", [5], params)
    w.run(6, dt=1000)
    assert w.released == ["p1"] and w.expired == []
    bad = [r for r in w.p.core.log.records() if r.fault is not None]
    assert len(bad) == 1 and bad[0].fault is Fault.REMOTE and "already released" in bad[0].reason
    assert isinstance(bad[0].event, NotificationReceived) and bad[0].event.sender == "D-0"
    w.run(3, dt=10 * S)
    assert w.released == ["p1"]


def test_burst_of_early_notifications_over_max_staged_keeps_the_newest_and_releases_each_hold_once() -> None:
    """Early notifications (vLLM PR 43509) for five holds not registered yet, with max_staged=3:
    the two oldest are dropped (decisions.md: a dropped notification costs the request its
    lease's wait), the three newest release their holds as soon as they are registered; every
    hold is reported exactly once."""
    w = LeaseWorld(p_config={"max_staged": 3})
    w.connect()
    for i in range(5):
        _note(w, f"r{i}")
    w.run(1, dt=1000)
    assert len(_records(w, StagedDropped)) == 2
    for i in range(5):
        w.p.request_finished(f"r{i}", [i + 1])
    w.run(1, dt=1000)
    assert sorted(w.released) == ["r2", "r3", "r4"] and w.expired == []
    w.run(2, dt=4 * S)
    assert sorted(w.released) == ["r0", "r1", "r2", "r3", "r4"]
    assert sorted(w.expired) == ["r0", "r1"]


def test_heartbeats_reorder_expiry_of_many_holds_and_each_expires_once_at_its_promise() -> None:
    """Forty holds under one lease (4 s); heartbeats extend every even one by 10 s half-way: at the
    lease's end exactly the odd ones expire, the even ones 10 s after their heartbeat (not
    before), each once (vLLM PR 50789: expiry must not depend on arming order)."""
    w = LeaseWorld()
    w.connect()
    t0 = w.now
    for i in range(40):
        w.p.request_finished(f"h{i}", [i])
    w.run(1)
    w.now = t0 + 2 * S
    for i in range(0, 40, 2):
        _beat(w, f"h{i}", 10 * S)
    w.run(1)
    w.now = t0 + 4 * S
    w.run(1)
    assert sorted(w.expired) == sorted(f"h{i}" for i in range(1, 40, 2))
    w.now = t0 + 12 * S - 1
    w.run(1)
    assert len(w.expired) == 20
    w.now = t0 + 12 * S
    w.run(2)
    assert sorted(w.expired) == sorted(f"h{i}" for i in range(40)) == sorted(w.released)


def test_a_staged_heartbeat_keeps_the_staging_a_lease_from_itself() -> None:
    """Two heartbeats before the hold registers, at 0 and at 0.8 lease, each promising 5 leases;
    the worker registers the hold at 1.2 leases. Staging ran one lease from the first heartbeat,
    so the entry, with the second's promise, went at 1.0 and the hold got a plain lease from its
    registration: shorter than promised, so a consumer's late read failed where it was promised to
    succeed (found by random walks in a review). Staged until a lease after the latest heartbeat,
    the hold keeps the promise."""
    lease = 10**9
    core = make_core(engine_id="P", lease_ns=lease, strict=False)
    core.apply(ev(Heartbeat, 0, request_id="x", extend_ns=5 * lease))
    core.apply(ev(Heartbeat, 8 * lease // 10, request_id="x", extend_ns=5 * lease))
    tick(core, 12 * lease // 10)
    core.apply(ev(BlocksHeld, 12 * lease // 10, request_id="x", block_ids=(1,)))
    m = core.producers["x"]
    assert m.state is producer.S.HOLDING and m.deadline == 8 * lease // 10 + 5 * lease


@pytest.mark.parametrize("tombstones", [0, 1, 2])
def test_stale_engine_news_for_a_request_forgotten_in_the_same_cascade_is_ignored(tombstones: int) -> None:
    """Two notify-only PP 2 requests; both stages' handshakes time out in one Tick, each deriving
    EngineFailed for both. The first releases each; with tombstones 0 or 1 the first release's
    tombstone is gone when the second stage's news arrives, which then met a fresh machine and
    was refused as a local violation, "no such request" (strict mode raised; found by review)."""
    core = make_core(tombstones=tombstones, read_timeout_ns=10**9, lease_ns=10**10, handshake_timeout_ns=5 * 10**8)
    for rid in ("r0", "r1"):
        core.apply(read(rid, blocks=(), remote_blocks=(), remote_pp=2, lease_ns=10**10))
    tick(core, 6 * 10**8)
    assert not core.violations[Fault.LOCAL] and not core.consumers
