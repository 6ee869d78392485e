"""The core: one owner applies events to the machines, one at a time, and records every outcome.

Data flows one way: an adapter thread submits an event to the log's inbox; the
owner thread pumps the inbox, routes each event to its machine, applies the
table cell, records the result, and applies whatever the transition derived
(a handshake completing wakes its waiting requests); the commands the
machines emitted are then taken by the adapter, which carries them out and
submits their outcomes as new events. The core does no I/O, reads no clock and
takes no lock.

Illegal events leave their machine unchanged and are recorded with whose fault
they were. In strict mode they raise :class:`~pdfsm.errors.LocalProtocolError`
or :class:`~pdfsm.errors.RemoteProtocolError` after being recorded (tests). In
production mode a local fault quarantines the consumer request or engine it hit
(failed with the failure policy, never silently reused); a remote fault is
recorded and otherwise changes nothing, so a misbehaving peer cannot fail our
requests by sending garbage.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any, Final, cast, final

import structlog

from pdfsm import consumer, engine, producer
from pdfsm.commands import Command
from pdfsm.errors import LocalProtocolError, OwnerError, RemoteProtocolError
from pdfsm.events import (
    ALL_EVENTS,
    CONSUMER,
    CORE,
    ENGINE,
    PRODUCER,
    BadMessage,
    Collect,
    CoreConfig,
    DeadlinePassed,
    Dropped,
    EngineKey,
    EngineQuarantined,
    EngineWanted,
    Event,
    EvictRequested,
    HandshakeFailed,
    LeaseExpired,
    Quarantined,
    Reported,
    SendFailed,
    Source,
    StagedDropped,
    Started,
    Tick,
)
from pdfsm.fsm import Fault, Go, Guard, Ignore, Machine, Option, State, Table
from pdfsm.log import EventLog, Outcome, Record
from pdfsm.records import Tombstone
from pdfsm.timers import Timers
from pdfsm.topology import Layout, ReadPlan, read_plan

__all__ = ["Core", "Tables"]


# Terminal states remembered (by key, state only, bounded) so late news is classified rather
# than mistaken for a new request. DISCARDED producers and EVICTED engines are forgotten:
# the same key may legitimately start over.
REMEMBERED: Final = frozenset({consumer.S.RELEASED, producer.S.RELEASED, producer.S.EXPIRED})


class Tables:
    """The three tables a core runs; tests and the race tester swap in variants."""

    __slots__ = ("consumer", "engine", "producer")

    def __init__(
        self,
        consumer: Table = consumer.TABLE,
        producer: Table = producer.TABLE,
        engine: Table = engine.TABLE,
    ) -> None:
        self.consumer = consumer
        self.producer = producer
        self.engine = engine


# A table option compiled for the apply loop. ``dst`` is the state after (the same for an ignore
# or an illegal event), ``before`` and ``after`` are state names; ``fault`` is None or (Fault,
# explain); ``end`` says what becomes of the machine: LIVES (a transition to a live state:
# kept), ENDS (to a terminal state: forgotten), REMEMBERS (to a remembered terminal state: kept as
# a tombstone) or STAYS (ignored or illegal: untouched). Plain classes, not tuples: compiled
# (setup.py), a field is one load where a tuple's unpack checks and counts every item.
@final
class Step:
    __slots__ = ("action", "after", "before", "dst", "end", "fault", "outcome", "reason")

    def __init__(self, action: Any, dst: State, before: str, after: str, outcome: Outcome, reason: str,
                 fault: tuple[Fault, Any] | None, end: int) -> None:
        self.action, self.dst, self.before, self.after = action, dst, before, after
        self.outcome, self.reason, self.fault, self.end = outcome, reason, fault, end


@final
class Cell:
    """A cell compiled: its first option's guard and step, then the (guard, step) of the others."""

    __slots__ = ("rest", "step", "when")

    def __init__(self, when: Guard | None, step: Step, rest: tuple[tuple[Guard | None, Step], ...]) -> None:
        self.when, self.step, self.rest = when, step, rest


@final
class Route:
    """Where events of one type go: the machines (keyed by engine or request), the compiled cells
    by state, the table's name, the machine maker (None: the core's own event), the tombstones."""

    __slots__ = ("by_engine", "cells", "machines", "make", "name", "remembered", "target")

    def __init__(self, machines: dict[Any, Any], cells: dict[State, Cell], by_engine: bool, name: str, make: Any,
                 remembered: dict[Any, State], target: int) -> None:
        self.machines, self.cells, self.by_engine, self.name = machines, cells, by_engine, name
        self.make, self.remembered, self.target = make, remembered, target


