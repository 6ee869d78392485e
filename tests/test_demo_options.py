"""The options of ``pdfsm demo`` / ``pdfsm demo-sim`` as a new user and an on-call engineer would drive them.

One real demo run (module-scoped fixture, about 14 s) plus cheap option and --log-dir checks that
fail before any engine starts. Each test cites the promise it checks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path

import pytest
from filelog_writer import row

from pdfsm import demo as demo_sim
from pdfsm import run as demo
from pdfsm.filelog import LOCK_NAME
from pdfsm.filesink import FileSink
from pdfsm.postmortem import DEMO_WRITER, clear_demo_logs
from transports.nixl import nixl_available

nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(list(argv))


def _run_command(*argv: str) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = demo.run_command(_args(*argv))
    return code, out.getvalue(), err.getvalue(), time.monotonic() - t0


# --- options the demo cannot run as asked (check_options: "Refuse what could only fail or silently
# --- not do what was asked, naming the option"; UsageError: "refused before any engine starts") ---


def test_a_negative_abort_count_is_refused() -> None:
    """--abort help: "abort this many requests while their reads run". --abort -1 is accepted and,
    as bool(-1) is true in _drive_requests, aborts requests 1, 4, 7... without limit (a 6-request run
    reported {"received": 4, "aborted": 2} and exit 0)."""
    with pytest.raises(demo.UsageError, match="--abort"):
        demo.check_options(_args("--requests", "6", "--abort", "-1"))


@pytest.mark.parametrize("lease", ["0", "-1"])
def test_a_lease_that_is_not_positive_is_refused_naming_the_option(lease: str) -> None:
    """--lease-s 0 (or negative) can only fail: today both engines are started and die with a
    pdfsm.errors.InvalidInput traceback about ``lease_ns`` on stderr, never naming --lease-s."""
    with pytest.raises(demo.UsageError, match="--lease-s"):
        demo.check_options(_args("--requests", "2", "--lease-s", lease))


def test_a_log_dir_that_is_a_file_is_refused_naming_the_option(tmp_path: Path) -> None:
    """A --log-dir that is a regular file can only fail. Expected: exit 2 naming --log-dir, before
    any engine starts. Today both engines are spawned, the prefill engine dies in FileSink's mkdir,
    and the user gets the tail of the child's traceback (NotADirectoryError) with no mention of
    the option."""
    f = tmp_path / "logs"
    f.write_text("not a directory\n")
    code, _, err, _ = _run_command("--log-dir", str(f), "--requests", "1", "--quiet")
    assert code == 2
    assert "--log-dir" in err, err
    assert "Traceback" not in err and "File \"" not in err, err


def test_a_log_dir_whose_name_is_too_long_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """run_command turns engine and usage errors into "pdfsm demo: ..." and exit 2. A --log-dir with
    a 300-character component makes clear_demo_logs' is_dir() raise OSError(ENAMETOOLONG), which
    escapes run_command as a traceback (exit 1, the code for "a run with problems")."""
    try:
        code, _, err, _ = _run_command("--log-dir", str(tmp_path / ("x" * 300)), "--requests", "1", "--quiet")
    except OSError as exc:
        pytest.fail(f"pdfsm demo raised {exc!r} instead of reporting a usage error")
    assert code == 2, err


def test_rerun_over_a_worker_dir_holding_only_a_stale_writer_lock(tmp_path: Path) -> None:
    """docs/decisions.md: "--log-dir reuse removes an earlier demo's segments and its writer.lock".
    worker_logs() lists a directory holding only writer.lock (its docstring: an engine killed between
    taking the lock and writing its first segment, or a segment moved aside by --repair), and
    clear_demo_logs then indexes segment_paths(d)[0] of an empty list: `pdfsm demo --log-dir` dies
    with IndexError (reproduced through the CLI, exit 1) instead of clearing or refusing it."""
    d = tmp_path / "prefill-pp0-tp0"
    d.mkdir()
    (d / LOCK_NAME).touch()
    try:
        refused = clear_demo_logs(tmp_path)
    except IndexError as exc:
        pytest.fail(f"clear_demo_logs raised {exc!r} on a directory holding only {LOCK_NAME}")
    assert refused is None or "--log-dir" in refused


def test_demo_sim_fault_on_a_request_that_never_runs_is_not_reported_as_planted(tmp_path: Path) -> None:
    """demo-sim --fault help: "plant one fault on request --fault-request". With --fault-request 99
    and 16 requests nothing is hit, yet the run prints "fault planted: read-error on req-99, failed
    reads: 0" and exits 0: a postmortem drill with nothing to find. (`pdfsm demo` refuses the same
    mistake: check_options "A fault needs requests to act on".) Expected: a usage error (exit 2)."""
    p = argparse.ArgumentParser()
    demo_sim.add_arguments(p)
    args = p.parse_args(["--log-dir", str(tmp_path / "logs"), "--quiet", "--fault", "read-error",
                         "--fault-request", "99"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = demo_sim.run(args)
    assert code == 2, out.getvalue()[-2000:]


@pytest.mark.parametrize(("request_n", "code"), [(0, 2), (1, 0), (4, 0), (5, 2)])
def test_demo_sim_fault_requests_are_numbered_as_the_requests_are(tmp_path: Path, request_n: int, code: int) -> None:
    """The requests are req-1 to req-N: --fault-request 0 planted a fault on a request that never
    ran while the run said it was planted, and N, the last one, was refused (found by a helper's
    review). A dropped notification on a request that runs is found: a remote violation."""
    p = argparse.ArgumentParser()
    demo_sim.add_arguments(p)
    args = p.parse_args(["--log-dir", str(tmp_path / "logs"), "--quiet", "--requests", "4",
                         "--fault", "drop-notification", "--fault-request", str(request_n)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        got = demo_sim.run(args)
    assert got == code, out.getvalue()[-2000:]
    if code == 0:
        assert f"on req-{request_n}" in out.getvalue() and "violations: 0 (local 0, remote 0)" not in \
            out.getvalue().split("prefill-tp0")[1], out.getvalue()[-3000:]


@pytest.mark.parametrize(("argv", "names"), [
    (["--prefill-tp", "3", "--decode-tp", "1"], "--prefill-tp 3"),
    (["--prefill-tp", "3", "--decode-tp", "6"], "--prefill-tp 3"),
    (["--prefill-tp", "8", "--decode-tp", "8", "--block-bytes", "4"], "--prefill-tp 8"),
])
def test_demo_sim_refuses_a_block_its_tp_ranks_cannot_share_equally(argv: list[str], names: str) -> None:
    """Scenario: `pdfsm demo-sim --prefill-tp 3`: a 256-byte block has no equal share for 3 ranks.
    Before (found by review), every read was refused at set-up and the demo said 0 of 4 moved; with
    `--decode-tp 6` the same; and `--block-bytes 4` over TP 8 gave each rank 0 bytes, which
    "moved" with no wrong bytes and exit 0 (found by a helper's hunt). Expected: refused up front,
    exit 2, naming the option; with --mla (whole blocks on every rank) accepted."""
    p = argparse.ArgumentParser()
    demo_sim.add_arguments(p)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = demo_sim.run(p.parse_args([*argv, "--requests", "2", "--quiet"]))
    assert code == 2 and "--block-bytes" in err.getvalue() and names in err.getvalue(), err.getvalue()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert demo_sim.run(p.parse_args([*argv, "--requests", "2", "--quiet", "--mla"])) == 0, err.getvalue()


# --- more blocks in flight than the engines' pool (256 blocks) --------------------------------------


def test_more_blocks_in_flight_than_an_engine_holds_is_refused_up_front() -> None:
    """--requests 4 --in-flight 4 --max-blocks 150: the router sends prefills without waiting for
    free blocks, so the prefill engine (256 blocks) answered one "out of blocks" and the run sat
    until --timeout-s with it "in flight". check_options refuses what could only fail."""
    code, _, err, _ = _run_command("--requests", "4", "--in-flight", "4", "--max-blocks", "150")
    assert code == 2 and "--max-blocks" in err, err


@pytest.mark.parametrize(("argv", "match"), [
    (("--requests", "4", "--lease-s", "inf"), "--lease-s inf: at most 3600"),
    (("--requests", "4", "--lease-s", "1e10"), "--lease-s"),
    (("--requests", "150", "--fault", "compat-hash"), "stay held on the prefill side until its lease ends"),
    (("--requests", "8", "--fault", "wrong-engine-id", "--fault", "forge-notification"), "forge-notification needs"),
    (("--requests", "8", "--prefill-pp", "2", "--no-pp", "--fault", "forge-notification"), "--no-pp with"),
    (("--prefill-tp", "4", "--kv-heads", "3"), "--prefill-tp 4 --kv-heads 3: the model's 3 KV heads do not divide"),
    (("--kv-heads", "0"), "--kv-heads 0: 1 to 64 in the demo"),
    (("--kv-heads", "65536"), "--kv-heads 65536: 1 to 64 in the demo"),  # both engines' pools, 16 GiB each
    (("--mla", "--kv-heads", "2"), "--kv-heads 2 with --mla"),
    (("--mla", "--kv-heads", "8"), "--kv-heads 8 with --mla"),  # the default's value, said: not ignored
])
def test_runs_that_could_only_fail_are_refused_before_any_engine_starts(argv: tuple[str, ...], match: str) -> None:
    """Found by review: each started both engines and ended in a traceback (an infinite lease), or
    exit 1 on a run doing what was asked (a compat-hash run of 150 requests emptied the prefill
    pool, every hold running its lease; a forged notification with no producer ever connected)."""
    with pytest.raises(demo.UsageError, match=match):
        demo.check_options(_args(*argv))


@nixl
def test_engines_that_meet_an_earlier_log_refuse_it_and_the_demo_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario: the engines start over an earlier demo's log in their worker directory (one that
    appeared after the demo cleared the directory: clear_demo_logs is made to leave it). Expected:
    exit 2, "pdfsm demo:" naming the directory, that it holds a log and --log-dir, no traceback,
    the old log untouched. Before the fix the prefill engine said "ready" and died at its first
    log write (LogWriteError "rows 0..x do not continue the log at seq 2", a traceback among the
    problems, exit 1), leaving a stray header-only segment in the old log."""
    worker = tmp_path / "prefill-pp0-tp0"
    with FileSink(worker, metadata={"writer": DEMO_WRITER, "worker": worker.name}) as sink:
        sink.write([row(0), row(1)])
    before = sorted(p.name for p in worker.iterdir())
    monkeypatch.setattr(demo, "clear_demo_logs", lambda _: None)
    code, _, err, _ = _run_command("--log-dir", str(tmp_path), "--requests", "1", "--quiet")
    assert code == 2, err
    assert "pdfsm demo:" in err and f"{worker}: already holds a log" in err and "--log-dir" in err, err
    assert "Traceback" not in err, err
    assert sorted(p.name for p in worker.iterdir()) == before


def test_demo_sim_runs_more_requests_than_ten_thousand_steps() -> None:
    """``pdfsm demo-sim --requests 16000`` exited 1 with "no progress after 10000 steps": a fixed cap
    on the run's length, which a run of about 10,000 requests reaches while progressing every step
    (found by a helper). The guard is for a run that stops progressing, not a long one."""
    p = argparse.ArgumentParser()
    demo_sim.add_arguments(p)
    args = p.parse_args(["--requests", "10200", "--quiet"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = demo_sim.run(args)
    assert code == 0, out.getvalue()[-2000:]
    assert "10200 of 10200 requests moved" in out.getvalue()
