"""Durable logs as a Chrome trace (JSON), for Perfetto or chrome://tracing.

The layout, per log (one *process* track each, named after the log and its engine):

- one *thread* track per event source (``scheduler``, ``transfer``, ``notify``,
  ``handshake``, ``timer``, ``core``...: the threads that produced the events),
  with an instant (``"ph": "i"``) per record: what arrived from where;
- one track per machine (``consumer d-req-3``, ``producer req-3``, ``engine
  ('prefill', 0)``) with a complete slice (``"ph": "X"``) per state visit, from the
  record that entered the state to the one that left it (:func:`pdfsm.replay.visits`).
  A terminal state is a zero-length slice (the machine is done); a state the machine
  was still in when the log ended runs to the end of the log, with ``"open": true``;
- a violation is an instant on its machine's track (on a ``core`` track for core
  records), named ``violation: <event>``, with the fault (``local`` or ``remote``)
  and the reason in its args.

Timestamps are the events' ``t_ns`` in microseconds. Each log keeps its own clock
domain: logs from different machines line up only as far as their clocks do.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, Final

from pdfsm.log import Record
from pdfsm.postmortem import (
    Exit,
    key_json,
    load_all,
    none_read,
    record_json,
    say_written,
    warn_unreadable,
    write_output,
)
from pdfsm.replay import machine_key, printable, visits

__all__ = ["SCHEMA", "chrome_trace", "trace_command"]

SCHEMA: Final = 1
_MACHINE_TIDS: Final = 1000  # machine tracks come after the source threads


def _us(t_ns: int) -> float:
    return t_ns / 1000


def _name(key: Any) -> str:
    return key if isinstance(key, str) else repr(key)


def _process(pid: int, name: str, records: Sequence[Record], *, events: bool) -> list[dict[str, Any]]:
    meta: list[dict[str, Any]] = []
    body: list[dict[str, Any]] = []
    first = records[0].event if records else None
    label = name
    cfg = getattr(first, "config", None)
    if cfg is not None:
        label = f"{name} ({cfg.engine_id} tp{cfg.tp_rank}/{cfg.tp_size} pp{cfg.pp_rank})"
    meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
    meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    sources: dict[str, int] = {}
    machines: dict[tuple[str, Any], int] = {}

    def thread(table: dict[Any, int], key: Any, title: str, base: int) -> int:
        tid = table.get(key)
        if tid is None:
            tid = table[key] = base + len(table) + 1
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": title}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        return tid

    for rec in records:
        src = rec.event.source
        if events:
            tid = thread(sources, src, src, 0)
            body.append({"ph": "i", "s": "t", "name": type(rec.event).__name__, "cat": "event",
                         "ts": _us(rec.event.t_ns), "pid": pid, "tid": tid, "args": record_json(rec)})
    end = max((r.event.t_ns for r in records), default=0)
    for v in visits(records):
        tid = thread(machines, (v.machine, v.key), f"{v.machine} {_name(v.key)}", _MACHINE_TIDS)
        still = v.end_t_ns is None and not v.terminal
        stop = v.start_t_ns if v.terminal else (end if v.end_t_ns is None else v.end_t_ns)
        body.append({"ph": "X", "name": v.state, "cat": v.machine, "ts": _us(v.start_t_ns),
                     "dur": max(0, stop - v.start_t_ns) / 1000, "pid": pid, "tid": tid,
                     "args": {"key": key_json(v.key), "from_seq": v.start_seq, "to_seq": v.end_seq,
                              "entered_by": v.entered_by, "left_by": v.left_by or None, "open": still}})
    for rec in records:
        if rec.fault is None:
            continue
        key = ("core", None) if rec.machine == "core" else (rec.machine, machine_key(rec))
        title = "core violations" if rec.machine == "core" else f"{key[0]} {_name(key[1])}"
        tid = thread(machines, key, title, _MACHINE_TIDS)
        body.append({"ph": "i", "s": "t", "name": f"violation: {type(rec.event).__name__}", "cat": "violation",
                     "ts": _us(rec.event.t_ns), "pid": pid, "tid": tid, "args": record_json(rec)})
    return meta + body


def chrome_trace(logs: Sequence[tuple[str, Sequence[Record]]], *, events: bool = True) -> dict[str, Any]:
    """The trace document: ``traceEvents`` (metadata first), one process per log."""
    out: list[dict[str, Any]] = []
    for pid, (name, records) in enumerate(logs, start=1):
        out += _process(pid, name, records, events=events)
    # Metadata first, then each track in time order (a violation instant sits among its machine's
    # slices); stable, so events at one time keep the order they were made in.
    out.sort(key=lambda e: (0, 0, 0, 0.0) if e["ph"] == "M" else (1, e["pid"], e["tid"], e["ts"]))
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"generator": "pdfsm trace", "schema": SCHEMA, "logs": [name for name, _ in logs]}}


def trace_command(args: argparse.Namespace) -> int:
    """``pdfsm trace LOG... -o trace.json``: not replayed (``pdfsm replay`` checks), only drawn."""
    logs = load_all(args.logs, check=False)
    code = warn_unreadable(logs, "pdfsm trace")
    if none_read(logs, args.output, "pdfsm trace"):
        return code
    doc = chrome_trace([(log.name, log.records) for log in logs], events=not args.no_events)
    if not write_output(args.output, json.dumps(doc, separators=(",", ":")), "pdfsm trace"):
        return Exit.USAGE
    kinds: dict[str, int] = {}
    for e in doc["traceEvents"]:
        kinds[e["ph"]] = kinds.get(e["ph"], 0) + 1
    say_written(args.output, f"wrote {printable(args.output)}: {len(logs)} logs, {kinds.get('X', 0)} state slices, "
                f"{kinds.get('i', 0)} instants (open it in Perfetto, ui.perfetto.dev, or chrome://tracing)")
    return code or Exit.OK
