"""Adversarial review of the durable log (pdfsm/filelog.py, pdfsm/filesink.py) against reliability.md."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import pytest
from filelog_writer import row

from pdfsm.core import Core
from pdfsm.events import AbortRequested, CoreConfig, HandshakeDone, HandshakeReply, RankInfo
from pdfsm.filelog import (
    FRAME,
    CorruptLogError,
    LogError,
    LogReader,
    LogWriteError,
    TornTailError,
    encode_frame,
    read_header,
    read_log,
    recover,
    segment_paths,
)
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.log import EventLog, Outcome, Overflow, Record
from pdfsm.replay import QuietLogger

TESTS = Path(__file__).parent


def _rows(a: int, b: int) -> list[Record]:
    return [row(s) for s in range(a, b)]


def _records(a: int, b: int) -> list[Record]:
    return [row(s) for s in range(a, b)]


def _seqs(path: Path) -> list[int]:
    return [r.seq for r in read_log(path)]


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


class FsyncLog:
    """The size each file had when it was last fsynced (fsync or fdatasync), by its final name."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.lock = threading.Lock()

    def record(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        if os.path.isdir(path):
            return
        path = path.removesuffix(".tmp")  # a header fsynced before its rename
        with self.lock:
            self.sizes[os.path.realpath(path)] = st.st_size

    def unsynced(self, directory: Path) -> list[str]:
        """Segments whose bytes on disk now are not all covered by an fsync."""
        with self.lock:
            return [f"{p.name}: {p.stat().st_size} bytes, fsynced {self.sizes.get(str(p.resolve()))}"
                    for p in segment_paths(directory)
                    if self.sizes.get(str(p.resolve())) != p.stat().st_size]


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[FsyncLog]:
    log = FsyncLog()
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        log.record(fd)

    def fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        log.record(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    yield log


def _slow_writer(sink: FileSink, delay: float) -> None:
    real = sink._write

    def slow(items: list[object]) -> None:
        time.sleep(delay)
        real(items)  # type: ignore[arg-type]

    sink._write = slow  # type: ignore[assignment,method-assign]


# --- acknowledgement and fsync policies --------------------------------------------------------------


@pytest.mark.parametrize("policy", [FsyncPolicy.always(), FsyncPolicy.every(2), FsyncPolicy.never()],
                         ids=["always", "every", "never"])
def test_an_ack_is_given_only_when_every_segment_is_fsynced_to_its_end(
        policy: FsyncPolicy, tmp_path: Path, fsyncs: FsyncLog) -> None:
    """acked_seq means "known to be fsynced": at each on_ack no segment may hold unsynced bytes."""
    directory = tmp_path / "log"
    bad: list[str] = []
    acks: list[int] = []

    def on_ack(seq: int) -> None:
        acks.append(seq)
        bad.extend(f"ack {seq}: {u}" for u in fsyncs.unsynced(directory))

    sink = FileSink(directory, fsync=policy, segment_bytes=4096, batch_records=8, on_ack=on_ack)
    seq = 0
    for rnd in range(3):
        for _ in range(12):  # enough to rotate at least once per round
            sink.write(_rows(seq, seq + 7))
            seq += 7
            assert sink.wait_written(timeout=5)
        assert sink.sync(timeout=5), rnd  # the sync acks everything handed over
    sink.close()
    assert len(segment_paths(directory)) >= 4 and acks and acks[-1] == seq - 1
    assert not bad, bad[:3]
    assert _seqs(directory) == list(range(seq))


def test_reopening_a_log_fsyncs_the_recovered_records_it_reports_acked(tmp_path: Path, fsyncs: FsyncLog) -> None:
    """A reopened FileSink sets acked_seq to the recovered end: those records must then be fsynced."""
    crashed = tmp_path / "crashed"
    with FileSink(tmp_path / "live", fsync=FsyncPolicy.never()) as live:
        live.write(_rows(0, 50))
        assert live.wait_written(timeout=5)
        crashed.mkdir()  # what a kill -9 leaves: the bytes in the page cache, never fsynced
        for seg in segment_paths(tmp_path / "live"):
            shutil.copyfile(seg, crashed / seg.name)
    fsyncs.sizes.clear()
    with FileSink(crashed, fsync=FsyncPolicy.always()) as again:
        assert again.acked_seq == 49
        assert not fsyncs.unsynced(crashed), "acked_seq claims records that were never fsynced"


def test_eio_from_fdatasync_never_acks_and_surfaces_on_the_owner_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync that fails acks nothing, calls no on_ack and raises LogWriteError to the owner."""
    acks: list[int] = []
    sink = FileSink(tmp_path / "log", fsync=FsyncPolicy.always(), on_ack=acks.append)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    sink.write(_rows(0, 10))
    with pytest.raises(LogWriteError, match="Input/output error"):
        sink.wait_acked(9, timeout=5)
    assert sink.acked_seq == -1 and acks == []
    with pytest.raises(LogWriteError):
        sink.write(_rows(10, 11))
    with pytest.raises(LogWriteError):
        sink.close()
    monkeypatch.undo()
    with FileSink(tmp_path / "log") as again:  # the lock was let go; the log is readable
        assert again.recovery.next_seq in (0, 10)


def test_enospc_mid_frame_fails_loudly_and_reopen_keeps_every_acked_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short writev then ENOSPC leaves a torn frame; reopening repairs it and keeps all acked rows."""
    directory = tmp_path / "log"
    sink = FileSink(directory, fsync=FsyncPolicy.always())
    sink.write(_rows(0, 20))
    assert sink.wait_acked(19, timeout=5)
    real_writev = os.writev

    def half_writev(fd: int, bufs: list[bytes]) -> int:
        data = b"".join(bufs)
        return real_writev(fd, [data[: len(data) // 2]])

    def enospc(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", half_writev)
    monkeypatch.setattr(os, "write", enospc)
    sink.write(_rows(20, 40))
    with pytest.raises(LogWriteError, match="No space left"):
        sink.sync(timeout=5)
    assert sink.acked_seq == 19
    with pytest.raises(LogWriteError):
        sink.close()
    monkeypatch.undo()
    again = FileSink(directory, fsync=FsyncPolicy.always())
    (repair,) = again.recovery.repairs
    assert Path(repair.backup).exists() and again.recovery.next_seq == 20
    again.write(_rows(20, 40))
    again.close()
    assert read_log(directory) == _records(0, 40)


def test_a_failed_rotation_leaves_a_log_that_reopens_at_its_last_acked_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while renaming the next segment into place: loud failure, no half segment (nor its
    temp file), nothing acked lost."""
    directory = tmp_path / "log"
    acks: list[int] = []
    sink = FileSink(directory, fsync=FsyncPolicy.always(), segment_bytes=4096, on_ack=acks.append)

    def no_space(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    seq = 0
    with pytest.raises(LogWriteError, match="No space left"):
        for _ in range(100):
            sink.write(_rows(seq, seq + 10))
            seq += 10
            sink.sync(timeout=5)
    monkeypatch.undo()
    with pytest.raises(LogWriteError):
        sink.close()
    assert acks
    assert not list(directory.glob("*.tmp"))  # the header that was never renamed is gone
    again = FileSink(directory)
    assert again.recovery.next_seq > acks[-1]
    again.close()
    got = read_log(directory)
    assert got == _records(0, len(got)) and len(got) > acks[-1]


# --- crashes -------------------------------------------------------------------------------------

_CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
from filelog_writer import row
from pdfsm.filesink import FileSink, FsyncPolicy
sink = FileSink(sys.argv[1], fsync=FsyncPolicy.every(3), segment_bytes=4096, queue_rows=64,
                on_ack=lambda s: print(f"ack {s}", flush=True))
seq = sink.recovery.next_seq
print(f"start {seq}", flush=True)
n = 1
while True:
    sink.write([row(s) for s in range(seq, seq + n)])
    seq += n
    n = n % 13 + 1
    sink.wait_written()
    print(f"written {seq - 1}", flush=True)
"""


def test_kill_9_loses_no_record_that_was_written_or_acked(tmp_path: Path) -> None:
    """Under kill -9 every record reported written (in the kernel) or acked (fsynced) is read back."""
    directory = tmp_path / "log"
    rng = random.Random(7)
    expect_start = 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory), str(TESTS)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stderr is not None
        lines: list[str] = []
        want = rng.randint(5, 120)
        while sum(x.count("written") for x in lines) < want:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line.strip())
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate()
        lines += out.split("\n")
        assert lines[0] == f"start {expect_start}", err
        # Two threads print (the writer acks): lines can interleave, so marks are found, not split.
        marks = [int(n) for n in re.findall(r"(?:written|ack) (\d+)", "\n".join(lines))]
        recover(directory)
        got = read_log(directory)
        assert got == _records(0, len(got))
        assert max(marks) < len(got), f"reported up to {max(marks)}, recovered {len(got)}"
        expect_start = len(got)
    assert len(segment_paths(directory)) > 1


# --- back-pressure -------------------------------------------------------------------------------


def test_block_backpressure_keeps_the_queue_bounded_and_drops_nothing(tmp_path: Path) -> None:
    """A writer slower than the producer: BLOCK never holds more than queue_rows and loses no row."""
    sink = FileSink(tmp_path / "log", queue_rows=64, fsync=FsyncPolicy.never())
    _slow_writer(sink, 0.002)
    peak = 0
    for i in range(150):
        sink.write(_rows(10 * i, 10 * i + 10))
        peak = max(peak, sink.queued)
    sink.close()
    assert peak <= 64 and sink.lost == 0
    assert _seqs(tmp_path / "log") == list(range(1500))


def test_count_backpressure_accounts_for_every_seq_as_a_record_or_a_gap(tmp_path: Path) -> None:
    """COUNT drops under a slow writer, but each seq is in the file as a record or inside a gap."""
    sink = FileSink(tmp_path / "log", queue_rows=32, overflow=Overflow.COUNT, fsync=FsyncPolicy.never())
    _slow_writer(sink, 0.002)
    for i in range(200):
        sink.write(_rows(10 * i, 10 * i + 10))
        assert sink.queued <= 32
    sink.close()
    reader = LogReader(tmp_path / "log")
    got = list(reader)
    lost = [s for g in reader.gaps for s in range(g.first_seq, g.first_seq + g.count)]
    assert sink.lost > 0 and len(lost) == sink.lost
    assert sorted([r.seq for r in got] + lost) == list(range(2000))
    assert got == [row(r.seq) for r in got] and reader.next_seq == 2000


def test_a_batch_larger_than_the_queue_is_admitted_whole(tmp_path: Path) -> None:
    """A batch over queue_rows goes into an empty queue whole (no deadlock, no drop)."""
    with FileSink(tmp_path / "log", queue_rows=8, overflow=Overflow.BLOCK) as sink:
        sink.write(_rows(0, 500))
        sink.write(_rows(500, 1000))
    assert sink.lost == 0 and _seqs(tmp_path / "log") == list(range(1000))


# --- segments, rotation, retention, reopening ------------------------------------------------------


def test_rotation_boundaries_keep_segments_contiguous_and_none_but_the_last_empty(tmp_path: Path) -> None:
    """Each segment starts where the previous ended and holds at least one frame (but the last)."""
    directory = tmp_path / "log"
    rng = random.Random(11)
    seq = 0
    with FileSink(directory, segment_bytes=4096, batch_records=3, fsync=FsyncPolicy.never()) as sink:
        for _ in range(300):
            n = rng.randint(1, 9)
            sink.write(_rows(seq, seq + n))
            seq += n
    paths = segment_paths(directory)
    assert len(paths) > 5
    end = 0
    for p in paths:
        assert read_header(p).start_seq == end, p.name
        recs = read_log(p)
        assert recs or p == paths[-1], p.name
        end += len(recs)
    assert end == seq and read_log(directory) == _records(0, seq)


def test_reading_while_retention_deletes_segments_never_silently_skips_records(tmp_path: Path) -> None:
    """A replay racing keep_segments yields a contiguous run of records, then fails loudly if at all."""
    directory = tmp_path / "log"
    sink = FileSink(directory, segment_bytes=4096, keep_segments=2, fsync=FsyncPolicy.never())
    seq = 0
    while sink.segments_deleted < 2:
        sink.write(_rows(seq, seq + 10))
        seq += 10
        sink.wait_written(timeout=5)
    it = LogReader(directory, on_torn_tail="stop").batches()
    seen = [r.seq for r in next(it)]
    deleted = sink.segments_deleted
    while sink.segments_deleted < deleted + 3:  # every segment the reader listed is now gone
        sink.write(_rows(seq, seq + 10))
        seq += 10
        sink.wait_written(timeout=5)
    try:
        for batch in it:
            seen += [r.seq for r in batch]
    except (OSError, LogError):
        pass
    sink.close()
    assert seen == list(range(seen[0], seen[0] + len(seen)))


def test_reopening_after_a_torn_tail_keeps_a_copy_and_appends_contiguously(tmp_path: Path) -> None:
    """A cut tail is backed up, truncated, and the next writer continues at the last good frame."""
    directory = tmp_path / "log"
    with FileSink(directory, batch_records=5) as sink:
        for i in range(40):
            sink.write(_rows(5 * i, 5 * i + 5))
    (last,) = segment_paths(directory)
    data = last.read_bytes()
    with open(last, "r+b") as f:
        f.truncate(len(data) - 7)
    again = FileSink(directory, segment_bytes=4096)
    (rep,) = again.recovery.repairs
    assert Path(rep.backup).read_bytes() == data[:-7] and rep.removed_bytes > 0
    start = again.recovery.next_seq
    assert 190 <= start < 200 and last.stat().st_size == rep.offset
    again.write(_rows(start, start + 30))
    again.close()
    assert read_log(directory) == _records(0, start + 30)


def test_truncating_the_last_segment_at_every_byte_of_its_header_and_last_frame_recovers_a_prefix(
        tmp_path: Path) -> None:
    """Every cut of the last segment is a torn tail: recovery leaves exactly the records before it."""
    directory = tmp_path / "log"
    with FileSink(directory, segment_bytes=4096, batch_records=4, fsync=FsyncPolicy.never()) as sink:
        i = 0
        while True:  # stop with at least one frame in the last of three or more segments
            sink.write(_rows(4 * i, 4 * i + 4))
            i += 1
            sink.wait_written(timeout=5)
            paths = segment_paths(directory)
            if len(paths) >= 3 and paths[-1].stat().st_size > 400:
                break
    last = paths[-1]
    data = last.read_bytes()
    reader = LogReader(last)
    frames = [fr for _, fr in reader.frames()]
    header = reader.headers[0]
    assert len(paths) > 2 and frames
    prev_end = header.start_seq
    head_end = frames[-1].offset + FRAME.size  # every byte of both headers, every 5th of the payload
    cuts = [*range(header.size), *range(frames[-1].offset + 1, head_end), *range(head_end, len(data), 5)]
    good = _records(prev_end, frames[-1].base_seq)
    for cut in cuts:
        for stale in directory.glob("*.torn.*"):
            stale.unlink()
        last.write_bytes(data[:cut])
        with pytest.raises(TornTailError):
            list(LogReader(directory).frames())
        rec = recover(directory)
        expect = prev_end if cut < header.size else frames[-1].base_seq
        assert rec.next_seq == expect, cut
        if cut < header.size:
            assert not last.exists(), cut  # a torn header: moved aside whole
        else:
            assert read_log(last) == good, cut
    assert _seqs(directory) == list(range(frames[-1].base_seq))
    with FileSink(directory) as again:
        again.write(_rows(again.recovery.next_seq, again.recovery.next_seq + 3))
    assert read_log(directory) == _records(0, frames[-1].base_seq + 3)


def test_a_bit_flip_in_a_middle_segment_is_corruption_at_its_offset_and_changes_nothing(tmp_path: Path) -> None:
    """Damage in a middle segment is CorruptLogError naming that file and frame; never truncated."""
    directory = tmp_path / "log"
    with FileSink(directory, segment_bytes=4096, batch_records=4, fsync=FsyncPolicy.never()) as sink:
        for i in range(60):
            sink.write(_rows(4 * i, 4 * i + 4))
    paths = segment_paths(directory)
    middle = paths[len(paths) // 2]
    data = middle.read_bytes()
    reader = LogReader(middle)
    frames = [fr for _, fr in reader.frames()]
    header_size = reader.headers[0].size
    rng = random.Random(5)
    picks = [b for b in rng.sample(range(len(data)), 40) if b not in (8, 9)]  # 8-9: format version
    picks += [frames[-1].offset + 5, frames[-1].end - 1, frames[0].offset]  # the last frame, and the first
    for byte in picks:
        flipped = bytearray(data)
        flipped[byte] ^= 1 << rng.randrange(8)
        middle.write_bytes(bytes(flipped))
        before = _snapshot(directory)
        with pytest.raises(CorruptLogError) as err:
            read_log(directory)
        expect = 0 if byte < header_size else next(fr.offset for fr in frames if fr.offset <= byte < fr.end)
        assert err.value.path == str(middle) and err.value.offset == expect, (byte, err.value)
        with contextlib.suppress(CorruptLogError):
            recover(directory)
        assert _snapshot(directory) == before, byte
    middle.write_bytes(data)


def test_replaying_a_log_whose_last_segment_is_empty_reads_every_record(tmp_path: Path) -> None:
    """Reopened and closed with nothing written: the empty last segment reads and reopens cleanly."""
    directory = tmp_path / "log"
    with FileSink(directory) as sink:
        sink.write(_rows(0, 30))
    for _ in range(3):
        FileSink(directory).close()
    paths = segment_paths(directory)
    assert len(paths) == 2 and read_header(paths[-1]).start_seq == 30
    reader = LogReader(directory)
    assert list(reader) == _records(0, 30) and reader.next_seq == 30
    assert recover(directory).next_seq == 30
    with FileSink(directory) as again:
        again.write(_rows(30, 40))
    assert read_log(directory) == _records(0, 40) and len(segment_paths(directory)) == 2


# --- cores, threads, closing ------------------------------------------------------------------------


def _core(log: EventLog, engine_id: str) -> Core:
    return Core(CoreConfig(engine_id=engine_id), log, logger=QuietLogger())


def test_two_cores_in_one_process_write_two_independent_logs(tmp_path: Path) -> None:
    """Two cores, two FileSinks: each log reads back as its own core's records; one dir, one writer."""
    logs = [EventLog(sink=FileSink(tmp_path / d, fsync=FsyncPolicy.always())) for d in ("a", "b")]
    cores = [_core(log, eid) for log, eid in zip(logs, ("A", "B"), strict=True)]
    with pytest.raises(LogWriteError, match="another writer"):
        FileSink(tmp_path / "a")
    for i in range(200):
        core = cores[i % 2]
        core.submit(AbortRequested(source="scheduler", t_ns=i, request_id=f"r{i}"))
        core.pump()
    for log in logs:
        log.close()
    for log, d in zip(logs, ("a", "b"), strict=True):
        assert read_log(tmp_path / d) == log.records()


def test_close_twice_is_idempotent_and_later_writes_are_refused(tmp_path: Path) -> None:
    """close() twice is harmless; a write, sync or pump after it raises LogWriteError."""
    sink = FileSink(tmp_path / "log", fsync=FsyncPolicy.never())
    log = EventLog(sink=sink)
    core = _core(log, "D")
    core.submit(AbortRequested(source="scheduler", t_ns=1, request_id="r"))
    core.pump()
    log.close()
    log.close()
    sink.close()
    assert sink.acked_seq == log.next_seq - 1
    with pytest.raises(LogWriteError, match="closed"):
        sink.write([row(log.next_seq)])
    core.submit(AbortRequested(source="scheduler", t_ns=2, request_id="r2"))
    with pytest.raises(LogWriteError):
        core.pump()
    assert _seqs(tmp_path / "log") == list(range(2))


def test_close_while_other_threads_submit_keeps_every_recorded_event(tmp_path: Path) -> None:
    """Producers keep submitting while the owner closes: every seq the core assigned is in the file."""
    sink = FileSink(tmp_path / "log", fsync=FsyncPolicy.every(1))
    log = EventLog(sink=sink, window=1 << 16)
    core = _core(log, "D")
    stop = threading.Event()

    def produce(k: int) -> None:
        i = 0
        while not stop.is_set():
            core.submit(AbortRequested(source=f"t{k}", t_ns=i, request_id=f"{k}-{i}"))
            i += 1
            if i % 64 == 0:
                time.sleep(0)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(50):
            core.pump()
        log.close()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert read_log(tmp_path / "log") == log.records() and len(log) == log.next_seq > 50


# --- odd records ----------------------------------------------------------------------------------


def test_a_record_exactly_at_the_frame_cap_is_written_and_one_byte_over_becomes_a_gap(tmp_path: Path) -> None:
    """The frame cap is inclusive on both sides: a frame of exactly the cap is kept and read back."""
    encode = msgspec.msgpack.Encoder().encode

    def with_reason(seq: int, n: int) -> Record:
        return msgspec.structs.replace(row(seq), reason="x" * n)

    fit = with_reason(1, 3000)
    cap = len(encode([fit])) + FRAME.size
    over = with_reason(2, 3001)
    with FileSink(tmp_path / "log", max_frame_bytes=cap, batch_records=1) as sink:
        sink.write([row(0), fit, over, row(3)])
    reader = LogReader(tmp_path / "log", max_frame_bytes=cap - FRAME.size)
    got = list(reader)
    assert [r.seq for r in got] == [0, 1, 3] and got[1] == fit
    (gap,) = reader.gaps
    assert (gap.first_seq, gap.count) == (2, 1) and "frame cap" in gap.reason


def test_unicode_and_odd_request_ids_round_trip_through_the_file_log(tmp_path: Path) -> None:
    """Request ids with NUL, RTL overrides, emoji, newlines and 4 KiB lengths read back unchanged."""
    ids = ["é", "🙂" * 64, "\u202eevil", "a\x00b", "line\nbreak", "x" * 4096, " ", "\\x00", "r" + "\ufeff"]
    log = EventLog(sink=FileSink(tmp_path / "log", fsync=FsyncPolicy.always()))
    core = _core(log, "Dé🙂")
    for i, rid in enumerate(ids):
        core.submit(AbortRequested(source="sched\u00fcler", t_ns=i, request_id=rid))
        core.pump()
    log.close()
    got = read_log(tmp_path / "log")
    assert got == log.records()
    assert {getattr(r.event, "request_id", None) for r in got} >= set(ids)


def test_an_unencodable_record_becomes_a_gap_and_the_writer_goes_on(tmp_path: Path) -> None:
    """A lone surrogate cannot be UTF-8: like an oversized record, a gap that says why, never a dead writer."""
    directory = tmp_path / "log"
    with FileSink(directory, fsync=FsyncPolicy.always()) as sink:
        sink.write(_rows(0, 10))
        r = row(10)
        bad = msgspec.structs.replace(r, event=msgspec.structs.replace(r.event, request_id="\ud800"))
        sink.write([bad, *_rows(11, 14)])
        assert sink.sync(timeout=5) and sink.acked_seq == 13
    reader = LogReader(directory)
    got = list(reader)
    assert [rec.seq for rec in got] == [*range(10), 11, 12, 13]
    (gap,) = reader.gaps
    assert (gap.first_seq, gap.count) == (10, 1) and "surrogate" in gap.reason


def test_a_batch_whose_seqs_do_not_rise_by_exactly_one_is_refused(tmp_path: Path) -> None:
    """write() promises LogWriteError for rows that do not continue the sequence, inner rows included."""
    with FileSink(tmp_path / "log") as sink:
        sink.write(_rows(0, 4))
        bad = [row(4), row(5), row(5), row(7)]  # right first and last seq, a duplicate and a hole inside
        refused = False
        try:
            sink.write(bad)
        except LogWriteError:
            refused = True
    if not refused:
        with pytest.raises(CorruptLogError):
            read_log(tmp_path / "log")
    assert refused, "accepted, and the log it wrote now reads as CorruptLogError"


def _handshake_row(seq: int, metadata: bytes) -> Record:
    reply = HandshakeReply(engine_id="P", compat_hash="h", tp_size=1,
                           ranks=(RankInfo(pp_rank=0, tp_rank=0, agent="P-0", metadata=metadata),))
    ev = HandshakeDone(source="handshake", t_ns=seq, engine_id="P", pp_rank=0, attempt=1, reply=reply)
    return Record(seq, ev, "engine", "CONNECTING", "CONNECTED", Outcome.APPLIED)


def test_a_torn_last_frame_whose_payload_embeds_frame_bytes_is_still_a_torn_tail(tmp_path: Path) -> None:
    """A short last record is a crash artefact even when a peer's metadata bytes look like a frame."""
    payload = b"\x90"
    head, _ = encode_frame(payload, 0, 10**6, 0, wall_ns=0, mono_ns=0)
    peer_bytes = head + payload + b"\x00" * 64  # a self-consistent frame inside the peer's metadata
    directory = tmp_path / "log"
    with FileSink(directory, fsync=FsyncPolicy.always()) as sink:
        sink.write(_rows(0, 5))
        assert sink.wait_acked(4, timeout=5)
        sink.write([_handshake_row(5, peer_bytes)])
    (seg,) = segment_paths(directory)
    data = seg.read_bytes()
    assert data.find(head) > 0
    seg.write_bytes(data[:-3])  # the last record cut short: what a torn write leaves
    with pytest.raises(TornTailError):
        read_log(directory)
    rec = recover(directory)
    assert rec.next_seq == 5 and read_log(directory) == _records(0, 5)


def test_shutdown_after_a_log_write_failure_still_stops_the_transport(tmp_path: Path) -> None:
    """A durable log whose writer hit a full disk while a decode read ran (found by review):
    shutdown() raised LogWriteError before closing the transport, so the read went on writing
    blocks the embedder was about to free. It still raises (nothing can be reported), and the
    transport is closed first: the read is cancelled, the Connector closed."""
    from helpers import reply

    from pdfsm.connector import Connector
    from pdfsm.errors import ConnectorClosed
    from pdfsm.filesink import FileSink, FsyncPolicy
    from pdfsm.log import EventLog
    from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport

    net, now = SimNetwork(), [10**9]

    def clock() -> int:
        return now[0]

    pt = SimTransport(net, "P-0")
    pt.fill(range(64))
    p = Connector(CoreConfig(engine_id="P", compat_hash="h"), pt, SimHandshaker(net), clock=clock,
                  wall_clock=clock, port=9)
    net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(pt.rank_info(),)))
    sink = FileSink(tmp_path / "d", fsync=FsyncPolicy.never())
    dt = SimTransport(net, "D-0")
    d = Connector(CoreConfig(engine_id="D", compat_hash="h"), dt, SimHandshaker(net), clock=clock,
                  wall_clock=clock, log=EventLog(sink=sink))
    net.script("d1", 0, 0, ReadScript(polls=1000))
    d.load("d1", [5, 6], p.request_finished("p1", [1, 2]))
    for _ in range(3):
        now[0] += 1000
        d.step()
    assert dt.reads
    sink._error = OSError(errno.ENOSPC, "No space left on device")  # the writer thread's failure
    with pytest.raises(LogWriteError):
        d.shutdown()
    assert not dt.reads and "D-0" in net.dead  # closed: the read cancelled, the agent gone
    with pytest.raises(ConnectorClosed):
        d.get_finished()
    assert d.core.log._closed  # and the log with it (found by review: it stayed open)


def test_shutdown_whose_last_step_cannot_write_the_log_is_closed_all_the_same() -> None:
    """The sink fails only once the transport has closed (a file log's writer finding the disk full
    then), so shutdown's last step raises. The Connector was left open: later calls were accepted
    (``request_finished`` minted params on a closed transport), and the log and its sink were never
    closed (found by a helper's hunt). It still raises, and everything is closed."""
    from helpers import LeaseWorld

    from pdfsm.errors import ConnectorClosed
    from pdfsm.log import MemorySink
    from transports.sim import ReadScript, SimTransport

    class Sink(MemorySink):
        closed = False
        transport: SimTransport | None = None

        def write(self, rows: Sequence[Record]) -> None:
            if self.transport is not None and self.transport.closed:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(rows)

        def close(self) -> None:
            self.closed = True

    sink = Sink()
    w = LeaseWorld(d_log=EventLog(sink=sink))
    sink.transport = w.cons
    w.net.script("d1", 0, 0, ReadScript(polls=1000))
    w.net.script("d0", 0, 0, ReadScript(end="err"))
    d = w.d
    d.load("d1", [5, 6], w.p.request_finished("p1", [1, 2]))
    d.load("d0", [8], w.p.request_finished("p0", [3]))
    for _ in range(6):
        w.now += 1000
        if "d0" in d.get_finished()[1]:
            break
    assert [f.request_id for f in d.last.failed] == ["d0"] and d.get_block_ids_with_load_errors() == {8}
    assert not d.get_block_ids_with_load_errors()  # taken
    with pytest.raises(OSError):
        d.shutdown()
    assert sink.closed
    for call in (d.get_finished, lambda: d.request_finished("x", [7])):
        with pytest.raises(ConnectorClosed):
            call()
    # The report before shutdown is not handed out again as shutdown's: its blocks went back already.
    assert not d.get_block_ids_with_load_errors() and not d.shutdown().failed


def test_a_full_disk_at_open_raises_log_write_error_and_leaves_no_stray_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a log on a full disk used to raise a bare OSError and leave the first segment's
    ``.tmp`` header behind (a helper's hunt with RLIMIT_FSIZE): now LogWriteError naming the
    directory, the OS error as its cause, no stray file, and the lock let go."""
    directory = tmp_path / "log"

    def enospc(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", enospc)
    monkeypatch.setattr(os, "writev", enospc)
    with pytest.raises(LogWriteError, match=r"cannot open the log: .*No space left") as caught:
        FileSink(directory, fsync=FsyncPolicy.always())
    assert caught.value.path == str(directory) and isinstance(caught.value.__cause__, OSError)
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    sink = FileSink(directory, fsync=FsyncPolicy.always())  # the lock was let go
    sink.write(_rows(0, 3))
    sink.close()
    assert read_log(directory) == _records(0, 3)
