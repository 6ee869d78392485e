"""More field scenarios from PD-disaggregation KV-transfer threads.

Each test is a real report (vLLM, SGLang, TensorRT-LLM, smg; the URL and a summary in our own
words are in its docstring) that the bug corpus and tests/test_field_scenarios.py do not cover
yet. Each drives the real machines, through the core or through Connectors over the simulated
transport, and asserts what pdfsm must guarantee: a defined terminal state, the failure policy,
invalid blocks in the same step, blocks released exactly once, nothing trusted after the lease,
or an illegal event attributed to the right side.
"""

from __future__ import annotations

import pytest
from helpers import SimPair, collect, connected, ev, make_core, read, reply, tick

from pdfsm.commands import (
    AddPeer,
    CancelRead,
    FinishedSending,
    HandOff,
    PostRead,
    SendNotification,
    StartHandshake,
)
from pdfsm.connector import Connector, ConnectorMetadata
from pdfsm.core import Core
from pdfsm.errors import InvalidInput, LayoutMismatch
from pdfsm.events import (
    PRODUCER,
    BlocksHeld,
    CoreConfig,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    NotificationReceived,
    PeerAdded,
    Tick,
)
from pdfsm.fsm import Fault
from pdfsm.log import Record
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

# --- helpers -----------------------------------------------------------------------------------


def hand_offs(core: Core, t: int = 0, step: int = 1) -> list[HandOff]:
    return [c for c in collect(core, t, step) if isinstance(c, HandOff)]


def faults(core: Core) -> list[Record]:
    return [r for r in core.log.records() if r.fault is not None]


def consumer_states(connector: Connector) -> list[str]:
    return [r.state for r in connector.core.log.records() if r.machine == "consumer"]


# --- aborts and failures while the producer is silent ---------------------------------------------


def test_vllm_issue_46283_abort_while_the_producer_never_answers_is_reported_once() -> None:
    """https://github.com/vllm-project/vllm/issues/46283 -- a decode request aborted while waiting
    for remote KV kept its blocks until a completion signal that a crashed (or aborting) prefill
    node never sent, so the decode KV cache leaked until the engine ran dry. pdfsm: an abort while
    the handshake hangs ends the request at once (nothing was posted), reported aborted exactly
    once with its blocks invalid; an abort while a read hangs (NIXL has no stall timeout) cancels
    it and reports the request once the cancel is confirmed; when the handshake is answered at
    last, the producer is told then (owed notices), so its blocks are released once, not by lease."""
    pair = SimPair(p_lease_ns=5_000_000_000)
    params = pair.p.request_finished("p1", [1, 2])
    pair.net.handshake_faults[("127.0.0.1", 9)] = "hang"  # the prefill node wedged
    pair.d.load("d1", [5, 6], params)
    pair.run(3)
    assert pair.d.core.consumers["d1"].state.name == "HANDSHAKING"
    pair.d.abort("d1")
    recv, sent, _ = pair.run(2)
    assert recv == ["d1"] and pair.invalid["d1"] == {5, 6}  # nothing was read into them
    assert consumer_states(pair.d)[-2:] == ["ABORTED", "RELEASED"]
    out = [r for r in pair.d.core.log.records() if r.machine == "consumer" and r.state == "RELEASED"]
    assert len(out) == 1
    assert pair.d.core.engines[("P", 0)].readers == 0 and not pair.cons.reads
    # The listener comes back and answers: no second report, and the notice d1 owed the producer
    # goes out now that the engine is connected, so its blocks are released at once, not by lease.
    del pair.net.handshake_faults[("127.0.0.1", 9)]
    recv, sent, _ = pair.run(3)
    was = pair.p.core.remembered(PRODUCER, "p1")
    assert recv == [] and sent == ["p1"] and was is not None and was.name == "RELEASED"

    # A second request whose read hangs (the producer stopped serving mid-transfer).
    params = pair.p.request_finished("p2", [3, 4])
    pair.net.script("d2", 0, 0, ReadScript(end="hang"))
    pair.d.load("d2", [7, 8], params)
    pair.run(3)
    assert pair.d.core.consumers["d2"].state.name == "READING"
    pair.d.abort("d2")
    recv, sent, _ = pair.run(3)
    assert recv == ["d2"] and pair.invalid["d2"] == {7, 8}
    assert consumer_states(pair.d)[-3:] == ["ABORTING", "ABORTED", "RELEASED"]
    assert not pair.cons.reads  # the read was stopped before the blocks were handed back
    assert sent == ["p2"]  # told by the aborted request's notification, not by its lease
    assert not pair.p.last.expired


