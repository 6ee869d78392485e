"""Divergence detection and determinism of ``pdfsm replay`` on edited logs.

Each log is built in-process by a real core, then its *records* are edited (never the bytes: the
CRC would catch that) and written back as a well-formed segment, as a buggy or different engine
would have written them. Sequence numbers (and the ``cause`` links to them) are renumbered after
an insertion or a removal, so the reader sees a contiguous, CRC-valid log and only replay can tell.

Promises checked:
- docs/postmortem.md: replay "rebuilds every machine from the root events and checks that each
  recorded outcome comes out again (a *divergence* names the first record that does not)";
  exit 3 is a divergence; exit 0 only when every log replays.
- pdfsm/events.py module docstring: events whose ``DERIVED`` flag is set "are produced by the
  core itself ...; the log records them with the sequence number of the event that caused them,
  and replay regenerates them instead of reading them".
- pdfsm/log.py ``EventLog.submit``: derived events are refused, "an adapter that could submit a
  ``Reported`` or an ``EngineReady`` could forge them".
- pdfsm/replay.py: "Only root events (records without a ``cause``) are fed back; the core
  derives the rest"; "Replay is deterministic".
- docs/log-format.md / docs/postmortem.md: a log trimmed by ``keep_segments`` "is summarized but
  not replayed" (exit 0, a ``note:``); the config comes from the ``Started`` record.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import child_env, ev, handshake, read, reply, run_cli_captured

from pdfsm.core import Core
from pdfsm.errors import ProtocolError
from pdfsm.events import (
    AbortRequested,
    BlocksHeld,
    Collect,
    CoreConfig,
    EngineReady,
    HandleDone,
    HandshakeDone,
    LeaseExpired,
    NotificationReceived,
    PeerAdded,
    Reported,
    Tick,
)
from pdfsm.filelog import segment_name, write_segment
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.fsm import Fault
from pdfsm.log import EventLog, MemorySink, Outcome, Record
from pdfsm.replay import QuietLogger

rep = msgspec.structs.replace


def _core(**cfg: Any) -> tuple[Core, MemorySink]:
    sink = MemorySink()
    core = Core(CoreConfig(**{"engine_id": "D", "compat_hash": "h", **cfg}), EventLog(sink=sink), t_ns=0,
                logger=QuietLogger())
    return core, sink


def _apply(core: Core, e: Any) -> None:
    with contextlib.suppress(ProtocolError):  # strict cores raise after recording
        core.apply(e)


def _busy() -> list[Record]:
    """Seqs: 0 Started, 1 Read a, 2 EngineWanted, 3 Read b, 4 EngineWanted, 5 HandshakeDone,
    6 PeerAdded, 7/8 EngineReady a/b, 9 HandleDone a, 10 BlocksHeld p, 11 HandleDone a (NOTIFIED),
    12 Abort b, 13 Notification p (RELEASED), 14 BlocksHeld q, 15 Tick, 16 LeaseExpired q
    (cause 15), 17 Collect, 18 Reported a (cause 17)."""
    core, sink = _core(lease_ns=500)
    core.apply(read("a", remote_tp=2, t=1))
    core.apply(read("b", remote_tp=2, t=2))
    handshake(core, tp_size=2, t=3)
    core.apply(ev(HandleDone, 5, request_id="a", pp_rank=0, tp_rank=1))
    core.apply(ev(BlocksHeld, 6, request_id="p", block_ids=(1,)))
    core.apply(ev(HandleDone, 6, request_id="a", pp_rank=0, tp_rank=0))
    core.apply(ev(AbortRequested, 7, request_id="b"))
    core.apply(ev(NotificationReceived, 9, request_id="p", part=0, of=1))
    core.apply(ev(BlocksHeld, 9, request_id="q", block_ids=(2,)))
    core.apply(ev(Tick, 10_000))
    core.apply(ev(Collect, 20, step=1))
    core.log.flush()
    recs = sink.records
    assert [type(r.event).__name__ for r in recs][15:] == ["Tick", "LeaseExpired", "Collect", "Reported"]
    return recs


def _renumber(records: list[Record]) -> list[Record]:
    """Contiguous seqs from 0, ``cause`` links following their record."""
    new: dict[int, int] = {}
    for i, r in enumerate(records):
        new.setdefault(r.seq, i)
    return [rep(r, seq=i, cause=None if r.cause is None else new.get(r.cause, r.cause))
            for i, r in enumerate(records)]


def _write(directory: Path, records: list[Record], *, batch: int = 256) -> Path:
    directory.mkdir(parents=True)
    write_segment(directory / segment_name(records[0].seq), records, salt=bytes(8),
                  meta={"worker": directory.name}, wall_ns=0, mono_ns=0, batch_records=batch)
    return directory


def _replay(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli_captured(capsys, "replay", *argv, "--timelines", "0")


# --- 1. a derived event recorded as a root (forged) -----------------------------------------------------


def _forged_reported_at_end() -> tuple[list[Record], int]:
    # The log stops before the Collect; a Reported for 'a' follows as a root record (no cause).
    recs = _busy()[:17]
    recs.append(Record(17, Reported(source="core", t_ns=30, request_id="a"), "consumer", "NOTIFIED", "RELEASED",
                       Outcome.APPLIED))
    return recs, 17


def _forged_engine_ready() -> tuple[list[Record], int]:
    # Request 'c' waits on engine Q, which never answered; a root EngineReady moves it to READING
    # and a HandleDone completes it: the request "read" from an engine that is still HANDSHAKING.
    core, sink = _core()
    core.apply(read("c", engine="Q", t=1))
    core.log.flush()
    recs = list(sink.records)
    n = len(recs)
    recs.append(Record(n, EngineReady(source="core", t_ns=2, request_id="c", engine_id="Q", pp_rank=0),
                       "consumer", "HANDSHAKING", "READING", Outcome.APPLIED))
    recs.append(Record(n + 1, HandleDone(source="transfer", t_ns=3, request_id="c", pp_rank=0, tp_rank=0),
                       "consumer", "READING", "NOTIFIED", Outcome.APPLIED))
    return recs, n


def _forged_reported_mid_log() -> tuple[list[Record], int]:
    # A root Reported for 'a' right after it was NOTIFIED (seq 11), before any Collect.
    recs = _busy()
    forged = Record(0, Reported(source="core", t_ns=6, request_id="a"), "consumer", "NOTIFIED", "RELEASED",
                    Outcome.APPLIED)
    return _renumber([*recs[:12], forged, *recs[12:]]), 12


def _forged_lease_expired_mid_log() -> tuple[list[Record], int]:
    # A root LeaseExpired for producer 'p' while it holds (seq 10), with no Tick that found it due.
    recs = _busy()
    forged = Record(0, LeaseExpired(source="core", t_ns=6, request_id="p"), "producer", "HOLDING", "EXPIRED",
                    Outcome.APPLIED, "lease expired before every consumer part notified", Fault.REMOTE)
    return _renumber([*recs[:11], forged, *recs[11:]]), 11


@pytest.mark.parametrize("build", [_forged_reported_at_end, _forged_engine_ready, _forged_reported_mid_log,
                                   _forged_lease_expired_mid_log],
                         ids=["reported-at-end", "engine-ready", "reported-mid-log", "lease-expired-mid-log"])
def test_a_derived_event_recorded_without_a_cause_is_a_divergence_at_that_record(
        build: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """events.py: derived events are "produced by the core itself" and recorded "with the sequence
    number of the event that caused them, and replay regenerates them instead of reading them";
    log.py: an adapter that could submit a Reported or an EngineReady "could forge them", so
    EventLog.submit refuses them. A live core therefore never records a DERIVED event with
    ``cause`` None. Replay must call such a record a divergence (exit 3) naming it (postmortem.md:
    "a *divergence* names the first record that does not [come out again]")."""
    records, forged_seq = build()
    assert records[forged_seq].cause is None and records[forged_seq].event.DERIVED
    log = _write(tmp_path / "forged", records)
    code, out, err = _replay(capsys, str(log))
    assert code == 3, out + err
    assert f"divergence at seq {forged_seq}:" in out, out


# --- 2. edited records: every kind is a divergence at the first differing record --------------------------


def _edit(name: str) -> tuple[list[Record], int]:
    r = _busy()
    if name == "fault":
        r[16] = rep(r[16], fault=Fault.LOCAL)
        return r, 16
    if name == "outcome":
        r[9] = rep(r[9], outcome=Outcome.IGNORED)
        return r, 9
    if name == "reason":
        r[16] = rep(r[16], reason="lease expired")
        return r, 16
    if name == "cause":
        r[18] = rep(r[18], cause=15)
        return r, 18
    if name == "derived-made-root":
        r[16] = rep(r[16], cause=None)
        return r, 16
    if name == "duplicate-root":
        return _renumber([*r[:10], r[9], *r[10:]]), 10
    if name == "duplicate-last-derived":
        return _renumber([*r, rep(r[18], seq=19)]), 19
    if name == "drop-root-keep-derived":  # PeerAdded gone, its EngineReady records kept
        return _renumber([*r[:6], *r[7:]]), 6
    if name == "swap-derived-of-two-machines":  # EngineReady b before EngineReady a
        return _renumber([*r[:7], r[8], r[7], *r[9:]]), 7
    if name == "later-block-time":  # q held later: the Tick no longer expires it
        r[14] = rep(r[14], event=rep(r[14].event, t_ns=9_900))
        return r, 16
    if name == "other-tp-rank":  # the first completion names rank 0: the real rank-0 one repeats it
        r[9] = rep(r[9], event=rep(r[9].event, tp_rank=0))
        return r, 11
    if name == "rejected-recorded-applied":  # a completion for an unknown request, "applied"
        forged = Record(0, HandleDone(source="transfer", t_ns=8, request_id="ghost", pp_rank=0, tp_rank=0),
                        "consumer", "READING", "NOTIFIED", Outcome.APPLIED)
        return _renumber([*r[:13], forged, *r[13:]]), 13
    raise AssertionError(name)


EDITS = ["fault", "outcome", "reason", "cause", "derived-made-root", "duplicate-root", "duplicate-last-derived",
         "drop-root-keep-derived", "swap-derived-of-two-machines", "later-block-time", "other-tp-rank",
         "rejected-recorded-applied"]


@pytest.mark.parametrize("name", EDITS)
def test_an_edited_record_is_a_divergence_naming_the_first_differing_seq(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """postmortem.md: exit 3, "the message names the seq, the field, the recorded and the
    recomputed record"; never exit 0, never a traceback."""
    records, first = _edit(name)
    log = _write(tmp_path / name, records, batch=4)
    code, out, err = _replay(capsys, str(log))
    assert code == 3, out + err
    assert f"divergence at seq {first}:" in out and "Traceback" not in out + err
    assert f"divergence at seq {first}" in err and "exit 3" in err


