"""The durable log file: format, recovery, writer, schema evolution (docs/log-format.md)."""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import pytest
from filelog_writer import row as writer_row
from helpers import child_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from make_golden import MONO_NS, SALT, WALL_NS, golden_rows

from pdfsm import filelog
from pdfsm.core import Core
from pdfsm.events import Collect, CoreConfig, HandleDone, HandleFailed, HandleFailure, ReadRequested, Tick
from pdfsm.filelog import (
    FORMAT_VERSION,
    MAGIC,
    SCHEMA_VERSION,
    CorruptLogError,
    LogError,
    LogReader,
    LogWriteError,
    TornTailError,
    UnsupportedVersionError,
    crc32c,
    encode_frame,
    encode_header,
    read_header,
    read_log,
    recover,
    segment_paths,
    upcast,
    write_segment,
)
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.log import EventLog, Outcome, Overflow, Record
from pdfsm.replay import QuietLogger

TESTS = Path(__file__).parent
GOLDEN = TESTS / "golden"
ROOT = TESTS.parent


class Seg(msgspec.Struct, frozen=True):
    """A single-segment log of the golden rows, four records per frame (the last frame: one)."""

    data: bytes
    header_size: int
    frames: list[tuple[int, int]]  # (offset, end) of every frame
    records: list[Record]


def _layout(path: Path) -> tuple[int, list[tuple[int, int]]]:
    reader = LogReader(path)
    frames = [(fr.offset, fr.end) for _, fr in reader.frames()]
    return reader.headers[0].size, frames


@pytest.fixture(scope="module")
def rows() -> list[Record]:
    return golden_rows()


@pytest.fixture(scope="module")
def seg(rows: list[Record], tmp_path_factory: pytest.TempPathFactory) -> Seg:
    path = tmp_path_factory.mktemp("seg") / "log.pdlog"
    write_segment(path, rows, salt=SALT, meta={"engine_id": "t"}, wall_ns=WALL_NS, mono_ns=MONO_NS,
                  batch_records=4)
    header_size, frames = _layout(path)
    assert len(rows) % 4 == 1 and frames[-1][1] - frames[-1][0] < 400  # the last frame is one record
    return Seg(path.read_bytes(), header_size, frames, list(rows))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scratch")


def _frame_of(seg: Seg, byte: int) -> int:
    """Index of the frame holding ``byte``; -1 for the header."""
    if byte < seg.header_size:
        return -1
    return next(i for i, (a, b) in enumerate(seg.frames) if a <= byte < b)


def _offset_of(seg: Seg, unit: int) -> int:
    return 0 if unit < 0 else seg.frames[unit][0]


def _records_before(seg: Seg, unit: int) -> list[Record]:
    return seg.records[: 4 * max(unit, 0)]


def _expect_damage(seg: Seg, path: Path, damaged_bytes: set[int]) -> None:
    """Reading fails at the first damaged frame: torn if no intact frame follows, else corrupt.

    Recovery then truncates a torn tail (keeping a copy) or refuses corruption, changing nothing."""
    data = path.read_bytes()
    units = sorted({_frame_of(seg, b) for b in damaged_bytes})
    first = units[0]
    if data[:8] == MAGIC and struct.unpack_from("<H", data, 8)[0] > FORMAT_VERSION:
        with pytest.raises(UnsupportedVersionError):
            read_log(path)
        return
    intact_after = any(i not in units for i in range(first + 1, len(seg.frames)))
    offset = _offset_of(seg, first)
    if intact_after:
        with pytest.raises(CorruptLogError) as corrupt:
            read_log(path)
        assert corrupt.value.offset == offset, corrupt.value
        assert str(path) in str(corrupt.value) and f"at byte {offset}" in str(corrupt.value)
        with pytest.raises(CorruptLogError):
            recover(path)
        assert path.read_bytes() == data  # never silently truncated
        return
    with pytest.raises(TornTailError) as torn:
        read_log(path)
    assert torn.value.offset == offset, torn.value
    report = recover(path)
    (repair,) = report.repairs
    assert Path(repair.backup).read_bytes() == data  # the damaged file is kept as it was
    Path(repair.backup).unlink()
    if first < 0:
        assert not path.exists()
        return
    assert repair.offset == offset and repair.removed_bytes == len(data) - offset
    assert path.read_bytes() == data[:offset]
    assert read_log(path) == _records_before(seg, first)
    assert report.next_seq == 4 * first


