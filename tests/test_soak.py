"""A short form of ``pdfsm soak --duration 600 --fault-rate 0.05``: the same machinery (two engine
processes over real NIXL, every fault kind, a prefill killed and restarted under a new engine
id), a denser fault rate so that every kind is hit in a few seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from pdfsm.soak import KINDS, _growth_after_warmup
from transports.nixl import nixl_available

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]


def test_a_short_soak_leaks_nothing_and_every_violation_is_one_it_caused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli("soak", "--duration", "16", "--rate", "20", "--fault-rate", "0.4", "--restart-s", "5",
                   "--seed", "3", "--log-dir", str(tmp_path), "--json")
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, d["problems"]
    assert d["requests"] == 320 and d["not_terminal"] == 0
    assert d["leaked_blocks"] == 0 and d["double_frees"] == 0 and d["early_frees"] == 0 and d["bad_bytes"] == 0
    assert d["unexpected_violations"] == 0 and d["violations"] > 0 and d["divergent"] is False
    assert set(d["faults"]) == {"none", *KINDS}
    assert d["restarts"] >= 1
    assert sum(d["outcomes"].values()) == d["requests"]
    # It did real work. Not a tight floor: each prefill kill takes every request whose params the
    # decode side has not read yet, and on a loaded machine it lags (250 of 320 received on an
    # idle one, 146 once beside a parallel suite).
    assert d["outcomes"]["received"] > d["requests"] // 4, (d["outcomes"], d["not_received_by_fault"], d["restarts"])
    assert sum(d["not_received_by_fault"].values()) == d["requests"] - d["outcomes"]["received"]
    # every incarnation of the prefill engine left its own log, and each replays
    logs = {p.name for p in tmp_path.iterdir()}
    assert {"decode-pp0-tp0", "prefill-pp0-tp0", "prefill-pp0-tp1", "prefill-r1-pp0-tp0"} <= logs


def test_rss_is_judged_after_each_engines_own_warm_up() -> None:
    """A long-lived engine after the run's warm-up; a short-lived (restarted or killed) one after
    40 % of its life; one too short to judge is left out rather than read as flat."""
    steady = [(float(t), 100 + min(t, 30)) for t in range(200)]  # grows while warming, then flat
    assert _growth_after_warmup(steady, warm_s=40.0) == 0
    leaking = [(float(t), 100 + t) for t in range(50, 150)]  # a restarted engine that leaks
    assert _growth_after_warmup(leaking, warm_s=120.0) == 149 - 90  # from 40 % into its 99 s life
    assert _growth_after_warmup([(0.0, 1), (10.0, 2)], warm_s=120.0) is None


@pytest.mark.parametrize(("argv", "named"), [
    (["--rate", "-5"], "--rate -5.0"),  # hung, arrivals stepping backwards, memory without bound
    (["--rate", "0"], "--rate 0.0"),  # ZeroDivisionError
    (["--rate", "nan"], "--rate nan"),
    (["--max-blocks", "0"], "--max-blocks must be at least 1"),  # ValueError from randrange
    (["--max-blocks", "5000"], "--max-blocks 5000"),  # no request could be prefilled: all left open
    (["--prefill-tp", "3"], "--prefill-tp 3"),  # the engine exited at start; the soak ran on for 50 s
    (["--prefill-tp", "0"], "--prefill-tp must be at least 1"),
    (["--duration", "-1"], "--duration -1.0"),
    (["--fault-rate", "2"], "--fault-rate 2.0"),
    (["--restart-s", "-1"], "--restart-s -1.0"),
])
def test_options_it_cannot_run_are_refused_before_any_engine_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str) -> None:
    """A helper's soak hunt: each of these hung, crashed or ran a minute to report requests never
    terminal. Now exit 2 and one line naming the option, with no engine started (no logs)."""
    code = run_cli("soak", "--duration", "1", *argv, "--log-dir", str(tmp_path / "logs"))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("pdfsm soak: ") and named in err, err
    assert not any((tmp_path / "logs").glob("*/*"))


def test_a_request_refused_for_a_full_pool_ends_refused_not_open(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Overload: a request the prefill pool cannot take is answered "out of blocks". The soak left it
    open, then waited out three leases and reported it never terminal (exit 1); it is an outcome."""
    code = run_cli("soak", "--duration", "2", "--rate", "40", "--fault-rate", "0", "--max-blocks", "2048",
                   "--seed", "0", "--log-dir", str(tmp_path), "--json")
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, d["problems"]
    assert d["outcomes"]["refused"] >= 1 and d["not_terminal"] == 0 and d["leaked_blocks"] == 0
    assert sum(d["outcomes"].values()) == d["requests"]
