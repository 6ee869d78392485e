"""Log, recovery and postmortem tooling under hostile or odd input (found by review; each asserts the fix)."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from helpers import run_cli
from make_golden import golden_rows

from pdfsm import filelog
from pdfsm.filelog import (
    HEADER_FIXED,
    MAGIC,
    CorruptLogError,
    LogError,
    encode_frame,
    encode_header,
    read_header,
    recover,
    segment_name,
    segment_paths,
    write_segment,
)
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.log import Record


@pytest.fixture(scope="module")
def rows() -> list[Record]:
    return golden_rows()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run_cli(*argv)
    out, err = capsys.readouterr()
    return code, out, err


def _log(rows: list[Record], directory: Path, **meta: object) -> Path:
    directory.mkdir(parents=True)
    write_segment(directory / segment_name(0), rows, salt=bytes(8), meta=meta, wall_ns=0, mono_ns=0,
                  batch_records=4)
    return directory


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Paths passed to fsync/fdatasync (resolved from the fd), in call order."""
    calls: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def path_of(fd: int) -> str:
        return os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))

    def fsync(fd: int) -> None:
        calls.append(path_of(fd))
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        calls.append(path_of(fd))
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    yield calls


# --- bounded reads ---------------------------------------------------------------------------------


def test_a_huge_frame_count_fails_without_allocating_per_claimed_record(rows: list[Record], tmp_path: Path) -> None:
    """A CRC-valid frame whose ``count`` claims far more records than its payload holds must be
    refused without allocating memory proportional to ``count`` (2**32 - 1 would be ~150 GiB)."""
    header, prev = encode_header(0, bytes(8), {})
    payload = msgspec.msgpack.encode(list(rows[:4]))
    head, _ = encode_frame(payload, 1 << 19, 0, prev, wall_ns=0, mono_ns=0)
    path = tmp_path / segment_name(0)
    path.write_bytes(header + head + payload)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptLogError):
            filelog.read_log(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes for a 4-record frame claiming {1 << 19} records"


def test_deeply_nested_header_metadata_is_a_typed_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Header metadata within MAX_META, CRC valid, nested deeper than msgspec recurses: a LogError
    (and exit 4 from replay), not a RecursionError traceback."""
    blob = b"\x81\xa1a" + b"\x91" * 60000 + b"\xc0"
    body = HEADER_FIXED.pack(MAGIC, 1, 0, len(blob), 0, bytes(8)) + blob
    path = tmp_path / "log" / segment_name(0)
    path.parent.mkdir()
    path.write_bytes(body + struct.pack("<I", filelog.crc32c(body)))
    with pytest.raises(LogError):
        read_header(path)
    code, _, _ = _run(capsys, "replay", str(path.parent))
    assert code == 4


# --- durability ----------------------------------------------------------------------------------


def test_sync_under_the_never_policy_makes_every_acknowledged_segment_durable(
        rows: list[Record], tmp_path: Path, fsynced: list[str]) -> None:
    """docs/log-format.md: under ``never`` the loss window is "everything since the last close() or
    sync()". With rotation, sync() acknowledges records in segments that were closed unsynced."""
    directory = tmp_path / "log"
    sink = FileSink(directory, fsync=FsyncPolicy.never(), segment_bytes=4096)
    n = 0
    for _ in range(10):
        batch = [msgspec.structs.replace(r, seq=n + i) for i, r in enumerate(rows)]
        n += len(batch)
        sink.write(batch)
    assert sink.sync(timeout=10) and sink.acked_seq == n - 1
    segments = segment_paths(directory)
    assert len(segments) > 1
    synced = set(fsynced)
    missing = [p.name for p in segments if str(p.resolve()) not in synced]
    assert not missing, f"acknowledged up to seq {n - 1} but never fsynced: {missing}"
    assert str(directory.resolve()) in synced, "the new segments' directory entries were never fsynced"
    sink.close()


def test_recovery_makes_its_backup_durable_before_cutting_the_original(
        rows: list[Record], tmp_path: Path, fsynced: list[str]) -> None:
    """Recovery "keeps a copy" of a torn tail, then truncates and fsyncs the original. The copy is
    never fsynced, so a power loss after the truncation can leave neither the bytes nor the copy."""
    directory = _log(rows, tmp_path / "log")
    seg = segment_paths(directory)[0]
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - 5)
    fsynced.clear()  # writing the log fsynced the segment already
    rec = recover(directory)
    (rep,) = rec.repairs
    backup = str(Path(rep.backup).resolve())
    assert backup in fsynced, "the backup of the torn segment was never fsynced"
    assert fsynced.index(backup) < fsynced.index(str(seg.resolve()))


