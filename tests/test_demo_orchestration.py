"""The demo orchestration (pdfsm.run) and its --log-dir handling, under engines that crash, exit
non-zero or hang, and reruns into the same directory (each test was a failing review
reproduction; each now asserts the fix)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest

from pdfsm import run as demo
from pdfsm.filesink import FileSink
from pdfsm.postmortem import DEMO_WRITER, clear_demo_logs
from transports.nixl import nixl_available

nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


def _args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(["--log-dir", str(tmp_path), "--quiet", *argv])


class _Tracked(demo.Engine):
    """demo.Engine, remembering every child so the test can kill what the demo left running."""

    children: ClassVar[list[subprocess.Popen[str]]] = []

    def __init__(self, role: str, argv: list[str]) -> None:
        super().__init__(role, argv)
        _Tracked.children.append(self.proc)


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    _Tracked.children = []
    monkeypatch.setattr(demo, "Engine", _Tracked)
    yield _Tracked.children
    for proc in _Tracked.children:  # only the processes this test started, by PID
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _sitecustomize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """Make every engine child run ``body`` at interpreter exit (after it reported its accounting)."""
    d = tmp_path / "site"
    d.mkdir()
    (d / "sitecustomize.py").write_text(
        "import atexit, os, sys, time\n"
        "if os.environ.get('REVIEW_ENGINE_EXIT'):\n"
        f"    atexit.register(lambda: ({body}))\n")
    monkeypatch.setenv("PYTHONPATH", f"{d}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("REVIEW_ENGINE_EXIT", "1")


# --- --log-dir reuse ------------------------------------------------------------------------------


@nixl
def test_log_dir_reuse_with_fewer_workers_is_clean(tmp_path: Path, tracked: list) -> None:  # type: ignore[type-arg]
    """A rerun into the same --log-dir with a smaller topology must replay only itself. clear_demo_logs
    deletes the *.pdlog files but leaves writer.lock, so the stale prefill-pp0-tp1 directory survives,
    run() lists it as a log, and the replay fails with 'no log segments' (exit 1, 'DIVERGED')."""
    first = demo.run(_args(tmp_path / "logs", "--requests", "2", "--prefill-tp", "2"), show=False)
    assert not first.problems, first.problems
    second = demo.run(_args(tmp_path / "logs", "--requests", "2", "--prefill-tp", "1"), show=False)
    assert not second.problems, second.problems
    assert {p.name for p in second.logs} == {"prefill-pp0-tp0", "decode-pp0-tp0"}


def test_clear_demo_logs_refuses_a_log_still_being_written(tmp_path: Path) -> None:
    """A second demo into the --log-dir of one still running must not delete the live run's log
    (clear_demo_logs checks only the writer tag, not the writer lock)."""
    sink = FileSink(tmp_path / "prefill-pp0-tp0", metadata={"writer": DEMO_WRITER, "worker": "prefill-pp0-tp0"})
    try:
        before = sorted(p.name for p in (tmp_path / "prefill-pp0-tp0").glob("*.pdlog"))
        assert before
        refused = clear_demo_logs(tmp_path)
        after = sorted(p.name for p in (tmp_path / "prefill-pp0-tp0").glob("*.pdlog"))
        assert refused is not None, "a log held by a live writer was cleared"
        assert after == before
    finally:
        sink.close()


# --- worker failures --------------------------------------------------------------------------------


@nixl
def test_worker_crash_mid_run_is_reported_promptly(tmp_path: Path, tracked: list) -> None:  # type: ignore[type-arg]
    """The decode engine dies (not killed by the demo) right after it is ready: the run must stop with
    a problem naming it, not sit until --timeout-s with every request 'in flight' (send() silently drops
    ops to an exited child and _drive never looks at the children)."""
    orig = demo.Engine.wait_for
    killed_at: list[float] = []

    def wait_for(self: demo.Engine, ev: str, timeout: float):  # type: ignore[no-untyped-def]
        r = orig(self, ev, timeout)
        if ev == "ready" and self.role == "decode":
            os.kill(self.proc.pid, signal.SIGKILL)  # a crash, as far as the demo knows
            self.proc.wait()
            killed_at.append(time.monotonic())
        return r

    with pytest.MonkeyPatch.context() as m:
        m.setattr(_Tracked, "wait_for", wait_for)
        # Timed from the crash, not from the start (two engines start slowly on a loaded machine),
        # against a --timeout-s far longer than noticing takes.
        out = demo.run(_args(tmp_path / "logs", "--requests", "4", "--timeout-s", "60"), show=False)
        took = time.monotonic() - killed_at[0]
    assert out.problems and "decode engine exited" in out.problems[0], out.problems
    assert took < 20, f"a dead decode engine went unnoticed for {took:.0f} s: {out.problems}"


@nixl
def test_engine_exit_code_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     tracked: list) -> None:  # type: ignore[type-arg]
    """An engine that reports its accounting and then exits with a non-zero status (a crash in
    teardown) is a failed run; run() never looks at the children's return codes, so the demo exits 0."""
    _sitecustomize(tmp_path, monkeypatch, "os._exit(7)")
    code = demo.run_command(_args(tmp_path / "logs", "--requests", "2"))
    assert [p.returncode for p in tracked] == [7, 7]  # the fault was really planted
    assert code != 0


