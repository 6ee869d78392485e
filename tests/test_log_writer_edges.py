"""Edge cases of the durable log writer (pdfsm/filesink.py) and reader (pdfsm/filelog.py) against
/work/shared/context/reliability.md and docs/log-format.md. Deterministic: interleavings are
forced with events and monkeypatching; waits poll with a bounded deadline."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelog_writer import row

from pdfsm.core import Core
from pdfsm.events import AbortRequested, CoreConfig
from pdfsm.filelog import LogError, LogReader, LogWriteError, read_log, recover, segment_paths
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.log import EventLog, Record
from pdfsm.replay import QuietLogger

WRITER_THREAD = "pdfsm-filelog"


def _rows(a: int, b: int) -> list[Record]:
    return [row(s) for s in range(a, b)]


def _records(a: int, b: int) -> list[Record]:
    return [row(s) for s in range(a, b)]


def _eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def _stall(sink: FileSink) -> threading.Event:
    """Make the writer thread wait in _write until the returned event is set."""
    go, real = threading.Event(), sink._write

    def slow(items: list[Any]) -> None:
        assert go.wait(10)
        real(items)

    sink._write = slow  # type: ignore[method-assign]
    return go


# --- a record that encodes but cannot be read back -------------------------------------------------


def test_an_ill_typed_event_does_not_make_the_log_unreadable(tmp_path: Path) -> None:
    """docs/log-format.md (Back-pressure): a record that "cannot be encoded at all ... becomes a
    gap ..., never a crashed writer"; reliability.md: corruption is *damage* followed by good
    records. A producer submits an event with a field of the wrong but msgpack-encodable type
    (``t_ns=1.5e9``, a float: Event structs do not validate on construction and Core.submit does
    not check). The core applies and records it, FileSink writes and acks it, and the reader
    then refuses the whole frame as CorruptLogError: every well-formed record in it and after it
    is unreadable, and the log is reported as damaged disk data."""
    directory = tmp_path / "log"
    sink = FileSink(directory, fsync=FsyncPolicy.always())
    log = EventLog(sink=sink)
    core = Core(CoreConfig(engine_id="E"), log, logger=QuietLogger())
    for i in range(5):
        core.submit(AbortRequested(source="s", t_ns=i, request_id=f"r{i}"))
    core.submit(AbortRequested(source="s", t_ns=1.5e9, request_id="float-t"))  # type: ignore[arg-type]
    for i in range(5, 10):
        core.submit(AbortRequested(source="s", t_ns=i, request_id=f"r{i}"))
    core.pump()
    log.close()
    assert sink.acked_seq == log.next_seq - 1
    reader = LogReader(directory)
    got = list(reader)  # raises CorruptLogError: "payload does not decode as schema 2"
    bad = {g.first_seq for g in reader.gaps}
    assert [r.seq for r in got] == [s for s in range(log.next_seq) if s not in bad] and len(bad) <= 1


# --- close on another thread while the owner waits for room ------------------------------------------


def test_a_write_blocked_for_room_when_the_sink_closes_is_refused_not_silently_dropped(tmp_path: Path) -> None:
    """FileSink.write: "Raises if the writer failed or was closed"; close(): "Write what is queued".
    An owner blocked in write() under Overflow.BLOCK while close() runs (e.g. shutdown from a signal
    handler or a supervisor thread) is let through after the writer took its last drain and exited:
    write() returns normally, the batch sits in a queue nobody will drain, and its rows are in
    neither the file nor an error."""
    directory = tmp_path / "log"
    sink = FileSink(directory, queue_rows=10, fsync=FsyncPolicy.never())
    go = _stall(sink)
    sink.write(_rows(0, 10))  # taken by the writer, which stalls
    _eventually(lambda: sink.queued == 0)
    sink.write(_rows(10, 20))  # queued: the queue is full
    outcome: list[object] = []

    def third() -> None:
        try:
            sink.write(_rows(20, 30))
            outcome.append("returned")
        except LogWriteError as e:
            outcome.append(e)

    blocked = threading.Thread(target=third)
    blocked.start()
    _eventually(lambda: sink._blocked == 1)
    closer = threading.Thread(target=sink.close)
    closer.start()
    _eventually(lambda: sink._closing)
    go.set()
    closer.join(10)
    blocked.join(10)
    assert not closer.is_alive() and not blocked.is_alive()
    seqs = [rec.seq for rec in read_log(directory)]
    if outcome == ["returned"]:
        assert seqs == list(range(30)), f"write() returned, yet the file ends at seq {seqs[-1]}"
    else:
        assert isinstance(outcome[0], LogWriteError)


# --- a failing close() of a segment fd -----------------------------------------------------------


def test_eio_from_closing_a_segment_at_rotation_lets_the_writer_lock_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer failure surfaces as LogWriteError and lets go of the writer lock (FileSink._run;
    test_eio_from_fdatasync_never_acks... reopens right after a failure). close(2) may report EIO
    (NFS, some FUSE/NBD backends) after the fd is already released. At rotation, _rotate's
    os.close raises before ``self._fd = -1``, so _run's handler closes the same fd number again
    (EBADF, or worse: a descriptor another thread got in between), that second error escapes the
    handler and the lock fd is never closed: the log cannot be reopened by this process."""
    directory = tmp_path / "log"
    real_close = os.close
    fired: list[int] = []

    def close(fd: int) -> None:
        if threading.current_thread().name == WRITER_THREAD and not fired:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.endswith(".pdlog"):
                fired.append(fd)
                real_close(fd)
                raise OSError(errno.EIO, "Input/output error")
        real_close(fd)

    monkeypatch.setattr(os, "close", close)
    sink = FileSink(directory, fsync=FsyncPolicy.always(), segment_bytes=4096)
    seq = 0
    with pytest.raises(LogWriteError):
        for _ in range(200):
            sink.write(_rows(seq, seq + 10))
            seq += 10
            sink.sync(timeout=5)
    assert fired
    with pytest.raises(LogWriteError):
        sink.close()
    monkeypatch.undo()
    again = FileSink(directory)  # raises "another writer holds this log"
    again.close()
    got = read_log(directory)
    assert got == _records(0, len(got)) and len(got) >= 10


