"""Field scenarios from PD-disaggregation KV-transfer threads: leases, clocks and params.

Each test mirrors a failure that shipped in a real system (vLLM, NIXL/UCCL, the vLLM router; the
source and a one-line summary are in its docstring, in our own words) and is not covered by the
bug corpus or the earlier field-scenario files. Each drives pdfsm through its public API (a
producer and a decode Connector over the simulated transport, on a fake clock) and asserts what a
demanding user expects: bytes that may have been overwritten are never reported received, every
block moves exactly once, and bad input is refused by name before anything is accepted.
"""

from __future__ import annotations

import pytest
from helpers import LeaseWorld, S, connected, make_core, reply

from pdfsm.commands import HandOff, PostRead, SendNotification
from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams
from pdfsm.core import Core
from pdfsm.errors import InvalidInput
from pdfsm.events import (
    PRODUCER,
    CoreConfig,
    HandleFailed,
    HandleFailure,
    Promised,
    ReadRequested,
)
from pdfsm.fsm import Fault
from pdfsm.wire import Notification, notify_codec
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

BLOCK = 64  # bytes per simulated block


def _slow_read(w: LeaseWorld, rid: str) -> None:
    """The read of ``rid`` will be seen complete by the decode worker's second poll of it."""
    w.net.script(rid, 0, 0, ReadScript(polls=1))


# --- leases: what the decode side may count on -------------------------------------------------------


def test_vllm_issue_21570_params_delayed_on_the_way_to_decode_never_trust_a_read_after_the_prefill_lease() -> None:
    """https://github.com/vllm-project/vllm/issues/21570 -- prefill released KV blocks on its
    timeout while decode, which cannot see that timeout, still read them: wrong output. pdfsm
    carries ``lease_ns`` in the params so decode can stop trusting reads near the lease's end, but
    counts the lease from the params' arrival at decode. Here the params spend 1.5 s between
    prefill's ``request_finished`` and decode's ``load`` (proxy, decode API server, tokenization),
    which is more than the default 1 s margin. The read completes after the 4 s lease expired
    and the prefill blocks were reused: it must not be reported received."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    t0 = w.now
    params = w.p.request_finished("p1", [1, 2])
    w.now = t0 + 3 * S // 2  # the params reach the decode scheduler; load runs as they arrive
    _slow_read(w, "d1")
    w.d.load("d1", [5, 6], params)
    w.d.get_finished()  # the read is posted
    w.now = t0 + 4 * S  # the prefill lease runs out
    w.released += sorted(w.p.get_finished()[0])
    assert w.p.last.expired == {"p1"}
    w.reuse([1, 2])
    w.now = t0 + 4 * S + S // 5  # decode sees the read complete 200 ms after the producer released
    w.run(3)
    bytes_ok = w.read_bytes_ok([5, 6], [1, 2])
    assert bytes_ok or "d1" not in w.received, "a read of reused prefill blocks was reported received"


def test_uccl_issue_1015_heartbeat_lost_in_transit_is_not_counted_as_a_lease_extension() -> None:
    """https://github.com/uccl-project/uccl/issues/1015 (also vLLM issue 53095) -- the NIXL UCCL
    plugin dropped notifications over 256 bytes with only a sender-side log line, so vLLM's lease
    heartbeats were lost silently, prefill released the blocks, and transfers failed later with no
    attributable error. pdfsm's ``heartbeat`` reports how many ranks it *sent* to and the embedding
    docs let decode count the lease as extended from that: with the heartbeat lost on the wire,
    decode trusts a read the producer's original lease no longer covers. It must not be reported
    received with the reused bytes."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    t0 = w.now
    params = w.p.request_finished("p1", [1, 2])  # the params arrive at decode at once and queue
    w.now = t0 + 2 * S  # 2 s of the 4 s lease left, more than the 1 s margin
    w.net.fault_notification("p1", "drop")  # the transport accepts it, the peer never gets it
    extend = 10 * S
    assert w.d.heartbeat(params, extend_ns=extend) == 1
    hb_sent = w.now  # on the decode worker's clock (no skew here)
    w.now = t0 + 4 * S
    w.released += sorted(w.p.get_finished()[0])
    assert w.p.last.expired == {"p1"}  # the original lease, not extended
    w.reuse([1, 2])
    w.now = t0 + 5 * S  # the request is scheduled; lease_start_ns exactly as docs/embedding.md says
    lease_start = min(w.now, max(t0, hb_sent + extend - params.lease_ns))
    _slow_read(w, "d1")
    w.d.load("d1", [5, 6], params, lease_start_ns=lease_start)
    w.run(3)
    bytes_ok = w.read_bytes_ok([5, 6], [1, 2])
    assert bytes_ok or "d1" not in w.received, "a read of reused prefill blocks was reported received"


