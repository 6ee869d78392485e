"""The postmortem tools (``pdfsm replay``, ``pdfsm trace``, ``pdfsm report``) on odd but legal input,
found by review. Every test asserts the documented (or plainly intended) behaviour and failed
before its fix; each docstring says what is expected and why."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import collect, ev, handshake, make_core, read, run_cli, run_cli_captured

from pdfsm.events import BlocksHeld, HandleDone, NotificationReceived, PeerAdded
from pdfsm.filelog import segment_name, segment_paths, write_segment
from pdfsm.log import MemorySink, Record
from pdfsm.postmortem import LoadedLog, expand, load, print_replay, verify
from pdfsm.replay import summarize
from pdfsm.trace import chrome_trace

ROOT = Path(__file__).resolve().parent.parent


def _records() -> list[Record]:
    """Consumer 'a' read end to end (seq 1..8), producer 'p' held and notified (seq 9, 10), then a
    duplicate notification (seq 11, a remote violation)."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink)
    core.apply(read("a", t=1_000, remote="p"))
    handshake(core, t=2_000)
    core.apply(ev(HandleDone, 5_000, request_id="a", pp_rank=0, tp_rank=0))
    collect(core, 6_000)
    core.apply(ev(BlocksHeld, 7_000, request_id="p", block_ids=(1,)))
    core.apply(ev(NotificationReceived, 8_000, request_id="p", part=0, of=1))
    core.apply(ev(NotificationReceived, 9_000, request_id="p", part=0, of=1))
    core.log.flush()
    return sink.records


def _write(directory: Path, records: list[Record], *, batch: int = 4) -> Path:
    directory.mkdir(parents=True)
    write_segment(directory / segment_name(records[0].seq), records, salt=bytes(8),
                  meta={"worker": directory.name}, wall_ns=0, mono_ns=0, batch_records=batch)
    return directory


# --- 1. --request on a log trimmed by keep_segments --------------------------------------------------


