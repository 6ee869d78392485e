"""Render transition tables as Mermaid or Graphviz diagrams, and as the generated docs page.

Everything here is derived from the tables themselves: docs/state-machines.md is
the output of :func:`markdown` and a test fails when the committed file is stale.
``shade`` (a set of exercised (state, event) cells) greys out what a log never hit.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdfsm import consumer, engine, producer
from pdfsm.fsm import Go, Ignore, Illegal, Option, State, Table, label

__all__ = ["TABLES", "cell_summary", "dot", "markdown", "mermaid"]

TABLES: dict[str, Table] = {"consumer": consumer.TABLE, "producer": producer.TABLE, "engine": engine.TABLE}


def _edges(table: Table) -> dict[tuple[State, State], list[str]]:
    """Transition labels grouped by (source, destination), in table order."""
    edges: dict[tuple[State, State], list[str]] = {}
    for src, etype, go in table.edges():
        guard = f" [{label(go.when)}]" if go.when is not None else ""
        text = f"{etype.__name__}{guard}"
        labels = edges.setdefault((src, go.dst), [])
        if text not in labels:
            labels.append(text)
    return edges


def mermaid(table: Table, *, shade: Iterable[tuple[str, str]] | None = None) -> str:
    """A Mermaid ``stateDiagram-v2``; with ``shade`` (the (state, event) cells a log exercised),
    states never entered there are drawn grey: all of them when it is empty."""
    lines = ["stateDiagram-v2", f"    [*] --> {table.initial.name}"]
    for (src, dst), labels in _edges(table).items():
        lines.append(f"    {src.name} --> {dst.name}: {'<br/>'.join(labels)}")
    lines.extend(f"    {s.name} --> [*]" for s in table.states if s.terminal)
    if shade is not None:
        seen = {state for state, _ in shade}
        lines.append("    classDef unvisited fill:#eee,color:#999")
        lines.extend(f"    class {s.name} unvisited" for s in table.states if s.name not in seen)
    return "\n".join(lines) + "\n"


def dot(table: Table) -> str:
    """A Graphviz digraph of the table's transitions."""
    lines = [f'digraph "{table.name}" {{', "    rankdir=LR;", '    node [shape=box, style=rounded];',
             '    start [shape=point];', f"    start -> {table.initial.name};"]
    lines.extend(f"    {s.name} [peripheries=2];" for s in table.states if s.terminal)
    for (src, dst), labels in _edges(table).items():
        text = "\\n".join(labels).replace('"', '\\"')
        lines.append(f'    {src.name} -> {dst.name} [label="{text}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _option(opt: Option) -> str:
    guard = f" if {label(opt.when)}" if opt.when is not None else ""
    if isinstance(opt, Go):
        fault = f" (handles a {opt.fault.value} fault)" if opt.fault is not None else ""
        return f"→ {opt.dst.name}{guard}{fault}"
    if isinstance(opt, Ignore):
        return f"ignore{guard}: {opt.reason}"
    assert isinstance(opt, Illegal)
    return f"illegal ({opt.fault.value}){guard}: {opt.reason}"


def cell_summary(table: Table, state: State, etype: type) -> str:
    """One cell in words, options in the order they are tried."""
    return "; ".join(_option(o) for o in table.cells[(state, etype)])


def markdown(tables: dict[str, Table] | None = None) -> str:
    """The whole generated docs page: a diagram and every cell of every machine."""
    tables = tables or TABLES
    out = [
        "# State machines",
        "",
        "<!-- Generated from the transition tables by `pdfsm diagram --markdown`; do not edit. -->",
        "",
        "Every (state, event) cell of every machine is decided: a transition (→), an ignore with",
        "its reason, or an illegal event with whose fault it is. Options in a cell are tried in",
        "order; the first whose guard holds decides, and the last one has no guard.",
        "",
    ]
    for name, table in tables.items():
        out += [f"## {name}", "", "```mermaid", mermaid(table).rstrip(), "```", "", "| state | event | decision |",
                "|---|---|---|"]
        for state in table.states:
            for etype in table.events:
                text = cell_summary(table, state, etype).replace("|", "\\|")
                out.append(f"| {state.name} | {etype.__name__} | {text} |")
        out.append("")
    return "\n".join(out)
