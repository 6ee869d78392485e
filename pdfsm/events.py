"""Events: frozen, slotted value classes that carry everything a machine may learn.

Every event says who produced it (``source``: a thread or actor name) and when
(``t_ns``: monotonic nanoseconds in the owning core's clock domain, stamped by
the adapter that observed it; the core reads no clock). Its keys route it to
one machine: ``request_id`` for consumer and producer requests, ``(engine_id,
pp_rank)`` for remote engines. Sequence numbers are not part of an event: the
log assigns them when the owner applies it.

Events whose ``DERIVED`` flag is set are produced by the core itself while it
applies another event (a handshake completing wakes its waiting requests, a
tick expires leases); the log records them with the sequence number of the
event that caused them, and replay regenerates them instead of reading them.

msgspec Structs were chosen over attrs: a frozen Struct is created in about
70 ns against about 1 us for a frozen attrs class on this machine
(``benchmarks/events.py``), and the same classes are the log's codec.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final, Literal

import msgspec

__all__ = [
    "CONSUMER",
    "CORE",
    "ENGINE",
    "PRODUCER",
    "AbortRequested",
    "BadMessage",
    "BlocksHeld",
    "Collect",
    "CoreConfig",
    "Deadline",
    "DeadlinePassed",
    "Dropped",
    "EngineFailed",
    "EngineKey",
    "EngineQuarantined",
    "EngineReady",
    "EngineWanted",
    "EvictRequested",
    "Event",
    "EventType",
    "HandleDone",
    "HandleFailed",
    "HandleFailure",
    "HandshakeDone",
    "HandshakeFailed",
    "HandshakeReply",
    "Heartbeat",
    "LeaseExpired",
    "NotificationReceived",
    "PeerAdded",
    "PeerDisconnected",
    "Policy",
    "Promised",
    "Quarantined",
    "RankInfo",
    "ReadRequested",
    "Reported",
    "Source",
    "StagedDropped",
    "SendFailed",
    "Started",
    "Tick",
    "ALL_EVENTS",
]

CORE: Final = 0
CONSUMER: Final = 1
PRODUCER: Final = 2
ENGINE: Final = 3

EngineKey = tuple[str, int]
"""A remote engine is known by (engine_id, pp_rank)."""

Policy = Literal["recompute", "fail"]
"""What the scheduler does with a request whose KV could not be read."""


class Source:
    """Conventional ``source`` names; adapters may use their own (``"xfer-3"``)."""

    SCHEDULER: Final = "scheduler"
    HANDSHAKE: Final = "handshake"
    TRANSFER: Final = "transfer"
    NOTIFY: Final = "notify"
    TIMER: Final = "timer"
    LISTENER: Final = "listener"
    CORE: Final = "core"


class Deadline(msgspec.Struct, frozen=True, gc=False):
    """An absolute time on a named clock. Deadlines from another clock must be rebased."""

    clock: str
    t_ns: int

    def rebased(self, *, there_now_ns: int, here_clock: str, here_now_ns: int) -> Deadline:
        """The same remaining time on another clock; both 'now' readings are taken together."""
        return Deadline(here_clock, here_now_ns + (self.t_ns - there_now_ns))


class CoreConfig(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Everything a core's behaviour depends on besides its events; logged first, for replay."""

    engine_id: str
    clock: str = "monotonic"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    mla: bool = False
    # The model's KV heads over all TP ranks (0: not said; every rank then holds a distinct
    # share). Said, a TP larger than it on either side works: ranks holding the same head are
    # read once (topology.heads_held). Both engines must say the same.
    kv_heads: int = 0
    compat_hash: str = ""
    block_size: int = 16
    supports_pp: bool = True
    policy: Policy = "recompute"
    read_timeout_ns: int = 30_000_000_000
    lease_ns: int = 120_000_000_000
    lease_margin_ns: int = 1_000_000_000  # a consumer stops trusting reads this long before the lease ends
    max_staged: int = 4096
    handshake_retry_ns: int = 1_000_000_000
    # A handshake attempt unanswered this long is failed by the core (a handshaker need not
    # promise an answer). 0: twice the read timeout.
    handshake_timeout_ns: int = 0
    # A connected engine nobody has read from this long is evicted (its transport peer dropped):
    # producers restart under new engine ids, and the old ones never say goodbye. 0: never.
    # An hour, as vLLM's TTL for remote agents.
    idle_engine_ns: int = 3_600_000_000_000
    tombstones: int = 65536
    tombstone_ns: int = 0  # terminal states remembered this long at most; 0: twice the lease or read timeout
    # How far apart the wall-clock issue times of one hold on two producer ranks may be (scheduler
    # step lag and clock skew): a notification further from the hold's is of another hold of the
    # same request id, and params issued further before a producer rank started are of a process
    # it replaced (docs/decisions.md). 0: not checked.
    hold_skew_ns: int = 5_000_000_000
    strict: bool = False
    # A read still running this long after its cancel says its peer no longer answers (a stopped
    # process, a node gone without a reset): later requests for that engine stage fail fast, each
    # instead of pinning its blocks behind the hung reads, until a read of it stops. Longer than
    # any transfer can take (NIXL's cancel waits for a READ in progress). 0: the read timeout.
    cancel_grace_ns: int = 0


