"""The handshake side channel, the notification codec and handshake metadata decoding, found by
review. Each test states the behaviour the requirements (reliability.md, docs/side-channel.md) ask
for, and failed before its fix (but the control, which checks the frames the others build)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import msgspec
import pytest
import structlog
from test_sidechannel import FakeServer

from pdfsm.connector import Connector
from pdfsm.events import BadMessage, CoreConfig, HandshakeReply, NotificationReceived, RankInfo
from pdfsm.sidechannel import (
    MAX_REQUEST_BYTES,
    ErrorCode,
    ErrorReply,
    HandshakeRequest,
    ReplyMessage,
    SideChannelError,
    SideChannelServer,
    check_reply,
    fetch_reply,
    pack_frame,
    request_codec,
    response_codec,
    unpack_frame,
)
from pdfsm.wire import MAX_NOTIFY_BYTES, Notification, WireError, notification_event, notify_codec
from transports.sim import SimHandshaker, SimNetwork, SimTransport

SECRET = b"pdfsm-review11-secret-0123456789"
NONCE_A, NONCE_B = b"A" * 16, b"B" * 16


def reply_for(pp_rank: int) -> HandshakeReply:
    if pp_rank >= 2:
        raise LookupError(f"pp_rank {pp_rank} is not served here")
    return HandshakeReply(engine_id="P", compat_hash="h", tp_size=1, pp_size=2, num_blocks=8,
                          ranks=(RankInfo(pp_rank=pp_rank, tp_rank=0, agent=f"P-{pp_rank}-0"),))


def nested(prefix_map: dict[str, object], depth: int) -> bytes:
    """A msgpack map holding ``prefix_map`` plus one unknown key whose value is ``depth`` nested
    one-element arrays: schema-valid apart from an unknown field, which msgspec skips."""
    body = b"".join(msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in prefix_map.items())
    n = len(prefix_map) + 1
    assert n < 16
    return bytes([0x80 | n]) + body + msgspec.msgpack.encode("zz") + b"\x91" * depth + b"\xc0"


def deep_notification() -> bytes:
    """A valid Notification (array-like: trailing elements are skipped) plus one trailing element
    nested as deep as the size cap allows."""
    base = notify_codec.encode(Notification("p1", 0, 1))
    assert base[0] == 0x97  # fixarray of 7: tag, request id, part, of, issued_wall_ns, consumer, unread
    raw = bytes([0x98]) + base[1:]
    raw += b"\x91" * (MAX_NOTIFY_BYTES - len(raw) - 1) + b"\xc0"
    assert len(raw) == MAX_NOTIFY_BYTES
    return raw


def exchange(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    with SideChannelServer(reply_for, io_timeout=2.0) as s:
        yield s


# --- 1. deeply nested msgpack escapes the codecs as RecursionError --------------------------------
# An unknown value is skipped (forward compatibility), and msgspec skips it recursively under the
# interpreter's recursion guard: nested deeper than that it raises RecursionError, which must become
# the codec's error. Where the guard trips depends on the interpreter (about 1,000 levels on 3.11,
# 1,500 on 3.12.1, more on 3.12.3: a lent GPU machine's Python decoded 5,000), so a value as deep
# as a small message's cap allows is either refused or skipped, and the tests accept exactly those
# two outcomes; a million levels, which the large caps allow, is refused everywhere.

TOO_DEEP = 1_000_000  # past any interpreter's guard: even 3.14's stack-based one on an 8 MiB stack


def test_deeply_nested_notification_is_a_bad_message_not_an_exception() -> None:
    """A notification of at most MAX_NOTIFY_BYTES whose (skipped) trailing element is nested as
    deep as the cap allows is a BadMessage (a recorded remote fault, invariant 8) where msgspec's
    guard trips, and otherwise the notification itself: never an exception out of the decoder."""
    raw = deep_notification()
    out = notification_event(raw, sender="X0", source="notify", t_ns=0)
    plain = notification_event(notify_codec.encode(Notification("p1", 0, 1)), sender="X0", source="notify", t_ns=0)
    assert isinstance(plain, NotificationReceived)
    if isinstance(out, BadMessage):
        assert out.size == len(raw) and "nested too deeply" in out.error
    else:
        assert out == plain


def test_a_forged_nested_notification_does_not_raise_out_of_the_connector() -> None:
    """One forged notification from a peer must never raise out of the scheduler-facing API
    (get_finished): it is recorded as a remote fault and the engine goes on."""
    net = SimNetwork()
    prefill = SimTransport(net, "P0")
    SimTransport(net, "X0")
    conn = Connector(CoreConfig(engine_id="P", compat_hash="h"), prefill, SimHandshaker(net))
    try:
        net.deliver("X0", "P0", deep_notification())
        with structlog.testing.capture_logs():
            assert conn.get_finished() == (set(), set())
    finally:
        conn.shutdown()


def test_deeply_nested_request_gets_a_malformed_error_reply(server: SideChannelServer) -> None:
    """A request frame at MAX_REQUEST_BYTES with an unknown field nested as deep as the cap allows
    is answered: ErrorReply(code="malformed") where msgspec's guard trips, else the reply (the
    field skipped), never a crash of the handler thread (which closes the connection without any
    reply); and the listener serves the next request."""
    prefix = {"type": "handshake", "version": 1, "engine_id": "D", "pp_rank": 0, "nonce": NONCE_A}
    depth = MAX_REQUEST_BYTES - len(nested(prefix, 0))
    body = nested(prefix, depth)
    assert len(body) == MAX_REQUEST_BYTES
    with structlog.testing.capture_logs():
        raw = exchange(server.port, pack_frame(body, secret=None, kind="request"))
    assert raw, "the listener closed the connection without an error reply"
    got = response_codec.decode(unpack_frame(raw, secret=None, kind="reply", cap=1 << 20))
    if isinstance(got, ErrorReply):
        assert got.code == ErrorCode.MALFORMED
    else:
        assert isinstance(got, ReplyMessage) and got.nonce == NONCE_A
    assert server.stats()["crashes"] == 0
    assert fetch_reply("127.0.0.1", server.port, engine_id="D", pp_rank=0).engine_id == "P"


def test_deeply_nested_reply_is_a_side_channel_error() -> None:
    """fetch_reply promises SideChannelError for any bad reply; a reply with an unknown field nested
    a million deep (well under the 16 MiB cap) must be refused as kind "malformed", not escape as
    a RecursionError."""
    def respond(frame: bytes) -> bytes:
        req = request_codec.decode(unpack_frame(frame, secret=None, kind="request", cap=4096))
        body = nested({"type": "reply", "version": 1, "pp_rank": 0, "nonce": req.nonce,
                       "reply": msgspec.msgpack.decode(msgspec.msgpack.encode(reply_for(0)))}, TOO_DEEP)
        return pack_frame(body, secret=None, kind="reply")

    fake = FakeServer(respond)
    try:
        with pytest.raises(SideChannelError) as info:
            fetch_reply("127.0.0.1", fake.port, engine_id="D", pp_rank=0, timeout=3.0)
        assert info.value.kind == "malformed"
    finally:
        fake.close()


def test_nixl_deeply_nested_rank_metadata_is_a_transport_error() -> None:
    """decode_rank_metadata documents TransportError for whatever is wrong with a peer's blob; an
    unknown field nested a million deep (under the 1 MiB cap) escaped as RecursionError."""
    from transports.base import TransportError
    from transports.nixl import MAX_METADATA_BYTES, NixlRankMetadata, RegionInfo, decode_rank_metadata

    good = msgspec.msgpack.encode(NixlRankMetadata(b"agent", (RegionInfo(4096, 64, 10, 0, "DRAM", 0),)))
    assert good[0] == 0x83
    raw = bytes([0x84]) + good[1:] + msgspec.msgpack.encode("zz") + b"\x91" * TOO_DEEP + b"\xc0"
    assert len(raw) <= MAX_METADATA_BYTES
    with pytest.raises(TransportError):
        decode_rank_metadata(raw)


# --- 2. the listener's reply cap --------------------------------------------------------------------


def test_listener_honours_a_reply_cap_above_the_default() -> None:
    """max_reply_bytes is configurable on both sides ("a receiver may set its own"): with 64 MiB
    on the listener and the client, a 20 MiB reply (20 ranks of 1 MiB metadata, within
    check_reply's bounds) must be served. The listener encodes with response_codec, whose cap is
    fixed at MAX_REPLY_BYTES (16 MiB), so it answers internal instead."""
    def big(pp: int) -> HandshakeReply:
        return HandshakeReply(engine_id="P", compat_hash="h", tp_size=20, ranks=tuple(
            RankInfo(pp_rank=pp, tp_rank=t, agent=f"a{t}", metadata=b"x" * (1 << 20)) for t in range(20)))

    with structlog.testing.capture_logs(), SideChannelServer(big, max_reply_bytes=64 << 20) as s:
        got = fetch_reply("127.0.0.1", s.port, engine_id="D", pp_rank=0, max_reply_bytes=64 << 20)
    assert len(got.ranks) == 20


# --- 3. an authentic error reply answers any request -------------------------------------------------


def test_a_recorded_error_reply_is_not_accepted_for_another_request() -> None:
    """The nonce binds a reply to its request so that a recorded authentic reply cannot answer a
    later one ("a reply cannot answer another request"). An ErrorReply carries no nonce: a
    recorded, MAC'd refusal (here no-such-rank for pp_rank 5, nonce A) replayed to a later request
    (pp_rank 0, nonce B) is accepted, and the failure is attributed to the remote engine's refusal.
    It must be refused as replayed, like a ReplyMessage with another nonce."""
    with structlog.testing.capture_logs(), SideChannelServer(reply_for, secret=SECRET) as s:
        body = request_codec.encode(HandshakeRequest(version=1, engine_id="D", pp_rank=5, nonce=NONCE_A))
        recorded = exchange(s.port, pack_frame(body, secret=SECRET, kind="request"))
    first = response_codec.decode(unpack_frame(recorded, secret=SECRET, kind="reply", cap=1 << 20))
    assert isinstance(first, ErrorReply) and first.code == ErrorCode.NO_SUCH_RANK  # authentic, for nonce A
    fake = FakeServer(lambda _frame: recorded)
    try:
        with pytest.raises(SideChannelError) as info:
            fetch_reply("127.0.0.1", fake.port, engine_id="D", pp_rank=0, secret=SECRET, nonce=NONCE_B)
        assert info.value.kind == "replayed", str(info.value)
    finally:
        fake.close()


# --- 4. bounds --------------------------------------------------------------------------------------


def test_check_reply_refuses_a_block_size_of_2_pow_31() -> None:
    """docs/side-channel.md bounds block_size "below 2^31" (it must fit a signed 32-bit int);
    check_reply accepts exactly 2^31."""
    with pytest.raises(WireError, match="block_size"):
        check_reply(HandshakeReply(engine_id="P", compat_hash="h", tp_size=1, block_size=1 << 31))


def test_reply_message_round_trip_sanity() -> None:
    """Control: the helpers above build frames the real codecs accept (keeps the failures honest)."""
    msg = ReplyMessage(version=1, pp_rank=0, nonce=NONCE_A, reply=reply_for(0))
    assert response_codec.decode(response_codec.encode(msg)) == msg
    body = nested({"type": "handshake", "version": 1, "engine_id": "D", "pp_rank": 0, "nonce": NONCE_A}, 3)
    assert request_codec.decode(body) == HandshakeRequest(version=1, engine_id="D", pp_rank=0, nonce=NONCE_A)
    raw = deep_notification()
    shallow = raw[:len(notify_codec.encode(Notification("p1", 0, 1)))] + b"\xc0"  # the trailing element: nil
    ev = notification_event(shallow, sender="x", source="notify", t_ns=0)
    assert isinstance(ev, NotificationReceived) and ev.request_id == "p1"


# --- 5. a bad host escapes fetch_reply, and the handshaker's crash log prints the secret ------------

LONG_LABEL_HOST = "a" * 64 + ".example"  # a DNS label over 63 characters: the idna codec refuses it


def test_an_unusable_host_is_a_side_channel_error() -> None:
    """fetch_reply promises SideChannelError, naming host:port. The host comes from the router's
    kv_transfer_params (any string); one that cannot be encoded for name resolution raises a bare
    UnicodeError out of getaddrinfo instead."""
    with pytest.raises(SideChannelError):
        fetch_reply(LONG_LABEL_HOST, 80, engine_id="D", pp_rank=0, timeout=1.0)


def test_the_hmac_secret_never_reaches_the_log() -> None:
    """No secret in logs (reliability.md). Under the CLI's logging set-up (pdfsm.cli.configure_logging:
    structlog's default processors, printed to stderr) a handshake whose host the router gave as an
    over-long DNS label crashes fetch_reply; the handshaker logs the traceback with _log.exception,
    and structlog's rich traceback shows every frame's locals, fetch_reply's ``secret`` included."""
    import io
    import logging
    import queue
    import time

    from pdfsm.commands import StartHandshake
    from pdfsm.sidechannel import SideChannelHandshaker

    buf = io.StringIO()
    saved = structlog.get_config()
    structlog.reset_defaults()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(buf))
    try:
        inbox: queue.Queue[object] = queue.Queue()
        hs = SideChannelHandshaker("D", secret=SECRET, timeout=1.0)
        hs.bind(inbox.put, time.monotonic_ns)
        try:
            hs.start(StartHandshake(engine_id="P", pp_rank=0, attempt=1, host=LONG_LABEL_HOST, port=80))
            inbox.get(timeout=5)
        finally:
            hs.close()
    finally:
        structlog.configure(**saved)
    out = buf.getvalue()
    assert SECRET.decode() not in out and repr(SECRET) not in out


