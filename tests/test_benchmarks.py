"""Every benchmark runs, at a toy size, and prints the one JSON object its issue names (the figures
themselves are measured by the scripts, never here: tests assert behaviour only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "apply.py": (["--requests", "300", "--rounds", "1"],
                 {"events_per_s", "baseline_events_per_s", "ratio_vs_baseline"}),
    "log.py": (["--rows", "3000", "--rounds", "1"],
               {"append_events_per_s", "replay_events_per_s", "append_vs_baseline", "replay_vs_baseline"}),
    "transport.py": (["--total-mib", "1", "--reps", "2", "--sizes", "65536"],
                     {"pdfsm_vs_raw_nixl", "coalesced_contiguous_vs_copy"}),
    "race_hunt.py": (["--examples", "40", "--sample", "10"], {"steps_per_s", "mutants"}),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_prints_its_json(script: str) -> None:
    argv, keys = CASES[script]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--json", *argv],
                          check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert keys <= set(doc), f"{script}: missing {sorted(keys - set(doc))}"
