"""The handshake side channel over real loopback TCP: round trip, core integration, HMAC and replay,
timeouts, refusals, and a Hypothesis fuzz of the listener."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import structlog
from helpers import eventually
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfsm.commands import HandOff, StartHandshake
from pdfsm.connector import Connector
from pdfsm.core import Core
from pdfsm.engine import EngineState
from pdfsm.errors import CompatibilityMismatch, EngineIdMismatch
from pdfsm.events import CoreConfig, Event, HandshakeDone, HandshakeFailed, HandshakeReply, RankInfo, ReadRequested
from pdfsm.sidechannel import (
    FLAG_MAC,
    HEADER,
    MAC_BYTES,
    MAGIC,
    MAX_REQUEST_BYTES,
    ErrorCode,
    ErrorReply,
    HandshakeRequest,
    ReplyMessage,
    SideChannelError,
    SideChannelHandshaker,
    SideChannelServer,
    check_reply,
    fetch_reply,
    pack_frame,
    request_codec,
    response_codec,
    unpack_frame,
)
from pdfsm.wire import MAX_ID_CHARS, WireError
from transports.sim import SimHandshaker, SimNetwork, SimTransport, pattern

SECRET = b"pdfsm-test-secret-0123456789abcd"
OTHER = b"pdfsm-other-secret-0123456789abc"
NONCE_A, NONCE_B = b"A" * 16, b"B" * 16


def make_reply(pp_rank: int, *, engine_id: str = "P", compat: str = "h", tp: int = 1) -> HandshakeReply:
    return HandshakeReply(
        engine_id=engine_id, compat_hash=compat, tp_size=tp, pp_size=2, block_size=16, num_blocks=64,
        ranks=tuple(RankInfo(pp_rank=pp_rank, tp_rank=t, agent=f"{engine_id}-{pp_rank}-{t}",
                             metadata=bytes([t, pp_rank]) * 300, incarnation=f"inc-{pp_rank}-{t}",
                             started_wall_ns=1_790_000_000_000_000_000 + t) for t in range(tp)),
    )


def reply_for(pp_rank: int) -> HandshakeReply:
    if pp_rank >= 2:
        raise LookupError(f"pp_rank {pp_rank} is not served here")
    return make_reply(pp_rank, tp=2)


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    with SideChannelServer(reply_for) as s:
        yield s


@pytest.fixture
def secret_server() -> Iterator[SideChannelServer]:
    with SideChannelServer(reply_for, secret=SECRET) as s:
        yield s


class Inbox:
    """A bound submit: collects events from the handshaker's threads."""

    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()

    def __call__(self, ev: Event) -> None:
        self.events.put(ev)

    def get(self, timeout: float = 10.0) -> Event:
        return self.events.get(timeout=timeout)

    def empty_after(self, seconds: float) -> bool:
        time.sleep(seconds)
        return self.events.empty()




def handshaker(**kw: object) -> tuple[SideChannelHandshaker, Inbox]:
    hs = SideChannelHandshaker("D", **kw)  # type: ignore[arg-type]
    inbox = Inbox()
    hs.bind(inbox, time.monotonic_ns)
    return hs, inbox


def cmd(port: int, *, pp_rank: int = 0, attempt: int = 1, engine_id: str = "P") -> StartHandshake:
    return StartHandshake(engine_id=engine_id, pp_rank=pp_rank, attempt=attempt, host="127.0.0.1", port=port)


def one_outcome(hs: SideChannelHandshaker, inbox: Inbox, c: StartHandshake) -> HandshakeDone | HandshakeFailed:
    hs.start(c)
    ev = inbox.get()
    assert isinstance(ev, HandshakeDone | HandshakeFailed)
    assert (ev.engine_id, ev.pp_rank, ev.attempt, ev.source) == (c.engine_id, c.pp_rank, c.attempt, "handshake")
    return ev