# --- 3. logs of non-default configurations replay clean ----------------------------------------------------


def _config_log(cfg: dict[str, Any]) -> list[Record]:
    core, sink = _core(**cfg)
    _apply(core, read("a", remote_tp=2, remote_pp=2, t=1))
    _apply(core, read("b", remote_tp=2, remote_pp=2, t=1))
    for pp in (0, 1):
        _apply(core, ev(HandshakeDone, 3, engine_id="P", pp_rank=pp, attempt=1,
                        reply=reply("P", tp_size=2, pp_rank=pp, pp_size=2, mla=core.config.mla,
                                    block_size=core.config.block_size)))
        _apply(core, ev(PeerAdded, 3, engine_id="P", pp_rank=pp, attempt=1))
    for src in core.plan(2, 2).sources:
        _apply(core, ev(HandleDone, 5, request_id="a", pp_rank=src.pp_rank, tp_rank=src.tp_rank))
        _apply(core, ev(HandleDone, 5, request_id="a", pp_rank=src.pp_rank, tp_rank=src.tp_rank))  # again
    for i in range(4):  # producers finished and forgotten (few, short-lived tombstones)
        _apply(core, ev(BlocksHeld, 10 + i, request_id=f"p{i}", block_ids=(i,)))
        _apply(core, ev(NotificationReceived, 11 + i, request_id=f"p{i}", part=0, of=1))
    _apply(core, ev(NotificationReceived, 40, request_id="p0", part=0, of=1))  # late: forgotten or not
    _apply(core, ev(NotificationReceived, 41, request_id="x", part=0, of=1))
    _apply(core, ev(Tick, 60))
    _apply(core, ev(Collect, 70, step=1))
    _apply(core, ev(Tick, 10**12))
    core.log.flush()
    return sink.records


