"""The durable writer of the event log: a :class:`~pdfsm.log.Sink` that writes on its own thread.

The owner thread (the core's) only hands batches over: :meth:`FileSink.write`
checks the sequence, puts the batch on a bounded queue and returns. The writer
thread drains the queue, encodes each run of rows in frames of up to
``batch_records`` records (one ``msgpack`` encode and one CRC per frame; the
format is in :mod:`pdfsm.filelog`), writes everything drained with one
``writev``, fsyncs as the policy says, and rotates to a new segment when the
current one reaches ``segment_bytes``.

Back-pressure (the queue holds at most ``queue_rows`` rows; a batch is always
admitted into an empty queue, so one larger batch still goes through):

- ``Overflow.BLOCK``: ``write`` waits until the writer has drained the queue.
- ``Overflow.COUNT``: the batch is refused, counted in :attr:`FileSink.lost`,
  and a *gap frame* naming the lost seqs and the reason is written in its
  place, so the loss is in the log itself; readers list it in ``gaps``.

Durability (:class:`FsyncPolicy`) and the loss window on a machine crash or
power loss (a process crash, ``kill -9`` included, loses only what was still
queued: the writer hands every drained batch to the kernel at once):

- ``always``: fdatasync after every write (group commit: everything drained
  together shares one fsync). A record is *acknowledged* once fsynced;
  :attr:`FileSink.acked_seq` is the highest acknowledged seq and nothing at
  or below it is lost.
- ``every(ms)``: fdatasync at most ``ms`` after the first unsynced write
  (even when idle). Loss window: about ``ms`` plus one write's time of records.
- ``never``: fsync only at :meth:`FileSink.close` and :meth:`FileSink.sync`
  (not even at rotation; those two fsync every segment created since, and the
  directory). Loss window: everything since the last of those;
  after a machine crash an earlier segment may be torn, which the reader
  reports as corruption.

Under ``always`` and ``every`` a segment is fsynced before the next one is
created, so only the last segment can have a torn tail. A new segment's
header is written to ``<name>.tmp``, fsynced and renamed, so a segment file
never has a half-written header. ``close`` writes what is queued, fsyncs
(every policy) and closes.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

from pdfsm.filelog import (
    DEFAULT_MAX_FRAME,
    FLAG_GAP,
    FRAME,
    LogWriteError,
    Recovery,
    encode_frame,
    encode_header,
    fsync_path,
    lock_writer,
    read_header,
    recover,
    segment_name,
    segment_paths,
    segment_start,
)
from pdfsm.log import Overflow, Record

__all__ = ["BATCH_RECORDS", "FileSink", "FsyncPolicy"]

BATCH_RECORDS: Final = 256
"""Records per frame by default. Replay decodes a frame at a time; frames much larger than this
decode measurably slower per record (the decoded batch no longer fits the CPU caches), and much
smaller ones pay the per-frame Python overhead (about 3 us) on too few records."""

_IOV_MAX: Final = 512  # iovecs per writev, under every platform's IOV_MAX
_FLUSH_BYTES: Final = 1 << 20  # write out at least this often: big writes stall on dirty-page throttling
_seq_of: Final = attrgetter("seq")


_MAX_INTERVAL_MS: Final = 86_400_000.0


class FsyncPolicy(msgspec.Struct, frozen=True):
    """When the writer fsyncs: ``always``, ``every`` ``interval_ms``, or ``never`` (close only)."""

    mode: Literal["always", "every", "never"]
    interval_ms: float = 0.0

    def __post_init__(self) -> None:
        # The writer waits this long: a bound it can wait (inf killed the writer thread at once).
        if self.mode == "every" and not 0 < self.interval_ms <= _MAX_INTERVAL_MS:
            raise ValueError(f"interval_ms must be positive and at most {_MAX_INTERVAL_MS} (a day), "
                             f"got {self.interval_ms!r}")

    @classmethod
    def always(cls) -> FsyncPolicy:
        return cls("always")

    @classmethod
    def every(cls, interval_ms: float) -> FsyncPolicy:
        return cls("every", float(interval_ms))

    @classmethod
    def never(cls) -> FsyncPolicy:
        return cls("never")


class _Lost:
    """A queued loss marker: ``count`` records from ``first`` never reached the queue."""

    __slots__ = ("count", "first", "reason")

    def __init__(self, first: int, count: int, reason: str) -> None:
        self.first, self.count, self.reason = first, count, reason


def _write_all(fd: int, bufs: list[bytes]) -> int:
    total = sum(map(len, bufs))
    done = os.writev(fd, bufs)
    if done < total:  # a short write (rare on regular files): write the rest piecewise
        rest = memoryview(b"".join(bufs))[done:]
        while rest:
            rest = rest[os.write(fd, rest):]
    return total


def _make_dirs(directory: Path) -> None:
    """Create the log directory and make each new level durable in its parent."""
    made = []
    d = directory
    while not d.exists():
        made.append(d)
        if d.parent == d:
            break
        d = d.parent
    directory.mkdir(parents=True, exist_ok=True)
    for new in reversed(made):
        fsync_path(new.parent)


class FileSink:
    """Writes the event log to a directory of segments, on its own thread.

    If the directory already holds a log, it is recovered first (a torn tail is
    repaired, see :func:`~pdfsm.filelog.recover`; the result is in
    :attr:`recovery`) and the first batch must continue its sequence. An
    :class:`~pdfsm.log.EventLog` always starts at seq 0, so a restarted engine
    logs into a new directory; ``fresh=True`` says so up front: a directory
    that already holds a log is refused (:class:`LogWriteError`) before
    anything in it is recovered or written.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy | None = None,
        segment_bytes: int = 64 << 20,
        keep_segments: int | None = None,
        queue_rows: int = 1 << 18,
        overflow: Overflow = Overflow.BLOCK,
        batch_records: int = BATCH_RECORDS,
        metadata: Mapping[str, Any] | None = None,
        on_ack: Callable[[int], None] | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME,
        fresh: bool = False,
    ) -> None:
        if segment_bytes < 4096 or queue_rows < 1 or batch_records < 1:
            raise ValueError("segment_bytes must be >= 4096, queue_rows and batch_records positive")
        if keep_segments is not None and keep_segments < 1:
            raise ValueError("keep_segments must be positive (None keeps every segment)")
        self.directory: Final = Path(directory)
        self.fsync: Final = fsync if fsync is not None else FsyncPolicy.every(10)
        self.segment_bytes: Final = segment_bytes
        self.keep_segments: Final = keep_segments
        self.queue_rows: Final = queue_rows
        self.overflow: Final = overflow
        self.batch_records: Final = batch_records
        self.max_frame_bytes: Final = max_frame_bytes
        self.on_ack: Final = on_ack
        # Which pdfsm wrote it: a divergence on replay may be a replayer of another version.
        self.metadata: Final[dict[str, Any]] = {"created_ns": time.time_ns(), "pid": os.getpid(),
                                                "pdfsm_version": version(), **(metadata or {})}
        self._lock = -1
        try:  # the lock is let go if recovery or the first segment fails
            _make_dirs(self.directory)
            self._lock = lock_writer(self.directory)
            if fresh and (old := segment_paths(self.directory)):  # under the lock: no writer adds one meanwhile
                raise LogWriteError(f"already holds a log ({len(old)} segment{'s' * (len(old) > 1)} from seq "
                                    f"{segment_start(old[0].name)}), which a new log cannot continue: remove "
                                    "it or write elsewhere", path=self.directory)
            self.recovery: Final[Recovery] = recover(self.directory, max_frame_bytes=max_frame_bytes,
                                                     writer_locked=True)
            start = self.recovery.next_seq
            # What a writer that died left may be in the page cache only: made durable before
            # anything of it is counted acked (acked_seq below), or power loss could tear it under
            # records this writer acks.
            segments = segment_paths(self.directory)
            # One random id per log, carried by every segment of it (a reopened log keeps its
            # own), so a reader refuses a segment of another log copied in, even of the same worker.
            known = read_header(segments[0]).meta.get("log_id") if segments else None
            self.metadata["log_id"] = known if isinstance(known, str) else secrets.token_hex(8)
            for path in segments:
                fsync_path(path)
            fsync_path(self.directory)
            # owner side
            self._next_in = start  # the seq the next handed-over row must have
            self.lost = 0
            # shared, under _cond
            self._cond = threading.Condition()
            self._queue: deque[list[Record] | _Lost] = deque()
            self._queued = 0
            self._blocked = 0
            self._closing = False
            self._sync_wanted = False
            self._error: BaseException | None = None
            # writer side (ints read by any thread)
            self.written_seq = start - 1  # handed to the kernel
            self.acked_seq = start - 1  # fsynced
            self.frames = 0
            self.bytes_written = 0
            self.segments_deleted = 0
            self._encode = msgspec.msgpack.Encoder().encode
            self._segments: list[Path] = segments
            self._iov: list[bytes] = []
            self._pending = 0
            self._next_out = start
            self._dirty = False
            self._last_sync = time.monotonic_ns()
            self._fd = -1
            self._prev_crc = 0
            self._seg_size = 0
            self._unsynced: list[Path] = []  # under ``never``: segments created or written since the last sync
            self._open_segment(start)
        except BaseException as exc:
            if self._lock >= 0:
                os.close(self._lock)
            if isinstance(exc, OSError):  # a full disk, say: typed like the writer thread's failures
                raise LogWriteError(f"cannot open the log: {exc}", path=self.directory) from exc
            raise
        self._thread = threading.Thread(target=self._run, name="pdfsm-filelog", daemon=True)
        self._thread.start()

    # --- owner thread ---------------------------------------------------------------------------

    def write(self, rows: Sequence[Record]) -> None:
        """Hand a batch over to the writer thread. Raises if the writer failed or was closed,
        having taken none of the batch (the log hands it again at its next flush)."""
        n = len(rows)
        if not n:
            return
        if self._error is not None or self._closing:
            self._raise()
        first = rows[0].seq
        if first != self._next_in or list(map(_seq_of, rows)) != list(range(first, first + n)):  # in C: ~10 ns a row
            raise LogWriteError(f"rows {first}..{rows[-1].seq} do not continue the log at seq {self._next_in} "
                                "one by one", path=self.directory)
        batch = list(rows)
        cond = self._cond
        with cond:
            if self._queued and self._queued + n > self.queue_rows:
                if self.overflow is Overflow.COUNT:
                    self._lose(first, n, f"writer queue full ({self.queue_rows} rows)")
                    self._next_in = first + n
                    return
                self._blocked += 1
                try:
                    while (self._queued and self._queued + n > self.queue_rows and self._error is None
                           and not self._closing):
                        cond.wait(0.1)
                finally:
                    self._blocked -= 1
                if self._error is not None or self._closing:  # closed meanwhile: nobody would write it
                    self._raise()
            self._queue.append(batch)
            self._queued += n
            self._next_in = first + n
            cond.notify()

    def _lose(self, first: int, n: int, reason: str) -> None:
        """Queue a loss marker (merged with one just before it). Holds _cond."""
        self.lost += n
        tail = self._queue[-1] if self._queue else None
        if isinstance(tail, _Lost) and tail.first + tail.count == first:
            tail.count += n
        else:
            self._queue.append(_Lost(first, n, reason))
        self._cond.notify()

    def sync(self, timeout: float | None = None) -> bool:
        """Write and fsync everything handed over so far, whatever the policy; wait for it.

        Returns False if ``timeout`` passed first; raises if the writer failed."""
        target = self._next_in - 1
        with self._cond:
            if self._error is None:
                self._sync_wanted = True
                self._cond.notify()
        return self.wait_acked(target, timeout)

    def wait_written(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over so far is in the kernel (written, not fsynced): what
        a process tells the outside world after this survives the process being killed (not a
        machine crash: that is :meth:`sync`). Returns False if ``timeout`` passed first."""
        return self._wait_until("written_seq", self._next_in - 1, timeout)

    def wait_acked(self, seq: int, timeout: float | None = None) -> bool:
        """Wait until ``seq`` is fsynced (acknowledged). Raises if the writer failed."""
        return self._wait_until("acked_seq", seq, timeout)

    def _wait_until(self, mark: str, seq: int, timeout: float | None) -> bool:
        """Wait until the writer's ``mark`` (written_seq or acked_seq) reaches ``seq``; False on
        timeout; raises if the writer failed or stopped short of it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while getattr(self, mark) < seq and self._error is None and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(left, 0.05))
        if getattr(self, mark) < seq:
            self._raise()
        return True

    def close(self) -> None:
        """Write what is queued, fsync, close the file. Idempotent; raises if the writer failed."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            self._raise()

    def __enter__(self) -> FileSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise(self) -> None:
        if self._error is not None:
            raise LogWriteError(f"the log writer failed: {self._error!r}", path=self.directory) from self._error
        raise LogWriteError("the log writer is closed", path=self.directory)

    @property
    def queued(self) -> int:
        """Rows handed over and not yet taken by the writer thread."""
        return self._queued

    # --- writer thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - kept and raised on the owner thread
            with self._cond:
                self._error = e
                self._cond.notify_all()
            with contextlib.suppress(OSError):  # the error that stopped the writer is the one to report
                self._close_fd()
            os.close(self._lock)  # whatever happened: the next writer of this log must get the lock

    def _loop(self) -> None:
        cond, queue, mode = self._cond, self._queue, self.fsync.mode
        interval = int(self.fsync.interval_ms * 1e6)
        while True:
            with cond:
                while not queue and not self._closing and not self._sync_wanted:
                    if mode == "every" and self._dirty:
                        left = self._last_sync + interval - time.monotonic_ns()
                        if left <= 0:
                            break
                        cond.wait(left / 1e9)
                    else:
                        cond.wait()
                items = list(queue)
                queue.clear()
                self._queued = 0
                closing, wanted = self._closing, self._sync_wanted
                self._sync_wanted = False
                if self._blocked:
                    cond.notify_all()
            if items:
                self._write(items)
            if (closing or wanted or mode == "always"
                    or (mode == "every" and time.monotonic_ns() - self._last_sync >= interval)):
                self._sync()
            if closing:
                self._close_fd()
                os.close(self._lock)
                return

    def _write(self, items: list[list[Record] | _Lost]) -> None:
        run: list[Record] = []
        for item in items:
            if isinstance(item, _Lost):
                self._add_rows(run)
                run = []
                self._add_gap(item.first, item.count, item.reason)
            elif not run:
                run = item
            else:
                run += item
        self._add_rows(run)
        self._flush()

    def _add_rows(self, rows: list[Record]) -> None:
        size = self.batch_records
        if len(rows) <= size:
            if rows:
                self._add_chunk(rows)
            return
        for i in range(0, len(rows), size):
            self._add_chunk(rows[i:i + size])

    def _add_chunk(self, chunk: list[Record]) -> None:
        """One frame for the chunk; halves when it is over the cap or a record of it does not
        encode; a gap that says why for a single such record (never a dead writer)."""
        try:
            payload = self._encode(chunk)
        except (msgspec.EncodeError, ValueError, TypeError, OverflowError) as exc:  # a lone surrogate, say
            why = f"record does not encode: {type(exc).__name__}: {exc}"
        else:
            if len(payload) + FRAME.size <= self.max_frame_bytes:
                self._add_frame(payload, len(chunk), chunk[0].seq, 0)
                return
            why = f"record encodes to {len(payload)} bytes, over the frame cap"
        if len(chunk) == 1:
            self._add_gap(chunk[0].seq, 1, why)
            return
        half = len(chunk) // 2
        self._add_chunk(chunk[:half])
        self._add_chunk(chunk[half:])

    def _add_gap(self, first: int, count: int, reason: str) -> None:
        self._add_frame(self._encode({"reason": reason}), count, first, FLAG_GAP)

    def _add_frame(self, payload: bytes, count: int, base: int, flags: int) -> None:
        head, self._prev_crc = encode_frame(payload, count, base, self._prev_crc, flags=flags,
                                            wall_ns=time.time_ns(), mono_ns=time.monotonic_ns())
        self._iov += (head, payload)
        self._pending += FRAME.size + len(payload)
        self._next_out = base + count
        self.frames += 1
        if self._seg_size + self._pending >= self.segment_bytes:
            self._flush()
            self._rotate()
        elif len(self._iov) >= _IOV_MAX or self._pending >= _FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._iov:
            return
        _write_all(self._fd, self._iov)
        self._seg_size += self._pending
        self.bytes_written += self._pending
        self._iov, self._pending = [], 0
        self._dirty = True
        with self._cond:  # wakes wait_written
            self.written_seq = self._next_out - 1
            self._cond.notify_all()

    def _sync(self) -> None:
        if self._unsynced:  # ``never`` created (and filled) these unsynced: nothing in them is acked before
            for path in self._unsynced:
                fsync_path(path)
            fsync_path(self.directory)
            self._unsynced.clear()
        if self._dirty:
            os.fdatasync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic_ns()
        if self.acked_seq != self.written_seq:
            self.acked_seq = self.written_seq
            with self._cond:
                self._cond.notify_all()
            if self.on_ack is not None:
                self.on_ack(self.acked_seq)

    def _close_fd(self) -> None:
        """Close the segment's descriptor once: it is released even when close(2) reports an error,
        so it is forgotten first (closing the number again could close another thread's file)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _rotate(self) -> None:
        if self.fsync.mode != "never":
            self._sync()
        elif self._dirty and self._segments[-1] not in self._unsynced:
            self._unsynced.append(self._segments[-1])  # written since the last sync: the next fsyncs it
        self._close_fd()
        self._open_segment(self._next_out)
        keep = self.keep_segments
        if keep is not None and len(self._segments) > keep:
            for old in self._segments[:-keep]:
                old.unlink(missing_ok=True)
                self.segments_deleted += 1
                if old in self._unsynced:
                    self._unsynced.remove(old)
            del self._segments[:-keep]
            if self.fsync.mode != "never":
                fsync_path(self.directory)

    def _open_segment(self, start: int) -> None:
        """Create the segment starting at ``start``: header to a temp file, fsync, rename."""
        header, self._prev_crc = encode_header(start, secrets.token_bytes(8), self.metadata)
        final = self.directory / segment_name(start)
        tmp = final.with_name(final.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, [header])
            if self.fsync.mode != "never":
                os.fdatasync(fd)
            os.replace(tmp, final)  # an empty segment at the same start (a crash right after rotating)
            if self.fsync.mode != "never":
                fsync_path(self.directory)
            else:
                self._unsynced.append(final)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):  # a header never renamed into place: no stray file left
                tmp.unlink(missing_ok=True)
            raise
        self._fd, self._seg_size = fd, len(header)
        if not self._segments or self._segments[-1] != final:
            self._segments.append(final)
        self.bytes_written += len(header)


def version() -> str:
    """The installed pdfsm version ("unknown" from a source tree that is not installed)."""
    try:
        return importlib.metadata.version("pdfsm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"
