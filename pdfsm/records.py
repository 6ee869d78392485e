"""What the log keeps: a record per applied, ignored or rejected event, stored as a plain
:data:`Row` and read back as a typed :class:`Record`; and where records go besides the window
(a :class:`Sink`). Apart from :mod:`pdfsm.log` so that it may be compiled (setup.py): mypyc
would drop a Struct's class keywords (``frozen``, ``array_like``)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from pdfsm.events import Event, EventType
from pdfsm.fsm import Fault

__all__ = ["MemorySink", "Outcome", "Record", "Row", "Sink"]


class Outcome(enum.IntEnum):
    APPLIED = 0
    IGNORED = 1
    REJECTED = 2


Row = tuple[int, Event, str, str, str, int, str, "str | None", "int | None"]
"""A record as stored: (seq, event, machine, before, state, outcome, reason, fault, cause).

Only atoms (ints, strings, None, GC-untracked events) so the garbage collector untracks the
tuple and never walks the window again; ``outcome`` is an :class:`Outcome` value and
``fault`` a :class:`~pdfsm.fsm.Fault` value."""


class Record(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One applied, ignored or rejected event and the state its machine was left in."""

    seq: int
    event: EventType
    machine: str  # "consumer", "producer", "engine" or "core"
    before: str
    state: str
    outcome: Outcome
    reason: str = ""
    fault: Fault | None = None
    cause: int | None = None  # derived events: the seq of the root event that caused them

    @property
    def violation(self) -> bool:
        """Rejected with a fault, or a legal transition that handled somebody's fault."""
        return self.fault is not None

    @property
    def root(self) -> bool:
        return self.cause is None

    def row(self) -> Row:
        return (self.seq, self.event, self.machine, self.before, self.state, int(self.outcome),
                self.reason, None if self.fault is None else self.fault.value, self.cause)

    @classmethod
    def of(cls, row: Sequence[Any]) -> Record:
        """The typed view of a stored row."""
        seq, event, machine, before, state, outcome, reason, fault, cause = row
        return cls(seq, event, machine, before, state, Outcome(outcome), reason,
                   None if fault is None else Fault(fault), cause)


class Sink(Protocol):
    """Where records go besides the in-memory window: the durable file log, a test list."""

    def write(self, rows: Sequence[Row]) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps every record; for tests, examples and short runs."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def write(self, rows: Sequence[Row]) -> None:
        self.rows.extend(rows)

    def close(self) -> None:
        pass

    @property
    def records(self) -> list[Record]:
        return [Record.of(row) for row in self.rows]
