"""Replay across the recent event and table changes, and of the on-call CLI on bad input.

Old logs are built the way the older pdfsm wrote them: rows re-encoded by hand with the older
field counts (ReadRequested without ``incarnation_pp``), or records made by a core running the
older table cell, which is exactly what the previous commit's code recorded (checked by hand
against ``git archive`` copies of 55187f0 and a8f565f).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import run_cli_captured, write_worker_log

from pdfsm import consumer
from pdfsm.core import Core, Tables
from pdfsm.events import (
    BlocksHeld,
    CoreConfig,
    EngineReady,
    HandleDone,
    HandshakeDone,
    HandshakeReply,
    NotificationReceived,
    PeerAdded,
    RankInfo,
    ReadRequested,
    Started,
)
from pdfsm.filelog import (
    SCHEMA_VERSION,
    encode_frame,
    encode_header,
    read_header,
    read_log,
    segment_name,
    segment_paths,
    write_segment,
)
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.log import EventLog, MemorySink, Record
from pdfsm.replay import TERMINAL, QuietLogger, replay, summarize

S = 1_000_000_000
GOLDEN = Path(__file__).parent / "golden"


def _core(sink: MemorySink, tables: Tables | None = None, **cfg: Any) -> Core:
    return Core(CoreConfig(**{"engine_id": "D", "compat_hash": "h", **cfg}), EventLog(sink=sink), t_ns=0,
                tables=tables, logger=QuietLogger())


def _write_raw(directory: Path, raw_rows: list[list[Any]], *, schema: int = SCHEMA_VERSION) -> Path:
    """One segment of plain msgpack rows, as a writer of ``schema`` would have framed them."""
    directory.mkdir(parents=True, exist_ok=True)
    header, prev = encode_header(raw_rows[0][0], bytes(8), {"engine_id": "D"})
    payload = msgspec.msgpack.encode(raw_rows)
    head, _ = encode_frame(payload, len(raw_rows), raw_rows[0][0], prev, wall_ns=0, mono_ns=0, schema=schema)
    (directory / segment_name(raw_rows[0][0])).write_bytes(header + head + payload)
    return directory


def _raw(records: list[Record]) -> list[list[Any]]:
    """Rows as plain msgpack values (bytes stay bytes), to edit as an older writer laid them out."""
    rows: list[list[Any]] = msgspec.msgpack.decode(msgspec.msgpack.encode(records))
    return rows


# --- logs written before the recent changes ---------------------------------------------------------------


def test_golden_logs_of_every_schema_replay_clean_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: `pdfsm replay tests/golden/v1.pdlog tests/golden/v2.pdlog` (released layouts:
    ReadRequested without incarnation/incarnation_pp, RankInfo without incarnation).
    Expected: both decode, replay with no divergence (exit 0) and report their 4 violations."""
    code, out, err = run_cli_captured(capsys, "replay", str(GOLDEN / "v1.pdlog"), str(GOLDEN / "v2.pdlog"),
                                      "--timelines", "0")
    assert code == 0, out + err
    assert out.count("replayed, no divergence") == 2
    assert out.count("violations: 4 (local 2, remote 2)") == 2


def test_rows_with_older_and_newer_event_field_counts_decode_and_replay(tmp_path: Path) -> None:
    """Scenario: a schema-2 log whose ReadRequested arrays stop after ``remote_blocks`` (written
    before deadline/lease/incarnation fields existed), and whose HandleDone carries one trailing
    element this reader does not know (a newer writer added a defaulted field at the end of a leaf
    class, which docs/log-format.md says needs no schema bump). Expected: the missing fields read
    as their defaults, the extra element is ignored, and the log replays with no divergence."""
    sink = MemorySink()
    core = _core(sink)
    core.apply(ReadRequested(source="scheduler", t_ns=S, request_id="d-1", remote_request_id="p-1",
                             engine_id="P", local_blocks=(1,), remote_blocks=(7,)))
    reply = HandshakeReply(engine_id="P", compat_hash="h", tp_size=1, ranks=(RankInfo(pp_rank=0, tp_rank=0,
                                                                                       agent="P-0"),))
    core.apply(HandshakeDone(source="handshake", t_ns=S, engine_id="P", pp_rank=0, attempt=1, reply=reply))
    core.apply(PeerAdded(source="handshake", t_ns=S, engine_id="P", pp_rank=0, attempt=1))
    core.apply(HandleDone(source="transfer", t_ns=2 * S, request_id="d-1", pp_rank=0, tp_rank=0))
    core.log.flush()
    rows = _raw(sink.records)
    n_fields = len(msgspec.structs.fields(ReadRequested))
    for row in rows:
        if row[1][0] == "ReadRequested":
            assert len(row[1]) == 1 + n_fields
            row[1] = row[1][:1 + n_fields - 5]  # no deadline, lease_ns, lease_start_ns, incarnation(_pp)
        if row[1][0] == "HandleDone":
            row[1] = [*row[1], "a field from a newer writer"]
    # DROPPABLE is a ClassVar: never on disk (HandleDone is tag, source, t_ns, request_id, pp_rank, tp_rank)
    assert len(msgspec.msgpack.decode(msgspec.msgpack.encode(sink.records[-1].event))) == 6
    got = read_log(_write_raw(tmp_path / "fields", rows))
    assert got == sink.records
    replay(got)


