"""The durable event log file: byte format, reader, torn-tail recovery and schema evolution.

The writer is :class:`pdfsm.filesink.FileSink`; this module owns everything a
reader needs, so tools that only read logs never import the writer.

Layout (all integers little-endian; docs/log-format.md has the long version)
---------------------------------------------------------------------------

A log is a directory of *segments* named ``<start_seq:020d>.pdlog`` (or one
such file). A segment is a header followed by frames::

    header (36 + M bytes)
      0   8  magic        b"PDFSMLOG"
      8   2  format       u16, FORMAT_VERSION (1)
     10   2  flags        u16, 0 (reserved)
     12   4  meta_len     u32, M <= MAX_META (65536)
     16   8  start_seq    u64, sequence number of the segment's first record
     24   8  salt         8 random bytes, new for every segment
     32   M  meta         msgpack map (engine id, created_ns, pid, ...)
     32+M 4  header_crc   u32, CRC32C of bytes [0, 32+M)

    frame (48 + L bytes): a CRC-protected batch of records (a Kafka record batch)
      0   4  marker       b"PDFB"
      4   4  crc          u32, CRC32C of bytes [8, 48+L) seeded with prev_crc
      8   4  length       u32, L: payload bytes; L <= the reader's cap and <= the bytes left
     12   4  count        u32, records in the payload (a gap frame: records lost)
     16   4  prev_crc     u32, crc of the previous frame; header_crc for the first frame
     20   2  schema       u16, schema version of the payload's rows (SCHEMA_VERSION)
     22   2  flags        u16, bit 0: GAP (records lost before they reached the file)
     24   8  base_seq     u64, seq of the first record; record i has seq base_seq + i
     32   8  wall_ns      i64, time.time_ns() when the frame was written
     40   8  mono_ns      i64, time.monotonic_ns() when the frame was written
     48   L  payload      msgpack array of ``count`` rows; a gap frame: msgpack map {"reason": str}

A row is ``[seq, event, machine, before, state, outcome, reason, fault, cause]``
(a :class:`pdfsm.log.Record` as msgspec encodes it), the event a msgpack array:
its class name, then its fields (schema 1 wrote a map with the class under ``"type"``; an upcaster reads
it). Each record is individually framed by the msgpack array element it is,
starts with its own seq (checked against ``base_seq + i``) and names its event
type; the length, CRC, schema version and write times are
per frame, because a frame is what one ``write`` puts on disk and one fsync
acknowledges. Why frames and not one CRC per record: a per-record header, CRC
call and encode call cost more than encoding the record does in Python; one
``Encoder.encode`` of a whole batch and one CRC over it keep appends within a
small factor of plain msgpack (docs/log-format.md has the figures).

The chain: ``crc`` is seeded with ``prev_crc``, the first frame's with the
header's CRC, which covers the random salt. A frame from another segment, a
reordered or a missing frame breaks the chain even when its own bytes are
intact. ``prev_crc`` is also stored, so a frame can be checked on its own while
scanning for good data after damage.

Recovery rule: the first bad frame of the *last* segment that no valid frame
follows is a torn tail (a crash artefact): :func:`recover` keeps a copy and
truncates to the end of the last good frame. Damage followed by a valid frame,
or damage in any earlier segment, is corruption: :class:`CorruptLogError`
names the file and byte offset, and nothing is truncated.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import stat
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

import msgspec

from pdfsm.errors import PdfsmError
from pdfsm.events import ALL_EVENTS
from pdfsm.log import Record

__all__ = [
    "CRC_IMPL",
    "DEFAULT_MAX_FRAME",
    "FLAG_GAP",
    "FORMAT_VERSION",
    "FRAME",
    "FRAME_MARKER",
    "HEADER_FIXED",
    "MAGIC",
    "MAX_META",
    "SCHEMA_VERSION",
    "SEGMENT_SUFFIX",
    "UPCASTERS",
    "CorruptLogError",
    "Gap",
    "LogError",
    "LogReader",
    "LogWriteError",
    "Recovery",
    "Repair",
    "SegmentHeader",
    "TornTailError",
    "UnsupportedVersionError",
    "Upcaster",
    "crc32c",
    "encode_frame",
    "encode_header",
    "read_header",
    "read_log",
    "recover",
    "segment_name",
    "segment_paths",
    "segment_start",
    "upcast",
    "write_segment",
]

MAGIC: Final = b"PDFSMLOG"
FRAME_MARKER: Final = b"PDFB"
FORMAT_VERSION: Final = 1
SCHEMA_VERSION: Final = 3
HEADER_FIXED: Final = struct.Struct("<8sHHIQ8s")  # magic, format, flags, meta_len, start_seq, salt
FRAME: Final = struct.Struct("<4sIIIIHHQqq")  # marker, crc, length, count, prev_crc, schema, flags, base, wall, mono
_FRAME_TAIL: Final = struct.Struct("<IIIHHQqq")  # FRAME from byte 8: what the crc covers before the payload
_U32: Final = struct.Struct("<I")
MAX_META: Final = 65536
DEFAULT_MAX_FRAME: Final = 64 << 20
FLAG_GAP: Final = 1
SEGMENT_SUFFIX: Final = ".pdlog"
_SCAN_CHUNK: Final = 1 << 20

# --- CRC32C ----------------------------------------------------------------------------------------

Buffer = bytes | bytearray | memoryview


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


def _crc32c_pure(data: Buffer, value: int = 0) -> int:
    """CRC32C (Castagnoli), byte at a time; only used when the ``crc32c`` package is missing."""
    table = _TABLE
    crc = value ^ 0xFFFFFFFF
    for b in bytes(data):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


_TABLE: Final = _crc32c_table()
_crc: Callable[[Buffer, int], int]
try:
    from crc32c import crc32c as _crc_fast

    _crc = _crc_fast
    CRC_IMPL: str = "crc32c"
except ImportError:  # pragma: no cover - the package is a dependency; this keeps old logs readable
    _crc = _crc32c_pure
    CRC_IMPL = "pure-python"


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (``crc32c(b, crc32c(a)) == crc32c(a + b)``)."""
    return _crc(data, value)