class Event(msgspec.Struct, frozen=True, gc=False, tag=True, array_like=True):
    """Base of every event. ``TARGET`` names the kind of machine it is routed to."""

    TARGET: ClassVar[int] = CORE
    DERIVED: ClassVar[bool] = False
    # Whether a full COUNT inbox may drop it (counted and recorded). Not the answers to what the
    # owner started (a read's outcome, a handshake's, a peer lost): there are no more of them than
    # it started, and losing one would leave its machine waiting for ever.
    DROPPABLE: ClassVar[bool] = True
    source: str
    t_ns: int


# --- core-level events -------------------------------------------------------------------------


class Started(Event, frozen=True):
    """First event of every log: the configuration replay rebuilds the core from."""

    config: CoreConfig
    format: int = 1


class Tick(Event, frozen=True):
    """Time has reached ``t_ns``: leases and deadlines at or before it expire."""


class Collect(Event, frozen=True):
    """The scheduler collects finished requests for step ``step`` (vLLM's get_finished)."""

    step: int


class Dropped(Event, frozen=True):
    """Events the inbox refused while full (``Overflow.COUNT``), counted by source."""

    count: int
    by_source: dict[str, int]


class SendFailed(Event, frozen=True):
    """A notification or heartbeat could not be sent; the producer's lease will release it."""

    engine_id: str
    pp_rank: int
    tp_rank: int
    request_id: str
    error: str


class BadMessage(Event, frozen=True):
    """Bytes from a peer that did not decode into any known message: a remote violation."""

    channel: str
    sender: str
    error: str
    size: int


# --- consumer (decode-side) request ---------------------------------------------------------


class _ConsumerEvent(Event, frozen=True):
    TARGET: ClassVar[int] = CONSUMER
    request_id: str


class ReadRequested(_ConsumerEvent, frozen=True):
    """The scheduler asks to pull a request's KV blocks from a remote (prefill) engine.

    ``remote_request_id`` is the producer's own id for the request; every
    notification is built from it. Zero blocks means notify-only: the prompt
    was entirely in the local prefix cache, but the producer still holds its
    blocks and must be told.
    """

    remote_request_id: str
    engine_id: str
    host: str = "127.0.0.1"
    port: int = 0
    remote_tp: int = 1
    remote_pp: int = 1
    local_blocks: tuple[int, ...] = ()
    remote_blocks: tuple[int, ...] = ()
    deadline: Deadline | None = None
    lease_ns: int = 0  # the producer's lease on the blocks, as its params said (0: unknown)
    lease_start_ns: int | None = None  # when that lease was last (re)started, on this clock; default t_ns
    incarnation: str = ""  # the minting producer rank's, as its params said ("": not said, not checked)
    # The PP stage of that rank, whose reply alone can confirm it (None: not said, as in params and
    # logs from before this field: judged against every stage's replies at once).
    incarnation_pp: int | None = None
    issued_wall_ns: int = 0  # when the params were issued, on the producer's wall clock (0: not said)
    # Until when this worker's heartbeats asked the producer to hold the blocks, on this clock (0:
    # none went out). Never trusted for a read (a heartbeat may be lost); it only says that a
    # notification can still find the blocks held, and so is owed, after the params' own lease.
    promised_ns: int = 0

    @property
    def hold(self) -> tuple[str, str, int]:
        """The hold these params name: (engine id, producer request id, issue time)."""
        return self.engine_id, self.remote_request_id, self.issued_wall_ns