def test_vllm_pr_50754_a_read_that_cannot_be_posted_fails_the_request_and_every_producer_rank_is_told() -> None:
    """https://github.com/vllm-project/vllm/pull/50754 -- when one of a request's transfers could
    not even be posted, the other side kept counting toward a number of completions it would
    never reach, and the request hung until its lease with blocks over half-written KV. pdfsm
    (prefill TP 2, decode TP 1: two reads): the read that cannot be set up fails the request, the
    sibling read is cancelled, nothing is reported until it stopped, the request is then failed
    once with its invalid blocks and policy, and both prefill ranks get their notification,
    carrying the prefill request id, so each releases at once (not by lease)."""
    d = connected(make_core(strict=False, policy="fail"), remote_tp=2)
    d.apply(read("d1", remote="p1", remote_tp=2, blocks=(5, 6), remote_blocks=(1, 2)))
    posts = [c for c in d.take_commands() if isinstance(c, PostRead)]
    assert [p.source.tp_rank for p in posts] == [0, 1]
    d.apply(ev(HandleFailed, request_id="d1", pp_rank=0, tp_rank=1, why=HandleFailure.SETUP,
               detail="TransportError: remote block out of range"))
    cmds = d.take_commands()
    assert [(c.pp_rank, c.tp_rank) for c in cmds if isinstance(c, CancelRead)] == [(0, 0)]
    assert not hand_offs(d)
    d.apply(ev(HandleFailed, request_id="d1", pp_rank=0, tp_rank=0, why=HandleFailure.CANCELLED))
    cmds = d.take_commands()
    notes = sorted((c.tp_rank, c.notification.request_id, c.notification.part, c.notification.of)
                   for c in cmds if isinstance(c, SendNotification))
    assert notes == [(0, "p1", 0, 1), (1, "p1", 0, 1)]
    (off,) = hand_offs(d, step=2)
    assert off.outcome == "failed" and off.policy == "fail" and off.invalid_blocks == (5, 6)
    assert "setup" in off.reason
    for rank in (0, 1):
        p = make_core(engine_id="P", tp_rank=rank, tp_size=2)
        p.apply(ev(BlocksHeld, request_id="p1", block_ids=(1, 2)))
        p.apply(ev(NotificationReceived, request_id="p1", part=0, of=1))
        (freed,) = [c for c in p.take_commands() if isinstance(c, FinishedSending)]
        assert not freed.expired


# --- the producer goes away and comes back ----------------------------------------------------------


def test_sglang_issue_16903_decode_recovers_after_a_prefill_outage_without_a_restart() -> None:
    """https://github.com/sgl-project/sglang/issues/16903 -- when the prefill server went down, the
    decode server's KV receivers failed on every rank and the decode server had to be restarted
    by hand. pdfsm: the read to the dead producer fails (recompute) and marks the engine
    disconnected; during the outage a handshake is refused (recompute) and requests within the
    retry pause fail fast without hammering it; once the producer is back under the same engine
    id, the first request after the pause handshakes afresh and reads the right bytes."""
    pair = SimPair(d_config={"handshake_retry_ns": 1_000_000_000})
    pair.d.load("d-warm", [1], pair.p.request_finished("warm", [1]))
    assert pair.run(3)[0] == ["d-warm"]
    params = pair.p.request_finished("p1", [2, 3])
    pair.net.kill("P-0")
    del pair.net.listeners[("127.0.0.1", 9)]  # the whole prefill server is down
    pair.d.load("d1", [5, 6], params)
    recv, _, failed = pair.run(3)
    assert recv == ["d1"] and [f.policy for f in failed] == ["recompute"] and "disconnected" in failed[0].reason
    assert pair.d.core.engines[("P", 0)].state.name == "DISCONNECTED"
    pair.now = 100
    pair.d.load("d2", [7, 8], {**params.to_dict(), "remote_request_id": "p2"})
    recv, _, failed = pair.run(3)
    assert recv == ["d2"] and "refused" in failed[0].reason
    assert pair.d.core.engines[("P", 0)].state.name == "FAILED"
    pair.now = 500_000_000  # within the retry pause: fails at once, no new handshake
    started = sum(1 for r in pair.d.core.log.records() if r.machine == "engine" and r.state == "HANDSHAKING")
    pair.d.load("d3", [9], {**params.to_dict(), "remote_request_id": "p3", "remote_block_ids": [2]})
    recv, _, failed = pair.run(2)
    assert recv == ["d3"] and failed[0].policy == "recompute"
    assert sum(1 for r in pair.d.core.log.records() if r.machine == "engine" and r.state == "HANDSHAKING") == started
    # The prefill server is back (a new process, the same engine id and port).
    pair.restart_producer("P-0-back")
    pair.now = 2_000_000_000
    pair.d.load("d4", [10, 11], pair.p.request_finished("p4", [2, 3]))
    recv, sent, failed = pair.run(4)
    assert recv == ["d4"] and not failed and sent == ["p4"]
    assert pair.cons.block(10) == pattern("P-0-back", 2, 64) and pair.cons.block(11) == pattern("P-0-back", 3, 64)
    assert pair.d.core.engines[("P", 0)].state.name == "CONNECTED"


