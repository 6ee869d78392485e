"""``pdfsm replay`` on real logs from the demo: exit codes, torn tails, corruption, divergence,
time travel, a request followed across the prefill and decode logs, and the JSON document."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import msgspec
import pytest
from helpers import run_cli, run_cli_captured

from pdfsm.filelog import FORMAT_VERSION, read_log, segment_name, segment_paths, write_segment
from pdfsm.log import Outcome, Record

ROOT = Path(__file__).resolve().parent.parent


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli_captured(capsys, *argv)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("clean")
    assert run_cli("demo-sim", "--requests", "8", "--log-dir", str(d), "--quiet") == 0
    return d


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo with req-3's notification to prefill rank 0 dropped: that rank's lease expires."""
    d = tmp_path_factory.mktemp("faulty")
    assert run_cli("demo-sim", "--requests", "6", "--log-dir", str(d), "--quiet", "--fault", "drop-notification") == 0
    return d


def _copy(records: list[Record], dest: Path) -> Path:
    """The records as a fresh log of 4-record frames, so damage can land between good frames."""
    dest.mkdir(parents=True)
    write_segment(dest / segment_name(0), records, salt=bytes(8), meta={"worker": dest.name},
                  wall_ns=0, mono_ns=0, batch_records=4)
    return dest


def _frames(path: Path) -> list[int]:
    data = path.read_bytes()
    return [m.start() for m in re.finditer(b"PDFB", data)]