# --- errors ----------------------------------------------------------------------------------------


class LogError(PdfsmError):
    """A log file could not be read or written; names the file and, where known, the byte offset."""

    def __init__(self, reason: str, *, path: str | os.PathLike[str], offset: int | None = None) -> None:
        where = str(path) if offset is None else f"{path} at byte {offset}"
        super().__init__(f"{where}: {reason}")
        self.reason = reason
        self.path = str(path)
        self.offset = offset


class CorruptLogError(LogError):
    """Damage that is not a torn tail: good data follows it, or it is in an earlier segment."""


class TornTailError(LogError):
    """The last frame of the last segment is short or damaged: a crash artefact.

    ``offset`` is where the good data ends; :func:`recover` (or a reader with
    ``on_torn_tail="repair"``) keeps a copy and truncates the file there."""


class UnsupportedVersionError(LogError):
    """A format or schema version this reader does not know (a newer writer, or no upcaster)."""


class LogWriteError(LogError):
    """The writer failed, was closed, or was handed rows out of sequence."""


# --- schema evolution ------------------------------------------------------------------------------

Upcaster = Callable[[list[Any]], list[Any]]
"""Turns one decoded row (plain msgpack values) of version v into a row of version v + 1. Pure."""


def _field_order() -> dict[Any, tuple[tuple[str, Any], ...]]:
    """Per event tag, its fields in array order with the plain value of each default
    (``msgspec.NODEFAULT`` for a required one)."""
    order: dict[Any, tuple[tuple[str, Any], ...]] = {}
    for cls in ALL_EVENTS:
        fields = []
        for f in msgspec.structs.fields(cls):
            default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
            fields.append((f.name, default if default is msgspec.NODEFAULT else msgspec.to_builtins(default)))
        order[cls.__struct_config__.tag] = tuple(fields)
    return order


_V2_FIELDS: Final = _field_order()


def _events_as_arrays(row: list[Any]) -> list[Any]:
    """Schema 1 to 2: the event, a map of its fields with its class under ``"type"``, becomes an
    array, its class first, then its fields in declaration order, base class first. A field the
    map lacks gets its default (or stays missing, for the decoder to name); an unknown class
    becomes an array of its name alone, for the decoder to refuse by name.

    It reads the field order off today's classes, which lay events out exactly as schema 2 does
    (the v2 golden file checks it); a schema that changes an event's layout must first freeze
    that order here as data."""
    event = row[1]
    if not isinstance(event, dict):
        return row
    values = [event.get("type")]
    fields = _V2_FIELDS.get(values[0], ())
    for name, default in fields:
        if name in event:
            values.append(event[name])
        elif default is msgspec.NODEFAULT:
            break  # required and absent: the array ends short, and decoding names the field
        else:
            values.append(default)
    return [row[0], values, *row[2:]]


def _engines_never_idled_out(row: list[Any]) -> list[Any]:
    """Schema 2 to 3: ``CoreConfig.idle_engine_ns`` came with schema 3 (connected engines unread
    that long are evicted). A core that wrote schema 2 never evicted a connected engine for
    idleness, so its config replays with 0 (never), not today's default."""
    event = row[1]
    if isinstance(event, list) and len(event) > 3 and event[0] == "Started" and isinstance(event[3], dict):
        # A new row, event and config: an upcaster is pure (it edited the caller's config in place).
        config = {"idle_engine_ns": 0, **event[3]}
        return [row[0], [*event[:3], config, *event[4:]], *row[2:]]
    return row


UPCASTERS: Final[Mapping[int, Upcaster]] = {1: _events_as_arrays, 2: _engines_never_idled_out}
"""``{v: upcaster from v to v + 1}``. Adding version N + 1 means adding ``UPCASTERS[N]``,
bumping SCHEMA_VERSION and committing tests/golden/v<N+1>.pdlog."""