class EngineReady(_ConsumerEvent, frozen=True):
    """Derived: the remote engine ``(engine_id, pp_rank)`` this request waits for is connected."""

    DERIVED: ClassVar[bool] = True
    engine_id: str
    pp_rank: int


class EngineFailed(_ConsumerEvent, frozen=True):
    """Derived: the handshake with a remote engine this request waits for failed."""

    DERIVED: ClassVar[bool] = True
    engine_id: str
    pp_rank: int
    error: str
    remote_fault: bool


class HandleFailure(enum.Enum):
    """How a read handle stopped without success."""

    SETUP = "setup"  # posting the read raised: nothing was transferred
    ERR = "err"  # the transport reported the transfer failed
    RAISED = "raised"  # polling the handle raised
    DISCONNECTED = "disconnected"  # the peer went away
    CANCELLED = "cancelled"  # cancelled on our request (abort, deadline); stopped for sure

    @property
    def remote_fault(self) -> bool:
        return self in (HandleFailure.ERR, HandleFailure.RAISED, HandleFailure.DISCONNECTED)


class HandleDone(_ConsumerEvent, frozen=True):
    """The read from remote rank (pp_rank, tp_rank) completed; its bytes are in place."""

    DROPPABLE: ClassVar[bool] = False

    pp_rank: int
    tp_rank: int


class HandleFailed(_ConsumerEvent, frozen=True):
    """The read from remote rank (pp_rank, tp_rank) stopped without completing."""

    DROPPABLE: ClassVar[bool] = False

    pp_rank: int
    tp_rank: int
    why: HandleFailure
    detail: str = ""


class AbortRequested(_ConsumerEvent, frozen=True):
    """The scheduler aborted the request."""


class Promised(_ConsumerEvent, frozen=True):
    """This worker's heartbeat asked the producer to hold the request's blocks until
    ``promised_ns`` (this core's clock), after the request was loaded: a notice stays owed until
    then less the margin, as for a promise made before the load (``ReadRequested.promised_ns``).
    Never trusted for a read (a heartbeat may be lost). It names the params heartbeated: a later
    load under the same request id, of other params, ignores it."""

    promised_ns: int
    engine_id: str = ""
    remote_request_id: str = ""
    issued_wall_ns: int = 0

    @property
    def hold(self) -> tuple[str, str, int]:
        """The hold the heartbeated params name, as :attr:`ReadRequested.hold`."""
        return self.engine_id, self.remote_request_id, self.issued_wall_ns


class DeadlinePassed(_ConsumerEvent, frozen=True):
    """Derived: the request's read deadline passed."""

    DERIVED: ClassVar[bool] = True


class Reported(_ConsumerEvent, frozen=True):
    """Derived: the request was handed back to the scheduler at a :class:`Collect`."""

    DERIVED: ClassVar[bool] = True


class Quarantined(_ConsumerEvent, frozen=True):
    """Derived (production mode): the request saw an illegal local event and is failed."""

    DERIVED: ClassVar[bool] = True
    reason: str


# --- producer (prefill-side) request --------------------------------------------------------


class _ProducerEvent(Event, frozen=True):
    TARGET: ClassVar[int] = PRODUCER
    request_id: str


class BlocksHeld(_ProducerEvent, frozen=True):
    """The request finished prefill; its blocks are held for consumers to read.

    The lease is ``deadline`` when given (it must be on this core's clock) or
    the configured lease from ``t_ns``.
    """

    block_ids: tuple[int, ...] = ()
    deadline: Deadline | None = None
    # The params' issued_wall_ns (this host's wall clock): notifications name the hold by it (0: none).
    issued_wall_ns: int = 0


class NotificationReceived(_ProducerEvent, frozen=True):
    """Consumer part ``part`` of ``of`` says it has read this request's blocks (``unread``: that it
    takes nothing from them, so the producer may release them)."""

    part: int
    of: int
    sender: str = ""
    issued_wall_ns: int = 0  # the hold read, by its params' issue time (0: not said)
    consumer: str = ""  # the consumer engine that read ("": not said); each engine's parts count apart
    unread: bool = False  # a release: the consumer says it takes nothing from this rank (not a read's end)


