"""Params handed to two decode engines: a router retries a request whose first decode engine it
thinks died mid-read (Dynamo PR 13928's migration), and the second engine reads the same hold.

Counted by part index alone, the first engine's part 0 and the second's part 1 completed the
hold, and the producer released blocks the second engine's rank 0 was still reading: it reported
the request received with another request's bytes. Notifications now name their consumer engine
and the producer counts each engine's parts apart (pdfsm/producer.py)."""

from __future__ import annotations

import msgspec
from helpers import ev, make_core

from pdfsm.commands import FinishedSending
from pdfsm.events import BlocksHeld, NotificationReceived, Tick
from pdfsm.fsm import Fault
from pdfsm.producer import S
from pdfsm.testing.explore import hunt
from pdfsm.testing.world import Scenario
from pdfsm.wire import Notification, notification_event, notify_codec

LEASE = 1000


def _released(core) -> list[FinishedSending]:  # type: ignore[no-untyped-def]
    return [c for c in core.take_commands() if isinstance(c, FinishedSending)]


def _note(core, t: int, part: int, of: int, consumer: str) -> None:  # type: ignore[no-untyped-def]
    core.apply(ev(NotificationReceived, t, request_id="r", part=part, of=of, sender=f"{consumer}-{part}",
                  consumer=consumer))


def _two_consumers(core) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.reason for r in core.log.records() if r.fault is Fault.REMOTE]


def test_a_second_engines_parts_do_not_complete_the_firsts() -> None:
    """D's part 0, then E's parts 0 and 1: E is done, D's rank 1 still reads; held until D's part 1."""
    core = make_core(engine_id="P", strict=False, lease_ns=LEASE)
    core.apply(ev(BlocksHeld, 0, request_id="r", block_ids=(7, 8)))
    _note(core, 1, 0, 2, "D")
    _note(core, 2, 0, 2, "E")
    _note(core, 3, 1, 2, "E")
    assert _released(core) == [], "released while the first engine's rank 1 still reads"
    assert core.producers["r"].state is S.HOLDING
    reasons = _two_consumers(core)
    assert len(reasons) == 1 and "second consumer engine, 'E', read this hold after 'D'" in reasons[0]  # once
    _note(core, 4, 1, 2, "D")
    assert [f.expired for f in _released(core)] == [False]


def test_a_dead_first_engine_holds_the_blocks_until_the_lease() -> None:
    """D died after part 0; E reads everything: nothing says D stopped reading, so the blocks stay
    until the lease (the safe side: a held block costs memory, a freed one another request's bytes)."""
    core = make_core(engine_id="P", strict=False, lease_ns=LEASE)
    core.apply(ev(BlocksHeld, 0, request_id="r", block_ids=(7,)))
    _note(core, 1, 0, 2, "D")
    _note(core, 2, 0, 2, "E")
    _note(core, 3, 1, 2, "E")
    core.apply(ev(Tick, LEASE + 1))
    assert [f.expired for f in _released(core)] == [True]


def test_engines_of_different_tp_sizes_count_their_own_parts() -> None:
    """E reads with TP 1 (one part), D with TP 2: each engine's count is its own, no disagreement."""
    core = make_core(engine_id="P", strict=False, lease_ns=LEASE)
    core.apply(ev(BlocksHeld, 0, request_id="r", block_ids=(7,)))
    _note(core, 1, 1, 2, "D")
    _note(core, 2, 0, 1, "E")
    _note(core, 3, 0, 1, "E")  # a duplicate of E's own part: a violation of its own, nothing else
    assert _released(core) == []
    reasons = _two_consumers(core)
    assert len(reasons) == 2 and "duplicate" in reasons[1] and not any("disagree" in r for r in reasons)
    _note(core, 4, 0, 2, "D")
    assert [f.expired for f in _released(core)] == [False]


def test_staged_notifications_of_two_engines_release_at_registration_only_when_both_are_done() -> None:
    core = make_core(engine_id="P", strict=False, lease_ns=LEASE)
    _note(core, 1, 0, 1, "D")
    _note(core, 2, 0, 2, "E")
    core.apply(ev(BlocksHeld, 3, request_id="r", block_ids=(7,)))
    assert _released(core) == [] and core.producers["r"].state is S.HOLDING
    _note(core, 4, 1, 2, "E")
    assert [f.expired for f in _released(core)] == [False]


def test_one_engine_is_counted_as_before() -> None:
    """The common case, and consumers that do not name their engine (older ones: ""), are counted
    by index as before: two parts, one release, no violation."""
    for consumer in ("D", ""):
        core = make_core(engine_id="P", strict=False, lease_ns=LEASE)
        core.apply(ev(BlocksHeld, 0, request_id="r", block_ids=(7,)))
        _note(core, 1, 1, 2, consumer)
        _note(core, 2, 0, 2, consumer)
        assert [f.expired for f in _released(core)] == [False]
        assert _two_consumers(core) == []


def test_the_notification_names_its_consumer_engine_and_older_ones_decode() -> None:
    new = notify_codec.encode(Notification("r", 1, 2, 5, "decode-7"))
    got = notification_event(new, sender="s", source="notify", t_ns=0)
    assert isinstance(got, NotificationReceived) and got.consumer == "decode-7" and got.issued_wall_ns == 5
    old = msgspec.msgpack.encode(["n", "r", 1, 2, 5])  # a consumer from before the field
    got = notification_event(old, sender="s", source="notify", t_ns=0)
    assert isinstance(got, NotificationReceived) and got.consumer == "" and (got.part, got.of) == (1, 2)


def test_the_race_tester_finds_no_release_under_a_live_read_with_a_second_reader() -> None:
    """Decode TP 2 reading producer TP 1 (two parts at one producer rank), and decode engine E's
    notices for the same hold at any point (the world models E's notices, not its reads): every
    interleaving's bytes received by D are the request's. Before the fix the search found D1
    reporting r0 received with block 0 in version 1."""
    for producer_tp, consumer_tp in ((1, 2), (2, 2)):
        scenario = Scenario(requests=1, producer_tp=producer_tp, consumer_tp=consumer_tp,
                            faults=frozenset({"second-reader", "notify-drop"}))
        found = hunt(scenario, max_examples=200)
        assert not found.found, found.message


def test_a_hold_read_by_too_many_engines_stays_bounded_and_waits_for_its_lease() -> None:
    """A peer naming a new consumer engine on every notice (found by review): the engines counted
    apart on one hold are bounded (MAX_READERS); past that the hold is crowded, and only its lease
    releases it, even if every engine seen finished."""
    from pdfsm.producer import MAX_READERS

    core = make_core(engine_id="P", strict=False, lease_ns=LEASE)
    core.apply(ev(BlocksHeld, 0, request_id="r", block_ids=(7,)))
    for i in range(1000):
        _note(core, 1, 0, 1 if i else 2, f"E{i}")  # E0's count is 2: it never completes
    m = core.producers["r"]
    assert m.others is not None and len(m.others) <= MAX_READERS
    _note(core, 2, 1, 2, "E0")  # every engine counted has now finished: still crowded
    assert _released(core) == []
    core.apply(ev(Tick, LEASE + 1))
    assert [f.expired for f in _released(core)] == [True]