def upcast(
    rows: list[list[Any]],
    version: int,
    *,
    chain: Mapping[int, Upcaster] = UPCASTERS,
    current: int = SCHEMA_VERSION,
) -> list[list[Any]]:
    """Rows of schema ``version`` as rows of schema ``current``, applying ``chain`` step by step.

    Raises :class:`ValueError` for a version newer than ``current`` or one the chain cannot reach;
    the reader turns that into :class:`UnsupportedVersionError` with the file and offset."""
    if version > current:
        raise ValueError(f"schema version {version} is newer than this reader's {current}")
    while version < current:
        step = chain.get(version)
        if step is None:
            raise ValueError(f"no upcaster from schema version {version} to {version + 1}")
        rows = [step(row) for row in rows]
        version += 1
    return rows


def _reachable(version: int, chain: Mapping[int, Upcaster] = UPCASTERS) -> bool:
    return version >= 1 and all(v in chain for v in range(version, SCHEMA_VERSION))


# --- encoding --------------------------------------------------------------------------------------


class _EventTag(msgspec.Struct, array_like=True):
    tag: str  # an event is an array tagged with its class name; the rest is not decoded


class _TaggedRow(msgspec.Struct, array_like=True):
    seq: int
    event: _EventTag  # the row's other fields are not decoded


_TAGGED_ROWS: Final = msgspec.msgpack.Decoder(list[_TaggedRow])
_TAGGED_ROW: Final = msgspec.msgpack.Decoder(_TaggedRow)
_MIN_RECORD_BYTES: Final = 8  # no encoded record is shorter: an array of 9 with a tagged event


def _unknown_event_types(payload: bytes) -> list[str]:
    """The event type names of a frame's rows that this pdfsm does not know, when every row is a
    record with a tagged event ([] otherwise). Only the tags are decoded: a crafted frame must not
    make this build an object per byte."""
    try:
        rows = _TAGGED_ROWS.decode(payload)
    except (msgspec.MsgspecError, RecursionError):
        return []
    return sorted({row.event.tag for row in rows} - _known_event_names())


def _known_event_names() -> set[str]:
    return {cls.__name__ for cls in ALL_EVENTS}


def _array_len(payload: bytes) -> int | None:
    """The length a msgpack array header at the start of ``payload`` says, or None (no array)."""
    if not payload:
        return None
    b = payload[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(payload) >= 3:
        return int.from_bytes(payload[1:3], "big")
    if b == 0xDD and len(payload) >= 5:
        return int.from_bytes(payload[1:5], "big")
    return None


def _same_writer(first: SegmentHeader, header: SegmentHeader, path: Path) -> None:
    """Every segment of one log names the same worker (when its writer said one) and the same log
    id (FileSink's, random per log): a segment of another log, copied in under a name that fits
    the sequence, is refused. (Each segment's CRC chain starts at its own header, so nothing else
    would tell.)"""
    for key, what in (("worker", "workers"), ("log_id", "logs")):
        was, now = first.meta.get(key), header.meta.get(key)
        if was is not None and now is not None and was != now:
            raise CorruptLogError(f"segment of {key} {now!r} in the log of {key} {was!r}: two {what} "
                                  "mixed", path=path, offset=0)


class SegmentHeader(NamedTuple):
    format: int
    start_seq: int
    salt: bytes
    meta: dict[str, Any]
    size: int  # bytes, header_crc included: where the first frame starts
    crc: int  # header_crc: the seed of the frame chain


def segment_name(start_seq: int) -> str:
    return f"{start_seq:020d}{SEGMENT_SUFFIX}"


def encode_header(start_seq: int, salt: bytes, meta: Mapping[str, Any]) -> tuple[bytes, int]:
    """A segment header and its CRC (the seed of the segment's frame chain)."""
    if len(salt) != 8:
        raise ValueError("salt must be 8 bytes")
    blob = msgspec.msgpack.encode(dict(meta))
    if len(blob) > MAX_META:
        raise ValueError(f"header metadata is {len(blob)} bytes, more than {MAX_META}")
    body = HEADER_FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(blob), start_seq, salt) + blob
    crc = _crc(body, 0)
    return body + _U32.pack(crc), crc


def encode_frame(
    payload: Buffer,
    count: int,
    base_seq: int,
    prev_crc: int,
    *,
    wall_ns: int,
    mono_ns: int,
    flags: int = 0,
    schema: int = SCHEMA_VERSION,
) -> tuple[bytes, int]:
    """The 48-byte frame header for ``payload`` and the frame's CRC (the next frame's prev_crc)."""
    tail = _FRAME_TAIL.pack(len(payload), count, prev_crc, schema, flags, base_seq, wall_ns, mono_ns)
    crc = _crc(payload, _crc(tail, prev_crc))
    return FRAME_MARKER + _U32.pack(crc) + tail, crc


