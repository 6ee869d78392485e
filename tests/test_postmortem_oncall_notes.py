"""`pdfsm replay` / `report` findings of an on-call review (helper, 2026-11-28): a log still being
written read as a finished one with stuck requests; the report's violation times were raw clock
readings; a log's timelines dropped the fault and reason `--request` shows; `--json` said no
error for a request in none of the logs; `--at :5` passed for a bare `--at 5`; control bytes of
ids reached the HTML page."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ev, make_core, run_cli, run_cli_captured

from pdfsm import filelog
from pdfsm.events import BlocksHeld, NotificationReceived
from pdfsm.log import MemorySink
from pdfsm.postmortem import LoadedLog, verify
from pdfsm.report import render_report


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """decode-tp0, prefill-tp0, prefill-tp1; req-3's first notification to prefill rank 0 is lost,
    so its hold there expires: a remote fault."""
    d = tmp_path_factory.mktemp("demo")
    assert run_cli("demo-sim", "--requests", "6", "--log-dir", str(d), "--quiet",
                   "--fault", "drop-notification") == 0
    return d


def test_a_log_its_writer_still_holds_says_so(demo: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Replayed while its writer runs, a log's open requests are in progress, not stuck: the text
    says so in a note and the JSON in ``writer_live``; a log no writer holds says neither."""
    live = tmp_path / "live"
    shutil.copytree(demo / "prefill-tp0", live)
    fd = filelog.lock_writer(live)
    try:
        code, out, _ = run_cli_captured(capsys, "replay", str(live), "--timelines", "0")
        assert code == 0
        assert "note: a writer holds this log" in out and "may be in progress, not stuck" in out
        page = tmp_path / "live.html"
        assert run_cli("report", str(live), "-o", str(page)) == 0
        assert "a writer holds this log" in page.read_text()
        capsys.readouterr()  # report's "wrote" line
        code, out, _ = run_cli_captured(capsys, "replay", str(live), "--json")
        assert json.loads(out)["logs"][0]["writer_live"] is True
    finally:
        os.close(fd)
    code, out, _ = run_cli_captured(capsys, "replay", str(live), "--json")
    assert json.loads(out)["logs"][0]["writer_live"] is False
    code, out, _ = run_cli_captured(capsys, "replay", str(live), "--timelines", "0")
    assert "a writer holds this log" not in out


