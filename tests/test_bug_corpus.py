"""One regression test per row of ../shared/context/bug-corpus.md, named after its id.

Each drives the real machines through the scenario that broke a real system and
asserts the outcome pdfsm guarantees: the event is illegal (rejected, state
unchanged, attributed to the right side) or it is handled (a defined transition
with the right outcome).
"""

from __future__ import annotations

import threading

import pytest
from helpers import collect, connected, ev, make_core, read, reply, tick

from pdfsm.commands import CancelRead, DropPeer, FinishedSending, HandOff, PostRead, SendNotification, StartHandshake
from pdfsm.connector import Connector
from pdfsm.errors import EngineIdMismatch, LocalProtocolError, RemoteProtocolError, UnsupportedPP
from pdfsm.events import (
    AbortRequested,
    BlocksHeld,
    CoreConfig,
    Deadline,
    EvictRequested,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    Heartbeat,
    LeaseExpired,
    NotificationReceived,
)
from pdfsm.fsm import Fault
from pdfsm.timers import Timers
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport

# --- the four the project started from --------------------------------------------------------


def test_vllm_pr_39907_engine_id_mismatch_is_a_typed_failure_naming_both_ids() -> None:
    core = make_core(strict=False)
    core.apply(read("r1", engine="prefill-node0"))
    core.apply(ev(HandshakeDone, engine_id="prefill-node0", pp_rank=0, attempt=1, reply=reply("prefill-node1")))
    engine = core.engines[("prefill-node0", 0)]
    assert engine.state.name == "FAILED"
    assert isinstance(engine.error, EngineIdMismatch)
    assert "prefill-node0" in str(engine.error) and "prefill-node1" in str(engine.error)
    violation = [r for r in core.log.records() if r.fault is not None][-1]
    assert violation.fault is Fault.REMOTE and "prefill-node1" in violation.reason
    (hand_off,) = [c for c in collect(core) if isinstance(c, HandOff)]
    assert hand_off.outcome == "failed" and hand_off.policy == "recompute" and hand_off.invalid_blocks == (1, 2)


def test_vllm_pr_43720_pp_rank_above_zero_refused_at_once_without_pp_support() -> None:
    core = make_core(strict=False, supports_pp=False)
    core.apply(read("r1", remote_pp=2))
    assert core.consumers["r1"].state.name == "FAILED"
    assert not [c for c in core.take_commands() if isinstance(c, StartHandshake)]  # refused before any I/O
    assert str(UnsupportedPP(1)) in core.consumers["r1"].error
    assert core.violations[Fault.LOCAL] == 1
    (hand_off,) = [c for c in collect(core) if isinstance(c, HandOff)]
    assert hand_off.outcome == "failed" and "pipeline" in hand_off.reason


def test_vllm_pr_43720_engines_keyed_by_pp_rank_and_metadata_by_pp_and_tp() -> None:
    core = make_core()
    core.apply(read("r1", remote_pp=2))
    starts = {(c.engine_id, c.pp_rank) for c in core.take_commands() if isinstance(c, StartHandshake)}
    assert starts == {("P", 0), ("P", 1)}
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=1, attempt=1, reply=reply(pp_rank=0, pp_size=2)))
    assert core.engines[("P", 1)].state.name == "FAILED"  # metadata keyed (0, t) answered for pp_rank 1
    assert "keyed by (pp_rank, tp_rank)" in str(core.engines[("P", 1)].error)


def test_vllm_pr_36958_mla_notifications_carry_the_producer_request_id() -> None:
    core = connected(make_core(mla=True), remote_tp=2)
    core.apply(read("decode-local-7", remote="prefill-42", remote_tp=2))
    core.apply(ev(HandleDone, request_id="decode-local-7", pp_rank=0, tp_rank=0))
    cmds = core.take_commands()
    (post,) = [c for c in cmds if isinstance(c, PostRead)]
    (extra,) = [c for c in cmds if isinstance(c, SendNotification)]
    assert post.source.tp_rank == 0 and extra.tp_rank == 1  # read one rank, notify the other
    assert post.notification.request_id == extra.notification.request_id == "prefill-42"
    # On the producer, a notification for a request it never had is a remote violation.
    prod = make_core(strict=False, engine_id="P", lease_ns=10)
    prod.apply(ev(NotificationReceived, request_id="decode-local-7", part=0, of=1))
    tick(prod, 100)
    assert prod.violations[Fault.REMOTE] == 1
    assert "never registered" in next(r for r in prod.log.records() if r.fault).reason


