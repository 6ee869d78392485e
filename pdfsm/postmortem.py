"""Reading durable logs back for a postmortem: ``pdfsm replay``, and the loading trace and report share.

A *log* on the command line is a log directory, one segment file, or a directory
whose subdirectories are logs (what ``pdfsm demo --log-dir`` leaves: one per
worker). Each log is read whole (a torn tail is accepted and reported, and the file
is left alone unless ``repair`` is asked), replayed with :func:`pdfsm.replay.replay`
(every recorded outcome must come out again) and summarized. What went wrong with
a log is its *status*, and each status has an exit code; the command exits with
the first failing log's (docs/postmortem.md has the table):

- ``ok`` (0): read and replayed; ``torn_tail`` (0): a crash artefact at the end,
  reported, the records before it replayed;
- ``divergence`` (3): replay recomputed something other than a record says;
- ``corrupt`` (4): damage with good data after it (the file and offset are named);
- ``unsupported`` (5): a newer format or schema; ``no_log`` (6): nothing there, or
  nothing of a log (a file without the segment magic or one good frame anywhere: a
  wrong file named, not a damaged log).

Exit code 2 is a usage error (bad ``--at``, a request found in no log).
``--json`` output is described in docs/replay-json.md (``"schema": 1``).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import errno
import json
import math
import mmap
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from pdfsm.events import BlocksHeld, CoreConfig, ReadRequested, Started
from pdfsm.filelog import (
    LOCK_NAME,
    MAGIC,
    CorruptLogError,
    Gap,
    LogError,
    LogReader,
    UnsupportedVersionError,
    _Unclassified,
    _valid_frame_after,
    read_header,
    segment_paths,
    segment_start,
    writer_holds,
)
from pdfsm.filesink import version as _version
from pdfsm.log import EventLog, Record
from pdfsm.replay import (
    OUTCOMES,
    Divergence,
    Followed,
    Step,
    Summary,
    event_detail,
    follow,
    machine_key,
    offsets,
    printable,
    render,
    replay,
    step_note,
    summarize,
    visits,
)

__all__ = [
    "SCHEMA",
    "Exit",
    "LoadedLog",
    "Progress",
    "add_replay_arguments",
    "expand",
    "load",
    "load_all",
    "make_progress",
    "print_replay",
    "record_json",
    "reader_left",
    "replay_command",
    "key_json",
    "say",
    "to_json",
    "verify",
    "warn_unreadable",
    "worker_log",
]

SCHEMA: Final = 1
"""Version of the ``--json`` document; bumped on any change a reader could notice."""


class Exit(enum.IntEnum):
    """Exit codes of ``pdfsm replay`` (and of ``trace`` and ``report`` for unreadable logs)."""

    OK = 0
    USAGE = 2
    DIVERGENCE = 3
    CORRUPT = 4
    UNSUPPORTED = 5
    NO_LOG = 6


WRITER_LIVE: Final = ("a writer holds this log (its writer.lock is locked, or no regular file): it may still be "
                      "written, so requests not terminal may be in progress, not stuck")
"""What replay and report say of a log whose writer may still be running."""

_EXIT: Final = {"ok": Exit.OK, "torn_tail": Exit.OK, "divergence": Exit.DIVERGENCE, "corrupt": Exit.CORRUPT,
                "unsupported": Exit.UNSUPPORTED, "no_log": Exit.NO_LOG}


@dataclass
class LoadedLog:
    """One log read back: its records (the good prefix, whatever happened) and what went wrong."""

    name: str
    path: str
    records: list[Record] = field(default_factory=list)
    status: str = "ok"  # a key of _EXIT
    error: str = ""
    error_file: str | None = None
    error_offset: int | None = None
    divergence_seq: int | None = None
    torn: dict[str, Any] | None = None  # file, offset, reason, repaired, backup, removed_bytes
    gaps: list[Gap] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    replayed: bool = False
    replay_note: str = ""  # why the records were not all replayed (a trimmed log, a gap)
    later: str | None = None  # a segment named alone: the next segment of its log, which it stops short of
    writer_live: bool = False  # a writer held the log's lock as it was read: it was still being written

    @property
    def exit_code(self) -> Exit:
        return _EXIT[self.status]

    @property
    def config(self) -> CoreConfig | None:
        first = self.records[0].event if self.records else None
        return first.config if isinstance(first, Started) else None


# --- progress ---------------------------------------------------------------------------------------


class Progress(Protocol):
    """A progress display on stderr: one task at a time."""

    def start(self, description: str, total: int | None) -> None: ...

    def update(self, completed: int) -> None: ...

    def stop(self) -> None: ...


class _NoProgress:
    def start(self, description: str, total: int | None) -> None:
        pass

    def update(self, completed: int) -> None:
        pass

    def stop(self) -> None:
        pass


class _PlainProgress:
    """A counter on stderr at most every 0.2 s: rewritten in place on a terminal (the fallback
    without rich); into a file or pipe one plain line each time, and each phase's last count
    (escape codes there, and a count stuck at its first update, found by a helper's review)."""

    def __init__(self, in_place: bool) -> None:
        self._in_place = in_place
        self._desc, self._last, self._shown = "", 0.0, False
        self._total: int | None = None
        self._done, self._said = 0, -1

    def start(self, description: str, total: int | None) -> None:
        self._end_phase()
        self._desc, self._total, self._last, self._done, self._said = description, total, 0.0, 0, -1

    def update(self, completed: int) -> None:
        self._done = completed
        now = time.monotonic()
        if now - self._last >= 0.2:
            self._last, self._shown = now, True
            self._write()

    def _write(self) -> None:
        of = f"/{self._total}" if self._total else ""
        line = f"{self._desc}: {self._done}{of}"
        sys.stderr.write(f"\r{line}\x1b[K" if self._in_place else f"{line}\n")
        sys.stderr.flush()
        self._said = self._done

    def _end_phase(self) -> None:
        if not self._in_place and self._shown and self._said != self._done:
            self._write()

    def stop(self) -> None:
        self._end_phase()
        if self._in_place and self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        self._shown = False


class _RichProgress:
    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import Progress as Bar

        self._bar = Bar(console=Console(file=sys.stderr), transient=True)
        self._task: Any = None

    def start(self, description: str, total: int | None) -> None:
        if self._task is None:
            self._bar.start()
        else:
            self._bar.remove_task(self._task)
        self._task = self._bar.add_task(description, total=total)

    def update(self, completed: int) -> None:
        self._bar.update(self._task, completed=completed)

    def stop(self) -> None:
        if self._task is not None:
            self._bar.stop()
            self._task = None


def make_progress(enabled: bool | None, *, json_mode: bool = False) -> Progress:
    """``enabled`` None means: only when stdout and stderr are terminals and the output is not JSON."""
    if enabled is None:
        enabled = not json_mode and sys.stdout.isatty() and sys.stderr.isatty()
    if not enabled:
        return _NoProgress()
    if not sys.stderr.isatty():  # asked for explicitly into a file or pipe: rich would draw nothing there
        return _PlainProgress(in_place=False)
    try:
        return _RichProgress()
    except ImportError:  # rich is a test dependency, not a runtime one
        return _PlainProgress(in_place=True)


# --- reading ------------------------------------------------------------------------------------------


def log_path(arg: str) -> str:
    """argparse type of a LOG argument: an empty one is refused (``Path("")`` is the working
    directory, so an unset shell variable would quietly replay whatever is there)."""
    if not arg.strip():
        raise argparse.ArgumentTypeError("an empty path names no log")
    return arg


def expand(paths: Iterable[str]) -> list[tuple[str, Path]]:
    """(name, path) per log. A directory whose subdirectories hold logs stands for those logs
    (sorted by name), and for its own when it holds segments too (a stray segment copied into a
    run's directory hid every worker's log: found by a helper's review). A log is named after its
    directory (a segment file after the directory it is in); a repeated name gets ``#2``,
    ``#3``... A path named twice (also through a directory holding it), or a segment file of a log
    directory also named, is read once; a writer lock named beside its log's segments (a shell's
    ``DIR/*``) is not a log. Names are fit to print (:func:`~pdfsm.replay.printable`): a
    directory's name is anyone's."""
    logs: list[Path] = []
    paths = list(paths)
    named = {Path(a).parent for a in paths if Path(a).name != LOCK_NAME}
    for arg in paths:
        p = Path(arg)
        if p.name == LOCK_NAME and p.parent in named:  # `replay DIR/*`: the lock of a log named by its segments
            continue
        try:
            subs, own = worker_logs(p), _has_segments(p)
        except OSError:  # unreadable: load() says so as the log's status
            subs, own = [], False
        logs += ([p] if own or not subs else []) + subs
    probed = [(log, *_probe(log)) for log in logs]
    whole = {real for _, real, is_file in probed if not is_file}
    found: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    for log, real, is_file in probed:
        if real in seen or (is_file and real.parent in whole):  # read with the directory named
            continue
        seen.add(real)
        # absolute(): the directory of a segment named as "0000.pdlog" from inside it
        name = log.absolute().parent.name if is_file and log.name[:1].isdigit() else log.name
        if name in ("", ".", ".."):  # `replay .` from inside the log: its directory's own name
            name = real.name
        found.append((printable(name or str(log)), log))
    out: list[tuple[str, Path]] = []
    taken = {name for name, _ in found}  # every log's own name
    given: set[str] = set()
    for name, log in found:
        unique, n = name, 1
        while unique in given or (unique != name and unique in taken):  # a log named "x#2" keeps its name
            n += 1
            unique = f"{name}#{n}"
        given.add(unique)
        out.append((unique, log))
    return out


def _probe(log: Path) -> tuple[Path, bool]:
    """Where ``log`` really is, and whether it is a file (else a directory, or nothing yet)."""
    try:
        return log.resolve(), log.is_file()
    except OSError:  # a path the system refuses (a name too long): load() says so as the log's status
        return log.absolute(), False


def _has_segments(p: Path) -> bool:
    return p.is_dir() and bool(segment_paths(p))


def worker_logs(log_dir: Path) -> list[Path]:
    """The log directories under ``log_dir``, by name: one per worker, those holding segments,
    and those a log was in (a writer lock, a segment moved aside by ``--repair``: reported as no
    log, not left out) or that cannot be listed (reported as unreadable, not hiding the rest)."""
    if not log_dir.is_dir():
        return []
    found = []
    for d in sorted(log_dir.iterdir()):
        try:
            if d.is_dir() and any(_log_file(c.name) for c in d.iterdir()):
                found.append(d)
        except OSError:  # load() says why
            found.append(d)
    return found


def _log_file(name: str) -> bool:
    """A segment, a segment moved aside, or the writer's lock."""
    return name == LOCK_NAME or segment_start(name.split(".torn.", maxsplit=1)[0]) is not None


class _Reader(LogReader):
    """A reader that reports how far into the files it is, for the progress bar."""

    def __init__(self, path: Path, on_frame: Callable[[Path, int], None], **kw: Any) -> None:
        super().__init__(path, **kw)
        self._on_frame = on_frame

    def frames(self) -> Iterator[tuple[Path, Any]]:
        for path, fr in super().frames():
            self._on_frame(path, fr.end)
            yield path, fr


def load(name: str, path: Path, *, repair: bool = False, progress: Progress | None = None) -> LoadedLog:
    """Read one log whole. Never raises for a bad log: the problem is in the result's status."""
    tries = 3
    while True:
        out = LoadedLog(name, printable(str(path)))
        try:
            return _load(out, path, repair=repair, progress=progress)
        except OSError as e:  # unreadable (permissions, a vanished file): a status, like any bad log
            tries -= 1
            # A live writer's retention (keep_segments) deleted a segment between listing and
            # reading it: the log is fine, read it again (a helper's hunt: 2% of such reads).
            if isinstance(e, FileNotFoundError) and tries and writer_holds(path):
                continue
            out.records, out.status, out.error = [], "no_log", f"{path}: cannot read: {e}"
            return out


def _load(out: LoadedLog, path: Path, *, repair: bool, progress: Progress | None) -> LoadedLog:
    if not path.exists():
        out.status, out.error = "no_log", f"{path}: does not exist"
        return out
    files = segment_paths(path)
    if path.is_file() and path.stat().st_size == 0 and segment_start(path.name) is None:
        # An empty file named like no segment (the writer's lock file) cannot be a segment whose
        # creation was cut short: it is not a log, not a torn one.
        out.status, out.error = "no_log", f"{path}: not a log segment (an empty file)"
        return out
    gone = next((f for f in files if not os.path.lexists(f)), None)
    if gone is not None:  # deleted since listed (a live writer's retention): load() reads again
        raise FileNotFoundError(errno.ENOENT, "a segment vanished while the log was read", str(gone))
    if not files or not all(f.is_file() for f in files):
        moved = sorted(c.name for c in path.iterdir() if ".torn." in c.name) if path.is_dir() else []
        aside = f" ({', '.join(moved)} moved aside by --repair)" if moved else ""
        out.status, out.error = "no_log", f"{path}: no log segments here{aside}"
        return out
    out.writer_live = live = writer_holds(path)
    if live:  # cutting a live writer's tail would lose what it is writing
        repair = False
    later = _later_segment(path)
    if later is not None:  # one segment of a longer log: its end is no tail, damage there no tear
        repair = False
        out.later = later.name
    bar = progress or _NoProgress()
    sizes = {f: f.stat().st_size for f in files}
    before = {f: sum(sizes[g] for g in files[:i]) for i, f in enumerate(files)}
    bar.start(f"reading {out.name}", sum(sizes.values()))
    reader = _Reader(path, lambda f, end: bar.update(before.get(f, 0) + end),
                     on_torn_tail="repair" if repair else "stop")
    repair_error = None
    try:
        for batch in reader.batches():
            out.records += batch
    except OSError as e:
        if reader.torn is None:
            raise  # the log itself cannot be read: load() says so
        repair_error = e.strerror or str(e)  # --repair could not cut it; what was read stands
    except UnsupportedVersionError as e:
        out.status, out.error, out.error_file, out.error_offset = "unsupported", str(e), e.path, e.offset
    except LogError as e:  # CorruptLogError, or an intact frame over the reader's cap: unreadable past here
        out.status, out.error, out.error_file, out.error_offset = "corrupt", str(e), e.path, e.offset
        if isinstance(e, CorruptLogError) and not out.records and e.offset == 0 and not _log_bytes_in(files):
            out.status, out.error_file, out.error_offset = "no_log", None, None
            out.error = f"{path}: not a pdfsm log: no segment header and no frame anywhere in it"
    finally:
        bar.stop()
    out.gaps = list(reader.gaps)
    if reader.headers:
        out.meta = {k: v for k, v in reader.headers[0].meta.items()
                    if isinstance(v, (str, int, bool)) or (isinstance(v, float) and math.isfinite(v))}  # strict JSON
    t = reader.torn
    if t is not None and out.status == "ok" and later is not None:
        out.status, out.error_file, out.error_offset = "corrupt", t.path, t.offset
        out.error = (f"{t.path} at byte {t.offset}: {t.reason.removeprefix('torn tail: ')}; {later.name} "
                     f"follows it in {path.parent}, so this is corruption, not a torn tail: replay the directory")
    elif t is not None and out.status == "ok":
        out.status = "torn_tail"
        out.torn = {"file": t.path, "offset": t.offset, "reason": t.reason.removeprefix("torn tail: "),
                    "repaired": False, "backup": None, "removed_bytes": None, "writer_live": live,
                    "repair_error": repair_error}
        if reader.repairs:
            rep = reader.repairs[-1]
            out.torn.update(repaired=True, backup=rep.backup, removed_bytes=rep.removed_bytes)
    if later is not None and out.status == "ok":  # named alone, it reads as a whole log that ends early
        out.replay_note = (f"one segment of a longer log: {later.name} follows it, so this is not the log's end "
                           f"state; name the directory ({path.parent}) for the whole log")
    return out


def _log_bytes_in(files: Sequence[Path]) -> bool:
    """Whether any of the files holds bytes of a log: the segment magic, or a frame whose CRC holds.
    A file with neither (a text file named by mistake) is no log (exit 6); a log damaged at its
    start still has them, and is corrupt (exit 4). Past the scan's budget of bytes checked
    (frame-shaped noise claiming large payloads) the answer is yes: damage is never called "not a
    log" on a guess."""
    return any(_log_bytes_in_file(f) for f in files)


def _log_bytes_in_file(path: Path) -> bool:
    size = path.stat().st_size
    if size == 0:  # mmap refuses an empty file, and there is nothing in it
        return False
    with path.open("rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(MAGIC) != -1:
                return True
        try:  # the reader's own search for a frame after damage, here from the first byte
            return _valid_frame_after(f.fileno(), -1, size, size, claimed_end=0, link=None, seq=None,
                                      follows=None, garbled=True) is not None
        except _Unclassified:
            return True


def _later_segment(path: Path) -> Path | None:
    """The next segment after ``path`` in its directory when ``path`` is one segment file."""
    start = segment_start(path.name) if path.is_file() else None
    if start is None:
        return None
    return next((f for f in segment_paths(path.parent) if (segment_start(f.name) or 0) > start), None)


def verify(log: LoadedLog, *, progress: Progress | None = None) -> LoadedLog:
    """Replay a readable log's records; a difference (or a replay that cannot go on) is a divergence."""
    if log.status not in ("ok", "torn_tail") or not log.records:
        return log
    records, first = log.records, log.records[0].seq
    if first != 0:  # the machines' earlier history is gone: nothing to rebuild them from
        note = (f"not replayed: the log starts at seq {first} (a later segment named alone, or older "
                "segments removed by keep_segments); summarized from its records")
        log.replay_note = f"{log.replay_note}; {note}" if log.replay_note else note  # after _load's, not over it
        return log
    if log.gaps:  # the core applied records the file never got: replay can check only up to them
        cut = log.gaps[0].first_seq
        records = [r for r in records if r.seq < cut]
        note = (f"replayed up to seq {cut - 1}: record {cut} is missing from the file (a gap: "
                f"{log.gaps[0].reason}); summarized from every record read")
        log.replay_note = f"{log.replay_note}; {note}" if log.replay_note else note
    bar = progress or _NoProgress()
    bar.start(f"replaying {log.name}", len(records))
    at = [0]

    def counted(records: list[Record]) -> Iterator[Record]:
        for i, rec in enumerate(records):
            at[0] = rec.seq
            if i & 4095 == 0:
                bar.update(i)
            yield rec

    unrecorded: list[Record] = []
    try:
        replay(counted(records), unrecorded=unrecorded)
        bar.update(len(records))  # the last count said is the whole (updates come every 4096)
        log.replayed = True
        if unrecorded:  # the writer stopped between an event and what it caused
            kinds = ", ".join(sorted({type(r.event).__name__ for r in unrecorded}))
            blamed = sum(r.violation for r in unrecorded)
            # With a gap, replay stops where the gap starts, and the log goes on after it.
            end = (f"replay stops at seq {records[-1].seq}, before the gap," if log.gaps
                   else f"this segment ends at seq {records[-1].seq}" if log.later
                   else f"the log ends at seq {records[-1].seq}")
            note = (f"{end} part-way through what its last event caused: replay "
                    f"recomputed {len(unrecorded)} record(s) the file does not have ({kinds}"
                    + (f"; {blamed} of them violations" if blamed else "") + "), not counted in this summary")
            log.replay_note = f"{log.replay_note}; {note}" if log.replay_note else note
    except Divergence as d:
        log.status, log.error, log.divergence_seq = "divergence", str(d), d.seq
    except Exception as e:  # noqa: BLE001 - a record the rebuilt core cannot even take is a divergence too
        log.status, log.divergence_seq = "divergence", at[0]
        log.error = f"divergence at seq {at[0]}: replay stopped: {type(e).__name__}: {e}"
    finally:
        bar.stop()
    wrote, mine = log.meta.get("pdfsm_version"), _version()
    if log.status == "divergence" and wrote and wrote != mine:
        log.error += (f" (written by pdfsm {wrote}, replayed by {mine}: a table or field that changed between "
                      "them diverges too; replay with the version the engine ran)")
    return log


def load_all(paths: Iterable[str], *, repair: bool = False, check: bool = True,
             progress: Progress | None = None) -> list[LoadedLog]:
    """Every log named on a command line, read and (``check``) replayed."""
    logs = [load(name, p, repair=repair, progress=progress) for name, p in expand(paths)]
    return [verify(log, progress=progress) for log in logs] if check else logs


def warn_unreadable(logs: Sequence[LoadedLog], tool: str = "pdfsm") -> int:
    """Say on stderr which logs could not be read whole (trace and report draw what was read);
    returns the first such log's exit code, 0 if none (a torn tail is only mentioned)."""
    code = 0
    for log in logs:
        if log.status == "torn_tail" and log.torn is not None:
            print(f"{tool}: {log.name}: torn tail at byte {log.torn['offset']} accepted (file left as it is)",
                  file=sys.stderr)
        elif log.status in ("corrupt", "unsupported", "no_log"):
            using = "" if log.status == "no_log" else f"; drawing the {len(log.records)} records before the damage"
            print(f"{tool}: {log.name}: {printable(log.error)} (exit {int(log.exit_code)}{using})", file=sys.stderr)
            code = code or int(log.exit_code)
    return code


def none_read(logs: Sequence[LoadedLog], output: str, tool: str) -> bool:
    """No log could be read at all: says the output is not written (a page or trace saying "wrote
    N logs" of nothing would pass for a result)."""
    if all(log.status == "no_log" for log in logs):
        print(f"{tool}: no log could be read: {printable(output)} not written", file=sys.stderr)
        return True
    return False


DEMO_WRITER: Final = "pdfsm demo"  # in every segment header the demos write: a rerun may replace those logs


def clear_demo_logs(log_dir: Path) -> str | None:
    """Remove the logs an earlier demo run left under ``log_dir``, so a rerun into the same directory
    replays only itself; returns why not when a log there was not a demo's (it is left alone: an
    engine's log starts at seq 0 and cannot be appended to, nor may a demo delete someone's log),
    or when ``log_dir`` cannot be made (before any engine starts, not as its traceback)."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--log-dir {log_dir}: cannot create it: {e.strerror or e}"
    dirs = worker_logs(log_dir)
    logs = {}
    for d in dirs:
        segments = segment_paths(d)
        try:
            if segments and read_header(segments[0]).meta.get("writer") != DEMO_WRITER:
                return f"{d} holds a log the demo did not write; choose another --log-dir"
        except (LogError, OSError) as e:
            return f"{d} holds a log whose header cannot be read ({e}); choose another --log-dir"
        if writer_holds(d):
            return f"{d} is being written by a running engine (another demo?); choose another --log-dir"
        logs[d] = bool(segments)
    for d, demo_log in logs.items():  # a lock alone: an engine killed before its first segment
        for f in d.iterdir():
            if f.is_file() and ((demo_log and ".pdlog" in f.name) or f.name == LOCK_NAME):
                f.unlink()
        if not any(d.iterdir()):
            d.rmdir()  # the next run may have other workers: no empty log left to confuse a replay
    return None


def worker_log(log_dir: str | os.PathLike[str], worker: str, **meta: Any) -> EventLog:
    """An event log that writes to ``log_dir/worker`` (one directory per worker), for an engine
    whose log a postmortem will read; ``meta`` goes into every segment header."""
    from pdfsm.filesink import FileSink

    return EventLog(sink=FileSink(Path(log_dir) / worker, metadata={"worker": worker, **meta}))


# --- text ----------------------------------------------------------------------------------------------

_HEADLINE: Final = {
    "ok": "replayed, no divergence",
    "torn_tail": "torn tail accepted; replayed, no divergence",
    "divergence": "DIVERGENCE",
    "corrupt": "CORRUPT, summary of the records before the damage",
    "unsupported": "UNSUPPORTED VERSION",
    "no_log": "NO LOG",
}


def _key(key: Any) -> str:
    return repr(key)


def _details(log: LoadedLog) -> Iterator[str]:
    """The lines about the log itself, each fit to print: paths and errors name its files."""
    return map(printable, _raw_details(log))


def _raw_details(log: LoadedLog) -> Iterator[str]:
    cfg = log.config
    where = f"  path: {log.path}"
    if cfg is not None:
        where += f"; engine {cfg.engine_id}, tp_rank {cfg.tp_rank} of {cfg.tp_size}, pp_rank {cfg.pp_rank}"
    yield where
    if log.torn is not None:
        t = log.torn
        if t["repaired"] and t["offset"] == 0:  # nothing of it was kept: say so, not "cut at byte 0"
            yield (f"  torn tail repaired: {t['file']} held no whole record ({t['reason']}), so it was moved "
                   f"aside as {t['backup']}")
        elif t["repaired"]:
            yield (f"  torn tail repaired: {t['file']} cut at byte {t['offset']} ({t['removed_bytes']} bytes "
                   f"removed: {t['reason']}); the damaged file is kept as {t['backup']}")
        else:
            why = ("a writer holds this log, so --repair left it alone" if t.get("writer_live")
                   else f"--repair could not cut it: {t['repair_error']}" if t.get("repair_error")
                   else "--repair cuts it there, keeping a copy")
            before = "every record before it replayed" if log.records else "no record before it"
            yield (f"  torn tail: {t['file']} at byte {t['offset']}: {t['reason']}; {before}; "
                   f"the file was left as it is ({why})")
    for g in log.gaps:
        yield f"  gap: seqs {g.first_seq}..{g.first_seq + g.count - 1} missing ({g.reason})"
    if log.replay_note:
        yield f"  note: {log.replay_note}"
    if log.writer_live:  # found by a helper's review: it read as a finished log with stuck requests
        yield f"  note: {WRITER_LIVE}"
    if log.error:
        lines = log.error.splitlines()
        yield f"  error: {lines[0]}"
        yield from (f"         {line.strip()}" for line in lines[1:])


def _machines_at(log: LoadedLog, summary: Summary) -> Iterator[str]:
    since = {(v.machine, v.key): v for v in visits(log.records, at=summary.last_seq)}
    t0 = summary.first_t_ns
    at = offsets(summary.last_t_ns - t0, pad=False)
    yield f"  machines at seq {summary.last_seq} ({at(summary.last_t_ns - t0)}):"
    for (machine, key), state in summary.states.items():
        v = since.get((machine, key))
        when = f"  since #{v.start_seq} ({at(v.start_t_ns - t0)}, {v.entered_by})" if v else ""
        yield f"    {printable(machine):9s} {_key(key):28s} {printable(state):12s}{when}"


def _log_text(log: LoadedLog, summary: Summary | None, *, timelines: int, limit: int, brief: bool) -> Iterator[str]:
    headline = _HEADLINE[log.status]
    if log.replay_note:
        done = "replayed in part, no divergence" if log.replayed else "not replayed"
        headline = headline.replace("replayed, no divergence", done)
    elif not log.records:  # a header and nothing else: nothing was replayed
        headline = headline.replace("replayed, no divergence", "nothing replayed")
    title = f"{log.name}: {headline}"
    if summary is None or brief:
        n, last = len(log.records), log.records[-1].seq if log.records else -1
        if summary is not None:  # what --at left of the log, as the full summary's header says
            n, last = summary.events, summary.last_seq
        yield f"{title}: {n} records" + (f" up to seq {last}" if n else "")
        yield from _details(log)
        return
    lines = list(render(summary, title=title, timelines=timelines, limit=limit))
    yield lines[0]
    yield from _details(log)
    yield from lines[1:]


def _follow_text(f: Followed) -> Iterator[str]:
    cons = ", ".join(f"{rid!r} in {log}" for log, rid in f.consumers) or "none"
    prods = ", ".join(f"{rid!r} in {log}" for log, rid in f.producers) or "none"
    yield printable(f"request {f.query!r}: producer {prods}; consumer {cons}")
    if not f.entries:
        return
    t0 = f.entries[0][1].event.t_ns
    at = offsets(max(rec.event.t_ns for _, rec in f.entries) - t0)
    width = max(len(log) for log, _ in f.entries)
    for log, rec in f.entries:
        applied = rec.outcome.name == "APPLIED"
        arrow = printable(f"{rec.before} -> {rec.state}" if applied else f"{rec.state} ({rec.outcome.name.lower()})")
        key = machine_key(rec)
        who = rec.machine if key is None else f"{rec.machine} {key if isinstance(key, str) else _key(key)}"
        note = step_note(rec.fault.value if rec.fault is not None else None, rec.reason, applied)
        tail = " ".join(x for x in (event_detail(rec.event), note) if x)
        yield (f"  {at(rec.event.t_ns - t0)}  {printable(log):{width}s} #{rec.seq:<6d} "
               f"{printable(who):20s} "
               f"{type(rec.event).__name__:21s} {arrow:24s} {tail}").rstrip()


# --- JSON ----------------------------------------------------------------------------------------------


def key_json(key: Any) -> Any:
    """A machine key as JSON writes it: a request's id, an engine's ``[engine_id, pp_rank]``."""
    return list(key) if isinstance(key, tuple) else key


def record_json(rec: Record, log: str | None = None) -> dict[str, Any]:
    """One record as the JSON document writes it (docs/replay-json.md, "record")."""
    out: dict[str, Any] = {} if log is None else {"log": log}
    out.update(seq=rec.seq, t_ns=rec.event.t_ns, source=rec.event.source, machine=rec.machine,
               key=key_json(machine_key(rec)), event=type(rec.event).__name__, before=rec.before,
               state=rec.state, outcome=rec.outcome.name.lower(), reason=rec.reason,
               fault=None if rec.fault is None else rec.fault.value, cause=rec.cause,
               detail=event_detail(rec.event))
    return out


def _step_json(st: Step) -> dict[str, Any]:
    return {"seq": st.seq, "t_ns": st.t_ns, "source": st.source, "event": st.event, "before": st.before,
            "state": st.state, "outcome": st.outcome, "reason": st.reason, "fault": st.fault, "cause": st.cause,
            "detail": st.detail}


def _log_json(log: LoadedLog, summary: Summary, at: int | None, timelines: int) -> dict[str, Any]:
    cfg = log.config
    shown = [(k, steps) for k, steps in summary.timelines.items() if k[0] != "engine"][:timelines]
    machines = None
    if at is not None:
        since = {(v.machine, v.key): v.start_seq for v in visits(log.records, at=summary.last_seq)}
        machines = [{"machine": m, "key": key_json(k), "state": s, "since_seq": since.get((m, k))}
                    for (m, k), s in summary.states.items()]
    return {
        "name": log.name,
        "path": log.path,
        "status": log.status,
        "exit_code": int(log.exit_code),
        "error": None if not log.error else {"message": log.error, "file": log.error_file,
                                             "offset": log.error_offset, "seq": log.divergence_seq},
        "torn_tail": log.torn,
        "replayed": log.replayed,
        "replay_note": log.replay_note or None,
        "writer_live": log.writer_live,
        "gaps": [{"first_seq": g.first_seq, "count": g.count, "reason": g.reason, "file": g.path,
                  "offset": g.offset} for g in log.gaps],
        "meta": log.meta,
        "config": None if cfg is None else {"engine_id": cfg.engine_id, "tp_rank": cfg.tp_rank,
                                            "tp_size": cfg.tp_size, "pp_rank": cfg.pp_rank, "pp_size": cfg.pp_size},
        "records": len(log.records),
        "at": at,
        "at_note": _at_note(log, at),
        "last_seq": summary.last_seq,
        "first_t_ns": summary.first_t_ns,
        "last_t_ns": summary.last_t_ns,
        "states": {m: dict(sorted(c.items())) for m, c in sorted(summary.per_state.items())},
        "outcomes": _outcomes_json(summary),
        "machines": machines,
        "violations": [record_json(v) for v in summary.violations],
        "violations_by_fault": {"local": summary.by_fault()["local"], "remote": summary.by_fault()["remote"]},
        "stuck": [{"machine": m, "key": key_json(k), "state": s} for m, k, s in summary.stuck],
        "timelines": [{"machine": m, "key": key_json(k), "steps": [_step_json(s) for s in steps]}
                      for (m, k), steps in shown],
    }


def _outcomes_json(summary: Summary) -> dict[str, Any]:
    """Every outcome of every kind, 0 when none: the document has every field always."""
    out: dict[str, Any] = {}
    for machine, names in OUTCOMES.items():
        got = summary.finished.get(machine, Counter())
        out.update((name, got.get(name, 0)) for name in names)
        if machine == "consumer":
            out["failure_policy"] = summary.policy
    return out


def to_json(logs: Sequence[LoadedLog], summaries: Sequence[Summary], ats: Sequence[int | None],
            followed: Followed | None, *, timelines: int, exit_code: int, found: bool = True) -> dict[str, Any]:
    """The whole ``--json`` document (schema 1, docs/replay-json.md)."""
    request = None
    if followed is not None:
        request = {"query": followed.query, "producer_ids": followed.producer_ids,
                   "consumers": [{"log": log, "request_id": rid} for log, rid in followed.consumers],
                   "producers": [{"log": log, "request_id": rid} for log, rid in followed.producers],
                   "entries": [record_json(rec, log) for log, rec in followed.entries],
                   "warnings": _mixed_runs(logs, followed),
                   # in the logs at all, --at aside: false is the usage error "in none of the logs"
                   "found": found}
    return {"schema": SCHEMA, "tool": "pdfsm replay", "exit_code": exit_code,
            "logs": [_log_json(log, s, at, timelines) for log, s, at in zip(logs, summaries, ats, strict=True)],
            "request": request, "error": None}


# --- the command ------------------------------------------------------------------------------------------


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", metavar="LOG", type=log_path,
                   help="a log directory, a segment file, or a directory of worker logs (pdfsm demo --log-dir)")
    p.add_argument("--at", action="append", default=[], metavar="SEQ|LOG:SEQ",
                   help="each machine's state after record SEQ (of every log; LOG:SEQ for one log; repeatable)")
    p.add_argument("--request", metavar="ID",
                   help="one request's merged timeline across the logs (decode-local or producer id)")
    p.add_argument("--timelines", type=int, default=8, metavar="N", help="per-request timelines to print (8)")
    p.add_argument("--limit", type=int, default=20, metavar="N", help="violations and stuck requests listed (20)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout (docs/replay-json.md)")
    p.add_argument("--repair", action="store_true",
                   help="cut a torn tail off the file (a copy is kept); by default the file is left alone")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: when stdout and stderr are terminals, never with --json)")


_MAX_SEQ: Final = 2**63 - 1


def _resolve_at(specs: Sequence[str], names: Sequence[str]) -> list[int | None] | str:
    """Per log, the seq to stop at (None: the end), or an error message."""
    default: int | None = None
    per: dict[str, int] = {}
    for spec in specs:
        name, _, seq = spec.rpartition(":")
        # str.isdigit alone takes "²", which int() refuses; and int() refuses over 4300 digits.
        # Sequence numbers are int64: a larger one would go into --json as an integer readers refuse.
        if not (seq.isascii() and seq.isdigit()) or len(seq) > 20 or int(seq) > _MAX_SEQ:
            return f"--at {spec[:80]!r}: expected SEQ or LOG:SEQ with SEQ an integer from 0 to {_MAX_SEQ}"
        if not name and spec.startswith(":"):  # ":5" names a log by "" (no log is): not a bare SEQ
            return f"--at {spec[:80]!r}: no log name before ':' (SEQ alone applies to every log)"
        if not name:
            default = int(seq)
        elif name not in names:
            return f"--at {spec!r}: no log named {name!r} (logs: {', '.join(names)})"
        else:
            per[name] = int(seq)
    return [per.get(n, default) for n in names]


def print_replay(logs: Sequence[LoadedLog], *, out: Callable[[str], None] | None = None, timelines: int = 8,
                 limit: int = 20, ats: Sequence[int | None] | None = None, request: str | None = None,
                 as_json: bool = False) -> int:
    """Print what ``pdfsm replay`` prints for logs already loaded (and verified); returns the exit code.
    ``out`` takes each line (:func:`say` by default)."""
    out = out or say
    ats = list(ats) if ats is not None else [None] * len(logs)
    failing = [log for log in logs if log.exit_code != Exit.OK]
    code = int(failing[0].exit_code) if failing else 0
    summaries = [summarize(log.records, at=at) for log, at in zip(logs, ats, strict=True)]
    followed = follow([(log.name, log.records) for log in logs], request) if request is not None else None
    found = followed is not None and bool(followed.entries)
    if followed is not None and not found and not code:
        code = Exit.USAGE
    if followed is not None:  # --at cuts the request's timeline as it cuts each log's summary
        _cut(followed, {log.name: at for log, at in zip(logs, ats, strict=True)})
    if as_json:
        doc = to_json(logs, summaries, ats, followed, timelines=timelines, exit_code=code, found=found)
        out(json.dumps(doc, indent=2))
        return code
    for log, summary, at in zip(logs, summaries, ats, strict=True):
        for line in _log_text(log, None if log.status == "no_log" else summary, timelines=timelines, limit=limit,
                              brief=followed is not None):
            out(line)
        for line in _at_text(log, summary, at):
            out(line)
    if followed is not None:
        for line in _request_text(logs, followed, found=found):
            out(line)
    return code


def _cut(followed: Followed, ats: dict[str, int | None]) -> None:
    """Leave out the followed records past their log's ``--at`` seq. The request is resolved on
    the whole logs first: which requests an id names does not depend on where they are shown."""
    followed.entries = [(name, rec) for name, rec in followed.entries
                        if (at := ats.get(name)) is None or rec.seq <= at]


def _at_note(log: LoadedLog, at: int | None) -> str | None:
    """Why the log is not shown at ``at`` itself: the seq is outside the records read (one line;
    the exit code does not change: the log is shown at its nearest end)."""
    if at is None or not log.records:
        return None
    first, last = log.records[0].seq, log.records[-1].seq
    if at < first:
        return f"--at {at}: the log starts at seq {first}; the machines' states before it are not in it"
    return f"--at {at}: the log ends at seq {last}" if at > last else None


def _at_text(log: LoadedLog, summary: Summary, at: int | None) -> Iterator[str]:
    note = _at_note(log, at)
    if note is not None:
        yield f"  ({note})"
    if at is not None and log.records and at >= log.records[0].seq:
        yield from _machines_at(log, summary)


def _request_text(logs: Sequence[LoadedLog], followed: Followed, *, found: bool) -> Iterator[str]:
    lines = _follow_text(followed)
    yield next(lines)
    yield from (f"  warning: {w}" for w in _mixed_runs(logs, followed))
    yield from lines
    if not found:
        yield f"  request {followed.query!r} is in none of the logs (as a decode-local id or a producer id)"
    elif not followed.entries:
        yield "  (none of its records is at or before --at)"


def _worker(log: LoadedLog) -> tuple[str, int, int] | None:
    cfg = log.config
    return None if cfg is None else (cfg.engine_id, cfg.pp_rank, cfg.tp_rank)


def _mixed_runs(logs: Sequence[LoadedLog], followed: Followed) -> list[str]:
    """A warning (one line) when the followed request's records come from several logs of one
    worker (same engine id and ranks): logs of two runs, or of a restart under the same engine
    id, or copies, named together. Their records merge into one timeline as if of one request,
    and the clocks of two runs need not be comparable."""
    named = {name for name, _ in followed.entries}
    same: dict[tuple[str, int, int], list[LoadedLog]] = {}
    for log in logs:
        worker = _worker(log)
        if log.name in named and worker is not None:
            same.setdefault(worker, []).append(log)
    clashes = [f"{', '.join(log.name for log in group)} (engine {engine} pp_rank {pp} tp_rank {tp}; {_headers(group)})"
               for (engine, pp, tp), group in same.items() if len(group) > 1]
    out = []
    if clashes:
        out.append(printable("logs of one worker from different runs (or restarts, or copies) are merged into this "
                             f"timeline: {'; '.join(clashes)}; name one run's logs to follow the request in it"))
    return out + _other_holds(logs, followed)


def _other_holds(logs: Sequence[LoadedLog], followed: Followed) -> list[str]:
    """A warning when the followed request's params name a hold none of the followed producer logs
    made: their issue time matches no hold's (within its log's hold_skew_ns). The decode logs of
    one run and the prefill logs of another merged into a story that never happened (found by a
    helper's review); the same ids recur from run to run, the issue times do not."""
    asked = {r.event.issued_wall_ns for _, r in followed.entries
             if isinstance(r.event, ReadRequested) and r.event.issued_wall_ns}
    skew = {log.name: log.config.hold_skew_ns for log in logs if log.config is not None}
    held = [(name, r.event.issued_wall_ns) for name, r in followed.entries
            if isinstance(r.event, BlocksHeld) and r.event.issued_wall_ns]
    made = {name for name, t in held if any(abs(t - a) <= skew.get(name, 0) for a in asked)}
    far = sorted({name for name, _ in held} - made)  # a log holding the id again later still made it
    if not asked or not far:
        return []
    return [printable(f"the decode side read params issued at {', '.join(map(str, sorted(asked)))} (wall clock, ns), "
                      f"a hold that {', '.join(far)} never made: logs of different runs named together? Name one "
                      "run's logs to follow the request in it")]


def _headers(group: Sequence[LoadedLog]) -> str:
    """How the logs' segment headers tell them apart: the writer's pid, else its creation time."""
    pids = [log.meta.get("pid") for log in group]
    if len(set(pids)) > 1:
        return "pids " + ", ".join(str(pid) for pid in pids)
    created = {log.meta.get("created_ns") for log in group}
    return "created at different times" if len(created) > 1 else "identical headers: copies of one log?"


def write_output(path: str, text: str, command: str) -> bool:
    """Write a command's output file, whole or not at all: through a file beside it, renamed over
    it, so a failure leaves an earlier file as it was. A link or what is not a plain file (a
    device such as /dev/stdout, a pipe) is written in place. On failure say why in one line
    (the caller exits 2). ``-`` is stdout, as for other tools."""
    if path == "-":
        return _write_stdout(text, command)
    target = temp = Path(path)
    direct = True
    try:
        direct = target.is_symlink() or (target.exists() and not target.is_file())
        if not direct:
            temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        temp.write_text(text, encoding="utf-8")  # the page says utf-8, whatever the locale
        if not direct:
            temp.replace(target)
    except (OSError, UnicodeError) as e:
        if not direct:
            with contextlib.suppress(OSError):
                temp.unlink()
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"{command}: cannot write {printable(path)}: {printable(why)}", file=sys.stderr)
        return False
    return True


def _write_stdout(text: str, command: str) -> bool:
    """``-o -``: the whole text to stdout, or one line saying why not (a reader that left is no
    failure: the command goes on to its exit code, as replay's output does)."""
    try:
        if sys.stdout is None:
            raise OSError(errno.EBADF, "stdout is closed")
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        reader_left()
    except OSError as e:
        print(f"{command}: cannot write -: {printable(e.strerror or str(e))}", file=sys.stderr)
        return False
    return True


def say_written(path: str, line: str) -> None:
    """The line saying what a command wrote: on stdout, unless the file itself went there (``-o -``)."""
    if path == "-":
        print(line, file=sys.stderr)
    else:
        say(line)


def reader_left() -> None:
    """Point stdout at /dev/null: its reader has gone (``pdfsm replay LOG | head``). What is left
    to print goes nowhere, and the command goes on to its exit code, which the reader leaving
    does not change."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.stdout.fileno())
    finally:
        os.close(null)


def say(line: str) -> None:
    """print() for a command's stdout: once its reader has gone, :func:`reader_left`."""
    try:
        print(line)
    except BrokenPipeError:
        reader_left()


def replay_command(args: argparse.Namespace) -> int:
    """``pdfsm replay``: read, replay, summarize; the exit code says whether the logs hold up."""
    names = [name for name, _ in expand(args.logs)]
    ats = _resolve_at(args.at, names)
    if args.timelines < 0 or args.limit < 0:
        ats = "--timelines and --limit must be >= 0"
    if isinstance(ats, str):  # a usage error, found before any log is read: --json still prints its document
        print(f"pdfsm replay: {ats}", file=sys.stderr)
        if args.json:
            say(json.dumps({**to_json([], [], [], None, timelines=0, exit_code=Exit.USAGE), "error": ats}))
        return Exit.USAGE
    progress = make_progress(args.progress, json_mode=args.json)
    logs = load_all(args.logs, repair=args.repair, progress=progress)
    code = print_replay(logs, timelines=args.timelines, limit=args.limit, ats=ats, request=args.request,
                        as_json=args.json)
    for log in logs:
        if log.status == "torn_tail":
            print(f"pdfsm replay: {log.name}: torn tail at byte {log.torn and log.torn['offset']} "
                  f"({'repaired' if log.torn and log.torn['repaired'] else 'file left as it is'}); exit 0",
                  file=sys.stderr)
        elif log.exit_code:
            print(f"pdfsm replay: {log.name}: {printable(log.error.splitlines()[0])} (exit {int(log.exit_code)})",
                  file=sys.stderr)
    if code == Exit.USAGE:
        print(printable(f"pdfsm replay: request {args.request!r} is in none of the logs"), file=sys.stderr)
    return code
