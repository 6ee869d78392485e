"""How fast the race tester finds each planted bug of the corpus, and how fast it samples.

For every mutant in pdfsm.testing.mutants (one per bug-corpus row): seconds and generated
interleavings until the first failure, and the size of the shrunk counterexample (its steps:
each step is one event delivered by one source, or one timer or scheduler action). The
sampler's speed is interleaving steps per second over the real machines, which break nothing.

    python benchmarks/race_hunt.py            # a table
    python benchmarks/race_hunt.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pdfsm.testing import Scenario, hunt
from pdfsm.testing.mutants import MUTANTS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--examples", type=int, default=2000, help="the most interleavings tried per mutant")
    parser.add_argument("--sample", type=int, default=300, help="interleavings of the real machines, for speed")
    args = parser.parse_args(argv)
    mutants = []
    for mid, variant in MUTANTS.items():
        found = hunt(variant.scenario, variant, max_examples=args.examples)
        mutants.append({"id": mid, "found": found.found, "seconds": round(found.seconds, 3),
                        "examples": found.examples, "counterexample_events": found.steps,
                        "what": variant.summary})
    start = time.perf_counter()
    clean = hunt(Scenario(), max_examples=args.sample)
    elapsed = time.perf_counter() - start
    out = {"steps_per_s": round(clean.total_steps / elapsed), "sample_examples": clean.examples,
           "sample_broke_invariant": clean.found, "mutants": mutants}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'mutant':28s} {'found':>5s} {'seconds':>8s} {'examples':>9s} {'steps':>6s}  planted bug")
    for m in mutants:
        print(f"{m['id']:28s} {m['found']!s:>5s} {m['seconds']:8.2f} {m['examples']:9d} "
              f"{m['counterexample_events']:6d}  {m['what']}")
    print(f"sampler: {out['steps_per_s']:,} interleaving steps/s over the real machines "
          f"({clean.examples} interleavings, invariants {'BROKEN' if clean.found else 'held'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