def producer_at_9_and_decode(net: SimNetwork, now: list[int]) -> tuple[Connector, SimTransport, Connector]:
    """Producer P (process P-old, 64 blocks) serving at port 9, and a decode Connector D, on one clock."""
    old = SimTransport(net, "P-old")
    old.fill(range(64))
    p_old = Connector(CoreConfig(engine_id="P", compat_hash="h"), old, SimHandshaker(net), clock=lambda: now[0],
                      port=9)
    net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(old.rank_info(),)))
    cons = SimTransport(net, "D-0", block_bytes=64)
    d = Connector(CoreConfig(engine_id="D", compat_hash="h"), cons, SimHandshaker(net), clock=lambda: now[0])
    return p_old, cons, d


def test_smg_issue_2382_producer_restarted_with_a_new_layout_under_the_same_id_is_not_refused_forever() -> None:
    """https://github.com/smg-project/smg/issues/2382 -- engines kept the transfer state of a peer
    that had restarted on the same host:port, and every later transfer through them failed until
    an operator restarted them by hand (the fleet was wedged while every pod looked Ready). The
    same shape on pdfsm's decode side: the producer restarts under the same engine id, host and
    port, now with TP 2. Its fresh params contradict the handshake reply the decode side cached
    from the old process (TP 1), and no read is ever posted to the dead agent, so nothing tells
    the decode side its cached view is stale. A request may fail once, but the decode side must
    handshake again and read from the restarted producer, not refuse it for ever."""
    net, now = SimNetwork(), [0]
    p_old, cons, d = producer_at_9_and_decode(net, now)
    d.load("d-warm", [1], p_old.request_finished("warm", [1]))
    for _ in range(3):
        d.get_finished()
        p_old.get_finished()
    assert d.core.engines[("P", 0)].state.name == "CONNECTED"

    net.kill("P-old")  # the producer restarts: same engine id and port, TP 2 now
    new = [SimTransport(net, f"P-new-{t}", tp_rank=t, block_bytes=32) for t in range(2)]
    for t in new:
        t.fill(range(64))
    p_new = [Connector(CoreConfig(engine_id="P", compat_hash="h", tp_rank=t, tp_size=2), new[t], SimHandshaker(net),
                       clock=lambda: now[0], port=9) for t in range(2)]
    net.serve("127.0.0.1", 9, lambda pp: reply("P", tp_size=2, ranks=tuple(t.rank_info() for t in new)))
    received: list[str] = []
    failed: list[str] = []
    for i in range(4):
        now[0] += 2_000_000_000  # well past any retry pause
        held = [p.request_finished(f"p{i}", [2, 3]) for p in p_new]  # every producer rank holds its part
        d.load(f"d{i}", [5, 6], held[0])
        for _ in range(4):
            got = d.get_finished()[1]
            failed += [f.request_id for f in d.last.failed]
            received += sorted(got - {f.request_id for f in d.last.failed})
            for p in p_new:
                p.get_finished()
    assert len(failed) <= 1, f"every request to the restarted producer was refused: {failed}"
    assert "d3" in received
    assert cons.block(5) == pattern("P-new-0", 2, 32) + pattern("P-new-1", 2, 32)