# --- repairing a live log -----------------------------------------------------------------------------


def test_recovery_run_on_a_live_log_never_destroys_records_the_writer_then_acknowledges(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """reliability.md: "A record acknowledged under always survives"; docs: writer.lock is "the live
    writer's flock" and LogReader's "stop" is for "a log that is being written". recover() (public,
    "make a log safe to append to") and LogReader(on_torn_tail="repair") do not look at the lock:
    run while a writev is in flight they see a short last frame, call it torn and truncate it; the
    live writer (not O_APPEND) goes on at its own offset, leaving a hole of zeros, and every record
    it then fsyncs and acknowledges reads back as CorruptLogError."""
    directory = tmp_path / "log"
    sink = FileSink(directory, fsync=FsyncPolicy.always(), batch_records=4)
    sink.write(_rows(0, 8))
    assert sink.wait_acked(7, timeout=5)
    real_writev = os.writev
    half_done, resume = threading.Event(), threading.Event()

    def torn_writev(fd: int, bufs: list[bytes]) -> int:
        if threading.current_thread().name == WRITER_THREAD and not half_done.is_set():
            data = b"".join(bufs)
            n = real_writev(fd, [data[: len(data) // 2]])
            half_done.set()
            assert resume.wait(10)
            return n  # _write_all writes the rest with os.write at the fd's offset
        return real_writev(fd, bufs)

    monkeypatch.setattr(os, "writev", torn_writev)
    sink.write(_rows(8, 16))
    assert half_done.wait(5)
    refused = False
    try:
        recover(directory)  # a second process / tool "recovering" the log while it is live
    except LogError:
        refused = True
    resume.set()
    assert sink.wait_acked(15, timeout=5)
    sink.write(_rows(16, 24))
    assert sink.wait_acked(23, timeout=5)
    sink.close()
    monkeypatch.undo()
    got = read_log(directory)  # acked records 8..23: CorruptLogError "a valid frame follows"
    assert got == _records(0, 24), refused


# --- cheap checks that pass (new coverage) -------------------------------------------------------------


def test_every_ack_is_readable_by_a_fresh_reader_while_the_writer_is_live(tmp_path: Path) -> None:
    """"acknowledged" = fsynced and in the file: from inside on_ack (writer thread, writer live),
    a fresh LogReader reads every record up to the acked seq, across rotations."""
    directory = tmp_path / "log"
    problems: list[str] = []

    def on_ack(seq: int) -> None:
        got = [r.seq for r in LogReader(directory, on_torn_tail="stop")]
        if got[-1:] != [seq] or got != list(range(seq + 1)):
            problems.append(f"ack {seq}: read {got[-1:] if got else None}, {len(got)} records")

    seq = 0
    with FileSink(directory, fsync=FsyncPolicy.always(), segment_bytes=4096, batch_records=5,
                  on_ack=on_ack) as sink:
        for i in range(60):
            sink.write(_rows(seq, seq + 1 + i % 7))
            seq += 1 + i % 7
            if i % 3 == 0:
                assert sink.wait_acked(seq - 1, timeout=5)
    assert len(segment_paths(directory)) > 3 and not problems, problems[:3]


def test_rotation_exactly_at_the_size_bound(tmp_path: Path) -> None:
    """"When a segment reaches segment_bytes ... it overshoots by at most one frame": a segment
    that reaches the bound exactly rotates there; one byte more and it takes exactly one more frame."""
    probe = tmp_path / "probe"
    with FileSink(probe, fsync=FsyncPolicy.never(), batch_records=1) as s:
        s.write(_rows(0, 100))
    ends = [fr.end for _, fr in LogReader(probe).frames()]
    k = next(i for i, e in enumerate(ends) if e >= 4096)
    for bound, first_frames in ((ends[k], k + 1), (ends[k] + 1, k + 2)):
        directory = tmp_path / f"b{bound}"
        with FileSink(directory, fsync=FsyncPolicy.never(), batch_records=1, segment_bytes=bound) as s:
            s.write(_rows(0, 100))
        paths = segment_paths(directory)
        assert paths[0].stat().st_size == ends[first_frames - 1], bound
        assert len(read_log(paths[0])) == first_frames
        assert read_log(directory) == _records(0, 100)
