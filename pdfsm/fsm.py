"""Transition tables as plain data, checked when they are defined.

A table maps every (state, event type) cell to an ordered tuple of options. An
option is a transition (:class:`Go`), an explicit ignore with a reason
(:class:`Ignore`) or an explicit illegal event (:class:`Illegal`), each
optionally guarded by a named predicate. The first option whose guard holds
decides; the last option of every cell is unguarded, so every cell decides
every input.

Two rules keep the machines honest: guards only read, and actions never raise.
Anything that can go wrong is a guard routing to a failure option, so an
illegal or ignored event leaves the machine exactly as it was.

Nothing here knows about KV transfer; :mod:`pdfsm.consumer`,
:mod:`pdfsm.producer` and :mod:`pdfsm.engine` each own one table.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, final

__all__ = [
    "Fault",
    "Machine",
    "Go",
    "Ignore",
    "Illegal",
    "Option",
    "State",
    "Table",
    "TableError",
    "label",
    "on",
]


class Fault(enum.Enum):
    """Whose fault a violation is: ours (a local misuse) or the peer's."""

    LOCAL = "local"
    REMOTE = "remote"


class TableError(Exception):
    """A table is malformed: raised when it is defined, never while it runs."""


@final
class State:
    """A named state. Compared by identity; the name is what logs and diagrams show."""

    __slots__ = ("name", "terminal")

    def __init__(self, name: str, *, terminal: bool = False) -> None:
        self.name: Final = name
        self.terminal: Final = terminal

    def __repr__(self) -> str:
        return self.name


class Machine:
    """What every machine has: its state, which the core's loop reads and writes on every event.
    A field of this base (the request and engine classes extend it), so the loop, which holds
    machines of three classes, reads and writes it natively (through ``Any`` compiled code would
    look it up by name)."""

    __slots__ = ("state",)

    def __init__(self, state: State) -> None:
        self.state = state


Guard = Callable[[Any, Any, Any], bool]
"""``guard(machine, event, core) -> bool``; reads only."""

Action = Callable[[Any, Any, Any], None]
"""``action(machine, event, core)``; updates the machine's data, emits commands, never raises."""

GO: Final = 0
IGNORE: Final = 1
ILLEGAL: Final = 2


def label(fn: Callable[..., Any] | None) -> str:
    """A guard's or action's name as diagrams and logs show it ("_lease_over" -> "lease over")."""
    return "" if fn is None else fn.__name__.strip("_").replace("_", " ")


@final
class Go:
    """Move to ``dst`` after running ``action``.

    ``fault`` marks a transition that handles a fault (a handshake refused, a
    notification for a request never registered): it is legal, and it is also
    listed as a violation attributed to ``fault`` with ``reason``, or with what
    ``explain(machine, event, core)`` says once the action has run.
    """

    __slots__ = ("action", "dst", "explain", "fault", "kind", "reason", "when")

    def __init__(
        self,
        dst: State,
        action: Action | None = None,
        *,
        when: Guard | None = None,
        fault: Fault | None = None,
        reason: str = "",
        explain: Callable[[Any, Any, Any], str] | None = None,
    ) -> None:
        if fault is not None and not reason:
            raise TableError(f"a fault-handling transition to {dst} needs a reason")
        self.kind: Final = GO
        self.dst: Final = dst
        self.action: Final = action
        self.when: Final = when
        self.fault: Final = fault
        self.reason: Final = reason
        self.explain: Final = explain

    def __repr__(self) -> str:
        guard = f" when {label(self.when)}" if self.when else ""
        return f"Go({self.dst}{guard})"


@final
class Ignore:
    """Leave the machine unchanged, on purpose, for the stated reason."""

    __slots__ = ("fault", "kind", "reason", "when")

    def __init__(self, reason: str, *, when: Guard | None = None) -> None:
        if not reason:
            raise TableError("an ignore needs a reason")
        self.kind: Final = IGNORE
        self.reason: Final = reason
        self.when: Final = when
        self.fault: Final[Fault | None] = None

    def __repr__(self) -> str:
        return f"Ignore({self.reason!r})"


@final
class Illegal:
    """Reject the event, leave the machine unchanged, and blame ``fault``."""

    __slots__ = ("fault", "kind", "reason", "when")

    def __init__(self, fault: Fault, reason: str, *, when: Guard | None = None) -> None:
        if not reason:
            raise TableError("an illegal cell needs a reason")
        self.kind: Final = ILLEGAL
        self.fault: Final = fault
        self.reason: Final = reason
        self.when: Final = when

    def __repr__(self) -> str:
        return f"Illegal({self.fault.value}: {self.reason!r})"


Option = Go | Ignore | Illegal
Cells = dict[tuple[State, type], tuple[Option, ...]]