def test_vllm_pr_40364_handshake_failure_honours_the_recompute_policy() -> None:
    core = make_core(strict=False, policy="recompute")
    core.apply(read("r1"))
    core.apply(ev(HandshakeFailed, engine_id="P", pp_rank=0, attempt=1, error="connection refused"))
    (hand_off,) = [c for c in collect(core) if isinstance(c, HandOff)]
    assert hand_off.outcome == "failed" and hand_off.policy == "recompute" and hand_off.invalid_blocks == (1, 2)


def test_vllm_pr_40364_one_failed_handle_keeps_the_request_until_siblings_stop() -> None:
    core = connected(make_core(), remote_tp=2)  # producer TP 2 > consumer TP 1: two reads
    core.apply(read("r1", remote_tp=2))
    core.apply(ev(HandleFailed, request_id="r1", pp_rank=0, tp_rank=0, why=HandleFailure.ERR))
    assert core.consumers["r1"].state.name == "FAILING"
    assert not [c for c in collect(core) if isinstance(c, HandOff)]  # not reported yet
    core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=1))
    assert core.consumers["r1"].state.name == "FAILED"
    reports = [c for c in collect(core, step=2) if isinstance(c, HandOff)]
    assert [r.outcome for r in reports] == ["failed"]
    with pytest.raises(LocalProtocolError):  # a second report is impossible
        core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=1))
    assert not [c for c in collect(core, step=3) if isinstance(c, HandOff)]


# --- more from the same field ----------------------------------------------------------------


def test_vllm_pr_20139_blocks_are_released_by_lease_when_never_read() -> None:
    core = make_core(strict=False, engine_id="P", lease_ns=1_000)
    core.apply(ev(BlocksHeld, request_id="p1", block_ids=(3, 4)))
    tick(core, 999)
    assert core.producers["p1"].state.name == "HOLDING"
    tick(core, 1_000)
    (freed,) = [c for c in core.take_commands() if isinstance(c, FinishedSending)]
    assert freed.expired and freed.block_ids == (3, 4)
    assert "p1" not in core.producers


def test_vllm_pr_24268_release_by_notification_and_expiry_in_one_pass_frees_once() -> None:
    core = make_core(strict=False, engine_id="P", lease_ns=1_000)
    core.apply(ev(BlocksHeld, request_id="p1", block_ids=(3,)))
    core.apply(ev(NotificationReceived, 1_000, request_id="p1", part=0, of=1))
    core.apply(ev(LeaseExpired, 1_000, request_id="p1"))  # the same pass: expiry right after
    tick(core, 2_000)
    frees = [c for c in core.take_commands() if isinstance(c, FinishedSending)]
    assert len(frees) == 1 and not frees[0].expired
    last = core.log.records()[-2]
    assert last.outcome.name == "IGNORED" and "already released" in last.reason


def test_vllm_pr_25067_abort_racing_with_finish_is_ignored_not_a_keyerror() -> None:
    core = connected(make_core())
    core.apply(read("r1"))
    core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=0))
    assert [c.outcome for c in collect(core) if isinstance(c, HandOff)] == ["received"]
    core.apply(ev(AbortRequested, request_id="r1"))  # the scheduler's abort arrives late
    rec = core.log.records()[-1]
    assert rec.outcome.name == "IGNORED" and rec.reason == "already released"
    assert not [c for c in collect(core, step=2) if isinstance(c, HandOff)]


def test_vllm_pr_26171_handshake_failure_reaches_every_waiting_request() -> None:
    core = make_core()
    for rid in ("a", "b", "c"):
        core.apply(read(rid))
    assert len([c for c in core.take_commands() if isinstance(c, StartHandshake)]) == 1  # one shared handshake
    core.apply(ev(HandshakeFailed, engine_id="P", pp_rank=0, attempt=1, error="peer died mid-handshake"))
    assert {core.consumers[r].state.name for r in "abc"} == {"FAILED"}
    assert sorted(c.request_id for c in collect(core) if isinstance(c, HandOff)) == ["a", "b", "c"]


def test_vllm_pr_56104_first_failed_handle_does_not_release_blocks_under_sibling_reads() -> None:
    core = connected(make_core(), remote_tp=4)
    core.apply(read("r1", remote_tp=4))
    assert len([c for c in core.take_commands() if isinstance(c, PostRead)]) == 4
    core.apply(ev(HandleFailed, request_id="r1", pp_rank=0, tp_rank=2, why=HandleFailure.RAISED))
    for tp in (0, 1):
        core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=tp))
        assert not [c for c in collect(core, step=tp) if isinstance(c, HandOff)]  # tp 3 may still write
    core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=3))
    (hand_off,) = [c for c in collect(core, step=9) if isinstance(c, HandOff)]
    assert hand_off.outcome == "failed" and hand_off.invalid_blocks == (1, 2)


