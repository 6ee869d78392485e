"""Replay: deterministic, divergence named at the first differing record, torn tails accepted."""

from __future__ import annotations

import msgspec
import pytest
from helpers import collect, connected, ev, handshake, make_core, read, tick

from pdfsm.errors import LocalProtocolError
from pdfsm.events import AbortRequested, BlocksHeld, HandleDone, HandleFailed, HandleFailure, NotificationReceived
from pdfsm.log import MemorySink, Record
from pdfsm.replay import Divergence, render, replay, summarize


def _busy_log(strict: bool = False) -> list[Record]:
    sink = MemorySink()
    core = make_core(strict=strict, sink=sink, engine_id="D", lease_ns=500)
    core.apply(read("a", remote_tp=2))
    core.apply(read("b", remote_tp=2))
    handshake(core, tp_size=2)
    core.apply(ev(HandleFailed, 5, request_id="a", pp_rank=0, tp_rank=1, why=HandleFailure.ERR))
    core.apply(ev(HandleDone, 6, request_id="a", pp_rank=0, tp_rank=0))
    core.apply(ev(AbortRequested, 7, request_id="b"))
    core.apply(ev(HandleDone, 8, request_id="b", pp_rank=0, tp_rank=0))
    core.apply(ev(HandleDone, 8, request_id="b", pp_rank=0, tp_rank=0))  # illegal: recorded, quarantines
    core.apply(ev(HandleFailed, 8, request_id="b", pp_rank=0, tp_rank=1, why=HandleFailure.CANCELLED))
    core.apply(ev(BlocksHeld, 9, request_id="p", block_ids=(1,)))
    core.apply(ev(NotificationReceived, 9, request_id="ghost", part=0, of=1))
    tick(core, 10_000_000_000_000)
    collect(core, 20)
    core.log.flush()
    return sink.records


def test_replay_reproduces_every_record_and_is_deterministic() -> None:
    records = _busy_log()
    first, second = replay(records), replay(records)
    assert first.log.next_seq == second.log.next_seq == len(records)
    assert list(render(summarize(records))) == list(render(summarize(records)))


def test_an_edited_state_is_a_divergence_naming_the_record() -> None:
    records = _busy_log()
    i = next(i for i, r in enumerate(records) if r.state == "FAILING")
    edited = [*records[:i], msgspec.structs.replace(records[i], state="READING"), *records[i + 1:]]
    with pytest.raises(Divergence) as err:
        replay(edited)
    assert err.value.seq == records[i].seq and "state differs" in str(err.value)


def test_a_dropped_derived_record_is_a_divergence() -> None:
    records = _busy_log()
    i = next(i for i, r in enumerate(records) if r.cause is not None)
    with pytest.raises(Divergence):
        replay([*records[:i], *records[i + 1:]])


def test_a_torn_tail_mid_cascade_replays() -> None:
    records = _busy_log()
    last_derived = max(i for i, r in enumerate(records) if r.cause is not None)
    replay(records[:last_derived])


def test_strict_logs_replay_too() -> None:
    sink = MemorySink()
    core = connected(make_core(strict=True, sink=sink))
    with pytest.raises(LocalProtocolError):
        core.apply(ev(HandleDone, request_id="nobody", pp_rank=0, tp_rank=0))
    core.log.flush()
    replay(sink.records)


def test_summary_at_any_sequence_number() -> None:
    records = _busy_log()
    at = next(r.seq for r in records if r.state == "FAILING")
    past = summarize(records, at=at)
    assert past.states[("consumer", "a")] == "FAILING"
    end = summarize(records)
    assert end.states[("consumer", "a")] == "RELEASED"
    assert {f for f in end.by_fault()} == {"local", "remote"}
    assert not end.stuck
