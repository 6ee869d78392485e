"""What a demo engine process (``python -m pdfsm.engines``) does with input it must not trust: op
lines, op fields, its engine id and a --log-dir an earlier run wrote. Found by review; each test
drives a real engine process over NIXL (a few seconds each) unless it says otherwise.

The rule each checks: bad input gets an error result naming what was wrong, or before "ready" a
clear refusal (exit 2); the engine never dies of it, never hangs on it, and loses nothing it
already accepted.
"""

from __future__ import annotations

import contextlib
import io
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from filelog_writer import row

from pdfsm import engines
from pdfsm import run as demo
from pdfsm.connector import KVTransferParams
from pdfsm.engine_messages import (
    MARK,
    MAX_LINE_BYTES,
    MAX_REASON_CHARS,
    Abort,
    Finish,
    Load,
    Prefill,
    Result,
    Tamper,
    read_lines,
)
from pdfsm.filelog import LOCK_NAME, LogWriteError, read_header, read_log, segment_paths
from pdfsm.filesink import FileSink
from transports.nixl import nixl_available

nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
_decode_result = msgspec.json.Decoder(Result).decode


@dataclass
class _Ran:
    rc: int
    results: list[Result]  # what the parent reads, "stats" left out
    stderr: str
    seconds: float

    def errors(self) -> list[str]:
        return [r.reason for r in self.results if r.ev == "error"]

    def only(self, ev: str) -> Result:
        (r,) = [r for r in self.results if r.ev == ev]
        return r


def _line(op: object) -> bytes:
    return msgspec.json.encode(op) + b"\n"


def _engine(log_dir: Path, *lines: bytes, role: str = "decode", engine_id: str = "d", argv: tuple[str, ...] = (),
            grace_s: float = 0.5) -> _Ran:
    """One engine process fed ``lines`` then a Finish; its results as the parent's reader sees them,
    every line within the bound (the parent drops longer ones). A hang is a failure (TimeoutExpired)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pdfsm.engines", "--role", role, "--engine-id", engine_id,
                        "--log-dir", str(log_dir), *argv], input=b"".join(lines) + _line(Finish(grace_s=grace_s)),
                       capture_output=True, timeout=60, check=False)
    chunks = iter([p.stdout, b""])
    read = list(read_lines(lambda _: next(chunks)))
    assert None not in read, f"a line over {MAX_LINE_BYTES} bytes: the parent drops it"
    mark = MARK.encode()
    results = [_decode_result(line[len(mark):]) for line in read if line is not None and line.startswith(mark)]
    return _Ran(p.returncode, [r for r in results if r.ev != "stats"], p.stderr.decode(errors="replace"),
                time.monotonic() - t0)


def _params(rid: str, blocks: tuple[int, ...]) -> KVTransferParams:
    """Params of a producer nobody runs (port 9): a read of them fails, reported."""
    return KVTransferParams(remote_tp_size=1, remote_engine_id="q", remote_request_id=rid, remote_port=9,
                            remote_block_ids=blocks, lease_ns=3_000_000_000, issued_wall_ns=time.time_ns())


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


# --- an earlier run's log in the worker's directory ------------------------------------------------


@nixl
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_engine_refuses_a_log_dir_holding_an_earlier_runs_log(tmp_path: Path, role: str) -> None:
    """Scenario: an engine is run again with the same --engine-id into the same --log-dir.
    Expected: exit 2 before "ready", a message naming the directory, the old log and --log-dir, and
    the old log's files exactly as they were. Before the fix the engine said "ready", then died at
    its first log write (an untyped LogWriteError "rows 0..x do not continue the log at seq N",
    exit 1, no error result) and left a header-only segment in the old log."""
    first = _engine(tmp_path, role=role)
    assert first.rc == 0, first.stderr[-2000:]
    worker = tmp_path / "d-pp0-tp0"
    before = _files(worker)
    again = _engine(tmp_path, _line(Prefill(rid="a", blocks=1, seed=1)), role=role)
    assert again.rc == 2, again.stderr[-2000:]
    assert again.results == [], again.results  # not even "ready"
    last = again.stderr.strip().splitlines()[-1]
    assert "--log-dir" in last and str(worker) in last and "already holds a log" in last, last
    assert "Traceback" not in again.stderr, again.stderr[-2000:]
    assert _files(worker) == before


def test_a_fresh_file_sink_refuses_an_old_log_before_recovering_it(tmp_path: Path) -> None:
    """Scenario (no engine): FileSink(fresh=True) on a directory whose log has a torn tail, and on
    one holding only a stale writer lock. Expected: the first refused (LogWriteError) with its
    files untouched (recovery would have truncated the tail and kept a .torn copy) and the lock
    let go; the second accepted (no log there to continue). Before the fix there was no such
    option: the engine's sink recovered the old log and failed only at its first write."""
    old = tmp_path / "old"
    with FileSink(old) as sink:
        sink.write([row(0), row(1)])
    seg = segment_paths(old)[0]
    seg.write_bytes(seg.read_bytes() + b"PDFB torn")
    before = _files(old)
    with pytest.raises(LogWriteError, match="already holds a log"):
        FileSink(old, fresh=True)
    assert _files(old) == before
    FileSink(old).close()  # the refused sink let go of the writer lock
    lock_only = tmp_path / "lock-only"
    lock_only.mkdir()
    (lock_only / LOCK_NAME).touch()
    FileSink(lock_only, fresh=True).close()