def write_segment(
    path: str | os.PathLike[str],
    rows: Sequence[Record],
    *,
    salt: bytes,
    meta: Mapping[str, Any],
    wall_ns: int,
    mono_ns: int,
    batch_records: int = 256,
    start_seq: int | None = None,
) -> None:
    """Write one complete segment synchronously with fixed salt and times (golden files, tools)."""
    encode = msgspec.msgpack.Encoder().encode
    start = rows[0].seq if rows else (start_seq or 0)
    header, prev = encode_header(start, salt, meta)
    parts = [header]
    for i in range(0, len(rows), batch_records):
        chunk = list(rows[i:i + batch_records])
        payload = encode(chunk)
        head, prev = encode_frame(payload, len(chunk), chunk[0].seq, prev, wall_ns=wall_ns, mono_ns=mono_ns)
        parts += (head, payload)
    with open(path, "wb") as f:
        f.write(b"".join(parts))
        f.flush()
        os.fsync(f.fileno())


# --- reading ---------------------------------------------------------------------------------------


_RECORD: Final = msgspec.msgpack.Decoder(Record)  # one record: a frame salvaged record by record


class Gap(msgspec.Struct, frozen=True):
    """Records the writer could not queue (``Overflow.COUNT``) or encode (over the frame cap, or
    not encodable): the loss, as written in the log."""

    first_seq: int
    count: int
    reason: str
    path: str
    offset: int


class _Frame(NamedTuple):
    offset: int
    n: int  # records in the frame (a gap frame: records lost)
    schema: int
    flags: int
    base_seq: int
    wall_ns: int
    mono_ns: int
    payload: bytes
    end: int


LOCK_NAME: Final = "writer.lock"
"""The file in a log directory that its one live writer holds locked (``flock``)."""


def open_regular(path: Path, flags: int, mode: int = 0o644, *, error: type[LogError] = LogError) -> int:
    """``os.open`` of a log's file, refusing anything but a regular file: a FIFO named like a
    segment or the lock blocked the reader, and the CLI, forever (found by a helper's audit)."""
    fd = os.open(path, flags | os.O_NONBLOCK, mode)  # no effect on a regular file's reads and writes
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error("not a regular file", path=path)
    return fd


def lock_writer(directory: Path) -> int:
    """Take the directory's writer lock; its fd, which holds it until closed (by the kernel, when
    the process dies). A second writer would recover, and append to, a log still being written."""
    fd = open_regular(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, error=LogWriteError)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LogWriteError("another writer holds this log", path=directory) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def writer_holds(path: str | os.PathLike[str]) -> bool:
    """Whether a live writer holds the log (a directory, or a segment file's directory); True also when its
    lock is no regular file (a FIFO): nothing then may be cut on the guess that none writes."""
    p = Path(path)
    lock = (p if p.is_dir() else p.parent) / LOCK_NAME
    try:
        fd = open_regular(lock, os.O_RDONLY)
    except OSError:
        return False
    except LogError:  # a FIFO, say: no writer's lock, but nothing says none writes: never cut on that
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a shared lock taken here
    return False


def segment_start(name: str) -> int | None:
    """The start seq a segment's file name says (:func:`segment_name`), or None: not a segment's."""
    stem = name.removesuffix(SEGMENT_SUFFIX)
    # ASCII digits only: str.isdigit() takes "²" too, which int() refuses (found by a helper's audit)
    return int(stem) if stem != name and stem.isascii() and stem.isdigit() else None


def segment_paths(path: str | os.PathLike[str]) -> list[Path]:
    """One file, or a directory's segments in sequence order (by the start seq in their names)."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    segs = [(start, child) for child in p.iterdir() if (start := segment_start(child.name)) is not None]
    return [c for _, c in sorted(segs)]


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:  # a regular file returns short only at EOF; callers checked the size
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def _parse_header(fd: int, size: int, path: Path) -> SegmentHeader | str:
    """The header, or the reason it is unreadable (damage at offset 0). Raises for future versions."""
    fixed = HEADER_FIXED.size
    if size < fixed + 4:
        head = _pread(fd, min(size, len(MAGIC)), 0)
        if head.count(0) != len(head) and not MAGIC.startswith(head):  # a short note is not a torn log
            raise CorruptLogError("bad magic: not a pdfsm log segment", path=path, offset=0)
        return f"file is {size} bytes, shorter than a segment header"
    raw = _pread(fd, fixed, 0)
    magic, version, _flags, meta_len, start, salt = HEADER_FIXED.unpack(raw)
    if magic != MAGIC:
        # Headers are renamed into place whole, so the only torn header a crash leaves is one
        # that never reached the disk (zeros); anything else is not a log.
        if raw.count(0) == len(raw):
            return "header is zeros: never reached the disk"
        raise CorruptLogError("bad magic: not a pdfsm log segment", path=path, offset=0)
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"log format version {version} is newer than this reader's {FORMAT_VERSION}: upgrade pdfsm",
            path=path, offset=8)
    if version < 1:
        raise CorruptLogError(f"format version {version} was never released", path=path, offset=0)
    if meta_len > MAX_META or fixed + meta_len + 4 > size:
        return f"header metadata length {meta_len} exceeds the cap or the file"
    rest = _pread(fd, meta_len + 4, fixed)
    crc = _U32.unpack_from(rest, meta_len)[0]
    if _crc(rest[:meta_len], _crc(raw, 0)) != crc:
        return "header CRC mismatch"
    try:
        meta = msgspec.msgpack.decode(rest[:meta_len], type=dict[str, Any])
    except (msgspec.MsgspecError, RecursionError) as e:  # deep nesting passes the cap, not the stack
        # The CRC held, so these are the bytes that were written: not a torn write.
        raise CorruptLogError(f"header metadata does not decode: {e}", path=path, offset=fixed) from e
    return SegmentHeader(version, start, salt, meta, fixed + meta_len + 4, crc)


def read_header(path: str | os.PathLike[str]) -> SegmentHeader:
    """A segment's header; raises :class:`CorruptLogError` when it is damaged."""
    p = Path(path)
    fd = open_regular(p, os.O_RDONLY)
    try:
        header = _parse_header(fd, os.fstat(fd).st_size, p)
    finally:
        os.close(fd)
    if isinstance(header, str):
        raise CorruptLogError(header, path=p, offset=0)
    return header