# --- torn tails and corruption ----------------------------------------------------------------------


def test_truncation_at_every_byte_of_the_last_record_is_a_torn_tail(seg: Seg, tmp_path: Path) -> None:
    path = tmp_path / "log.pdlog"
    last, end = seg.frames[-1]
    good = seg.records[:-1]
    assert end == len(seg.data)
    for cut in range(last + 1, end):
        path.write_bytes(seg.data[:cut])
        with pytest.raises(TornTailError) as torn:
            read_log(path)
        assert torn.value.offset == last
        stopped = LogReader(path, on_torn_tail="stop")
        assert list(stopped) == good and stopped.torn is not None
        assert path.stat().st_size == cut  # "stop" leaves the file alone
        report = recover(path)
        (repair,) = report.repairs
        assert (repair.offset, repair.removed_bytes) == (last, cut - last)
        assert Path(repair.backup).read_bytes() == seg.data[:cut]
        Path(repair.backup).unlink()
        assert read_log(path) == good and report.next_seq == len(good)
    path.write_bytes(seg.data[:last])  # cut at a frame boundary: a clean, shorter log
    assert read_log(path) == good and recover(path).repairs == ()
    path.write_bytes(seg.data)
    assert read_log(path) == seg.records


@settings(derandomize=True, max_examples=250, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_bit_flips_are_all_detected(seg: Seg, scratch: Path, data: st.DataObject) -> None:
    bits = data.draw(st.lists(st.integers(0, 8 * len(seg.data) - 1), min_size=1, max_size=3, unique=True))
    mutated = bytearray(seg.data)
    for bit in bits:
        mutated[bit // 8] ^= 1 << (bit % 8)
    path = scratch / "flipped.pdlog"
    path.write_bytes(mutated)
    _expect_damage(seg, path, {bit // 8 for bit in bits})


@pytest.mark.parametrize("frame", [3, -1])
def test_every_single_bit_flip_in_a_frame_header_is_detected(seg: Seg, tmp_path: Path, frame: int) -> None:
    path = tmp_path / "log.pdlog"
    start = seg.frames[frame][0]
    for bit in range(start * 8, (start + 48) * 8):
        mutated = bytearray(seg.data)
        mutated[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(mutated)
        _expect_damage(seg, path, {bit // 8})


def test_zeroed_sector_at_the_tail_is_torn(seg: Seg, tmp_path: Path) -> None:
    path = tmp_path / "log.pdlog"
    start = len(seg.data) - 512
    path.write_bytes(seg.data[:start] + bytes(512))
    _expect_damage(seg, path, set(range(start, len(seg.data))))
    assert read_log(path) == _records_before(seg, _frame_of(seg, start))


def test_zeroed_sector_in_the_middle_is_corruption_with_its_offset(seg: Seg, tmp_path: Path) -> None:
    path = tmp_path / "log.pdlog"
    start = 1024  # sector-aligned, past the header, with intact frames after it
    path.write_bytes(seg.data[:start] + bytes(512) + seg.data[start + 512:])
    _expect_damage(seg, path, set(range(start, start + 512)))
    with pytest.raises(CorruptLogError) as err:
        read_log(path)
    assert err.value.offset == seg.frames[_frame_of(seg, start)][0]


def test_huge_length_prefix_fails_fast_without_allocating(seg: Seg, tmp_path: Path) -> None:
    path = tmp_path / "log.pdlog"
    off = seg.frames[3][0]
    for length in (0xFFFFFFFF, 1 << 30, len(seg.data)):
        mutated = bytearray(seg.data)
        struct.pack_into("<I", mutated, off + 8, length)
        path.write_bytes(mutated)
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            with pytest.raises(CorruptLogError) as err:
                read_log(path)
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert time.perf_counter() - t0 < 1.0
        assert peak < 256 << 10, peak  # nothing near the claimed length was allocated
        assert err.value.offset == off and f"frame length {length} exceeds" in err.value.reason
    # the same in the last frame is a torn tail: refused the same way, and recoverable
    mutated = bytearray(seg.data)
    struct.pack_into("<I", mutated, seg.frames[-1][0] + 8, 0xFFFFFFFF)
    path.write_bytes(mutated)
    with pytest.raises(TornTailError):
        read_log(path)


def test_a_frame_over_the_readers_cap_is_refused_never_repaired(seg: Seg, tmp_path: Path) -> None:
    path = tmp_path / "log.pdlog"
    path.write_bytes(seg.data)
    with pytest.raises(LogError, match="over this reader's cap") as err:
        read_log(path, max_frame_bytes=64)
    assert type(err.value) is LogError
    with pytest.raises(LogError, match="over this reader's cap"):
        recover(path, max_frame_bytes=64)
    assert path.read_bytes() == seg.data


def test_huge_header_metadata_length_is_refused(seg: Seg, tmp_path: Path) -> None:
    path = tmp_path / "log.pdlog"
    mutated = bytearray(seg.data)
    struct.pack_into("<I", mutated, 12, 0xFFFFFFFF)
    path.write_bytes(mutated)
    with pytest.raises(CorruptLogError, match="metadata length") as err:
        read_log(path)
    assert err.value.offset == 0


def test_damage_at_the_tail_of_an_earlier_segment_is_corruption(rows: list[Record], tmp_path: Path) -> None:
    log = tmp_path / "log"
    with FileSink(log, fsync=FsyncPolicy.never(), segment_bytes=4096, batch_records=4) as sink:
        for _ in range(3):
            sink.write(_shift(rows, sink))
    paths = segment_paths(log)
    assert len(paths) >= 3
    first = paths[0]
    size = first.stat().st_size
    with open(first, "r+b") as f:
        f.truncate(size - 5)
    with pytest.raises(CorruptLogError, match="later segments follow") as err:
        read_log(log)
    assert err.value.path == str(first)
    recover(log)  # only the last segment is recovered: earlier ones are checked by readers
    with pytest.raises(CorruptLogError):
        read_log(log)


def test_reader_repair_mode_truncates_and_reports(seg: Seg, tmp_path: Path) -> None:
    path = tmp_path / "log.pdlog"
    path.write_bytes(seg.data[:-3])
    reader = LogReader(path, on_torn_tail="repair")
    assert list(reader) == seg.records[:-1]
    (repair,) = reader.repairs
    assert repair.offset == seg.frames[-1][0] and Path(repair.backup).exists()
    assert read_log(path) == seg.records[:-1]


# --- a real writer, killed -----------------------------------------------------------------------


def _run_until_killed(directory: Path, seed: int, delay: float) -> tuple[int, list[int], str]:
    env = child_env()
    proc = subprocess.Popen([sys.executable, str(TESTS / "filelog_writer.py"), str(directory), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    acked = threading.Event()

    def pump(stream: Any) -> None:
        for line in stream:
            lines.append(line.strip())
            if line.startswith("ack"):
                acked.set()

    reader = threading.Thread(target=pump, args=(proc.stdout,))
    reader.start()
    try:
        assert acked.wait(30), f"the writer acknowledged nothing: {proc.stderr.read() if proc.poll() else ''}"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join()
        stderr = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, stderr
    start = next(int(x.split()[1]) for x in lines if x.startswith("start"))
    acks = [int(x.split()[1]) for x in lines if x.startswith("ack")]
    return start, acks, stderr


def test_kill_9_loop_loses_no_acknowledged_record(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    rng = random.Random(20240521)
    recovered = 0
    for i in range(6):
        start, acks, stderr = _run_until_killed(directory, i, rng.uniform(0.02, 0.4))
        assert start == recovered, stderr  # each writer continued exactly where the log ended
        assert acks == sorted(acks) and acks[0] >= start
        report = recover(directory)
        records = read_log(directory)
        assert [r.seq for r in records] == list(range(len(records)))  # contiguous across segments
        assert acks[-1] < len(records), f"acked {acks[-1]} but only {len(records)} records recovered"
        assert records == [writer_row(s) for s in range(len(records))]
        assert report.next_seq == len(records)
        recovered = len(records)
    assert len(segment_paths(directory)) > 1


# --- schema evolution ----------------------------------------------------------------------------


def _golden_files() -> list[Path]:
    return sorted(GOLDEN.glob("v*.pdlog"))


def test_golden_files_exist_for_every_schema_version() -> None:
    assert [p.stem for p in _golden_files()] == [f"v{v}" for v in range(1, SCHEMA_VERSION + 1)]


@pytest.mark.parametrize("path", _golden_files(), ids=lambda p: p.name)
def test_golden_file_stays_readable(path: Path) -> None:
    version = int(path.stem[1:])
    raw = msgspec.json.decode(path.with_suffix(".json").read_bytes())  # the records as that version wrote them
    expected = msgspec.convert(upcast(raw, version), list[Record])
    reader = LogReader(path)
    assert list(reader) == expected
    assert {fr.schema for _, fr in reader.frames()} == {version}
    assert reader.headers[0].format == 1 and reader.headers[0].meta["engine_id"] == "golden-D"
    assert {type(r.event).__name__ for r in expected} >= {"Started", "ReadRequested", "HandshakeDone", "Dropped"}


def test_upcaster_chain_is_applied_in_order_and_is_pure() -> None:
    chain = {1: lambda r: [*r, "added in 2"], 2: lambda r: [x.upper() if isinstance(x, str) else x for x in r]}
    rows = [[0, "a"], [1, "b"]]
    assert upcast(rows, 1, chain=chain, current=3) == [[0, "A", "ADDED IN 2"], [1, "B", "ADDED IN 2"]]
    assert upcast(rows, 2, chain=chain, current=3) == [[0, "A"], [1, "B"]]
    assert upcast(rows, 3, chain=chain, current=3) == rows == [[0, "a"], [1, "b"]]
    with pytest.raises(ValueError, match="newer"):
        upcast(rows, 4, chain=chain, current=3)
    with pytest.raises(ValueError, match="no upcaster from schema version 0"):
        upcast(rows, 0, chain=chain, current=3)


def test_reader_upcasts_an_old_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """What adding a schema looks like: one pure function; v1 and v2 files read as v3 records,
    v1 through both upcasters in order."""

    def v2_to_v3(row: list[Any]) -> list[Any]:
        return [*row[:6], row[6] or "(no reason)", *row[7:]]

    current = filelog.SCHEMA_VERSION
    monkeypatch.setattr(filelog, "SCHEMA_VERSION", current + 1)
    monkeypatch.setitem(filelog.UPCASTERS, current, v2_to_v3)
    for path in _golden_files():
        raw = msgspec.json.decode(path.with_suffix(".json").read_bytes())
        expected = msgspec.convert(upcast(raw, int(path.stem[1:]), current=current), list[Record])
        got = read_log(path)
        assert got == [msgspec.structs.replace(r, reason=r.reason or "(no reason)") for r in expected]
    monkeypatch.delitem(filelog.UPCASTERS, current)
    with pytest.raises(UnsupportedVersionError, match="no upcaster"):
        read_log(GOLDEN / "v1.pdlog")


def test_schema_1_event_maps_become_arrays() -> None:
    """Schema 2 writes each event as an array (its class, then its fields, base class first);
    schema 1 wrote a map. The upcaster fills a default the map lacks, leaves a missing required
    field for the decoder to name, and leaves an unknown class for the decoder to refuse."""
    ev = HandleFailed(source="x", t_ns=1, request_id="r", pp_rank=0, tp_rank=1, why=HandleFailure.ERR, detail="d")
    v1 = {"type": "HandleFailed", "source": "x", "t_ns": 1, "request_id": "r", "pp_rank": 0, "tp_rank": 1,
          "why": "err", "detail": "d"}
    row = [0, v1, "consumer", "READING", "FAILING", 0, "", None, None]
    decode = msgspec.msgpack.Decoder(list[Record]).decode
    assert decode(msgspec.msgpack.encode(upcast([row], 1))) == [Record(0, ev, "consumer", "READING", "FAILING",
                                                                        Outcome.APPLIED)]
    assert upcast([row], 1)[0][1] == msgspec.msgpack.decode(msgspec.msgpack.encode(ev))
    del v1["detail"]  # a field with a default: filled
    assert decode(msgspec.msgpack.encode(upcast([row], 1)))[0].event == msgspec.structs.replace(ev, detail="")
    del v1["request_id"]  # required: named by the decoder
    with pytest.raises(msgspec.ValidationError, match="at least"):
        decode(msgspec.msgpack.encode(upcast([row], 1)))
    unknown = [0, {"type": "FromTheFuture", "source": "x", "t_ns": 1}, "core", "-", "-", 0, "", None, None]
    with pytest.raises(msgspec.ValidationError, match="FromTheFuture"):
        decode(msgspec.msgpack.encode(upcast([unknown], 1)))


def test_future_schema_and_format_versions_are_refused(rows: list[Record], tmp_path: Path) -> None:
    path = tmp_path / "future.pdlog"
    header, prev = encode_header(0, SALT, {})
    payload = msgspec.msgpack.encode(rows[:2])
    head, _ = encode_frame(payload, 2, 0, prev, wall_ns=1, mono_ns=1, schema=SCHEMA_VERSION + 1)
    path.write_bytes(header + head + payload)
    with pytest.raises(UnsupportedVersionError, match="upgrade pdfsm"):
        read_log(path)
    data = bytearray((GOLDEN / "v1.pdlog").read_bytes())
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 1)
    path.write_bytes(data)
    with pytest.raises(UnsupportedVersionError, match="format version 2"):
        read_log(path)
    with pytest.raises(UnsupportedVersionError):
        recover(path)


def test_an_event_field_added_later_stays_readable() -> None:
    """Events are arrays whose fields keep their places: a field added with a default at the end
    of a leaf class is ignored by an older reader and filled by a newer one, no schema bump."""
    ev = HandleDone(source="x", t_ns=1, request_id="r", pp_rank=0, tp_rank=1)
    row = Record(0, ev, "consumer", "READING", "NOTIFIED", Outcome.APPLIED)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode([row]))
    assert raw[0][1] == ["HandleDone", "x", 1, "r", 0, 1]
    decode = msgspec.msgpack.Decoder(list[Record]).decode
    raw[0][1].append(42)  # a newer writer's trailing optional field
    assert decode(msgspec.msgpack.encode(raw)) == [row]
    del raw[0][1][-2:]  # an older writer's array, short of a required field: named, never guessed
    with pytest.raises(msgspec.ValidationError, match="at least"):
        decode(msgspec.msgpack.encode(raw))


# --- the writer ----------------------------------------------------------------------------------


def _shift(rows: list[Record], sink: FileSink) -> list[Record]:
    """``rows`` renumbered to continue what ``sink`` has been handed."""
    start = sink._next_in
    return [msgspec.structs.replace(r, seq=start + i) for i, r in enumerate(rows)]


def _quiet_core(log: EventLog, engine_id: str = "D") -> Core:
    return Core(CoreConfig(engine_id=engine_id), log, logger=QuietLogger())


def _lifecycles(core: Core, n: int) -> None:
    for i in range(n):
        core.submit(ReadRequested(source="scheduler", t_ns=10 * i, request_id=f"r{i}", remote_request_id=f"p{i}",
                                  engine_id="P", local_blocks=(i, i + 1), remote_blocks=(i, i + 1)))
        core.submit(HandleDone(source="xfer-0", t_ns=10 * i + 1, request_id=f"r{i}", pp_rank=0, tp_rank=0))
        core.submit(Collect(source="scheduler", t_ns=10 * i + 2, step=i))
        core.pump()


def test_round_trip_through_event_log_and_core(tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "log", fsync=FsyncPolicy.always(), metadata={"engine_id": "D"})
    log = EventLog(sink=sink)
    core = _quiet_core(log)
    _lifecycles(core, 20)
    core.apply(Tick(source="timer", t_ns=1_000))
    log.close()
    expected = list(log.window)
    assert read_log(tmp_path / "log") == expected == log.records()
    assert sink.acked_seq == sink.written_seq == expected[-1].seq
    (header_path,) = segment_paths(tmp_path / "log")
    assert read_header(header_path).meta["engine_id"] == "D"


def test_rotation_keeps_sequence_contiguous_across_segments(rows: list[Record], tmp_path: Path) -> None:
    directory = tmp_path / "log"
    sent: list[Record] = []
    with FileSink(directory, fsync=FsyncPolicy.every(5), segment_bytes=4096, batch_records=16) as sink:
        for _ in range(60):
            batch = _shift(rows, sink)
            sink.write(batch)
            sent += batch
    paths = segment_paths(directory)
    assert len(paths) > 20 and all(p.stat().st_size < 4096 + 16 * 400 for p in paths)
    starts = [read_header(p).start_seq for p in paths]
    assert starts == sorted(starts) and starts[0] == 0
    assert read_log(directory) == sent


def test_retention_deletes_the_oldest_segments(rows: list[Record], tmp_path: Path) -> None:
    directory = tmp_path / "log"
    sent: list[Record] = []
    with FileSink(directory, fsync=FsyncPolicy.never(), segment_bytes=4096, keep_segments=3) as sink:
        for _ in range(40):
            batch = _shift(rows, sink)
            sink.write(batch)
            sent += batch
    assert len(segment_paths(directory)) == 3 and sink.segments_deleted > 0
    got = read_log(directory)
    assert got and got[0].seq > 0 and got == sent[got[0].seq:]


def test_reopening_continues_the_sequence_and_refuses_a_restart(rows: list[Record], tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with FileSink(directory) as sink:
        sink.write(rows)
    again = FileSink(directory)
    assert again.recovery.next_seq == len(rows) and again.acked_seq == len(rows) - 1
    with pytest.raises(LogWriteError, match=f"do not continue the log at seq {len(rows)}"):
        again.write(rows)  # an EventLog restarting at 0 needs a new directory
    more = _shift(rows, again)
    again.write(more)
    again.close()
    assert read_log(directory) == [*rows, *more]


def _eventually(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _stall(sink: FileSink) -> threading.Event:
    """Make the writer thread wait inside its next write until the returned event is set."""
    go, real = threading.Event(), sink._write

    def slow(items: list[Any]) -> None:
        go.wait(10)
        real(items)

    sink._write = slow  # type: ignore[method-assign]
    return go


def test_count_policy_records_the_loss_as_a_gap(rows: list[Record], tmp_path: Path) -> None:
    directory = tmp_path / "log"
    sink = FileSink(directory, queue_rows=len(rows), overflow=Overflow.COUNT)
    go = _stall(sink)
    a = _shift(rows, sink)
    sink.write(a)  # taken by the writer, which stalls
    _eventually(lambda: not sink.queued)
    b = _shift(rows, sink)
    sink.write(b)  # queued: the queue is now full
    c = _shift(rows, sink)[:5]
    sink.write(c)  # refused and counted
    d = _shift(rows[:3], sink)
    sink.write(d)  # refused too: one gap covers both
    go.set()
    sink.close()
    assert sink.lost == len(c) + len(d)
    reader = LogReader(directory)
    got = list(reader)
    assert got == [*a, *b]
    (gap,) = reader.gaps
    assert (gap.first_seq, gap.count) == (c[0].seq, len(c) + len(d)) and "queue full" in gap.reason
    assert reader.next_seq == d[-1].seq + 1


def test_block_policy_waits_for_room(rows: list[Record], tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "log", queue_rows=len(rows), overflow=Overflow.BLOCK)
    go = _stall(sink)
    batches = [_shift(rows, sink)]
    sink.write(batches[0])
    _eventually(lambda: not sink.queued)
    batches.append(_shift(rows, sink))
    sink.write(batches[1])
    batches.append(_shift(rows, sink))
    done = threading.Event()

    def third() -> None:
        sink.write(batches[2])
        done.set()

    blocked = threading.Thread(target=third)
    blocked.start()
    assert not done.wait(0.2)  # the owner waits: nothing is dropped
    go.set()
    assert done.wait(5)
    blocked.join()
    sink.close()
    assert sink.lost == 0
    assert read_log(tmp_path / "log") == [r for b in batches for r in b]


def test_acknowledgement_follows_the_fsync_policy(rows: list[Record], tmp_path: Path) -> None:
    always = FileSink(tmp_path / "always", fsync=FsyncPolicy.always())
    always.write(rows)
    assert always.wait_acked(len(rows) - 1, timeout=5)
    always.close()

    every = FileSink(tmp_path / "every", fsync=FsyncPolicy.every(20))
    every.write(rows)
    assert every.wait_acked(len(rows) - 1, timeout=5)  # within about 20 ms, without a close
    every.close()

    acks: list[int] = []
    never = FileSink(tmp_path / "never", fsync=FsyncPolicy.never(), on_ack=acks.append)
    never.write(rows)
    _eventually(lambda: never.written_seq == len(rows) - 1)
    assert not never.wait_acked(len(rows) - 1, timeout=0.1)
    assert never.acked_seq == -1  # written, not durable
    assert never.sync(timeout=5) and acks == [len(rows) - 1]
    more = _shift(rows, never)
    never.write(more)
    never.close()  # close flushes and fsyncs
    assert never.acked_seq == more[-1].seq and acks[-1] == more[-1].seq
    with pytest.raises(ValueError):
        FsyncPolicy.every(0)


def test_wait_written_puts_rows_in_the_file_before_any_fsync(rows: list[Record], tmp_path: Path) -> None:
    """Write-ahead against a process crash: after wait_written a reader of the directory sees
    every row handed over, with no fsync (policy never) and the sink still open."""
    sink = FileSink(tmp_path / "log", fsync=FsyncPolicy.never())
    sink.write(rows[:5])
    assert sink.wait_written(timeout=5)
    assert sink.acked_seq == -1 and sink.written_seq == 4
    assert [r.seq for r in read_log(tmp_path / "log", on_torn_tail="stop")] == [0, 1, 2, 3, 4]
    sink.close()


def test_writer_failure_is_raised_on_the_owner_thread(rows: list[Record], tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "log")

    def fail(items: list[Any]) -> None:
        raise OSError(28, "No space left on device")

    sink._write = fail  # type: ignore[method-assign]
    sink.write(rows)
    with pytest.raises(LogWriteError, match="No space left"):
        sink.close()
    with pytest.raises(LogWriteError, match="No space left"):
        sink.write(_shift(rows, sink))
    with pytest.raises(LogWriteError, match="No space left"):
        sink.wait_acked(0, timeout=1)


def test_an_oversized_record_becomes_a_gap_not_a_crash(rows: list[Record], tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "log", max_frame_bytes=300, batch_records=8)
    sink.write(rows)
    sink.close()
    reader = LogReader(tmp_path / "log", max_frame_bytes=300)
    got = list(reader)
    lost = {s for g in reader.gaps for s in range(g.first_seq, g.first_seq + g.count)}
    assert lost and all("over the frame cap" in g.reason for g in reader.gaps)
    assert [r.seq for r in got] == [s for s in range(len(rows)) if s not in lost]
    assert got == [r for r in rows if r.seq not in lost]


def test_interrupted_rotation_leaves_no_half_segment(rows: list[Record], tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with FileSink(directory) as sink:
        sink.write(rows)
    stale = directory / "00000000000000000099.pdlog.tmp"
    stale.write_bytes(b"PDFSM")  # a crash between creating and renaming the next segment
    report = recover(directory)
    assert report.removed_temp == (str(stale),) and not stale.exists()
    assert read_log(directory) == rows


# --- CRC -----------------------------------------------------------------------------------------


def test_crc32c_matches_the_pure_fallback() -> None:
    assert crc32c(b"123456789") == 0xE3069283 == filelog._crc32c_pure(b"123456789")
    rng = random.Random(3)
    for n in (0, 1, 7, 64, 1000):
        data = rng.randbytes(n)
        seed = rng.getrandbits(32)
        assert crc32c(data, seed) == filelog._crc32c_pure(data, seed)
        assert crc32c(data[n // 2:], crc32c(data[: n // 2])) == crc32c(data)



def test_damage_over_a_gap_frame_with_intact_frames_after_it_is_corruption_and_nothing_is_cut(
        tmp_path: Path) -> None:
    """reliability.md: damage followed by good records is corruption, never silently truncated.
    Frame A (seqs 0-9), a gap frame G (5000 records lost), then B and C intact and chained; garbage
    over A from its CRC to the end of G. A later frame counted as evidence only if its seq was
    within the damaged bytes' count of A's, so B (seq 5010) was not, the damage read as a torn
    tail, and recovery cut B and C, acknowledged records (found by a helper's audit)."""
    enc = msgspec.msgpack.Encoder().encode

    def rows(a: int, b: int) -> bytes:
        return enc([(s, Tick(source="timer", t_ns=s), "core", "-", "-", 0, "", None, None) for s in range(a, b)])

    head, prev = encode_header(0, SALT, {"worker": "w"})
    parts, offsets = [head], {}
    for name, payload, count, base, flags in (("A", rows(0, 10), 10, 0, 0),
                                              ("G", enc({"reason": "queue full"}), 5000, 10, filelog.FLAG_GAP),
                                              ("B", rows(5010, 5020), 10, 5010, 0),
                                              ("C", rows(5020, 5030), 10, 5020, 0)):
        offsets[name] = sum(map(len, parts))
        frame, prev = encode_frame(payload, count, base, prev, wall_ns=1, mono_ns=1, flags=flags)
        parts += [frame, payload]
    data = bytearray(b"".join(parts))
    rnd = random.Random(7)
    start, end = offsets["A"] + 4, offsets["B"]
    data[start:end] = bytes(rnd.randrange(256) for _ in range(end - start))
    data[offsets["A"] + 8:offsets["A"] + 12] = (0xFFFFFF00).to_bytes(4, "little")  # a length past the file
    path = tmp_path / filelog.segment_name(0)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError, match="a valid frame follows"):
        read_log(path)
    with pytest.raises(CorruptLogError):
        recover(tmp_path)
    assert path.read_bytes() == bytes(data)  # nothing cut


def test_the_real_upcasters_leave_their_input_alone() -> None:
    """reliability.md: upcasters are pure. Schema 2 to 3 added ``idle_engine_ns`` to the caller's
    own config dict, and from schema 1 the dict was shared with its input (found by a helper's
    audit): a tool upcasting the same raw rows twice, or keeping them, saw them change."""
    import copy

    for path in _golden_files():
        version = int(path.stem[1:])
        if version == filelog.SCHEMA_VERSION:
            continue
        raw = msgspec.json.decode(path.with_suffix(".json").read_bytes())
        before = copy.deepcopy(raw)
        upcast(raw, version)
        assert raw == before, path.name


@pytest.mark.parametrize("name", ["\u00b2.pdlog", "\u0663.pdlog"])
def test_a_file_named_with_non_ascii_digits_is_no_segment(name: str, tmp_path: Path) -> None:
    """docs/log-format.md: other names in a log directory are ignored. "².pdlog" crashed the CLI
    and FileSink (int() refuses what str.isdigit() takes) and "٣.pdlog" was taken as segment 3,
    so the log read as corrupt (found by a helper's audit)."""
    sink = FileSink(tmp_path)
    sink.write([writer_row(0)])
    sink.close()
    (tmp_path / name).write_bytes(b"notes")
    assert filelog.segment_start(name) is None
    assert [r.seq for r in read_log(tmp_path)] == [0]
    FileSink(tmp_path).close()


@pytest.mark.parametrize("fifo", ["segment", "lock"])
def test_a_fifo_in_a_log_directory_is_refused_never_waited_on(fifo: str, tmp_path: Path) -> None:
    """A FIFO named like a segment, or as the writer's lock, blocked read_log, recover, FileSink
    and ``pdfsm replay --repair`` forever on open (found by a helper's audit). Refused, typed;
    a lock that is no regular file never lets a repair cut anything."""
    sink = FileSink(tmp_path)
    sink.write([writer_row(0)])
    sink.close()
    if fifo == "segment":
        os.mkfifo(tmp_path / filelog.segment_name(999))
        for call in (lambda: read_log(tmp_path), lambda: recover(tmp_path), lambda: FileSink(tmp_path)):
            with pytest.raises(LogError, match="not a regular file"):
                call()
    else:
        (tmp_path / filelog.LOCK_NAME).unlink()
        os.mkfifo(tmp_path / filelog.LOCK_NAME)
        assert filelog.writer_holds(tmp_path)
        with pytest.raises(LogError, match="not a regular file"):
            FileSink(tmp_path)
        run = subprocess.run([sys.executable, "-m", "pdfsm.cli", "replay", "--repair", str(tmp_path)],
                             check=False, capture_output=True, text=True, timeout=60)
        assert run.returncode == 3 and "Traceback" not in run.stderr, run.stderr  # 3: these rows lack a Started