# --- op lines that do not decode ---------------------------------------------------------------------


@nixl
@pytest.mark.parametrize("bad", [
    pytest.param(b'{"op":"prefill","rid":"\xff\xfe","blocks":1,"seed":1}\n', id="invalid-utf8-in-a-string"),
    pytest.param(b'{"op":"forge","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", id="nested-too-deep"),
])
def test_an_op_line_that_does_not_decode_is_reported_and_the_engine_goes_on(tmp_path: Path, bad: bytes) -> None:
    """Scenario: one op line with invalid UTF-8 inside a JSON string (UnicodeDecodeError), or
    100,000 nested arrays (RecursionError), then a good Prefill and a Finish. Expected: an error
    result for the bad line, the Prefill served, the accounting, exit 0. Before the fix only
    msgspec.DecodeError was caught: the op reader thread died, nothing read the rest, and the
    engine never finished (killed by the timeout)."""
    ran = _engine(tmp_path, bad, _line(Prefill(rid="good", blocks=1, seed=1)), role="prefill")
    assert ran.rc == 0, ran.stderr[-2000:]
    assert [e for e in ran.errors() if e.startswith("bad op line")], ran.results
    assert ran.only("prefilled").rid == "good"
    ran.only("accounting")


def test_a_result_line_that_does_not_decode_is_reported_and_the_reader_goes_on() -> None:
    """Scenario (no engine): the demo's reader of an engine's results (pdfsm.run.Engine._read) gets a
    result line with invalid UTF-8 in a string, then a good one. Expected: an error result naming
    the engine, then the good result. Before the fix the UnicodeDecodeError ended the reader thread:
    every later result was lost and the run waited for them until its timeout."""
    eng = demo.Engine.__new__(demo.Engine)
    eng.role, eng.results = "decode", queue.Queue()
    mark = MARK.encode()
    data = mark + b'{"ev":"error","reason":"\xff"}\n' + mark + b'{"ev":"done","rid":"d-0"}\n'
    eng._read(io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))
    got = [eng.results.get_nowait() for _ in range(eng.results.qsize())]
    assert [r.ev for r in got] == ["error", "done"], got
    assert "bad result line from the decode engine" in got[0].reason


# --- op fields ------------------------------------------------------------------------------------------


@nixl
@pytest.mark.parametrize("rid", ["", "x" * 300], ids=["empty", "300-chars"])
def test_an_abort_with_a_refused_request_id_is_reported_not_fatal(tmp_path: Path, rid: str) -> None:
    """Scenario: Abort(stage="now") with a request id the connector refuses (empty, or over the
    wire's 256 characters). Expected: an error result naming the rid field, the engine finishing
    (accounting, exit 0). Before the fix the op was accepted, conn.abort raised InvalidInput out of
    the main loop and the engine died (exit 1, no accounting)."""
    ran = _engine(tmp_path, _line(Abort(rid=rid, stage="now")))
    assert ran.rc == 0, ran.stderr[-2000:]
    assert any("$.rid" in e for e in ran.errors()), ran.results
    ran.only("accounting")


