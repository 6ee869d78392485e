"""The producer (prefill-side) request: everything that affects its state machine lives here.

::

    NEW -> HOLDING -> RELEASED        (every expected notification part arrived)
              \\-> EXPIRED             (the lease ran out first: released with a warning)
    NEW -> STAGED -> HOLDING           (notifications that arrived before registration)
              \\-> DISCARDED           (never registered: a remote protocol violation)

Blocks are released exactly once: RELEASED and EXPIRED are terminal, and
whichever of the last notification and the lease expiry comes second finds
the request already released (vLLM PR 24268). Notifications are counted as
distinct parts ``part`` of ``of`` (SGLang 39846); a duplicate, a part out of
range or a disagreement on ``of`` is a remote violation that changes nothing.
Each consumer engine's parts are counted apart (notifications name their
engine): params handed to a second decode engine (a router retrying a request
whose first decode engine died mid-read) are a remote violation, and the hold
is released only when every engine that notified has notified every part, or
at its lease; counted together, one engine's part 0 and the other's part 1
released the blocks while the second engine's rank 0 still read them.
Notifications that arrive before the scheduler registers the request are
staged, bounded in number and kept one lease from the first news of the request
(a notification can only follow the start of its lease, so a lease later the
request cannot still be coming: vLLM PR 43509; a later notification of the same
hold does not move it, one of a later hold under the id does); so are heartbeats
(they follow their params' minting), each moving it to a lease from itself, whose
promise the lease keeps once the hold is registered. Heartbeats extend the
lease from the local time of their arrival: every deadline here is on this
core's clock (vLLM PR 50326).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from pdfsm.commands import FinishedSending
from pdfsm.events import BlocksHeld, Heartbeat, LeaseExpired, NotificationReceived, StagedDropped
from pdfsm.fsm import Fault, Go, Ignore, Illegal, Machine, State, Table, on

if TYPE_CHECKING:
    from pdfsm.core import Core

__all__ = ["MAX_READERS", "TABLE", "ProducerRequest", "ProducerState"]

MAX_READERS: Final = 8
"""Consumer engines counted apart on one hold. A hold read by more (a peer naming a new engine on
each notice) is crowded: only its lease releases it, and it stays bounded."""


class ProducerState:
    NEW: Final[State] = State("NEW")
    STAGED: Final[State] = State("STAGED")
    HOLDING: Final[State] = State("HOLDING")
    RELEASED: Final[State] = State("RELEASED", terminal=True)
    EXPIRED: Final[State] = State("EXPIRED", terminal=True)
    DISCARDED: Final[State] = State("DISCARDED", terminal=True)


S = ProducerState


class ProducerRequest(Machine):
    """A prefill-side request's data. Only the owner thread, through the table, changes it."""

    __slots__ = ("block_ids", "consumer", "deadline", "extended_to", "issued", "of", "others", "outcome", "parts",
                 "promised_for", "read_noticed", "request_id", "t_start")

    def __init__(self, request_id: str) -> None:
        super().__init__(S.NEW)
        self.request_id = request_id
        self.block_ids: tuple[int, ...] = ()
        self.of = 0  # parts expected, learnt from the first notification
        self.parts = 0  # bit i: part i has notified
        self.consumer = ""  # the consumer engine those parts are from ("": not said)
        # Any other consumer engine's (of, parts): params handed to two decode engines (None: one).
        # At most MAX_READERS - 1 of them; past that the hold is crowded: only its lease ends it.
        self.others: dict[str, tuple[int, int]] | None = None
        self.deadline = 0
        # A heartbeat that arrived before registration promised the lease this long (None: none did;
        # 0 and negative are real times).
        self.extended_to: int | None = None
        self.outcome = ""
        self.t_start = 0
        self.issued = 0  # the hold's params' issue time, or the staged notifications' (0: not said)
        self.promised_for = 0  # the issue time of the hold an early heartbeat's promise is for (0: not said)
        self.read_noticed = False  # a staged notice said a read ended (not ``unread``)

    def __repr__(self) -> str:
        return f"ProducerRequest({self.request_id!r}, {self.state})"

    @property
    def complete(self) -> bool:
        """Every consumer engine that notified has notified every part."""
        return self.of > 0 and self.parts == (1 << self.of) - 1 and _others_done(self, None)


