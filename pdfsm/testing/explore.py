"""Driving a :class:`World`: Hypothesis picks the interleaving, or every interleaving is tried.

- :func:`drive` runs one interleaving inside a Hypothesis test (``@given(st.data())``):
  at each step Hypothesis picks one of the enabled choices (or to stop), so failures
  shrink to short interleavings made of the first choices, fault-free where possible.
  Given ``logs=``, a failing interleaving's logs are written there.
- :func:`hunt` runs that search programmatically and returns what it found: whether an
  invariant broke, after how many examples and seconds, and the shrunk counterexample
  (its steps then minimized by name, see :func:`minimize`).
- :func:`exhaust` tries every interleaving up to a depth, treating choices that touch
  different requests as commuting (sleep sets), for when sampling is not enough; a node
  budget bounds it, and says when it cut the search short.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdfsm.testing.invariants import END_INVARIANTS
from pdfsm.testing.world import Choice, InvariantViolation, Scenario, Variant, World

__all__ = ["DEFAULT_SCENARIOS", "Found", "drive", "exhaust", "hunt", "minimize", "replay_choices"]

DEFAULT_SCENARIOS: dict[str, Scenario] = {
    "basic": Scenario(),
    "producer TP 2": Scenario(producer_tp=2),
    "consumer TP 2": Scenario(consumer_tp=2),
    "producer PP 2": Scenario(producer_pp=2),
    "PP without transport support": Scenario(producer_pp=2, supports_pp=False),
    "MLA": Scenario(producer_tp=2, mla=True),
    "notify-only": Scenario(notify_only=(1,)),
    "wrong listener": Scenario(wrong_listener=True),
    "scheduler deadlines": Scenario(scheduler_deadlines=True),
    "staging full": Scenario(requests=2, max_staged=1),
    "peer added asynchronously": Scenario(add_peer_async=True),
    "handshake retries": Scenario(requests=3, faults=frozenset({"handshake-timeout", "disconnect", "evict"})),
    "late replies": Scenario(requests=3, add_peer_async=True, handshake_retry_ns=0,
                             faults=frozenset({"handshake-timeout", "disconnect"}),
                             prefix=("prefill: p0 finishes prefill", "scheduler: D0 asks to read r0",
                                     "handshake: D0 gets the answer for (P, pp 0) #1: timed out",
                                     "prefill: p1 finishes prefill", "scheduler: D0 asks to read r1",
                                     "handshake: D0 gets the answer for (P, pp 0) #2")),
    # A decode timer behind: reads end, and answers come, past a deadline not yet expired (the trust bound).
    "decode timer behind": Scenario(requests=2, producer_tp=2, faults=frozenset({"late-tick", "abort"})),
    # Cancelled reads outliving cancel_grace_ns: their engine stage marked stalled while they still run.
    "cancelled reads hang": Scenario(requests=2, producer_tp=2, cancel_grace_ns=10),
}
"""Shapes the CI profile explores; together they reach every reachable cell (tests/test_race.py)."""

Invariant = Callable[[World], None]
_GLOBAL = frozenset({"time", "collect", "engine"})


def drive(data: st.DataObject, scenario: Scenario | None = None, variant: Variant | None = None,
          invariants: Iterable[Invariant] = (), *, settle: bool = True,
          logs: str | os.PathLike[str] | None = None) -> World:
    """One interleaving chosen by Hypothesis; raises :class:`InvariantViolation` on a broken invariant.

    With ``logs``, a failing run's logs are written there (emptied first), in the production
    format for ``pdfsm replay``, and the message names the directory. Hypothesis runs the
    shrunk example last, so the logs left are those of the counterexample it reports. The steps
    are Hypothesis's shrink; :func:`hunt` (and the ``race`` fixture) also remove steps by name.
    """
    world = World(scenario, variant, invariants)
    try:
        _choose(world, data)
        if settle:
            world.drain()
            for invariant in END_INVARIANTS:
                invariant(world)
    except InvariantViolation as exc:
        if logs is None:
            raise
        shutil.rmtree(logs, ignore_errors=True)  # another example's cores would pass for this one's
        world.dump(logs)
        raise InvariantViolation(f"{exc}\n\ncounterexample logs (pdfsm replay them): {logs}") from exc
    return world


@dataclass
class Found:
    """What a hunt found."""

    found: bool
    examples: int  # interleavings generated up to the first failure (all of them if none failed)
    seconds: float  # until the first failure
    steps: int = 0  # steps chosen in the shrunk counterexample (not the settling that follows them)
    message: str = ""
    world: World | None = field(default=None, repr=False)
    total_steps: int = 0  # steps taken over every interleaving tried, shrinking included


def hunt(scenario: Scenario | None = None, variant: Variant | None = None, invariants: Iterable[Invariant] = (),
         *, max_examples: int = 2000, derandomize: bool = True, shrink: bool = True,
         coverage: set[tuple[str, str, str]] | None = None) -> Found:
    """Search interleavings with Hypothesis until an invariant breaks; shrink it.

    ``coverage``, when given, collects the (machine, state, event type) cells every run hit.
    """
    invariants = list(invariants)
    calls, first, total = 0, None, 0
    last: list[World] = []
    start = time.perf_counter()
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]

    @settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        nonlocal calls, first
        calls += 1
        world = World(scenario, variant, invariants)
        last[:] = [world]
        try:
            _run(world, data)
        except InvariantViolation:
            if first is None:
                first = (calls, time.perf_counter() - start)
            raise
        finally:
            nonlocal total
            total += world.step_no
            if coverage is not None:
                coverage.update(world.coverage())

    try:
        run()
    except InvariantViolation as exc:
        assert first is not None
        world, message = minimize(last[0].chosen, scenario, variant, invariants) or (last[0], str(exc))
        return Found(True, first[0], first[1], len(world.chosen), message, world, total)
    return Found(False, calls, time.perf_counter() - start, total_steps=total)


def replay_choices(names: list[str], scenario: Scenario | None, variant: Variant | None,
                   invariants: Iterable[Invariant] = (), *, strict: bool = False) -> tuple[World, str]:
    """Make the named choices in order (skipping any not enabled; ``strict``: a step not enabled
    is a ValueError, for a written-down interleaving), settle, check; returns the world and the
    violation message ("" if every invariant held)."""
    world = World(scenario, variant, invariants)
    try:
        for name in names:
            choice = next((c for c in world.enabled() if c.name == name), None)
            if choice is not None:
                world.choose(choice)
            elif strict:
                raise ValueError(f"step {name!r} is not enabled: {[c.name for c in world.enabled()]}")
        world.drain()
        for invariant in END_INVARIANTS:
            invariant(world)
    except InvariantViolation as exc:
        return world, str(exc)
    return world, ""


def minimize(names: list[str], scenario: Scenario | None, variant: Variant | None,
             invariants: Iterable[Invariant] = ()) -> tuple[World, str] | None:
    """Remove steps by name while the run still fails: a counterexample where no single step can go.

    Hypothesis shrinks the choice *indices*; this shrinks the *steps*, which stay meaningful
    when earlier ones are removed because every choice has a stable name.
    """
    invariants = list(invariants)
    world, message = replay_choices(names, scenario, variant, invariants)
    if not message:
        return None
    names, shrunk = world.chosen, True
    while shrunk:  # until a whole pass removes nothing: a step may go only once a later one went
        shrunk, i = False, 0
        while i < len(names):
            w, m = replay_choices(names[:i] + names[i + 1:], scenario, variant, invariants)
            if m:
                world, message, names, shrunk = w, m, w.chosen, True
            else:
                i += 1
    return world, message


def _seed(world: World) -> None:
    """Make the scenario's prefix steps, each of which must be enabled."""
    for name in world.s.prefix:
        choice = next((c for c in world.enabled() if c.name == name), None)
        if choice is None:  # a misspelt seed would quietly start the search from the root
            raise ValueError(f"prefix step {name!r} is not enabled after {world.chosen}")
        world.choose(choice)