def _check_frame(fd: int, offset: int, size: int, cap: int) -> tuple[tuple[Any, ...], bytes | None] | str:
    """A frame's fields and payload, CRC checked against its own prev_crc, or what is wrong.

    The length is checked against the bytes left and the cap before anything is
    read. A frame longer than the cap is checked in bounded chunks and, if its CRC
    holds, returned with ``None`` for a payload: valid data this reader refuses."""
    if size - offset < FRAME.size:
        return f"{size - offset} bytes left, shorter than a frame header"
    head = _pread(fd, FRAME.size, offset)
    fields = FRAME.unpack(head)
    if fields[0] != FRAME_MARKER:
        return "bad frame marker"
    length, left = fields[2], size - offset - FRAME.size
    if length > left:
        over = f", and the cap of {cap}" if length > cap else ""
        return f"frame length {length} exceeds the {left} bytes left in the file{over}"
    crc = _crc(memoryview(head)[8:], fields[4])
    if length > cap:
        pos, end = offset + FRAME.size, offset + FRAME.size + length
        while pos < end:
            chunk = _pread(fd, min(_SCAN_CHUNK, end - pos), pos)
            crc, pos = _crc(chunk, crc), pos + len(chunk)
        if crc != fields[1]:
            return f"frame length {length} exceeds the cap of {cap} bytes, and its CRC does not match"
        return fields, None
    payload = _pread(fd, length, offset + FRAME.size)
    if _crc(payload, crc) != fields[1]:
        return "CRC mismatch"
    return fields, payload


_SCAN_BUDGET: Final = 256 << 20  # payload bytes CRC-checked while classifying one damage


class _Unclassified(Exception):
    """Too many frame-shaped candidates after a damage to check them all (a hostile file)."""


def _valid_frame_after(fd: int, offset: int, size: int, cap: int, claimed_end: int, link: int | None,
                       seq: int | None, follows: int | None, garbled: bool) -> int | None:
    """The offset of the first self-consistent frame after the damage at ``offset``, if any (bounded
    reads), that is evidence of later data: past the damaged frame's claimed payload (which ends at
    ``claimed_end``), or chained to it (its prev_crc is ``link``), or starting at a seq that could
    follow it: ``follows`` (the damaged frame's seq plus its record count, when its header reads),
    or after ``seq``, the damaged frame's: by at most the bytes between them while the damaged
    header reads as written (``garbled`` False), by any distance once it does not (a gap frame
    stands for any number of records in a few bytes: bounding the next seq by the bytes cut
    intact, acknowledged frames after damage that took a gap frame; found by a helper's audit).

    Each candidate's header is judged before its payload is read and CRC-checked, and the payloads
    checked add up to at most ``_SCAN_BUDGET`` bytes: past it, ``_Unclassified`` (else frame-shaped
    runs each claiming the rest of the file made this quadratic)."""
    spent = 0
    pos = offset + 1
    while pos < size:
        chunk = _pread(fd, min(_SCAN_CHUNK + len(FRAME_MARKER) - 1, size - pos), pos)
        i = chunk.find(FRAME_MARKER)
        while i != -1:
            at = pos + i
            if size - at >= FRAME.size:
                fields = FRAME.unpack(_pread(fd, FRAME.size, at))
                base = fields[7]
                if fields[2] <= size - at - FRAME.size and (
                        at >= claimed_end or fields[4] == link or (follows is not None and base == follows)
                        or (seq is not None and seq < base and (garbled or base <= seq + at - offset))):
                    spent += fields[2]
                    if spent > _SCAN_BUDGET:
                        raise _Unclassified
                    if not isinstance(_check_frame(fd, at, size, cap), str):
                        return at
            i = chunk.find(FRAME_MARKER, i + 1)
        pos += _SCAN_CHUNK
    return None


