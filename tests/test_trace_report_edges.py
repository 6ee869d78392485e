"""Edge cases of ``pdfsm trace`` and ``pdfsm report`` (pdfsm/trace.py, pdfsm/report.py) on logs built
in-process. Each test cites what docs/postmortem.md, the module docstrings or the Chrome trace
event format promise; the docstring says what is expected and why."""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path
from typing import Any, ClassVar

import pytest
from helpers import collect, ev, handshake, make_core, read, run_cli_captured

from pdfsm.diagram import TABLES
from pdfsm.events import (
    AbortRequested,
    BadMessage,
    BlocksHeld,
    HandleDone,
    HandleFailed,
    HandleFailure,
    NotificationReceived,
    Tick,
)
from pdfsm.filelog import segment_name, segment_paths, write_segment
from pdfsm.log import MemorySink, Record
from pdfsm.postmortem import load_all
from pdfsm.report import render_report
from pdfsm.trace import chrome_trace


def _write(directory: Path, records: list[Record], *, batch: int = 4) -> Path:
    directory.mkdir(parents=True)
    write_segment(directory / segment_name(records[0].seq if records else 0), records,
                  salt=bytes(8), meta={"worker": directory.name}, wall_ns=0, mono_ns=0, batch_records=batch)
    return directory


def _tracks(doc: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def _prefill_with_core_violation() -> list[Record]:
    """A producer held and notified, with an undecodable notification in between (BadMessage: a
    core record with a remote fault)."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink, engine_id="P")
    core.apply(ev(BlocksHeld, 1_000, source="scheduler", request_id="p", block_ids=(1,)))
    core.apply(ev(BadMessage, 2_000, source="notify", channel="notify", sender="10.0.0.9", error="bad", size=3))
    core.apply(ev(NotificationReceived, 3_000, source="notify", request_id="p", part=0, of=1))
    core.log.flush()
    return sink.records


# --- trace -----------------------------------------------------------------------------------------


def test_trace_state_slices_of_one_machine_never_overlap_when_stamps_arrive_out_of_order() -> None:
    """pdfsm/trace.py: one track per machine "with a complete slice per state visit, from the
    record that entered the state to the one that left it"; a machine is in one state at a time,
    and Perfetto (like chrome://tracing) needs the complete slices of one thread track to nest
    properly: two slices that partially overlap are misnested and dropped or mis-drawn.

    Events are stamped on the thread that observed them (pdfsm/events.py: "stamped by the adapter
    that observed it"; docs/side-channel.md: "Events are stamped t_ns = clock() on the worker
    thread"), so a log's t_ns are not in apply order: here the scheduler stamps an abort at 30 us,
    the transfer thread stamps a failed read at 40 us and submits it first. The trace then draws
    READING over [20, 40] us and ABORTED over [30, 50] us on the same track: two states at once,
    partially overlapping (and ABORTED drawn before FAILED, the reverse of the machine's path)."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink)
    core.apply(read("a", t=10_000, source="scheduler"))
    handshake(core, t=20_000)
    core.apply(ev(HandleFailed, 40_000, source="transfer", request_id="a", pp_rank=0, tp_rank=0,
                  why=HandleFailure.ERR, detail="x"))
    core.apply(ev(AbortRequested, 30_000, source="scheduler", request_id="a"))
    collect(core, 50_000)
    core.log.flush()
    path = [r.state for r in sink.records if r.machine == "consumer"]
    assert path == ["HANDSHAKING", "READING", "FAILED", "ABORTED", "RELEASED"]  # the machine's real path
    doc = json.loads(json.dumps(chrome_trace([("decode", sink.records)])))
    names = _tracks(doc)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X" and names[(e["pid"], e["tid"])] == "consumer a"]
    for prev, cur in pairwise(slices):
        assert cur["ts"] >= prev["ts"] + prev["dur"], (
            f"{prev['name']} [{prev['ts']}, {prev['ts'] + prev['dur']}] overlaps {cur['name']} starting at {cur['ts']}")
    assert [s["name"] for s in slices] == path, "the slices on the track are not in the machine's order"


def test_trace_of_same_named_logs_and_a_corrupt_log_has_distinct_named_processes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/postmortem.md: a repeated log name gets ``#2``; ``pdfsm trace`` exits 4 for a corrupt
    log (it "exits non-zero only for 4, 5, 6") and still draws the records before the damage; each
    log is a process with its own pid and a process_name (Chrome trace format: pid/tid integers)."""
    a = _write(tmp_path / "a" / "prefill-tp0", _prefill_with_core_violation())
    b = _write(tmp_path / "b" / "prefill-tp0", _prefill_with_core_violation())
    corrupt = _write(tmp_path / "c" / "decode-tp0", _prefill_with_core_violation(), batch=1)
    seg = segment_paths(corrupt)[0]
    data = bytearray(seg.read_bytes())
    data[[m.start() for m in re.finditer(b"PDFB", data)][1] + 30] ^= 0xFF
    seg.write_bytes(data)
    out = tmp_path / "t.json"
    code, _, err = run_cli_captured(capsys, "trace", str(a), str(b), str(corrupt), "-o", str(out))
    assert code == 4, err
    doc = json.loads(out.read_text())
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert len(procs) == 3 and all(isinstance(p, int) for p in procs)
    assert sorted(n.split(" ")[0] for n in procs.values()) == ["decode-tp0", "prefill-tp0", "prefill-tp0#2"]
    assert doc["otherData"]["logs"] == ["prefill-tp0", "prefill-tp0#2", "decode-tp0"]
    # a core violation is an instant on a core track of its own process, with its fault
    names = _tracks(doc)
    core_v = [e for e in doc["traceEvents"] if e.get("cat") == "violation" and e["args"]["event"] == "BadMessage"]
    assert {e["pid"] for e in core_v} >= {1, 2}
    assert all("core" in names[(e["pid"], e["tid"])] and e["args"]["fault"] == "remote" for e in core_v)


# --- report ----------------------------------------------------------------------------------------


def _timeline(page: str) -> str:
    start = page.index('<svg id="timeline"')
    return page[start:page.index("</svg>", start)]


def test_report_timeline_draws_a_diamond_for_every_violation_core_ones_included(tmp_path: Path) -> None:
    """pdfsm/report.py: the timeline has "a diamond per violation (red: local fault, orange:
    remote)"; docs/postmortem.md lists violations "with whose fault it was" and counts core ones
    (the replay summary's violations include them). A BadMessage (an undecodable notification: a
    remote violation recorded by the core) is listed in the page's violation table, but the
    timeline draws no diamond for it: _rows() skips records whose machine is "core", so a log
    whose only violation is a core one shows a clean timeline."""
    logs = load_all([str(_write(tmp_path / "prefill-tp0", _prefill_with_core_violation()))])
    page = render_report(logs)
    listed = int(re.search(r"<h2>Violations \((\d+)\)</h2>", page).group(1))  # type: ignore[union-attr]
    assert listed == 1 and "undecodable notify message" in page
    diamonds = _timeline(page).count("<path ")
    assert diamonds == listed, f"{listed} violation(s) listed, {diamonds} diamond(s) on the timeline"


def test_report_mermaid_source_greys_every_state_of_a_machine_kind_the_logs_never_exercised(tmp_path: Path) -> None:
    """pdfsm/report.py: per machine kind, the state diagram with "states and transitions the logs
    exercised in colour, the others grey", and "the Mermaid source" of it; pdfsm/diagram.py
    mermaid(): "states never entered in ``shade`` are drawn grey". For a prefill-only log no
    consumer or engine record exists: the SVG diagrams grey every consumer and engine state, but
    the Mermaid source for them has no ``unvisited`` class at all (an empty shade is taken as "no
    shading"), so pasted into a Mermaid renderer it shows every state as exercised."""
    logs = load_all([str(_write(tmp_path / "prefill-tp0", _prefill_with_core_violation()))])
    page = render_report(logs)
    sources = dict(re.findall(r"<h3>(\w+)</h3>.*?<pre>(.*?)</pre>", page, re.S))
    assert set(sources) == set(TABLES)
    producer = html.unescape(sources["producer"])
    assert "class EXPIRED unvisited" in producer and "class HOLDING unvisited" not in producer  # shaded
    for kind in ("consumer", "engine"):
        src = html.unescape(sources[kind])
        missing = [s.name for s in TABLES[kind].states if f"class {s.name} unvisited" not in src]
        assert not missing, f"{kind}: never exercised, yet drawn as visited in the Mermaid source: {missing}"


class _Tags(HTMLParser):
    VOID: ClassVar[set[str]] = {"meta", "br", "link", "img", "input", "hr", "area", "base", "col", "wbr"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.seen: Counter[str] = Counter()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen[tag] += 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen[tag] += 1

    def handle_endtag(self, tag: str) -> None:
        if self.stack and self.stack[-1] == tag:
            self.stack.pop()
        else:
            self.errors.append(f"</{tag}> with {self.stack[-3:]} open")


def test_report_cell_matrix_counts_equal_the_records_and_the_page_parses(tmp_path: Path) -> None:
    """pdfsm/report.py: "the (state, event) cell matrix coloured by how often the logs exercised
    each cell": each cell's count must be the number of records of that machine kind with that
    ``before`` state and event type (counted here from the records directly), on logs with
    failures, a local violation, a staged notification, a lease expiry and an abort; the page is
    balanced HTML with the timeline SVG, one diagram per machine kind and the tables."""
    d = MemorySink()
    c = make_core(strict=False, sink=d, engine_id="D")
    c.apply(read("d-1", remote="req-1", engine="P", t=2_000))
    handshake(c, "P", t=3_000)
    c.apply(ev(HandleFailed, 5_000, request_id="d-1", pp_rank=0, tp_rank=0, why=HandleFailure.ERR, detail="x"))
    collect(c, 6_000)
    c.apply(ev(HandleDone, 7_000, request_id="d-1", pp_rank=0, tp_rank=0))
    c.apply(read("d-2", remote="req-2", engine="P", t=8_000))
    c.apply(ev(AbortRequested, 8_500, request_id="d-2"))
    collect(c, 9_000, step=2)
    c.log.flush()
    p = MemorySink()
    pc = make_core(strict=False, sink=p, engine_id="P", lease_ns=1_000_000)
    pc.apply(ev(BlocksHeld, 1_000, request_id="req-1", block_ids=(1,)))
    pc.apply(ev(BlocksHeld, 1_500, request_id="req-2", block_ids=(2,)))
    pc.apply(ev(NotificationReceived, 9_000, request_id="req-1", part=0, of=1))
    pc.apply(ev(NotificationReceived, 9_500, request_id="zzz", part=0, of=1))
    pc.apply(ev(Tick, 5_000_000))
    pc.log.flush()
    logs = load_all([str(_write(tmp_path / "decode-tp0", d.records)), str(_write(tmp_path / "prefill-tp0", p.records))])
    page = render_report(logs)
    want = Counter((r.machine, r.before, type(r.event).__name__) for log in logs for r in log.records
                   if r.machine != "core")
    got: Counter[tuple[str, str, str]] = Counter()
    for section in page.split("<h3>")[1:]:
        kind = section[:section.index("<")]
        for tip in re.findall(r'<td class="\w+" title="([^"]*)"', section):
            m = re.match(r"(\w+) x (\w+): .*?(?: \(exercised (\d+) times\))?$", html.unescape(tip), re.S)
            assert m is not None
            if m.group(3):
                got[(kind, m.group(1), m.group(2))] = int(m.group(3))
    assert got == want
    tags = _Tags()
    tags.feed(page)
    tags.close()
    assert not tags.errors and tags.stack == [], (tags.errors, tags.stack)
    assert tags.seen["svg"] == 1 + len(TABLES) and tags.seen["table"] >= 2 + len(TABLES)


def test_report_and_trace_of_a_header_only_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty (header-only) log is a log (docs/postmortem.md: status ``ok``, exit 0): the
    report is written with an empty timeline, the trace has the process and no slice."""
    empty = tmp_path / "decode-tp9"
    empty.mkdir()
    write_segment(empty / segment_name(0), [], salt=bytes(8), meta={}, wall_ns=0, mono_ns=0)
    code, _, err = run_cli_captured(capsys, "report", str(empty), "-o", str(tmp_path / "r.html"))
    assert code == 0, err
    page = (tmp_path / "r.html").read_text()
    assert 'id="timeline"' in page and "<h2>Violations (0)</h2>" in page
    code, _, err = run_cli_captured(capsys, "trace", str(empty), "-o", str(tmp_path / "t.json"))
    assert code == 0, err
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"] == ["decode-tp9"]
    assert not [e for e in doc["traceEvents"] if e["ph"] != "M"]