@nixl
def test_engine_that_does_not_exit_is_killed_not_leaked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        tracked: list) -> None:  # type: ignore[type-arg]
    """An engine that reports its accounting but then never exits: run()'s finally calls
    proc.wait(timeout=30), whose TimeoutExpired escapes run_command as a traceback and leaves the
    child running (the other engine is never waited either). Expected: a non-zero exit, no child left.
    (Popen.wait's timeout is scaled down to 3 s here to keep the test short.)"""
    _sitecustomize(tmp_path, monkeypatch, "time.sleep(3600)")
    orig = subprocess.Popen.wait

    def short_wait(self, timeout=None):  # type: ignore[no-untyped-def]
        return orig(self, timeout=None if timeout is None else min(timeout, 3.0))

    monkeypatch.setattr(subprocess.Popen, "wait", short_wait)
    try:
        code = demo.run_command(_args(tmp_path / "logs", "--requests", "2"))
    except subprocess.TimeoutExpired as exc:
        alive = [p.pid for p in tracked if p.poll() is None]
        pytest.fail(f"run_command raised {exc!r}; engine children still running: {alive}")
    assert code != 0
    assert all(p.poll() is not None for p in tracked), "an engine child was left running"


# --- an engine process under bad ops (found by review, stop 19) ------------------------------------


@nixl
def test_an_engine_reports_bad_ops_and_keeps_serving(tmp_path: Path, tracked: list) -> None:  # type: ignore[type-arg]
    """A line that was not an op killed the thread reading ops, so closing stdin never finished the
    engine; a line of any length was read whole; an op the connector refused (a reused id, a
    load without a lease) crashed the engine process. Each is now an error result, and the engine
    serves the next op and finishes cleanly with its block pool whole."""
    from pdfsm.engine_messages import MAX_LINE_BYTES, Finish, Load, Prefill

    args = _args(tmp_path)
    eng = demo.Engine("prefill", demo._engine_args(args, "prefill", tmp_path))
    eng.wait_for("ready", 60)
    assert eng.proc.stdin is not None
    eng.proc.stdin.write('{"op":"prefil","rid":"x"}\n' + "x" * (MAX_LINE_BYTES + 10) + "\n")
    eng.proc.stdin.flush()
    eng.send(Prefill(rid="p-0", blocks=2, seed=1))
    eng.send(Prefill(rid="p-0", blocks=2, seed=2))  # the id is held: refused, its blocks not taken
    errors: list[str] = []

    def until(ev: str) -> Any:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = eng.results.get(timeout=30)
            if r.ev == "error":
                errors.append(r.reason)
            if r.ev == ev:
                return r
        raise AssertionError(f"no {ev!r}")

    params = until("prefilled").params
    assert params is not None
    eng.send(Load(rid="d-0", params=msgspec.structs.replace(params, lease_ns=0), seed=1))  # no lease: refused
    while len(errors) < 4:
        until("error")
    assert any("bad op line" in e for e in errors) and any(f"over {MAX_LINE_BYTES}" in e for e in errors)
    assert any("already held" in e for e in errors) and any("load refused: lease_ns" in e for e in errors)
    eng.send(Finish(grace_s=1.0))
    acc = eng.wait_for("accounting", 60)
    assert acc.free == acc.total - 2 and acc.in_flight == 1  # p-0's hold, nothing else taken
    assert eng.reap(30) is None


def test_read_lines_bounds_every_line_however_it_is_chunked() -> None:
    from pdfsm.engine_messages import MAX_LINE_BYTES, read_lines

    big = b"y" * (MAX_LINE_BYTES + 1)
    data = b"a\n" + b"x" * MAX_LINE_BYTES + b"\n" + big + b"\nb\n\nlast"
    for step in (1 << 16, 7, MAX_LINE_BYTES + 3):
        chunks = iter([data[i:i + step] for i in range(0, len(data), step)])
        got = list(read_lines(lambda n, c=chunks: next(c, b"")))  # type: ignore[misc]
        assert got == [b"a", b"x" * MAX_LINE_BYTES, None, b"b", b"", b"last"], step