def _choose(world: World, data: st.DataObject) -> None:
    """The prefix, the run's length (it shrinks towards short runs), then each step's choice
    (which shrinks towards the first enabled one)."""
    _seed(world)
    steps = data.draw(st.integers(1, world.s.max_steps), label="steps")
    for _ in range(steps):
        choices = world.enabled()
        world.choose(choices[data.draw(st.integers(0, len(choices) - 1), label="next")])


def _run(world: World, data: st.DataObject) -> None:
    _choose(world, data)
    world.drain()
    for invariant in END_INVARIANTS:
        invariant(world)


def _independent(a: Choice, b: Choice) -> bool:
    return not (a.keys & b.keys) and not (a.keys & _GLOBAL) and not (b.keys & _GLOBAL)


@dataclass
class Exhausted:
    """What an exhaustive search did: ``cut`` when the node budget ended it before every path was
    tried (then a clean result proves nothing about the paths left)."""

    paths: int
    nodes: int
    violation: str = ""
    trace: list[str] = field(default_factory=list)
    cut: bool = False


def exhaust(scenario: Scenario, variant: Variant | None = None, invariants: Iterable[Invariant] = (),
            *, depth: int = 12, ticks: int = 1, collects: int = 2, max_nodes: int | None = 20_000) -> Exhausted:
    """Every interleaving of up to ``depth`` choices, commuting independent ones (sleep sets).

    The search starts after the scenario's ``prefix`` (a step not enabled is a ValueError).
    Timer and collect actions are global (they touch everything) and are bounded to ``ticks``
    and ``collects`` uses per path; every path ends by settling the world and checking the
    end invariants. The tree grows about tenfold per level with the default faults, so the
    search stops after ``max_nodes`` nodes (None: never) with ``cut`` set: a budget in nodes,
    not seconds, so a cut search is the same search on any machine.
    """
    if max_nodes is not None and max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1 (or None), got {max_nodes}")
    invariants = list(invariants)
    out = Exhausted(0, 0)

    def replay(path: list[str]) -> World:
        world = World(scenario, variant, invariants)
        _seed(world)
        for name in path:
            world.choose(next(c for c in world.enabled() if c.name == name))
        return world

    def allowed(world: World, path: list[str]) -> list[Choice]:
        used_ticks = sum(p.startswith("timer") for p in path)
        used_collects = sum(p.startswith("scheduler: decode collects") for p in path)
        return [c for c in world.enabled()
                if not (c.name.startswith("timer: 5 ns") or c.name.startswith("timer: idle")
                        or (c.name.startswith("timer") and used_ticks >= ticks)
                        or (c.name.startswith("scheduler: decode collects") and used_collects >= collects))]

    def visit(path: list[str], sleep: list[Choice]) -> None:
        if max_nodes is not None and out.nodes >= max_nodes:
            out.cut = True
            return
        out.nodes += 1
        try:
            world = replay(path)
            choices = allowed(world, path) if len(path) < depth else []
            if not choices:
                out.paths += 1
                world.drain()
                for invariant in END_INVARIANTS:
                    invariant(world)
                return
        except InvariantViolation as exc:
            if not out.violation:  # the trace replays from the root: the prefix, then the path
                out.violation, out.trace = str(exc), [*scenario.prefix, *path]
            raise
        asleep = {c.name for c in sleep}
        done: list[Choice] = []
        for choice in choices:
            if out.cut:
                return
            if choice.name in asleep:
                continue
            visit([*path, choice.name], [s for s in [*sleep, *done] if _independent(s, choice)])
            done.append(choice)

    with contextlib.suppress(InvariantViolation):  # recorded in ``out`` by visit
        visit([], [])
    return out