def test_vllm_pr_32255_abort_holds_blocks_until_the_read_stops() -> None:
    core = connected(make_core())
    core.apply(read("r1"))
    core.apply(ev(AbortRequested, request_id="r1"))
    assert core.consumers["r1"].state.name == "ABORTING"
    assert [type(c) for c in core.take_commands()][-1] is CancelRead
    assert not [c for c in collect(core) if isinstance(c, HandOff)]  # a READ may still write
    core.apply(ev(HandleFailed, request_id="r1", pp_rank=0, tp_rank=0, why=HandleFailure.CANCELLED))
    (hand_off,) = [c for c in collect(core, step=2) if isinstance(c, HandOff)]
    assert hand_off.outcome == "aborted"


def test_vllm_pr_43509_notification_before_registration_is_staged_not_dropped() -> None:
    core = make_core(engine_id="P")
    core.apply(ev(NotificationReceived, request_id="p1", part=0, of=1))
    assert core.producers["p1"].state.name == "STAGED"
    core.apply(ev(BlocksHeld, request_id="p1", block_ids=(7,)))
    (freed,) = [c for c in core.take_commands() if isinstance(c, FinishedSending)]
    assert freed.block_ids == (7,) and not freed.expired


def test_vllm_pr_50789_issue_58222_expiry_is_not_stopped_by_an_extended_lease() -> None:
    core = make_core(engine_id="P", lease_ns=1_000)
    core.apply(ev(BlocksHeld, 0, request_id="early", block_ids=(1,)))
    core.apply(ev(BlocksHeld, 10, request_id="late", block_ids=(2,)))
    core.apply(ev(Heartbeat, 500, request_id="early", extend_ns=5_000))  # early now outlives late
    tick(core, 1_010)
    freed = [c.request_id for c in core.take_commands() if isinstance(c, FinishedSending)]
    assert freed == ["late"]
    assert core.producers["early"].state.name == "HOLDING"
    # The wheel itself: an out-of-order entry never hides a due one.
    wheel = Timers(shift=4)
    wheel.arm("a", 100)
    wheel.arm("b", 5)
    assert wheel.due(50) == [(5, "b")] and wheel.earliest() == 100


def test_vllm_pr_50326_deadline_from_another_clock_is_refused_until_rebased() -> None:
    core = make_core(engine_id="P", clock="worker-node1")
    scheduler_deadline = Deadline("scheduler-node0", 9_000_000)
    with pytest.raises(LocalProtocolError, match="another clock"):
        core.apply(ev(BlocksHeld, 100, request_id="p1", block_ids=(1,), deadline=scheduler_deadline))
    assert "p1" not in core.producers
    rebased = scheduler_deadline.rebased(there_now_ns=8_000_000, here_clock="worker-node1", here_now_ns=100)
    core.apply(ev(BlocksHeld, 100, request_id="p1", block_ids=(1,), deadline=rebased))
    assert core.producers["p1"].deadline == 1_000_100


def _sim_pair(policy: str = "recompute") -> tuple[SimNetwork, Connector, Connector, SimTransport]:
    net, clock = SimNetwork(), [0]
    prod = SimTransport(net, "P-0")
    prod.fill(range(64))
    p = Connector(CoreConfig(engine_id="P", compat_hash="h"), prod, SimHandshaker(net), clock=lambda: clock[0],
                  port=9)
    net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(prod.rank_info(),)))
    cons = SimTransport(net, "D-0")
    d = Connector(CoreConfig(engine_id="D", compat_hash="h", policy=policy), cons, SimHandshaker(net),  # type: ignore[arg-type]
                  clock=lambda: clock[0])
    return net, p, d, cons


def _steps_until_received(d: Connector, rid: str, steps: int = 5) -> int:
    """Scheduler steps until ``rid`` is reported finished receiving (its load errors with it)."""
    for step in range(steps):
        if rid in d.get_finished()[1]:
            return step
    raise AssertionError(f"{rid} not reported in {steps} steps")


