"""The remote engine, keyed by (engine_id, pp_rank): everything that affects its machine lives here.

::

    UNKNOWN -> HANDSHAKING -> CONNECTING -> CONNECTED -> EVICTED
                    |              |            \\-> DISCONNECTED -> HANDSHAKING ...
                    +--------------+-> FAILED -> HANDSHAKING (a later request retries)

- One handshake per engine: requests that arrive while it runs join its
  waiting list, and every one of them hears the outcome (vLLM PR 26171); one
  naming another address is set aside and asks again when the attempt ends.
- The reply is validated in a fixed order: compatibility hash, engine id
  (the error names both ids: vLLM PR 39907, issue 27083), layout, and only
  then PP support (vLLM PR 43720). Metadata is keyed by (pp_rank, tp_rank).
- The handshake thread only reports; the transport adds the peer on the owner
  thread (:class:`~pdfsm.commands.AddPeer`), so NIXL is never touched from two
  threads at once (SGLang PR 28897). Replies carry the attempt number they
  answer, so a stale reply from an earlier attempt is ignored.
- A connected engine is evicted only when no transfer to it is in flight
  (vLLM PR 54689); a disconnected one is handshaken again before reuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import msgspec

from pdfsm.commands import AddPeer, DropPeer, SendNotification, StartHandshake
from pdfsm.errors import (
    CompatibilityMismatch,
    EngineIdMismatch,
    HandshakeError,
    LayoutMismatch,
    UnsupportedPP,
)
from pdfsm.events import (
    EngineFailed,
    EngineQuarantined,
    EngineReady,
    EngineWanted,
    EvictRequested,
    HandshakeDone,
    HandshakeFailed,
    HandshakeReply,
    PeerAdded,
    PeerDisconnected,
    ReadRequested,
    Source,
)
from pdfsm.fsm import Fault, Go, Ignore, Illegal, Machine, State, Table, on
from pdfsm.topology import heads_agree, heads_problem

if TYPE_CHECKING:
    from pdfsm.core import Core

__all__ = ["TABLE", "EngineState", "RemoteEngine", "ask_owed_eviction", "pay_drop", "validate_reply"]


class EngineState:
    UNKNOWN: Final[State] = State("UNKNOWN")
    HANDSHAKING: Final[State] = State("HANDSHAKING")
    CONNECTING: Final[State] = State("CONNECTING")
    CONNECTED: Final[State] = State("CONNECTED")
    FAILED: Final[State] = State("FAILED")
    DISCONNECTED: Final[State] = State("DISCONNECTED")
    EVICTED: Final[State] = State("EVICTED", terminal=True)


S = EngineState


class RemoteEngine(Machine):
    """What this worker knows of one remote engine at one PP rank."""

    __slots__ = (
        "aside",
        "attempt",
        "drop_owed",
        "engine_id",
        "error",
        "evict_owed",
        "host",
        "idle_at",
        "idle_since",
        "incarnations",
        "notices",
        "num_blocks",
        "port",
        "pp_rank",
        "readers",
        "reply",
        "reply_pp",
        "reply_tp",
        "retry_at",
        "stalled",
        "started_ns",
        "waiters",
    )

    def __init__(self, key: tuple[str, int]) -> None:
        super().__init__(S.UNKNOWN)
        self.engine_id, self.pp_rank = key
        self.attempt = 0
        self.host = ""
        self.port = 0
        self.waiters: dict[str, None] = {}  # request ids waiting for the handshake, in order
        # Requests that want it at another address than the attempt running (a producer that moved,
        # stale params still about): asked again when that attempt ends (_ask_aside), in order.
        self.aside: dict[str, EngineWanted] = {}
        # Notifications owed once connected by requests that stopped while it handshook:
        # (their params, their trust bound, the notice); sent by consumer.send_owed.
        self.notices: list[tuple[ReadRequested, int, SendNotification]] = []
        self.readers = 0  # requests holding it: told it is ready, or reading from it
        self.drop_owed = False  # lost while held: its peer is dropped when the last reader lets go (pay_drop)
        self.evict_owed = False  # eviction asked while held: asked again when the last reader lets go
        # A cancelled read of it outlived cancel_grace_ns: new requests fail fast until a reader
        # lets go (a read of it stopped: the peer answers again).
        self.stalled = False
        self.reply: HandshakeReply | None = None
        # What every request's params are checked against, from the reply (set with it, by
        # connect): native fields, where the reply's are generic attribute reads from compiled code.
        self.reply_tp = self.reply_pp = self.num_blocks = 0
        self.started_ns = 0  # its reply's latest rank start (wall clock; 0: none said)
        self.incarnations: frozenset[str] = frozenset()  # its ranks' incarnations
        self.error: HandshakeError | None = None
        self.retry_at = 0
        self.idle_since = 0  # when it last failed, disconnected, connected or was read from
        self.idle_at: int | None = None  # its one armed idle timer (Core.idle), if any

    def __repr__(self) -> str:
        return f"RemoteEngine({self.engine_id!r}, pp_rank={self.pp_rank}, {self.state})"

    def connect(self, reply: HandshakeReply) -> None:
        """Keep the validated reply, and what each request is checked against (consumer._contradiction)."""
        self.reply = reply
        self.reply_tp, self.reply_pp, self.num_blocks = reply.tp_size, reply.pp_size, reply.num_blocks
        self.started_ns = max((rank.started_wall_ns for rank in reply.ranks), default=0)
        self.incarnations = frozenset(rank.incarnation for rank in reply.ranks)

    def elsewhere(self, host: str, port: int) -> bool:
        """``host:port`` is another address than the one it was handshaken at (port 0: none given)."""
        return bool(port and self.port and (port != self.port or host != self.host))

    def pausing(self, t_ns: int, host: str, port: int) -> bool:
        """Within the pause after a failed handshake, at the address that failed: a request now
        fails at once; an address not tried yet (a producer that moved) is handshaken now."""
        return t_ns < self.retry_at and not self.elsewhere(host, port)

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.pp_rank)

    @property
    def usable(self) -> bool:
        """Connected, and not stalled: a request may read from it now (else the table decides)."""
        return self.state is S.CONNECTED and not self.stalled


def validate_reply(m: RemoteEngine, reply: HandshakeReply, core: Core) -> HandshakeError | None:
    """The first problem with a handshake reply, in the documented order, or None."""
    cfg = core.config
    if reply.compat_hash != cfg.compat_hash:
        return CompatibilityMismatch(cfg.compat_hash, reply.compat_hash)
    if reply.engine_id != m.engine_id:
        return EngineIdMismatch(m.engine_id, reply.engine_id)
    big, small = max(cfg.tp_size, reply.tp_size), min(cfg.tp_size, reply.tp_size)
    if small < 1 or big % small:
        return LayoutMismatch(f"TP sizes do not divide one another: local {cfg.tp_size}, remote {reply.tp_size}")
    if reply.block_size != cfg.block_size:
        return LayoutMismatch(f"block sizes differ: local {cfg.block_size}, remote {reply.block_size}")
    if reply.mla != cfg.mla:
        return LayoutMismatch(f"MLA differs: local {cfg.mla}, remote {reply.mla}")
    if not heads_agree(cfg.kv_heads, reply.kv_heads, cfg.tp_size, reply.tp_size):
        return LayoutMismatch(f"KV heads differ: local {cfg.kv_heads}, remote {reply.kv_heads}")
    why = heads_problem(reply.tp_size, cfg.kv_heads) if cfg.kv_heads else None
    if why is not None:
        return LayoutMismatch(f"remote TP {reply.tp_size}: {why}")
    if not 0 <= m.pp_rank < reply.pp_size:
        return LayoutMismatch(f"remote has PP size {reply.pp_size}, no pp_rank {m.pp_rank}")
    keys = sorted((r.pp_rank, r.tp_rank) for r in reply.ranks)
    if keys != [(m.pp_rank, t) for t in range(reply.tp_size)]:
        return LayoutMismatch(
            f"metadata must be keyed by (pp_rank, tp_rank) for pp_rank {m.pp_rank} and every "
            f"tp_rank below {reply.tp_size}; got {keys}"
        )
    if m.pp_rank > 0 and not cfg.supports_pp:
        return UnsupportedPP(m.pp_rank)
    return None


# --- guards -----------------------------------------------------------------------------------


def _pp_unsupported(m: RemoteEngine, ev: EngineWanted, core: Core) -> bool:
    return m.pp_rank > 0 and not core.config.supports_pp


def _stale(m: RemoteEngine, ev: HandshakeDone | HandshakeFailed | PeerAdded, core: Core) -> bool:
    return ev.attempt != m.attempt


def _stale_loss(m: RemoteEngine, ev: PeerDisconnected, core: Core) -> bool:
    return ev.attempt not in (0, m.attempt)  # 0: not known, taken as the current connection


def _reply_refused(m: RemoteEngine, ev: HandshakeDone, core: Core) -> bool:
    return validate_reply(m, ev.reply, core) is not None


def _not_waiting(m: RemoteEngine, ev: EngineWanted, core: Core) -> bool:
    """The request no longer waits for this engine: it stopped after the request was derived and
    before it was applied (a request set aside asks again after the attempt ends, in the same
    cascade as a sibling stage's failure that ended it)."""
    c = core.consumers.get(ev.request_id)
    return c is None or c.req is None or c.req.engine_id != m.engine_id or not (c.waiting >> m.pp_rank) & 1


def _wanted_elsewhere(m: RemoteEngine, ev: EngineWanted, core: Core) -> bool:
    return m.elsewhere(ev.host, ev.port)


def _retry_later(m: RemoteEngine, ev: EngineWanted, core: Core) -> bool:
    return m.pausing(ev.t_ns, ev.host, ev.port)


def _stalled(m: RemoteEngine, ev: EngineWanted, core: Core) -> bool:
    return m.stalled


def _transfers_in_flight(m: RemoteEngine, ev: EvictRequested, core: Core) -> bool:
    return m.readers > 0


def _stalled_and_held(m: RemoteEngine, ev: EvictRequested, core: Core) -> bool:
    return m.stalled and m.readers > 0


# --- actions ----------------------------------------------------------------------------------


def _start(m: RemoteEngine, ev: EngineWanted, core: Core) -> None:
    # Handshaken again while a reader of the lost connection still reads or stops: a clean slate;
    # its reads end over the transport's drain (transports.md, the drop rule).
    pay_drop(m, core)
    m.evict_owed = m.stalled = False  # a new connection: what was owed by, or seen of, the old one is moot
    if not m.attempt:
        # A fresh machine for a key seen before (forgotten since) numbers its attempts above every
        # earlier one's, so a late answer to the forgotten machine's attempt is recognized stale.
        m.attempt = core.engines_forgotten << 32
    m.attempt += 1
    m.host, m.port = ev.host, ev.port
    m.error = None
    m.waiters[ev.request_id] = None
    core.handshake_started(m, ev.t_ns)
    core.emit(StartHandshake(engine_id=m.engine_id, pp_rank=m.pp_rank, attempt=m.attempt, host=ev.host, port=ev.port))


def _join(m: RemoteEngine, ev: EngineWanted, core: Core) -> None:
    m.waiters[ev.request_id] = None


def _set_aside(m: RemoteEngine, ev: EngineWanted, core: Core) -> None:
    m.aside[ev.request_id] = ev


def _ask_aside(m: RemoteEngine, core: Core, t_ns: int) -> None:
    """The attempt ended: the requests set aside want the engine again, now, and the table decides
    as for any request arriving now (a failed address is no reason to fail them: theirs is
    handshaken; a connection at another address is judged against their params)."""
    aside, m.aside = m.aside, {}
    for ev in aside.values():
        core.derive(msgspec.structs.replace(ev, t_ns=t_ns))


def _tell_waiters(m: RemoteEngine, core: Core, t_ns: int) -> None:
    waiters, m.waiters = m.waiters, {}
    if m.error is None:
        for rid in waiters:
            core.derive(EngineReady(source=Source.CORE, t_ns=t_ns, request_id=rid,
                                    engine_id=m.engine_id, pp_rank=m.pp_rank))
    else:
        error, remote = str(m.error), m.error.remote_fault
        for rid in waiters:
            core.derive(EngineFailed(source=Source.CORE, t_ns=t_ns, request_id=rid, engine_id=m.engine_id,
                                     pp_rank=m.pp_rank, error=error, remote_fault=remote))


def _fail(m: RemoteEngine, error: HandshakeError, t_ns: int, core: Core, *, drop: bool) -> None:
    m.error = error
    m.reply = None
    # Nobody to tell at this address: those producers release at their lease. Notices owed at
    # another address (requests set aside that stopped) wait for a handshake there.
    m.notices = [owed for owed in m.notices if m.elsewhere(owed[0].host, owed[0].port)]
    m.retry_at = t_ns + core.config.handshake_retry_ns
    if drop:
        core.emit(DropPeer(engine_id=m.engine_id, pp_rank=m.pp_rank))
    _tell_waiters(m, core, t_ns)
    _ask_aside(m, core, t_ns)
    core.engine_idle(m, t_ns)


def _refuse_pp(m: RemoteEngine, ev: EngineWanted, core: Core) -> None:
    m.waiters[ev.request_id] = None
    _fail(m, UnsupportedPP(m.pp_rank), ev.t_ns, core, drop=False)


def _refuse_reply(m: RemoteEngine, ev: HandshakeDone, core: Core) -> None:
    error = validate_reply(m, ev.reply, core)
    assert error is not None
    _fail(m, error, ev.t_ns, core, drop=False)


def _explain(m: RemoteEngine, ev: object, core: Core) -> str:
    return str(m.error)


def _add_peer(m: RemoteEngine, ev: HandshakeDone, core: Core) -> None:
    m.connect(ev.reply)
    core.emit(AddPeer(engine_id=m.engine_id, pp_rank=m.pp_rank, attempt=m.attempt, reply=ev.reply))


def _connected(m: RemoteEngine, ev: PeerAdded, core: Core) -> None:
    # Sibling stages this connection replaces (another PP size, not newer): a producer restarted
    # with another PP split, its old stage's loss unseen. They would claim layers this stage holds,
    # and every read would be refused until they idled out: evicted (owed while a read holds one),
    # and what their replies say no longer counts against the notices owed to this stage.
    stale = {e.pp_rank for e in _other_layouts(m, core) if not _newer(e, m)}
    if m.notices:
        core.send_owed(m, ev.t_ns, stale)
    for pp in sorted(stale):
        core.derive(EvictRequested(source=Source.CORE, t_ns=ev.t_ns, engine_id=m.engine_id, pp_rank=pp))
    _tell_waiters(m, core, ev.t_ns)
    _ask_aside(m, core, ev.t_ns)
    core.engine_idle(m, ev.t_ns, connected=True)


def _other_layouts(m: RemoteEngine, core: Core) -> list[RemoteEngine]:
    """Stages of this engine id holding a reply of another PP size than ``m``'s (one scan per
    connection: cheap)."""
    assert m.reply is not None
    size = m.reply.pp_size
    return [e for (eid, pp), e in core.engines.items()
            if eid == m.engine_id and pp != m.pp_rank and e.reply is not None and e.reply.pp_size != size]


def _newer(a: RemoteEngine, b: RemoteEngine) -> bool:
    """``a``'s process started after ``b``'s, both said (their replies' latest rank starts)."""
    return bool(a.started_ns and b.started_ns) and a.started_ns > b.started_ns


def _superseded(m: RemoteEngine, ev: PeerAdded, core: Core) -> bool:
    """A connected sibling stage says another PP size and its process started after ``m``'s: the
    reply ``m`` is connecting with is of the process that one replaced (_connected evicts only
    older siblings)."""
    return any(e.state is S.CONNECTED and _newer(e, m) for e in _other_layouts(m, core))


def _refuse_superseded(m: RemoteEngine, ev: PeerAdded, core: Core) -> None:
    _fail(m, HandshakeError("the reply is of a producer process replaced since: a sibling stage's newer "
                            "reply says another PP size"), ev.t_ns, core, drop=True)
    m.retry_at = ev.t_ns  # the new process is there: the next request handshakes it at once


def _handshake_failed(m: RemoteEngine, ev: HandshakeFailed, core: Core) -> None:
    _fail(m, HandshakeError(ev.error), ev.t_ns, core, drop=m.state is S.CONNECTING)


def _lost_while_connecting(m: RemoteEngine, ev: PeerDisconnected, core: Core) -> None:
    _fail(m, HandshakeError(f"peer disconnected while connecting: {ev.detail}"), ev.t_ns, core, drop=True)


def _quarantine(m: RemoteEngine, ev: EngineQuarantined, core: Core) -> None:
    drop = m.state is S.CONNECTING or m.state is S.CONNECTED
    error = HandshakeError(f"quarantined: {ev.reason}")
    error.remote_fault = False
    _fail(m, error, ev.t_ns, core, drop=drop)


def _refuse_stalled(m: RemoteEngine, ev: EngineWanted, core: Core) -> None:
    """Fail the request now, with its policy: a READ posted into a peer that no longer answers
    would pin its blocks behind the hung ones for as long as the hang lasts."""
    grace = core.cancel_grace_ns
    core.derive(EngineFailed(source=Source.CORE, t_ns=ev.t_ns, request_id=ev.request_id, engine_id=m.engine_id,
                             pp_rank=m.pp_rank, remote_fault=True,
                             error=f"{m.engine_id} (pp {m.pp_rank}) does not answer: a cancelled read of it still ran "
                                   f"{grace / 1e9:g} s later (cancel_grace_ns)"))


def _ready_now(m: RemoteEngine, ev: EngineWanted, core: Core) -> None:
    core.derive(EngineReady(source=Source.CORE, t_ns=ev.t_ns, request_id=ev.request_id,
                            engine_id=m.engine_id, pp_rank=m.pp_rank))


def _fail_fast(m: RemoteEngine, ev: EngineWanted, core: Core) -> None:
    m.waiters[ev.request_id] = None
    _tell_waiters(m, core, ev.t_ns)


def _owe_eviction(m: RemoteEngine, ev: EvictRequested, core: Core) -> None:
    """Asked to evict while requests still read from it (params that contradict its reply: a
    producer restarted behind the same engine id and address while an old read drains). It cannot
    go yet (vLLM PR 54689), but must go as soon as it can: otherwise every request for the
    restarted producer is refused until one more arrives after the drain (SGLang PR 34289)."""
    m.evict_owed = True


def ask_owed_eviction(m: RemoteEngine, core: Core, t_ns: int) -> None:
    """The last reader let go of an engine whose eviction was asked while held: ask again now."""
    if m.evict_owed and not m.readers:
        m.evict_owed = False
        core.derive(EvictRequested(source=Source.CORE, t_ns=t_ns, engine_id=m.engine_id, pp_rank=m.pp_rank))


def _forget(m: RemoteEngine, ev: EvictRequested, core: Core) -> None:
    core.engines_forgotten += 1


def _evict(m: RemoteEngine, ev: EvictRequested, core: Core) -> None:
    _drop(m, ev, core)
    _forget(m, ev, core)


def _drop(m: RemoteEngine, ev: PeerDisconnected | EvictRequested, core: Core) -> None:
    m.reply = None
    core.emit(DropPeer(engine_id=m.engine_id, pp_rank=m.pp_rank))


def _lost(m: RemoteEngine, ev: PeerDisconnected | EvictRequested, core: Core) -> None:
    """One rank's loss ends the stage's connection. Requests still reading it stop first: their
    cancelled reads end, then they notify the stage's live ranks, which needs the peer, so the
    drop waits for the last of them (pay_drop, from the consumer letting go)."""
    if m.readers:
        m.reply = None
        m.drop_owed = True
    else:
        _drop(m, ev, core)
    core.engine_idle(m, ev.t_ns)


def _lost_stalled(m: RemoteEngine, ev: EvictRequested, core: Core) -> None:
    """Taken as lost while held: the reads still running over it are cancelled first (a stalled
    read nobody cancelled would go on writing blocks nobody watches once its request is told)."""
    core.cancel_reads_over(m)
    _lost(m, ev, core)


def pay_drop(m: RemoteEngine, core: Core) -> None:
    """Drop the peer of a connection lost while held (_lost), if that drop is still owed."""
    if m.drop_owed:
        m.drop_owed = False
        core.emit(DropPeer(engine_id=m.engine_id, pp_rank=m.pp_rank))


# --- the table --------------------------------------------------------------------------------

local, remote = Fault.LOCAL, Fault.REMOTE
_replies = (HandshakeDone, HandshakeFailed, PeerAdded)
# A producer that moved under its engine id, stale params still naming the old address: neither
# address's outcome is the other's (vLLM PR 18903, smg issue 2382).
_ELSEWHERE = "wanted at another address than the attempt running: asked again when it ends"
_gone = Ignore("the request no longer waits for it (it stopped before this was applied)", when=_not_waiting)
_stale_ignored = Ignore("reply to an earlier handshake attempt", when=_stale)
_stale_loss_ignored = Ignore("the loss of another attempt's connection, not the current one", when=_stale_loss)

TABLE: Final[Table] = Table(
    "engine",
    states=(S.UNKNOWN, S.HANDSHAKING, S.CONNECTING, S.CONNECTED, S.FAILED, S.DISCONNECTED, S.EVICTED),
    initial=S.UNKNOWN,
    events=(EngineWanted, HandshakeDone, HandshakeFailed, PeerAdded, PeerDisconnected, EvictRequested,
            EngineQuarantined),
    cells=(
        on(
            S.UNKNOWN,
            EngineWanted,
            _gone,
            Go(S.FAILED, _refuse_pp, when=_pp_unsupported, fault=local,
               reason="transport cannot serve pp_rank > 0", explain=_explain),
            Go(S.HANDSHAKING, _start),
        ),
        on(S.UNKNOWN, _replies, Ignore("no handshake in progress: a stale reply")),
        on(S.UNKNOWN, PeerDisconnected, Ignore("not connected")),
        on(S.UNKNOWN, EvictRequested, Ignore("nothing to evict")),
        on(S.UNKNOWN, EngineQuarantined, Ignore("nothing to quarantine")),
        # HANDSHAKING: one handshake, shared by every waiting request.
        on(S.HANDSHAKING, EngineWanted, _gone,
           Go(S.HANDSHAKING, _set_aside, when=_wanted_elsewhere, reason=_ELSEWHERE),
           Go(S.HANDSHAKING, _join)),
        on(
            S.HANDSHAKING,
            HandshakeDone,
            _stale_ignored,
            Go(S.FAILED, _refuse_reply, when=_reply_refused, fault=remote,
               reason="handshake reply refused", explain=_explain),
            Go(S.CONNECTING, _add_peer),
        ),
        on(S.HANDSHAKING, HandshakeFailed, _stale_ignored, Go(S.FAILED, _handshake_failed)),
        on(S.HANDSHAKING, PeerAdded, _stale_ignored,
           Illegal(local, "peer added before its handshake reply was validated")),
        on(S.HANDSHAKING, PeerDisconnected, Ignore("not connected yet")),
        on(S.HANDSHAKING, EvictRequested, Ignore("a handshake is in progress")),
        on((S.HANDSHAKING, S.CONNECTING), EngineQuarantined, Go(S.FAILED, _quarantine)),
        # CONNECTING: the transport is adding the peer on the owner thread.
        on(S.CONNECTING, EngineWanted, _gone,
           Go(S.CONNECTING, _set_aside, when=_wanted_elsewhere, reason=_ELSEWHERE),
           Go(S.CONNECTING, _join)),
        on(S.CONNECTING, HandshakeDone, _stale_ignored, Ignore("a reply was already accepted for this attempt")),
        on(S.CONNECTING, HandshakeFailed, _stale_ignored, Go(S.FAILED, _handshake_failed)),
        on(S.CONNECTING, PeerAdded, _stale_ignored,
           Go(S.FAILED, _refuse_superseded, when=_superseded, fault=remote,
              reason="a sibling stage's newer reply says another PP size", explain=_explain),
           Go(S.CONNECTED, _connected)),
        on(S.CONNECTING, PeerDisconnected, _stale_loss_ignored, Go(S.FAILED, _lost_while_connecting)),
        on(S.CONNECTING, EvictRequested, Ignore("a handshake is in progress")),
        # CONNECTED.
        on(S.CONNECTED, EngineWanted, _gone,
           Go(S.CONNECTED, _refuse_stalled, when=_stalled, reason="stalled: a cancelled read of it has not stopped"),
           Go(S.CONNECTED, _ready_now)),
        on(S.CONNECTED, _replies, Ignore("already connected: a stale reply")),
        on(S.CONNECTED, PeerDisconnected, _stale_loss_ignored, Go(S.DISCONNECTED, _lost)),
        on(
            S.CONNECTED,
            EvictRequested,
            # A stalled stage's readers may never let go (a process stopped for good): owing the
            # eviction to them would lock a replacement under the same engine id out.
            Go(S.DISCONNECTED, _lost_stalled, when=_stalled_and_held,
               reason="stalled, and its reads may never stop: taken as lost, dropped with its last reader"),
            Go(S.CONNECTED, _owe_eviction, when=_transfers_in_flight,
               reason="a request still holds it (reading, or about to): evicted when the last one lets go"),
            Go(S.EVICTED, _evict),
        ),
        on(S.CONNECTED, EngineQuarantined, Go(S.FAILED, _quarantine)),
        # FAILED: the next request retries, after a pause.
        on(S.FAILED, EngineWanted, _gone, Go(S.FAILED, _fail_fast, when=_retry_later), Go(S.HANDSHAKING, _start)),
        on((S.FAILED, S.DISCONNECTED), _replies, Ignore("no handshake in progress: a stale reply")),
        on(S.FAILED, PeerDisconnected, Ignore("not connected")),
        on(S.DISCONNECTED, PeerDisconnected, Ignore("already disconnected")),
        on((S.FAILED, S.DISCONNECTED), EvictRequested,
           Ignore("a request still holds it (a sibling engine handshakes): not evicted", when=_transfers_in_flight),
           Go(S.EVICTED, _forget)),
        on(S.FAILED, EngineQuarantined, Ignore("already failed")),
        on(S.DISCONNECTED, EngineQuarantined, Ignore("not connected")),
        # DISCONNECTED: never reused; handshaken again.
        on(S.DISCONNECTED, EngineWanted, _gone, Go(S.HANDSHAKING, _start)),
        # EVICTED: forgotten; the core starts a fresh machine for the next request.
        on(S.EVICTED, EngineWanted, Illegal(local, "an evicted engine is never reused")),
        on(S.EVICTED, (*_replies, PeerDisconnected, EvictRequested, EngineQuarantined),
           Ignore("evicted: forgotten")),
    ),
)
