"""A notification names one hold of a request id, by its params' issue time (docs/decisions.md,
"A notification names the hold it read"): late notices of an earlier hold under a reused id do
not count toward the new one, and every rank's early notices for the hold still do."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import RankedEngines, ev, make_core

from pdfsm.commands import FinishedSending
from pdfsm.connector import ConnectorMetadata
from pdfsm.core import Core
from pdfsm.errors import InvalidInput
from pdfsm.events import BlocksHeld, NotificationReceived
from pdfsm.fsm import Fault
from pdfsm.wire import Notification, notification_event, notify_codec

S = 1_000_000_000  # one second, in ns
OLD, NEW = 1_000 * S, 1_300 * S  # wall-clock issue times of two holds of one id, a lease apart and more


def producer(**config: Any) -> Core:
    return make_core(engine_id="P", strict=False, **config)


def hold(core: Core, t: int, issued: int, rid: str = "px") -> None:
    core.apply(ev(BlocksHeld, t, request_id=rid, block_ids=(1, 2), issued_wall_ns=issued))


def note(core: Core, t: int, issued: int, rid: str = "px", part: int = 0, of: int = 1) -> None:
    core.apply(ev(NotificationReceived, t, request_id=rid, part=part, of=of, sender="D-0", issued_wall_ns=issued))


def released(core: Core) -> list[str]:
    return [c.request_id for c in core.take_commands() if isinstance(c, FinishedSending)]


def faults(core: Core) -> list[tuple[Fault, str]]:
    return [(r.fault, r.reason) for r in core.log.records() if r.fault is not None]


def test_a_late_notice_staged_before_the_hold_does_not_release_a_new_hold_of_the_id() -> None:
    core = producer()
    note(core, 10, OLD)  # the previous hold's notice, late: the id is forgotten, so it is staged
    hold(core, 20, NEW)
    assert released(core) == []
    assert faults(core) == [(Fault.REMOTE, "staged notifications were of an earlier hold of this request id: "
                                           "not counted")]
    note(core, 30, NEW)  # this hold's own reader
    assert released(core) == ["px"]


def test_a_late_notice_while_holding_is_a_remote_violation_that_changes_nothing() -> None:
    core = producer()
    hold(core, 10, NEW)
    note(core, 20, OLD)
    assert released(core) == [] and core.producers["px"].state.name == "HOLDING"
    ((fault, reason),) = faults(core)
    assert fault is Fault.REMOTE and reason.startswith("notification of another hold of this request id")
    note(core, 30, NEW)
    assert released(core) == ["px"]


def test_every_rank_s_early_notice_within_the_skew_still_counts() -> None:
    """The consumer may read rank k before rank k registers the hold (its issue time is its own, a
    moment after the minting rank's): staged, then counted."""
    core = producer()
    note(core, 10, NEW, part=0, of=2)
    note(core, 11, NEW + 3 * S, part=1, of=2)  # another consumer rank, the same params
    hold(core, 20, NEW + 2 * S)
    assert released(core) == ["px"] and faults(core) == []


def test_a_later_hold_s_notice_replaces_an_earlier_hold_s_staged_one() -> None:
    core = producer()
    note(core, 10, OLD)
    note(core, 11, NEW)
    hold(core, 20, NEW)
    assert released(core) == ["px"]
    assert [reason for _, reason in faults(core)] == [
        "staged notifications were of an earlier hold of this request id: replaced"]


def test_unsaid_issue_times_and_a_zero_skew_are_not_checked() -> None:
    for core, old, new in ((producer(), 0, NEW), (producer(), OLD, 0), (producer(hold_skew_ns=0), OLD, NEW)):
        note(core, 10, old)
        hold(core, 20, new)
        assert released(core) == ["px"] and faults(core) == []


def test_the_wire_carries_the_issue_time_and_older_notifications_still_decode() -> None:
    raw = notify_codec.encode(Notification("px", 0, 1, NEW))
    got = notification_event(raw, sender="D-0", source="notify", t_ns=5)
    assert isinstance(got, NotificationReceived) and got.issued_wall_ns == NEW
    older = b"\x94\xa1n\xa2px\x00\x01"  # ["n", "px", 0, 1]: a consumer from before the field
    got = notification_event(older, sender="D-0", source="notify", t_ns=5)
    assert isinstance(got, NotificationReceived) and got.issued_wall_ns == 0 and got.part == 0


# --- one stamp for every rank (Connector.request_finished / ConnectorMetadata.hold_issued) --------------


def skewed_tp2() -> RankedEngines:
    """A TP 2 prefill engine whose rank 1 runs on a host with its wall clock 10 s ahead, and a TP 1
    decode worker reading both ranks; every clock at 1,000 s."""
    w = RankedEngines(2, 1, p_wall_ahead={1: 10 * S}, p_config={"lease_ns": 600 * S})
    w.now = 1_000 * S
    return w


def run(w: RankedEngines) -> list[set[str]]:
    """Step every worker a few times; what each producer TP rank released."""
    sent: list[set[str]] = [set(), set()]
    for _ in range(6):
        w.now += 1_000
        w.d[(0, 0)].get_finished()
        for (_, t), c in w.p.items():
            sent[t] |= c.get_finished()[0]
    return sent


def test_ranks_whose_clocks_differ_past_the_skew_release_by_notice_only_with_one_stamp() -> None:
    """Each rank stamping its own hold, rank 1's stamp is 10 s from the params' (rank 0's): its
    notice reads as another hold's and its blocks wait for the lease (what docs/embedding.md warns
    of). Given one stamp for every rank, both release as soon as the reader notified them."""
    w = skewed_tp2()
    p0, p1, d = w.p[(0, 0)], w.p[(0, 1)], w.d[(0, 0)]
    own = p0.request_finished("own", [1, 2])
    p1.request_finished("own", [1, 2])
    d.load("d-own", [1, 2], own)
    assert run(w) == [{"own"}, set()]
    assert any(r.fault is Fault.REMOTE and r.reason.startswith("notification of another hold")
               for r in p1.core.log.records())
    stamp = w.now
    shared = p0.request_finished("shared", [3, 4], issued_wall_ns=stamp)
    p1.request_finished("shared", [3, 4], issued_wall_ns=stamp)
    assert shared.issued_wall_ns == stamp
    d.load("d-shared", [3, 4], shared)
    assert run(w) == [{"shared"}, {"shared"}]


def test_the_scheduler_s_stamp_reaches_every_worker_s_hold_through_the_metadata() -> None:
    w = skewed_tp2()
    meta = ConnectorMetadata(reqs_to_send={"r": (5, 6)}, hold_issued={"r": w.now - 2 * S})
    for c in w.p.values():
        c.start_load_kv(meta)
    held = [next(r.event for r in c.core.log.records() if isinstance(r.event, BlocksHeld)) for c in w.p.values()]
    assert [h.issued_wall_ns for h in held] == [w.now - 2 * S] * 2


@pytest.mark.parametrize(("call", "field"), [
    ("request_finished", "issued_wall_ns"),
    ("stray", "hold_issued"),
    ("zero", "hold_issued['r'].issued_wall_ns"),
])
def test_a_bad_hold_stamp_is_refused_naming_it_and_nothing_is_held(call: str, field: str) -> None:
    c = skewed_tp2().p[(0, 0)]
    with pytest.raises(InvalidInput) as err:
        if call == "request_finished":
            c.request_finished("r", [1], issued_wall_ns=0)
        else:
            c.start_load_kv(ConnectorMetadata(reqs_to_send={"r": (1,)},
                                              hold_issued={"x": 5} if call == "stray" else {"r": 0}))
    assert err.value.field == field
    c.step()
    assert not c.core.producers and c.request_finished("r", [1]).remote_request_id == "r"


# --- heartbeats name their hold too (found by review, stop 19) ---------------------------------------


def beat(core: Core, t: int, issued: int, extend: int = 3600 * S, rid: str = "px") -> None:
    from pdfsm.events import Heartbeat

    core.apply(ev(Heartbeat, t, request_id=rid, extend_ns=extend, sender="D-0", issued_wall_ns=issued))


@pytest.mark.parametrize("when", ["staged before the hold", "while holding"])
def test_a_late_heartbeat_of_an_earlier_hold_does_not_extend_a_new_hold(when: str) -> None:
    """A late heartbeat of the previous hold of a reused id (staged as early, or arriving while
    the new hold is live) extended the new one by up to an hour past its lease. It names its hold
    now, as a notification does: it is not counted; this hold's own heartbeats still extend it."""
    core = producer(lease_ns=1 * S)
    if when == "staged before the hold":
        beat(core, 10, OLD)
        hold(core, 20, NEW)
    else:
        hold(core, 20, NEW)
        beat(core, 30, OLD)
    assert core.producers["px"].deadline == 20 + 1 * S  # its own lease, not the late promise
    beat(core, 40, NEW, extend=5 * S)
    assert core.producers["px"].deadline == 40 + 5 * S
    beat(core, 50, 0, extend=9 * S)  # a heartbeat that does not say its hold (older consumers) still counts
    assert core.producers["px"].deadline == 50 + 9 * S


@pytest.mark.parametrize("order", ["new-then-old", "old-then-new"])
def test_a_late_heartbeat_staged_beside_the_new_hold_s_own_does_not_extend_it(order: str) -> None:
    """Scenario: before the hold registers, this hold's heartbeat (2 s) and a late one of the
    earlier hold of the id (1 h) are both staged, in either order; then the hold registers.
    Expected: only this hold's promise stands (deadline 10+2 s or 20+2 s, past its 1 s lease).
    Before: the two promises merged under the later issue time, so the hour stayed (found by
    review)."""
    core = producer(lease_ns=1 * S)
    beats = [(NEW, 2 * S), (OLD, 3600 * S)]
    if order == "old-then-new":
        beats.reverse()
    for t, (issued, extend) in zip((10, 20), beats, strict=True):
        beat(core, t, issued, extend=extend)
    if order == "old-then-new":  # staged one lease from the later hold's heartbeat: not the hour
        assert core.producers["px"].deadline == 20 + 1 * S
    hold(core, 30, NEW)
    own = 10 if order == "new-then-old" else 20
    assert core.producers["px"].deadline == own + 2 * S


def test_a_heartbeat_says_its_hold_on_the_wire_and_an_older_one_still_decodes() -> None:
    import msgspec

    from pdfsm.events import Heartbeat
    from pdfsm.wire import HeartbeatMessage

    raw = notify_codec.encode(HeartbeatMessage("px", 5 * S, NEW))
    got = notification_event(raw, sender="D-0", source="notify", t_ns=1)
    assert isinstance(got, Heartbeat) and got.issued_wall_ns == NEW
    older = msgspec.msgpack.encode(("h", "px", 5 * S))  # before the field: tag, request id, extension
    got = notification_event(older, sender="D-0", source="notify", t_ns=1)
    assert isinstance(got, Heartbeat) and got.issued_wall_ns == 0