def on(
    states: State | Iterable[State],
    events: type | Iterable[type],
    *options: Option,
) -> Cells:
    """Decide the cells ``states x events`` with the same ordered options."""
    ss = (states,) if isinstance(states, State) else tuple(states)
    es = (events,) if isinstance(events, type) else tuple(events)
    return {(s, e): options for s in ss for e in es}


@final
class Table:
    """One machine's transition table, checked for totality and reachability.

    ``cells`` is given as a sequence of :func:`on` blocks; a cell decided twice
    is an error, as is a cell left undecided.
    """

    __slots__ = ("cells", "dispatch", "events", "initial", "name", "states", "terminal", "variant")

    def __init__(
        self,
        name: str,
        *,
        states: Sequence[State],
        initial: State,
        events: Sequence[type],
        cells: Sequence[Cells],
        variant: str = "",
    ) -> None:
        self.name: Final = name
        self.variant: Final = variant  # a patched copy's own name; records keep the machine's
        self.states: Final = tuple(states)
        self.initial: Final = initial
        self.events: Final = tuple(events)
        self.terminal: Final = frozenset(s for s in self.states if s.terminal)
        merged: Cells = {}
        for block in cells:
            for key, options in block.items():
                if key in merged:
                    raise TableError(f"{name}: cell ({key[0]}, {key[1].__name__}) decided twice")
                merged[key] = options
        self.cells: Final[Mapping[tuple[State, type], tuple[Option, ...]]] = merged
        self._check()
        self.dispatch: Final[dict[State, dict[type, tuple[Option, ...]]]] = {
            s: {e: merged[(s, e)] for e in self.events} for s in self.states
        }

    def patched(self, variant: str, cells: Cells) -> Table:
        """A copy with some cells decided differently, checked like any table (for policies and
        the race tester's mutants). It keeps the machine's name, which is what records carry,
        so a log made with it is read by every tool; replaying it against the real tables shows
        where the two differ."""
        unknown = sorted(f"({s}, {e.__name__})" for s, e in cells if (s, e) not in self.cells)
        if unknown:
            raise TableError(f"{self.name} ({variant}): patches cells that do not exist: {', '.join(unknown)}")
        merged = {**self.cells, **cells}
        return Table(self.name, states=self.states, initial=self.initial, events=self.events, cells=(merged,),
                     variant=variant)

    def edges(self) -> list[tuple[State, type, Go]]:
        """Every transition option, in table order: (source, event type, option)."""
        return [
            (s, e, opt)
            for (s, e), options in self.cells.items()
            for opt in options
            if isinstance(opt, Go)
        ]

    def targets(self, state: State, event: type) -> frozenset[State]:
        """The states a (state, event) cell may lead to (its own state for ignore or illegal)."""
        return frozenset(o.dst if isinstance(o, Go) else state for o in self.cells[(state, event)])

    def _check(self) -> None:
        name, states = f"{self.name} ({self.variant})" if self.variant else self.name, set(self.states)
        if len(states) != len(self.states):
            raise TableError(f"{name}: a state is listed twice")
        if self.initial not in states:
            raise TableError(f"{name}: initial state {self.initial} is not one of its states")
        if self.initial.terminal:
            raise TableError(f"{name}: the initial state cannot be terminal")
        if not self.terminal:
            raise TableError(f"{name}: no terminal state")
        known = {(s, e) for s in self.states for e in self.events}
        extra = sorted(f"({s}, {e.__name__})" for s, e in set(self.cells) - known)
        if extra:
            raise TableError(f"{name}: cells for unknown states or events: {', '.join(extra)}")
        missing = sorted(f"({s}, {e.__name__})" for s, e in known - set(self.cells))
        if missing:
            raise TableError(f"{name}: undecided cells: {', '.join(missing)}")
        for (s, e), options in self.cells.items():
            where = f"{name}: cell ({s}, {e.__name__})"
            if not options:
                raise TableError(f"{where} has no option")
            if options[-1].when is not None:
                raise TableError(f"{where}: its last option must be unguarded")
            if any(o.when is None for o in options[:-1]):
                raise TableError(f"{where}: an unguarded option hides the ones after it")
            for o in options:
                if isinstance(o, Go):
                    if o.dst not in states:
                        raise TableError(f"{where} goes to unknown state {o.dst}")
                    if s.terminal and o.dst is not s:
                        raise TableError(f"{where} leaves terminal state {s}")
        succ: dict[State, set[State]] = {s: set() for s in self.states}
        for s, _, go in self.edges():
            succ[s].add(go.dst)
        reached = _closure({self.initial}, succ)
        unreachable = sorted(s.name for s in states - reached)
        if unreachable:
            raise TableError(f"{name}: unreachable states: {', '.join(unreachable)}")
        for s in self.states:
            if not s.terminal and not (_closure({s}, succ) & self.terminal):
                raise TableError(f"{name}: no terminal state is reachable from {s} (a trap)")


def _closure(start: set[State], succ: Mapping[State, set[State]]) -> set[State]:
    seen, todo = set(start), list(start)
    while todo:
        for nxt in succ[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
