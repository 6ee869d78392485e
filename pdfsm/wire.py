"""Messages that cross the network between engines, with their schemas and size caps.

Every message is a typed msgspec Struct encoded as MessagePack; nothing from
the network is ever unpickled. A decoder checks the size cap before it looks
at a single byte of the payload, then decodes into exactly one of the known
types (anything else is a :class:`WireError` that names what was wrong).

Notifications are built by the library from the producer's request id, never
from the consumer's local id (vLLM PR 36958), and say which part they are
(``part`` of ``of``) so the producer counts distinct parts (SGLang 39846).
"""

from __future__ import annotations

import ipaddress
import socket
from functools import lru_cache
from typing import Annotated, Final, Generic, TypeVar

import msgspec

from pdfsm.events import BadMessage, Event, Heartbeat, NotificationReceived
from pdfsm.topology import MAX_RANKS

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_EXTEND_NS",
    "MAX_HASH_CHARS",
    "MAX_ID_CHARS",
    "MAX_NOTIFY_BYTES",
    "Codec",
    "HeartbeatMessage",
    "NotifyMessage",
    "Notification",
    "WireError",
    "every_interface",
    "notification_event",
    "notify_codec",
]

@lru_cache(maxsize=256)
def every_interface(host: str) -> bool:
    """``host`` is an address naming every interface: bound, a listener on all of them; dialled,
    no listener in particular (this host's own). Also in the old IPv4 spellings resolvers still take
    ("0", "0x0") and IPv4-mapped; a host name is not (it is never resolved here). Cached: a load
    checks its params' host."""
    try:
        addr = ipaddress.ip_address(host.split("%", maxsplit=1)[0])
    except ValueError:
        try:
            addr = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:  # a host name
            return False
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return addr.is_unspecified or (mapped is not None and mapped.is_unspecified)


MAX_ID_CHARS: Final = 256
MAX_HASH_CHARS: Final = 1024  # a handshake reply's compat_hash
MAX_BLOCK_SIZE: Final = (1 << 31) - 1  # a handshake reply's block_size
# The two longest ids a message can carry (a request's and a consumer engine's, 4 UTF-8 bytes a
# character) and the rest of the largest one: every message pdfsm's checks accept fits, so a send
# never fails on its size.
MAX_NOTIFY_BYTES: Final = 8 * MAX_ID_CHARS + 64
MAX_EXTEND_NS: Final = 3_600_000_000_000  # a heartbeat extends a lease by an hour at most

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
# A part's index and count: at most one part per consumer rank, and a layout has at most MAX_RANKS
# ranks. 2**16 let a peer's 25-byte notice make the producer keep a 65536-bit part mask for a
# lease, 50 times the bytes of a real one, for each staged id (found by a helper's audit).
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANKS)]


class WireError(ValueError):
    """Bytes from a peer were refused: too large, malformed, or not a known message."""


class Notification(msgspec.Struct, frozen=True, gc=False, tag="n", array_like=True):
    """Part ``part`` of ``of`` of the consumer has read the producer's request ``request_id``."""

    request_id: RequestId
    part: Count  # 0 <= part < of is checked by the producer's table, which attributes it
    of: Count
    # The params' issued_wall_ns: which hold of ``request_id`` was read (0: not said). Older
    # producers ignore it (msgspec skips trailing array items a struct does not have).
    issued_wall_ns: Annotated[int, msgspec.Meta(ge=0)] = 0
    # The consumer engine that read (its engine id; "": not said, older consumers): the producer
    # counts each engine's parts apart, so params handed to two decode engines cannot mix them.
    consumer: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""
    # True: a release, not a read's end: the consumer takes nothing from this rank (the request
    # stopped before a read of it completed, or MLA read another rank; a read it saw fail may still
    # have moved bytes, and that read's own notice, if one went, says so). After the lease it tells
    # the producer that nothing was misread (False: a read, or an older consumer that does not say).
    unread: bool = False


class HeartbeatMessage(msgspec.Struct, frozen=True, gc=False, tag="h", array_like=True):
    """A consumer still intends to read ``request_id``: extend its lease by ``extend_ns``."""

    request_id: RequestId
    extend_ns: Annotated[int, msgspec.Meta(gt=0, le=MAX_EXTEND_NS)]
    # The params' issued_wall_ns, as a Notification says it: which hold to extend (0: not said).
    issued_wall_ns: Annotated[int, msgspec.Meta(ge=0)] = 0


NotifyMessage = Notification | HeartbeatMessage

T = TypeVar("T")


class Codec(Generic[T]):
    """Encode and decode one message union with a size cap checked before decoding."""

    __slots__ = ("_decoder", "_encoder", "cap", "name")

    def __init__(self, name: str, kind: type[T], cap: int) -> None:
        self.name: Final = name
        self.cap: Final = cap
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(kind)

    def encode(self, message: T) -> bytes:
        try:
            raw = self._encoder.encode(message)
        except (msgspec.EncodeError, UnicodeEncodeError, TypeError, OverflowError) as exc:
            # A lone surrogate in a string (non-UTF-8 argv bytes), a field of the wrong type.
            raise WireError(f"{self.name}: cannot encode: {exc}") from None
        if len(raw) > self.cap:
            raise WireError(f"{self.name}: message of {len(raw)} bytes exceeds the cap of {self.cap}")
        return raw

    def decode(self, raw: bytes | bytearray | memoryview) -> T:
        if len(raw) > self.cap:
            raise WireError(f"{self.name}: message of {len(raw)} bytes exceeds the cap of {self.cap}")
        try:
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, ValueError) as exc:  # ValidationError is a DecodeError
            raise WireError(f"{self.name}: {exc}") from None
        except RecursionError:  # skipping an unknown value nested ~1000 deep: still a small message
            raise WireError(f"{self.name}: nested too deeply") from None


notify_codec: Final[Codec[NotifyMessage]] = Codec("notification", NotifyMessage, MAX_NOTIFY_BYTES)  # type: ignore[arg-type]


def notification_event(raw: bytes, *, sender: str, source: str, t_ns: int) -> Event:
    """The event for raw notification bytes from ``sender``: a notification, a heartbeat, or,
    for anything that does not decode, a :class:`~pdfsm.events.BadMessage` (a remote fault)."""
    try:
        msg = notify_codec.decode(raw)
    except WireError as exc:
        return BadMessage(source=source, t_ns=t_ns, channel="notification", sender=sender,
                          error=str(exc), size=len(raw))
    if isinstance(msg, Notification):
        return NotificationReceived(source=source, t_ns=t_ns, request_id=msg.request_id, part=msg.part,
                                    of=msg.of, sender=sender, issued_wall_ns=msg.issued_wall_ns,
                                    consumer=msg.consumer, unread=msg.unread)
    return Heartbeat(source=source, t_ns=t_ns, request_id=msg.request_id, extend_ns=msg.extend_ns,
                     sender=sender, issued_wall_ns=msg.issued_wall_ns)