def _others_done(m: ProducerRequest, but: str | None) -> bool:
    """Every other consumer engine counted (all but ``but``) has notified every part; a crowded
    hold never has (its lease ends it)."""
    return m.others is None or (len(m.others) < MAX_READERS and all(
        parts == (1 << of) - 1 for consumer, (of, parts) in m.others.items() if consumer != but))


def _uncount(m: ProducerRequest) -> None:
    """Forget the notifications counted (they were of an earlier hold under this id)."""
    m.of = m.parts = 0
    m.consumer, m.others = "", None


# --- guards -----------------------------------------------------------------------------------


def _completes_cleanly(m: ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    """The common case: a well-formed, new part that completes the count.

    With ``0 <= part < of`` and the count agreed on, "new and completing" is "every other part
    is in": the parts so far are all of them but this one (none at all when ``of`` is 1).
    """
    part, of, issued = ev.part, ev.of, ev.issued_wall_ns
    return (0 <= part < of and m.parts == ((1 << of) - 1) ^ (1 << part) and m.of in (0, of)
            and (not issued or not m.issued or abs(issued - m.issued) <= core.hold_skew_ns)
            and m.others is None and _first_consumer(m, ev.consumer))


def _first_consumer(m: ProducerRequest, consumer: str) -> bool:
    """``consumer`` is the consumer engine whose parts ``m.of`` and ``m.parts`` count (or the first)."""
    return not m.of or consumer == m.consumer


def _counted(m: ProducerRequest, ev: NotificationReceived) -> tuple[int, int]:
    """(of, parts) counted so far for ``ev``'s consumer engine ((0, 0): none yet)."""
    if _first_consumer(m, ev.consumer):
        return m.of, m.parts
    return (m.others or {}).get(ev.consumer, (0, 0))


def _another_consumer(m: ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    """The first notice from a second consumer engine: the params went to two decode engines."""
    return not _first_consumer(m, ev.consumer) and (m.others is None or ev.consumer not in m.others)


def _apart(a: int, b: int, core: Core) -> bool:
    """Issue times ``a`` and ``b`` name two holds of one id (0: not said, never apart)."""
    skew = core.hold_skew_ns
    return bool(skew and a and b and abs(a - b) > skew)


def _of_another_hold(m: ProducerRequest, ev: NotificationReceived | Heartbeat, core: Core) -> bool:
    return _apart(ev.issued_wall_ns, m.issued, core)


def _of_a_later_hold(m: ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    return m.issued < ev.issued_wall_ns and _apart(ev.issued_wall_ns, m.issued, core)


def _staged_for_another_hold(m: ProducerRequest, ev: BlocksHeld, core: Core) -> bool:
    return m.of > 0 and _apart(ev.issued_wall_ns, m.issued, core)


def _on_our_clock(m: ProducerRequest, ev: BlocksHeld, core: Core) -> bool:
    """The common case: no deadline given (the configured lease), or one on this core's clock."""
    return ev.deadline is None or ev.deadline.clock == core.clock


def _foreign_deadline(m: ProducerRequest, ev: BlocksHeld, core: Core) -> bool:
    return not _on_our_clock(m, ev, core)


def _malformed(m: ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    return not 0 <= ev.part < ev.of


def _unread(m: ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    return ev.unread


def _only_unread_notices(m: ProducerRequest, ev: LeaseExpired, core: Core) -> bool:
    """Every staged notice said its consumer took nothing: a release of a hold forgotten since (a
    late notice, heartbeats having kept the consumer telling) or of one never registered here (a
    wrong id, vLLM PR 36958): the producer cannot tell which, but nothing was read."""
    return m.of > 0 and not m.read_noticed


def _disagrees_on_count(m: ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    return _counted(m, ev)[0] not in (0, ev.of)


def _duplicate(m: ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    return (_counted(m, ev)[1] >> ev.part) & 1 == 1


def _completes(m: ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    """With this part, every consumer engine that notified has notified every part."""
    if _counted(m, ev)[1] | 1 << ev.part != (1 << ev.of) - 1:
        return False
    if _first_consumer(m, ev.consumer):
        return _others_done(m, None)
    return m.parts == (1 << m.of) - 1 and _others_done(m, ev.consumer)


def _staged_complete(m: ProducerRequest, ev: BlocksHeld, core: Core) -> bool:
    return m.complete


def _only_heartbeats(m: ProducerRequest, ev: object, core: Core) -> bool:
    return m.of == 0


# --- actions ----------------------------------------------------------------------------------


def _hold(m: ProducerRequest, ev: BlocksHeld, core: Core) -> None:
    m.block_ids = ev.block_ids
    m.issued = ev.issued_wall_ns
    t = m.t_start = ev.t_ns
    deadline = m.deadline = ev.deadline.t_ns if ev.deadline is not None else t + core.lease_ns
    core.leases.arm(m.request_id, deadline)


def _hold_staged(m: ProducerRequest, ev: BlocksHeld, core: Core) -> None:
    core.leases.disarm(m.request_id, m.deadline)  # the staging time no longer applies
    core.unstage(m)
    _hold(m, ev, core)
    if _apart(m.promised_for, ev.issued_wall_ns, core):  # a late heartbeat of an earlier hold: not ours
        m.extended_to = None
    _keep_promise(m, core)


def _keep_promise(m: ProducerRequest, core: Core) -> None:
    """An early heartbeat promised the lease longer than its deadline now: keep that promise."""
    if m.extended_to is not None and m.extended_to > m.deadline:
        _move_deadline(m, m.extended_to, core)


def _move_deadline(m: ProducerRequest, deadline: int, core: Core) -> None:
    """The hold's lease, or its staging, now ends at ``deadline``."""
    core.leases.disarm(m.request_id, m.deadline)
    m.deadline = deadline
    core.leases.arm(m.request_id, deadline)


def _release(m: ProducerRequest, expired: bool, t_ns: int, core: Core) -> None:
    if not expired:
        core.leases.disarm(m.request_id, m.deadline)
    m.deadline = 0
    core.emit(FinishedSending(request_id=m.request_id, block_ids=m.block_ids, expired=expired))
    core.finished(m, "expired" if expired else "released", t_ns)


def _hold_over_stale(m: ProducerRequest, ev: BlocksHeld, core: Core) -> None:
    """The staged notifications were of an earlier hold under this id (a late notice for a hold
    forgotten since): they do not count toward this one."""
    _uncount(m)
    _hold_staged(m, ev, core)


def _hold_and_release(m: ProducerRequest, ev: BlocksHeld, core: Core) -> None:
    _hold_staged(m, ev, core)
    _release(m, False, ev.t_ns, core)


def _count(m: ProducerRequest, ev: NotificationReceived, core: Core) -> None:
    consumer, of, part = ev.consumer, ev.of, ev.part  # read once: each read of an event is a lookup
    if _first_consumer(m, consumer):
        m.of, m.consumer = of, consumer
        m.parts |= 1 << part
    else:
        others = m.others = m.others or {}
        if consumer in others or len(others) < MAX_READERS:  # past the bound, one more marks it crowded
            others[consumer] = (of, others.get(consumer, (0, 0))[1] | 1 << part)
    if not m.issued:  # staged after a heartbeat, or a hold that did not say: the first to say names it
        m.issued = ev.issued_wall_ns


def _count_staged(m: ProducerRequest, ev: NotificationReceived, core: Core) -> None:
    _count(m, ev, core)
    m.read_noticed = m.read_noticed or not ev.unread


def _stage(m: ProducerRequest, ev: NotificationReceived, core: Core) -> None:
    _count_staged(m, ev, core)  # names the staged hold by this notification's issue time
    m.t_start = ev.t_ns
    m.deadline = ev.t_ns + core.lease_ns  # its lease started before it was sent: keep it a lease
    core.stage(m)


def _restage(m: ProducerRequest, ev: NotificationReceived, core: Core) -> None:
    """Staged notices of an earlier hold under this id give way to a later hold's: the later one is
    the hold the scheduler is about to register (or has, on the minting rank)."""
    _uncount(m)
    m.issued = 0
    m.read_noticed = False
    _move_deadline(m, max(m.deadline, ev.t_ns + core.lease_ns), core)
    _count_staged(m, ev, core)


def _stage_heartbeat(m: ProducerRequest, ev: Heartbeat, core: Core) -> None:
    """A heartbeat before registration (like an early notification): remember its promise, kept
    by the lease once the hold registers; staged one lease, as a notification (from the latest
    heartbeat: _extend_staged)."""
    m.t_start = ev.t_ns
    m.extended_to = ev.t_ns + ev.extend_ns
    m.promised_for = ev.issued_wall_ns
    # Staged one lease, as a notification: the hold it names follows its params' minting, so a
    # lease later it is not coming. Staged until the promise's end (up to an hour), a peer's
    # heartbeats for ids never held here filled staging and shut early notifications out (found
    # by a helper's hunt); the promise is kept by the lease once the hold registers.
    m.deadline = ev.t_ns + core.lease_ns
    core.stage(m)


def _extend_staged(m: ProducerRequest, ev: Heartbeat, core: Core) -> None:
    """Promises of one hold merge; of two holds of a reused id, only the later hold's stands (its
    hold is the one to come: a late heartbeat of the earlier one must not pin it for an hour)."""
    promised = ev.t_ns + ev.extend_ns
    # Staged a lease from the latest news of the hold: counted from the first heartbeat, a hold
    # registering later lost the later ones' promise and expired at once (found by a review).
    staged_until = max(m.deadline, ev.t_ns + core.lease_ns)
    if _apart(m.promised_for, ev.issued_wall_ns, core):
        if ev.issued_wall_ns < m.promised_for:
            return
        m.extended_to = None
        staged_until = ev.t_ns + core.lease_ns  # the later hold's staging time
    _move_deadline(m, staged_until, core)
    m.extended_to = promised if m.extended_to is None else max(m.extended_to, promised)
    m.promised_for = max(m.promised_for, ev.issued_wall_ns)  # the latest hold said (0: none)
    core.promise(m, ev.t_ns)


def _count_and_release(m: ProducerRequest, ev: NotificationReceived, core: Core) -> None:
    _count(m, ev, core)
    rid = m.request_id
    core.leases.disarm(rid, m.deadline)  # _release, spelt out: once per request
    m.deadline = 0
    core.emit(FinishedSending(request_id=rid, block_ids=m.block_ids))
    if core.log_info:  # the one line per finished request; the outcome is recorded either way
        core.finished(m, "released", ev.t_ns)
    else:
        m.outcome = "released"


def _extend(m: ProducerRequest, ev: Heartbeat, core: Core) -> None:
    deadline = ev.t_ns + ev.extend_ns  # rebased: the extension runs from our own arrival time
    if deadline > m.deadline:
        _move_deadline(m, deadline, core)


def _expire(m: ProducerRequest, ev: LeaseExpired, core: Core) -> None:
    _release(m, True, ev.t_ns, core)


def _discard(m: ProducerRequest, ev: LeaseExpired | StagedDropped, core: Core) -> None:
    core.leases.disarm(m.request_id, m.deadline)
    m.deadline = 0
    core.unstage(m)
    core.finished(m, "discarded", ev.t_ns)


# --- the table --------------------------------------------------------------------------------

local, remote = Fault.LOCAL, Fault.REMOTE
_bad_part = Illegal(remote, "part out of range", when=_malformed)
_bad_count = Illegal(remote, "notification parts disagree on how many to expect", when=_disagrees_on_count)
_dup = Illegal(remote, "duplicate notification for a part already counted", when=_duplicate)
_reused = Illegal(local, "request id reused after release")
_other_hold = Illegal(remote, "notification of another hold of this request id (its params were issued at "
                              "another time): a late notice, not this hold's", when=_of_another_hold)
_TWO_CONSUMERS_TAIL: Final = ("(its params went to two decode engines): released when every engine that "
                               "notified has notified every part, or at the lease")
_two_consumers = f"a second consumer engine read this hold {_TWO_CONSUMERS_TAIL}"


def _name_consumers(m: ProducerRequest, ev: NotificationReceived, core: Core) -> str:
    """The violation's reason with both engines named ("" is a consumer that did not say)."""
    def name(c: str) -> str:
        return repr(c) if c else "(not named: an older consumer)"

    return (f"a second consumer engine, {name(ev.consumer)}, read this hold after {name(m.consumer)} "
            f"{_TWO_CONSUMERS_TAIL}")

TABLE: Final[Table] = Table(
    "producer",
    states=(S.NEW, S.STAGED, S.HOLDING, S.RELEASED, S.EXPIRED, S.DISCARDED),
    initial=S.NEW,
    events=(BlocksHeld, NotificationReceived, Heartbeat, LeaseExpired, StagedDropped),
    cells=(
        on(
            S.NEW,
            BlocksHeld,
            Go(S.HOLDING, _hold, when=_on_our_clock),
            Illegal(local, "deadline is on another clock: rebase it first"),
        ),
        on(S.NEW, NotificationReceived, _bad_part, Go(S.STAGED, _stage)),
        on(S.NEW, Heartbeat, Go(S.STAGED, _stage_heartbeat)),
        on(S.NEW, (LeaseExpired, StagedDropped), Illegal(local, "no such request")),
        # STAGED: notifications arrived before the scheduler registered the blocks.
        on(
            S.STAGED,
            BlocksHeld,
            Illegal(local, "deadline is on another clock: rebase it first", when=_foreign_deadline),
            Go(S.HOLDING, _hold_over_stale, when=_staged_for_another_hold, fault=remote,
               reason="staged notifications were of an earlier hold of this request id: not counted"),
            Go(S.RELEASED, _hold_and_release, when=_staged_complete),
            Go(S.HOLDING, _hold_staged),
        ),
        on(S.STAGED, NotificationReceived, _bad_part,
           Go(S.STAGED, _restage, when=_of_a_later_hold, fault=remote,
              reason="staged notifications were of an earlier hold of this request id: replaced"),
           _other_hold, Go(S.STAGED, _count_staged, when=_another_consumer, fault=remote, reason=_two_consumers,
                           explain=_name_consumers),
           _bad_count, _dup, Go(S.STAGED, _count_staged)),
        on(S.STAGED, Heartbeat, Go(S.STAGED, _extend_staged)),
        on(
            S.STAGED,
            LeaseExpired,
            Go(S.DISCARDED, _discard, when=_only_heartbeats, fault=remote,
               reason="heartbeats for a request that was never registered"),
            Go(S.DISCARDED, _discard, when=_only_unread_notices, fault=remote,
               reason="release notices for a request not held here: never registered, or a hold that expired and "
                      "was forgotten since (a late release; nothing was read)"),
            Go(S.DISCARDED, _discard, fault=remote, reason="notification for a request that was never registered"),
        ),
        on(S.STAGED, StagedDropped, Go(S.DISCARDED, _discard, fault=remote,
                                       reason="staged notifications dropped: staging is full")),
        # HOLDING: counting distinct parts under a lease.
        on(S.HOLDING, BlocksHeld, Illegal(local, "blocks already held for this request id")),
        on(
            S.HOLDING,
            NotificationReceived,
            Go(S.RELEASED, _count_and_release, when=_completes_cleanly),
            _bad_part,
            _other_hold,
            Go(S.HOLDING, _count, when=_another_consumer, fault=remote, reason=_two_consumers,
               explain=_name_consumers),
            _bad_count,
            _dup,
            Go(S.RELEASED, _count_and_release, when=_completes),
            Go(S.HOLDING, _count),
        ),
        on(S.HOLDING, Heartbeat,
           Ignore("heartbeat of another hold of this request id (its params were issued at another time)",
                  when=_of_another_hold),
           Go(S.HOLDING, _extend)),
        on(S.HOLDING, LeaseExpired, Go(S.EXPIRED, _expire, fault=remote,
                                       reason="lease expired before every consumer part notified")),
        on((S.HOLDING, S.RELEASED, S.EXPIRED, S.DISCARDED), StagedDropped, Illegal(local, "not staged")),
        # Terminal: late and duplicate news.
        on((S.RELEASED, S.EXPIRED, S.DISCARDED), BlocksHeld, _reused),
        on(S.RELEASED, NotificationReceived,
           Illegal(remote, "notification for a request already released: duplicate or late")),
        on(S.EXPIRED, NotificationReceived, _bad_part,
           Ignore("a late release: the consumer says it takes nothing from this rank", when=_unread),
           Illegal(remote, "notification after the lease expired: that read may have seen reused blocks")),
        on(S.DISCARDED, NotificationReceived, Illegal(remote, "notification for a discarded request")),
        on((S.RELEASED, S.DISCARDED), Heartbeat, Ignore("already released")),
        on(S.EXPIRED, Heartbeat, Illegal(remote, "heartbeat after the lease expired")),
        on(S.RELEASED, LeaseExpired, Ignore("already released by its notifications")),
        on((S.EXPIRED, S.DISCARDED), LeaseExpired, Ignore("already expired")),
    ),
)
