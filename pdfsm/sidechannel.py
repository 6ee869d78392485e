"""The handshake side channel: a small TCP request/reply protocol between engines.

A decode engine asks a prefill engine's listener for the handshake metadata of
one PP rank (every TP rank's :class:`~pdfsm.events.RankInfo`, keyed by
(pp_rank, tp_rank)) and reports exactly one :class:`~pdfsm.events.HandshakeDone`
or :class:`~pdfsm.events.HandshakeFailed` per attempt to its core. The engine
machine validates the reply (compatibility hash, engine id, layout, PP support,
in that order); this module only enforces what the wire guarantees: schema,
sizes, authentication, and that the reply answers the request sent (nonce and
pp_rank). Frame, both directions (docs/side-channel.md)::

    "PDSC" | flags u16 | reserved u16 (0) | body length u32 | msgpack body | [HMAC-SHA256, 32 bytes]
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal

import msgspec
import structlog

from pdfsm.commands import StartHandshake
from pdfsm.errors import PdfsmError
from pdfsm.events import HandshakeDone, HandshakeFailed, HandshakeReply, Source
from pdfsm.topology import MAX_KV_HEADS, MAX_RANKS
from pdfsm.wire import MAX_BLOCK_SIZE, MAX_HASH_CHARS, MAX_ID_CHARS, Codec, WireError, every_interface
from transports.base import Clock, Submit

__all__ = [
    "FLAG_MAC", "HEADER", "MAC_BYTES", "MAGIC", "MAX_HASH_CHARS", "MAX_MESSAGE_CHARS", "MAX_METADATA_BYTES",
    "MAX_RANKS", "MAX_REPLY_BYTES", "MAX_REQUEST_BYTES", "MAX_TIMEOUT_S", "MIN_SECRET_BYTES",
    "PROTOCOL_VERSION",
    "ErrorCode", "ErrorReply", "HandshakeRequest", "ReplyMessage", "Response", "SideChannelError",
    "SideChannelHandshaker", "SideChannelServer",
    "check_reply", "fetch_reply", "pack_frame", "request_codec", "response_codec", "unpack_frame",
]

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"PDSC"
HEADER: Final = struct.Struct("!4sHHI")  # magic, flags, reserved, body length: 12 bytes
FLAG_MAC: Final = 0x0001
MAC_BYTES: Final = 32
MAX_REQUEST_BYTES: Final = 4096  # a request is an id, two small ints and a nonce
MAX_REPLY_BYTES: Final = 16 << 20  # default cap of a reply body; a receiver may set its own
MAX_METADATA_BYTES: Final = 1 << 20  # one rank's transport metadata
MAX_MESSAGE_CHARS: Final = 1024
MIN_SECRET_BYTES: Final = 16
MAX_TIMEOUT_S: Final = 86_400.0  # a day; poll() takes at most INT_MAX ms (~24.8 days)
_LABELS: Final = {"request": b"pdfsm-sidechannel/1 request\x00", "reply": b"pdfsm-sidechannel/1 reply\x00"}

_log = structlog.get_logger("pdfsm.sidechannel")

Kind = Literal["request", "reply"]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
Version = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=8, max_length=64)]
Destination = tuple[str, int]  # a listener's (host, port), as the params name it


class ErrorCode:
    """The ``code`` of an :class:`ErrorReply`; a receiver must accept codes it does not know."""

    MALFORMED: Final = "malformed"  # bad magic, flags, or a body that is not a valid request
    TOO_LARGE: Final = "too-large"
    TRUNCATED: Final = "truncated"
    TIMEOUT: Final = "timeout"
    WRONG_TYPE: Final = "wrong-type"  # a well-formed message that is not a request
    UNSUPPORTED_VERSION: Final = "unsupported-version"
    UNAUTHENTICATED: Final = "unauthenticated"
    NO_SUCH_RANK: Final = "no-such-rank"
    BUSY: Final = "busy"
    INTERNAL: Final = "internal"


# --- messages ----------------------------------------------------------------------------------


class HandshakeRequest(msgspec.Struct, frozen=True, kw_only=True, tag="handshake"):
    """Engine ``engine_id`` asks for the handshake metadata of PP rank ``pp_rank``."""

    version: Version
    engine_id: Id  # the requesting engine, for the listener's logs
    pp_rank: Rank
    nonce: Nonce | None = None  # echoed in the (MAC'd) reply: a reply cannot answer another request


class ReplyMessage(msgspec.Struct, frozen=True, kw_only=True, tag="reply"):
    """The listener's answer: ``reply`` for ``pp_rank``, bound to the request's ``nonce``."""

    version: Version
    pp_rank: Rank
    nonce: Nonce | None
    reply: HandshakeReply


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag="error"):
    """The listener refused the request; ``code`` is one of :class:`ErrorCode` (or a newer one).
    ``nonce`` and ``pp_rank`` echo the request's when it could be read (a refusal of a request
    it read, like ``no-such-rank``, answers that request only); None when it could not be."""

    code: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    message: Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE_CHARS)] = ""
    nonce: Nonce | None = None
    pp_rank: Rank | None = None


Response = ReplyMessage | ErrorReply


class _RequestProbe(msgspec.Struct, frozen=True, tag="handshake"):
    """Just the version of a request, read before the full schema (which may differ by version)."""

    version: int


request_codec: Final[Codec[HandshakeRequest]] = Codec("side-channel request", HandshakeRequest, MAX_REQUEST_BYTES)
response_codec: Final[Codec[Response]] = Codec("side-channel reply", Response, MAX_REPLY_BYTES)  # type: ignore[arg-type]
def reply_codec(cap: int) -> Codec[Response]:
    """The reply codec for a cap: the shared one at the default, a new one otherwise."""
    return response_codec if cap == MAX_REPLY_BYTES else Codec("side-channel reply", Response, cap)  # type: ignore[arg-type]


_probe_codec: Final[Codec[_RequestProbe | Response]] = Codec(  # a well-formed reply sent to us is "wrong-type"
    "side-channel request", _RequestProbe | Response, MAX_REQUEST_BYTES)  # type: ignore[arg-type]


def check_reply(reply: HandshakeReply) -> None:
    """Refuse a reply with a field out of the wire's bounds (WireError). Bounds only: whether the
    values are right for this engine is the engine machine's decision."""
    rows = [("len(engine_id)", len(reply.engine_id), MAX_ID_CHARS),
            ("len(compat_hash)", len(reply.compat_hash), MAX_HASH_CHARS),
            ("tp_size", reply.tp_size, MAX_RANKS), ("pp_size", reply.pp_size, MAX_RANKS),
            ("block_size", reply.block_size, MAX_BLOCK_SIZE), ("num_blocks", reply.num_blocks, 1 << 48),
            ("len(ranks)", len(reply.ranks), MAX_RANKS), ("kv_heads", reply.kv_heads, MAX_KV_HEADS)]
    for i, r in enumerate(reply.ranks[:MAX_RANKS]):
        rows += [(f"ranks[{i}].pp_rank", r.pp_rank, MAX_RANKS - 1), (f"ranks[{i}].tp_rank", r.tp_rank, MAX_RANKS - 1),
                 (f"len(ranks[{i}].agent)", len(r.agent), MAX_ID_CHARS),
                 (f"len(ranks[{i}].incarnation)", len(r.incarnation), MAX_ID_CHARS),
                 (f"ranks[{i}].started_wall_ns", r.started_wall_ns, (1 << 63) - 1),
                 (f"len(ranks[{i}].metadata)", len(r.metadata), MAX_METADATA_BYTES)]
    problems = [f"{name} = {value!r}, outside 0..{top}" for name, value, top in rows
                if type(value) is not int or not 0 <= value <= top]
    if problems:
        raise WireError("handshake reply out of bounds: " + "; ".join(problems[:4]))


