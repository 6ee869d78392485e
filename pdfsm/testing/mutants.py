"""Naive policies that plant, one each, the bugs of ../shared/context/bug-corpus.md.

Each :class:`~pdfsm.testing.world.Variant` here is the real machines with one cell decided
the way a connector without a state machine got it wrong, or an adapter quirk, or naive
timers, plus the scenario in which that bug can show. The race tester must find every
one (tests/test_race.py, benchmarks/race_hunt.py); the real machines pass the same scenarios.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from pdfsm import consumer as C
from pdfsm import engine as E
from pdfsm import producer as P
from pdfsm.commands import FinishedSending, HandOff, SendNotification
from pdfsm.core import Tables
from pdfsm.errors import EngineIdMismatch, HandshakeError, UnsupportedPP
from pdfsm.events import (
    AbortRequested,
    BlocksHeld,
    EngineFailed,
    EngineReady,
    EngineWanted,
    EvictRequested,
    HandleDone,
    HandleFailed,
    HandshakeDone,
    HandshakeFailed,
    Heartbeat,
    NotificationReceived,
    ReadRequested,
    Reported,
)
from pdfsm.fsm import Cells, Fault, Go, Ignore, Illegal, on
from pdfsm.testing.world import FAULTS, Scenario, Variant
from pdfsm.timers import Timers
from pdfsm.wire import Notification

if TYPE_CHECKING:
    from pdfsm.core import Core

__all__ = ["MUTANTS", "NaiveTimers"]

local = Fault.LOCAL


def _consumer(name: str, *cells: Cells) -> Tables:
    return Tables(consumer=C.TABLE.patched(name, {k: v for c in cells for k, v in c.items()}))


def _producer(name: str, *cells: Cells) -> Tables:
    return Tables(producer=P.TABLE.patched(name, {k: v for c in cells for k, v in c.items()}))


def _engine(name: str, *cells: Cells) -> Tables:
    return Tables(engine=E.TABLE.patched(name, {k: v for c in cells for k, v in c.items()}))


# --- vLLM PR 39907 / issue 27083: a reply from another engine is accepted -----------------------------


def _refused_unless_engine_id(m: E.RemoteEngine, ev: HandshakeDone, core: Core) -> bool:
    error = E.validate_reply(m, ev.reply, core)
    return error is not None and not isinstance(error, EngineIdMismatch)


def _refuse_other(m: E.RemoteEngine, ev: HandshakeDone, core: Core) -> None:
    E._fail(m, E.validate_reply(m, ev.reply, core) or HandshakeError("?"), ev.t_ns, core, drop=False)


_ENGINE_ID_UNCHECKED = _engine(
    "engine-id-unchecked",
    on(E.S.HANDSHAKING, HandshakeDone, Ignore("stale", when=E._stale),
       Go(E.S.FAILED, _refuse_other, when=_refused_unless_engine_id), Go(E.S.CONNECTING, E._add_peer)),
)

# --- vLLM PR 43720: pp_rank > 0 sent to a transport that cannot serve it ------------------------------

_read_cell = C.TABLE.cells[(C.S.NEW, ReadRequested)]


def _reply_refused_but_pp(m: E.RemoteEngine, ev: HandshakeDone, core: Core) -> bool:
    error = E.validate_reply(m, ev.reply, core)
    return error is not None and not isinstance(error, UnsupportedPP)


# pdfsm refuses pp_rank > 0 twice (the request at once, the engine before any handshake): remove both.
_PP_UNCHECKED = Tables(
    consumer=C.TABLE.patched("pp-unchecked", on(C.S.NEW, ReadRequested, *[
        o for o in _read_cell if o.when not in (C._pp_unsupported, C._pp_unsupported_notify_only)])),
    engine=E.TABLE.patched("pp-unchecked", {
        **on(E.S.UNKNOWN, EngineWanted, Go(E.S.HANDSHAKING, E._start)),
        **on(E.S.HANDSHAKING, HandshakeDone, Ignore("stale", when=E._stale),
             Go(E.S.FAILED, E._refuse_reply, when=_reply_refused_but_pp), Go(E.S.CONNECTING, E._add_peer))}))

# --- vLLM PR 36958: MLA's extra notifications carry the consumer's own request id ---------------------


def _read_done_local_id(m: C.ConsumerRequest, ev: HandleDone, core: Core) -> None:
    plan, req = m.plan, m.req
    assert plan is not None and req is not None
    for pp, tp in plan.notify_only:  # the bug: the local id instead of the producer's
        core.emit(SendNotification(engine_id=req.engine_id, pp_rank=pp, tp_rank=tp,
                                   notification=Notification(m.request_id, plan.part, plan.of,
                                                             consumer=core.config.engine_id)))
    m.done |= m.pending
    m.pending = 0
    C._let_go(m, core, ev.t_ns)
    C._disarm_deadline(m, core)
    core.ready(m)


_done_cell = C.TABLE.cells[(C.S.READING, HandleDone)]
_MLA_LOCAL_ID = _consumer("mla-local-id", on(C.S.READING, HandleDone,
                                             Go(C.S.NOTIFIED, _read_done_local_id, when=C._last_in_flight),
                                             *_done_cell[1:]))

# --- vLLM PR 40364: a handshake failure reported as fatal, ignoring the policy ------------------------


def _engine_failed_fatal(m: C.ConsumerRequest, ev: EngineFailed, core: Core) -> None:
    C._stop_waiting(m, core, ev.t_ns)
    core.emit(HandOff(request_id=m.request_id, outcome="failed", invalid_blocks=m.local_blocks, policy="fail",
                      reason="engine dead"))
    core.finished(m, "failed", ev.t_ns)


_POLICY_IGNORED = _consumer("policy-ignored", on(
    C.S.HANDSHAKING, EngineFailed, Illegal(local, "not waiting", when=C._not_waiting_for_it),
    Go(C.S.RELEASED, C._engine_failed_notify_only, when=C._nothing_to_read),
    Go(C.S.RELEASED, _engine_failed_fatal)))

# --- vLLM PR 20139: no lease on held blocks ------------------------------------------------------------


def _hold_forever(m: P.ProducerRequest, ev: BlocksHeld, core: Core) -> None:
    m.block_ids = ev.block_ids
    m.t_start = ev.t_ns  # the bug: no deadline is armed


_NO_LEASE = _producer("no-lease", on(P.S.NEW, BlocksHeld, Go(P.S.HOLDING, _hold_forever)),
                      on(P.S.STAGED, BlocksHeld, Go(P.S.HOLDING, _hold_forever)))

# --- vLLM PR 24268: released by the last notification and again by expiry -------------------------------


def _release_but_keep(m: P.ProducerRequest, ev: NotificationReceived, core: Core) -> None:
    P._count(m, ev, core)
    core.emit(FinishedSending(request_id=m.request_id, block_ids=m.block_ids))  # the lease stays armed


_DOUBLE_RELEASE = _producer("double-release", on(
    P.S.HOLDING, NotificationReceived, Go(P.S.HOLDING, _release_but_keep, when=P._completes_cleanly),
    *P.TABLE.cells[(P.S.HOLDING, NotificationReceived)][1:]))

# --- vLLM PR 25067: an abort racing with the finish treated as an error --------------------------------

_ABORT_AFTER_FINISH = _consumer("abort-after-finish", on(C.S.RELEASED, AbortRequested,
                                                         Illegal(local, "abort of an unknown request")))

# --- vLLM PR 26171: the handshake failure never reaches the waiting requests ---------------------------


def _failed_silently(m: E.RemoteEngine, ev: HandshakeFailed, core: Core) -> None:
    m.error = HandshakeError(ev.error)
    m.retry_at = ev.t_ns + core.config.handshake_retry_ns
    m.waiters = {}  # the bug: nobody is told


_WAITERS_FORGOTTEN = _engine("waiters-forgotten", on(E.S.HANDSHAKING, HandshakeFailed,
                                                      Ignore("stale", when=E._stale),
                                                      Go(E.S.FAILED, _failed_silently)))

# --- vLLM PR 56104: the first failed handle releases the blocks under its siblings ---------------------


def _fail_at_once(m: C.ConsumerRequest, ev: HandleFailed, core: Core) -> None:
    C._stopped(m, ev)
    m.pending = 0  # the bug: siblings forgotten while they still write
    C._let_go(m, core, ev.t_ns)
    C._disarm_deadline(m, core)
    core.ready(m)


# --- vLLM PR 40364 (its second half): a failed handle post-processed as a success --------------------

_FAILED_AS_DONE = _consumer("failed-as-done", on(
    C.S.READING, HandleFailed, C._not_in_flight_illegal, Go(C.S.NOTIFIED, C._read_done)))

_FIRST_FAILURE_RELEASES = _consumer("first-failure-releases", on(
    C.S.READING, HandleFailed, C._not_in_flight_illegal, Go(C.S.FAILED, _fail_at_once)))

# --- vLLM PR 32255: an abort frees the blocks with a READ in flight ------------------------------------


def _abort_now(m: C.ConsumerRequest, ev: AbortRequested, core: Core) -> None:
    m.pending = 0  # the bug: the read in flight is forgotten
    C._let_go(m, core, ev.t_ns)
    C._disarm_deadline(m, core)
    core.ready(m)


_ABORT_FREES = _consumer("abort-frees-under-read", on(C.S.READING, AbortRequested, Go(C.S.ABORTED, _abort_now)))

# --- vLLM PR 41269: a request aborted while its engine handshakes tells the producer nothing ---------


def _abort_untold(m: C.ConsumerRequest, ev: AbortRequested, core: Core) -> None:
    C._stop_waiting(m, core, ev.t_ns)  # the bug: no notice owed to the stage still handshaking
    core.ready(m)


_ABORT_UNTOLD = _consumer("abort-untold", on(C.S.HANDSHAKING, AbortRequested, Go(C.S.ABORTED, _abort_untold)))

# --- vLLM PR 43509: a notification before registration is dropped --------------------------------------

_EARLY_DROPPED = _producer("early-notification-dropped", on(
    P.S.NEW, NotificationReceived, Ignore("unknown request: dropped")))

# --- vLLM PR 50789 / issue 58222: an expiry scan that stops at the first unexpired entry ----------------


class NaiveTimers(Timers):
    """Leases in insertion order, updated in place; the scan stops at the first unexpired entry,
    so a heartbeat that extends an early lease hides the expired ones behind it."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        super().__init__()
        self._entries: OrderedDict[str, int] = OrderedDict()

    def arm(self, key: str, deadline: int) -> None:
        self._entries[key] = deadline  # an existing key keeps its place

    def disarm(self, key: str, deadline: int) -> None:
        if self._entries.get(key) == deadline:
            del self._entries[key]

    def due(self, now: int) -> list[tuple[int, str]]:
        out = []
        for key, deadline in list(self._entries.items()):
            if deadline > now:
                break
            out.append((deadline, key))
            del self._entries[key]
        return out

    def earliest(self) -> int | None:
        return next(iter(self._entries.values()), None)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries


def _extend_in_place(m: P.ProducerRequest, ev: object, core: Core) -> None:
    deadline = ev.t_ns + ev.extend_ns  # type: ignore[attr-defined]
    if deadline > m.deadline:
        m.deadline = deadline
        core.leases.arm(m.request_id, deadline)  # naive: updated where it stands


# --- vLLM PR 50326: a deadline on the scheduler's clock compared with the worker's ---------------------

_FOREIGN_CLOCK = _producer("foreign-clock-accepted", on(P.S.NEW, BlocksHeld, Go(P.S.HOLDING, P._hold)),
                          on(P.S.STAGED, BlocksHeld, Go(P.S.RELEASED, P._hold_and_release, when=P._staged_complete),
                             Go(P.S.HOLDING, P._hold_staged)))

# --- vLLM PR 57570: a notify-only request reported as received -----------------------------------------


def _notify_and_report(m: C.ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    C._accept(m, ev, core)
    C._notify_unread(m, core, ev.t_ns)
    core.ready(m)  # the bug: the scheduler is not waiting for it


def _notify_and_report_when_ready(m: C.ConsumerRequest, ev: EngineReady, core: Core) -> None:
    m.waiting = 0
    C._let_go(m, core, ev.t_ns)
    C._disarm_deadline(m, core)
    C._notify_unread(m, core, ev.t_ns)
    core.ready(m)  # the bug


_ready_cell = C.TABLE.cells[(C.S.HANDSHAKING, EngineReady)]
_NOTIFY_ONLY_REPORTED = _consumer(
    "notify-only-reported",
    on(C.S.NEW, ReadRequested, *[Go(C.S.NOTIFIED, _notify_and_report, when=C._nothing_to_read)
                                 if o.when is C._nothing_to_read else o for o in _read_cell]),
    on(C.S.HANDSHAKING, EngineReady, *[Go(C.S.NOTIFIED, _notify_and_report_when_ready, when=C._nothing_to_read)
                                       if o.when is C._nothing_to_read else o for o in _ready_cell]))

# --- vLLM PR 54689: idle eviction with a READ in flight --------------------------------------------------

_EVICT_UNDER_READ = _engine("evict-under-read", on(E.S.CONNECTED, EvictRequested, Go(E.S.EVICTED, E._drop)))

# --- vLLM PR 41853: a failed request post-processed against its engine's registration ----------------


def _hand_off_via_engine(m: C.ConsumerRequest, ev: object, core: Core) -> None:
    assert m.req is not None
    core.engines[(m.req.engine_id, 0)]
    C._hand_off(m, ev, core)  # type: ignore[arg-type]


_ENGINE_LOOKUP = _consumer("engine-lookup-on-report", on(
    (C.S.NOTIFIED, C.S.FAILED, C.S.ABORTED), Reported, Go(C.S.RELEASED, _hand_off_via_engine)))

# --- SGLang issue 39846: done after the first of several parts ---------------------------------------------


def _first_part_completes(m: P.ProducerRequest, ev: NotificationReceived, core: Core) -> bool:
    return 0 <= ev.part < ev.of and not (m.parts >> ev.part) & 1  # the bug: any new part completes


_FIRST_PART_DONE = _producer("first-part-done", on(
    P.S.HOLDING, NotificationReceived, Go(P.S.RELEASED, P._count_and_release, when=_first_part_completes),
    *P.TABLE.cells[(P.S.HOLDING, NotificationReceived)][1:]))

_some = FAULTS - {"forge", "heartbeat"}
_base = Scenario(requests=2, faults=frozenset())

MUTANTS: dict[str, Variant] = {v.id: v for v in (
    Variant("vLLM PR 39907", "a reply naming another engine is accepted (engine ids not synced or checked)",
            _ENGINE_ID_UNCHECKED,
            scenario=Scenario(requests=1, producer_tp=2, wrong_listener=True, faults=frozenset())),
    Variant("vLLM PR 43720", "pp_rank > 0 is sent to a transport without PP support",
            _PP_UNCHECKED, scenario=Scenario(requests=1, producer_pp=2, supports_pp=False, faults=frozenset())),
    Variant("vLLM PR 36958", "MLA's notifications to the ranks not read carry the consumer's local id",
            _MLA_LOCAL_ID, scenario=Scenario(requests=1, producer_tp=2, mla=True, faults=frozenset())),
    Variant("vLLM PR 40364", "a handshake failure is reported as fatal instead of with the recompute policy",
            _POLICY_IGNORED, scenario=Scenario(requests=1, faults=frozenset({"handshake-refuse"}))),
    Variant("vLLM PR 40364 / failed handle", "a failed read is post-processed as a success", _FAILED_AS_DONE,
            scenario=Scenario(requests=1, faults=frozenset({"read-err"}))),
    Variant("vLLM PR 20139", "held blocks get no lease", _NO_LEASE,
            scenario=Scenario(requests=1, faults=frozenset({"handshake-refuse"}))),
    Variant("vLLM PR 24268", "released by the last notification and again by the lease", _DOUBLE_RELEASE,
            scenario=Scenario(requests=1, faults=frozenset())),
    Variant("vLLM PR 25067", "an abort after the request finished is treated as an error", _ABORT_AFTER_FINISH,
            scenario=Scenario(requests=1, faults=frozenset({"abort"}))),
    Variant("vLLM PR 26171", "a failed handshake never tells the requests waiting for it", _WAITERS_FORGOTTEN,
            scenario=Scenario(requests=1, faults=frozenset({"handshake-refuse"}))),
    Variant("vLLM PR 56104", "the first failed read releases the request under its sibling reads",
            _FIRST_FAILURE_RELEASES, scenario=Scenario(requests=1, producer_tp=2, faults=frozenset({"read-err"}))),
    Variant("vLLM PR 32255", "an abort frees the blocks while a read is in flight", _ABORT_FREES,
            scenario=Scenario(requests=1, faults=frozenset({"abort"}))),
    Variant("vLLM PR 41269", "a request aborted while its engine handshakes never tells the producer",
            _ABORT_UNTOLD, scenario=Scenario(requests=1, faults=frozenset({"abort"}))),
    Variant("vLLM PR 43509", "a notification before the request is registered is dropped", _EARLY_DROPPED,
            scenario=Scenario(requests=1, faults=frozenset())),
    Variant("vLLM PR 50789 / issue 58222", "the expiry scan stops at the first unexpired lease",
            _producer("extend-in-place", on(P.S.HOLDING, Heartbeat, Go(P.S.HOLDING, _extend_in_place))),
            timers=NaiveTimers, scenario=Scenario(requests=2, faults=frozenset({"heartbeat"}))),
    Variant("vLLM PR 50326", "a deadline on the scheduler's clock is compared with the worker's", _FOREIGN_CLOCK,
            quirks=frozenset({"no-rebase"}), scenario=Scenario(requests=1, scheduler_deadlines=True,
                                                             faults=frozenset())),
    Variant("vLLM PR 28120", "an exception from polling escapes instead of failing the read",
            quirks=frozenset({"poll-errors-escape"}), scenario=Scenario(requests=1, faults=frozenset({"read-raise"}))),
    Variant("vLLM PR 57570", "a notify-only request is reported as received", _NOTIFY_ONLY_REPORTED,
            scenario=Scenario(requests=1, notify_only=(0,), faults=frozenset())),
    Variant("vLLM PR 54689", "idle eviction tears down the engine with a read in flight", _EVICT_UNDER_READ,
            scenario=Scenario(requests=1, faults=frozenset({"evict"}))),
    Variant("vLLM PR 41853", "a failed request is post-processed against an engine never registered",
            _ENGINE_LOOKUP, scenario=Scenario(requests=1, faults=frozenset({"handshake-refuse", "evict"}))),
    Variant("vLLM issue 27083", "a handshake answered by the wrong listener is accepted",
            _ENGINE_ID_UNCHECKED, scenario=Scenario(requests=1, wrong_listener=True, faults=frozenset())),
    Variant("NIXL PR 252", "the notification goes out when the read is posted, before its data is complete",
            quirks=frozenset({"notify-on-post"}), scenario=Scenario(requests=1, faults=frozenset())),
    Variant("SGLang issue 39846", "the transfer is done after the first of several parts", _FIRST_PART_DONE,
            scenario=Scenario(requests=1, consumer_tp=2, faults=frozenset())),
    Variant("SGLang PR 28897", "the handshake thread adds the peer while the owner thread polls",
            quirks=frozenset({"add-peer-off-owner"}), scenario=Scenario(requests=1, faults=frozenset())),
)}
