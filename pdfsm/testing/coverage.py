"""Which (state, event type) cells the race tester reaches, and why the others cannot be reached.

    python -m pdfsm.testing.coverage            # explore, print what was reached and what not

Every cell is reached by the default scenarios, or by one of the :data:`DIRECTED` interleavings
(named steps that reach a rare cell for sure: several faults in a row that random search
strings together only now and then), or explained by a rule of :func:`unreachable_reason`:
local misuse (the world's schedulers and adapters are correct; the all-cells test drives those
cells directly), quarantine (it only follows a local violation), a timer already disarmed, a
machine already forgotten, or a race the design rules out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdfsm.core import Tables
from pdfsm.diagram import TABLES
from pdfsm.fsm import Fault, Go, Ignore, Illegal, Option, Table, label
from pdfsm.testing.explore import DEFAULT_SCENARIOS, hunt, replay_choices
from pdfsm.testing.world import Scenario, Variant

__all__ = ["DIRECTED", "all_cells", "all_options", "explore", "explore_options", "instrumented", "unexplained",
           "unreachable_reason"]

Cell = tuple[str, str, str]
OptionKey = tuple[str, str, str, str]
"""(machine, state, event type, option): one option of one cell, named by :func:`option_label`."""
_LATE = Scenario(requests=3, add_peer_async=True, handshake_retry_ns=0,
                 faults=frozenset({"handshake-timeout", "disconnect", "evict"}))
_RETRIED = ("prefill: p0 finishes prefill", "scheduler: D0 asks to read r0",
            "handshake: D0 gets the answer for (P, pp 0) #1: timed out", "prefill: p1 finishes prefill",
            "scheduler: D0 asks to read r1", "handshake: D0 gets the answer for (P, pp 0) #2")
DIRECTED: dict[str, tuple[Scenario, tuple[str, ...]]] = {
    "a late answer while the retry connects": (_LATE, (
        *_RETRIED, "handshake: D0 gets a late answer for (P, pp 0) #1")),
    "a late refusal after the peer disconnected": (_LATE, (
        *_RETRIED, "adapter D0: PeerAdded reaches D0", "fault: the producer disconnects",
        "handshake: D0 gets a late answer for (P, pp 0) #1: refused")),
    "a late answer after the peer disconnected": (_LATE, (
        *_RETRIED, "adapter D0: PeerAdded reaches D0", "fault: the producer disconnects",
        "handshake: D0 gets a late answer for (P, pp 0) #1")),
    "the peer added after its engine was forgotten": (_LATE, (
        *_RETRIED, "fault: the producer disconnects", "timer: idle eviction of the producer engine",
        "adapter D0: PeerAdded reaches D0")),
    "a held PP engine lost while its sibling still handshakes": (
        Scenario(requests=1, producer_pp=2, faults=frozenset({"link-drop"})), (
            "prefill: p0 finishes prefill", "scheduler: D0 asks to read r0",
            "handshake: D0 gets the answer for (P, pp 0) #1", "fault: D0 loses its connection to (P, pp 0)",
            "transport: D0 reports (P, pp 0) disconnected", "handshake: D0 gets the answer for (P, pp 1) #1")),
}
"""Rare cells (and options: the last one is the consumer's rewatch of a lost engine) reached for
sure: each is several faults in a row."""
_DISARMED = {("consumer", s) for s in ("NOTIFIED", "FAILED", "ABORTED", "RELEASED")} | {
    ("producer", s) for s in ("RELEASED", "EXPIRED")}


def all_cells() -> set[Cell]:
    return {(n, s.name, e.__name__) for n, t in TABLES.items() for s in t.states for e in t.events}


def unreachable_reason(cell: Cell) -> str:
    """Why the simulated world cannot reach ``cell``, or "" if it should."""
    machine, state, event = cell
    table = TABLES[machine]
    st = next(s for s in table.states if s.name == state)
    et = next(e for e in table.events if e.__name__ == event)
    if all(isinstance(o, Illegal) and o.fault is Fault.LOCAL for o in table.cells[(st, et)]):
        return "local misuse only: the world's scheduler and adapters never do it (test_cells drives it)"
    if event in ("Quarantined", "EngineQuarantined"):
        return "follows a local violation only, and the world injects none (test_cells drives it)"
    if machine == "consumer" and event == "Promised" and state == "NEW":
        return "the Connector hands a heartbeat's promise to a live load only (a load carries an earlier one)"
    if state in ("EVICTED", "DISCARDED"):
        return "the machine is forgotten when it gets there; no cascade touches it after"
    if event in ("DeadlinePassed", "LeaseExpired") and (machine, state) in _DISARMED:
        return "its timer was disarmed on the way into this state; expiries are derived for armed ones"
    if event in ("EngineReady", "EngineFailed") and machine == "consumer" and state != "HANDSHAKING":
        return ("engine news reaches a request only while it waits: it stops waiting (unwatches) as it ends, and "
                "watches no engine past the first that fails it at once")
    if machine == "engine" and event == "PeerAdded" and state in ("CONNECTED", "DISCONNECTED"):
        return "a stale PeerAdded needs two peers added for one engine at once; AddPeer is carried out at once"
    return ""


def explore(examples: int) -> set[Cell]:
    """The cells the default scenarios and the directed interleavings reach; raises if any breaks
    an invariant (with the shrunk counterexample)."""
    cells: set[Cell] = set()
    for name, scenario in DEFAULT_SCENARIOS.items():
        found = hunt(scenario, max_examples=examples, coverage=cells)
        if found.found:
            raise AssertionError(f"{name}: {found.message}")
    for name, (scenario, steps) in DIRECTED.items():
        world, message = replay_choices(list(steps), scenario, None)
        if message:
            raise AssertionError(f"{name}: {message}")
        cells |= world.coverage()
    return cells


def option_label(opt: Option) -> str:
    """A stable name for an option: its destination, action and guard, or its reason."""
    if isinstance(opt, Go):
        guard = f" when {label(opt.when)}" if opt.when is not None else ""
        return f"-> {opt.dst.name} ({label(opt.action) or '-'}){guard}"
    return repr(opt)


def _tracked(opt: Option) -> bool:
    """Options :func:`instrumented` can see decide: every transition, and every guarded ignore or
    illegal option (an unguarded one has no guard to wrap; its reason is in the log)."""
    return isinstance(opt, Go) or opt.when is not None


def all_options() -> set[OptionKey]:
    """Every option :func:`instrumented` tracks, over the three real tables."""
    return {(n, s.name, e.__name__, option_label(o)) for n, t in TABLES.items()
            for (s, e), opts in t.cells.items() for o in opts if _tracked(o)}


def instrumented(hits: set[OptionKey]) -> Tables:
    """The real tables, deciding exactly as they do, with every tracked option adding its key to
    ``hits`` when it decides: a transition when its action runs (one is added where it had none), a
    guarded ignore or illegal option when its guard holds (the first that holds decides)."""

    def wrap(name: str, state: str, event: str, opt: Option) -> Option:
        key = (name, state, event, option_label(opt))
        if isinstance(opt, Go):
            action = opt.action

            def act(m: Any, ev: Any, core: Any) -> None:
                hits.add(key)
                if action is not None:
                    action(m, ev, core)

            return Go(opt.dst, act, when=opt.when, fault=opt.fault, reason=opt.reason, explain=opt.explain)
        when = opt.when
        if when is None:
            return opt

        def guard(m: Any, ev: Any, core: Any) -> bool:
            held = when(m, ev, core)
            if held:
                hits.add(key)
            return held

        if isinstance(opt, Ignore):
            return Ignore(opt.reason, when=guard)
        return Illegal(opt.fault, opt.reason, when=guard)

    def table(t: Table) -> Table:
        cells = {(s, e): tuple(wrap(t.name, s.name, e.__name__, o) for o in opts) for (s, e), opts in t.cells.items()}
        return t.patched("instrumented", cells)

    return Tables(consumer=table(TABLES["consumer"]), producer=table(TABLES["producer"]),
                  engine=table(TABLES["engine"]))


def explore_options(scenarios: Mapping[str, Scenario], examples: int,
                    directed: Iterable[tuple[Scenario, tuple[str, ...]]] = (),
                    invariants: Iterable[Callable[[Any], None]] = ()) -> set[OptionKey]:
    """The options the scenarios' searches and the directed interleavings made decide; raises if
    any breaks an invariant (with the shrunk counterexample)."""
    hits: set[OptionKey] = set()
    variant = Variant(id="pdfsm", summary="the real machines, options recorded", tables=instrumented(hits))
    for name, scenario in scenarios.items():
        found = hunt(scenario, variant, invariants, max_examples=examples)
        if found.found:
            raise AssertionError(f"{name}: {found.message}")
    for scenario, steps in directed:
        _, message = replay_choices(list(steps), scenario, variant, invariants)
        if message:
            raise AssertionError(message)
    return hits


def unexplained(reached: set[Cell]) -> list[Cell]:
    """Cells neither reached nor explained: a gap in the world, or a rule missing."""
    return sorted(c for c in all_cells() - reached if not unreachable_reason(c))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=300, help="interleavings per default scenario")
    args = parser.parse_args(argv)
    reached = explore(args.examples)
    everything = all_cells()
    print(f"reached {len(reached)} of {len(everything)} cells")
    for cell in sorted(everything - reached):
        print(f"  {' '.join(cell):55s} {unreachable_reason(cell) or 'NOT EXPLAINED'}")
    return 1 if unexplained(reached) else 0


if __name__ == "__main__":
    sys.exit(main())