class Heartbeat(_ProducerEvent, frozen=True):
    """A consumer still intends to read: extend the lease to ``t_ns + extend_ns``."""

    extend_ns: int
    sender: str = ""
    issued_wall_ns: int = 0  # the hold it extends, by its params' issue time (0: not said)


class LeaseExpired(_ProducerEvent, frozen=True):
    """Derived: the lease (or the staging time of early notifications) ran out."""

    DERIVED: ClassVar[bool] = True


class StagedDropped(_ProducerEvent, frozen=True):
    """Derived: staged early notifications were dropped to keep staging bounded."""

    DERIVED: ClassVar[bool] = True
    reason: str


# --- remote engine ---------------------------------------------------------------------------


class _EngineEvent(Event, frozen=True):
    TARGET: ClassVar[int] = ENGINE
    engine_id: str
    pp_rank: int


class RankInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One remote worker's transfer metadata, keyed by (pp_rank, tp_rank)."""

    pp_rank: int
    tp_rank: int
    agent: str
    metadata: bytes = b""
    # Drawn afresh each time the worker's transport starts ("": not said): params minted by a
    # process that has since restarted under the same engine id name none of the new ranks'.
    incarnation: str = ""
    # When that transport started, on its host's wall clock (0: not said): params issued before
    # a rank started (beyond CoreConfig.hold_skew_ns) name a hold of the process it replaced.
    started_wall_ns: int = 0


class HandshakeReply(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a remote engine says about itself; validated in a fixed order by the engine machine."""

    engine_id: str
    compat_hash: str
    tp_size: int
    pp_size: int = 1
    block_size: int = 16
    num_blocks: int = 0
    mla: bool = False
    ranks: tuple[RankInfo, ...] = ()
    kv_heads: int = 0  # CoreConfig.kv_heads (last: a log or peer from before it reads 0)


class EngineWanted(_EngineEvent, frozen=True):
    """Derived: a request needs this remote engine."""

    DERIVED: ClassVar[bool] = True
    request_id: str
    host: str
    port: int


class HandshakeDone(_EngineEvent, frozen=True):
    """The handshake thread got a reply for attempt ``attempt``."""

    DROPPABLE: ClassVar[bool] = False

    attempt: int
    reply: HandshakeReply


class HandshakeFailed(_EngineEvent, frozen=True):
    """Attempt ``attempt`` failed: timeout, refused, or the transport rejected the peer."""

    DROPPABLE: ClassVar[bool] = False

    attempt: int
    error: str


class PeerAdded(_EngineEvent, frozen=True):
    """The transport added the remote agents of attempt ``attempt``; reads may start."""

    DROPPABLE: ClassVar[bool] = False

    attempt: int


class PeerDisconnected(_EngineEvent, frozen=True):
    """The transport saw the connection of handshake attempt ``attempt`` go away.

    ``attempt`` is the one the transport's ``add_peer`` was given (``AddPeer.attempt``): a report
    about a connection replaced since is told from one about the current connection. 0 means not
    known (logs of schema 1, an adapter that does not track it): taken as the current connection.
    """

    DROPPABLE: ClassVar[bool] = False

    detail: str = ""
    attempt: int = 0


class EvictRequested(_EngineEvent, frozen=True):
    """Idle eviction (or an operator) asks to forget this engine."""


class EngineQuarantined(_EngineEvent, frozen=True):
    """Derived (production mode): the engine saw an illegal local event and is failed."""

    DERIVED: ClassVar[bool] = True
    reason: str


EventType = (
    Started
    | Tick
    | Collect
    | Dropped
    | SendFailed
    | BadMessage
    | ReadRequested
    | EngineReady
    | EngineFailed
    | HandleDone
    | HandleFailed
    | AbortRequested
    | Promised
    | DeadlinePassed
    | Reported
    | Quarantined
    | BlocksHeld
    | NotificationReceived
    | Heartbeat
    | LeaseExpired
    | StagedDropped
    | EngineWanted
    | HandshakeDone
    | HandshakeFailed
    | PeerAdded
    | PeerDisconnected
    | EvictRequested
    | EngineQuarantined
)
"""The union of every concrete event, for decoding."""

ALL_EVENTS: Final[tuple[type[Event], ...]] = EventType.__args__
