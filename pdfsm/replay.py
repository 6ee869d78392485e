"""Replay a log: rebuild every machine and check that the recorded outcomes come out again.

Only root events (records without a ``cause``) are fed back; the core derives the
rest, and every record it produces must equal the recorded one: same sequence
number, event, machine, states, outcome, reason and fault. The first difference
is a :class:`Divergence` naming that record. Replay is deterministic: the core
reads no clock and no randomness, so the same log always replays the same way.

:func:`summarize` reads the records alone (no re-application): each machine's
state at any sequence number, how the finished requests ended (:func:`finished_as`),
violations with their attribution, requests that never reached a terminal state, and
per-request timelines. :func:`visits` cuts a
log into state visits (what the trace and the HTML report draw), and :func:`follow`
joins one request's records across a prefill log and a decode log.
"""

from __future__ import annotations

import contextlib
import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdfsm import consumer, engine, producer
from pdfsm.core import Core
from pdfsm.errors import PdfsmError, ProtocolError
from pdfsm.events import ReadRequested, Reported, SendFailed, Started
from pdfsm.log import EventLog, MemorySink, Outcome, Record

__all__ = [
    "OUTCOMES",
    "TERMINAL",
    "Divergence",
    "Followed",
    "QuietLogger",
    "Step",
    "Summary",
    "Visit",
    "duration",
    "event_detail",
    "finished_as",
    "follow",
    "machine_key",
    "offsets",
    "outcome_lines",
    "render",
    "replay",
    "step_note",
    "summarize",
    "time_unit",
    "visits",
]

_TABLES = {"consumer": consumer.TABLE, "producer": producer.TABLE, "engine": engine.TABLE}
TERMINAL = {name: frozenset(s.name for s in table.terminal) for name, table in _TABLES.items()}
# A machine is created in its table's initial state, and no transition leads back into it.
_INITIAL = {name: table.initial.name for name, table in _TABLES.items()}


def _kept_none(rec: Record) -> bool:
    """An ignored or rejected event left in the initial state: the core kept no machine for it
    (a first event it refused, or late news for a request whose tombstone aged out), so it
    changes no state; the machine's last life, if any, ended where its records say."""
    return rec.outcome is not Outcome.APPLIED and rec.state == _INITIAL.get(rec.machine)


# How a request's life ended, named by the record that made it terminal. Commands are not logged,
# so the consumer's HandOff outcome is read off the Reported record's ``before`` state (the hand-off
# is decided by it: consumer._hand_off); a consumer released by any other event had nothing to read
# (notify-only) and was never handed back. A producer's terminal state says it all.
_HANDED_BACK: dict[str, str] = {"NOTIFIED": "received", "FAILED": "failed", "ABORTED": "aborted"}
_PRODUCER_END: dict[str, str] = {"RELEASED": "released", "EXPIRED": "expired", "DISCARDED": "discarded"}
OUTCOMES: dict[str, tuple[str, ...]] = {
    "consumer": (*_HANDED_BACK.values(), "notify_only"),
    "producer": tuple(_PRODUCER_END.values()),
}
"""The outcomes :func:`finished_as` names, per machine kind."""


def finished_as(rec: Record) -> str | None:
    """The outcome a record ended its request's life with (a key of :data:`OUTCOMES`), or None
    when it ended none: not applied, an engine's, or not the move into a terminal state."""
    if rec.outcome is not Outcome.APPLIED or rec.before == rec.state or rec.state not in TERMINAL.get(rec.machine, ()):
        return None
    if rec.machine == "consumer":
        return _HANDED_BACK.get(rec.before, "notify_only") if isinstance(rec.event, Reported) else "notify_only"
    return _PRODUCER_END.get(rec.state) if rec.machine == "producer" else None


class Divergence(PdfsmError):
    """Replaying a log produced something other than what it recorded."""

    def __init__(self, seq: int, expected: Record | None, got: Record | None, why: str) -> None:
        super().__init__(f"divergence at seq {seq}: {why}\n  recorded:   {expected}\n  recomputed: {got}")
        self.seq, self.expected, self.got = seq, expected, got