def _pp2_read_minted_by_stage1(incarnation: str) -> list[Record]:
    """A decode core reading a PP-2 producer whose params were minted by stage 1 (what the demo's
    PP producers do: `pdfsm demo --prefill-pp 2` logs incarnation_pp=1)."""
    sink = MemorySink()
    core = _core(sink)
    core.apply(ReadRequested(source="scheduler", t_ns=S, request_id="d-1", remote_request_id="p-1",
                             engine_id="P", remote_pp=2, local_blocks=(1, 2), remote_blocks=(5, 6),
                             lease_ns=60 * S, incarnation=incarnation))
    for pp in (0, 1):
        reply = HandshakeReply(engine_id="P", compat_hash="h", tp_size=1, pp_size=2,
                               ranks=(RankInfo(pp_rank=pp, tp_rank=0, agent=f"P-{pp}", incarnation=f"inc-s{pp}"),))
        core.apply(HandshakeDone(source="handshake", t_ns=2 * S, engine_id="P", pp_rank=pp, attempt=1, reply=reply))
        core.apply(PeerAdded(source="handshake", t_ns=2 * S, engine_id="P", pp_rank=pp, attempt=1))
    core.log.flush()
    return sink.records


def test_a_pp2_log_written_before_incarnation_pp_replays_without_divergence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: a healthy decode log written by pdfsm before ReadRequested.incarnation_pp existed
    (55187f0): a read from a PP-2 producer whose params name the incarnation of the stage-1 rank
    that minted them (`remote_incarnation`, no `remote_incarnation_pp`). That pdfsm judged the
    incarnation against every stage's reply, found it, and read (READING). The row has the old
    field count: no incarnation_pp element.
    Expected: it decodes and replays with no divergence (the missing field must mean 'not said',
    as the older writer meant). pdfsm fills incarnation_pp=0, judges the params by stage 0 alone,
    recomputes FAILED with a remote 'producer restarted' fault and reports a divergence at the
    EngineReady record (exit 3); the same happens to real `pdfsm demo --prefill-pp 2` logs of 55187f0."""
    # The records that pdfsm wrote: with the incarnation unchecked, the machines go the same way.
    records = _pp2_read_minted_by_stage1("")
    assert records[-1].state == "READING"
    rows = _raw(records)
    fields = ["type", *ReadRequested.__struct_fields__]  # the event's array: its class, then its fields
    for row in rows:
        if row[1][0] == "ReadRequested":
            row[1][fields.index("incarnation")] = "inc-s1"  # as the params said
            del row[1][fields.index("incarnation_pp"):]  # no incarnation_pp nor any later field: none existed
    log = _write_raw(tmp_path / "decode-pp0-tp0", rows)
    got = read_log(log)[1].event
    assert isinstance(got, ReadRequested) and got.incarnation == "inc-s1" and got.incarnation_pp is None
    code, out, err = run_cli_captured(capsys, "replay", str(log), "--timelines", "0")
    assert code == 0 and "replayed, no divergence" in out, out + err


def _contradicted_notify_only_ready_late(core: Core) -> None:
    """A notify-only load whose params say TP 2; the producer's reply says TP 1, and the engine is
    ready only after the lease's trust bound."""
    core.apply(ReadRequested(source="scheduler", t_ns=S, request_id="d-1", remote_request_id="p-1", engine_id="P",
                             remote_tp=2, local_blocks=(), remote_blocks=(), lease_ns=5 * S))
    reply = HandshakeReply(engine_id="P", compat_hash="h", tp_size=1, ranks=(RankInfo(pp_rank=0, tp_rank=0,
                                                                                       agent="P-0"),))
    core.apply(HandshakeDone(source="handshake", t_ns=6 * S, engine_id="P", pp_rank=0, attempt=1, reply=reply))
    core.apply(PeerAdded(source="handshake", t_ns=6 * S, engine_id="P", pp_rank=0, attempt=1))
    core.log.flush()