def test_sglang_pr_34289_a_producer_replaced_while_an_old_read_drains_is_read_once_the_drain_ends() -> None:
    """https://github.com/sgl-project/sglang/pull/34289 (issue 33789) -- a prefill process was
    replaced behind an address that stayed reachable while the old one still drained; the decode
    side kept the old process's endpoints and every later request died on its timeout. pdfsm's
    decode side: connected to P (process P-old) with a slow read in flight, P-new replaces it under
    the same engine id and port, and the router sends P-new's params. They contradict the cached
    reply (another incarnation), so the engine is asked to be evicted, which cannot happen while
    the old read holds it (vLLM PR 54689), and those requests are refused (the documented cost: one
    connection per engine id and PP rank). Expected: once the old read ends the engine is evicted
    at once, so the next request handshakes with P-new and reads its bytes. pdfsm ignored the
    eviction asked while held, so the first request after the drain was refused too (asking
    again), and with one request at a time none was ever read before the next one came."""
    net, now = SimNetwork(), [0]
    p_old, cons, d = producer_at_9_and_decode(net, now)
    net.script("d-old", 0, 0, ReadScript(polls=6))  # still reading when P-new takes over
    d.load("d-old", [1], p_old.request_finished("p-old", [1]))
    for _ in range(3):
        d.get_finished()  # handshaken with P-old, the read posted
    assert d.core.consumers["d-old"].state.name == "READING"
    new = SimTransport(net, "P-new")
    new.fill(range(64))
    p_new = Connector(CoreConfig(engine_id="P", compat_hash="h"), new, SimHandshaker(net), clock=lambda: now[0],
                      port=9)
    net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(new.rank_info(),)))
    outcome: dict[str, str] = {}

    def step() -> None:
        now[0] += 1_000_000_000
        got = d.get_finished()[1]
        failed = {f.request_id for f in d.last.failed}
        outcome.update(dict.fromkeys(failed, "failed") | dict.fromkeys(got - failed, "received"))
        p_new.get_finished()
        p_old.get_finished()

    d.load("d0", [5], p_new.request_finished("q0", [2]))  # during the drain: refused, eviction owed
    while "d-old" not in outcome:
        step()
    assert outcome == {"d0": "failed", "d-old": "received"}
    assert ("P", 0) not in d.core.engines, "the owed eviction waited for another contradicting request"
    d.load("d1", [6], p_new.request_finished("q1", [3]))
    for _ in range(4):
        step()
    assert outcome["d1"] == "received"
    assert cons.block(6) == pattern("P-new", 3, 64)
    assert "q1" not in p_new.core.producers, "P-new's hold of d1 is released by its notification"


def test_sglang_pr_34692_a_handshake_attempt_never_answered_is_failed_by_the_core_and_retried() -> None:
    """https://github.com/sgl-project/sglang/pull/34692 -- a bootstrap with no timeout: a peer that
    never answered kept the transfer waiting for ever. pdfsm's side-channel handshaker bounds each
    attempt, but the Handshaker protocol does not promise an answer. Scenario: attempt 1 is never
    answered. Expected: the core fails it after `handshake_timeout_ns` (twice the read timeout by
    default), so the next request starts attempt 2 and reads, and a late answer
    to attempt 1 is ignored as stale. Before: the engine stayed HANDSHAKING at attempt 1 for ever
    and every later request joined it and failed at its own deadline."""
    core = make_core(strict=False, read_timeout_ns=10, handshake_retry_ns=1)
    core.apply(read("d1", t=0))
    assert [c.attempt for c in core.take_commands() if isinstance(c, StartHandshake)] == [1]
    tick(core, 10)  # d1's deadline
    assert [h.outcome for h in collect(core, 10) if isinstance(h, HandOff)] == ["failed"]
    assert core.engines[("P", 0)].state.name == "HANDSHAKING"  # a slow answer may still come
    tick(core, 20)  # handshake_timeout_ns: by default twice the read timeout
    assert core.engines[("P", 0)].state.name == "FAILED"
    core.apply(read("d2", t=30))
    assert [c.attempt for c in core.take_commands() if isinstance(c, StartHandshake)] == [2]
    core.apply(ev(HandshakeDone, 31, engine_id="P", pp_rank=0, attempt=1, reply=reply()))  # attempt 1, late
    assert core.engines[("P", 0)].state.name == "HANDSHAKING"
    core.apply(ev(HandshakeDone, 32, engine_id="P", pp_rank=0, attempt=2, reply=reply()))
    core.apply(ev(PeerAdded, 32, engine_id="P", pp_rank=0, attempt=2))
    assert core.consumers["d2"].state.name == "READING"
    assert not core.violations[Fault.LOCAL]


