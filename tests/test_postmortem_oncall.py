"""`pdfsm replay` / `report` as an on-call engineer uses them in a postmortem (review, session 13).

Logs come from `pdfsm demo-sim --log-dir` (real FileSink logs, one process) and are damaged or
rearranged by hand the way they are in incidents: a short file that is not a log, an unreadable
worker directory, a worker whose only segment was moved aside by --repair, a gap, a segment
missing from the middle."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import msgspec
import pytest
from helpers import run_cli, run_cli_captured, write_worker_log

from pdfsm import filelog
from pdfsm.filelog import FLAG_GAP, encode_frame, encode_header, read_log, segment_name, write_segment
from pdfsm.log import Outcome, Record

ROOT = Path(__file__).resolve().parent.parent


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli_captured(capsys, *argv)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """decode-tp0, prefill-tp0, prefill-tp1; req-3's first notification to prefill rank 0 is lost."""
    d = tmp_path_factory.mktemp("demo")
    assert run_cli("demo-sim", "--requests", "6", "--log-dir", str(d), "--quiet",
                   "--fault", "drop-notification") == 0
    return d


def _copy(demo: Path, dest: Path) -> Path:
    shutil.copytree(demo, dest)
    return dest


# --- a file that is not a log ----------------------------------------------------------------------


