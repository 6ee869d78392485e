"""A notification names one hold of a request id, by its params' issue time (docs/decisions.md,
"A notification names the hold it read"): late notices of an earlier hold under a reused id do
not count toward the new one, and every rank's early notices for the hold still do."""

from __future__ import annotations

from typing import Any

from helpers import ev, make_core

from pdfsm.commands import FinishedSending
from pdfsm.core import Core
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