# --- framing -----------------------------------------------------------------------------------


class _Secret:
    """The shared HMAC key, held so that it never shows: a traceback printed with its frames'
    locals (rich's, better-exceptions') or a debugger shows this object's repr, never the key."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def __repr__(self) -> str:
        return "<secret>"

    def mac(self, kind: Kind, header: bytes | bytearray, body: bytes | bytearray) -> bytes:
        return hmac.new(self._key, b"".join((_LABELS[kind], header, body)), hashlib.sha256).digest()


def _check_secret(secret: bytes | _Secret | None) -> _Secret | None:
    if secret is None or isinstance(secret, _Secret):
        return secret
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be bytes of at least {MIN_SECRET_BYTES} bytes (or None for no HMAC)")
    return _Secret(secret)


def _check_timeouts(**timeouts: float) -> None:
    for name, value in timeouts.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
            raise ValueError(f"{name} must be a positive finite number of seconds up to {MAX_TIMEOUT_S:.0f}, "
                             f"got {value!r}")


def pack_frame(body: bytes, *, secret: bytes | _Secret | None, kind: Kind) -> bytes:
    """A complete frame for ``body``, with a MAC when ``secret`` is given."""
    key = _check_secret(secret)
    flags = FLAG_MAC if key is not None else 0
    header = HEADER.pack(MAGIC, flags, 0, len(body))
    return header + body + (key.mac(kind, header, body) if key is not None else b"")


def _parse_header(header: bytes | bytearray, cap: int) -> tuple[int, int]:
    """(flags, body length) of a header, or WireError; the cap is checked here, before any read."""
    magic, flags, reserved, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise _FrameError(ErrorCode.MALFORMED, f"bad magic {bytes(magic)!r}: not a pdfsm side-channel frame")
    if flags & ~FLAG_MAC or reserved:
        raise _FrameError(ErrorCode.MALFORMED, f"unknown flags {flags:#06x} / reserved {reserved:#06x}")
    if length > cap:
        raise _FrameError(ErrorCode.TOO_LARGE, f"frame body of {length} bytes exceeds the cap of {cap}")
    return flags, length


def _verify(secret: _Secret | None, kind: Kind, flags: int, *, header: bytes | bytearray,
            body: bytes | bytearray, mac: bytes | bytearray) -> None:
    """Fail closed: a MAC is required exactly when a secret is configured, and must verify."""
    problem = ""
    if secret is None:
        problem = "carries a MAC but no secret is configured here" if flags & FLAG_MAC else ""
    elif not flags & FLAG_MAC:
        problem = "carries no MAC but a secret is configured here"
    elif not hmac.compare_digest(secret.mac(kind, header, body), bytes(mac)):
        problem = "has a MAC that does not verify (a wrong secret or a tampered message)"
    if problem:
        raise _FrameError(ErrorCode.UNAUTHENTICATED,
                          f"the {kind} {problem}: the same secret must be configured on both sides")


def unpack_frame(data: bytes, *, secret: bytes | _Secret | None, kind: Kind, cap: int) -> bytes:
    """The verified body of one complete frame held in ``data`` (tests and tools)."""
    if len(data) < HEADER.size:
        raise WireError(f"truncated header: {len(data)} of {HEADER.size} bytes")
    flags, length = _parse_header(data[:HEADER.size], cap)
    end = HEADER.size + length + (MAC_BYTES if flags & FLAG_MAC else 0)
    if len(data) != end:
        raise WireError(f"frame of {len(data)} bytes, expected {end}")
    body = data[HEADER.size:HEADER.size + length]
    _verify(_check_secret(secret), kind, flags, header=data[:HEADER.size], body=body, mac=data[HEADER.size + length:])
    return body


class SideChannelError(PdfsmError):
    """A handshake over the side channel failed; ``kind`` says how (timeout, refused, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _FrameError(WireError):
    """A frame or request refused; ``code`` is the :class:`ErrorCode` to answer, ``cause`` (our own
    side's failure) is logged with its traceback."""

    def __init__(self, code: str, message: str, cause: BaseException | None = None,
                 request: HandshakeRequest | None = None) -> None:
        super().__init__(message)
        self.code, self.cause, self.request = code, cause, request  # the request, when it was read


class _PeerClosed(Exception):
    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"peer closed after {got} of {wanted} bytes")
        self.got = got
        self.empty = False  # closed before the first byte of a frame