@nixl
def test_an_abort_applied_directly_with_a_refused_request_id_is_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario (the engine in this process): Engine.apply given Abort(rid="", stage="now") built in
    Python (a Struct's constructor checks no bounds; only the op reader's decode does). Expected:
    an error result "abort refused: request_id ...", the engine finishing normally. Before the fix
    the connector's InvalidInput escaped Engine.abort (in the engine process: out of its main
    loop, exit 1)."""
    got: list[Result] = []
    monkeypatch.setattr(engines, "emit", got.append)
    args = engines.build_parser().parse_args(["--role", "decode", "--engine-id", "d", "--log-dir", str(tmp_path)])
    engine = engines.Engine(args)
    try:
        engine.apply(Abort(rid="", stage="now"))
    finally:
        engine.finish(Finish(grace_s=0.0))
    assert [r.reason.startswith("abort refused: request_id") for r in got if r.ev == "error"] == [True]
    assert got[-1].ev == "accounting"


@nixl
@pytest.mark.parametrize("make", [
    lambda: Load(rid="a", params=_params("a", (1,)), seed=1, age_s=1e300),
    lambda: Load(rid="a", params=_params("a", (1,)), seed=1, age_s=-1.0),
    lambda: Tamper(rid="a", kind="delay-notification", delay_s=1e300),
], ids=["load-age-1e300", "load-age-negative", "tamper-delay-1e300"])
def test_an_op_with_seconds_out_of_range_is_refused_naming_the_field(tmp_path: Path,
                                                                     make: Callable[[], Load | Tamper]) -> None:
    """Scenario: a Load with age_s=1e300 (or negative), a Tamper with delay_s=1e300: finite JSON
    numbers. Expected: an error result naming the field, exit 0. Before the fix int(age_s * 1e9)
    raised OverflowError and the engine died (exit 1); the Tamper was accepted and killed the engine
    the same way once the notification it delays arrived."""
    op = make()
    ran = _engine(tmp_path, _line(op))
    assert ran.rc == 0, ran.stderr[-2000:]
    field = "age_s" if isinstance(op, Load) else "delay_s"
    assert any(f"$.{field}" in e for e in ran.errors()), ran.results
    ran.only("accounting")


@nixl
def test_a_load_under_a_request_id_the_engine_holds_is_refused(tmp_path: Path) -> None:
    """Scenario: a prefill engine holds "a" (Prefill), then gets a Load under "a"; its lease (2 s)
    runs out before Finish's grace. Expected: the Load refused ("request id already held"), the
    hold released by its lease, every block back in the pool, exit 0. Before the fix the Load
    overwrote the hold's books, and at the lease's end the engine died of a KeyError (exit 1),
    the producer's blocks never returned."""
    ran = _engine(tmp_path, _line(Prefill(rid="a", blocks=2, seed=1)), _line(Load(rid="a", params=_params("a", (1, 2)),
                                                                                seed=1)),
                  role="prefill", argv=("--lease-s", "2"), grace_s=10)
    assert ran.rc == 0, ran.stderr[-2000:]
    assert [(r.rid, r.reason) for r in ran.results if r.ev == "error"] == [("a", "request id already held")]
    assert ran.only("released").expired
    acc = ran.only("accounting")
    assert acc.free == acc.total and acc.in_flight == 0, acc


@nixl
def test_a_load_with_no_remote_blocks_is_refused_not_held(tmp_path: Path) -> None:
    """Scenario: a Load whose params name no remote blocks (notify-only to the connector, which
    never reports such a request), then Finish with 20 s of grace. Expected: an error result for
    it, nothing in flight at the end, Finish not waiting out its grace. Before the fix the engine
    recorded it as held for ever: Finish waited the whole grace and the accounting said
    in_flight 1."""
    ran = _engine(tmp_path, _line(Load(rid="r1", params=_params("r1", ()), seed=1)), grace_s=20)
    assert ran.rc == 0, ran.stderr[-2000:]
    assert [(r.rid, "no remote blocks" in r.reason) for r in ran.results if r.ev == "error"] == [("r1", True)]
    assert ran.only("accounting").in_flight == 0
    assert ran.seconds < 15, ran.seconds


# --- results the parent must be able to read --------------------------------------------------------


