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
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any, Final

import structlog

from pdfsm import consumer, engine, producer
from pdfsm.commands import Command
from pdfsm.errors import LocalProtocolError, RemoteProtocolError
from pdfsm.events import (
    CONSUMER,
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
    LeaseExpired,
    Quarantined,
    Reported,
    SendFailed,
    Source,
    StagedDropped,
    Started,
    Tick,
)
from pdfsm.fsm import GO, IGNORE, Fault, State, Table
from pdfsm.log import EventLog, Outcome, Record
from pdfsm.timers import Timers
from pdfsm.topology import Layout, ReadPlan, read_plan

__all__ = ["Core", "Tables"]

APPLIED, IGNORED, REJECTED = int(Outcome.APPLIED), int(Outcome.IGNORED), int(Outcome.REJECTED)

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


def _enabled(logger: Any, level: int) -> bool:
    try:
        return bool(logger.is_enabled_for(level))
    except AttributeError:
        return True


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
        # Remembered terminal states: a dict per machine kind, with its keys in arrival order in a
        # deque to drop the oldest (dropping a dict's first key after many deletions is O(n), and an
        # OrderedDict's bookkeeping costs more than this on the hot path).
        self._remembered: Final[dict[int, dict[Any, State]]] = {CONSUMER: {}, PRODUCER: {}, ENGINE: {}}
        self._remembered_order: Final[deque[tuple[int, dict[Any, State], Any]]] = deque()
        self._ready: dict[str, None] = {}
        self._staged: OrderedDict[str, None] = OrderedDict()
        self._commands: list[Command] = []
        self._derived: list[Event] = []
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
        self._last_t = t_ns
        self._logger = logger if logger is not None else structlog.get_logger("pdfsm")
        self.refresh_logging()
        self.apply(Started(source=Source.CORE, t_ns=t_ns, config=config))

    def _build_routes(self) -> dict[type, tuple[int, dict[Any, Any], dict[State, Any], str, Any, dict[Any, State]]]:
        """Per event type: (target, machines, options by state, machine name, maker, remembered)."""
        routes = {}
        for target, machines, table, make in (
            (CONSUMER, self.consumers, self.tables.consumer, consumer.ConsumerRequest),
            (PRODUCER, self.producers, self.tables.producer, producer.ProducerRequest),
            (ENGINE, self.engines, self.tables.engine, engine.RemoteEngine),
        ):
            for etype in table.events:
                by_state = {s: table.dispatch[s][etype] for s in table.states}
                routes[etype] = (target, machines, by_state, table.name, make, self._remembered[target])
        return routes

    def refresh_logging(self) -> None:
        """Re-read which levels are enabled (the hot path only checks a cached flag)."""
        self._debug = _enabled(self._logger, logging.DEBUG)
        self._info = _enabled(self._logger, logging.INFO)

    # --- applying ------------------------------------------------------------------------------

    def pump(self) -> int:
        """Apply every queued event, in order, then flush the log. Owner thread only."""
        inbox, n = self.log.inbox, 0
        dropped = self.log.take_dropped()
        if dropped:
            self.apply(Dropped(source=Source.CORE, t_ns=self._last_t, count=sum(dropped.values()),
                               by_source=dict(dropped)))
        apply_one, derived = self._apply_one, self._derived
        try:
            while inbox:
                seq = apply_one(inbox.popleft(), None)
                n += 1
                if derived:  # inline rather than through apply(): this loop runs for every event
                    self._cascade(seq)
        finally:
            self.log.flush()
        return n

    def apply(self, ev: Event) -> int:
        """Apply one event and everything it derives, now; returns the event's sequence number.

        Owner thread only: tests, replay and adapters that own the core call this directly.
        """
        seq = self._apply_one(ev, None)
        if self._derived:
            self._cascade(seq)
        return seq

    def _cascade(self, root: int) -> None:
        derived = self._derived
        try:
            i = 0
            while i < len(derived):
                self._apply_one(derived[i], root)
                i += 1
        finally:
            derived.clear()

    def _apply_one(self, ev: Event, cause: int | None) -> int:
        route = self._routes.get(type(ev))
        if route is None:
            return self._apply_core_event(ev, cause)
        target, machines, by_state, name, make, remembered = route
        key = ev.request_id if target != ENGINE else (ev.engine_id, ev.pp_rank)  # type: ignore[attr-defined]
        m = machines.get(key)
        stored = m is not None
        if m is None:
            m = make(key)
            if remembered:  # late news for a request already finished: classify, do not restart
                was = remembered.get(key)
                if was is not None:
                    m.state = was
        before = m.state
        for opt in by_state[before]:
            when = opt.when
            if when is None or when(m, ev, self):
                break
        log = self.log
        seq = log.next_seq
        log.next_seq = seq + 1
        if opt.kind == GO:
            action = opt.action
            if action is not None:
                action(m, ev, self)
            after = m.state = opt.dst
            if after.terminal:
                if stored:
                    del machines[key]
                if after in REMEMBERED:
                    remembered[key] = after
                    order = self._remembered_order
                    t = ev.t_ns
                    order.append((t, remembered, key))
                    # Bounded by count and by age, so memory is flat in a long run at any rate.
                    while len(order) > self._tombstones or order[0][0] < t - self._tombstone_ns:
                        _, old, old_key = order.popleft()
                        old.pop(old_key, None)
            elif not stored:
                machines[key] = m
            if opt.fault is None:
                row = (seq, ev, name, before.name, after.name, APPLIED, "", None, cause)
            else:
                reason = opt.explain(m, ev, self) if opt.explain is not None else opt.reason
                row = (seq, ev, name, before.name, after.name, APPLIED, reason, opt.fault.value, cause)
        elif opt.kind == IGNORE:
            row = (seq, ev, name, before.name, before.name, IGNORED, opt.reason, None, cause)
        else:
            row = (seq, ev, name, before.name, before.name, REJECTED, opt.reason, opt.fault.value, cause)
        self._window_append(row)
        if self._sinking:
            self._unsunk_append(row)
        if opt.fault is not None:
            self._violation(row, target, key, m if stored else None)
        if self._debug:
            self._logger.debug("transition", seq=seq, machine=name, key=key, event_type=type(ev).__name__,
                               before=before.name, after=row[4], outcome=Outcome(row[5]).name,
                               reason=row[6] or None, cause=cause)
        return seq

    def _apply_core_event(self, ev: Event, cause: int | None) -> int:
        self._last_t = ev.t_ns
        reason, fault, outcome = "", None, Outcome.APPLIED
        if isinstance(ev, Tick):
            self._expire(ev.t_ns)
        elif isinstance(ev, Collect):
            ready, self._ready = self._ready, {}
            for rid in ready:
                self.derive(Reported(source=Source.CORE, t_ns=ev.t_ns, request_id=rid))
        elif isinstance(ev, BadMessage):
            sender = ev.sender or "unknown sender"
            reason = f"undecodable {ev.channel} message from {sender}: {ev.error}"
            fault, outcome = Fault.REMOTE, Outcome.REJECTED
        elif isinstance(ev, Dropped):
            reason, fault = f"inbox full: {ev.count} events refused", Fault.LOCAL
        elif isinstance(ev, SendFailed):
            reason = f"could not tell {ev.engine_id} ({ev.pp_rank}, {ev.tp_rank}) about {ev.request_id}: {ev.error}"
        row = self.log.append(ev, "core", "-", "-", outcome, reason, fault, cause)
        if fault is not None:
            self._violation(row, 0, None, None)
        return row[0]

    def _expire(self, now: int) -> None:
        for _, key in self.deadlines.due(now):
            if key in self.consumers:
                self.derive(DeadlinePassed(source=Source.CORE, t_ns=now, request_id=key))
        for _, key in self.leases.due(now):
            if key in self.producers:
                self.derive(LeaseExpired(source=Source.CORE, t_ns=now, request_id=key))

    # --- violations -----------------------------------------------------------------------------

    def _violation(self, row: tuple[Any, ...], target: int, key: Any, live: Any) -> None:
        rec = Record.of(row)
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

    def plan(self, remote_tp: int, remote_pp: int) -> ReadPlan:
        """The read plan against a producer layout; raises TopologyError if there is none."""
        key = (remote_tp, remote_pp)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = read_plan(self._local, Layout(remote_tp, remote_pp), self.config.mla)
        return plan

    def engine_connected(self, key: EngineKey) -> bool:
        e = self.engines.get(key)
        return e is not None and e.state is engine.S.CONNECTED

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
            pp_mask >>= 1
            pp += 1

    def ready(self, m: consumer.ConsumerRequest) -> None:
        self._ready[m.request_id] = None

    def stage(self, m: producer.ProducerRequest) -> None:
        self._staged[m.request_id] = None
        self.leases.arm(m.request_id, m.deadline)
        if len(self._staged) > self.config.max_staged:
            oldest, _ = self._staged.popitem(last=False)
            self.derive(StagedDropped(source=Source.CORE, t_ns=m.t_start, request_id=oldest,
                                      reason=f"more than {self.config.max_staged} staged"))

    def unstage(self, m: producer.ProducerRequest) -> None:
        self._staged.pop(m.request_id, None)

    def finished(self, m: consumer.ConsumerRequest | producer.ProducerRequest, outcome: str, t_ns: int) -> None:
        """A request is done; one line at info (a warning when blocks were released by expiry)."""
        m.outcome = outcome
        if not self._info:
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
        a, b = self.deadlines.earliest(), self.leases.earliest()
        return b if a is None else a if b is None else min(a, b)

    def machines(self) -> Iterator[tuple[str, Any, Any]]:
        """Every live machine as (kind, key, machine)."""
        for name, table in (("consumer", self.consumers), ("producer", self.producers), ("engine", self.engines)):
            for key, m in table.items():
                yield name, key, m

    @property
    def pending_hand_offs(self) -> int:
        return len(self._ready)
