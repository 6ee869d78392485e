"""Notification codec: schema, size cap before decoding, typed errors, events for bad bytes."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdfsm.events import BadMessage, Heartbeat, NotificationReceived
from pdfsm.wire import MAX_NOTIFY_BYTES, HeartbeatMessage, Notification, WireError, notification_event, notify_codec


def test_round_trip() -> None:
    for msg in (Notification("p-1", 1, 2), HeartbeatMessage("p-1", 5_000)):
        assert notify_codec.decode(notify_codec.encode(msg)) == msg


def test_oversized_is_refused_before_decoding() -> None:
    with pytest.raises(WireError, match="exceeds the cap"):
        notify_codec.decode(b"\x00" * (MAX_NOTIFY_BYTES + 1))


def test_schema_is_enforced() -> None:
    with pytest.raises(WireError):
        notify_codec.decode(msgspec.msgpack.encode(["n", "", 0, 1]))  # empty id
    with pytest.raises(WireError):
        notify_codec.decode(msgspec.msgpack.encode(["h", "p", -5]))  # negative extension
    with pytest.raises(WireError):
        notify_codec.decode(b"\xc1")  # never-used msgpack byte


def test_part_counts_past_the_largest_layout_are_refused() -> None:
    """A part's index and count are bounded by MAX_RANKS (1024), not 2**16: a 25-byte notice with
    part 65535 of 65536 made the producer keep a 65536-bit part mask for a lease, for each of
    max_staged unknown ids and each consumer engine: 280 MiB from a flood of 25-byte messages
    (found by a helper's audit)."""
    from pdfsm.topology import MAX_RANKS

    assert isinstance(notification_event(notify_codec.encode(Notification("p", MAX_RANKS - 1, MAX_RANKS)),
                                         sender="a", source="notify", t_ns=1), NotificationReceived)
    for part, of in ((65535, 65536), (0, MAX_RANKS + 1), (MAX_RANKS + 1, 2)):
        raw = msgspec.msgpack.encode(["n", "p", part, of])
        assert isinstance(notification_event(raw, sender="a", source="notify", t_ns=1), BadMessage), (part, of)


def test_events_from_raw_bytes() -> None:
    ok = notification_event(notify_codec.encode(Notification("p", 0, 1)), sender="a", source="notify", t_ns=1)
    assert isinstance(ok, NotificationReceived) and ok.request_id == "p" and ok.sender == "a"
    hb = notification_event(notify_codec.encode(HeartbeatMessage("p", 9)), sender="a", source="notify", t_ns=1)
    assert isinstance(hb, Heartbeat) and hb.extend_ns == 9
    bad = notification_event(b"p-1:2", sender="a", source="notify", t_ns=1)  # vLLM's old text format
    assert isinstance(bad, BadMessage) and bad.size == 5


@given(st.binary(max_size=2 * MAX_NOTIFY_BYTES))
def test_any_bytes_become_an_event_never_an_exception(raw: bytes) -> None:
    out = notification_event(raw, sender="x", source="notify", t_ns=0)
    assert isinstance(out, (NotificationReceived, Heartbeat, BadMessage))
