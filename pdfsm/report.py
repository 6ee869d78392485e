"""One self-contained HTML page about durable logs: ``pdfsm report LOG... -o report.html``.

The page fetches nothing: CSS is inline, every picture is inline SVG drawn here,
and there is no script. It has, in order:

- a summary per log (status as ``pdfsm replay`` decides it, records, machines per
  state, how the finished requests ended, violations by fault, requests not terminal);
- a timeline (``<svg id="timeline">``, on a background of :data:`TIMELINE_BG`):
  one row per machine, a coloured bar per state visit over time, a diamond per
  violation (red: local fault, orange: remote); rows with violations or stuck
  requests are drawn first when there are more than ``rows``. Each log's times run
  from its own first record: logs from different hosts are on different clocks;
- the violations and stuck requests, in full;
- per machine kind, its state diagram as inline SVG (a layered layout of the
  table's transitions, states and transitions the logs exercised in colour, the
  others grey and dashed), the (state, event) cell matrix coloured by how often
  the logs exercised each cell, and the Mermaid source.
"""

from __future__ import annotations

import argparse
import html
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pdfsm.diagram import TABLES, cell_summary, mermaid
from pdfsm.fsm import Go, Ignore, Table
from pdfsm.log import Record
from pdfsm.postmortem import (
    WRITER_LIVE,
    Exit,
    LoadedLog,
    load_all,
    none_read,
    say_written,
    warn_unreadable,
    write_output,
)
from pdfsm.replay import (
    Visit,
    duration,
    event_detail,
    machine_key,
    offsets,
    outcome_lines,
    printable,
    summarize,
    visits,
)

__all__ = ["STATE_COLOURS", "TIMELINE_BG", "diagram_svg", "render_report", "report_command", "timeline_svg"]

TIMELINE_BG: Final = "#e8f0fa"
"""The timeline's background: distinctive, so a screenshot test can find the timeline."""

