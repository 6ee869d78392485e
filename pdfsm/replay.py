"""Replay a log: rebuild every machine and check that the recorded outcomes come out again.

Only root events (records without a ``cause``) are fed back; the core derives the
rest, and every record it produces must equal the recorded one: same sequence
number, event, machine, states, outcome, reason and fault. The first difference
is a :class:`Divergence` naming that record. Replay is deterministic: the core
reads no clock and no randomness, so the same log always replays the same way.

:func:`summarize` reads the records alone (no re-application): each machine's
state at any sequence number, violations with their attribution, requests that
never reached a terminal state, and per-request timelines.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pdfsm.core import Core
from pdfsm.errors import PdfsmError, ProtocolError
from pdfsm.events import Started
from pdfsm.log import EventLog, Record, Row

__all__ = ["Divergence", "Step", "Summary", "machine_key", "replay", "summarize"]

TERMINAL = {"consumer": {"RELEASED"}, "producer": {"RELEASED", "EXPIRED", "DISCARDED"}, "engine": set()}


class Divergence(PdfsmError):
    """Replaying a log produced something other than what it recorded."""

    def __init__(self, seq: int, expected: Record | None, got: Record | None, why: str) -> None:
        super().__init__(f"divergence at seq {seq}: {why}\n  recorded:   {expected}\n  recomputed: {got}")
        self.seq, self.expected, self.got = seq, expected, got


class _Capture:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def write(self, rows: Any) -> None:
        self.rows.extend(rows)

    def close(self) -> None:
        pass


def _differs(a: Record, b: Record) -> str:
    for name in ("seq", "event", "machine", "before", "state", "outcome", "reason", "fault", "cause"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} differs"
    return ""


def replay(records: Iterable[Record], *, window: int = 1024) -> Core:
    """Rebuild the core a log came from, checking each record; returns the rebuilt core.

    Raises :class:`Divergence` at the first record that does not come out again. A log
    that ends part-way through the records one event derived (a torn tail) is accepted.
    """
    it = iter(records)
    first = next(it, None)
    if first is None or not isinstance(first.event, Started) or first.seq != 0:
        raise Divergence(0, first, None, "a log starts with the Started record at seq 0")
    capture = _Capture()
    core = Core(first.event.config, EventLog(window=window, sink=capture), t_ns=first.event.t_ns)
    core.log.flush()
    pending: list[Record] = [Record.of(row) for row in capture.rows]
    capture.rows.clear()
    _match(pending, first)
    for rec in it:
        if rec.root:
            if pending:
                raise Divergence(pending[0].seq, None, pending[0], "recomputed records the log does not have")
            with contextlib.suppress(ProtocolError):  # strict mode raised after recording, as it did then
                core.apply(rec.event)
            core.log.flush()
            pending = [Record.of(row) for row in capture.rows]
            capture.rows.clear()
        _match(pending, rec)
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

    @property
    def per_state(self) -> dict[str, Counter[str]]:
        out: dict[str, Counter[str]] = {}
        for (machine, _), state in self.states.items():
            out.setdefault(machine, Counter())[state] += 1
        return out

    @property
    def stuck(self) -> list[tuple[str, Any, str]]:
        """Requests not in a terminal state at the end (engines rest in CONNECTED legitimately)."""
        return [(m, k, s) for (m, k), s in self.states.items() if m != "engine" and s not in TERMINAL[m]]

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
            out.first_t_ns = t
        out.last_t_ns = max(out.last_t_ns, t)
        if rec.fault is not None:
            out.violations.append(rec)
        if rec.machine == "core":
            continue
        key = (rec.machine, machine_key(rec))
        if rec.state != "NEW" or key in out.states:
            out.states[key] = rec.state
        if timelines:
            out.timelines.setdefault(key, []).append(Step(
                rec.seq, t, rec.event.source, type(rec.event).__name__, rec.before, rec.state,
                rec.outcome.name.lower(), rec.reason, rec.cause))
    return out


def render(summary: Summary, *, title: str = "", timelines: int = 8) -> Iterator[str]:
    """A readable report: machines per state, violations, stuck requests, a few timelines."""
    span = (summary.last_t_ns - summary.first_t_ns) / 1e6
    yield f"{title or 'log'}: {summary.events} records up to seq {summary.last_seq}, {span:.1f} ms"
    for machine, counts in sorted(summary.per_state.items()):
        yield f"  {machine:9s} " + ", ".join(f"{state} {n}" for state, n in sorted(counts.items()))
    faults = summary.by_fault()
    yield f"  violations: {len(summary.violations)} (local {faults['local']}, remote {faults['remote']})"
    for v in summary.violations[:20]:
        outcome = "rejected" if v.outcome.name == "REJECTED" else "handled"
        yield (f"    seq {v.seq} [{v.fault.value if v.fault else '?'}] {v.machine} "
               f"{machine_key(v)!r}: {type(v.event).__name__} {outcome}: {v.reason}")
    stuck = summary.stuck
    yield f"  not terminal: {len(stuck)}" + "".join(f"\n    {m} {k!r} in {s}" for m, k, s in stuck[:20])
    shown = 0
    for (machine, key), steps in summary.timelines.items():
        if machine == "engine" or shown >= timelines:
            continue
        shown += 1
        t0 = steps[0].t_ns
        yield f"  {machine} {key!r}:"
        for st in steps:
            arrow = f"{st.before} -> {st.state}" if st.outcome == "applied" else f"{st.state} ({st.outcome})"
            yield f"    +{(st.t_ns - t0) / 1e6:8.3f} ms  #{st.seq:<6d} {st.event:22s} {arrow}"