def test_a_logs_timelines_say_the_fault_and_reason_as_request_does(demo: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The expired hold's LeaseExpired line: `--request` said "[remote fault: lease expired...]";
    the log's own timelines printed the bare transition."""
    code, out, _ = run_cli_captured(capsys, "replay", str(demo / "prefill-tp0"), "--timelines", "20")
    assert code == 0
    expired = [line for line in out.splitlines() if "LeaseExpired" in line and "HOLDING -> EXPIRED" in line]
    assert expired and all("[remote fault: lease expired" in line for line in expired), expired
    code, out, _ = run_cli_captured(capsys, "replay", str(demo), "--request", "req-3")
    assert any("LeaseExpired" in line and "[remote fault: lease expired" in line for line in out.splitlines())


def test_report_violation_times_run_from_the_logs_first_record(demo: Path, tmp_path: Path) -> None:
    """The page says each log's times run from its own first record; the violations table
    printed the clock's raw reading (6179495.647 ms on a host up for 1.7 hours)."""
    page_path = tmp_path / "report.html"
    assert run_cli("report", str(demo), "-o", str(page_path)) == 0
    page = page_path.read_text()
    table = page.split("<h2>Violations", 1)[1].split("</table>", 1)[0]
    assert "t (from the log's earliest record)" in table
    times = re.findall(r'<td class="num">\d+</td><td class="num">([^<]*)</td>', table)
    assert times and all(re.fullmatch(r"\+\d+\.\d+ (ms|us|ns|s)", t) for t in times), times
    assert all(float(t[1:].split()[0]) < 60_000 for t in times)  # a demo of seconds, not the clock's epoch


def test_json_says_whether_the_request_is_in_the_logs(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 and a stderr line, but nothing in the document told a script why: ``request.found``
    does (``error`` keeps its meaning: a usage error before any log was read). A request whose
    records ``--at`` cuts away is found all the same (exit 0)."""
    code, out, err = run_cli_captured(capsys, "replay", str(demo), "--json", "--request", "nope")
    doc = json.loads(out)
    assert code == 2 and doc["exit_code"] == 2 and doc["request"]["found"] is False and doc["error"] is None
    assert doc["logs"] and all(log["status"] == "ok" for log in doc["logs"])
    assert "request 'nope' is in none of the logs" in err
    code, out, _ = run_cli_captured(capsys, "replay", str(demo), "--json", "--request", "req-3")
    assert code == 0 and json.loads(out)["request"]["found"] is True
    code, out, _ = run_cli_captured(capsys, "replay", str(demo), "--json", "--request", "req-3", "--at", "0")
    doc = json.loads(out)
    assert code == 0 and doc["request"]["found"] is True and not doc["request"]["entries"]


def test_at_with_an_empty_log_name_is_a_usage_error(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli_captured(capsys, "replay", str(demo), "--at", ":5")
    assert code == 2 and "no log name before ':'" in err
    code, _, _ = run_cli_captured(capsys, "replay", str(demo), "--at", "5")
    assert code == 0


def test_the_report_escapes_control_characters_of_ids() -> None:
    """A request id with an escape sequence (a peer chooses producer ids) is written escaped, as
    the text output writes it: no raw control byte reaches the page (it did, in the title of
    every bar and row of that request)."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink)
    core.apply(ev(BlocksHeld, 1_000, request_id="p\x1b[31m1", block_ids=(1,)))
    core.apply(ev(NotificationReceived, 2_000, request_id="q", part=0, of=1, sender="d\x1b[2J"))
    core.log.flush()
    page = render_report([verify(LoadedLog("prefill", "(memory)", list(sink.records)))])
    assert "\x1b" not in page
    assert "p\\x1b[31m1" in page


def test_trace_and_report_write_to_stdout_with_dash(demo: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``-o -`` wrote a file named "-"; now the document goes to stdout and the "wrote" line to
    stderr. Engine keys in the trace's args are lists, as in ``replay --json``."""
    assert run_cli("trace", str(demo), "-o", "-") == 0
    out, err = capfd.readouterr()
    doc = json.loads(out)
    assert "wrote -" in err and not Path("-").exists()
    keys = [e["args"]["key"] for e in doc["traceEvents"] if e.get("cat") == "engine"]
    assert keys and all(isinstance(k, list) and isinstance(k[1], int) for k in keys), keys[:3]
    assert run_cli("report", str(demo), "-o", "-") == 0
    out, err = capfd.readouterr()
    assert out.startswith("<!DOCTYPE html>") and out.rstrip().endswith("</html>") and "wrote -" in err


def test_dash_output_to_a_stdout_that_cannot_take_it_is_said(demo: Path) -> None:
    """``-o -`` with stdout a full disk: the one "cannot write" line and exit 2, as ``-o
    /dev/stdout`` gives (it was a traceback); with stdout closed, the same (it claimed "wrote")."""
    pdfsm = [sys.executable, "-m", "pdfsm.cli"]
    with open("/dev/full", "w") as full:
        done = subprocess.run([*pdfsm, "trace", str(demo), "-o", "-"], check=False, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2 and "pdfsm trace: cannot write -: No space left on device" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([*pdfsm, "report", str(demo), "-o", "-"], check=False, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120, close_fds=True,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 2 and "cannot write -: stdout is closed" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "wrote" not in done.stderr


def test_a_segment_retention_deletes_mid_read_is_read_again_while_the_writer_lives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live writer with ``keep_segments`` may delete the oldest segment between a reader's
    listing and its reading it: the log used to read as "cannot read" (exit 6) in about 2% of
    such reads (a helper's hunt). It is read again; a log no writer holds still says it."""
    from pdfsm import postmortem
    from pdfsm.core import Core
    from pdfsm.events import CoreConfig, Tick
    from pdfsm.filesink import FileSink
    from pdfsm.log import EventLog

    directory = tmp_path / "log"
    sink = FileSink(directory, segment_bytes=4096, keep_segments=3)
    log = EventLog(window=64, sink=sink)
    core = Core(CoreConfig(engine_id="P", compat_hash="h"), log, t_ns=0)
    for i in range(3_000):
        core.apply(Tick(source="t", t_ns=i))
    log.flush()
    assert sink.wait_written(10.0)
    real = filelog.segment_paths
    deleted: list[Path] = []

    def listed_then_deleted(path: Path) -> list[Path]:
        files = real(path)
        if not deleted:  # retention takes the oldest right after this listing
            deleted.append(files[0])
            files[0].unlink()
        return files

    monkeypatch.setattr(postmortem, "segment_paths", listed_then_deleted)
    got = postmortem.load("log", directory)
    assert deleted and got.status == "ok" and got.writer_live and got.records
    log.close()
    deleted.clear()
    gone = postmortem.load("log", directory)
    assert deleted and gone.status == "no_log" and "cannot read" in (gone.error or "")