STATE_COLOURS: Final = {
    "NEW": "#8e9aa8", "HANDSHAKING": "#f2c14e", "READING": "#3b82d6", "NOTIFIED": "#4caf50",
    "FAILING": "#f0883e", "FAILED": "#c62828", "ABORTING": "#b07cc6", "ABORTED": "#7b4fa0",
    "RELEASED": "#6d6d6d", "STAGED": "#c9a0dc", "HOLDING": "#1f6fa8", "EXPIRED": "#e0529c",
    "DISCARDED": "#8d8d8d", "UNKNOWN": "#d0d0d0", "CONNECTING": "#bcbd22", "CONNECTED": "#17a2b8",
    "DISCONNECTED": "#8c564b", "EVICTED": "#a0a0a0",
}
_FAULT_COLOURS: Final = {"local": "#e00000", "remote": "#ff8c00"}
_CSS: Final = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 22px; margin: 0 0 8px; } h2 { font-size: 18px; margin: 28px 0 8px; }
table { border-collapse: collapse; margin: 8px 0; } td, th { border: 1px solid #ccc; padding: 2px 6px; }
th { background: #f3f3f3; text-align: left; } .num { text-align: right; }
.ok { color: #2e7d32; } .bad { color: #c62828; font-weight: bold; } .warn { color: #b26a00; }
.legend span { display: inline-block; margin-right: 12px; } .sw { width: 12px; height: 12px;
  display: inline-block; vertical-align: middle; margin-right: 4px; border: 1px solid #888; }
.matrix td { width: 26px; height: 20px; text-align: center; font-size: 11px; padding: 0; }
.matrix th.ev { writing-mode: vertical-rl; font-weight: normal; font-size: 11px; }
.hit { background: #8fd18b; } .go { background: #fafafa; } .ign { background: #f2f2f2; color: #999; }
.ill { background: #fbe3e3; color: #b55; } pre { background: #f7f7f7; padding: 8px; overflow-x: auto; }
"""


def _e(text: object) -> str:
    """Escaped for HTML, control characters too (a peer chooses some ids and reasons)."""
    return html.escape(printable(str(text)), quote=True)


def _key(key: Any) -> str:
    return key if isinstance(key, str) else repr(key)


# --- summary ---------------------------------------------------------------------------------------


def _summary(logs: Sequence[LoadedLog]) -> Iterator[str]:
    yield "<table><tr><th>log</th><th>status</th><th>records</th><th>span</th><th>machines per state</th>"
    yield "<th>finished requests</th><th>violations (local / remote)</th><th>not terminal</th></tr>"
    for log in logs:
        s = summarize(log.records, timelines=False)
        cls = "ok" if log.status == "ok" else "warn" if log.status == "torn_tail" else "bad"
        states = "<br>".join(f"{_e(m)}: " + ", ".join(f"{_e(st)} {n}" for st, n in sorted(c.items()))
                             for m, c in sorted(s.per_state.items()))
        faults = s.by_fault()
        finished = "<br>".join(_e(line) for line in outcome_lines(s))
        yield (f"<tr><td>{_e(log.name)}<br><small>{_e(log.path)}</small></td><td class=\"{cls}\">"
               f"{_e(log.status)}</td><td class=\"num\">{len(log.records)}</td>"
               f"<td class=\"num\">{duration(s.last_t_ns - s.first_t_ns)}</td><td>{states}</td><td>{finished}</td>"
               f"<td class=\"num\">{len(s.violations)} ({faults['local']} / {faults['remote']})</td>"
               f"<td class=\"num\">{len(s.stuck)}</td></tr>")
    yield "</table>"
    for log in logs:
        # _e() makes them printable: they name the log's files, whose names need not decode
        if log.error:
            yield f"<p class=\"bad\">{_e(log.name)}: {_e(log.error.splitlines()[0])}</p>"
        if log.torn is not None:
            yield (f"<p class=\"warn\">{_e(log.name)}: torn tail at byte {_e(log.torn['offset'])} of "
                   f"{_e(log.torn['file'])} ({_e(log.torn['reason'])}); the records before it are shown</p>")
        for g in log.gaps:
            yield (f"<p class=\"warn\">{_e(log.name)}: gap: seqs {g.first_seq}..{g.first_seq + g.count - 1} lost "
                   f"before reaching the file ({_e(g.reason)})</p>")
        if log.replay_note:
            yield f"<p class=\"warn\">{_e(log.name)}: note: {_e(log.replay_note)}</p>"
        if log.writer_live:
            yield f"<p class=\"warn\">{_e(log.name)}: note: {_e(WRITER_LIVE)}</p>"


# --- timeline --------------------------------------------------------------------------------------


@dataclass
class _Row:
    log: str
    machine: str
    key: Any
    visits: list[Visit]
    marks: list[Record]  # records with a fault
    t0: int  # its log's first time: each log is drawn on its own clock
    end_t: int
    flagged: bool


def _t0(log: LoadedLog) -> int:
    """Where a log's times start on the page: its earliest record (each host's clock its own)."""
    return min((r.event.t_ns for r in log.records), default=0)


def _rows(logs: Sequence[LoadedLog]) -> list[_Row]:
    out: list[_Row] = []
    for log in logs:
        t0 = _t0(log)
        end = max((r.event.t_ns for r in log.records), default=0)
        rows: dict[tuple[str, Any], _Row] = {}
        for v in visits(log.records):
            row = rows.setdefault((v.machine, v.key), _Row(log.name, v.machine, v.key, [], [], t0, end, False))
            row.visits.append(v)
        for rec in log.records:
            if rec.fault is not None:
                # a machine that never left its initial state (a rejected first event) gets a row
                # too, and so do the core's own violations (an undecodable message, events dropped)
                key = (rec.machine, machine_key(rec))
                rows.setdefault(key, _Row(log.name, rec.machine, key[1], [], [], t0, end, False)).marks.append(rec)
        for row in rows.values():
            last = row.visits[-1] if row.visits else None
            open_end = last is not None and last.end_seq is None and not last.terminal and row.machine != "engine"
            row.flagged = bool(row.marks) or open_end
        out += rows.values()
    return out


def timeline_svg(logs: Sequence[LoadedLog], *, rows: int = 200) -> str:
    """Requests (and engines) as rows, state visits as bars over time, violations as diamonds.
    Each log's times run from its own first record: logs of different hosts are on different
    clocks (each its engine's monotonic one), which no common axis could line up."""
    every = _rows(logs)
    chosen = every
    if len(every) > rows:  # every row that shows a problem first, then the earliest others
        chosen = [r for r in every if r.flagged][:rows]
        chosen += [r for r in every if not r.flagged][:rows - len(chosen)]
    span = max(1, max((r.end_t - r.t0 for r in every), default=1))
    label_w, plot_w, row_h, top = 300, 1000, 16, 28
    width, height = label_w + plot_w + 20, top + row_h * max(1, len(chosen)) + 10

    def x(t: int, t0: int = 0) -> float:
        return label_w + (t - t0) * plot_w / span

    tick = offsets(span, pad=False)
    out = [f'<svg id="timeline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'role="img" aria-label="timeline">',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="{TIMELINE_BG}"/>']
    for i in range(6):
        t = span * i // 5
        out.append(f'<line x1="{x(t):.1f}" y1="{top - 6}" x2="{x(t):.1f}" y2="{height}" stroke="#c5d3e6"/>')
        out.append(f'<text x="{x(t):.1f}" y="{top - 10}" font-size="11" text-anchor="middle">'
                   f'{tick(t)}</text>')
    for i, row in enumerate(chosen):
        y = top + i * row_h
        label = f"{row.log} {row.machine} {_key(row.key)}"
        out.append(f'<text x="4" y="{y + 12}" font-size="11">{_e(label[:48])}</text>')
        for v in row.visits:
            colour = STATE_COLOURS.get(v.state, "#999")
            start = x(v.start_t_ns, row.t0)
            if v.terminal:
                w, extra = 3.0, ""
            else:
                stop = row.end_t if v.end_t_ns is None else v.end_t_ns
                w = max(2.0, x(stop, row.t0) - start)
                extra = ' stroke="#000" stroke-dasharray="3,2"' if v.end_t_ns is None else ""
            tip = (f"{row.machine} {_key(row.key)}: {v.state} from seq {v.start_seq} ({v.entered_by})"
                   + (f" to seq {v.end_seq} ({v.left_by})" if v.end_seq is not None else " to the end of the log"))
            out.append(f'<rect x="{start:.1f}" y="{y + 2}" width="{w:.1f}" height="{row_h - 4}" '
                       f'fill="{colour}"{extra}><title>{_e(tip)}</title></rect>')
        for rec in row.marks:
            cx, cy = x(rec.event.t_ns, row.t0), y + row_h / 2
            fault = rec.fault.value if rec.fault is not None else "local"
            tip = f"seq {rec.seq} {fault} fault: {type(rec.event).__name__} {rec.outcome.name.lower()}: {rec.reason}"
            out.append(f'<path d="M{cx:.1f} {cy - 6:.1f} L{cx + 6:.1f} {cy:.1f} L{cx:.1f} {cy + 6:.1f} '
                       f'L{cx - 6:.1f} {cy:.1f} Z" fill="{_FAULT_COLOURS[fault]}" stroke="#000">'
                       f'<title>{_e(tip)}</title></path>')
    out.append("</svg>")
    if len(every) > len(chosen):
        out.append(f"<p>{len(every) - len(chosen)} more rows not drawn (--rows).</p>")
    return "\n".join(out)


def _legend(states: Iterable[str]) -> str:
    items = [f'<span><i class="sw" style="background:{STATE_COLOURS.get(s, "#999")}"></i>{_e(s)}</span>'
             for s in states]
    items += [f'<span><i class="sw" style="background:{c}"></i>{f} fault</span>' for f, c in _FAULT_COLOURS.items()]
    return '<p class="legend">' + "".join(items) + "</p>"


# --- violations ------------------------------------------------------------------------------------


def _violations(logs: Sequence[LoadedLog]) -> Iterator[str]:
    # Times from each log's earliest record, as on the timeline (its clock's raw readings mean
    # nothing to a reader; a helper's review found them here).
    rows: list[tuple[str, Record, int]] = []
    for log in logs:
        t0 = _t0(log)
        rows += [(log.name, r, r.event.t_ns - t0) for r in log.records if r.fault is not None]
    stuck = [(log.name, m, k, s) for log in logs for m, k, s in summarize(log.records, timelines=False).stuck]
    yield f"<h2>Violations ({len(rows)})</h2>"
    if rows:
        offset = offsets(max(t for _, _, t in rows), pad=False)
        yield ("<table><tr><th>log</th><th>seq</th><th>t (from the log's earliest record)</th><th>machine</th>"
               "<th>key</th><th>event</th><th>outcome</th><th>fault</th><th>reason</th></tr>")
        for name, r, t in rows:
            fault = r.fault.value if r.fault is not None else ""
            yield (f"<tr><td>{_e(name)}</td><td class=\"num\">{r.seq}</td><td class=\"num\">"
                   f"{_e(offset(t))}</td><td>{_e(r.machine)}</td><td>{_e(_key(machine_key(r)))}</td>"
                   f"<td>{_e(type(r.event).__name__)} {_e(event_detail(r.event))}</td>"
                   f"<td>{_e(r.outcome.name.lower())}</td><td style=\"color:{_FAULT_COLOURS.get(fault, '#000')}\">"
                   f"{_e(fault)}</td><td>{_e(r.reason)}</td></tr>")
        yield "</table>"
    yield f"<h2>Not terminal at the end ({len(stuck)})</h2>"
    if stuck:
        yield "<table><tr><th>log</th><th>machine</th><th>key</th><th>state</th></tr>"
        yield from (f"<tr><td>{_e(n)}</td><td>{_e(m)}</td><td>{_e(_key(k))}</td><td>{_e(s)}</td></tr>"
                    for n, m, k, s in stuck)
        yield "</table>"


# --- state diagrams --------------------------------------------------------------------------------


def _layers(table: Table) -> dict[str, int]:
    """Breadth-first depth of each state from the initial one: the column it is drawn in."""
    succ: dict[str, list[str]] = {}
    for src, _, go in table.edges():
        succ.setdefault(src.name, []).append(go.dst.name)
    depth = {table.initial.name: 0}
    todo = [table.initial.name]
    while todo:
        s = todo.pop(0)
        for d in succ.get(s, []):
            if d not in depth:
                depth[d] = depth[s] + 1
                todo.append(d)
    return depth


def diagram_svg(table: Table, entered: Counter[str], moved: Counter[tuple[str, str]]) -> str:
    """The table's states and transitions, laid out in layers; what the logs exercised in colour."""
    depth = _layers(table)
    columns: dict[int, list[str]] = {}
    for s in table.states:
        columns.setdefault(depth.get(s.name, 0), []).append(s.name)
    node_w, node_h, col_gap, row_gap = 130, 30, 70, 26
    pos: dict[str, tuple[float, float]] = {}
    for col, names in columns.items():
        for i, name in enumerate(names):
            pos[name] = (20 + col * (node_w + col_gap), 20 + i * (node_h + row_gap))
    width = 40 + (max(columns) + 1) * (node_w + col_gap)
    height = 80 + max(len(v) for v in columns.values()) * (node_h + row_gap)
    labels: dict[tuple[str, str], list[str]] = {}
    for state, etype, go in table.edges():
        labels.setdefault((state.name, go.dst.name), []).append(etype.__name__)
    out = [f'<svg class="diagram" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
           f'<defs><marker id="arrow-{table.name}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto-start-reverse"><path d="M0 0 L10 5 L0 10 z" fill="#555"/></marker></defs>']
    for (src, dst), evs in labels.items():
        if src == dst:
            continue
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        hit = moved[(src, dst)]
        style = 'stroke="#333" stroke-width="2"' if hit else 'stroke="#bbb" stroke-dasharray="4,3"'
        if depth.get(dst, 0) > depth.get(src, 0):
            d = f"M{x1 + node_w:.0f} {y1 + node_h / 2:.0f} L{x2:.0f} {y2 + node_h / 2:.0f}"
        else:  # same column or backwards: an arc under the boxes
            sx, ex, by = x1 + node_w / 2, x2 + node_w / 2, max(y1, y2) + node_h
            d = f"M{sx:.0f} {y1 + node_h:.0f} C{sx:.0f} {by + 40:.0f} {ex:.0f} {by + 40:.0f} {ex:.0f} {y2 + node_h:.0f}"
        tip = f"{src} -> {dst}: {', '.join(dict.fromkeys(evs))}" + (f" (taken {hit} times)" if hit else " (not taken)")
        out.append(f'<path d="{d}" fill="none" {style} marker-end="url(#arrow-{table.name})">'
                   f"<title>{_e(tip)}</title></path>")
    for s in table.states:
        x, y = pos[s.name]
        n = entered[s.name]
        fill = STATE_COLOURS.get(s.name, "#999") if n else "#eeeeee"
        ink = "#fff" if n else "#999"
        border = ' stroke="#000" stroke-width="3"' if s.terminal else ' stroke="#555"'
        out.append(f'<rect x="{x}" y="{y}" width="{node_w}" height="{node_h}" rx="8" fill="{fill}"{border}>'
                   f"<title>{_e(s.name)}: entered {n} times</title></rect>")
        out.append(f'<text x="{x + node_w / 2}" y="{y + 19}" font-size="12" text-anchor="middle" fill="{ink}">'
                   f"{_e(s.name)}{' *' if s is table.initial else ''}</text>")
    out.append("</svg>")
    return "\n".join(out)


def _matrix(table: Table, cells: Counter[tuple[str, str]]) -> Iterator[str]:
    yield '<table class="matrix"><tr><th>state \\ event</th>'
    yield "".join(f'<th class="ev">{_e(e.__name__)}</th>' for e in table.events) + "</tr>"
    for s in table.states:
        tds = []
        for e in table.events:
            n = cells[(s.name, e.__name__)]
            kinds = {type(o) for o in table.cells[(s, e)]}
            cls = "hit" if n else "go" if Go in kinds else "ign" if Ignore in kinds else "ill"
            mark = str(n) if n else {"go": "→", "ign": "i", "ill": "✗"}[cls]
            tip = f"{s.name} x {e.__name__}: {cell_summary(table, s, e)}" + (f" (exercised {n} times)" if n else "")
            tds.append(f'<td class="{cls}" title="{_e(tip)}">{_e(mark)}</td>')
        yield f"<tr><th>{_e(s.name)}</th>{''.join(tds)}</tr>"
    yield "</table>"


def _diagrams(logs: Sequence[LoadedLog]) -> Iterator[str]:
    cells: Counter[tuple[str, str, str]] = Counter()
    entered: dict[str, Counter[str]] = {m: Counter() for m in TABLES}
    moved: dict[str, Counter[tuple[str, str]]] = {m: Counter() for m in TABLES}
    for log in logs:
        for r in log.records:
            if r.machine in TABLES:
                cells[(r.machine, r.before, type(r.event).__name__)] += 1
                if r.state != r.before:
                    moved[r.machine][(r.before, r.state)] += 1
                    entered[r.machine][r.state] += 1
                    if r.before == TABLES[r.machine].initial.name:  # it was in its initial state first
                        entered[r.machine][r.before] += 1
    yield "<h2>State machines: what the logs exercised</h2>"
    yield ("<p>Coloured states were entered and dark transitions taken; grey and dashed ones were not. "
           "In the cell matrix a green cell was exercised (the number of records), → is a transition "
           "never exercised, i an ignore, ✗ an illegal cell (hover for the decision).</p>")
    for name, table in TABLES.items():
        mine = Counter({(b, e): n for (m, b, e), n in cells.items() if m == name})
        yield f"<h3>{_e(name)}</h3>"
        yield diagram_svg(table, entered[name], moved[name])
        yield from _matrix(table, mine)
        shade = {(b, e) for b, e in mine} | {(s, "") for s in entered[name]}
        source = html.escape(mermaid(table, shade=shade))  # multi-line: its newlines stay
        yield f"<details><summary>Mermaid source</summary><pre>{source}</pre></details>"


# --- the page --------------------------------------------------------------------------------------


def render_report(logs: Sequence[LoadedLog], *, rows: int = 200, title: str = "pdfsm report") -> str:
    """The whole page, as one string."""
    order = {s: i for i, s in enumerate(STATE_COLOURS)}
    used = sorted({v.state for log in logs for v in visits(log.records)}, key=lambda s: (order.get(s, len(order)), s))
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1>",
             f"<p>{len(logs)} logs: {_e(', '.join(log.name for log in logs))}. Generated by <code>pdfsm report</code>; "
             "statuses as <code>pdfsm replay</code> decides them.</p>",
             "<h2>Summary</h2>", *_summary(logs),
             "<h2>Timeline</h2>",
             "<p>One row per machine; a bar per state visit (dashed outline: still in it when the log ended; "
             "a thin mark: a terminal state); diamonds are violations. Hover for details. Each log's times "
             "are from its own first record; clocks of different hosts are not compared.</p>",
             _legend(used), timeline_svg(logs, rows=rows),
             *_violations(logs), *_diagrams(logs), "</body></html>"]
    return "\n".join(parts) + "\n"


def report_command(args: argparse.Namespace) -> int:
    """``pdfsm report``: the logs are replayed as for ``pdfsm replay``; its exit code, the page written
    anyway unless no log could be read at all."""
    if args.rows < 0:
        print("pdfsm report: --rows must be >= 0", file=sys.stderr)
        return Exit.USAGE
    logs = load_all(args.logs)
    warn_unreadable(logs, "pdfsm report")
    for log in logs:
        if log.status == "divergence":
            print(f"pdfsm report: {log.name}: {printable(log.error.splitlines()[0])}", file=sys.stderr)
    code = next((int(log.exit_code) for log in logs if log.exit_code), 0)  # the first failing log's, as replay
    if none_read(logs, args.output, "pdfsm report"):
        return code
    if not write_output(args.output, render_report(logs, rows=args.rows), "pdfsm report"):
        return Exit.USAGE
    say_written(args.output,
                f"wrote {printable(args.output)}: {len(logs)} logs, self-contained (open it in any browser)")
    return code