# --- 6. timeouts that are not positive numbers ----------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_timeouts_are_refused_at_construction(bad: float) -> None:
    """"timeouts must be positive" is checked with ``<= 0``, which NaN passes; NaN (and inf) then
    reach _wait, where math.ceil raises ValueError/OverflowError: every handshake fails as an
    "internal error" and every listener connection that has to wait crashes its handler without a
    reply. A non-finite timeout must be refused when the object is built."""
    with pytest.raises(ValueError):
        SideChannelServer(reply_for, io_timeout=bad)
    from pdfsm.sidechannel import SideChannelHandshaker
    with pytest.raises(ValueError):
        SideChannelHandshaker("D", timeout=bad)


@pytest.mark.parametrize("port", [0, -1, 65536, 2**31])
def test_a_port_out_of_range_is_an_invalid_request(port: int) -> None:
    """docs/side-channel.md: a port out of range is a SideChannelError of kind ``invalid`` (it was
    ``refused`` or ``connection``, depending on what the resolver made of it)."""
    with pytest.raises(SideChannelError) as err:
        fetch_reply("127.0.0.1", port, engine_id="D", pp_rank=0, timeout=1.0)
    assert err.value.kind == "invalid"


# --- found by review (stop 19) ---------------------------------------------------------------------


def test_a_timeout_past_a_day_is_refused_when_built_not_an_overflow_at_poll() -> None:
    """poll() takes at most ~24.8 days: a 30-day timeout passed the finite check and then failed
    every exchange with a bare OverflowError (fetch_reply), a crash (handshaker, listener)."""
    from pdfsm.sidechannel import MAX_TIMEOUT_S, SideChannelHandshaker

    month = 30 * 86_400.0
    with SideChannelServer(lambda pp: HandshakeReply(engine_id="P", compat_hash="h", tp_size=1)) as srv:
        with pytest.raises(ValueError, match="up to 86400"):  # as NaN is: refused before anything is sent
            fetch_reply("127.0.0.1", srv.port, engine_id="D", pp_rank=0, timeout=month)
        assert fetch_reply("127.0.0.1", srv.port, engine_id="D", pp_rank=0, timeout=MAX_TIMEOUT_S).engine_id == "P"
    for build in (lambda: SideChannelHandshaker("D", timeout=month),
                  lambda: SideChannelServer(lambda pp: HandshakeReply(engine_id="P", compat_hash="h", tp_size=1),
                                            io_timeout=month)):
        with pytest.raises(ValueError, match="up to 86400"):
            build()