def _damage(fd: int, path: Path, offset: int, reason: str, *, size: int, cap: int, last: bool,
            seq: int | None = None) -> LogError:
    """Classify damage at ``offset``: a torn tail, or corruption because good data follows it.

    A frame whose header still reads claims a payload, and records carry peers' bytes (a handshake
    reply's metadata): a frame-shaped run of them inside a torn last record must not make it
    corruption. So a frame found inside the claimed payload is evidence of later data only if it
    chains to the damaged frame (the segment's random salt keeps anyone from forging that) or
    starts at a seq that could follow the damaged frame's (``seq``): the real next frame always
    does, whatever of the damaged header was hit. While that header reads as the writer wrote it
    (its seq the expected one, or zeros where a torn header's sector never landed, its length
    within the cap), as a torn last record's does, "could
    follow" is within a few hundred seqs, the bytes between them: a peer would have to guess this
    log's seq that closely, and even then only make a torn tail read as corruption. A header that
    does not read so was itself hit: a gap frame may have gone with it, and any later seq counts.
    Damage whose
    classification would take more than ``_SCAN_BUDGET`` bytes of checking is corruption: never
    cut on a guess."""
    claimed_end, link, follows, garbled = offset + 1, None, None, True
    if size - offset >= FRAME.size:
        fields = FRAME.unpack(_pread(fd, FRAME.size, offset))
        if fields[0] == FRAME_MARKER:
            claimed_end, link = offset + FRAME.size + fields[2], fields[1]
            follows = None if seq is None else seq + fields[3]
            # Zeros read where a sector of a torn header never landed: not the header "hit"
            garbled = fields[2] > cap or fields[7] not in (seq, 0)
    try:
        after = _valid_frame_after(fd, offset, size, cap, claimed_end, link, seq, follows, garbled)
    except _Unclassified:
        return CorruptLogError(f"{reason}; more frame-shaped data follows than can be checked", path=path,
                               offset=offset)
    if after is not None:
        return CorruptLogError(f"{reason}; a valid frame follows at byte {after}", path=path, offset=offset)
    if not last:
        return CorruptLogError(f"{reason}; later segments follow", path=path, offset=offset)
    return TornTailError(f"torn tail: {reason}", path=path, offset=offset)