LIVES, ENDS, REMEMBERS, STAYS = 0, 1, 2, 3
# The route of events no table takes: applied by the core itself (no maker).
_CORE_ROUTE: Final = Route({}, {}, False, "core", None, {}, CORE)


def _step(state: State, opt: Option) -> Step:
    fault = None if opt.fault is None else (opt.fault, getattr(opt, "explain", None))
    if isinstance(opt, Go):
        dst = opt.dst
        end = (REMEMBERS if dst in REMEMBERED else ENDS) if dst.terminal else LIVES
        return Step(opt.action, dst, state.name, dst.name, Outcome.APPLIED, opt.reason if fault else "", fault, end)
    outcome = Outcome.IGNORED if isinstance(opt, Ignore) else Outcome.REJECTED
    return Step(None, state, state.name, state.name, outcome, opt.reason, fault, STAYS)


def _compile(state: State, options: tuple[Option, ...]) -> Cell:
    """The options of one (state, event type) cell, in table order, as the apply loop reads them:
    the same decisions, fewer attribute loads."""
    first, *rest = options
    return Cell(first.when, _step(state, first), tuple((o.when, _step(state, o)) for o in rest))


def _enabled(logger: Any, level: int) -> bool:
    try:
        return bool(logger.is_enabled_for(level))
    except AttributeError:
        return True


def _default_logger() -> Any:
    """structlog's logger, configured by the application; left unconfigured, structlog filters
    nothing, so pdfsm logs at info there (a line per finished request, no line per transition:
    the hot path would pay for debug lines nobody asked for)."""
    if structlog.is_configured():
        return structlog.get_logger("pdfsm")
    return structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))