def test_a_short_file_that_is_not_a_log_is_not_a_torn_tail(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`pdfsm replay notes.txt` with a 17-byte note: the size check comes before the magic check, so
    a file shorter than a header reads as a "torn tail" (exit 0) though not one byte of it is a
    pdfsm header. log-format.md: a header that is not a pdfsm header (bad magic, not zeros) is
    corruption; only zeros or a cut-short *pdfsm* header are torn."""
    notes = tmp_path / "notes.txt"
    notes.write_text("see prefill logs\n")
    code, out, _ = _run(capsys, "replay", str(notes), "--timelines", "0")
    assert code != 0, out
    assert "torn tail" not in out, out


def test_repair_never_moves_aside_a_short_file_that_is_not_a_log(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`pdfsm replay notes.txt --repair` renames the user's 17-byte note to notes.txt.torn.0 and exits 0
    (the long-note case is fixed; a note shorter than a header is not)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("see prefill logs\n")
    _run(capsys, "replay", str(notes), "--repair", "--timelines", "0")
    assert notes.exists() and notes.read_text() == "see prefill logs\n", sorted(p.name for p in tmp_path.iterdir())


def test_a_path_that_does_not_exist_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped path is exit 6 (right), but the message is "no log segments here", which reads as
    "the directory is there and empty"; the on-call engineer should be told the path does not exist."""
    missing = tmp_path / "logs-typo"
    code, _, err = _run(capsys, "replay", str(missing))
    assert code == 6
    assert "No such file" in err or "does not exist" in err, err


# --- worker directories ---------------------------------------------------------------------------------


def test_an_unreadable_worker_directory_does_not_hide_the_other_workers(demo: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """One worker's directory cannot be listed (chmod 000, another user's; simulated, these tests run
    as root). `expand` swallows the PermissionError and falls back to treating the parent as one log,
    so the whole run reads "DIR: NO LOG ... no log segments here": the two readable workers are not
    replayed at all and "Permission denied" is never said. Expected: decode-tp0 and prefill-tp0
    replayed, prefill-tp1 reported as unreadable (exit 6)."""
    logs = _copy(demo, tmp_path / "logs")
    real = Path.iterdir

    def deny(self: Path):  # type: ignore[no-untyped-def]
        if self.name == "prefill-tp1":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", deny)
    code, out, err = _run(capsys, "replay", str(logs), "--timelines", "0")
    assert code == 6, out + err
    assert "decode-tp0: replayed, no divergence" in out, out
    assert "prefill-tp0: replayed, no divergence" in out, out
    assert "prefill-tp1" in out + err and "Permission denied" in out + err, out + err


def test_a_worker_whose_only_segment_was_moved_aside_is_still_listed(demo: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """prefill-tp1's only segment has a torn header (cut short). `pdfsm replay DIR` lists it (torn tail,
    0 records); `--repair` moves the file aside whole, as documented. The next `pdfsm replay DIR`
    silently shows two workers and exit 0: the third worker (its writer.lock and .torn.0 backup still
    there) has vanished from the postmortem. A worker directory that holds no segments should be
    reported (no log), as it is when named directly (exit 6)."""
    logs = _copy(demo, tmp_path / "logs")
    (seg,) = filelog.segment_paths(logs / "prefill-tp1")
    with open(seg, "r+b") as f:
        f.truncate(20)
    code, out, _ = _run(capsys, "replay", str(logs), "--timelines", "0")
    assert code == 0 and "prefill-tp1: torn tail accepted" in out, out
    _run(capsys, "replay", str(logs), "--repair", "--timelines", "0")
    assert not filelog.segment_paths(logs / "prefill-tp1")  # moved aside whole, as documented
    assert _run(capsys, "replay", str(logs / "prefill-tp1"))[0] == 6  # named directly: no log
    code, out, err = _run(capsys, "replay", str(logs), "--timelines", "0")
    assert "prefill-tp1" in out + err, out + err


# --- gaps and missing segments ---------------------------------------------------------------------------


def _with_gap(records: list[Record], dest: Path, first: int, count: int) -> Path:
    """The records as a log whose seqs first..first+count-1 are a gap frame (Overflow.COUNT)."""
    dest.mkdir(parents=True)
    enc = msgspec.msgpack.Encoder().encode
    rows = records
    header, prev = encode_header(0, bytes(8), {"worker": dest.name})
    parts = [header]

    def frame(payload: bytes, n: int, base: int, flags: int = 0) -> None:
        nonlocal prev
        head, prev = encode_frame(payload, n, base, prev, wall_ns=0, mono_ns=0, flags=flags)
        parts.extend((head, payload))

    for i in range(0, first, 4):
        chunk = rows[i:min(i + 4, first)]
        frame(enc(chunk), len(chunk), chunk[0].seq)
    frame(enc({"reason": "queue full"}), count, first, FLAG_GAP)
    for i in range(first + count, len(rows), 4):
        chunk = rows[i:i + 4]
        frame(enc(chunk), len(chunk), chunk[0].seq)
    (dest / segment_name(0)).write_bytes(b"".join(parts))
    return dest


def test_a_gap_is_replayed_up_to_and_reported(demo: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Pins the documented gap behaviour at the command line (only the reader is tested elsewhere):
    exit 0, a `gap:` and a `note:` line, `replayed` true with a `replay_note`, the gap in `gaps`; an
    edit before the gap is still a divergence."""
    records = read_log(demo / "prefill-tp0")
    log = _with_gap(records, tmp_path / "prefill-tp0", 6, 2)
    code, out, _ = _run(capsys, "replay", str(log), "--timelines", "0")
    assert code == 0, out
    assert "gap: seqs 6..7 missing (queue full)" in out
    assert "note: replayed up to seq 5" in out
    code, out, _ = _run(capsys, "replay", str(log), "--json")
    (doc,) = json.loads(out)["logs"]
    assert code == 0 and doc["status"] == "ok" and doc["replayed"] is True
    assert doc["replay_note"].startswith("replayed up to seq 5")
    assert [(g["first_seq"], g["count"], g["reason"]) for g in doc["gaps"]] == [(6, 2, "queue full")]
    assert doc["records"] == len(records) - 2
    i = next(i for i, r in enumerate(records) if r.seq < 6 and r.machine == "producer"
             and r.outcome is Outcome.APPLIED)
    edited = [*records[:i], msgspec.structs.replace(records[i], state="RELEASED"), *records[i + 1:]]
    log = _with_gap(edited, tmp_path / "edited" / "prefill-tp0", 6, 2)
    code, out, _ = _run(capsys, "replay", str(log), "--json")
    (doc,) = json.loads(out)["logs"]
    assert code == 3 and doc["status"] == "divergence" and doc["error"]["seq"] == records[i].seq


def test_the_report_says_records_were_lost_in_a_gap(demo: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`pdfsm replay` says "gap: seqs 6..7 lost" and "replayed up to seq 5"; the report page, "one
    page to attach to the incident", shows the same log as plain `ok`, with no word of the lost
    records, while its summary counts the requests the gap left unfinished as not terminal."""
    log = _with_gap(read_log(demo / "prefill-tp0"), tmp_path / "prefill-tp0", 6, 2)
    page = tmp_path / "report.html"
    code, _, _ = _run(capsys, "report", str(log), "-o", str(page))
    assert code == 0
    text = page.read_text()
    said = "gap" in text.lower() or "replayed up to seq" in text or "6..7" in text
    assert said, "the page never mentions the gap (seqs 6..7) nor that replay stopped at seq 5"


def test_a_segment_missing_from_the_middle_is_corruption_naming_the_next_segment(
        demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pins: a directory of rotated segments with one deleted from the middle is exit 4, naming the
    segment after the hole, and the records before the hole are summarized."""
    records = read_log(demo / "decode-tp0")
    rows = records
    log = tmp_path / "decode-tp0"
    log.mkdir()
    third = len(rows) // 3
    for part in (rows[:third], rows[third:2 * third], rows[2 * third:]):
        write_segment(log / segment_name(part[0].seq), part, salt=bytes(8), meta={}, wall_ns=0, mono_ns=0,
                      batch_records=4)
    code, out, _ = _run(capsys, "replay", str(log), "--timelines", "0")
    assert code == 0, out
    (log / segment_name(third)).unlink()
    code, out, err = _run(capsys, "replay", str(log), "--json")
    (doc,) = json.loads(out)["logs"]
    assert code == 4 and doc["status"] == "corrupt"
    assert doc["error"]["file"] == str(log / segment_name(2 * third))
    assert "records missing" in doc["error"]["message"]
    assert doc["records"] == third and doc["last_seq"] == third - 1
    assert segment_name(2 * third) in err


def test_a_log_cut_after_a_root_event_says_what_replay_recomputed_past_its_end(
        demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """prefill-tp0 ends with the timer Tick (root) and the LeaseExpired it derived for req-3 (the remote
    violation, the incident's key evidence). Cut the file cleanly after the Tick (a frame boundary: a
    power loss, or an edit): replay rebuilds the core, recomputes the LeaseExpired, drops it without a
    word and prints "replayed, no divergence ... violations: 0 ... producer 'req-3' in HOLDING", i.e. a
    leaked hold, exit 0. What replay recomputed past the log's end should be said (a note naming the
    missing seq or the recomputed LeaseExpired), not silently discarded."""
    records = read_log(demo / "prefill-tp0")
    last = records[-1]
    assert type(last.event).__name__ == "LeaseExpired" and last.cause == records[-2].seq  # Tick -> LeaseExpired
    log = write_worker_log(tmp_path / "prefill-tp0", records[:-1])
    code, out, err = _run(capsys, "replay", str(log), "--timelines", "0")
    assert code == 0
    said = "LeaseExpired" in out + err or f"seq {last.seq}" in out + err
    assert said, out + err


# --- the docs ------------------------------------------------------------------------------------------


def test_log_format_doc_states_the_schema_version_the_writer_uses() -> None:
    """docs/log-format.md says "`SCHEMA_VERSION` is 1" (and "= 1" in the frame table) while the writer
    stamps every frame with 2: someone writing a reader from the doc refuses every real frame."""
    doc = (ROOT / "docs" / "log-format.md").read_text()
    stated = {int(m) for m in re.findall(r"`SCHEMA_VERSION`(?: is|\s*=)\s*(\d+)", doc)}
    assert stated == {filelog.SCHEMA_VERSION}, stated