def _walk(path: Path, *, last: bool, cap: int, expect: int | None,
          first: SegmentHeader | None = None) -> Iterator[SegmentHeader | _Frame]:
    """The header, then every frame of one segment, checked: CRC, chain, sequence, and the same
    writer as the log's ``first`` segment (before the sequence: that names the cause)."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        header = _parse_header(fd, size, path)
        if isinstance(header, str):
            raise _damage(fd, path, 0, header, size=size, cap=cap, last=last)
        if first is not None:
            _same_writer(first, header, path)
        if expect is not None and header.start_seq != expect:
            raise CorruptLogError(f"segment starts at seq {header.start_seq}, expected {expect}: records missing",
                                  path=path, offset=16)
        yield header
        offset, prev, seq = header.size, header.crc, header.start_seq
        while offset < size:
            got = _check_frame(fd, offset, size, cap)
            if isinstance(got, str):
                raise _damage(fd, path, offset, got, size=size, cap=cap, last=last, seq=seq)
            (_m, crc, length, count, prev_crc, schema, flags, base, wall, mono), payload = got
            if payload is None:
                raise LogError(f"frame of {length} bytes is over this reader's cap of {cap} bytes "
                               "(intact: raise max_frame_bytes to read it)", path=path, offset=offset)
            if prev_crc != prev:
                raise CorruptLogError("CRC chain broken: the frame does not follow the one before it",
                                      path=path, offset=offset)
            if base != seq:
                raise CorruptLogError(f"frame starts at seq {base}, expected {seq}", path=path, offset=offset)
            end = offset + FRAME.size + length
            yield _Frame(offset, count, schema, flags, base, wall, mono, payload, end)
            offset, prev, seq = end, crc, seq + count
    finally:
        os.close(fd)


TornTailPolicy = Literal["raise", "repair", "stop"]


class Repair(msgspec.Struct, frozen=True):
    """What recovery did to a torn tail."""

    path: str
    offset: int  # the file now ends here (0: the whole file was moved aside)
    removed_bytes: int
    backup: str  # the damaged file, kept as it was
    reason: str


class Recovery(msgspec.Struct, frozen=True):
    """The outcome of :func:`recover`: where the log ends and what was repaired."""

    path: str
    segments: int
    next_seq: int  # the seq the next record must have
    repairs: tuple[Repair, ...] = ()
    removed_temp: tuple[str, ...] = ()


def _backup_name(path: Path) -> Path:
    n = 0
    while True:
        candidate = path.with_name(f"{path.name}.torn.{n}")
        if not candidate.exists():
            return candidate
        n += 1


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name (a directory: the names in it become durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _repair(err: TornTailError, header_size: int | None) -> Repair:
    """Keep a copy of the damaged file and cut it back to its last good frame (durably)."""
    path = Path(err.path)
    offset = err.offset or 0
    size = path.stat().st_size
    backup = _backup_name(path)
    if header_size is None or offset < header_size:  # not even the header is good: move it aside
        os.replace(path, backup)
        offset = 0
    else:
        shutil.copyfile(path, backup)
        fsync_path(backup)  # the copy is durable before the original is cut
        fsync_path(path.parent)
        with open(path, "r+b") as f:
            f.truncate(offset)
            f.flush()
            os.fsync(f.fileno())
    fsync_path(path.parent)
    return Repair(str(path), offset, size - offset, str(backup), err.reason)


class LogReader:
    """Reads a log (a segment file or a directory of segments) in sequence order.

    Every frame is checked (length cap, CRC, chain, sequence) before its payload
    is decoded into typed :class:`~pdfsm.log.Record` objects. At a torn tail,
    ``on_torn_tail`` decides: ``"raise"`` :class:`TornTailError` (after every
    good record was yielded), ``"repair"`` (keep a copy, truncate, note it in
    :attr:`repairs`) or ``"stop"`` (leave the file alone: a log being written).
    Gaps the writer recorded (``Overflow.COUNT``) are collected in :attr:`gaps`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        on_torn_tail: TornTailPolicy = "raise",
        max_frame_bytes: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.path: Final = Path(path)
        self.on_torn_tail: Final = on_torn_tail
        self.cap: Final = max_frame_bytes
        self.gaps: list[Gap] = []
        self.repairs: list[Repair] = []
        self.torn: TornTailError | None = None
        self.headers: list[SegmentHeader] = []
        self.next_seq: int | None = None  # after reading: the seq the next record would have
        self._decode = msgspec.msgpack.Decoder(list[Record]).decode

    def frames(self) -> Iterator[tuple[Path, _Frame]]:
        """Every frame of every segment, checked but not decoded."""
        paths = segment_paths(self.path)
        if not paths:
            raise LogError("no log segments", path=self.path)
        self.headers, self.next_seq, self.torn = [], None, None
        for i, path in enumerate(paths):
            header_size: int | None = None
            try:
                first = self.headers[0] if self.headers else None
                for item in _walk(path, last=i == len(paths) - 1, cap=self.cap, expect=self.next_seq, first=first):
                    if isinstance(item, SegmentHeader):
                        self.headers.append(item)
                        header_size, self.next_seq = item.size, item.start_seq
                    else:
                        self.next_seq = item.base_seq + item.n
                        yield path, item
            except TornTailError as e:
                if self.on_torn_tail == "raise":
                    raise
                self.torn = e
                if self.on_torn_tail == "repair":
                    _refuse_live(e.path)
                    self.repairs.append(_repair(e, header_size))

    def batches(self) -> Iterator[list[Record]]:
        """The records frame by frame: one decode call per frame (the fast path)."""
        decode, seq_of = self._decode, attrgetter("seq")
        self.gaps = []
        for path, fr in self.frames():
            if fr.flags & FLAG_GAP:
                self.gaps.append(self._gap(path, fr))
                continue
            schema = fr.schema
            if schema > SCHEMA_VERSION or (schema < SCHEMA_VERSION and not _reachable(schema)):
                raise UnsupportedVersionError(
                    f"schema version {schema} cannot be read by this reader (current {SCHEMA_VERSION}"
                    f"{', upgrade pdfsm' if schema > SCHEMA_VERSION else ', no upcaster'})",
                    path=path, offset=fr.offset + 20)
            # Checked before anything is decoded: the frame's own count must not size what we build.
            if _array_len(fr.payload) != fr.n or fr.n * _MIN_RECORD_BYTES > len(fr.payload):
                raise CorruptLogError(f"payload is not an array of the frame's {fr.n} records", path=path,
                                      offset=fr.offset)
            try:
                if schema == SCHEMA_VERSION:
                    recs = decode(fr.payload)
                else:
                    raw = msgspec.msgpack.decode(fr.payload, type=list[list[Any]])
                    try:
                        upcasted = upcast(raw, schema, current=SCHEMA_VERSION)
                    except (IndexError, KeyError, TypeError, ValueError) as e:  # rows of no shape schema N had
                        raise CorruptLogError(f"payload does not decode as schema {schema}: its rows cannot be "
                                              f"upgraded ({type(e).__name__}: {e})", path=path,
                                              offset=fr.offset) from e
                    recs = msgspec.convert(upcasted, list[Record])
            except (msgspec.MsgspecError, RecursionError) as e:
                unknown = _unknown_event_types(fr.payload)
                if unknown:  # intact (its CRC held), written by a pdfsm that knows more events
                    raise UnsupportedVersionError(f"event types {unknown} are unknown to this reader: the log was "
                                                  "written by a newer pdfsm, upgrade pdfsm", path=path,
                                                  offset=fr.offset) from e
                salvaged = self._salvage(path, fr) if schema == SCHEMA_VERSION else None
                if salvaged is None:
                    raise CorruptLogError(f"payload does not decode as schema {schema}: {e}",
                                          path=path, offset=fr.offset) from e
                yield salvaged
                continue
            # The count is checked first: the frame's own count must not size anything we build.
            if len(recs) != fr.n or list(map(seq_of, recs)) != list(range(fr.base_seq, fr.base_seq + fr.n)):
                raise CorruptLogError(f"records do not carry seqs {fr.base_seq}..{fr.base_seq + fr.n - 1}",
                                      path=path, offset=fr.offset)
            yield recs

    def __iter__(self) -> Iterator[Record]:
        for batch in self.batches():
            yield from batch

    def _salvage(self, path: Path, fr: _Frame) -> list[Record] | None:
        """The records of an intact frame (its CRC held) that do not all decode: written so (an
        event built with a field of the wrong type, which msgpack encodes all the same). Each
        record that decodes is kept, each run of those that do not becomes one gap; None when the
        frame is not an array of its ``n`` records in seq order, each at least shaped as one (its
        seq, then an event tagged with a class this pdfsm knows): anything else is corruption, not
        a writer's slip."""
        try:
            raws = msgspec.msgpack.decode(fr.payload, type=list[msgspec.Raw])
        except (msgspec.MsgspecError, RecursionError):
            return None
        if len(raws) != fr.n:
            return None
        known = _known_event_names()
        out: list[Record] = []
        gaps: list[Gap] = []
        for seq, raw in enumerate(raws, fr.base_seq):
            try:
                rec = _RECORD.decode(raw)
            except (msgspec.MsgspecError, RecursionError) as e:
                try:
                    shape = _TAGGED_ROW.decode(raw)
                except (msgspec.MsgspecError, RecursionError):
                    return None
                if shape.seq != seq or shape.event.tag not in known:
                    return None
                last = gaps[-1] if gaps else None
                if last is not None and last.first_seq + last.count == seq:  # one gap per run
                    gaps[-1] = Gap(last.first_seq, last.count + 1, last.reason, last.path, last.offset)
                else:
                    gaps.append(Gap(seq, 1, f"written, but does not decode: {e}", str(path), fr.offset))
                continue
            if rec.seq != seq:
                return None
            out.append(rec)
        self.gaps.extend(gaps)
        return out

    @staticmethod
    def _gap(path: Path, fr: _Frame) -> Gap:
        try:
            info = msgspec.msgpack.decode(fr.payload, type=dict[str, str])
        except msgspec.MsgspecError as e:
            raise CorruptLogError(f"gap frame does not decode: {e}", path=path, offset=fr.offset) from e
        return Gap(fr.base_seq, fr.n, info.get("reason", ""), str(path), fr.offset)


