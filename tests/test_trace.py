"""``pdfsm trace``: a Chrome trace that Perfetto opens, one slice per state visit."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from helpers import collect, ev, handshake, make_core, read, run_cli

from pdfsm.events import BlocksHeld, HandleDone, NotificationReceived
from pdfsm.log import MemorySink, Record
from pdfsm.replay import machine_key
from pdfsm.trace import chrome_trace

INITIAL = {"consumer": "NEW", "producer": "NEW", "engine": "UNKNOWN"}


def _known_log() -> list[Record]:
    """A read end to end, a producer released by its notification, then a duplicate (a remote violation)."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink)
    core.apply(read("a", t=1_000))
    handshake(core, t=2_000)
    core.apply(ev(HandleDone, 5_000, request_id="a", pp_rank=0, tp_rank=0))
    collect(core, 6_000)
    core.apply(ev(BlocksHeld, 7_000, request_id="p", block_ids=(1,)))
    core.apply(ev(NotificationReceived, 8_000, request_id="p", part=0, of=1))
    core.apply(ev(NotificationReceived, 9_000, request_id="p", part=0, of=1))
    core.log.flush()
    return sink.records


def _check_structure(doc: dict[str, Any]) -> None:
    events = doc["traceEvents"]
    named_pids = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    named_tids = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert named_pids
    for e in events:
        assert e["ph"] in ("X", "i", "M")
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0
        if e["ph"] == "i":
            assert isinstance(e["ts"], float) and e["s"] in ("t", "p", "g")
        if e["ph"] != "M":
            assert e["pid"] in named_pids and (e["pid"], e["tid"]) in named_tids


def _tracks(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] != "M":
            out[names[(e["pid"], e["tid"])]].append(e)
    return out


def test_one_slice_per_state_visit_on_the_machine_tracks() -> None:
    records = _known_log()
    doc = json.loads(json.dumps(chrome_trace([("decode", records)])))
    _check_structure(doc)
    tracks = _tracks(doc)
    slices = [(e["name"], e["ts"], e["dur"]) for e in tracks["consumer a"] if e["ph"] == "X"]
    assert slices == [("HANDSHAKING", 1.0, 1.0), ("READING", 2.0, 3.0), ("NOTIFIED", 5.0, 1.0), ("RELEASED", 6.0, 0.0)]
    assert [(e["name"], e["dur"]) for e in tracks["producer p"] if e["ph"] == "X"] == [("HOLDING", 1.0),
                                                                                        ("RELEASED", 0.0)]
    engine = [e for e in tracks["engine ('P', 0)"] if e["ph"] == "X"]
    assert [e["name"] for e in engine] == ["HANDSHAKING", "CONNECTING", "CONNECTED"]
    assert engine[-1]["args"]["open"] and engine[-1]["ts"] + engine[-1]["dur"] == 9.0  # runs to the log's end
    # the same count from the records by a different road: every change of a machine's state
    last: dict[Any, str] = {}
    changes = 0
    for r in records:
        if r.machine != "core":
            key = (r.machine, machine_key(r))
            if r.state != last.get(key, INITIAL[r.machine]):
                changes += 1
            last[key] = r.state
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == changes
    (violation,) = [e for e in doc["traceEvents"] if e.get("cat") == "violation"]
    assert violation in tracks["producer p"] and violation["ts"] == 9.0
    assert violation["args"]["fault"] == "remote" and "duplicate" in violation["args"]["reason"]
    per_source = {e["args"]["seq"] for e in tracks["test"] if e["cat"] == "event"}
    assert per_source == {r.seq for r in records if r.event.source == "test"}


def test_the_cli_writes_a_trace_of_the_demo_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = tmp_path / "logs"
    assert run_cli("demo-sim", "--requests", "4", "--log-dir", str(logs), "--quiet",
                   "--fault", "drop-notification") == 0
    out = tmp_path / "trace.json"
    assert run_cli("trace", str(logs), "-o", str(out)) == 0
    doc = json.loads(out.read_text())
    _check_structure(doc)
    processes = sorted(e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name")
    assert processes == ["decode-tp0 (decode tp0/1 pp0)", "prefill-tp0 (prefill tp0/2 pp0)",
                         "prefill-tp1 (prefill tp1/2 pp0)"]
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {"scheduler", "transfer", "notify", "handshake", "producer req-3", "consumer d-req-3"} <= threads
    (violation,) = [e for e in doc["traceEvents"] if e.get("cat") == "violation"]
    assert violation["args"]["event"] == "LeaseExpired" and violation["args"]["fault"] == "remote"
    assert run_cli("trace", str(logs), "-o", str(out), "--no-events") == 0
    assert not any(e.get("cat") == "event" for e in json.loads(out.read_text())["traceEvents"])
    assert run_cli("trace", str(tmp_path / "missing"), "-o", str(out)) == 6