def _heartbeated(w: LeaseWorld, prid: str, blocks: list[int], extend: int) -> KVTransferParams:
    """Params of a request queued on the decode side past its producer's lease, kept held there by
    a heartbeat every half lease (vLLM PR 41383's pattern for requests queued through a surge)."""
    params = w.p.request_finished(prid, blocks)
    for _ in range(3):
        assert w.d.heartbeat(params, extend_ns=extend) == 1
        w.run(1, dt=params.lease_ns // 2)
    assert w.p.core.producers[prid].state.name == "HOLDING"  # past the params' lease: the heartbeats hold it
    return params


@pytest.mark.parametrize("local", [[5, 6], []], ids=["refused-as-lease-over", "notify-only"])
def test_heartbeated_hold_is_told_when_the_decode_request_stops_past_its_lease(local: list[int]) -> None:
    """vLLM PR 41383's heartbeats keep a queued decode request's prefill blocks held; pdfsm never
    trusts a read past the params' own lease, so the request, scheduled 1.5 leases after issue, is
    refused (or, loaded notify-only, dropped). It sent the producer nothing ("it releases by
    itself"), but its own heartbeats had asked the producer to hold for 10 leases: the blocks stayed
    pinned that long, then expired with a remote violation blaming this side (found by review).
    Expected: what this side trusts is unchanged, and it tells the producer, which releases now."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    params = _heartbeated(w, "p1", [1, 2], extend=40 * S)
    w.d.load("d1", local, params)
    w.run(3)
    assert "d1" not in w.received
    if local:
        assert "lease" in w.failed["d1"].reason and set(w.failed["d1"].invalid_blocks) == {5, 6}
    assert w.released == ["p1"] and not w.expired, "released by the notice, not 10 leases later by expiry"
    assert w.p.core.violations[Fault.REMOTE] == 0


def test_a_heartbeat_sent_while_the_read_runs_is_carried_to_the_request() -> None:
    """A heartbeat sent while the read is already running (``heartbeat``: it "keeps the producer's
    blocks from being reused under a read already running") was not carried to the request: the
    request read the promise once, when it was loaded. Stopping past its trust bound (the read
    hangs), it told the producer nothing, which kept the blocks for the whole 60 s extension and
    then blamed the consumer (found by a helper's hunt). Now the Connector submits ``Promised`` to
    the live request: it tells the producer, which releases at once."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    params = w.p.request_finished("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(end="hang"))
    w.d.load("d1", [5, 6], params)
    w.run(1, dt=S // 10)
    assert w.d.heartbeat(params, 60 * S) == 1
    w.run(40, dt=S // 10)  # past the trust bound: the hung read is cancelled, the request fails
    assert "d1" in w.failed and "d1" not in w.received
    notes = [m for _, m in w.cons.sent if isinstance(m, Notification) and m.request_id == "p1"]
    assert len(notes) == 1 and notes[0].unread
    w.run(2, dt=S)
    assert w.released == ["p1"] and not w.expired
    assert w.p.core.violations[Fault.REMOTE] == 0


def test_params_whose_load_ended_are_not_heartbeated() -> None:
    """A heartbeat for params already loaded and finished asks the producer to hold blocks nobody
    will read or release: the producer released them when told, or by itself at its lease, where a
    heartbeat is a remote violation. It is not sent (0 ranks told)."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    params = w.p.request_finished("p1", [1, 2])
    w.d.load("d1", [5, 6], params)
    w.run(3)
    assert w.received == ["d1"] and w.released == ["p1"]
    sent = len(w.cons.sent)
    assert w.d.heartbeat(params, 60 * S) == 0
    assert len(w.cons.sent) == sent


def test_a_load_whose_reads_stopped_is_not_heartbeated() -> None:
    """A load refused past its trust bound by ``start_load_kv``'s step (FAILED, nobody told, not
    handed off yet) was still heartbeated: the producer extended the hold by the whole extension
    for a request that would never notify it, then expired it and blamed the consumer (found by
    review). Its notices were settled when its reads stopped: 0 ranks are told."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    params = w.p.request_finished("p1", [1, 2])
    w.run(1)
    w.now += 3 * S + S // 2  # past the consumer's trust bound (the lease less the 1 s margin)
    w.d.start_load_kv(ConnectorMetadata(reqs_to_recv={"d1": ((5, 6), params)}))
    assert w.d.core.consumers["d1"].state.name == "FAILED"
    assert w.d.heartbeat(params, 60 * S) == 0
    w.run(1, dt=S)
    assert w.expired == ["p1"]  # at its own lease, not a minute later


def test_a_promise_is_kept_only_for_params_that_name_their_hold() -> None:
    """A notice past the trust bound may reach a producer that released at its lease (the
    heartbeat lost) and holds the request id again since: it tells the new hold apart only by the
    params' issue time. Params that do not say it (``issued_wall_ns`` 0) get no notice past the
    trust bound, promise or not (found by review: with a producer not checking, the late notice
    released the new hold while its reader still read)."""
    for issued, told in ((0, False), (10**18, True)):
        d = connected(make_core(strict=False))
        d.apply(ReadRequested(source="s", t_ns=5 * S, request_id="d1", remote_request_id="p1", engine_id="P",
                              local_blocks=(2,), remote_blocks=(2,), lease_ns=4 * S, lease_start_ns=0,
                              issued_wall_ns=issued, promised_ns=40 * S))
        assert d.consumers["d1"].state.name == "FAILED"  # refused: the lease the params gave is over
        notes = [c for c in d.take_commands() if isinstance(c, SendNotification)]
        assert bool(notes) is told, (issued, notes)


def test_a_promise_for_other_params_is_ignored_by_a_later_load_under_the_id() -> None:
    """``Promised`` names the params heartbeated: a load under the same request id of other params
    (the id reused once forgotten, its new load queued when the old params were heartbeated) does
    not take their promise (found by review)."""
    d = Core(CoreConfig(engine_id="D", compat_hash="h"))
    d.apply(ReadRequested(source="s", t_ns=0, request_id="d1", remote_request_id="p2", engine_id="P",
                          local_blocks=(1,), remote_blocks=(1,), issued_wall_ns=2))
    d.apply(Promised(source="scheduler", t_ns=1, request_id="d1", promised_ns=60 * S, engine_id="P",
                     remote_request_id="p1", issued_wall_ns=1))
    assert d.consumers["d1"].promised == 0
    d.apply(Promised(source="scheduler", t_ns=2, request_id="d1", promised_ns=60 * S, engine_id="P",
                     remote_request_id="p2", issued_wall_ns=2))
    assert d.consumers["d1"].promised == 60 * S


def test_heartbeat_promise_ends_and_a_later_stop_tells_nobody() -> None:
    """Past the end its heartbeats asked for (less the margin) the producer may have released: a
    request stopping then sends nothing, as before heartbeats were remembered."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    params = _heartbeated(w, "p1", [1, 2], extend=4 * S)
    w.run(1, dt=4 * S)  # past the last heartbeat's extension: the producer expired the hold
    assert w.expired == ["p1"]
    sent = len(w.cons.sent)
    w.d.load("d1", [5, 6], params)
    w.run(2)
    assert "lease" in w.failed["d1"].reason
    assert w.cons.sent[sent:] == [], "no notice after the promise ended"


def test_vllm_pr_50326_decode_lease_start_from_a_scheduler_on_another_node_is_not_trusted() -> None:
    """https://github.com/vllm-project/vllm/pull/50326 (bug corpus, prefill side) -- a deadline taken
    on the scheduler's clock was compared with a worker's clock on another node: silent corruption.
    The same shape on the decode side: docs/embedding.md has the scheduler record
    ``time.monotonic_ns()`` when params arrive and pass it in ``ConnectorMetadata.lease_starts``
    (a bare int, no clock domain). With decode TP spanning nodes, a worker whose CLOCK_MONOTONIC
    lags the scheduler's by 10 s (it booted later) took the lease as 10 s younger than it is. The
    metadata now carries ages (``lease_ages``, durations on the scheduler's own clock), which mean
    the same on every node. The request queued 11 s on a 4 s lease: it must fail as lease-over,
    not read reused blocks."""
    w = LeaseWorld(p_lease_ns=4 * S, d_skew=10 * S)
    w.connect()
    t0 = w.now
    params = w.p.request_finished("p1", [1, 2])
    arrival = t0 + S // 2  # the scheduler's CLOCK_MONOTONIC (node 0) when the params arrive
    w.now = t0 + 4 * S
    w.released += sorted(w.p.get_finished()[0])
    assert w.p.last.expired == {"p1"}
    w.reuse([1, 2])
    w.now = t0 + 11 * S  # scheduled at last; the worker is on node 1
    _slow_read(w, "d1")
    age = w.now - arrival  # the scheduler's clock, both readings
    w.d.start_load_kv(ConnectorMetadata(reqs_to_recv={"d1": ((5, 6), params)}, lease_ages={"d1": age}))
    w.run(3)
    bytes_ok = w.read_bytes_ok([5, 6], [1, 2])
    assert bytes_ok or "d1" not in w.received, "a read of reused prefill blocks was reported received"
    assert "d1" in w.failed and set(w.failed["d1"].invalid_blocks) == {5, 6}


def test_vllm_pr_41269_late_rejection_notice_after_the_lease_is_not_a_false_corruption_alarm() -> None:
    """https://github.com/vllm-project/vllm/pull/41269 -- a decode that rejects a request before
    admitting it now tells prefill so the blocks are freed (docs/embedding.md: load it
    notify-only). Under a decode backlog that notice can come after prefill's lease ran out, where
    prefill already warns of expiry; a notification there is recorded as a remote violation that
    "that read may have seen reused blocks" -- an error-level corruption alarm for a request that
    read nothing. Decode knows the lease is over (``lease_start_ns`` + ``lease_ns``): it should
    send nothing (the producer has nothing left to release), so the only record is the expiry."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    t0 = w.now
    params = w.p.request_finished("p1", [1, 2])
    w.now = t0 + 5 * S
    w.run(2)
    assert w.expired == ["p1"]
    sent_before = len(w.cons.sent)
    w.d.load("d1", [], params, lease_start_ns=t0)  # rejected before admission: notify-only
    w.run(3)
    assert len(w.cons.sent) == sent_before, "a notice for an expired lease was sent"
    alarms = [r for r in w.p.core.log.records() if r.reason and "reused blocks" in r.reason]
    assert alarms == []


def _heartbeat_lost_then_expired(w: LeaseWorld, extend_ns: int) -> tuple[LeaseWorld, KVTransferParams]:
    """p1 held; the decode side's heartbeat for it is lost on the wire; the producer expires it."""
    w.connect()
    params = w.p.request_finished("p1", [1, 2])
    w.net.fault_notification("p1", "drop")
    assert w.d.heartbeat(params, extend_ns=extend_ns) == 1  # sent, never delivered
    w.run(1, dt=5 * S)
    assert w.expired == ["p1"]
    return w, params


def test_uccl_issue_1015_lost_heartbeat_then_a_late_release_notice_is_not_a_corruption_alarm() -> None:
    """https://github.com/uccl-project/uccl/issues/1015 -- notifications (vLLM's lease heartbeats
    among them) were dropped on the wire with only a sender-side log line. The decode side asked
    the producer to hold for 10 leases; the heartbeat never arrived and the producer expired the
    hold at its own lease. The request, refused past its lease, then told the producer (it owed
    the notice its heartbeat promised), which recorded "that read may have seen reused blocks", an
    error-level corruption alarm for a request that read nothing (the known limit until the notice
    said so, found by review). Expected: the notice says it is a release of unread blocks
    (``Notification.unread``); the producer records it as ignored; the only violation is the expiry."""
    w, params = _heartbeat_lost_then_expired(LeaseWorld(p_lease_ns=4 * S), extend_ns=40 * S)
    sent = len(w.cons.sent)
    w.d.load("d1", [5, 6], params)
    w.run(3)
    assert "lease" in w.failed["d1"].reason and "d1" not in w.received
    assert len(w.cons.sent) > sent, "the notice the heartbeat promised was sent"
    records = w.p.core.log.records()
    assert [r for r in records if r.reason and "reused blocks" in r.reason] == []
    late = [r for r in records if r.reason and "takes nothing" in r.reason]
    assert len(late) == 1 and late[0].outcome.name == "IGNORED" and late[0].fault is None
    assert w.p.core.violations[Fault.REMOTE] == 1  # the expiry


def test_a_late_notice_of_a_read_is_still_a_corruption_alarm() -> None:
    """The other side of the flag: a notice that a read ended (``unread`` False, as an older
    consumer sends every notice) reaching a producer after its lease is still a remote violation."""
    w = LeaseWorld(p_lease_ns=4 * S)
    w.connect()
    w.p.request_finished("p1", [1, 2])
    w.run(1, dt=5 * S)
    assert w.expired == ["p1"]
    w.net.deliver("D-0", "P-0", notify_codec.encode(Notification("p1", 0, 1)), "p1")
    w.run(1)
    alarms = [r for r in w.p.core.log.records() if r.reason and "reused blocks" in r.reason]
    assert len(alarms) == 1 and alarms[0].fault == Fault.REMOTE


def test_a_late_release_of_a_hold_the_producer_forgot_says_it_may_be_one() -> None:
    """The same lost heartbeat, the request stopping later than the producer remembers expired
    holds (``tombstone_ns``): the notice finds no hold, is staged as an early notice would be, and
    at its staging time is discarded. The producer cannot tell a late release of a forgotten hold
    from a release under a wrong id (vLLM PR 36958), so it is still a remote violation, but its
    reason no longer says "never registered" as a fact (found by review); a staged notice of a read
    keeps that reason (tests/test_bug_corpus.py)."""
    w, params = _heartbeat_lost_then_expired(LeaseWorld(p_lease_ns=4 * S, p_config={"tombstone_ns": 10 * S}),
                                             extend_ns=400 * S)
    w.run(1, dt=60 * S)
    w.d.load("x", [9], w.p.request_finished("x", [9]))  # a later hold ends: the expired one is forgotten
    w.run(3)
    assert "p1" not in w.p.core._remembered[PRODUCER]
    w.d.load("d1", [5, 6], params)
    w.run(3)
    assert "lease" in w.failed["d1"].reason
    assert w.p.core.producers["p1"].state.name == "STAGED"
    w.run(2, dt=5 * S)  # past the staging time
    assert "p1" not in w.p.core.producers
    (why,) = [r.reason for r in w.p.core.log.records() if r.fault and r.state == "DISCARDED"]
    assert "forgotten" in why and "nothing was read" in why


def test_a_read_carries_a_notice_of_a_read_and_a_stopped_request_a_release() -> None:
    """What the consumer puts on the wire: the notice a read carries says it is a read's end
    (``unread`` False: late, it is a corruption alarm at the producer); the notice of a request
    that stopped before its read completed says it is a release."""
    d = connected(make_core(strict=False))
    d.apply(ReadRequested(source="s", t_ns=1, request_id="d1", remote_request_id="p1", engine_id="P",
                          local_blocks=(1,), remote_blocks=(1,)))
    posts = [c for c in d.take_commands() if isinstance(c, PostRead)]
    assert len(posts) == 1 and posts[0].notification.unread is False
    d.apply(HandleFailed(source="transfer", t_ns=2, request_id="d1", pp_rank=0, tp_rank=0,
                         why=HandleFailure.ERR))
    notes = [c for c in d.take_commands() if isinstance(c, SendNotification)]
    assert len(notes) == 1 and notes[0].notification.unread is True


# --- input the producer or the router gets wrong -------------------------------------------------------


def test_vllm_pr_50297_prefill_request_finished_with_no_blocks_is_refused() -> None:
    """https://github.com/vllm-project/vllm/pull/50297 (and PR 48141) -- with async scheduling a
    prefill request could be preempted during its final step; its blocks were already purged, so
    the connector's ``request_finished`` saw an empty block list and handed out transfer params
    for KV that no longer existed (the PR's alternative fix: make the connector fail it so the
    router retries). A prompt always has at least one block on the producer, so pdfsm should
    refuse ``request_finished`` with no blocks by name, hold nothing, and return no params that a
    decode could load."""
    w = LeaseWorld()
    with pytest.raises(InvalidInput) as err:
        w.p.request_finished("p1", [])
    assert err.value.field == "block_ids"
    w.run(1)
    assert "p1" not in w.p.core.producers and w.p.core.remembered(PRODUCER, "p1") is None


def test_vllm_router_pr_191_params_without_remote_tp_size_are_not_silently_read_as_tp_1() -> None:
    """https://github.com/vllm-project/router/pull/191 -- the router put ``remote_tp_size: 1`` in
    every request (hard-coded until vLLM issue 41211) instead of the prefill engine's real TP size,
    so connectors planned reads and notifications for the wrong number of ranks. The same happens
    when a router forwards vLLM NixlConnector's own dict, whose field is ``tp_size``: pdfsm's
    parser ignores the unknown ``tp_size`` and defaults ``remote_tp_size`` to 1 (and ``lease_ns``
    to unknown). Params that do not say the producer's TP size should be refused by name."""
    vllm_shaped = {"lease_ns": 60_000_000_000,
                   "remote_engine_id": "P", "remote_request_id": "p1", "remote_block_ids": [1, 2],
                   "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 4,
                   "do_remote_prefill": True, "do_remote_decode": False}
    with pytest.raises(InvalidInput) as err:
        KVTransferParams.parse(vllm_shaped)
    assert err.value.field in ("remote_tp_size", "tp_size")


# --- scale ---------------------------------------------------------------------------------------------


def test_nixl_issue_135_page_size_one_prompt_of_128k_blocks_moves_every_block_once() -> None:
    """https://github.com/ai-dynamo/nixl/issues/135 (and NIXL issue 176) -- SGLang with attention page
    size 1 hands NIXL one segment per token: 15k-segment transfers made descriptors of ~20 MB and a
    0.6 s ``transfer()``. pdfsm takes a 131072-block request (a 128k-token prompt at page size 1)
    through the params' dict form, in reverse order, and moves every block exactly once to its
    paired local block, reports the request once and releases the producer once, fast."""
    n = 1 << 17
    w = LeaseWorld(num_blocks=n, p_lease_ns=120 * S)
    params = w.p.request_finished("p1", list(range(n))).to_dict()
    local = list(reversed(range(n)))
    w.d.load("d1", local, params)
    w.run(4)
    assert w.received == ["d1"] and w.released == ["p1"] and not w.failed and not w.expired
    assert w.cons.memory == b"".join(pattern("P-0", n - 1 - b, BLOCK) for b in range(n))
    # The same local blocks are free for the next long request once the first is reported.
    w.d.load("d2", list(range(n)), w.p.request_finished("p2", list(range(n))))
    w.run(4)
    assert w.received == ["d1", "d2"] and w.released == ["p1", "p2"]


# --- partial TP failure ----------------------------------------------------------------------------------


def test_sglang_pr_13657_one_of_two_prefill_tp_ranks_dies_mid_read_then_restarts() -> None:
    """https://github.com/sgl-project/sglang/pull/13657 (issue 12779) -- a crashed prefill node left
    decode requests waiting on it and decode's health check failed; the fix marks requests from the
    dead prefill failed and releases their KV. Here prefill TP 2 spans two nodes and only rank 1
    dies while decode (TP 1) reads half of each block from each rank. Expected: the request fails
    once, blamed on the peer, with its blocks invalid and the recompute policy, only after both
    reads stopped; the surviving rank releases its blocks once, by notification, not by lease;
    and when rank 1 comes back as a new agent under the same engine id, the next request
    handshakes afresh and reads both halves correctly."""
    net, now = SimNetwork(), [0]

    def producer(agent: str, rank: int) -> tuple[Connector, SimTransport]:
        t = SimTransport(net, agent, tp_rank=rank, block_bytes=BLOCK // 2)
        t.fill(range(64))
        c = Connector(CoreConfig(engine_id="P", compat_hash="h", tp_rank=rank, tp_size=2), t, SimHandshaker(net),
                      clock=lambda: now[0], port=9)
        return c, t

    ranks = [producer("P-0", 0), producer("P-1", 1)]
    net.serve("127.0.0.1", 9, lambda pp: reply("P", tp_size=2, ranks=tuple(t.rank_info() for _, t in ranks)))
    cons = SimTransport(net, "D-0", block_bytes=BLOCK)
    d = Connector(CoreConfig(engine_id="D", compat_hash="h"), cons, SimHandshaker(net), clock=lambda: now[0])
    released: list[tuple[int, str]] = []
    expired: list[str] = []
    received: list[str] = []
    failed: list[HandOff] = []

    def run(steps: int = 4) -> None:
        for _ in range(steps):
            got = d.get_finished()[1]
            failed.extend(d.last.failed)
            received.extend(sorted(got - {f.request_id for f in d.last.failed}))
            for r, (p, t) in enumerate(ranks):
                if t.agent in net.dead:
                    continue
                released.extend((r, rid) for rid in sorted(p.get_finished()[0]))
                expired.extend(p.last.expired)

    params, _ = (p.request_finished("p1", [1, 2]) for p, _ in ranks)  # every rank holds its blocks
    net.script("d1", 0, 1, ReadScript(polls=50))  # rank 1's read is still running when it dies
    d.load("d1", [5, 6], params)
    run(3)
    assert d.core.consumers["d1"].state.name == "READING" and received == [] and failed == []
    net.kill("P-1")
    run(4)
    (off,) = failed
    assert off.request_id == "d1" and set(off.invalid_blocks) == {5, 6} and off.policy == "recompute"
    assert "disconnected" in off.reason and received == []
    assert released == [(0, "p1")] and expired == []  # the survivor, once, not by lease
    assert not cons.reads and d.core.engines[("P", 0)].state.name == "DISCONNECTED"

    ranks[1] = producer("P-1b", 1)  # rank 1 restarts: a new agent, the same engine id and listener
    params, _ = (p.request_finished("p2", [3, 4]) for p, _ in ranks)
    d.load("d2", [7, 8], params)
    run(4)
    assert received == ["d2"] and len(failed) == 1
    assert sorted(released) == [(0, "p1"), (0, "p2"), (1, "p2")] and expired == []
    for lb, rb in ((7, 3), (8, 4)):
        assert cons.block(lb) == pattern("P-0", rb, BLOCK // 2) + pattern("P-1b", rb, BLOCK // 2)