class _Stopped(Exception):
    """The owner is closing: abandon the I/O."""


# --- deadline-bound, stoppable socket I/O (non-blocking sockets, poll) ----------------------------


def _wait(sock: socket.socket, events: int, deadline: float, stop: socket.socket | None) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    poller = select.poll()
    poller.register(sock, events)
    if stop is not None:
        poller.register(stop, select.POLLIN)
    ready = poller.poll(max(1, math.ceil(remaining * 1000)))
    if stop is not None and any(fd == stop.fileno() for fd, _ in ready):
        raise _Stopped
    if not ready:
        raise TimeoutError


def _connect(addresses: list[Any], until: float, stop: socket.socket | None) -> socket.socket:
    """A connected non-blocking socket to the first of a name's addresses that accepts, within one
    connect budget. A name may resolve to several (localhost to ::1 and 127.0.0.1, a DNS name to
    AAAA and A records) while the listener serves one: trying only the first refused the handshake
    (SGLang PR 29459, Dynamo PR 5443). Raises the last address's error."""
    error: OSError = ConnectionRefusedError(errno.ECONNREFUSED, "no address to connect to")
    for family, _, _, _, addr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            err = sock.connect_ex(addr)
            if err in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
                _wait(sock, select.POLLOUT, until, stop)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except BaseException:
            sock.close()
            raise
        if not err:
            return sock
        sock.close()
        error = OSError(err, os.strerror(err))  # ECONNREFUSED makes a ConnectionRefusedError
    raise error


def _recv_exact(sock: socket.socket, n: int, deadline: float, stop: socket.socket | None) -> bytearray:
    buf = bytearray(n)  # n was checked against a cap by the caller
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except (BlockingIOError, InterruptedError):
            _wait(sock, select.POLLIN, deadline, stop)
            continue
        if k == 0:
            raise _PeerClosed(got, n)
        got += k
    return buf


def _send_all(sock: socket.socket, data: bytes, deadline: float, stop: socket.socket | None) -> None:
    view, sent = memoryview(data), 0
    while sent < len(data):
        try:
            sent += sock.send(view[sent:])
        except (BlockingIOError, InterruptedError):
            _wait(sock, select.POLLOUT, deadline, stop)


def _read_frame(sock: socket.socket, *, cap: int, secret: _Secret | None, kind: Kind, deadline: float,
                stop: socket.socket | None) -> bytearray:
    """One frame's verified body: header, cap check, then body and MAC."""
    try:
        header = _recv_exact(sock, HEADER.size, deadline, stop)
    except _PeerClosed as exc:
        exc.empty = exc.got == 0
        raise
    flags, length = _parse_header(header, cap)
    body = _recv_exact(sock, length, deadline, stop)
    mac = _recv_exact(sock, MAC_BYTES, deadline, stop) if flags & FLAG_MAC else b""
    _verify(secret, kind, flags, header=header, body=body, mac=mac)
    return body