def test_a_handshake_answered_just_before_its_bound_connects_when_the_tick_comes_first() -> None:
    """Scenario: attempt 1 is answered (HandshakeDone, the engine CONNECTING, AddPeer emitted) just
    before handshake_timeout_ns; the Tick at the bound is applied before the transport's PeerAdded.
    Expected: the bound fails only an unanswered attempt, so the engine connects and the request
    reads. Before (found by review): the Tick failed the answered attempt, dropped its peer and
    ignored PeerAdded as stale."""
    core = make_core(strict=False, read_timeout_ns=10**7, handshake_timeout_ns=10**6)
    core.apply(read("d1", t=0))
    core.take_commands()
    core.apply(ev(HandshakeDone, 10**6 - 1, engine_id="P", pp_rank=0, attempt=1, reply=reply()))
    tick(core, 10**6)
    core.apply(ev(PeerAdded, 10**6, engine_id="P", pp_rank=0, attempt=1))
    assert core.engines[("P", 0)].state.name == "CONNECTED"
    assert core.consumers["d1"].state.name == "READING"


# --- preemption, duplicates and lost notifications ---------------------------------------------------


def test_vllm_pr_53250_remote_kv_is_not_loaded_again_after_decoder_preemption() -> None:
    """https://github.com/vllm-project/vllm/pull/53250 -- after a decoder preempted and rescheduled a
    request, the connector asked for the one-shot remote KV a second time; the transfer never came
    (or the engine crashed). pdfsm refuses the second load synchronously, whether the scheduler
    reuses the request id or a new one, one by one or in a step's metadata, before anything is
    submitted: no second read, the producer released exactly once, the first result untouched."""
    pair = SimPair()
    params = pair.p.request_finished("p1", [1, 2])
    pair.d.load("d1", [5, 6], params)
    recv, sent, _ = pair.run(3)
    assert recv == ["d1"] and sent == ["p1"]
    reads = len(pair.cons.sent)
    with pytest.raises(InvalidInput, match="request_id"):
        pair.d.load("d1", [7, 8], params)  # rescheduled under the same id
    with pytest.raises(InvalidInput, match="kv_transfer_params"):
        pair.d.load("d1-resumed", [7, 8], params)  # or under a new one
    with pytest.raises(InvalidInput, match="kv_transfer_params"):
        pair.d.start_load_kv(ConnectorMetadata(reqs_to_recv={"d1-again": ((7, 8), params)}))
    assert not pair.d.core.log.inbox and "d1-resumed" not in pair.d.core.consumers
    recv, sent, _ = pair.run(3)
    assert recv == [] and sent == [] and len(pair.cons.sent) == reads
    assert pair.cons.block(7) == bytes(64)


def test_sglang_issue_40125_two_decode_requests_claiming_one_transfer_do_not_crash_either_side() -> None:
    """https://github.com/sgl-project/sglang/issues/40125 -- a transfer id (bootstrap room) used by
    two requests at once crashed both the prefill and the decode scheduler with an uncaught
    KeyError / ValueError. pdfsm: on one decode worker the second claim of the same params is
    refused synchronously (one by one or two in a step); a second decode engine that reads the
    same producer request too only produces a duplicate notification, which the producer records
    as a remote violation without freeing anything twice or raising."""
    pair = SimPair()
    params = pair.p.request_finished("p1", [1, 2])
    pair.d.load("a", [5, 6], params)
    with pytest.raises(InvalidInput, match="single-use"):
        pair.d.load("b", [7, 8], params)
    with pytest.raises(InvalidInput, match="single-use"):
        pair.d.start_load_kv(ConnectorMetadata(reqs_to_recv={"c": ((9,), params), "e": ((10,), params)},
                                                       computed_blocks={"c": 1, "e": 1}))
    cons2 = SimTransport(pair.net, "D2-0")
    d2 = Connector(CoreConfig(engine_id="D2", compat_hash="h"), cons2, SimHandshaker(pair.net), clock=pair.clock)
    d2.load("a", [5, 6], params)  # another decode engine, the same room
    released: list[str] = []
    for _ in range(4):
        pair.d.get_finished()
        d2.get_finished()
        released += pair.p.get_finished()[0]
    assert released == ["p1"]
    (dup,) = faults(pair.p.core)
    assert dup.fault is Fault.REMOTE and "already released" in dup.reason


