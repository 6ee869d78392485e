"""The event log: producers on any thread submit events; the owner records what it applied.

Two halves, one object:

- **Inbox.** ``submit`` may be called from any thread (NIXL's progress
  threads, the handshake thread, timers, the scheduler). It appends to a
  deque, which CPython makes atomic, so the hot path takes no lock. The inbox
  is bounded; when it is full the policy is explicit: ``BLOCK`` makes the
  producer wait for the owner, ``COUNT`` refuses the event, counts it by
  source, and the owner records a :class:`~pdfsm.events.Dropped` event so the
  loss is in the log, never silent (once the log is closed, events still
  submitted are only counted, in ``take_dropped``: no record follows the last).
  The owner thread's own submissions are
  neither refused nor made to wait (it would wait for itself).
- **Records.** The owner thread records every event it applied, ignored or
  rejected, with the state it produced, in one sequence with no gaps. The last
  ``window`` records stay in memory; every record also goes to the sink (the
  durable file log plugs in there) when the owner flushes after a batch. With
  no sink, records older than the window are counted as ``evicted``.

A record is a :class:`Record` from the moment it is made (untracked by the
garbage collector: see its docstring); the file log writes them as they are.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, Final, cast

from pdfsm.errors import InvalidInput
from pdfsm.events import Event
from pdfsm.fsm import Fault
from pdfsm.records import MemorySink, Outcome, Record, Sink

__all__ = ["EventLog", "MemorySink", "Outcome", "Overflow", "Record", "Sink"]

_NONE: Final[Mapping[str, int]] = MappingProxyType({})
# Whether each event class is derived (its DERIVED), by class: submit asks for every event, and
# compiled code would look the class attribute up by name each time. Bounded by the classes.
_DERIVED: Final[dict[type, bool]] = {}


class Overflow(enum.Enum):
    """What ``submit`` does when the inbox is full."""

    BLOCK = "block"
    COUNT = "count"


class EventLog:
    """An append-only log with a thread-safe inbox and a bounded in-memory window."""

    def __init__(
        self,
        *,
        window: int = 65536,
        sink: Sink | None = None,
        inbox_limit: int = 1 << 20,
        overflow: Overflow = Overflow.BLOCK,
    ) -> None:
        if window < 1 or inbox_limit < 1:
            raise ValueError("window and inbox_limit must be positive")
        self.inbox: Final[deque[Event]] = deque()
        self._inbox_append: Final = self.inbox.append  # bound once: submit's one call
        self.window: Final[deque[Record]] = deque(maxlen=window)
        self.sink: Final = sink
        self.inbox_limit: Final = inbox_limit
        self.overflow: Final = overflow
        self.next_seq = 0
        self.unsunk: Final[list[Record]] = []  # records not yet handed to the sink; always this one list
        self._room = threading.Condition()
        self._waiting = 0
        self._owner_waits = 0  # owner_waiting() depth: BLOCK submitters do not wait then
        self._dropped: Counter[str] = Counter()
        self._closed = False
        self.owner: int | None = None  # the owner thread's ident, once known (set by the core)

    # --- any thread ----------------------------------------------------------------------------

    def submit(self, ev: Event) -> None:
        """Queue an event for the owner. Thread-safe; blocks or counts only when the inbox is full.

        Derived events (``DERIVED``) are the core's own conclusions and are refused: an adapter
        that could submit a ``Reported`` or an ``EngineReady`` could forge them.
        """
        kind = type(ev)
        derived = _DERIVED.get(kind)
        if derived is None:
            derived = _DERIVED[kind] = bool(ev.DERIVED)
        if derived:
            raise InvalidInput("event", f"{kind.__name__} is derived by the core, never submitted")
        if (len(self.inbox) >= self.inbox_limit or self._closed) and not self._make_room(ev):
            return  # counted: a closed log is never pumped again, so nothing is kept silently
        self._inbox_append(ev)

    def _make_room(self, ev: Event) -> bool:
        if threading.get_ident() == self.owner and not self._closed:
            # The owner's own submissions (the scheduler's calls, a polled transport's outcomes)
            # go in over the limit: waiting would wait for itself, and dropping them would lose
            # what the caller was told is accepted. It drains them at its next pump.
            return True
        with self._room:
            if self.overflow is Overflow.BLOCK:
                self._waiting += 1
                try:
                    while len(self.inbox) >= self.inbox_limit and not self._closed and not self._owner_waits:
                        self._room.wait(0.05)
                finally:
                    self._waiting -= 1
                if not self._closed:
                    return True
            if not self._closed and not ev.DROPPABLE:  # COUNT: an answer the owner waits for goes in
                return True
            self._dropped[ev.source] += 1  # COUNT, or closed: nobody will ever apply it
            return False

    @contextlib.contextmanager
    def owner_waiting(self) -> Iterator[None]:
        """The owner waits for adapter threads that report as they stop (a transport's ``close()``
        joining its workers): it cannot make room meanwhile, so their submissions go in over the
        limit instead of waiting for it (what they still have to report is bounded: each read
        reports once). Owner thread only."""
        with self._room:
            self._owner_waits += 1
            self._room.notify_all()
        try:
            yield
        finally:
            with self._room:
                self._owner_waits -= 1

    # --- owner thread ---------------------------------------------------------------------------
    # The core, the log's single writer, appends records inline on its hot path (a method call
    # here would cost as much as the rest of the append); this is the same append, spelt out.

    def append(
        self,
        event: Event,
        machine: str,
        before: str,
        state: str,
        outcome: Outcome,
        reason: str = "",
        fault: Fault | None = None,
        cause: int | None = None,
    ) -> Record:
        """Assign the next sequence number and keep the record. Owner thread only."""
        seq = self.next_seq
        self.next_seq = seq + 1
        # Record.event is typed as the decoder's union of event classes; any event is recorded.
        rec = Record(seq, cast(Any, event), machine, before, state, outcome, reason, fault, cause)
        self.window.append(rec)
        if self.sink is not None:
            self.unsunk.append(rec)
        return rec

    def take_dropped(self) -> Mapping[str, int]:
        """Counts of events refused since the last call (COUNT policy). Owner thread only."""
        if not self._dropped:
            return _NONE  # every pump asks: no allocation for the common answer
        with self._room:
            dropped, self._dropped = self._dropped, Counter()
        return dropped

    def flush(self) -> None:
        """Hand the records made since to the sink and wake producers waiting for room."""
        if self.unsunk and self.sink is not None:
            batch = self.unsunk[:]
            self.sink.write(batch)  # if it raises, the records stay and go again at the next flush
            del self.unsunk[:len(batch)]  # in place: the core holds its append method
        if self._waiting:
            with self._room:
                self._room.notify_all()

    def close(self) -> None:
        """Flush and close the sink; closed even when the flush raises (raised after)."""
        try:
            self.flush()
        finally:
            self._closed = True
            if self.sink is not None:
                self.sink.close()

    # --- reading --------------------------------------------------------------------------------

    @property
    def evicted(self) -> int:
        """Records no longer in the in-memory window (they went to the sink, if there is one)."""
        return self.next_seq - len(self.window)

    def records(self) -> list[Record]:
        """The records still in the in-memory window, oldest first."""
        return list(self.window)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records())

    def __len__(self) -> int:
        return len(self.window)