class QuietLogger:
    """A core logger that drops everything. Replay's: it recomputes the past, and the violations
    it meets again were logged when they happened (re-logging them as live errors would mislead
    a postmortem); also for tools and tests that build a core to make records."""

    def is_enabled_for(self, level: int) -> bool:
        return False

    def _drop(self, *args: Any, **kw: Any) -> None:
        pass

    debug = info = warning = error = _drop


def _differs(a: Record, b: Record) -> str:
    for name in ("seq", "event", "machine", "before", "state", "outcome", "reason", "fault", "cause"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} differs"
    return ""


def replay(records: Iterable[Record], *, window: int = 1024, unrecorded: list[Record] | None = None) -> Core:
    """Rebuild the core a log came from, checking each record; returns the rebuilt core.

    Raises :class:`Divergence` at the first record that does not come out again. A log
    that ends part-way through the records one event derived (a torn tail, or a cut at a
    frame boundary) is accepted; the records recomputed past its end go to ``unrecorded``.
    """
    it = iter(records)
    first = next(it, None)
    if first is None or not isinstance(first.event, Started) or first.seq != 0:
        raise Divergence(0, first, None, "a log starts with the Started record at seq 0")
    capture = MemorySink()
    core = Core(first.event.config, EventLog(window=window, sink=capture), t_ns=first.event.t_ns, logger=QuietLogger())
    core.log.flush()
    pending: list[Record] = capture.records[:]
    capture.records.clear()
    _match(pending, first)
    for rec in it:
        if rec.root:
            if pending:
                raise Divergence(pending[0].seq, None, pending[0], "recomputed records the log does not have")
            if rec.event.DERIVED:  # only the core makes these, each with its cause: never an input
                raise Divergence(rec.seq, rec, None, f"{type(rec.event).__name__} is derived by the core, "
                                                     "but recorded with no cause (as an input)")
            with contextlib.suppress(ProtocolError):  # strict mode raised after recording, as it did then
                core.apply(rec.event)
            core.log.flush()
            pending = capture.records[:]
            capture.records.clear()
        _match(pending, rec)
    if unrecorded is not None:
        unrecorded += pending
    return core


def _match(pending: list[Record], rec: Record) -> None:
    if not pending:
        raise Divergence(rec.seq, rec, None, "the log has a record replay did not produce")
    got = pending.pop(0)
    why = _differs(rec, got)
    if why:
        raise Divergence(rec.seq, rec, got, why)


def machine_key(rec: Record) -> Any:
    """The key of the machine a record belongs to (None for core records)."""
    ev = rec.event
    if rec.machine == "engine":
        return (getattr(ev, "engine_id", ""), getattr(ev, "pp_rank", 0))
    return getattr(ev, "request_id", None) if rec.machine != "core" else None


# The fields that tell one event of a type from another (the keys are shown elsewhere).
_DETAIL: dict[str, tuple[str, ...]] = {
    "ReadRequested": ("remote_request_id", "engine_id", "remote_tp"),
    "HandleDone": ("pp_rank", "tp_rank"),
    "HandleFailed": ("pp_rank", "tp_rank", "why", "detail"),
    "NotificationReceived": ("part", "of", "sender", "consumer", "unread"),
    "Heartbeat": ("extend_ns", "sender"),
    "Promised": ("promised_ns",),
    "EngineReady": ("engine_id", "pp_rank"),
    "EngineFailed": ("engine_id", "pp_rank", "error"),
    "HandshakeDone": ("attempt",),
    "HandshakeFailed": ("attempt", "error"),
    "PeerAdded": ("attempt",),
    "PeerDisconnected": ("attempt", "detail"),
    "SendFailed": ("engine_id", "tp_rank", "request_id", "error"),
    "Quarantined": ("reason",),
    "EngineQuarantined": ("reason",),
    "StagedDropped": ("reason",),
    "Collect": ("step",),
    "BadMessage": ("channel", "sender", "error"),
    "Dropped": ("count",),
}


