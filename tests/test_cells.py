"""Every (state, event type) cell of every machine, driven with Hypothesis-drawn event fields.

For each cell a scenario brings a machine into the state, Hypothesis draws an event
of the type aimed at that machine, and the core applies it in strict mode. The
outcome must be a state the cell allows, or a typed protocol error raised by that
very event with the machine's state and data untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from helpers import collect, connected, ev, handshake, make_core, read, reply, tick
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfsm import consumer, engine, producer
from pdfsm.core import Core
from pdfsm.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from pdfsm.events import (
    AbortRequested,
    BlocksHeld,
    DeadlinePassed,
    EngineFailed,
    EngineQuarantined,
    EngineReady,
    EngineWanted,
    EvictRequested,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    Heartbeat,
    LeaseExpired,
    NotificationReceived,
    PeerAdded,
    PeerDisconnected,
    Promised,
    Quarantined,
    ReadRequested,
    Reported,
    StagedDropped,
)
from pdfsm.fsm import Illegal, State, Table

RID, PID, EKEY, WAITER = "r", "p", ("P", 0), "w"

# --- scenarios: a core holding the machine under test in a given state --------------------------


def _consumer(state: str) -> Core:
    core = make_core()
    if state == "NEW":
        return core
    if state in ("HANDSHAKING", "ABORTED"):
        core.apply(read(RID))
        if state == "ABORTED":
            core.apply(ev(AbortRequested, request_id=RID))
        return core
    connected(core, remote_tp=2)
    core.apply(read(RID, remote_tp=2))
    steps: dict[str, list[Any]] = {
        "READING": [],
        "NOTIFIED": [ev(HandleDone, request_id=RID, pp_rank=0, tp_rank=0),
                     ev(HandleDone, request_id=RID, pp_rank=0, tp_rank=1)],
        "FAILING": [ev(HandleFailed, request_id=RID, pp_rank=0, tp_rank=0, why=HandleFailure.ERR)],
        "FAILED": [ev(HandleFailed, request_id=RID, pp_rank=0, tp_rank=0, why=HandleFailure.ERR),
                   ev(HandleDone, request_id=RID, pp_rank=0, tp_rank=1)],
        "ABORTING": [ev(AbortRequested, request_id=RID)],
        "RELEASED": [ev(HandleDone, request_id=RID, pp_rank=0, tp_rank=0),
                     ev(HandleDone, request_id=RID, pp_rank=0, tp_rank=1)],
    }
    for e in steps[state]:
        core.apply(e)
    if state == "RELEASED":
        collect(core)
    return core


def _producer(state: str) -> Core:
    core = make_core(engine_id="P", lease_ns=1_000)
    if state == "STAGED":
        core.apply(ev(NotificationReceived, request_id=PID, part=0, of=2))
    elif state in ("HOLDING", "RELEASED", "EXPIRED"):
        core.apply(ev(BlocksHeld, request_id=PID, block_ids=(1, 2)))
        if state == "RELEASED":
            core.apply(ev(NotificationReceived, request_id=PID, part=0, of=1))
        elif state == "EXPIRED":
            tick(core, 5_000)
    elif state == "DISCARDED":  # forgotten once reached; only a cascade could still touch it
        m = producer.ProducerRequest(PID)
        m.state = producer.S.DISCARDED
        core.producers[PID] = m
    return core


def _engine(state: str) -> Core:
    core = make_core()
    if state == "UNKNOWN":
        return core
    if state == "EVICTED":  # forgotten once reached; only a cascade could still touch it
        m = engine.RemoteEngine(EKEY)
        m.state = engine.S.EVICTED
        core.engines[EKEY] = m
        return core
    core.apply(read(RID))
    if state == "FAILED":
        core.apply(ev(HandshakeFailed, engine_id="P", pp_rank=0, attempt=1, error="refused"))
    elif state == "CONNECTING":
        core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply()))
    elif state in ("CONNECTED", "DISCONNECTED"):
        handshake(core)
        if state == "DISCONNECTED":
            core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0))
    return core


SCENARIOS: dict[str, tuple[Table, Callable[[str], Core], str, Any]] = {
    "consumer": (consumer.TABLE, _consumer, "consumers", RID),
    "producer": (producer.TABLE, _producer, "producers", PID),
    "engine": (engine.TABLE, _engine, "engines", EKEY),
}

# --- events aimed at the machine under test, with drawn fields -----------------------------------

ranks = st.integers(0, 2)
small = st.integers(0, 3)
times = st.integers(0, 10_000)
blocks = st.lists(st.integers(0, 8), max_size=3).map(tuple)


def _event(etype: type, data: st.DataObject) -> Any:
    d = data.draw
    t = d(times)
    if etype is ReadRequested:
        n = d(st.integers(0, 2))
        return read(RID, t=t, blocks=tuple(range(n)), remote_tp=d(st.sampled_from([1, 2, 3])),
                    remote_pp=d(st.integers(1, 2)))
    consumer_ids = {"request_id": RID}
    if etype in (EngineReady, EngineFailed):
        extra: dict[str, Any] = {"engine_id": d(st.sampled_from(["P", "Q"])), "pp_rank": d(ranks)}
        if etype is EngineFailed:
            extra |= {"error": "x", "remote_fault": d(st.booleans())}
        return ev(etype, t, **consumer_ids, **extra)
    if etype is HandleDone:
        return ev(etype, t, **consumer_ids, pp_rank=d(ranks), tp_rank=d(small))
    if etype is HandleFailed:
        return ev(etype, t, **consumer_ids, pp_rank=d(ranks), tp_rank=d(small),
                  why=d(st.sampled_from(list(HandleFailure))))
    if etype in (AbortRequested, DeadlinePassed, Reported):
        return ev(etype, t, **consumer_ids)
    if etype is Quarantined:
        return ev(etype, t, **consumer_ids, reason="test")
    if etype is Promised:
        return ev(etype, t, **consumer_ids, promised_ns=d(st.integers(0, 20_000)))
    if etype is BlocksHeld:
        return ev(etype, t, request_id=PID, block_ids=d(blocks))
    if etype is NotificationReceived:
        return ev(etype, t, request_id=PID, part=d(st.integers(-1, 3)), of=d(st.integers(0, 3)))
    if etype is Heartbeat:
        return ev(etype, t, request_id=PID, extend_ns=d(st.integers(1, 5_000)))
    if etype is LeaseExpired:
        return ev(etype, t, request_id=PID)
    if etype is StagedDropped:
        return ev(etype, t, request_id=PID, reason="test")
    engine_ids: dict[str, Any] = {"engine_id": "P", "pp_rank": 0}
    if etype is EngineWanted:  # derived: only ever names a request that waits for this engine
        return ev(etype, t, **engine_ids, request_id=WAITER, host="h", port=1)
    if etype is HandshakeDone:
        good = reply()
        bad = reply("Q")
        return ev(etype, t, **engine_ids, attempt=d(small), reply=d(st.sampled_from([good, bad])))
    if etype is HandshakeFailed:
        return ev(etype, t, **engine_ids, attempt=d(small), error="x")
    if etype is PeerAdded:
        return ev(etype, t, **engine_ids, attempt=d(small))
    if etype in (PeerDisconnected, EvictRequested):
        return ev(etype, t, **engine_ids)
    if etype is EngineQuarantined:
        return ev(etype, t, **engine_ids, reason="test")
    raise AssertionError(f"no strategy for {etype.__name__}")


def _add_waiter(core: Core) -> None:
    """A request waiting for engine (P, 0), as the consumer machine leaves it before it derives
    EngineWanted (built by hand: applying its ReadRequested would already move the engine)."""
    w = consumer.ConsumerRequest(WAITER)
    w.req = read(WAITER)
    w.plan = core.plan(1, 1)
    w.waiting = 1
    w.state = consumer.S.HANDSHAKING
    core.consumers[WAITER] = w


def _snapshot(m: Any) -> dict[str, Any]:
    """Every slot; containers copied (states are compared by identity, so never copied)."""
    # The compiled build lists a class's fields, its base's included; pure Python, each class its own.
    names = getattr(type(m), "__mypyc_attrs__", None) or [
        n for c in type(m).__mro__ for n in getattr(c, "__slots__", ())]
    values = {name: getattr(m, name) for name in names}
    return {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v for k, v in values.items()}


CELLS = [
    pytest.param(name, state, etype, id=f"{name}-{state.name}-{etype.__name__}")
    for name, (table, *_rest) in SCENARIOS.items()
    for state in table.states
    for etype in table.events
]


def test_every_cell_is_listed() -> None:
    assert len(CELLS) == sum(len(t.states) * len(t.events) for t, *_ in SCENARIOS.values())


@pytest.mark.parametrize(("name", "state", "etype"), CELLS)
@settings(max_examples=12)
@given(data=st.data())
def test_cell(name: str, state: State, etype: type, data: st.DataObject) -> None:
    table, scenario, attr, key = SCENARIOS[name]
    core = scenario(state.name)
    machines = getattr(core, attr)
    m = machines.get(key)
    if state is table.initial:
        assert m is None
    elif m is None:  # a terminal state the core remembers by key only
        assert state.terminal and core._remembered[{"consumers": 1, "producers": 2}[attr]][key] is state
    else:
        assert m.state is state, f"scenario did not reach {state}"
    before = _snapshot(m) if m is not None else None
    event = _event(etype, data)
    if etype is EngineWanted:
        _add_waiter(core)
    seq = core.log.next_seq
    try:
        core.apply(event)
    except ProtocolError as err:
        assert isinstance(err, (LocalProtocolError, RemoteProtocolError))
        assert err.seq == seq, f"a derived event was refused: {err}"
        assert any(isinstance(o, Illegal) for o in table.cells[(state, etype)])
        after = machines.get(key)
        assert (after is None) == (m is None)
        if m is not None:
            assert _snapshot(m) == before, "an illegal event changed the machine"
        return
    rec = core.log.records()[seq - core.log.evicted] if core.log.evicted else core.log.records()[seq]
    assert rec.seq == seq
    assert rec.state in {s.name for s in table.targets(state, etype)}
    if rec.outcome.name == "IGNORED" and m is not None:
        assert _snapshot(m) == before, "an ignored event changed the machine"