class Core:
    """Owns the machines of one worker and applies every event to them, in log order."""

    def __init__(
        self,
        config: CoreConfig,
        log: EventLog | None = None,
        *,
        t_ns: int = 0,
        tables: Tables | None = None,
        timers: tuple[Timers, Timers] | None = None,
        logger: Any = None,
    ) -> None:
        self.config: Final = config
        self.log: Final = log if log is not None else EventLog()
        self.tables: Final = tables or Tables()
        self.consumers: Final[dict[str, consumer.ConsumerRequest]] = {}
        self.producers: Final[dict[str, producer.ProducerRequest]] = {}
        self.engines: Final[dict[EngineKey, engine.RemoteEngine]] = {}
        # Consumer read deadlines and producer leases (staging times too), each on its own wheel.
        self.deadlines, self.leases = timers or (Timers(), Timers())
        # Engines left FAILED or DISCONNECTED, or connected and unused, keyed "pp_rank:engine_id":
        # forgotten when due unless used again (producers restart under new ids; a router may name
        # engines that never answer).
        self.idle: Final = Timers()
        self.engines_forgotten = 0  # evictions so far: the base of a re-created engine's attempt numbers
        # Remembered terminal states: a dict per machine kind, with its keys in arrival order in a
        # deque to drop the oldest (dropping a dict's first key after many deletions is O(n), and an
        # OrderedDict's bookkeeping costs more than this on the hot path).
        self._remembered: Final[dict[int, dict[Any, State]]] = {CONSUMER: {}, PRODUCER: {}, ENGINE: {}}
        self._remembered_order: Final[deque[Tombstone]] = deque()
        self._oldest_tombstone_ns = 0  # the first one's t_ns (read per finished request: a native field)
        # Consumer requests to hand back at the next Collect, in order (always this one dict).
        self.ready_ids: Final[dict[str, None]] = {}
        self._staged: OrderedDict[str, None] = OrderedDict()  # early notifications only
        self._promised: OrderedDict[str, None] = OrderedDict()  # staged with a heartbeat's promise
        self._commands: list[Command] = []
        self._derived: deque[Event] = deque()  # events the core concluded, applied after their cause
        self._one: deque[Event] = deque()  # apply()'s queue of one
        # What the loop was applying when a guard or action raised: (exception, event, machine or
        # None, cause), for tools that record the crash (the race tester); the innermost loop's,
        # cleared as the next apply() or pump() starts.
        self.crash: tuple[BaseException, Event, Any, int | None] | None = None
        self._pumping: int | None = None  # the thread in pump(), if any
        # Bound methods, not wrappers: one Python frame less on every event (see benchmarks/apply.py).
        self.submit: Final = self.log.submit  # any thread; pump() applies on the owner thread
        self.emit: Final = self._commands.append  # actions: a command for the adapter
        self.derive: Final = self._derived.append  # actions: an event the core applies next
        self._local = Layout(config.tp_size, config.pp_size, config.tp_rank, config.pp_rank)
        self.plans: Final[dict[tuple[int, int], ReadPlan]] = {}
        self.violations: Final[dict[Fault, int]] = {Fault.LOCAL: 0, Fault.REMOTE: 0}  # rejected or handled
        self.rejections: Final[dict[Fault, int]] = {Fault.LOCAL: 0, Fault.REMOTE: 0}  # illegal events only
        self._routes = self._build_routes()
        self._window_append = self.log.window.append
        self._unsunk_append = self.log.unsunk.append
        self._sinking = self.log.sink is not None
        self._tombstones = config.tombstones
        self._tombstone_ns = config.tombstone_ns or 2 * max(config.lease_ns, config.read_timeout_ns)
        self._forget_engine_ns = max(self._tombstone_ns, config.handshake_retry_ns)  # never before a retry
        self._idle_engine_ns = config.idle_engine_ns
        self._handshake_timeout_ns = config.handshake_timeout_ns or 2 * config.read_timeout_ns
        self.cancel_grace_ns = config.cancel_grace_ns or config.read_timeout_ns
        # The config fields requests read on their way through, as the core's own: compiled, a
        # field of this class is a load, one of the config (a msgspec Struct) a generic lookup.
        self.read_timeout_ns: Final = config.read_timeout_ns
        self.lease_ns: Final = config.lease_ns
        self.lease_margin_ns: Final = config.lease_margin_ns
        self.hold_skew_ns: Final = config.hold_skew_ns
        self.engine_id: Final = config.engine_id
        self.clock: Final = config.clock
        # consumer.times_of's last answer and the params it was for: the common request's guard
        # and action both need it (events are immutable, so the same object gives the same times).
        self.times_for: Event | None = None
        self.times: tuple[int, int] = (0, 0)
        # The latest time a core event (a Tick, a Collect) brought: what the core knows the time is
        # at least, whatever older stamp a late event carries from another thread.
        self.latest_t_ns = t_ns
        self._logger = logger if logger is not None else _default_logger()
        self.refresh_logging()
        self.log.owner = threading.get_ident()
        self.apply(Started(source=Source.CORE, t_ns=t_ns, config=config))

    def _build_routes(self) -> dict[type, Route]:
        """Per event type, its :class:`Route`; the core's own events get ``_CORE_ROUTE`` (no maker)."""
        routes: dict[type, Route] = dict.fromkeys(ALL_EVENTS, _CORE_ROUTE)
        for target, machines, table, make in (
            (CONSUMER, self.consumers, self.tables.consumer, consumer.ConsumerRequest),
            (PRODUCER, self.producers, self.tables.producer, producer.ProducerRequest),
            (ENGINE, self.engines, self.tables.engine, engine.RemoteEngine),
        ):
            for etype in table.events:
                cells = {s: _compile(s, table.dispatch[s][etype]) for s in table.states}
                routes[etype] = Route(machines, cells, target == ENGINE, table.name, make, self._remembered[target],
                                      target)
        return routes

    def refresh_logging(self) -> None:
        """Re-read which levels are enabled (the hot path only checks a cached flag)."""
        self._debug = _enabled(self._logger, logging.DEBUG)
        self.log_info = _enabled(self._logger, logging.INFO)  # actions call finished() only when set

    # --- applying ------------------------------------------------------------------------------

    def pump(self) -> int:
        """Apply every queued event, in order, then flush the log; returns how many. Owner thread
        only: the calling thread becomes the owner; a pump already running on another thread
        raises :class:`~pdfsm.errors.OwnerError` (a flag, not a lock: misuse is caught, not
        serialized)."""
        me = threading.get_ident()
        if self._pumping not in (None, me):
            raise OwnerError(f"pump() is running on thread {self._pumping}: one owner at a time")
        self._pumping = self.log.owner = me
        try:
            dropped = self.log.take_dropped()
            if dropped:
                self.apply(Dropped(source=Source.CORE, t_ns=self.latest_t_ns, count=sum(dropped.values()),
                                   by_source=dict(dropped)))
            return self._drain(self.log.inbox, None)
        finally:
            try:
                self.log.flush()
            finally:
                self._pumping = None

    def apply(self, ev: Event) -> int:
        """Apply one event and everything it derives, now; returns the event's sequence number.

        Owner thread only: tests, replay and adapters that own the core call this directly.
        """
        seq = self.log.next_seq
        self._one.append(ev)
        self._drain(self._one, None)
        return seq

    def _drain(self, queue: deque[Event], cause: int | None) -> int:
        """Apply the events of ``queue`` in order until it is empty; returns how many.

        Root events (``cause`` None) are followed at once by everything they derived, applied by
        a nested call with the root's sequence number as their cause. This is the hot loop: one
        frame for a whole batch, the tables' cells precompiled (:func:`_compile`), what it reads
        per event held in locals, the next sequence number included (written back to the log
        whenever something else may read it, and on the way out).
        """
        popleft, routes, log = queue.popleft, self._routes, self.log
        window_append, derived = self._window_append, self._derived
        unsunk_append = self._unsunk_append if self._sinking else None
        debug = self._debug
        first = seq = log.next_seq
        if cause is None:  # a root batch: an earlier crash is not this one's (an exception may be reused)
            self.crash = None
        n_derived = 0
        ev: Event | None = None
        m: Any = None
        try:
            while queue:
                ev = popleft()
                m = None
                # An event type no table or the core knows: the core records it.
                route = routes.get(type(ev), _CORE_ROUTE)
                make, name = route.make, route.name
                if make is None:  # a core event
                    log.next_seq = seq
                    try:
                        self._apply_core_event(ev, cause)
                    finally:  # strict mode raises after recording it: its seq is used either way
                        seq = log.next_seq
                else:
                    key = (ev.engine_id, ev.pp_rank) if route.by_engine else ev.request_id  # type: ignore[attr-defined]
                    machines = route.machines
                    m = machines.get(key)
                    stored = m is not None
                    if m is None:
                        m = make(key)
                    machine: Machine = m  # typed: its state is a native field (Machine)
                    if not stored:
                        remembered = route.remembered
                        if remembered:  # late news for a request already finished: classify, do not restart
                            was = remembered.get(key)
                            if was is not None:
                                machine.state = was
                    cell = route.cells[machine.state]
                    when, step = cell.when, cell.step
                    if when is not None and not when(m, ev, self):
                        for when, step in cell.rest:  # noqa: B007 (the step is the one the loop stops at)
                            if when is None or when(m, ev, self):
                                break
                    action, dst, before, after = step.action, step.dst, step.before, step.after
                    outcome, reason, fault, end = step.outcome, step.reason, step.fault, step.end
                    if action is not None:
                        action(m, ev, self)
                    if not end:  # LIVES
                        machine.state = dst
                        if not stored:
                            machines[key] = m
                    elif end < 3:  # ENDS or REMEMBERS: a terminal state
                        machine.state = dst
                        if stored:
                            del machines[key]
                        if end == 2:
                            route.remembered[key] = dst
                            order = self._remembered_order
                            t = ev.t_ns
                            if not order:
                                self._oldest_tombstone_ns = t
                            order.append(Tombstone(t, route.target, key))
                            # Bounded by count and by age, so memory is flat in a long run at any rate.
                            if len(order) > self._tombstones or self._oldest_tombstone_ns < t - self._tombstone_ns:
                                self._forget_oldest(t)
                    if fault is None:
                        rec = Record(seq, cast(Any, ev), name, before, after, outcome, reason, None, cause)
                        seq += 1
                        window_append(rec)
                        if unsunk_append is not None:
                            unsunk_append(rec)
                    else:
                        blame, explain = fault
                        if explain is not None:  # a fault-handling transition says what went wrong
                            reason = explain(m, ev, self)
                        frec = Record(seq, cast(Any, ev), name, before, after, outcome, reason, blame, cause)
                        seq += 1
                        log.next_seq = seq
                        window_append(frec)
                        if unsunk_append is not None:
                            unsunk_append(frec)
                        self._violation(frec, route.target, key, m if stored else None)
                    if debug:
                        self._logger.debug("transition", seq=seq - 1, machine=name, key=key,
                                           event_type=type(ev).__name__, before=before, after=after,
                                           outcome=outcome.name, reason=reason or None, cause=cause)
                if derived and cause is None:
                    log.next_seq = seq
                    try:
                        n_derived += self._drain(derived, seq - 1)
                    except BaseException:  # strict mode: a derived event was illegal
                        derived.clear()
                        seq = log.next_seq  # its records (and those before it) were made: never reuse their seqs
                        raise
                    seq = log.next_seq
        except BaseException as exc:
            if ev is not None and self.crash is None:  # the innermost loop's, set first as it unwinds
                self.crash = (exc, ev, m, cause)
            raise
        finally:
            log.next_seq = seq
        return seq - first - n_derived  # one record per event applied

    def _forget_oldest(self, t_ns: int) -> None:
        """Forget remembered terminal states past the count bound or older than the age bound."""
        order, horizon = self._remembered_order, t_ns - self._tombstone_ns
        while order and (len(order) > self._tombstones or order[0].t_ns < horizon):
            old = order.popleft()
            self._remembered[old.target].pop(old.key, None)
        self._oldest_tombstone_ns = order[0].t_ns if order else 0

    def _apply_core_event(self, ev: Event, cause: int | None) -> int:
        self.latest_t_ns = max(self.latest_t_ns, ev.t_ns)
        reason, fault, outcome = "", None, Outcome.APPLIED
        if isinstance(ev, Tick):
            self._expire(ev.t_ns)
        elif isinstance(ev, Collect):
            ready = self.ready_ids
            if ready:
                t_ns, derive = ev.t_ns, self.derive
                for rid in ready:
                    derive(Reported(source=Source.CORE, t_ns=t_ns, request_id=rid))
                ready.clear()
        elif isinstance(ev, BadMessage):
            sender = ev.sender or "unknown sender"
            reason = f"undecodable {ev.channel} message from {sender}: {ev.error}"
            fault, outcome = Fault.REMOTE, Outcome.REJECTED
        elif isinstance(ev, Dropped):
            reason, fault = f"inbox full: {ev.count} events refused", Fault.LOCAL
        elif isinstance(ev, SendFailed):
            reason = f"could not tell {ev.engine_id} ({ev.pp_rank}, {ev.tp_rank}) about {ev.request_id}: {ev.error}"
        rec = self.log.append(ev, "core", "-", "-", outcome, reason, fault, cause)
        if fault is not None:
            self._violation(rec, 0, None, None)
        return rec.seq

    def _expire(self, now: int) -> None:
        for _, key in self.deadlines.due(now):
            if key in self.consumers:
                self.derive(DeadlinePassed(source=Source.CORE, t_ns=now, request_id=key))
        for _, key in self.leases.due(now):
            if key in self.producers:
                self.derive(LeaseExpired(source=Source.CORE, t_ns=now, request_id=key))
        for deadline, key in self.idle.due(now):
            pp, _, engine_id = key.partition(":")
            e = self.engines.get((engine_id, int(pp)))
            if e is None or e.idle_at != deadline:
                continue  # forgotten, or its timer moved since
            e.idle_at = None
            if e.state is engine.S.CONNECTED:
                period = self._idle_engine_ns
            elif e.state is engine.S.FAILED or e.state is engine.S.DISCONNECTED:
                period = self._forget_engine_ns
            elif e.state is engine.S.CONNECTING:
                continue  # answered in time: the transport adds the peer, whose outcome arms the timer
            else:  # a handshake attempt still unanswered (handshake_started armed the timer)
                self.derive(HandshakeFailed(source=Source.CORE, t_ns=now, engine_id=engine_id, pp_rank=e.pp_rank,
                                            attempt=e.attempt, error="no answer within handshake_timeout_ns "
                                            f"({self._handshake_timeout_ns / 1e9:g} s)"))
                continue
            if now < e.idle_since + period:
                self._arm_idle(e, e.idle_since + period)  # used since
            elif e.readers or e.waiters:
                self._arm_idle(e, now + period)  # held: look again later
            elif e.notices and (kept := [n for n in e.notices if n[1] > now]):
                # Notices kept for a handshake at another address (a failed attempt's): forgetting
                # the engine lost them, and their producer waited out its lease (found by a
                # helper's hunt). Kept until the last can no longer be sent.
                e.notices = kept
                self._arm_idle(e, max(n[1] for n in kept))
            else:
                self.derive(EvictRequested(source=Source.CORE, t_ns=now, engine_id=engine_id, pp_rank=e.pp_rank))

    # --- violations -----------------------------------------------------------------------------

    def _violation(self, rec: Record, target: int, key: Any, live: Any) -> None:
        assert rec.fault is not None
        self.violations[rec.fault] += 1
        self._logger.error("violation", seq=rec.seq, fault=rec.fault.value, machine=rec.machine, key=key,
                           event_type=type(rec.event).__name__, state=rec.state, reason=rec.reason,
                           outcome=rec.outcome.name.lower())
        if rec.outcome is not Outcome.REJECTED:
            return
        self.rejections[rec.fault] += 1
        if self.config.strict:
            self._derived.clear()
            error = LocalProtocolError if rec.fault is Fault.LOCAL else RemoteProtocolError
            raise error(rec.reason, machine=rec.machine, key=key, state=rec.state, event=rec.event, seq=rec.seq)
        if rec.fault is Fault.LOCAL and live is not None:
            why = f"{type(rec.event).__name__} refused at seq {rec.seq}: {rec.reason}"
            t_ns = rec.event.t_ns
            if target == CONSUMER:
                self.derive(Quarantined(source=Source.CORE, t_ns=t_ns, request_id=key, reason=why))
            elif target == ENGINE:
                self.derive(EngineQuarantined(source=Source.CORE, t_ns=t_ns, engine_id=key[0],
                                              pp_rank=key[1], reason=why))

    # --- what actions may ask of the core ----------------------------------------------------------

    def engine_idle(self, e: engine.RemoteEngine, t_ns: int, *, connected: bool = False) -> None:
        """``e`` failed or disconnected: forget it in a while unless it is wanted again. Or it
        connected: forget it once nobody has read from it for ``idle_engine_ns`` (reads move
        ``idle_since``), so the engines of producers long gone do not pile up."""
        e.idle_since = t_ns
        period = self._idle_engine_ns if connected else self._forget_engine_ns
        if period:
            self._arm_idle(e, t_ns + period)
        elif e.idle_at is not None:
            self.idle.disarm(f"{e.pp_rank}:{e.engine_id}", e.idle_at)
            e.idle_at = None

    def cancel_reads_over(self, e: engine.RemoteEngine) -> None:
        """``e`` is taken as lost while held: cancel the reads still running over it."""
        consumer.cancel_reads_over(e, self)

    def send_owed(self, e: engine.RemoteEngine, t_ns: int, replaced: set[int]) -> None:
        """``e`` connected: send the notices requests that stopped meanwhile owe its ranks."""
        consumer.send_owed(e, self, t_ns, replaced)

    def handshake_started(self, e: engine.RemoteEngine, t_ns: int) -> None:
        """Bound a handshake attempt by ``handshake_timeout_ns``: a handshaker that never answers
        one must not leave the engine handshaking for ever, every later request joining it and
        timing out (SGLang PR 34692). Twice the read timeout by default, so a slow answer still
        connects the engine for the requests after the one that gave up on it."""
        e.idle_since = t_ns
        self._arm_idle(e, t_ns + self._handshake_timeout_ns)

    def _arm_idle(self, e: engine.RemoteEngine, at: int) -> None:
        """One idle timer per engine: the one armed before is disarmed."""
        key = f"{e.pp_rank}:{e.engine_id}"
        if e.idle_at is not None:
            self.idle.disarm(key, e.idle_at)
        e.idle_at = at
        self.idle.arm(key, at)

    def plan(self, remote_tp: int, remote_pp: int) -> ReadPlan:
        """The read plan against a producer layout; raises TopologyError if there is none."""
        key = (remote_tp, remote_pp)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = read_plan(self._local, Layout(remote_tp, remote_pp), self.config.mla,
                                               self.config.kv_heads)
        return plan

    def engine_connected(self, key: EngineKey, host: str = "", port: int = 0) -> bool:
        """Connected (and, given an address, handshaken at that address)."""
        e = self.engines.get(key)
        return e is not None and e.state is engine.S.CONNECTED and not e.elsewhere(host, port)

    def engine_usable(self, key: EngineKey) -> bool:
        """Connected and not stalled: a request may read from it now (RemoteEngine.usable)."""
        e = self.engines.get(key)
        return e is not None and e.usable

    def watch(self, request_id: str, key: EngineKey, host: str, port: int, t_ns: int) -> None:
        self.derive(EngineWanted(source=Source.CORE, t_ns=t_ns, engine_id=key[0], pp_rank=key[1],
                                 request_id=request_id, host=host, port=port))

    def unwatch(self, request_id: str, engine_id: str, pp_mask: int) -> None:
        pp = 0
        while pp_mask:
            if pp_mask & 1:
                e = self.engines.get((engine_id, pp))
                if e is not None:
                    e.waiters.pop(request_id, None)
                    e.aside.pop(request_id, None)
            pp_mask >>= 1
            pp += 1

    def ready(self, m: consumer.ConsumerRequest) -> None:
        self.ready_ids[m.request_id] = None

    def stage(self, m: producer.ProducerRequest) -> None:
        """Keep news of a request not registered yet, within ``max_staged``. Over the bound the
        oldest entry goes, one holding only notifications first: losing those costs the request
        its lease's wait, while a heartbeat's promise lost leaves the hold a plain lease, shorter
        than its consumers were promised. Entries with a promise take at most half the bound (at
        least one, so from a bound of 2 up): a peer's heartbeats for ids never held here cannot shut
        notifications out."""
        (self._promised if m.extended_to is not None else self._staged)[m.request_id] = None
        self.leases.arm(m.request_id, m.deadline)
        self._bound_staging(m.t_start)

    def promise(self, m: producer.ProducerRequest, t_ns: int) -> None:
        """A staged request now holds a heartbeat's promise: dropped when nothing else can be, or
        when promises pass half of ``max_staged``."""
        if self._staged.pop(m.request_id, 0) is None:
            self._promised[m.request_id] = None
            self._bound_staging(t_ns)

    def _bound_staging(self, t_ns: int) -> None:
        bound = self.config.max_staged
        if len(self._promised) > max(1, bound // 2):
            oldest, _ = self._promised.popitem(last=False)
        elif len(self._staged) + len(self._promised) > bound:
            oldest, _ = (self._staged or self._promised).popitem(last=False)
        else:
            return
        self.derive(StagedDropped(source=Source.CORE, t_ns=t_ns, request_id=oldest,
                                  reason=f"more than {bound} staged"))

    def unstage(self, m: producer.ProducerRequest) -> None:
        self._staged.pop(m.request_id, None)
        self._promised.pop(m.request_id, None)

    def finished(self, m: consumer.ConsumerRequest | producer.ProducerRequest, outcome: str, t_ns: int) -> None:
        """A request is done; one line at info (a warning when blocks were released by expiry)."""
        m.outcome = outcome
        if not self.log_info:
            return
        side = "consumer" if isinstance(m, consumer.ConsumerRequest) else "producer"
        fields: dict[str, Any] = {"side": side, "request_id": m.request_id, "outcome": outcome,
                                  "duration_ms": round((t_ns - m.t_start) / 1e6, 3)}
        if isinstance(m, consumer.ConsumerRequest) and m.error:
            fields["error"] = m.error
        if outcome == "expired":
            self._logger.warning("request finished: lease expired, blocks released unread", **fields)
        else:
            self._logger.info("request finished", **fields)

    # --- what adapters and tools read -----------------------------------------------------------

    def take_commands(self) -> list[Command]:
        """Commands emitted since the last call, in order. Owner thread only."""
        cmds = self._commands[:]
        self._commands.clear()  # the same list: ``emit`` is bound to it
        return cmds

    def next_deadline(self) -> int | None:
        """When a :class:`~pdfsm.events.Tick` will next have something to expire, if ever."""
        due = (self.deadlines.earliest(), self.leases.earliest(), self.idle.earliest())
        return min((t for t in due if t is not None), default=None)

    def machines(self) -> Iterator[tuple[str, Any, Any]]:
        """Every live machine as (kind, key, machine)."""
        for name, table in (("consumer", self.consumers), ("producer", self.producers), ("engine", self.engines)):
            for key, m in table.items():
                yield name, key, m

    def remembered(self, target: int, key: Any) -> State | None:
        """The terminal state a finished machine of kind ``target`` (CONSUMER, PRODUCER, ENGINE)
        was remembered in, or None."""
        return self._remembered[target].get(key)

    @property
    def pending_hand_offs(self) -> int:
        return len(self.ready_ids)