def event_detail(ev: Any) -> str:
    """A few ``name=value`` pairs that say which event of its type this is (which rank, which part)."""
    out = []
    for name in _DETAIL.get(type(ev).__name__, ()):
        value = getattr(ev, name, None)
        if value is None or value == "" or value is False:  # a flag shows only when set
            continue
        out.append(f"{name}={getattr(value, 'value', value)}")
    return printable(" ".join(out))


def printable(text: str) -> str:
    """``text`` with control characters escaped: a peer chooses some fields (a sender, an error),
    and a newline or a terminal escape in them must not forge lines of a report. A byte a file
    name could not decode (Python holds it as a lone surrogate, which no UTF-8 output can
    encode) is shown as ``\\xNN``."""
    return text if text.isprintable() else "".join(c if c.isprintable() else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    if "\udc80" <= c <= "\udcff":  # os.fsdecode's surrogateescape: the byte ord(c) - 0xDC00
        return f"\\x{ord(c) - 0xDC00:02x}"
    return repr(c)[1:-1]


@dataclass(frozen=True)
class Step:
    """One line of a timeline."""

    seq: int
    t_ns: int
    source: str
    event: str
    before: str
    state: str
    outcome: str
    reason: str
    cause: int | None
    fault: str | None = None
    detail: str = ""


@dataclass
class Summary:
    """What a log says happened, up to ``last_seq``."""

    last_seq: int = -1
    first_t_ns: int = 0
    last_t_ns: int = 0
    states: dict[tuple[str, Any], str] = field(default_factory=dict)  # (machine, key) -> state
    violations: list[Record] = field(default_factory=list)
    timelines: dict[tuple[str, Any], list[Step]] = field(default_factory=dict)
    events: int = 0
    finished: dict[str, Counter[str]] = field(default_factory=dict)  # machine -> finished_as -> lives
    policy: str | None = None  # the failure policy of the Started config (None: that record is not here)

    @property
    def per_state(self) -> dict[str, Counter[str]]:
        out: dict[str, Counter[str]] = {}
        for (machine, _), state in self.states.items():
            out.setdefault(machine, Counter())[state] += 1
        return out

    @property
    def stuck(self) -> list[tuple[str, Any, str]]:
        """Requests not in a terminal state at the end (engines rest in CONNECTED legitimately)."""
        return [(m, k, s) for (m, k), s in self.states.items() if m != "engine" and s not in TERMINAL.get(m, ())]

    def by_fault(self) -> Counter[str]:
        return Counter(v.fault.value for v in self.violations if v.fault is not None)


def summarize(records: Iterable[Record], *, at: int | None = None, timelines: bool = True) -> Summary:
    """Each machine's state after the last record at or before ``at`` (the end by default)."""
    out = Summary()
    for rec in records:
        if at is not None and rec.seq > at:
            break
        out.events += 1
        out.last_seq = rec.seq
        t = rec.event.t_ns
        if out.events == 1:
            out.first_t_ns = out.last_t_ns = t  # 0 and negative are real times: no 0 to start from
        out.last_t_ns = max(out.last_t_ns, t)
        if rec.fault is not None:
            out.violations.append(rec)
        if rec.machine == "core":
            if isinstance(rec.event, Started):
                out.policy = rec.event.config.policy
            continue
        key = (rec.machine, machine_key(rec))
        if not _kept_none(rec):
            out.states[key] = rec.state
        ended = finished_as(rec)
        if ended is not None:
            out.finished.setdefault(rec.machine, Counter())[ended] += 1
        if timelines:
            out.timelines.setdefault(key, []).append(Step(
                rec.seq, t, rec.event.source, type(rec.event).__name__, rec.before, rec.state,
                rec.outcome.name.lower(), rec.reason, rec.cause,
                None if rec.fault is None else rec.fault.value, event_detail(rec.event)))
    return out


def duration(ns: int) -> str:
    """A span in words, in a unit that shows it: logs of simulations and of the race tester span
    micro- or nanoseconds, which "0.0 ms" would hide."""
    unit, per, _ = time_unit(ns)
    return f"{ns} ns" if per == 1 else f"{ns / per:.1f} {unit}"


def time_unit(span_ns: int) -> tuple[str, int, int]:
    """(unit, ns per unit, decimals) for times from 0 to ``span_ns``: ms (to the us) from 1 ms, as
    long logs always printed; us (to the ns) under it; ns under 1 us. Logs of simulations and of
    the race tester have events a few us or ns apart, which would otherwise all print as 0.000 ms."""
    if abs(span_ns) >= 1_000_000:
        return "ms", 1_000_000, 3
    return ("us", 1_000, 3) if abs(span_ns) >= 1_000 else ("ns", 1, 0)


def offsets(span_ns: int, *, pad: bool = True) -> Callable[[int], str]:
    """A formatter of offsets from 0 to ``span_ns`` (``+   3.002 ms``), all in one unit
    (:func:`time_unit`) and, with ``pad``, one width (that of the widest, at least 8), so a column
    of them lines up, past ``+9999.999 ms`` too."""
    unit, per, places = time_unit(span_ns)
    width = max(8, len(f"{abs(span_ns) / per:.{places}f}")) if pad else 0

    def offset(t: int) -> str:
        return f"+{t / per:>{width}.{places}f} {unit}"

    return offset


def outcome_lines(summary: Summary) -> Iterator[str]:
    """One line per kind of request machine in the log: how its finished requests ended. A failed
    consumer request is handed back with its blocks invalid, and the config's policy says what the
    scheduler does about it (recompute or fail it), so the policy is named."""
    kinds = set(summary.per_state) | set(summary.finished)
    for machine in OUTCOMES:
        if machine in kinds:
            yield f"{machine}: " + ", ".join(_outcome_parts(machine, summary.finished.get(machine, Counter()),
                                                            summary.policy))


def _outcome_parts(machine: str, got: Counter[str], policy: str | None) -> list[str]:
    """The usual outcomes always (a 0 says something), the rare ones only when they happened."""
    if machine == "consumer":
        parts = [f"received {got['received']}",
                 f"failed {got['failed']} (policy {policy or 'unknown: no Started record'})",
                 f"aborted {got['aborted']}"]
        return parts + ([f"notify-only {got['notify_only']}"] if got["notify_only"] else [])
    parts = [f"released by notification {got['released']}", f"expired {got['expired']}"]
    return parts + ([f"discarded {got['discarded']}"] if got["discarded"] else [])


def render(summary: Summary, *, title: str = "", timelines: int = 8, limit: int = 20) -> Iterator[str]:
    """A readable report: machines per state, how finished requests ended, violations, stuck
    requests, a few timelines.

    At most ``limit`` violations and stuck requests are listed (the counts are always whole).
    """
    span = duration(summary.last_t_ns - summary.first_t_ns)
    if not summary.events:  # not "0 records up to seq -1, 0 ns"
        yield f"{title or 'log'}: no records"
    else:
        yield f"{title or 'log'}: {summary.events} records up to seq {summary.last_seq}, {span}"
    for machine, counts in sorted(summary.per_state.items()):
        # Machine and state names come from the file: a crafted one must not forge lines either.
        states = ", ".join(f"{printable(state)} {n}" for state, n in sorted(counts.items()))
        yield f"  {printable(machine):9s} {states}"
    yield from (f"  finished  {line}" for line in outcome_lines(summary))
    faults = summary.by_fault()
    yield f"  violations: {len(summary.violations)} (local {faults['local']}, remote {faults['remote']})"
    for v in summary.violations[:limit]:
        outcome = "rejected" if v.outcome.name == "REJECTED" else "handled"
        yield (f"    seq {v.seq} [{v.fault.value if v.fault else '?'}] {printable(v.machine)} "
               f"{machine_key(v)!r}: {type(v.event).__name__} {outcome}: {printable(v.reason)}")
    if len(summary.violations) > limit:
        yield f"    ... {len(summary.violations) - limit} more"
    stuck = summary.stuck
    yield f"  not terminal: {len(stuck)}" + "".join(f"\n    {printable(m)} {printable(repr(k))} in {printable(s)}"
                                                     for m, k, s in stuck[:limit])
    if len(stuck) > limit:
        yield f"    ... {len(stuck) - limit} more"
    shown = 0
    for (machine, key), steps in summary.timelines.items():
        if machine == "engine" or shown >= timelines:
            continue
        shown += 1
        t0 = steps[0].t_ns
        at = offsets(max(st.t_ns for st in steps) - t0)
        yield f"  {printable(machine)} {printable(repr(key))}:"
        for st in steps:
            applied = st.outcome == "applied"
            arrow = printable(f"{st.before} -> {st.state}" if applied else f"{st.state} ({st.outcome})")
            tail = " ".join(x for x in (st.detail, step_note(st.fault, st.reason, applied)) if x)
            yield f"    {at(st.t_ns - t0)}  #{st.seq:<6d} {st.event:22s} {arrow:24s} {tail}".rstrip()


def step_note(fault: str | None, reason: str, applied: bool) -> str:
    """What a timeline line says of a record beyond its transition: its fault and reason, or
    why it was not applied (the same in a log's timelines and a request's)."""
    if fault is not None:
        return f"[{fault} fault: {printable(reason)}]"
    return f"({printable(reason)})" if reason and not applied else ""


@dataclass(frozen=True)
class Visit:
    """One stay of one machine in one state: from the record that entered it to the one that left.

    ``end_seq`` is None when the machine was still in the state at the end of the records
    read (a terminal state, or a request stuck there). ``terminal`` is the table's notion:
    engines are terminal only once EVICTED.
    """

    machine: str
    key: Any
    state: str
    start_seq: int
    start_t_ns: int
    entered_by: str
    end_seq: int | None = None
    end_t_ns: int | None = None
    left_by: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL.get(self.machine, ())


def visits(records: Iterable[Record], *, at: int | None = None) -> list[Visit]:
    """Every state visit of every machine, in the order they started; self-loops stay one visit.
    Times run forward per machine: a record stamped before one applied earlier (its thread read
    the clock first, submitted later) is placed at that one's time, so visits never overlap."""
    out: list[Visit] = []
    current: dict[tuple[str, Any], int] = {}  # machine -> index of its open visit in ``out``
    latest: dict[tuple[str, Any], int] = {}  # machine -> the latest time placed on it
    for rec in records:
        if at is not None and rec.seq > at:
            break
        if rec.machine == "core":
            continue
        key = (rec.machine, machine_key(rec))
        t = latest[key] = max(rec.event.t_ns, latest.get(key, rec.event.t_ns))
        if _kept_none(rec):
            continue
        i = current.get(key)
        if i is not None:
            if out[i].state == rec.state and rec.before == rec.state:  # a self-loop, or news ignored there
                continue
            v = out[i]
            out[i] = Visit(v.machine, v.key, v.state, v.start_seq, v.start_t_ns, v.entered_by,
                           rec.seq, t, type(rec.event).__name__)
        current[key] = len(out)
        out.append(Visit(rec.machine, key[1], rec.state, rec.seq, t, type(rec.event).__name__))
    return out


@dataclass
class Followed:
    """One request's records across several logs, merged in time order.

    ``producer_ids`` are the producer's ids the query resolved to; ``consumers`` the
    (log, decode-local id) pairs that read them; ``entries`` (log name, record) pairs.
    """

    query: str
    producer_ids: list[str] = field(default_factory=list)
    consumers: list[tuple[str, str]] = field(default_factory=list)
    producers: list[tuple[str, str]] = field(default_factory=list)
    entries: list[tuple[str, Record]] = field(default_factory=list)


def _producer_side(rec: Record) -> bool:
    # A decode side's failed notification (SendFailed) names the producer's id, as notifications do.
    return rec.machine == "producer" or isinstance(rec.event, SendFailed)


# A producer request as a read names it: (engine id, producer's request id); an engine of None
# (a log whose first record, the Started config, was trimmed away) matches any engine.
_Hold = tuple["str | None", str]


@dataclass
class _Life:
    """One life of a decode-local id in one log: from the read that created its machine to the
    next (ids are reused once forgotten), or a single refused read (the id was in use)."""

    log: str
    request_id: str
    holds: set[_Hold] = field(default_factory=set)
    records: list[Record] = field(default_factory=list)


def _same(a: _Hold, b: _Hold) -> bool:
    return a[1] == b[1] and (a[0] is None or b[0] is None or a[0] == b[0])


def _lives(logs: Sequence[tuple[str, Sequence[Record]]]) -> list[_Life]:
    lives: list[_Life] = []
    current: dict[tuple[str, str], _Life] = {}
    for name, records in logs:
        for rec in records:
            ev = rec.event
            rid = getattr(ev, "request_id", None)
            if not isinstance(rid, str) or _producer_side(rec):
                continue
            life = current.get((name, rid))
            if isinstance(ev, ReadRequested) and rec.machine == "consumer":
                hold = (ev.engine_id, ev.remote_request_id)
                if rec.outcome is not Outcome.APPLIED:  # refused or ignored: this read alone
                    lives.append(_Life(name, rid, {hold}, [rec]))
                    continue
                # A read starts a new life of its id, unless the id's records so far read nothing
                # (an abort that came before the read): they are this life's first.
                if life is None or (rec.before == consumer.S.NEW.name and life.holds):
                    life = current[(name, rid)] = _Life(name, rid)
                    lives.append(life)
                life.holds.add(hold)
            elif life is None:  # its read was trimmed away (keep_segments)
                life = current[(name, rid)] = _Life(name, rid)
                lives.append(life)
            life.records.append(rec)
    return lives


def follow(logs: Sequence[tuple[str, Sequence[Record]]], request_id: str) -> Followed:
    """Follow a request through prefill and decode logs, by either of its ids.

    The decode side knows a request by its local id and names the producer's engine and id in
    ``ReadRequested``; the prefill side knows only its own id (its log's ``Started`` config
    names its engine). A query that is some decode log's local id resolves to every producer
    request it read (a local id reused once forgotten reads several); otherwise it is taken as
    a producer id, on any engine. Every decode request that read one of those (one per decode
    TP rank, typically; a read refused for an id in use included) is followed in the lives of
    its id that read them, and so are the producer records of those requests in the logs of
    their engines. Records are merged by ``t_ns`` (each log's own order is kept; ties go to the
    log listed first), which is a meaningful order across logs only when their clocks are
    comparable.
    """
    lives = _lives(logs)
    direct = [life for life in lives if life.request_id == request_id]
    wanted: set[_Hold] = set().union(*(life.holds for life in direct)) if direct else {(None, request_id)}
    chosen = direct + [life for life in lives if life.request_id != request_id
                       and any(_same(h, w) for h in life.holds for w in wanted)]
    out = Followed(request_id, sorted({rid for _, rid in wanted}),
                   sorted({(life.log, life.request_id) for life in chosen}))
    taken = {id(rec) for life in chosen for rec in life.records}
    streams: list[list[tuple[str, Record]]] = []
    producers: set[tuple[str, str]] = set()
    for name, records in logs:
        engine_id = records[0].event.config.engine_id if records and isinstance(records[0].event, Started) else None
        mine: list[tuple[str, Record]] = []
        for rec in records:
            if id(rec) in taken:
                mine.append((name, rec))
                continue
            rid = getattr(rec.event, "request_id", None)
            if not isinstance(rid, str) or not _producer_side(rec):
                continue
            at = rec.event.engine_id if isinstance(rec.event, SendFailed) else engine_id
            if any(_same((at, rid), w) for w in wanted):
                mine.append((name, rec))
                if rec.machine == "producer":
                    producers.add((name, rid))
        streams.append(mine)
    out.producers = sorted(producers)
    out.entries = list(heapq.merge(*streams, key=lambda e: e[1].event.t_ns))
    return out
