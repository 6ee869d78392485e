"""The table machinery: malformed tables are refused when defined; the real ones pass."""

from __future__ import annotations

import pytest

from pdfsm import consumer, engine, producer
from pdfsm.diagram import cell_summary, dot, markdown, mermaid
from pdfsm.events import AbortRequested, HandleDone, ReadRequested
from pdfsm.fsm import Fault, Go, Ignore, Illegal, State, Table, TableError, on

A, B, C = State("A"), State("B"), State("C", terminal=True)


def _yes(m: object, ev: object, core: object) -> bool:
    return True


def _table(*cells: dict, states: tuple[State, ...] = (A, B, C), initial: State = A) -> Table:  # type: ignore[type-arg]
    return Table("t", states=states, initial=initial, events=(ReadRequested, HandleDone), cells=cells)


GOOD = (
    on(A, ReadRequested, Go(B)),
    on(A, HandleDone, Illegal(Fault.LOCAL, "no")),
    on(B, ReadRequested, Ignore("dup")),
    on(B, HandleDone, Go(C)),
    on(C, (ReadRequested, HandleDone), Ignore("done")),
)


def test_a_well_formed_table_is_accepted() -> None:
    t = _table(*GOOD)
    assert t.targets(A, ReadRequested) == {B}
    assert t.targets(B, ReadRequested) == {B}


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        (GOOD[:-1], "undecided cells: (C, HandleDone), (C, ReadRequested)"),
        ((*GOOD, on(A, ReadRequested, Go(B))), "decided twice"),
        ((GOOD[0], GOOD[1], GOOD[2], on(B, HandleDone, Go(B)), GOOD[4]), "unreachable states: C"),
        ((GOOD[0], GOOD[1], on(B, ReadRequested, Go(C, when=_yes)), GOOD[3], GOOD[4]), "last option must be unguarded"),
        ((GOOD[0], GOOD[1], on(B, ReadRequested, Go(C), Go(B)), GOOD[3], GOOD[4]), "hides the ones after it"),
        ((*GOOD[:4], on(C, ReadRequested, Go(A)), on(C, HandleDone, Ignore("x"))), "leaves terminal state C"),
        ((*GOOD, on(A, AbortRequested, Go(B))), "unknown states or events"),
    ],
)
def test_malformed_tables_are_refused(cells: tuple[dict, ...], message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(TableError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _table(*cells)


def test_a_trap_is_refused() -> None:
    d = State("D")
    cells = (*GOOD[:3], on(B, HandleDone, Go(C), ), GOOD[4], on(A, AbortRequested, Go(d)))
    with pytest.raises(TableError, match="no terminal state is reachable from D"):
        Table("t", states=(A, B, C, d), initial=A, events=(ReadRequested, HandleDone, AbortRequested),
              cells=(*cells, on(d, (ReadRequested, HandleDone, AbortRequested), Go(d)),
                     on((B, C), AbortRequested, Ignore("x"))))


def test_options_need_reasons() -> None:
    with pytest.raises(TableError):
        Ignore("")
    with pytest.raises(TableError):
        Illegal(Fault.REMOTE, "")
    with pytest.raises(TableError):
        Go(B, fault=Fault.REMOTE)


@pytest.mark.parametrize("table", [consumer.TABLE, producer.TABLE, engine.TABLE], ids=lambda t: t.name)
def test_real_tables_are_total_and_render(table: Table) -> None:
    assert len(table.cells) == len(table.states) * len(table.events)
    text = mermaid(table)
    assert text.startswith("stateDiagram-v2") and f"[*] --> {table.initial.name}" in text
    assert f'digraph "{table.name}"' in dot(table)
    for state in table.states:
        for etype in table.events:
            assert cell_summary(table, state, etype)


def test_mermaid_shades_states_a_log_never_reached() -> None:
    text = mermaid(producer.TABLE, shade={("HOLDING", "BlocksHeld")})
    assert "class EXPIRED unvisited" in text and "class HOLDING unvisited" not in text


def test_markdown_lists_every_cell() -> None:
    page = markdown()
    total = sum(len(t.states) * len(t.events) for t in (consumer.TABLE, producer.TABLE, engine.TABLE))
    assert page.count("\n| ") - 3 * 1 == total  # one header row per machine