def read_log(
    path: str | os.PathLike[str],
    *,
    on_torn_tail: TornTailPolicy = "raise",
    max_frame_bytes: int = DEFAULT_MAX_FRAME,
) -> list[Record]:
    """Every record of a log, in sequence order (see :class:`LogReader`)."""
    out: list[Record] = []
    for batch in LogReader(path, on_torn_tail=on_torn_tail, max_frame_bytes=max_frame_bytes).batches():
        out += batch
    return out


def _refuse_live(path: str | os.PathLike[str]) -> None:
    """A log a live writer holds has a tail being written, not a torn one: never cut it."""
    if writer_holds(path):
        raise LogWriteError("a live writer holds this log: its last frame is being written, not torn; "
                            "read it with on_torn_tail='stop'", path=Path(path))


def recover(path: str | os.PathLike[str], *, max_frame_bytes: int = DEFAULT_MAX_FRAME,
            writer_locked: bool = False) -> Recovery:
    """Make a log safe to append to after a crash: repair a torn tail, find the next seq.
    A log that a live writer holds is refused (:class:`LogWriteError`) unless the caller is
    that writer (``writer_locked``: it took the lock, as :class:`~pdfsm.filesink.FileSink` does).

    Checks the last segment frame by frame (CRC, chain, sequence; payloads are
    not decoded) and the earlier segments' headers. A torn tail is copied to
    ``<segment>.torn.<n>`` and truncated to the last good frame; a segment whose
    header is torn is moved aside whole. Corruption raises :class:`CorruptLogError`
    and changes nothing. Stale ``*.tmp`` files of an interrupted rotation are removed.
    """
    root = Path(path)
    if not writer_locked:
        _refuse_live(root)
    removed: list[str] = []
    if root.is_dir():
        for tmp in root.glob(f"*{SEGMENT_SUFFIX}.tmp"):
            tmp.unlink()
            removed.append(str(tmp))
    paths = segment_paths(root)
    repairs: list[Repair] = []
    next_seq = 0
    while paths:
        last = paths[-1]
        header_size: int | None = None
        try:
            for item in _walk(last, last=True, cap=max_frame_bytes, expect=None):
                if isinstance(item, SegmentHeader):
                    header_size, next_seq = item.size, item.start_seq
                else:
                    next_seq = item.base_seq + item.n
        except TornTailError as e:
            rep = _repair(e, header_size)
            repairs.append(rep)
            if rep.offset == 0:  # the whole segment was moved aside: the one before is now last
                paths.pop()
                continue
        break
    for prev, nxt in itertools.pairwise(paths):
        a, b = read_header(prev), read_header(nxt)
        if b.start_seq <= a.start_seq:
            raise CorruptLogError(f"segment starts at seq {b.start_seq}, not after {a.start_seq}", path=nxt, offset=16)
    return Recovery(str(root), len(paths), next_seq, tuple(repairs), tuple(removed))
