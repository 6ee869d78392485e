"""What the log keeps: a :class:`Record` per applied, ignored or rejected event; and where
records go besides the window (a :class:`Sink`). Apart from :mod:`pdfsm.log` so that the log may
be compiled (setup.py): mypyc would drop a Struct's class keywords (``frozen``, ``array_like``)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from pdfsm.events import EventType
from pdfsm.fsm import Fault

__all__ = ["MemorySink", "Outcome", "Record", "Sink"]


class Outcome(enum.IntEnum):
    APPLIED = 0
    IGNORED = 1
    REJECTED = 2


class Record(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One applied, ignored or rejected event and the state its machine was left in.

    The core keeps records as they are made (the window, the sink's batches), so this class is the
    hot path's one allocation per record. It is untracked by the garbage collector (``gc=False``:
    it holds atoms and an event, which are untracked too, and nothing refers back to a record).
    A tuple would be cheaper to build but is tracked until the collector's next look, and at one
    or more per event the collections it triggers cost more than the build saves (measured:
    docs/benchmarks.md). Encoded as an array, ``outcome`` as its int and ``fault`` as its value.
    """

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


class Sink(Protocol):
    """Where records go besides the in-memory window: the durable file log, a test list."""

    def write(self, records: Sequence[Record]) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps every record; for tests, examples and short runs."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def write(self, records: Sequence[Record]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


class Tombstone(msgspec.Struct, frozen=True, gc=False):
    """A terminal state the core remembers (its key, kind and time), oldest first in a deque to
    forget in order. A Struct, not a tuple, for the reason :class:`Record` is one: one is made per
    finished request and stays, untracked by the garbage collector (it holds atoms, a key tuple of
    atoms at most). Here, not in :mod:`pdfsm.core`: a compiled module cannot define a Struct."""

    t_ns: int
    target: int
    key: Any
