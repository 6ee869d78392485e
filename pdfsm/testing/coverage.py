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

from pdfsm.diagram import TABLES
from pdfsm.fsm import Fault, Illegal
from pdfsm.testing.explore import DEFAULT_SCENARIOS, hunt, replay_choices
from pdfsm.testing.world import Scenario

__all__ = ["DIRECTED", "all_cells", "explore", "unexplained", "unreachable_reason"]

Cell = tuple[str, str, str]
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
    "the peer added after its engine was forgotten": (_LATE, (
        *_RETRIED, "fault: the producer disconnects", "timer: idle eviction of the producer engine",
        "adapter D0: PeerAdded reaches D0")),
}
"""Rare cells reached for sure: each is several faults in a row."""
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
    if state in ("EVICTED", "DISCARDED"):
        return "the machine is forgotten when it gets there; no cascade touches it after"
    if event in ("DeadlinePassed", "LeaseExpired") and (machine, state) in _DISARMED:
        return "its timer was disarmed on the way into this state; expiries are derived for armed ones"
    if event in ("EngineReady", "EngineFailed") and machine == "consumer" and state != "HANDSHAKING":
        return ("engine news reaches a request only while it waits: it stops waiting (unwatches) as it ends, and "
                "watches no engine past the first that fails it at once")
    if (machine, state, event) == ("engine", "CONNECTED", "EngineWanted"):
        return "a request asks only for engines that are not connected yet"
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