def test_the_demo_leaves_one_log_per_worker_and_they_replay(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(p.name for p in clean.iterdir()) == ["decode-tp0", "prefill-tp0", "prefill-tp1"]
    for worker in clean.iterdir():
        assert segment_paths(worker) and read_log(worker)[0].seq == 0
    code, out, err = _run(capsys, "replay", str(clean))
    assert code == 0, out + err
    assert out.count("replayed, no divergence") == 3
    assert "violations: 0" in out and "not terminal: 0" in out
    assert err == ""  # no progress bar when stdout is not a terminal, no violation logged again


def test_replaying_twice_prints_the_same(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _run(capsys, "replay", str(clean), "--timelines", "3")
    assert first == _run(capsys, "replay", str(clean), "--timelines", "3")
    as_json = _run(capsys, "replay", str(clean), "--json")
    assert as_json == _run(capsys, "replay", str(clean), "--json")


def test_an_edited_state_is_a_divergence_naming_the_seq(clean: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    records = read_log(clean / "decode-tp0")
    i = next(i for i, r in enumerate(records) if r.state == "NOTIFIED" and r.outcome is Outcome.APPLIED)
    edited = [*records[:i], msgspec.structs.replace(records[i], state="READING"), *records[i + 1:]]
    log = _copy(edited, tmp_path / "decode-tp0")
    code, out, err = _run(capsys, "replay", str(log))
    assert code == 3
    assert f"divergence at seq {records[i].seq}: state differs" in out
    assert f"divergence at seq {records[i].seq}" in err and "exit 3" in err


def test_a_torn_tail_is_accepted_and_the_file_left_alone(clean: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    log = _copy(read_log(clean / "decode-tp0"), tmp_path / "decode-tp0")
    seg = segment_paths(log)[0]
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 5)
    code, out, err = _run(capsys, "replay", str(log))
    assert code == 0
    last_frame = _frames(seg)[-1]
    assert f"torn tail: {seg} at byte {last_frame}" in out and "the file was left as it is" in out
    assert "torn tail" in err
    assert seg.stat().st_size == size - 5 and [p.name for p in log.iterdir()] == [seg.name]
    code, out, _ = _run(capsys, "replay", str(log), "--repair")
    assert code == 0 and "torn tail repaired" in out
    assert seg.stat().st_size == last_frame and (log / f"{seg.name}.torn.0").exists()


def test_corruption_in_the_middle_names_the_file_and_offset(clean: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    log = _copy(read_log(clean / "decode-tp0"), tmp_path / "decode-tp0")
    seg = segment_paths(log)[0]
    second = _frames(seg)[1]
    data = bytearray(seg.read_bytes())
    data[second + 60] ^= 0xFF  # inside the second frame's payload: its CRC fails, good frames follow
    seg.write_bytes(data)
    code, out, err = _run(capsys, "replay", str(log))
    assert code == 4
    assert f"{seg} at byte {second}: CRC mismatch" in out
    assert f"{seg} at byte {second}" in err and "exit 4" in err
    assert "4 records up to seq 3" in out  # what came before the damage is still summarized


def test_an_unsupported_version_and_a_missing_log_have_their_own_codes(clean: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    log = _copy(read_log(clean / "decode-tp0"), tmp_path / "decode-tp0")
    seg = segment_paths(log)[0]
    data = bytearray(seg.read_bytes())
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 1)
    seg.write_bytes(data)
    code, out, _ = _run(capsys, "replay", str(log))
    assert code == 5 and "UNSUPPORTED VERSION" in out
    code, out, _ = _run(capsys, "replay", str(tmp_path / "nothing-here"))
    assert code == 6 and "does not exist" in out
    code, _, _ = _run(capsys, "replay", str(clean), str(log))  # the first failing log decides
    assert code == 5


def test_at_shows_every_machine_at_that_seq(faulty: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = read_log(faulty / "prefill-tp0")
    held = next(r.seq for r in records if r.machine == "producer" and getattr(r.event, "request_id", "") == "req-3")
    code, out, _ = _run(capsys, "replay", str(faulty), "--at", f"prefill-tp0:{held}", "--timelines", "0")
    assert code == 0
    section = out.split("prefill-tp0:", 1)[1].split("prefill-tp1:", 1)[0]
    assert f"machines at seq {held}" in section
    assert re.search(rf"producer\s+'req-3'\s+HOLDING\s+since #{held}", section)
    assert "machines at" not in out.split("prefill-tp1:", 1)[1]  # the other logs: at their end
    code, out, _ = _run(capsys, "replay", str(faulty), "--at", str(held), "--timelines", "0")
    assert out.count(f"machines at seq {held}") == 3  # a bare SEQ applies to every log
    code, _, err = _run(capsys, "replay", str(faulty), "--at", "nosuch:3")
    assert code == 2 and "no log named 'nosuch'" in err
    code, _, err = _run(capsys, "replay", str(faulty), "--at", "9" * 5000)  # int() refuses over 4300 digits
    assert code == 2 and f"an integer from 0 to {2**63 - 1}" in err and len(err) < 400


def test_a_request_is_followed_across_prefill_and_decode(faulty: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, by_local, _ = _run(capsys, "replay", str(faulty), "--request", "d-req-3")
    assert code == 0
    _, by_producer, _ = _run(capsys, "replay", str(faulty), "--request", "req-3")
    timeline = by_local.split("request 'd-req-3':", 1)[1].splitlines()[1:]
    assert timeline == by_producer.split("request 'req-3':", 1)[1].splitlines()[1:]
    assert "producer 'req-3' in prefill-tp0, 'req-3' in prefill-tp1; consumer 'd-req-3' in decode-tp0" in by_local
    cols = [line.replace("+", "", 1).split() for line in timeline]  # time, ms, log, #seq, machine, key, event
    assert {"prefill-tp0", "prefill-tp1", "decode-tp0"} <= {c[2] for c in cols}
    times = [float(c[0]) for c in cols]
    assert times == sorted(times)
    events = [c[6] for c in cols]
    assert events.index("BlocksHeld") < events.index("ReadRequested") < events.index("Reported")
    assert "LeaseExpired" in timeline[-1] and "[remote fault: lease expired" in timeline[-1]
    code, _, err = _run(capsys, "replay", str(faulty), "--request", "req-999")
    assert code == 2 and "in none of the logs" in err


def _documented() -> dict[str, list[str]]:
    """Field names per object, from the tables in docs/replay-json.md."""
    fields: dict[str, list[str]] = {}
    section = ""
    for line in (ROOT / "docs" / "replay-json.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"\| `(\w+)` \|", line)
        if m and section:
            fields.setdefault(section, []).append(m.group(1))
    return fields


def test_json_matches_the_documented_schema(faulty: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc_fields = _documented()
    code, out, err = _run(capsys, "replay", str(faulty), "--json", "--request", "req-3", "--at", "decode-tp0:20")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["schema"] == 1 and doc["exit_code"] == 0
    assert list(doc) == doc_fields["Document"]
    for log in doc["logs"]:
        assert list(log) == doc_fields["Log"]
        assert log["config"] is None or list(log["config"]) == doc_fields["Config"]
        for v in log["violations"]:
            assert list(v) == doc_fields["Record"]
        for s in log["stuck"]:
            assert list(s) == doc_fields["Stuck"]
        for t in log["timelines"]:
            assert list(t) == doc_fields["Timeline"]
            assert all(list(s) == doc_fields["Step"] for s in t["steps"])
        for m in log["machines"] or []:
            assert list(m) == doc_fields["Machine"]
    by_name = {log["name"]: log for log in doc["logs"]}
    assert by_name["decode-tp0"]["at"] == 20 and by_name["decode-tp0"]["machines"]
    assert by_name["prefill-tp0"]["machines"] is None
    (violation,) = by_name["prefill-tp0"]["violations"]
    assert violation["fault"] == "remote" and violation["key"] == "req-3" and violation["event"] == "LeaseExpired"
    req = doc["request"]
    assert list(req) == doc_fields["Request"] and req["producer_ids"] == ["req-3"]
    assert all(list(p) == doc_fields["Party"] for p in req["consumers"] + req["producers"])
    assert all(list(e) == ["log", *doc_fields["Record"]] for e in req["entries"])
    engine = next(m for m in by_name["decode-tp0"]["machines"] if m["machine"] == "engine")
    assert engine["key"] == ["prefill", 0]


def test_json_reports_failures_too(clean: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _copy(read_log(clean / "decode-tp0"), tmp_path / "decode-tp0")
    seg = segment_paths(log)[0]
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - 3)
    code, out, _ = _run(capsys, "replay", str(log), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["logs"][0]["status"] == "torn_tail"
    assert list(doc["logs"][0]["torn_tail"]) == _documented()["TornTail"]
    assert doc["logs"][0]["error"] is None


def test_progress_only_on_a_terminal_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from pdfsm import postmortem

    assert isinstance(postmortem.make_progress(None), postmortem._NoProgress)  # pytest's stdout is no terminal
    assert isinstance(postmortem.make_progress(True, json_mode=True), postmortem._PlainProgress)  # asked for
    assert isinstance(postmortem.make_progress(False), postmortem._NoProgress)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert isinstance(postmortem.make_progress(None), postmortem._RichProgress)
    assert isinstance(postmortem.make_progress(None, json_mode=True), postmortem._NoProgress)
    monkeypatch.setitem(sys.modules, "rich.progress", None)  # rich not installed: a plain counter
    assert isinstance(postmortem.make_progress(None), postmortem._PlainProgress)


def test_progress_into_a_file_is_plain_lines_ending_at_each_phases_count(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`pdfsm replay LOG --progress 2>err`: the docs promise a plain counter when stderr is not a
    terminal. It wrote terminal escape codes and stopped at its first update ("611/5683"; found by
    a helper's review). Now one line per update, no escape codes, and each phase's last count."""
    from pdfsm import postmortem

    clock = iter(x * 0.3 for x in range(100))
    monkeypatch.setattr("pdfsm.postmortem.time.monotonic", lambda: next(clock))
    bar = postmortem.make_progress(True)
    bar.start("reading a", 5)
    for i in range(1, 6):
        bar.update(i)
    bar.start("replaying a", 3)
    bar.update(1)
    bar.stop()
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err
    lines = err.splitlines()
    assert lines[-1] == "replaying a: 1/3" and "reading a: 5/5" in lines