def test_a_log_written_by_the_table_before_drop_lease_over_when_ready_replays(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: a decode log from pdfsm a8f565f (before HANDSHAKING + EngineReady -> RELEASED via
    _drop_lease_over_when_ready): a notify-only request whose params say TP 2 while the producer's
    reply says TP 1, and whose engine became ready after the lease's trust bound. That table
    recorded RELEASED with a remote fault ('the params say P has TP 2 ...'); the records are made
    here by a core whose cell lacks the new option, which is that table.
    Expected: replays with no divergence (the contradiction is still a remote violation whether or
    not the lease is also over). pdfsm takes the new lease-over option first, recomputes the record
    with no fault and no reason, and reports 'divergence at seq 5: reason differs' (exit 3)."""
    cell = consumer.TABLE.cells[(consumer.S.HANDSHAKING, EngineReady)]
    older = tuple(o for o in cell if getattr(o, "action", None) is not consumer._drop_lease_over_when_ready)
    assert len(older) == len(cell) - 1
    tables = Tables(consumer=consumer.TABLE.patched("a8f565f", {(consumer.S.HANDSHAKING, EngineReady): older}))
    sink = MemorySink()
    core = _core(sink, tables)
    _contradicted_notify_only_ready_late(core)
    assert sink.records[-1].fault is not None and "TP 2" in sink.records[-1].reason
    log = write_worker_log(tmp_path / "decode-pp0-tp0", sink.records)
    code, out, err = run_cli_captured(capsys, "replay", str(log), "--timelines", "0")
    assert code == 0 and "replayed, no divergence" in out, out + err


def test_contradicted_notify_only_params_stay_a_remote_violation_when_the_lease_is_also_over() -> None:
    """Scenario (current code): a notify-only request waits in HANDSHAKING; the producer's reply
    says TP 1 where the params said TP 2 (a router/producer fault), and the engine becomes ready
    after the lease's trust bound. Expected: the log still records a remote violation naming the
    contradiction (it is what a postmortem looks for: the same request with the lease not over is
    recorded so). pdfsm records a plain HANDSHAKING -> RELEASED with no fault and no reason, so
    `pdfsm replay` lists 0 violations."""
    sink = MemorySink()
    core = _core(sink)
    _contradicted_notify_only_ready_late(core)
    last = sink.records[-1]
    assert (last.machine, last.before, last.state) == ("consumer", "HANDSHAKING", "RELEASED")
    assert summarize(sink.records).by_fault()["remote"] == 1, last


# --- the log names what wrote it ----------------------------------------------------------------------


def test_a_log_says_which_pdfsm_wrote_it(tmp_path: Path) -> None:
    """Scenario: docs/postmortem.md says a divergence means the log was edited 'or the code that
    replays it is not the code that wrote it (replay on the same pdfsm version the engine ran)'.
    The two tests above show that a table or field-meaning change makes an old, untouched log
    diverge. Expected: the log records the pdfsm version (or a fingerprint of its tables) that
    wrote it, in the segment header metadata or the Started record, so the on-call can tell a
    changed replayer from an edited log. pdfsm writes only created_ns, pid and the caller's keys."""
    from importlib.metadata import version

    sink = FileSink(tmp_path / "w", fsync=FsyncPolicy.never(), metadata={"worker": "w"})
    log = EventLog(sink=sink)
    Core(CoreConfig(engine_id="D"), log, logger=QuietLogger())
    log.close()
    meta = read_header(segment_paths(tmp_path / "w")[0]).meta
    started = read_log(tmp_path / "w")[0].event
    assert isinstance(started, Started)
    said = {str(v) for v in meta.values()} | {str(started.format)}
    assert version("pdfsm") in said or any("pdfsm" in str(k).lower() for k in meta), meta


# --- mixed, newer and mistaken inputs ------------------------------------------------------------------


def _rotated_prefill(directory: Path, worker: str, tp_rank: int, t0: int) -> list[Path]:
    sink = FileSink(directory, segment_bytes=4096, batch_records=4, fsync=FsyncPolicy.never(),
                    metadata={"worker": worker, "engine_id": "P"})
    log = EventLog(sink=sink)
    core = Core(CoreConfig(engine_id="P", tp_rank=tp_rank, tp_size=2, lease_ns=10**12), log, t_ns=t0,
                logger=QuietLogger())
    for i in range(120):
        core.apply(BlocksHeld(source="scheduler", t_ns=t0 + i * 10, request_id=f"p-{i}", block_ids=(i,)))
        core.apply(NotificationReceived(source="notify", t_ns=t0 + i * 10 + 5, request_id=f"p-{i}", part=0, of=1,
                                        sender="d"))
        log.flush()
    log.close()
    return segment_paths(directory)


def test_a_segment_of_another_workers_log_mixed_into_a_log_is_refused(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: two prefill TP ranks rotate their logs at the same seqs; while gathering logs from
    two hosts, prefill-tp1's segment 00..52.pdlog overwrites prefill-tp0's. The headers say so
    (meta worker 'prefill-tp1' vs 'prefill-tp0', another created_ns).
    Expected: `pdfsm replay` refuses the log with a clear, typed error naming the segment (corrupt,
    exit 4, or another non-zero status), never 'replayed, no divergence'. pdfsm reads the frames
    (each segment's CRC chain starts at its own header), replays them on tp0's core (the two
    ranks' machines go the same way) and exits 0 with a clean summary of two workers' records."""
    a = _rotated_prefill(tmp_path / "prefill-tp0", "prefill-tp0", 0, 1000)
    b = _rotated_prefill(tmp_path / "prefill-tp1", "prefill-tp1", 1, 2000)
    # Every log's first segment has the same name (it starts at seq 0); where later ones rotate
    # depends on the writer thread's batching, so the first one is the one overwritten here.
    assert a[0].name == b[0].name and len(a) >= 3
    mixed = tmp_path / "gathered" / "prefill-tp0"
    mixed.mkdir(parents=True)
    for p in a:
        shutil.copy(p, mixed / p.name)
    shutil.copy(b[0], mixed / b[0].name)
    assert read_header(mixed / a[0].name).meta["worker"] != read_header(mixed / a[1].name).meta["worker"]
    code, out, err = run_cli_captured(capsys, "replay", str(mixed), "--timelines", "0")
    assert code != 0 and "replayed, no divergence" not in out, out + err
    assert a[1].name in out + err and "workers mixed" in out + err


def test_a_segment_of_another_run_of_the_same_worker_is_refused(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: the same worker ('prefill-tp0') ran twice, each run logging into its own directory;
    while gathering, the second run's first segment overwrites the first run's. Both headers name
    the same worker, so the worker check alone let it through and replay reported a divergence
    (an engine fault) where the log was mixed by hand.
    Expected: refused as corrupt with both log ids named; a log reopened by a new writer keeps its
    own id, so a log continued after a crash still reads whole."""
    a = _rotated_prefill(tmp_path / "run1", "prefill-tp0", 0, 1000)
    b = _rotated_prefill(tmp_path / "run2", "prefill-tp0", 0, 2000)
    ids = {read_header(p).meta["log_id"] for p in a}
    assert len(ids) == 1 and ids != {read_header(b[0]).meta["log_id"]}
    mixed = tmp_path / "gathered" / "prefill-tp0"
    mixed.mkdir(parents=True)
    for p in a:
        shutil.copy(p, mixed / p.name)
    shutil.copy(b[0], mixed / b[0].name)
    code, out, err = run_cli_captured(capsys, "replay", str(mixed), "--timelines", "0")
    assert code == 4 and "logs mixed" in out + err and a[1].name in out + err, out + err
    # A new writer on run1 (as after a crash) continues it under the same id.
    sink = FileSink(tmp_path / "run1", fsync=FsyncPolicy.never(), metadata={"worker": "prefill-tp0"})
    assert sink.metadata["log_id"] in ids
    sink.close()


def test_an_event_type_from_a_newer_pdfsm_is_unsupported_not_corrupt(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: a newer pdfsm added an event class (docs/log-format.md: no schema bump needed for
    readers that know it) and its log, intact (every CRC good), is read by this pdfsm.
    Expected: exit 5 'unsupported' telling the on-call to upgrade pdfsm, as for a newer schema
    (docs/postmortem.md: 5 = 'a format or schema newer than this pdfsm'; 4 = damage). pdfsm says
    'CORRUPT ... payload does not decode as schema 2: Invalid value ...' and exits 4, sending the
    on-call after disk damage that is not there (log-format.md documents this as 'refused loudly')."""
    rows = _raw(read_log(GOLDEN / "v2.pdlog"))
    rows.append([len(rows), ["CapacityReport", "core", 99, 3], "core", "-", "-", 0, "", None, None])
    log = _write_raw(tmp_path / "newer", rows)
    code, out, err = run_cli_captured(capsys, "replay", str(log), "--timelines", "0")
    assert code == 5, out + err
    assert "CORRUPT" not in out


def test_replay_of_a_file_that_is_not_a_segment_is_no_log(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: the on-call tab-completes the wrong file: `pdfsm replay logs/decode-pp0-tp0/writer.lock`
    (the writer's 0-byte lock file). Expected: a clear 'not a log' error with a non-zero exit (6, no
    log), as for a directory with no segments. pdfsm reports 'torn tail accepted; no records to
    replay' and exits 0, which reads as a log that is fine."""
    d = tmp_path / "decode-pp0-tp0"
    d.mkdir()
    write_segment(d / segment_name(0), read_log(GOLDEN / "v2.pdlog"),
                  salt=bytes(8), meta={}, wall_ns=0, mono_ns=0)
    (d / "writer.lock").write_bytes(b"")
    code, out, err = run_cli_captured(capsys, "replay", str(d / "writer.lock"), "--timelines", "0")
    assert code != 0, out + err
    assert "torn tail accepted" not in out


def test_one_later_segment_named_alone_is_not_said_to_be_trimmed(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: `pdfsm replay DIR/00000000000000000052.pdlog` (one later segment of a rotated log
    whose earlier segments are all there beside it). Expected: the note says the file starts at
    seq 52 and is summarized, without claiming the older segments were deleted by keep_segments.
    pdfsm says 'older segments were deleted, keep_segments', which is false here."""
    segs = _rotated_prefill(tmp_path / "prefill-tp0", "prefill-tp0", 0, 1000)
    code, out, _err = run_cli_captured(capsys, "replay", str(segs[1]), "--timelines", "0")
    assert code == 0
    assert "not replayed" in out
    assert "deleted" not in out, out


# --- a replay of a log written now, at every point ------------------------------------------------------


def _check_every_point(records: list[Record]) -> int:
    """Replay each prefix that ends a cascade and compare the rebuilt core's live machines with
    what `--at` (summarize) says; returns how many points were checked."""
    points = 0
    for k in range(len(records)):
        if k + 1 < len(records) and not records[k + 1].root:
            continue
        core = replay(records[:k + 1])
        states = summarize(records, at=records[k].seq, timelines=False).states
        live = {(name, key): m.state.name for name, key, m in core.machines()}
        for key, state in live.items():
            assert states.get(key) == state, (records[k].seq, key)
        for key, state in states.items():
            assert key in live or state in TERMINAL[key[0]], (records[k].seq, key, state)
        points += 1
    return points


def test_nixl_pp2_demo_logs_reproduce_every_machine_at_every_point(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: `pdfsm demo --prefill-pp 2 --fault drop-notification --log-dir DIR` (two processes
    over real NIXL; params minted by stage 1, so incarnation_pp=1 in every ReadRequested; a lost
    notification expires p-1's lease on the stage that lost it). Expected: `pdfsm replay DIR` exits
    0 with no divergence; at every cascade boundary the core rebuilt from the records up to there
    holds exactly the states `--at` reports, and the lease expiry is the only violation kind."""
    pytest.importorskip("transports.nixl")
    from transports.nixl import nixl_available

    if not nixl_available():
        pytest.skip("NIXL is not installed")
    from pdfsm import run as demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--requests", "6", "--prefill-pp", "2", "--fault", "drop-notification",
                              "--log-dir", str(tmp_path), "--timeout-s", "90"])
    out = demo.run(args, show=False)
    assert not out.problems, out.problems
    code, text, err = run_cli_captured(capsys, "replay", str(tmp_path), "--timelines", "0")
    assert code == 0 and text.count("replayed, no divergence") == 5, text + err
    logs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    decode = read_log(next(p for p in logs if p.name.startswith("decode")))
    assert {r.event.incarnation_pp for r in decode if isinstance(r.event, ReadRequested)} == {1}
    faults = set()
    for log in logs:
        records = read_log(log)
        assert _check_every_point(records) > 0
        faults |= {(type(r.event).__name__, r.fault.value) for r in records if r.fault is not None}
    assert faults == {("LeaseExpired", "remote")}


@pytest.mark.parametrize("command", ["replay", "trace", "report"])
def test_an_empty_log_path_is_a_usage_error_not_the_working_directory(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pdfsm replay "$LOGDIR"` with the variable unset: Path("") is the working directory, which
    would be replayed as if named. Expected: a usage error (exit 2) naming the empty path."""
    extra = [] if command == "replay" else ["-o", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        run_cli_captured(capsys, command, "", *extra)
    assert exit_.value.code == 2
    assert "an empty path names no log" in capsys.readouterr().err