def test_tensorrt_llm_issue_17665_a_dropped_completion_notification_costs_a_lease_not_a_hang() -> None:
    """https://github.com/NVIDIA/TensorRT-LLM/issues/17665 -- the NIXL cache transceiver waited for
    ever when a single completion notification was dropped. pdfsm: the decode side is reported
    received once (its read completed); the producer, never told, releases the blocks exactly once
    when its lease runs out, marked expired; a duplicated notification for another request frees
    it once and is recorded as the peer's fault."""
    pair = SimPair(p_lease_ns=3_000_000_000)
    params = pair.p.request_finished("p1", [1, 2])
    pair.net.fault_notification("p1", "drop")
    pair.d.load("d1", [5, 6], params)
    recv, sent, _ = pair.run(4)
    assert recv == ["d1"] and sent == []
    assert pair.cons.block(5) == pattern("P-0", 1, 64)
    pair.now = 3_000_000_000
    recv, sent, _ = pair.run(1)
    assert sent == ["p1"] and pair.p.last.expired == {"p1"}
    recv, sent, _ = pair.run(3)
    assert sent == [] and recv == []

    params = pair.p.request_finished("p2", [3])
    pair.net.fault_notification("p2", "duplicate")
    pair.d.load("d2", [7], params)
    recv, sent, _ = pair.run(4)
    assert recv == ["d2"] and sent == ["p2"] and not pair.p.last.expired
    assert [r.fault for r in faults(pair.p.core) if getattr(r.event, "request_id", "") == "p2"] == [Fault.REMOTE]


# --- heterogeneous layouts --------------------------------------------------------------------------