@nixl
def test_a_prefill_with_a_600k_char_request_id_gets_an_answer_the_parent_reads(tmp_path: Path) -> None:
    """Scenario: a Prefill whose rid is 600,000 characters (its line under MAX_LINE_BYTES).
    Expected: an error result the parent's reader decodes (every result line within the bound).
    Before the fix the engine answered with a 1.2 MB line (the rid twice, in the rid field and the
    InvalidInput message), which the parent's read_lines dropped: the op went unanswered."""
    ran = _engine(tmp_path, _line(Prefill(rid="r" * 600_000, blocks=1, seed=1)))
    assert ran.rc == 0, ran.stderr[-2000:]
    assert any("$.rid" in e for e in ran.errors()), [r.reason[:200] for r in ran.results]


def test_an_error_result_with_a_long_reason_is_cut_to_fit_a_line() -> None:
    """Scenario (no engine): emit() of an error whose reason is 2,000,000 characters (a refusal
    quoting a long op field). Expected: one line under MAX_LINE_BYTES, decoding to a reason of
    MAX_REASON_CHARS characters and a note of how many were cut. Before the fix the line was
    written whole and the parent's reader dropped it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engines.emit(Result(ev="error", rid="r", reason="é" * 2_000_000))
    line = out.getvalue().encode()
    assert line.endswith(b"\n") and len(line) <= MAX_LINE_BYTES
    reason = _decode_result(line[len(MARK):-1]).reason
    assert reason == "é" * MAX_REASON_CHARS + f"... ({2_000_000 - MAX_REASON_CHARS} more characters)"


# --- the engine id in a path --------------------------------------------------------------------------


@nixl
@pytest.mark.parametrize("engine_id", ["../escaped", "e" * 256], ids=["dot-dot-slash", "256-chars"])
def test_an_engine_id_is_made_a_safe_directory_name(tmp_path: Path, engine_id: str) -> None:
    """Scenario: an engine id with "../", and one of 256 characters (the wire's limit). Expected:
    each engine logs into one directory inside --log-dir, named log_name(id)-pp0-tp0 (bounded, a
    digest of the id), its segment header carrying the real id, and `pdfsm replay` reads it.
    Before the fix the id was a path component verbatim: "../escaped" wrote its log outside
    --log-dir; the 256-character id died at startup (OSError: File name too long, exit 1)."""
    logs = tmp_path / "logs"
    ran = _engine(logs, engine_id=engine_id)
    assert ran.rc == 0, ran.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    (worker,) = logs.iterdir()
    assert worker.name == f"{engines.log_name(engine_id)}-pp0-tp0" and len(worker.name) < 128
    assert read_header(segment_paths(worker)[0]).meta["engine_id"] == engine_id
    assert read_log(worker)
    from pdfsm.cli import main as cli

    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["replay", str(logs), "--timelines", "0"]) == 0


def test_an_ordinary_engine_id_keeps_its_name() -> None:
    """Scenario (no engine): the ids the demo and the soak use. Expected: unchanged, so their
    directories stay prefill-pp0-tp0, decode-pp0-tp0 (docs/postmortem.md); ids differing only in
    an unsafe character never share a directory."""
    for eid in ("prefill", "decode", "prefill-1", "node_2.a"):
        assert engines.log_name(eid) == eid
    assert engines.log_name("a/b") != engines.log_name("a_b") != engines.log_name("a:b")


def test_a_prefill_request_one_rank_released_by_lease_is_reported_expired(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill request over two ranks: rank 0's lease expired, rank 1 was released by its
    notification afterwards. The engine's "released" result took ``expired`` from the last rank
    only, so `pdfsm demo` and the soak counted the lease release as one by notification (found by
    a helper). Any rank's expiry makes it expired."""
    out: list[Result] = []
    monkeypatch.setattr(engines, "emit", out.append)
    e = object.__new__(engines.Engine)
    e.args = type("Args", (), {"role": "prefill"})()
    e.held = {"p-1": ([3, 4], 7, {0, 1})}
    e._outcomes, e.params, e.free = {}, {}, []
    e.workers = [type("W", (), {"tamper": type("T", (), {"planned": {}})()})() for _ in range(2)]
    e._ranked("p-1", 0, frozenset({"p-1"}))
    e._ranked("p-1", 1, frozenset())
    assert [(r.ev, r.rid, r.expired) for r in out] == [("released", "p-1", True)]