def test_a_new_log_directory_is_made_durable_in_its_parent(rows: list[Record], tmp_path: Path,
                                                           fsynced: list[str]) -> None:
    """Under ``always`` an acknowledged record survives a machine crash. A log directory created by
    FileSink is a new entry of its parent directory; without an fsync of the parent the whole log
    (every acknowledged record) can be gone after a power loss."""
    parent = tmp_path / "logs"
    parent.mkdir()
    with FileSink(parent / "worker", fsync=FsyncPolicy.always()) as sink:
        sink.write(rows[:3])
        assert sink.wait_acked(2, timeout=5)
        assert str(parent.resolve()) in fsynced


# --- postmortem command line -------------------------------------------------------------------------


def test_a_file_that_is_not_a_log_is_not_a_clean_torn_tail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pdfsm replay notes.txt` says "torn tail accepted; replayed, no divergence" and exits 0.
    A file with a wrong magic (whole header written, tmp+fsync+rename) is not a crash artefact."""
    notes = tmp_path / "notes.txt"
    notes.write_text("meeting notes: the decode side looked fine, prefill did not........\n")
    code, out, _ = _run(capsys, "replay", str(notes))
    assert code != 0, out
    assert "no divergence" not in out


def test_repair_never_moves_aside_a_file_that_is_not_a_log(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.txt"
    text = "meeting notes: the decode side looked fine, prefill did not........\n"
    notes.write_text(text)
    _run(capsys, "replay", str(notes), "--repair")
    assert notes.exists() and notes.read_text() == text, sorted(p.name for p in tmp_path.iterdir())


def test_at_with_a_non_ascii_digit_is_a_usage_error(rows: list[Record], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`--at ²`: str.isdigit() accepts it, int() does not: a ValueError traceback instead of exit 2."""
    log = _log(rows, tmp_path / "log")
    code, _, err = _run(capsys, "replay", str(log), "--at", "\u00b2")
    assert code == 2 and "--at" in err


def test_json_is_strict_json_whatever_the_header_metadata(rows: list[Record], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`meta` copies float header values; NaN/Infinity come out as bare NaN/Infinity tokens, which
    are not JSON (jq, JavaScript's JSON.parse and Go's encoding/json reject the document)."""
    log = _log(rows, tmp_path / "log", worker="w", load=float("nan"), limit=float("inf"))
    code, out, _ = _run(capsys, "replay", str(log), "--json")
    assert code == 0

    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    doc = json.loads(out, parse_constant=refuse)
    assert doc["schema"] == 1


def test_an_unreadable_segment_is_a_status_not_a_traceback(rows: list[Record], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """postmortem.load: "Never raises for a bad log". A segment the user may not read (simulated:
    these tests run as root) raises PermissionError out of `pdfsm replay`."""
    log = _log(rows, tmp_path / "log")
    real_open = os.open

    def deny(path: object, *args: object, **kw: object) -> int:
        if str(path).endswith(".pdlog"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", deny)
    code, _, err = _run(capsys, "replay", str(log))
    assert code != 0 and "Permission denied" in err


def test_trace_into_a_missing_directory_is_a_clear_error(rows: list[Record], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    log = _log(rows, tmp_path / "log")
    code, _, err = _run(capsys, "trace", str(log), "-o", str(tmp_path / "no" / "such" / "trace.json"))
    assert code != 0 and err


def test_a_second_writer_on_a_live_log_is_refused_and_changes_nothing(rows: list[Record], tmp_path: Path) -> None:
    """reliability.md: "one writer". Opening a FileSink on a directory another FileSink is writing
    (two workers given the same name, an engine restarted while the old process lingers) runs
    recovery on the live log and creates a segment at its current end; the first writer keeps
    appending to its own segment, and its later (acknowledged) records now read as corruption."""
    directory = tmp_path / "log"
    first = FileSink(directory, fsync=FsyncPolicy.always())
    first.write(rows[:10])
    assert first.wait_acked(9, timeout=5)
    try:
        second = FileSink(directory)
    except LogError:
        pass  # refused: the right outcome
    else:
        second.close()
    first.write(rows[10:20])
    assert first.wait_acked(19, timeout=5)
    first.close()
    assert [r.seq for r in filelog.read_log(directory)] == list(range(20))


# --- logs that cannot be replayed whole ------------------------------------------------------------


def test_a_trimmed_log_is_summarized_not_reported_as_divergence(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """keep_segments deletes the oldest segments of a long-running engine's log; what is left
    starts after seq 0 and cannot be replayed, which is not a divergence: exit 0, a note says so."""
    from pdfsm.core import Core
    from pdfsm.events import AbortRequested, CoreConfig
    from pdfsm.log import EventLog

    sink = FileSink(tmp_path / "log", fsync=FsyncPolicy.never(), segment_bytes=4096, keep_segments=2)
    core = Core(CoreConfig(engine_id="D"), EventLog(sink=sink))
    for i in range(400):
        core.submit(AbortRequested(source="scheduler", t_ns=i, request_id=f"r{i}"))
        core.pump()
    core.log.close()
    assert sink.segments_deleted > 0
    code, out, _ = _run(capsys, "replay", str(tmp_path / "log"))
    assert code == 0 and "not replayed" in out and "removed by keep_segments" in out
    code, out, _ = _run(capsys, "replay", "--json", str(tmp_path / "log"))
    (log,) = json.loads(out)["logs"]
    assert code == 0 and log["replayed"] is False and "starts at seq" in log["replay_note"]


# --- found by review (stop 19) ---------------------------------------------------------------------


def test_a_damaged_gap_frame_mid_log_is_corruption_and_no_acknowledged_record_is_cut(rows: list[Record],
                                                                                    tmp_path: Path) -> None:
    """A gap frame stands for many lost records in a few bytes: the next frame's seq was judged
    against the bytes between them, so two flips in a gap frame's header (CRC and length) made
    the damage a torn tail and reopening the sink cut 60 acknowledged records. The damaged
    header's record count says where the next frame starts: corruption, nothing cut."""
    from pdfsm.filelog import FRAME, LogReader, TornTailError
    from pdfsm.log import Overflow

    d = tmp_path / "log"
    sink = FileSink(d, fsync=FsyncPolicy.always(), queue_rows=10, overflow=Overflow.COUNT)
    def row(seq: int) -> Record:
        return msgspec.structs.replace(rows[seq % len(rows)], seq=seq)

    with sink._cond:  # the writer cannot drain meanwhile: the second batch is refused whole, a gap
        sink.write([row(i) for i in range(10)])
        sink.write([row(10 + i) for i in range(100_000)])  # more records than the log has bytes
    sink.sync()
    for i in range(0, 60, 10):
        sink.write([row(100_010 + i + k) for k in range(10)])
        sink.sync()
    sink.close()
    seg = next(d.glob("*.pdlog"))
    data = bytearray(seg.read_bytes())
    gap = next(o for o in range(len(data)) if data[o:o + 4] == b"PDFB" and FRAME.unpack_from(data, o)[6] & 1)
    data[gap + 4] ^= 0x01  # the CRC field
    data[gap + 11] ^= 0x80  # the top bit of the length field
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError, match="a valid frame follows"):
        list(LogReader(d))
    with pytest.raises(LogError) as err:
        FileSink(d)  # recovery refuses corruption: it never cuts it
    assert not isinstance(err.value, TornTailError)
    assert seg.read_bytes() == bytes(data)


def test_classifying_damage_is_bounded_on_a_file_of_frame_shaped_runs(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every frame-shaped run after an unreadable frame header had its whole claimed payload read
    and CRC-checked: quadratic on a hostile file (a 4 MiB one took a minute). The payloads checked
    are bounded; past the bound the damage is corruption (nothing is cut on a guess)."""
    from pdfsm.filelog import LogReader, TornTailError

    header, _ = encode_header(0, bytes(8), {})
    n = 2000
    body = b"JUNK" + b"\0" * 44 + b"".join(b"PDFB" + struct.pack("<II", 0, max(0, 12 * (n - i) - 48)) for i in range(n))
    path = tmp_path / segment_name(0)
    path.write_bytes(header + body)
    with pytest.raises(TornTailError):  # within the bound: every run checked, none valid
        list(LogReader(path))
    monkeypatch.setattr(filelog, "_SCAN_BUDGET", 64 << 10)
    with pytest.raises(CorruptLogError, match="more frame-shaped data follows than can be checked"):
        list(LogReader(path))