def exchange(port: int, data: bytes, *, half_close: bool = True, timeout: float = 5.0) -> bytes:
    """Send raw bytes, then read whatever comes back until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def answer(raw: bytes, *, secret: bytes | None = None) -> ReplyMessage | ErrorReply:
    return response_codec.decode(unpack_frame(raw, secret=secret, kind="reply", cap=1 << 24))


def request_frame(*, version: int = 1, pp_rank: int = 0, nonce: bytes | None = NONCE_A,
                  secret: bytes | None = None) -> bytes:
    body = request_codec.encode(HandshakeRequest(version=version, engine_id="D", pp_rank=pp_rank, nonce=nonce))
    return pack_frame(body, secret=secret, kind="request")


class FakeServer:
    """A listener that answers each connection with ``respond(request frame bytes)`` (or never)."""

    def __init__(self, respond: Callable[[bytes], bytes] | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.respond = respond
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.respond is None:
                continue  # accept and never answer
            header = conn.recv(HEADER.size, socket.MSG_WAITALL)
            _, flags, _, length = HEADER.unpack(header)
            rest = conn.recv(length + (MAC_BYTES if flags & FLAG_MAC else 0), socket.MSG_WAITALL)
            conn.sendall(self.respond(header + rest))
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.conns:
            c.close()


# --- binding, round trip ------------------------------------------------------------------------


def test_listener_binds_loopback_by_default(server: SideChannelServer) -> None:
    host, port = server.address
    assert host == "127.0.0.1" and port > 0 and port == server.port


def test_empty_host_is_refused_rather_than_binding_every_interface() -> None:
    with pytest.raises(ValueError, match="every interface"):
        SideChannelServer(reply_for, host="")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "0", "::0", "0x0", "::ffff:0.0.0.0"])
def test_a_wildcard_host_is_refused_rather_than_binding_every_interface(host: str) -> None:
    with pytest.raises(ValueError, match="every interface"):
        SideChannelServer(reply_for, host=host)


def test_real_handshake_round_trips_exactly(server: SideChannelServer) -> None:
    for pp in (0, 1):
        got = fetch_reply("127.0.0.1", server.port, engine_id="D", pp_rank=pp)
        assert got == reply_for(pp)
        assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(reply_for(pp))
    hs, inbox = handshaker()
    try:
        ev = one_outcome(hs, inbox, cmd(server.port, pp_rank=1, attempt=7))
        assert isinstance(ev, HandshakeDone) and ev.reply == reply_for(1)
    finally:
        hs.close()
    assert eventually(lambda: server.stats()["served"] == 3)


def test_every_attempt_gets_exactly_one_outcome(server: SideChannelServer) -> None:
    """Superseded attempts included (tests/test_sidechannel_queueing.py)."""
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    hs, inbox = handshaker(max_workers=3)
    try:
        # An engine each: a newer attempt of the same engine and stage would supersede a waiting one.
        cmds = [cmd(server.port if i % 2 else dead_port, attempt=i, pp_rank=i % 3, engine_id=f"P{i}")
                for i in range(12)]
        for c in cmds:
            hs.start(c)
        events = [inbox.get() for _ in cmds]
        assert inbox.empty_after(0.2)
    finally:
        hs.close()
    by_attempt = {e.attempt: e for e in events if isinstance(e, HandshakeDone | HandshakeFailed)}
    assert sorted(by_attempt) == list(range(12))
    for i, e in by_attempt.items():
        ok = i % 2 == 1 and i % 3 < 2
        assert isinstance(e, HandshakeDone) == ok, e
    assert "no-such-rank" in next(e.error for e in by_attempt.values()  # pp_rank 2 is not served
                                  if isinstance(e, HandshakeFailed) and e.pp_rank == 2 and e.attempt % 2)


# --- the core -----------------------------------------------------------------------------------


def drive_core(port: int) -> tuple[Core, HandshakeDone | HandshakeFailed]:
    core = Core(CoreConfig(engine_id="D", compat_hash="h"), t_ns=time.monotonic_ns())
    core.apply(ReadRequested(source="scheduler", t_ns=time.monotonic_ns(), request_id="r1",
                             remote_request_id="p1", engine_id="P", host="127.0.0.1", port=port,
                             local_blocks=(1,), remote_blocks=(2,)))
    starts = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert starts == [StartHandshake(engine_id="P", pp_rank=0, attempt=1, host="127.0.0.1", port=port)]
    assert core.engines[("P", 0)].state is EngineState.HANDSHAKING
    hs, inbox = handshaker()
    try:
        ev = one_outcome(hs, inbox, starts[0])
    finally:
        hs.close()
    core.apply(ev)
    return core, ev


def test_core_reaches_connecting_over_tcp() -> None:
    with SideChannelServer(make_reply) as s:
        core, ev = drive_core(s.port)
    assert isinstance(ev, HandshakeDone)
    assert core.engines[("P", 0)].state is EngineState.CONNECTING


def test_core_fails_on_engine_id_mismatch_naming_both_ids() -> None:
    # The handshaker passes the wrong id through; the engine machine refuses it, in its order.
    with SideChannelServer(lambda pp: make_reply(pp, engine_id="X")) as s:
        core, ev = drive_core(s.port)
    assert isinstance(ev, HandshakeDone) and ev.reply.engine_id == "X"
    eng = core.engines[("P", 0)]
    assert eng.state is EngineState.FAILED
    assert isinstance(eng.error, EngineIdMismatch)
    assert "'P'" in str(eng.error) and "'X'" in str(eng.error)
    assert "'X'" in core.consumers["r1"].error


def test_compatibility_is_checked_before_the_engine_id() -> None:
    """A reply wrong on both counts fails on the compatibility hash (the documented order): a
    different model is the real problem, whatever the engine calls itself."""
    with SideChannelServer(lambda pp: make_reply(pp, engine_id="X", compat="other-model")) as s:
        core, _ = drive_core(s.port)
    eng = core.engines[("P", 0)]
    assert eng.state is EngineState.FAILED and isinstance(eng.error, CompatibilityMismatch)
    assert "other-model" in str(eng.error)


def test_core_fails_when_the_handshake_fails() -> None:
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    core, ev = drive_core(port)
    assert isinstance(ev, HandshakeFailed) and "refused" in ev.error
    assert core.engines[("P", 0)].state is EngineState.FAILED


def test_two_connectors_transfer_over_a_real_side_channel() -> None:
    """Prefill and decode connectors: the handshake crosses loopback TCP (with HMAC), the blocks and
    notifications the simulated transport."""
    net = SimNetwork()
    p_xfer, d_xfer = SimTransport(net, "P0"), SimTransport(net, "D0")
    p_xfer.fill([2, 3])
    with SideChannelServer(lambda pp: HandshakeReply(engine_id="P", compat_hash="h", tp_size=1,
                                                      num_blocks=64, ranks=(p_xfer.rank_info(),)),
                           secret=SECRET) as server:
        prefill = Connector(CoreConfig(engine_id="P", compat_hash="h"), p_xfer, SimHandshaker(net),
                            port=server.port)
        decode = Connector(CoreConfig(engine_id="D", compat_hash="h"), d_xfer,
                           SideChannelHandshaker("D", secret=SECRET))
        try:
            params = prefill.request_finished("p1", [2, 3])
            assert (params.remote_host, params.remote_port) == ("127.0.0.1", server.port)
            decode.load("r1", [1, 5], params)
            received: set[str] = set()
            sent: set[str] = set()
            failed: list[HandOff] = []
            deadline = time.monotonic() + 10
            while not (received and sent) and time.monotonic() < deadline:
                received |= decode.get_finished()[1]
                failed += decode.last.failed
                sent |= prefill.get_finished()[0]
                time.sleep(0.005)
            assert received == {"r1"} and sent == {"p1"} and not failed
            assert d_xfer.block(1) == pattern("P0", 2, 64) and d_xfer.block(5) == pattern("P0", 3, 64)
        finally:
            decode.shutdown()
            prefill.shutdown()
        assert server.stats()["served"] == 1


# --- HMAC and replay --------------------------------------------------------------------------


def test_hmac_right_secret_works(secret_server: SideChannelServer) -> None:
    hs, inbox = handshaker(secret=SECRET)
    try:
        ev = one_outcome(hs, inbox, cmd(secret_server.port))
    finally:
        hs.close()
    assert isinstance(ev, HandshakeDone) and ev.reply == reply_for(0)


@pytest.mark.parametrize(("server_secret", "client_secret", "refused_as"), [
    (SECRET, OTHER, "MAC that does not verify"),  # wrong secret
    (SECRET, None, "carries a MAC but no secret is configured here"),  # missing MAC: server refuses
    (None, SECRET, "carries no MAC but a secret is configured here"),  # secret on the client only
])
def test_hmac_fails_closed(server_secret: bytes | None, client_secret: bytes | None, refused_as: str) -> None:
    with SideChannelServer(reply_for, secret=server_secret) as s:
        hs, inbox = handshaker(secret=client_secret)
        try:
            ev = one_outcome(hs, inbox, cmd(s.port))
        finally:
            hs.close()
        assert isinstance(ev, HandshakeFailed)
        assert "unauthenticated" in ev.error and refused_as in ev.error
        assert eventually(lambda: s.stats()["refused"] == {"unauthenticated": 1}) and s.stats()["served"] == 0


def test_server_refuses_unmacd_and_tampered_requests(secret_server: SideChannelServer) -> None:
    bare = answer(exchange(secret_server.port, request_frame()), secret=SECRET)
    assert isinstance(bare, ErrorReply) and bare.code == ErrorCode.UNAUTHENTICATED
    assert "carries no MAC" in bare.message
    good = bytearray(request_frame(secret=SECRET))
    good[HEADER.size + 3] ^= 0x01  # one bit of the body
    tampered = answer(exchange(secret_server.port, bytes(good)), secret=SECRET)
    assert isinstance(tampered, ErrorReply) and "does not verify" in tampered.message
    ok = answer(exchange(secret_server.port, request_frame(secret=SECRET)), secret=SECRET)
    assert isinstance(ok, ReplyMessage) and ok.nonce == NONCE_A


def test_replayed_reply_for_another_nonce_is_refused(secret_server: SideChannelServer) -> None:
    recorded = exchange(secret_server.port, request_frame(secret=SECRET, nonce=NONCE_A))
    assert isinstance(answer(recorded, secret=SECRET), ReplyMessage)  # authentic, for nonce A
    fake = FakeServer(lambda _request: recorded)  # replays it to every later request
    try:
        with pytest.raises(SideChannelError, match="nonce mismatch") as info:
            fetch_reply("127.0.0.1", fake.port, engine_id="D", pp_rank=0, secret=SECRET, nonce=NONCE_B)
        assert info.value.kind == "replayed"
        hs, inbox = handshaker(secret=SECRET)
        try:
            ev = one_outcome(hs, inbox, cmd(fake.port))
        finally:
            hs.close()
        assert isinstance(ev, HandshakeFailed) and "nonce mismatch" in ev.error
    finally:
        fake.close()


def test_a_reply_reflected_back_as_a_request_is_refused(secret_server: SideChannelServer) -> None:
    recorded = exchange(secret_server.port, request_frame(secret=SECRET))
    back = answer(exchange(secret_server.port, recorded), secret=SECRET)  # MAC labels differ by direction
    assert isinstance(back, ErrorReply) and back.code == ErrorCode.UNAUTHENTICATED


def test_reply_for_another_pp_rank_is_refused() -> None:
    def wrong_rank(frame: bytes) -> bytes:
        req = request_codec.decode(unpack_frame(frame, secret=None, kind="request", cap=MAX_REQUEST_BYTES))
        msg = ReplyMessage(version=1, pp_rank=req.pp_rank + 1, nonce=req.nonce, reply=make_reply(req.pp_rank + 1))
        return pack_frame(response_codec.encode(msg), secret=None, kind="reply")

    fake = FakeServer(wrong_rank)
    try:
        with pytest.raises(SideChannelError, match="asked for pp_rank 0, the reply is for pp_rank 1"):
            fetch_reply("127.0.0.1", fake.port, engine_id="D", pp_rank=0)
    finally:
        fake.close()


def test_short_secrets_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SideChannelHandshaker("D", secret=b"short")


# --- timeouts, refusals, concurrency ----------------------------------------------------------


def test_silent_server_fails_within_the_deadline() -> None:
    fake = FakeServer(None)  # accepts, never answers
    hs, inbox = handshaker(timeout=0.5)
    try:
        t0 = time.monotonic()
        hs.start(cmd(fake.port))
        assert time.monotonic() - t0 < 0.45  # start never blocks (the deadline is 0.5 s)
        ev = inbox.get()
        elapsed = time.monotonic() - t0
    finally:
        hs.close()
        fake.close()
    assert isinstance(ev, HandshakeFailed) and "no answer within the deadline" in ev.error
    assert 0.4 <= elapsed < 2.0


def test_connection_refused_fails_quickly() -> None:
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    hs, inbox = handshaker(timeout=30.0)
    try:
        t0 = time.monotonic()
        ev = one_outcome(hs, inbox, cmd(port))
        assert time.monotonic() - t0 < 1.0
    finally:
        hs.close()
    assert isinstance(ev, HandshakeFailed) and "connection refused" in ev.error


def test_close_abandons_attempts_promptly() -> None:
    fake = FakeServer(None)
    hs, inbox = handshaker(timeout=30.0, max_workers=1)
    try:
        for attempt in (1, 2, 3):  # one running, two queued (engines of their own: none supersedes another)
            hs.start(cmd(fake.port, attempt=attempt, engine_id=f"P{attempt}"))
        time.sleep(0.1)
        t0 = time.monotonic()
        hs.close()
        assert time.monotonic() - t0 < 1.0
        assert inbox.empty_after(0.2)  # abandoned attempts submit nothing
        hs.start(cmd(fake.port, attempt=4))  # after close: refused at once, still one outcome
        ev = inbox.get(timeout=1)
        assert isinstance(ev, HandshakeFailed) and ev.attempt == 4 and "closed" in ev.error
    finally:
        fake.close()


def test_silent_and_slow_clients_cannot_hold_the_listener() -> None:
    with SideChannelServer(reply_for, io_timeout=0.3) as s:
        silent = socket.create_connection(("127.0.0.1", s.port))
        trickle = socket.create_connection(("127.0.0.1", s.port))
        try:
            frame = request_frame()
            assert fetch_reply("127.0.0.1", s.port, engine_id="D", pp_rank=0) == reply_for(0)  # served meanwhile
            for i in range(8):  # one byte every 60 ms: past the 0.3 s deadline of the whole request
                try:
                    trickle.sendall(frame[i:i + 1])
                except OSError:
                    break
                time.sleep(0.06)
            silent.settimeout(3)
            got = answer(silent.recv(65536))
            assert isinstance(got, ErrorReply) and got.code == ErrorCode.TIMEOUT
        finally:
            silent.close()
            trickle.close()
        assert eventually(lambda: s.stats()["refused"].get("timeout") == 2)
        assert s.alive


def test_busy_listener_answers_busy() -> None:
    with SideChannelServer(reply_for, max_connections=1, io_timeout=2.0) as s:
        holder = socket.create_connection(("127.0.0.1", s.port))
        try:
            assert eventually(lambda: s.stats()["active"] == 1)
            with pytest.raises(SideChannelError, match="busy"):
                fetch_reply("127.0.0.1", s.port, engine_id="D", pp_rank=0)
        finally:
            holder.close()
        assert eventually(lambda: s.stats()["active"] == 0)
        assert fetch_reply("127.0.0.1", s.port, engine_id="D", pp_rank=0) == reply_for(0)


@pytest.mark.parametrize(("data", "code"), [
    (HEADER.pack(MAGIC, 0, 0, 1 << 31), ErrorCode.TOO_LARGE),  # refused before any body is read
    (b"GET / HTTP/1.1\r\n\r\n", ErrorCode.MALFORMED),
    (HEADER.pack(MAGIC, 0x8000, 0, 0), ErrorCode.MALFORMED),
    (request_frame()[:-3], ErrorCode.TRUNCATED),
    (pack_frame(b"\xc1\xff", secret=None, kind="request"), ErrorCode.MALFORMED),
    (pack_frame(response_codec.encode(ErrorReply(code="x")), secret=None, kind="request"), ErrorCode.WRONG_TYPE),
    (request_frame(version=2), ErrorCode.UNSUPPORTED_VERSION),
    (pack_frame(msgspec.msgpack.encode({"type": "handshake", "version": 1, "engine_id": "D" * (MAX_ID_CHARS + 1),
                                        "pp_rank": 0}), secret=None, kind="request"), ErrorCode.MALFORMED),
    (pack_frame(msgspec.msgpack.encode({"type": "handshake", "version": 1, "engine_id": "D", "pp_rank": -1}),
                secret=None, kind="request"), ErrorCode.MALFORMED),
    (request_frame(pp_rank=5), ErrorCode.NO_SUCH_RANK),
    (request_frame(secret=SECRET), ErrorCode.UNAUTHENTICATED),  # a MAC the server cannot check
])
def test_bad_requests_get_an_error_reply_and_the_listener_keeps_serving(
        server: SideChannelServer, data: bytes, code: str) -> None:
    with structlog.testing.capture_logs() as logs:
        got = answer(exchange(server.port, data))
        assert isinstance(got, ErrorReply) and got.code == code, got
        assert fetch_reply("127.0.0.1", server.port, engine_id="D", pp_rank=0) == reply_for(0)
    refusals = [e for e in logs if e["event"] == "side channel refused a request"]
    assert [e["code"] for e in refusals] == [code]  # logged once
    assert eventually(lambda: server.stats()["refused"] == {code: 1}) and server.alive


def test_oversized_reply_is_refused_by_the_client_cap(server: SideChannelServer) -> None:
    with pytest.raises(SideChannelError, match="exceeds the cap of 256"):
        fetch_reply("127.0.0.1", server.port, engine_id="D", pp_rank=0, max_reply_bytes=256)


def test_out_of_bounds_or_failing_replies_become_internal_errors() -> None:
    def bad(pp: int) -> HandshakeReply:
        if pp == 0:
            return make_reply(0, engine_id="E" * (MAX_ID_CHARS + 1))
        raise RuntimeError("secret detail")

    with SideChannelServer(bad) as s:
        for pp, expected in ((0, r"len\(engine_id\) = 257, outside 0..256"), (1, "reply_for raised RuntimeError")):
            with pytest.raises(SideChannelError, match=expected) as info:
                fetch_reply("127.0.0.1", s.port, engine_id="D", pp_rank=pp)
            assert "secret detail" not in str(info.value)
        assert eventually(lambda: s.stats()["refused"] == {"internal": 2}) and s.stats()["crashes"] == 0


def test_check_reply_bounds() -> None:
    check_reply(reply_for(0))
    with pytest.raises(WireError, match=r"len\(ranks\[0\]\.metadata\) = 2097152, outside"):
        check_reply(HandshakeReply(engine_id="P", compat_hash="h", tp_size=1,
                                   ranks=(RankInfo(pp_rank=0, tp_rank=0, agent="a", metadata=b"x" * (2 << 20)),)))
    with pytest.raises(WireError, match="tp_size"):
        check_reply(HandshakeReply(engine_id="P", compat_hash="h", tp_size=-1))
    with pytest.raises(WireError, match=r"ranks\[0\]\.started_wall_ns = -1, outside"):
        check_reply(HandshakeReply(engine_id="P", compat_hash="h", tp_size=1,
                                   ranks=(RankInfo(pp_rank=0, tp_rank=0, agent="a", started_wall_ns=-1),)))


# --- fuzzing the listener -------------------------------------------------------------------------

VALID = request_frame()
VALID_MAC = request_frame(secret=SECRET)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
request_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["handshake", "reply", "error", "x"])},
    optional={"version": msgpack_values | st.integers(0, 3), "engine_id": msgpack_values | st.text(max_size=300),
              "pp_rank": msgpack_values | st.integers(-2, 2000), "nonce": msgpack_values | st.binary(max_size=80)},
)
frames = st.one_of(
    st.binary(max_size=64),  # random bytes
    st.binary(max_size=MAX_REQUEST_BYTES + 16).map(lambda b: pack_frame(b, secret=None, kind="request")),
    request_like.map(lambda d: pack_frame(msgspec.msgpack.encode(d), secret=None, kind="request")),
    msgpack_values.map(lambda v: pack_frame(msgspec.msgpack.encode(v), secret=None, kind="request")),
    st.builds(lambda m, f, r, n, tail: HEADER.pack(m, f, r, n) + tail,  # arbitrary headers
              st.sampled_from([MAGIC, b"PDSX"]) | st.binary(min_size=4, max_size=4), st.integers(0, 0xFFFF),
              st.sampled_from([0, 1, 0xFFFF]), st.integers(0, 2**32 - 1), st.binary(max_size=32)),
    st.integers(0, len(VALID) - 1).map(lambda n: VALID[:n]),  # truncated
    st.tuples(st.integers(0, len(VALID_MAC) - 1), st.integers(1, 255)).map(  # a bit flipped: forged
        lambda t: VALID_MAC[:t[0]] + bytes([VALID_MAC[t[0]] ^ t[1]]) + VALID_MAC[t[0] + 1:]),
    st.binary(min_size=MAC_BYTES, max_size=MAC_BYTES).map(  # a valid body with a made-up MAC
        lambda mac: HEADER.pack(MAGIC, FLAG_MAC, 0, len(VALID) - HEADER.size) + VALID[HEADER.size:] + mac),
    st.builds(lambda a, b: a + b, st.sampled_from([VALID, VALID_MAC]), st.binary(max_size=64)),  # trailing junk
)


@pytest.fixture(scope="module")
def fuzz_servers() -> Iterator[dict[str, SideChannelServer]]:
    plain = SideChannelServer(reply_for, io_timeout=2.0).start()
    keyed = SideChannelServer(reply_for, io_timeout=2.0, secret=SECRET).start()
    yield {"plain": plain, "keyed": keyed}
    plain.close()
    keyed.close()


@settings(derandomize=True, max_examples=250, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=frames, which=st.sampled_from(["plain", "keyed"]))
def test_fuzz_listener_never_crashes(fuzz_servers: dict[str, SideChannelServer], data: bytes, which: str) -> None:
    s = fuzz_servers[which]
    secret = SECRET if which == "keyed" else None
    with structlog.testing.capture_logs():
        raw = exchange(s.port, data)
    if raw:
        got = answer(raw, secret=secret)  # whatever it says is one authentic, well-formed frame
        if isinstance(got, ReplyMessage):
            assert got.reply == reply_for(got.pp_rank)
    assert s.alive and s.stats()["crashes"] == 0
    assert fetch_reply("127.0.0.1", s.port, engine_id="D", pp_rank=1, secret=secret) == reply_for(1)


def test_fuzzed_listeners_still_serve(fuzz_servers: dict[str, SideChannelServer]) -> None:
    assert fetch_reply("127.0.0.1", fuzz_servers["plain"].port, engine_id="D", pp_rank=1) == reply_for(1)
    assert fetch_reply("127.0.0.1", fuzz_servers["keyed"].port, engine_id="D", pp_rank=0,
                       secret=SECRET) == reply_for(0)
    for s in fuzz_servers.values():
        assert s.alive and s.stats()["crashes"] == 0


def test_a_handshake_reaches_a_listener_on_any_of_the_names_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name resolving to several addresses (localhost to ::1 then 127.0.0.1 on dual-stack hosts,
    a DNS name with AAAA and A records) whose listener serves one of them: the client tried only
    the first, and the handshake was refused (SGLang PR 29459, Dynamo PR 5443; found by review).
    Every address is tried within the one connect budget."""
    with SideChannelServer(make_reply, host="127.0.0.1") as srv:
        real = socket.getaddrinfo

        def dual_stack(host: str, port: int, *a: Any, **kw: Any) -> list[Any]:
            if host == "dualstack.test":
                return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
            return real(host, port, *a, **kw)

        monkeypatch.setattr(socket, "getaddrinfo", dual_stack)
        assert fetch_reply("dualstack.test", srv.port, engine_id="P", pp_rank=0, timeout=2).engine_id == "P"
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **kw: [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 1))])  # nothing listens there
        with pytest.raises(SideChannelError, match="refused"):
            fetch_reply("dualstack.test", srv.port, engine_id="P", pp_rank=0, timeout=2)