CONFIGS: dict[str, dict[str, Any]] = {
    "strict-mla-tp": {"strict": True, "mla": True, "tp_size": 2, "tp_rank": 1, "tombstones": 1, "tombstone_ns": 1},
    "pp-stage": {"tp_size": 2, "pp_size": 2, "pp_rank": 1, "lease_ns": 30, "lease_margin_ns": 3},
    "custom-timeouts": {"tp_size": 4, "tp_rank": 3, "read_timeout_ns": 50, "handshake_retry_ns": 7, "block_size": 32,
                        "policy": "fail", "max_staged": 1, "tombstones": 2, "tombstone_ns": 5},
}


def test_logs_of_non_default_configs_replay_clean_from_their_started_record(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """postmortem.md: exit 0 when every log replays; the core is rebuilt from the Started record's
    config (replay.py), so strict mode, MLA, PP/TP ranks, custom timeouts and small tombstones
    must all come out again."""
    for name, cfg in CONFIGS.items():
        records = _config_log(cfg)
        assert any(r.fault is not None for r in records)
        _write(tmp_path / "logs" / name, records, batch=3)
    code, out, err = _replay(capsys, str(tmp_path / "logs"))
    assert code == 0, out + err
    assert out.count("replayed, no divergence") == len(CONFIGS), out


# --- 4. determinism across processes, a trimmed log included -----------------------------------------------


def test_json_is_byte_identical_across_processes_with_different_hash_seeds(tmp_path: Path) -> None:
    """replay.py: "Replay is deterministic"; the task's bar: replaying twice gives identical
    output. Sets and hashes must not leak into the output: two processes with different
    PYTHONHASHSEED print the same bytes. A log trimmed by keep_segments is among them (exit 0,
    "not replayed" per log-format.md)."""
    logs = tmp_path / "logs"
    for name in ("decode-a", "decode-b"):
        _write(logs / name, _busy(), batch=5)
    sink = FileSink(logs / "trimmed", segment_bytes=4096, keep_segments=2, fsync=FsyncPolicy.never(),
                    metadata={"worker": "trimmed"})
    core = Core(CoreConfig(engine_id="P", strict=True, lease_ns=100, tombstones=2), EventLog(sink=sink),
                logger=QuietLogger())
    for i in range(200):
        _apply(core, ev(BlocksHeld, 10 * i, request_id=f"p{i}", block_ids=(1, 2)))
        _apply(core, ev(NotificationReceived, 10 * i + 1, request_id=f"p{i}", part=0, of=1))
        _apply(core, ev(Tick, 10 * i + 3))
    core.log.flush()
    sink.close()
    runs = []
    for seed in ("1", "2"):
        for extra in ([], ["--request", "a"], ["--at", "9"]):
            r = subprocess.run([sys.executable, "-m", "pdfsm.cli", "replay", str(logs), "--json", *extra],
                               capture_output=True, env=child_env(PYTHONHASHSEED=seed), check=False, timeout=60)
            runs.append((tuple(extra), r.returncode, r.stdout))
    half = len(runs) // 2
    assert runs[:half] == runs[half:]
    assert all(code == 0 for _, code, _ in runs)
    assert b"not replayed: the log starts at seq" in runs[0][2]