def test_request_in_a_trimmed_decode_log_is_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A decode log trimmed by ``keep_segments`` (it starts after the request's ReadRequested) still
    holds records of the decode-local request 'a' (EngineReady, HandleDone, Reported). ``--request a``
    must show them and exit 0: exit 2 is documented for "a --request id found in no log", and this
    id is in the log. Today follow() only learns decode-local ids from ReadRequested records, so
    the id is taken for a producer id, nothing matches, and replay says "in none of the logs"."""
    records = _records()
    log = _write(tmp_path / "decode-tp0", [r for r in records if r.seq >= 5])
    code = run_cli("replay", str(log), "--request", "a")
    out, err = capsys.readouterr()
    assert "is in none of the logs" not in out + err
    assert code == 0, out + err
    assert "HandleDone" in out and "Reported" in out


# --- 2. --repair that cannot write must not lose the log ----------------------------------------------


def test_a_failed_repair_keeps_the_torn_log_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--repair`` on a torn log that cannot be written (a read-only copy attached to a ticket, a
    full disk) must not turn a readable log into "NO LOG" with zero records (exit 6, which means
    "nothing to read at that path"): the records before the torn tail were read and must still be
    summarized and replayed. Today load() catches the OSError raised by the repair's backup copy as
    if the log could not be read at all and throws the records away."""
    log = _write(tmp_path / "decode-tp0", _records())
    seg = segment_paths(log)[0]
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - 5)

    def read_only(*_a: object, **_k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("pdfsm.filelog.shutil.copyfile", read_only)
    loaded = verify(load("decode-tp0", log, repair=True))
    assert loaded.status != "no_log", loaded.error
    assert len(loaded.records) == 8  # two good 4-record frames before the torn one


# --- 3. the report is UTF-8 whatever the locale --------------------------------------------------------


def test_report_is_written_as_utf8_under_a_non_utf8_locale(tmp_path: Path) -> None:
    """The page declares ``<meta charset="utf-8">`` and contains non-ASCII text (the cell matrix's
    arrows and crosses, request ids), so it must be written as UTF-8 whatever the locale. Today
    write_output() uses Path.write_text() with the locale's encoding: under LC_ALL=C (no UTF-8
    mode, no locale coercion) ``pdfsm report`` dies with a UnicodeEncodeError traceback, exit 1."""
    log = _write(tmp_path / "decode-tp0", _records())
    out = tmp_path / "report.html"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    proc = subprocess.run([sys.executable, "-X", "utf8=0", "-m", "pdfsm.cli", "report", str(log), "-o", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "→" in out.read_bytes().decode("utf-8")


# --- 4. log names must be unique ----------------------------------------------------------------------


def test_log_names_are_unique_even_when_a_directory_is_named_like_a_repeat(tmp_path: Path) -> None:
    """Names are what ``--at LOG:SEQ`` and every output use, and "a repeated name gets #2, #3"
    (docs/postmortem.md) so that they are unique. With logs a/x, b/x and c/x#2 the second x is
    renamed x#2, which is the third log's own name: two logs called x#2, and ``--at x#2:3`` then
    applies to both. expand() must pick a suffix no other log uses."""
    records = _records()
    paths = [_write(tmp_path / sub / name, records) for sub, name in (("a", "x"), ("b", "x"), ("c", "x#2"))]
    names = [name for name, _ in expand([str(p) for p in paths])]
    assert len(set(names)) == 3, names


# --- 5. summaries count only machines that exist --------------------------------------------------------


def test_a_stale_reply_for_an_unknown_engine_is_not_counted_as_a_machine() -> None:
    """A PeerAdded for an engine this core never wanted is ignored and leaves no machine behind
    (the record says UNKNOWN -> UNKNOWN, the engine table's initial state). The summary's machines
    per state (and ``--at``'s machine list, and JSON ``states``) must not list it, exactly as a
    rejected first event of a request (NEW -> NEW) is not listed. summarize() tests the initial
    state against the literal "NEW", so the phantom engine shows up as "engine UNKNOWN 1"."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink)
    core.apply(ev(PeerAdded, 10, engine_id="Z", pp_rank=0, attempt=1))
    core.apply(ev(HandleDone, 20, request_id="nobody", pp_rank=0, tp_rank=0))
    core.log.flush()
    assert [(r.machine, r.before, r.state) for r in sink.records[1:]] == [("engine", "UNKNOWN", "UNKNOWN"),
                                                                       ("consumer", "NEW", "NEW")]
    assert summarize(sink.records).states == {}


# --- 6. the trace's tracks are in time order -----------------------------------------------------------


def test_trace_events_on_each_track_are_in_time_order() -> None:
    """Every track of the Chrome trace should list its events in timestamp order. A violation in
    the middle of a machine's life (a duplicate notification part while HOLDING) is appended to the
    machine's track after all of its state slices, so the track goes HOLDING@1, RELEASED@4, then
    the violation@3: out of order for any reader that streams the file (Perfetto sorts JSON traces,
    but other tools and the brief's validity check do not)."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink)
    core.apply(ev(BlocksHeld, 1_000, request_id="p", block_ids=(1,)))
    core.apply(ev(NotificationReceived, 2_000, request_id="p", part=0, of=2))
    core.apply(ev(NotificationReceived, 3_000, request_id="p", part=0, of=2))  # duplicate part: remote fault
    core.apply(ev(NotificationReceived, 4_000, request_id="p", part=1, of=2))
    core.log.flush()
    assert any(r.fault is not None for r in sink.records)
    doc = chrome_trace([("prefill", sink.records)])
    last: dict[tuple[int, int], float] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "M":
            continue
        track = (e["pid"], e["tid"])
        assert e["ts"] >= last.get(track, float("-inf")), (track, e["name"], e["ts"], last[track])
        last[track] = e["ts"]


# --- 7. --at before the first record of a trimmed log --------------------------------------------------


def test_at_before_a_trimmed_log_starts_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--at SEQ`` past a log's end says "(--at N: the log ends at seq M)". A log trimmed by
    keep_segments that starts at seq 5, asked ``--at 2``, has no record 2: the machines' states
    there are unknown, not "none". Today it prints "machines at seq -1 (+0.000 ms):" followed by an
    empty list, as if no machine existed, and no word that the log starts later."""
    records = _records()
    log = _write(tmp_path / "decode-tp0", [r for r in records if r.seq >= 5])
    code = run_cli("replay", str(log), "--at", "2", "--timelines", "0")
    out, _ = capsys.readouterr()
    assert code == 0
    assert "machines at seq -1" not in out
    assert any("--at 2" in line and "5" in line for line in out.splitlines()), out


# --- 8. text output escapes what a peer controls ----------------------------------------------------------


def test_text_output_escapes_control_characters_from_the_log() -> None:
    """Event fields such as a notification's ``sender`` come from the peer. ``pdfsm replay`` prints
    keys with repr() so they cannot break the layout, but event details raw: a sender with a
    newline forges a line of the summary ("  not terminal: 0") and an ANSI escape reaches the
    terminal. Every printed line must come from the tool, with control characters escaped."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink)
    core.apply(ev(BlocksHeld, 1_000, request_id="p", block_ids=(1,)))
    core.apply(ev(NotificationReceived, 2_000, request_id="p", part=0, of=1,
                  sender="d\n  not terminal: 0\x1b[2J"))
    core.log.flush()
    log = verify(LoadedLog("prefill", "(memory)", list(sink.records)))
    for request in (None, "p"):
        lines: list[str] = []
        print_replay([log], out=lines.append, request=request)
        text = "\n".join(lines)
        assert "\x1b" not in text
        assert sum(line.strip() == "not terminal: 0" for line in text.splitlines()) <= 1, text
        assert "sender=d\\n  not terminal: 0\\x1b[2J" in text  # shown, escaped


def test_report_refuses_a_negative_row_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--rows -3`` drew all but the last rows (a negative slice); refused like replay's counts."""
    log = _write(tmp_path / "decode-tp0", _records())
    assert run_cli("report", str(log), "-o", str(tmp_path / "r.html"), "--rows", "-3") == 2
    assert "--rows must be >= 0" in capsys.readouterr().err


# --- 9. crafted frames: intact (their CRC holds), yet no records ----------------------------------------


def _crafted(directory: Path, payload: bytes, count: int, schema: int = 3) -> Path:
    """One segment holding one CRC-valid frame of ``payload`` that says it carries ``count`` records."""
    from pdfsm.filelog import encode_frame, encode_header

    directory.mkdir(parents=True)
    head, prev = encode_header(0, bytes(8), {"worker": directory.name})
    frame, _ = encode_frame(payload, count, 0, prev, wall_ns=0, mono_ns=0, schema=schema)
    (directory / segment_name(0)).write_bytes(head + frame + payload)
    return directory


@pytest.mark.parametrize(("rows", "schema"), [
    ([[]], 2),  # no fields at all
    ([[0]], 1),  # a seq and nothing else
    ([[0, {"type": [1, 2]}, "core", "NEW", "NEW", 0, "", None, None]], 1),  # a class name that is a list
], ids=["empty-row-v2", "short-row-v1", "unhashable-type-v1"])
def test_old_schema_rows_of_no_shape_are_corruption_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: list[object], schema: int) -> None:
    """Rows of schema 1 or 2 that its upcasters cannot upgrade crashed every command with an
    IndexError or TypeError traceback (exit 1, no --json document); found by review. A CRC-valid
    payload that does not decode as its schema is corruption: exit 4, the file and offset named."""
    import msgspec

    log = _crafted(tmp_path / "x", msgspec.msgpack.encode(rows), 1, schema)
    code, out, _ = run_cli_captured(capsys, "replay", str(log))
    assert code == 4 and "CORRUPT" in out and "Traceback" not in out, out
    assert load("x", log).status == "corrupt"


@pytest.mark.parametrize(("payload", "count"), [
    (b"\xdd" + (1 << 20).to_bytes(4, "big") + b"\x90" * (1 << 20), 1 << 20),  # a million empty arrays
    (b"\x93\x90\x07\xa1x", 3),  # [[], 7, "x"]
], ids=["a-million-empty-arrays", "three-non-records"])
def test_a_frame_of_non_records_is_corruption_and_costs_no_object_per_byte(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], payload: bytes, count: int) -> None:
    """A frame whose payload holds no records was salvaged record by record: a gap per element
    (exit 0, "no records to replay", a line per gap), after decoding the payload untyped, an object
    per byte (a 4 MiB frame took 1.3 GiB and 6.5 s; found by review). A frame that cannot hold its
    count of records, or of which no record decodes, is corruption, found before anything is built."""
    import resource

    log = _crafted(tmp_path / "x", payload, count)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loaded = load("x", log)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: < 100 MiB more
    assert loaded.status == "corrupt" and not loaded.gaps, (loaded.status, loaded.error)
    code, out, _ = run_cli_captured(capsys, "replay", str(log))
    assert code == 4 and "gap:" not in out


def test_a_frame_of_rows_not_shaped_as_records_is_corruption(tmp_path: Path) -> None:
    """Arrays of the right count whose event is no tagged event: not a writer's slip (salvage keeps
    records that are shaped as records but do not decode), corruption."""
    import msgspec

    rows = [[seq, 7, "core", "NEW", "NEW", 0, "", None, None] for seq in range(3)]
    log = _crafted(tmp_path / "x", msgspec.msgpack.encode(rows), 3)
    loaded = load("x", log)
    assert loaded.status == "corrupt" and not loaded.gaps


def test_state_names_from_a_crafted_log_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A record's ``state``, ``before`` and ``machine`` were printed raw: a crafted log forged a
    "violations: 0" line and sent terminal escapes (found by review; reason, details and keys were
    already escaped). Every printed line must come from the tool."""
    import msgspec

    forged = "RELEASED\n  violations: 0 (local 0, remote 0)\x1b[2K"
    records = [msgspec.structs.replace(r, state=forged) if r.state == "RELEASED" else r for r in _records()]
    log = _write(tmp_path / "decode-tp0", [r for r in records if r.seq >= 5])  # trimmed: summarized as read
    for args in ((), ("--request", "a"), ("--timelines", "4")):
        _, out, _ = run_cli_captured(capsys, "replay", str(log), *args)
        assert "\x1b" not in out and "RELEASED\\n" in out, out
        assert sum(line.strip().startswith("violations: 0 (local 0, remote 0)") for line in out.splitlines()) <= 1


@pytest.mark.parametrize("interval", [float("inf"), float("nan"), 1e12, 0, -1])
def test_fsync_interval_out_of_bounds_is_refused_when_built(interval: float) -> None:
    """``FsyncPolicy.every(inf)`` was accepted, then the writer thread died at once (OverflowError)
    and the first write raised: bad arguments are refused when given (found by review)."""
    from pdfsm.filesink import FsyncPolicy

    with pytest.raises(ValueError, match="interval_ms"):
        FsyncPolicy.every(interval)


def test_a_frame_holding_only_an_ill_typed_record_is_a_gap_not_corruption(tmp_path: Path) -> None:
    """The writer's slip salvage exists for (an event built with a float time, which msgpack encodes
    all the same), alone in its frame, as after a quiet step: a one-record gap, the records around it
    read. A review of the hardening above found it refused the whole log as corrupt."""
    from pdfsm.events import AbortRequested
    from pdfsm.filelog import LogReader

    records = _records()
    import msgspec

    bad = msgspec.structs.replace(records[3], event=AbortRequested(source="s", t_ns=1.5e9, request_id="x"))  # type: ignore[arg-type]
    log = _write(tmp_path / "decode-tp0", [*records[:3], bad, *records[4:]], batch=1)  # a frame per record
    reader = LogReader(log)
    assert [r.seq for r in reader] == [r.seq for r in records if r.seq != bad.seq]
    assert [(g.first_seq, g.count) for g in reader.gaps] == [(bad.seq, 1)]