def test_vllm_pr_28120_an_exception_from_polling_fails_the_handle_not_the_worker() -> None:
    net, p, d, _ = _sim_pair()
    params = p.request_finished("p1", [1, 2])
    net.script("d1", 0, 0, ReadScript(polls=0, end="raise"))
    d.load("d1", [5, 6], params)
    _steps_until_received(d, "d1")
    assert d.get_block_ids_with_load_errors() == {5, 6}
    (failed,) = d.last.failed
    assert failed.policy == "recompute" and "raised" in failed.reason


def test_vllm_pr_57570_notify_only_request_is_never_reported_as_received() -> None:
    _, p, d, _ = _sim_pair()
    params = p.request_finished("p1", [1, 2])
    d.load("d1", [], params)  # the whole prompt was a local prefix hit
    seen: set[str] = set()
    for _ in range(3):
        seen |= d.get_finished()[1]
    assert seen == set()
    assert p.get_finished()[0] == {"p1"}  # but the producer was told, and released


def test_vllm_pr_54689_no_eviction_while_a_read_is_in_flight() -> None:
    core = connected(make_core())
    core.apply(read("r1"))
    core.take_commands()
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))
    assert core.engines[("P", 0)].state.name == "CONNECTED"
    assert not [c for c in core.take_commands() if isinstance(c, DropPeer)]
    core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=0))
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))
    assert ("P", 0) not in core.engines
    assert [c for c in core.take_commands() if isinstance(c, DropPeer)]


def test_vllm_pr_41853_failed_request_is_handed_off_without_a_registered_engine() -> None:
    core = make_core()
    core.apply(read("r1"))
    core.apply(ev(HandshakeFailed, engine_id="P", pp_rank=0, attempt=1, error="refused"))
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))  # the engine is forgotten entirely
    assert ("P", 0) not in core.engines
    (hand_off,) = [c for c in collect(core) if isinstance(c, HandOff)]
    assert hand_off.outcome == "failed"


def test_vllm_issue_27083_handshake_answered_by_the_wrong_listener_is_caught_by_engine_id() -> None:
    core = make_core(strict=False)
    core.apply(read("r1", engine="prefill-dp3"))
    core.apply(ev(HandshakeDone, engine_id="prefill-dp3", pp_rank=0, attempt=1, reply=reply("prefill-dp5")))
    assert isinstance(core.engines[("prefill-dp3", 0)].error, EngineIdMismatch)
    assert core.consumers["r1"].state.name == "FAILED"


def test_nixl_pr_252_producer_is_notified_only_after_the_read_completes() -> None:
    net, p, d, cons = _sim_pair()
    params = p.request_finished("p1", [1, 2])
    net.script("d1", 0, 0, ReadScript(polls=5))
    d.load("d1", [5, 6], params)
    d.step()
    assert p.get_finished()[0] == set()  # the read is still in PROC: no notification yet
    assert not cons.sent
    for _ in range(4):
        d.step()
    _steps_until_received(d, "d1")
    assert p.get_finished()[0] == {"p1"}


def test_sglang_issue_39846_done_only_after_every_part() -> None:
    core = make_core(engine_id="P")
    core.apply(ev(BlocksHeld, request_id="p1", block_ids=(1,)))
    core.apply(ev(NotificationReceived, request_id="p1", part=0, of=2))
    assert core.producers["p1"].state.name == "HOLDING"
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        core.apply(ev(NotificationReceived, request_id="p1", part=0, of=2))
    assert core.producers["p1"].state.name == "HOLDING"
    core.apply(ev(NotificationReceived, request_id="p1", part=1, of=2))
    assert [c for c in core.take_commands() if isinstance(c, FinishedSending)]


def test_sglang_pr_28897_transport_is_only_touched_from_the_owner_thread() -> None:
    net, p, d, cons = _sim_pair()
    threads: set[str] = set()
    for name in ("add_peer", "drop_peer", "post_read", "cancel_read", "send", "progress"):
        original = getattr(cons, name)

        def spy(*args: object, _original: object = original) -> object:
            threads.add(threading.current_thread().name)
            return _original(*args)  # type: ignore[operator]

        setattr(cons, name, spy)

    class ThreadedHandshaker(SimHandshaker):
        def progress(self) -> None:  # answer from another thread, as a real handshake thread does
            worker = threading.Thread(target=super().progress, name="handshake")
            worker.start()
            worker.join()

    d.handshaker = ThreadedHandshaker(net)
    d.handshaker.bind(d.core.submit, lambda: 0)
    params = p.request_finished("p1", [1])
    d.load("d1", [3], params)
    for _ in range(3):
        d.get_finished()
    assert threads == {threading.main_thread().name}
    assert [r.state for r in d.core.log.records() if r.machine == "consumer"][-1] == "RELEASED"