def test_vllm_issue_42895_block_size_mismatch_is_refused_at_the_handshake() -> None:
    """https://github.com/vllm-project/vllm/issues/42895 -- prefill and decode ran with different
    physical block sizes and the NIXL transfer failed (or would have copied misaligned KV). pdfsm
    refuses the producer's handshake reply by name (a layout failure blamed on the peer), adds no
    peer and posts no read; the waiting request fails with the configured policy and its blocks
    invalid; a request within the retry pause fails at once, without a handshake storm."""
    core = make_core(strict=False, policy="fail", block_size=16)
    core.apply(read("r1"))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", block_size=32)))
    engine = core.engines[("P", 0)]
    assert engine.state.name == "FAILED" and isinstance(engine.error, LayoutMismatch)
    assert "block sizes differ" in str(engine.error)
    assert faults(core)[-1].fault is Fault.REMOTE
    assert not [c for c in core.take_commands() if isinstance(c, (AddPeer, PostRead))]
    (off,) = hand_offs(core)
    assert off.outcome == "failed" and off.policy == "fail" and off.invalid_blocks == (1, 2)
    core.apply(read("r2", blocks=(3,), t=10))
    assert not [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    (off,) = hand_offs(core, t=10, step=2)
    assert off.request_id == "r2" and "block sizes differ" in off.reason


def test_vllm_pr_26848_mla_prefill_tp_larger_than_decode_every_prefill_rank_released_once() -> None:
    """https://github.com/vllm-project/vllm/pull/26848 -- MLA with prefill TP larger than decode TP
    was not supported by the NIXL connector: decode ranks could not map to prefill ranks, and the
    prefill ranks that were not read kept their blocks. pdfsm (MLA, prefill TP 4, decode TP 2):
    each decode rank reads whole blocks from one prefill rank and tells the other prefill rank it
    covers, with the prefill request id; every prefill rank frees its blocks exactly once, by
    notification. When one decode rank's read fails, the two prefill ranks it covers are still
    told, once the read stopped."""
    notes: dict[int, list[tuple[int, int]]] = {t: [] for t in range(4)}
    for rank in range(2):
        d = connected(make_core(mla=True, tp_rank=rank, tp_size=2), remote_tp=4)
        d.apply(read("d1", remote="p1", remote_tp=4))
        (post,) = [c for c in d.take_commands() if isinstance(c, PostRead)]
        assert post.source.tp_rank == 2 * rank and post.source.remote_slices == post.source.local_slices == 1
        notes[post.source.tp_rank].append((post.notification.part, post.notification.of))
        d.apply(ev(HandleDone, request_id="d1", pp_rank=0, tp_rank=post.source.tp_rank))
        (extra,) = [c for c in d.take_commands() if isinstance(c, SendNotification)]
        assert extra.tp_rank == 2 * rank + 1 and extra.notification.request_id == "p1"
        notes[extra.tp_rank].append((extra.notification.part, extra.notification.of))
        assert [h.outcome for h in hand_offs(d)] == ["received"]
    for t in range(4):
        p = make_core(engine_id="P", mla=True, tp_rank=t, tp_size=4)
        p.apply(ev(BlocksHeld, request_id="p1", block_ids=(1, 2)))
        for part, of in notes[t]:
            p.apply(ev(NotificationReceived, request_id="p1", part=part, of=of))
        (freed,) = [c for c in p.take_commands() if isinstance(c, FinishedSending)]
        assert not freed.expired

    d = connected(make_core(mla=True, tp_rank=1, tp_size=2), remote_tp=4)
    d.apply(read("d2", remote="p2", remote_tp=4))
    d.take_commands()
    d.apply(ev(HandleFailed, request_id="d2", pp_rank=0, tp_rank=2, why=HandleFailure.ERR))
    told = sorted(c.tp_rank for c in d.take_commands() if isinstance(c, SendNotification))
    assert told == [2, 3]
    (off,) = hand_offs(d)
    assert off.outcome == "failed" and off.invalid_blocks == (1, 2)


# --- deadlines and completions observed late ------------------------------------------------------


def test_sglang_pr_32267_completion_observed_after_the_read_timeout_but_within_the_lease_is_trusted() -> None:
    """https://github.com/sgl-project/sglang/pull/32267 -- the decode receiver checked its waiting
    timeout before draining completions already queued in NIXL, so a transfer whose KV had arrived
    was failed (and aborted) when the poll happened to land after the deadline: a false timeout
    decided by poll timing. pdfsm polls before it ticks, but the completion is then judged against
    the request's read timeout too, not only against the producer's lease. Here the decode
    scheduler stalls for 2 s (read timeout 1 s) while its read completes; the producer's lease (120
    s, from its params) has 118 s left, so no block can have been reused under the read. The read
    must be trusted: reported received, not failed (with policy "fail" a user would get an error
    for KV that arrived intact)."""
    pair = SimPair(d_config={"read_timeout_ns": 1_000_000_000, "policy": "fail"})
    params = pair.p.request_finished("p1", [1, 2])
    assert params.lease_ns == 120_000_000_000
    pair.net.script("d1", 0, 0, ReadScript(polls=1))
    pair.d.load("d1", [5, 6], params)
    for _ in range(6):
        pair.d.step(rounds=1)
        if ("d1", 0, 0) in pair.cons.reads:
            break
    assert pair.d.core.consumers["d1"].state.name == "READING"
    pair.now = 2_000_000_000  # the scheduler stalls; the read finishes meanwhile
    recv, sent, failed = pair.run(2)
    assert recv == ["d1"] and sent == ["p1"]
    assert pair.cons.block(5) == pattern("P-0", 1, 64)  # the KV arrived intact
    assert not failed, f"a completed read inside the lease was failed: {failed[0].reason}"
    assert pair.invalid["d1"] == set()


def test_sglang_pr_32267_completion_queued_before_the_deadline_tick_wins_at_the_core() -> None:
    """https://github.com/sgl-project/sglang/pull/32267 -- the same race at the core: a completion
    stamped before the deadline and a tick past it are pumped in one batch, completion first. The
    request is received; the tick finds nothing to expire; nothing is cancelled."""
    core = connected(make_core(read_timeout_ns=1_000))
    core.apply(read("r1", t=0))
    core.take_commands()
    core.submit(ev(HandleDone, 999, request_id="r1", pp_rank=0, tp_rank=0))
    core.submit(ev(Tick, 1_500))
    core.pump()
    assert not [c for c in core.take_commands() if isinstance(c, CancelRead)]
    (off,) = hand_offs(core, t=1_500)
    assert off.outcome == "received"
    tick(core, 5_000)
    assert not hand_offs(core, t=5_000, step=2)
