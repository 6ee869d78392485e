"""Which (state, event type) cells the race tester reaches, and why the others cannot be reached.

    python -m pdfsm.testing.coverage            # explore, print what was reached and what not
    python -m pdfsm.testing.coverage --write    # also rewrite the committed list of reachable cells

A cell the simulated world never reaches must be explained by one of the rules in
:func:`unreachable_reason`: local misuse (the world's schedulers and adapters are correct; the
all-cells test drives those cells directly), quarantine (it only follows a local violation),
a timer already disarmed, a machine already forgotten, or a race the design rules out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdfsm.diagram import TABLES
from pdfsm.fsm import Fault, Illegal
from pdfsm.testing.explore import DEFAULT_SCENARIOS, hunt

__all__ = ["REACHABLE_FILE", "all_cells", "explore", "reachable", "unreachable_reason"]

Cell = tuple[str, str, str]
REACHABLE_FILE = Path(__file__).with_name("reachable-cells.txt")
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
    if event in ("EngineReady", "EngineFailed") and machine == "consumer":
        return "engine news reaches a request only while it waits, or in the very cascade that stopped it"
    if (machine, state, event) == ("engine", "CONNECTED", "EngineWanted"):
        return "a request asks only for engines that are not connected yet"
    if machine == "engine" and event == "PeerAdded" and state in ("HANDSHAKING", "CONNECTED", "DISCONNECTED"):
        return "a stale PeerAdded needs two peers added for one engine at once; AddPeer is carried out at once"
    return ""


def explore(examples: int) -> set[Cell]:
    cells: set[Cell] = set()
    for name, scenario in DEFAULT_SCENARIOS.items():
        found = hunt(scenario, max_examples=examples, coverage=cells)
        if found.found:
            raise AssertionError(f"{name}: {found.message}")
    return cells


def reachable() -> set[Cell]:
    """The committed list of cells the default scenarios must reach."""
    lines = REACHABLE_FILE.read_text().splitlines()
    return {tuple(line.split(" ", 2)) for line in lines if line and not line.startswith("#")}  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1500, help="interleavings per default scenario")
    parser.add_argument("--write", action="store_true", help="rewrite the committed list of reachable cells")
    args = parser.parse_args(argv)
    reached = explore(args.examples)
    everything = all_cells()
    unexplained = sorted(c for c in everything - reached if not unreachable_reason(c))
    print(f"reached {len(reached)} of {len(everything)} cells")
    for cell in sorted(everything - reached):
        print(f"  {' '.join(cell):55s} {unreachable_reason(cell) or 'NOT EXPLAINED'}")
    if args.write:
        lines = ["# Cells the default scenarios reach (pdfsm.testing.coverage --write); one per line."]
        REACHABLE_FILE.write_text("\n".join([*lines, *(" ".join(c) for c in sorted(reached))]) + "\n")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