def test_a_refusal_naming_lone_surrogates_still_fits_its_schema() -> None:
    """The message was cut to 1024 characters and then escaped (six characters per lone
    surrogate): the listener's own refusal broke its schema and reached the client as malformed."""

    def unknown(pp: int) -> HandshakeReply:
        raise LookupError("engine " + "\udcff" * 300 + " unknown")  # an id from non-UTF-8 argv bytes

    with SideChannelServer(unknown, io_timeout=1.0) as srv:
        with pytest.raises(SideChannelError) as err:
            fetch_reply("127.0.0.1", srv.port, engine_id="D", pp_rank=0, timeout=2.0)
        assert err.value.kind == "remote" and "no-such-rank" in str(err.value)


@pytest.mark.parametrize(("engine_id", "pp_rank"), [("", 0), ("D", 5000), ("D", -1), ("x" * 300, 0)])
def test_a_request_outside_its_schema_is_invalid_here_not_blamed_on_the_listener(engine_id: str,
                                                                                  pp_rank: int) -> None:
    """msgspec checks a schema's bounds when decoding only: such a request cost a round trip, a
    warning on the listener, and came back as the listener's refusal (kind ``remote``)."""
    with SideChannelServer(lambda pp: HandshakeReply(engine_id="P", compat_hash="h", tp_size=1)) as srv:
        with pytest.raises(SideChannelError) as err:
            fetch_reply("127.0.0.1", srv.port, engine_id=engine_id, pp_rank=pp_rank, timeout=2.0)
        assert err.value.kind == "invalid" and not srv.stats()["refused"]