# --- the listener --------------------------------------------------------------------------------


class SideChannelServer:
    """Answers handshake requests on ``host:port`` (loopback and a free port by default).

    ``reply_for(pp_rank)`` builds the reply (every TP rank's metadata of that PP rank; it
    must not block); raising ``LookupError`` means no such rank. One thread accepts; each
    connection gets its own thread, at most ``max_connections`` at once (more are answered
    ``busy``), and ``io_timeout`` seconds to send its request, again to take the reply.
    Anything wrong gets an :class:`ErrorReply` when one can still be sent, is counted in
    :attr:`refused` and logged once; the listener keeps serving."""

    def __init__(self, reply_for: Callable[[int], HandshakeReply], *, host: str = "127.0.0.1", port: int = 0,
                 secret: bytes | None = None, io_timeout: float = 5.0, max_connections: int = 16,
                 max_reply_bytes: int = MAX_REPLY_BYTES, backlog: int = 64) -> None:
        if not host:
            raise ValueError("host must name one interface (e.g. '127.0.0.1'); '' would bind every interface")
        _check_timeouts(io_timeout=io_timeout)
        if max_connections < 1:
            raise ValueError("max_connections must be positive")
        self.reply_for = reply_for
        self.secret = _check_secret(secret)
        self.io_timeout = io_timeout
        self.max_reply_bytes = max_reply_bytes
        self._reply_codec = reply_codec(max_reply_bytes)
        self.refused: Counter[str] = Counter()  # by ErrorCode, plus "empty" and "connection-error"
        self.served = self.crashes = 0
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._handlers: set[threading.Thread] = set()
        self._closed = False
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        if every_interface(str(addr[0])):  # as resolved: "0", "0x0" and "::ffff:0.0.0.0" too
            raise ValueError(f"host {host!r} would bind every interface: name the one to serve on "
                             "(the default is loopback, 127.0.0.1)")
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                self._sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            self._sock.bind(addr)
            self._sock.listen(backlog)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        name = self._sock.getsockname()
        self.address: Final[tuple[str, int]] = (str(name[0]), int(name[1]))  # as bound
        self.port: Final = self.address[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._accept_loop, name=f"pdfsm-sidechannel:{self.port}",
                                        daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> SideChannelServer:
        self._thread.start()
        _log.info("side channel listening", host=self.address[0], port=self.port, hmac=self.secret is not None)
        return self

    __enter__ = start

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"served": self.served, "refused": dict(self.refused), "crashes": self.crashes,
                    "active": len(self._handlers)}

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, abandon connections in progress, close the socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake_w.send(b"x")  # never drained: every poll on _wake_r sees it from now on
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._lock:  # after the accept thread stopped: no handler can be added any more
            handlers = list(self._handlers)
        for t in handlers:
            t.join(timeout)
        self._sock.close()
        if not self._thread.is_alive() and not any(t.is_alive() for t in handlers):
            self._wake_r.close()  # otherwise left to the garbage collector: a straggler still polls it
            self._wake_w.close()

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._wake_r.fileno() in ready:
                return
            try:
                conn, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE and friends: back off rather than spin
                _log.warning("side channel accept failed", error=str(exc))
                time.sleep(0.05)
                continue
            conn.setblocking(False)
            peer_name = f"{peer[0]}:{peer[1]}"
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, peer_name, ErrorCode.BUSY, "too many concurrent handshakes; retry later",
                             busy=True)
                conn.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn, peer_name), daemon=True,
                                 name=f"pdfsm-sidechannel-conn:{peer_name}")
            with self._lock:
                self._handlers.add(t)
            try:
                t.start()
            except RuntimeError as exc:  # no thread to be had: refuse this one, keep listening
                with self._lock:
                    self._handlers.discard(t)
                self._slots.release()
                self._refuse(conn, peer_name, ErrorCode.BUSY, f"cannot serve now: {exc}", busy=True)
                conn.close()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            request, out = self._answer(conn)
            _send_all(conn, pack_frame(out, secret=self.secret, kind="reply"), time.monotonic() + self.io_timeout,
                      self._wake_r)
            with self._lock:
                self.served += 1
            _log.debug("side channel served", peer=peer, requester=request.engine_id, pp_rank=request.pp_rank)
            _finish(conn, self._wake_r)
        except _FrameError as exc:
            self._refuse(conn, peer, exc.code, str(exc), cause=exc.cause, request=exc.request)
        except _PeerClosed:  # closed before sending a byte (a health check): counted, not logged
            with self._lock:
                self.refused["empty"] += 1
        except _Stopped:
            pass
        except OSError as exc:  # reset, or a reply that could not be written in time: no reply possible
            with self._lock:
                self.refused["connection-error"] += 1
            _log.warning("side channel refused a request", peer=peer, code="connection-error", error=repr(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here must not kill the listener; counted, logged
            with self._lock:
                self.crashes += 1
            _log.exception("side channel handler crashed", peer=peer, error=repr(exc))
        finally:
            conn.close()
            with self._lock:
                self._handlers.discard(threading.current_thread())
            self._slots.release()

    def _answer(self, conn: socket.socket) -> tuple[HandshakeRequest, bytes]:
        """Read one request and encode its reply, or raise :class:`_FrameError` saying why not."""
        try:
            body = _read_frame(conn, cap=MAX_REQUEST_BYTES, secret=self.secret, kind="request",
                               deadline=time.monotonic() + self.io_timeout, stop=self._wake_r)
            probe = _probe_codec.decode(body)
        except _PeerClosed as exc:
            if exc.empty:
                raise
            raise _FrameError(ErrorCode.TRUNCATED, f"truncated request: {exc}") from None
        except TimeoutError:
            raise _FrameError(ErrorCode.TIMEOUT, f"no complete request within {self.io_timeout} s") from None
        except WireError as exc:  # a _FrameError already carries its code
            raise (exc if isinstance(exc, _FrameError) else _FrameError(ErrorCode.MALFORMED, str(exc))) from None
        if not isinstance(probe, _RequestProbe):
            raise _FrameError(ErrorCode.WRONG_TYPE, f"expected a HandshakeRequest, got {type(probe).__name__}")
        if probe.version != PROTOCOL_VERSION:
            raise _FrameError(ErrorCode.UNSUPPORTED_VERSION,
                              f"this listener speaks version {PROTOCOL_VERSION}; the request has {probe.version}")
        try:
            request = request_codec.decode(body)
        except WireError as exc:
            raise _FrameError(ErrorCode.MALFORMED, str(exc)) from None
        try:
            reply = self.reply_for(request.pp_rank)
        except LookupError as exc:
            raise _FrameError(ErrorCode.NO_SUCH_RANK, f"no metadata for pp_rank {request.pp_rank}: {exc}",
                              request=request) from None
        except Exception as exc:  # noqa: BLE001 - the caller's code: logged in full, named to the peer
            raise _FrameError(ErrorCode.INTERNAL, f"reply_for raised {type(exc).__name__}", exc, request) from None
        try:
            if not isinstance(reply, HandshakeReply):
                raise WireError(f"reply_for returned {type(reply).__name__}, not a HandshakeReply")
            check_reply(reply)
            out = self._reply_codec.encode(ReplyMessage(version=PROTOCOL_VERSION, pp_rank=request.pp_rank,
                                                        nonce=request.nonce, reply=reply))
        except WireError as exc:
            raise _FrameError(ErrorCode.INTERNAL, f"cannot send the reply: {exc}", exc, request) from None
        return request, out

    def _refuse(self, conn: socket.socket, peer: str, code: str, message: str, *,
                cause: BaseException | None = None, busy: bool = False,
                request: HandshakeRequest | None = None) -> None:
        """Count and log the refusal once, then send an ErrorReply if the peer can still take one.

        ``busy`` refusals run on the accept thread: a short write window and almost no drain."""
        with self._lock:
            self.refused[code] += 1
        log = _log.error if code == ErrorCode.INTERNAL else _log.warning
        log("side channel refused a request", peer=peer, code=code, error=message, exc_info=cause)
        # Encodable whatever it held, then cut: escaping a lone surrogate takes six characters.
        text = message.encode("utf-8", "backslashreplace").decode()[:MAX_MESSAGE_CHARS]
        body = response_codec.encode(ErrorReply(code=code, message=text,
                                                nonce=request.nonce if request else None,
                                                pp_rank=request.pp_rank if request else None))
        try:
            _send_all(conn, pack_frame(body, secret=self.secret, kind="reply"),
                      time.monotonic() + min(0.2 if busy else 1.0, self.io_timeout), self._wake_r)
            _finish(conn, self._wake_r, linger=0.02 if busy else 0.2)
        except (OSError, TimeoutError, _Stopped):
            pass  # the peer is gone or stuck, or we are closing; the refusal is already counted


def _finish(conn: socket.socket, stop: socket.socket | None, linger: float = 0.2) -> None:
    """Half-close, then drain (until EOF, 64 KiB or ``linger`` s): unread input must not reset the reply."""
    try:
        conn.shutdown(socket.SHUT_WR)
        deadline, drained = time.monotonic() + linger, 0
        while drained < 65536:
            try:
                chunk = conn.recv(4096)
            except (BlockingIOError, InterruptedError):
                _wait(conn, select.POLLIN, deadline, stop)
                continue
            if not chunk:
                return
            drained += len(chunk)
    except (OSError, TimeoutError, _Stopped):
        return


# --- the client ----------------------------------------------------------------------------------


def fetch_reply(host: str, port: int, *, engine_id: str, pp_rank: int, secret: bytes | _Secret | None = None,
                connect_timeout: float = 2.0, timeout: float = 5.0, max_reply_bytes: int = MAX_REPLY_BYTES,
                nonce: bytes | None = None, stop: socket.socket | None = None) -> HandshakeReply:
    """Ask ``host:port`` for the handshake reply of ``pp_rank``; raise :class:`SideChannelError`.

    ``engine_id`` is the requesting (local) engine. ``timeout`` bounds the whole exchange,
    ``connect_timeout`` the connection. The reply's engine id and compatibility hash are
    not checked here: that is the engine machine's job."""
    key, where = _check_secret(secret), f"side channel {host}:{port}"
    del secret  # only the key object from here on: a traceback's locals must not show the key
    _check_timeouts(connect_timeout=connect_timeout, timeout=timeout)
    start = time.monotonic()
    deadline = start + timeout
    nonce = nonce if nonce is not None else secrets.token_bytes(16)
    try:
        body = request_codec.encode(HandshakeRequest(version=PROTOCOL_VERSION, engine_id=engine_id,
                                                     pp_rank=pp_rank, nonce=nonce))
        request_codec.decode(body)  # msgspec checks the schema's bounds when decoding: as the listener will
    except WireError as exc:
        raise SideChannelError("invalid", f"{where}: cannot build the request: {exc}") from None
    sock: socket.socket | None = None
    phase = "connect"
    try:
        if type(port) is not int or not 0 < port <= 65535:
            raise SideChannelError("invalid", f"{where}: port must be 1..65535")
        try:
            addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (UnicodeError, OverflowError, ValueError) as exc:  # a host no resolver takes, a port out of range
            raise SideChannelError("invalid", f"{where}: cannot resolve: {exc}") from None
        sock = _connect(addresses, min(deadline, start + connect_timeout), stop)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        phase = "exchange"
        _send_all(sock, pack_frame(body, secret=key, kind="request"), deadline, stop)
        try:
            raw = _read_frame(sock, cap=max_reply_bytes, secret=key, kind="reply", deadline=deadline, stop=stop)
        except _FrameError as exc:
            if exc.code == ErrorCode.UNAUTHENTICATED:
                raise SideChannelError(exc.code, f"{where}: unauthenticated reply: {exc}") from None
            raise
        message = reply_codec(max_reply_bytes).decode(raw)
        if isinstance(message, ReplyMessage):
            check_reply(message.reply)
    except SideChannelError:
        raise
    except _Stopped:
        raise SideChannelError("stopped", f"{where}: abandoned: the handshaker is closing") from None
    except TimeoutError:
        limit = f"connect timeout {connect_timeout:.3g} s" if phase == "connect" else f"deadline {timeout:.3g} s"
        raise SideChannelError("timeout", f"{where}: no answer within the {limit}") from None
    except _PeerClosed as exc:
        raise SideChannelError("truncated", f"{where}: connection closed mid-reply ({exc})") from None
    except WireError as exc:
        raise SideChannelError("malformed", f"{where}: malformed reply: {exc}") from None
    except ConnectionRefusedError:
        raise SideChannelError("refused", f"{where}: connection refused") from None
    except OSError as exc:
        raise SideChannelError("connection", f"{where}: {phase} failed: {exc.strerror or exc}") from None
    finally:
        if sock is not None:
            sock.close()
    if isinstance(message, ErrorReply):
        if message.nonce is not None and (not hmac.compare_digest(message.nonce, nonce) or message.pp_rank != pp_rank):
            raise SideChannelError("replayed", f"{where}: a refusal of another request (nonce or pp_rank mismatch): "
                                               "replayed or misrouted")
        raise SideChannelError("remote", f"{where} refused the handshake: {message.code}: {message.message}")
    for bad, kind, what in (
        (message.version != PROTOCOL_VERSION, "malformed",
         f"reply has protocol version {message.version}, expected {PROTOCOL_VERSION}"),
        (message.nonce is None or not hmac.compare_digest(message.nonce, nonce), "replayed",
         "the reply answers another request (nonce mismatch): replayed or misrouted"),
        (message.pp_rank != pp_rank, "malformed",
         f"asked for pp_rank {pp_rank}, the reply is for pp_rank {message.pp_rank}"),
    ):
        if bad:
            raise SideChannelError(kind, f"{where}: {what}")
    return message.reply


# --- the handshaker ------------------------------------------------------------------------------


class SideChannelHandshaker:
    """The :class:`~transports.base.Handshaker` over the side channel.

    :meth:`start` queues the attempt and returns; a worker thread submits exactly one
    HandshakeDone or HandshakeFailed for it (unless :meth:`close` abandoned it first). What the
    reply says about the remote engine is judged by the engine machine.

    A hung listener (a stopped process: its kernel still completes connects) holds a thread for
    the whole ``timeout`` of every attempt to it, so that one remote's hang neither fails nor
    holds up a handshake to another (docs/side-channel.md, "Scheduling"): at most
    ``max_per_destination`` attempts run per (host, port), the rest wait behind their own
    destination; threads start on demand, at most ``max_workers``; a freed thread goes to a
    waiting destination whose last attempt did not time out before one whose did, then to the one
    with the fewest attempts running; and ``timeout`` counts from when the attempt runs, not while
    it waits (the core bounds the whole attempt: handshake_timeout_ns).
    At most ``max_queued`` attempts wait; one more fails at once, saying the overload is local."""

    def __init__(self, local_engine_id: str, *, secret: bytes | None = None, connect_timeout: float = 2.0,
                 timeout: float = 5.0, max_workers: int = 32, max_per_destination: int = 2,
                 max_queued: int = 4096, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        if not 1 <= len(local_engine_id) <= MAX_ID_CHARS:
            raise ValueError(f"local_engine_id must have 1..{MAX_ID_CHARS} characters")
        try:
            local_engine_id.encode()
        except UnicodeEncodeError as exc:  # non-UTF-8 bytes from argv: no request could carry it
            raise ValueError(f"local_engine_id is not valid UTF-8 text: {exc}") from None
        _check_timeouts(connect_timeout=connect_timeout, timeout=timeout)
        for name, value in (("max_workers", max_workers), ("max_per_destination", max_per_destination),
                            ("max_queued", max_queued)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.local_engine_id = local_engine_id
        self.secret = _check_secret(secret)
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.max_workers, self.max_per_destination, self.max_queued = max_workers, max_per_destination, max_queued
        self.max_reply_bytes = max_reply_bytes
        # Waiting attempts by destination, in turn order (a destination served goes last).
        self._waiting: dict[Destination, deque[StartHandshake]] = {}
        self._queued = 0  # attempts in _waiting
        self._running: Counter[Destination] = Counter()
        self._slow: dict[Destination, None] = {}  # last attempt timed out; oldest first, at most max_queued
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._submit: Submit | None = None
        self._clock: Clock = time.monotonic_ns

    def bind(self, submit: Submit, clock: Clock) -> None:
        self._submit, self._clock = submit, clock

    def start(self, cmd: StartHandshake) -> None:
        submit = self._submit
        if submit is None:
            raise RuntimeError("bind() the handshaker before starting handshakes")
        with self._lock:
            superseded = self._drop_superseded(cmd)
            refused = self._admit(cmd)
            unstarted = self._spawn() if refused[0] is None else (None, "")
        for old in superseded:  # an outcome each, as for every attempt: the core finds it stale
            submit(self._failed(old, f"superseded by attempt {cmd.attempt} before it ran: not tried"))
        for failed, error in (refused, unstarted):
            if failed is not None:
                _log.warning("side channel handshake refused here", engine_id=failed.engine_id,
                             pp_rank=failed.pp_rank, attempt=failed.attempt, error=error)
                submit(self._failed(failed, error))

    def progress(self) -> None:
        """Nothing to do: worker threads submit their outcomes themselves."""

    def stats(self) -> dict[str, int]:
        """A consistent snapshot: attempts waiting and running, worker threads alive."""
        with self._lock:
            return {"waiting": self._queued, "running": sum(self._running.values()), "threads": len(self._threads)}

    def close(self, timeout: float = 1.0) -> None:
        """Abandon attempts (waiting ones never start, running ones stop their I/O at once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._waiting.clear()
            self._queued = 0
            threads = [t for t in self._threads if t is not threading.current_thread()]
        self._wake_w.send(b"x")  # never drained: every worker's poll sees it
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in threads):  # otherwise left to the garbage collector
            self._wake_r.close()
            self._wake_w.close()

    # --- scheduling (under _lock) -------------------------------------------------------------------

    def _admit(self, cmd: StartHandshake) -> tuple[StartHandshake | None, str]:
        """Queue ``cmd``, or (cmd, why not): closed, or a full queue (a local overload)."""
        if self._closed:
            return cmd, "side channel handshaker is closed"
        if self._queued >= self.max_queued:
            return cmd, (f"side channel handshaker overloaded here: {self._queued} handshakes already wait "
                         f"(max_queued); {cmd.host}:{cmd.port} was not tried")
        self._waiting.setdefault((cmd.host, cmd.port), deque()).append(cmd)
        self._queued += 1
        return None, ""

    def _drop_superseded(self, cmd: StartHandshake) -> list[StartHandshake]:
        """Take out the waiting attempts of ``cmd``'s engine and stage that ``cmd`` replaces: the
        core starts an attempt only once the one before ended (its own handshake_timeout_ns gave
        up on it), so their answers would be stale, and left queued they would fill the queue
        behind a hung listener and run for nothing. They fail at once, not tried."""
        dropped: list[StartHandshake] = []
        for dest, waiting in list(self._waiting.items()):
            keep: deque[StartHandshake] = deque()
            for w in waiting:
                stale = w.engine_id == cmd.engine_id and w.pp_rank == cmd.pp_rank and w.attempt < cmd.attempt
                (dropped if stale else keep).append(w)
            if len(keep) != len(waiting):
                self._queued -= len(waiting) - len(keep)
                if keep:
                    self._waiting[dest] = keep
                else:
                    del self._waiting[dest]
        return dropped

    def _spawn(self) -> tuple[StartHandshake | None, str]:
        """Start a worker if one may run and an attempt can: every worker alive is busy (an idle
        one exits), so an attempt that can run now should not wait for one of them."""
        cmd = self._next() if len(self._threads) < self.max_workers else None
        if cmd is None:
            return None, ""
        thread = threading.Thread(target=self._work, args=(cmd,), name="pdfsm-handshake", daemon=True)
        self._threads.add(thread)  # started under the lock: close() never sees an unstarted thread
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had (a process limit): fail this attempt here
            self._threads.discard(thread)
            self._done(cmd, slow=None)
            return cmd, f"side channel handshaker cannot start a thread: {exc}"
        return None, ""

    def _next(self) -> StartHandshake | None:
        """Take the attempt to run next, or None. Of the destinations under their cap: one whose last
        attempt did not time out before one whose did, then the one with the fewest attempts running
        (one not held by a hung attempt before one that is), then the one whose turn came longest
        ago. So while hung listeners hold every thread, a healthy destination gets the next one."""
        ready = [] if self._closed else [d for d in self._waiting if self._running[d] < self.max_per_destination]
        if not ready:
            return None
        dest = min(ready, key=lambda d: (d in self._slow, self._running[d]))  # the first of equals: turn order
        waiting = self._waiting.pop(dest)
        cmd = waiting.popleft()
        if waiting:
            self._waiting[dest] = waiting  # its next attempt waits for its turn again
        self._queued -= 1
        self._running[dest] += 1
        return cmd

    def _done(self, cmd: StartHandshake, *, slow: bool | None) -> None:
        """``cmd`` stopped running; ``slow``: it timed out (None: it never ran)."""
        dest = (cmd.host, cmd.port)
        self._running[dest] -= 1
        if self._running[dest] <= 0:
            del self._running[dest]
        if slow is not None:
            self._slow.pop(dest, None)
            if slow:
                self._slow[dest] = None
                if len(self._slow) > self.max_queued:  # bounded: forget the one marked longest ago
                    del self._slow[next(iter(self._slow))]

    # --- workers ------------------------------------------------------------------------------------

    def _work(self, cmd: StartHandshake | None) -> None:
        """Run attempts until none can run now: a thread lives only while there is work for it."""
        while cmd is not None:
            outcome, slow = self._attempt(cmd)
            self._report(outcome)
            with self._lock:
                self._done(cmd, slow=slow)
                cmd = self._next()
                if cmd is None:
                    self._threads.discard(threading.current_thread())

    def _failed(self, cmd: StartHandshake, error: str) -> HandshakeFailed:
        return HandshakeFailed(source=Source.HANDSHAKE, t_ns=self._clock(), engine_id=cmd.engine_id,
                               pp_rank=cmd.pp_rank, attempt=cmd.attempt, error=error)

    def _attempt(self, cmd: StartHandshake) -> tuple[HandshakeDone | HandshakeFailed, bool]:
        """The outcome, and whether the listener left it unanswered until its timeout."""
        # A full timeout from now, whatever the wait for a thread: that wait is other remotes'
        # doing, not this one's, and the core bounds the whole attempt (handshake_timeout_ns).
        try:
            reply = fetch_reply(cmd.host, cmd.port, engine_id=self.local_engine_id, pp_rank=cmd.pp_rank,
                                secret=self.secret, connect_timeout=self.connect_timeout, timeout=self.timeout,
                                max_reply_bytes=self.max_reply_bytes, stop=self._wake_r)
        except SideChannelError as exc:
            return self._failed(cmd, str(exc)), exc.kind == "timeout"
        except Exception as exc:  # noqa: BLE001 - a bug must still end the attempt, or requests wait forever
            _log.exception("side channel handshake crashed", engine_id=cmd.engine_id, pp_rank=cmd.pp_rank)
            return self._failed(cmd, f"side channel internal error: {type(exc).__name__}: {exc}"), False
        return HandshakeDone(source=Source.HANDSHAKE, t_ns=self._clock(), engine_id=cmd.engine_id,
                             pp_rank=cmd.pp_rank, attempt=cmd.attempt, reply=reply), False

    def _report(self, outcome: HandshakeDone | HandshakeFailed) -> None:
        if self._closed:
            return  # abandoned: the owner is shutting down
        if isinstance(outcome, HandshakeFailed):
            _log.info("side channel handshake failed", engine_id=outcome.engine_id, pp_rank=outcome.pp_rank,
                      attempt=outcome.attempt, error=outcome.error)
        assert self._submit is not None
        try:
            self._submit(outcome)
        except Exception:  # noqa: BLE001 - the worker must go on: its accounting and other attempts
            _log.exception("side channel could not submit a handshake outcome", engine_id=outcome.engine_id)
