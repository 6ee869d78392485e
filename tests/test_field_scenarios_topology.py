"""Production scenarios on the producer side and in topologies (found in review, session 13).

Each test models a real deployment situation (vLLM NixlConnector, SGLang disaggregation, smg,
NIXL; named in its docstring) on the prefill side or in a heterogeneous topology, and asserts what
a demanding user would expect from docs/ or from plain correctness.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import SimPair, collect, ev, handshake, make_core, notes, read, reply, stop_while_handshaking

from pdfsm.commands import HandOff, PostRead, SendNotification, StartHandshake
from pdfsm.connector import Connector
from pdfsm.errors import InvalidInput, LayoutMismatch
from pdfsm.events import (
    AbortRequested,
    CoreConfig,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    PeerAdded,
    PeerDisconnected,
    RankInfo,
)
from pdfsm.fsm import Fault
from pdfsm.sidechannel import check_reply
from pdfsm.topology import MAX_KV_HEADS
from pdfsm.wire import WireError
from transports.sim import SimHandshaker, SimNetwork, SimTransport, pattern

LEASE = 120_000_000_000


# --- PP producer: a request that stops while one PP engine is connected --------------------------------


@pytest.mark.parametrize("how", ["handshake-fails", "abort", "deadline", "notify-only-handshake-fails"])
def test_pp2_producer_request_stopping_while_pp1_handshakes_notifies_the_connected_pp0_ranks(how: str) -> None:
    """vLLM PR 43366 / SGLang PR 15027 (PP prefill read by a PP 1 decode): the decode worker
    handshakes each producer PP stage separately. Stage 0 is connected, stage 1's handshake then
    fails (or the request is aborted, or its deadline passes while stage 1 still handshakes; or a
    notify-only request, a full local prefix hit, sees stage 1's handshake fail).

    docs/decisions.md ("Failed and aborted consumer requests still notify the producer"): a failed
    or aborted request notifies each producer rank it did not read, so the producer releases at
    once instead of waiting for its lease; only a request that *never reached a connected engine*
    has no connection to notify over. Here stage 0 is connected and held by the request: its ranks
    can be told, and should be, or stage 0 pins the request's blocks for a whole lease (120 s by
    default) on every such failure."""
    core = make_core(read_timeout_ns=1_000)
    notify_only = how.startswith("notify-only")  # a full local prefix hit: nothing to read, only to tell
    core.apply(read("r", remote_pp=2, remote_tp=2, blocks=() if notify_only else (1, 2)))
    core.apply(ev(HandshakeDone, 0, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", tp_size=2, pp_size=2)))
    core.apply(ev(PeerAdded, 0, engine_id="P", pp_rank=0, attempt=1))  # stage 0 connected; the request holds it
    assert core.consumers["r"].state.name == "HANDSHAKING"
    core.take_commands()
    cmds = stop_while_handshaking(core, how)
    outcomes = [c.outcome for c in cmds if isinstance(c, HandOff)]
    assert outcomes == [] if notify_only else outcomes in (["failed"], ["aborted"])
    assert sorted(notes(cmds)) == [(0, 0, "p-r"), (0, 1, "p-r")], (
        "stage 0's ranks were connected and never read: they are left to their lease")


# --- the simulated transport keeps the transport protocol on sends too -----------------------------------


def test_sim_send_to_a_killed_producer_reports_the_engine_gone_like_nixl_and_torch() -> None:
    """docs/transports.md, the protocol table: ``send`` raises on failure "after submitting
    ``PeerDisconnected`` if the peer is gone" (the NIXL and torch transports do). A full prefix hit
    (notify-only load) or a heartbeat to a prefill worker that died is such a send. The simulated
    transport, which the race tester drives, raises without reporting the engine gone, so the
    engine stays CONNECTED to a dead agent and the failure path the real transports take is never
    exercised."""
    pair = SimPair()
    pair.d.load("d-warm", [1], pair.p.request_finished("warm", [1]))
    pair.run(3)
    assert pair.d.core.engines[("P", 0)].state.name == "CONNECTED"
    params = pair.p.request_finished("p1", [2, 3])
    pair.net.kill("P-0")
    pair.d.load("d1", [], params)  # notify-only: the whole prompt is in the local prefix cache
    pair.run(2)
    losses = [r for r in pair.d.core.log.records() if isinstance(r.event, PeerDisconnected)]
    assert losses, "no PeerDisconnected after a send to a dead peer"
    assert pair.d.core.engines[("P", 0)].state.name == "DISCONNECTED"


# --- producer restarted under the same engine id while consumers still hold its params -----------------------


def test_smg_2492_params_minted_before_a_same_id_producer_restart_are_never_reported_received() -> None:
    """smg PR 2492 / issue 2491 and vLLM PR 55471: a prefill worker restarts on the same address under
    the same (configured) engine id. The router still holds params the dead process minted (their
    lease is not over); the decode side re-handshakes with the new process (same engine id, same
    layout, so every check passes) and reads the old block ids out of the new process's memory,
    which never held that request. The new producer then hears of a request it never had (a remote
    violation, after the fact).

    The decode side must not report such a load as received: the bytes are another request's (or
    none). pdfsm's handshake reply and params share nothing that tells two incarnations of one
    engine id apart."""
    pair = SimPair()
    pair.d.load("d-warm", [1], pair.p.request_finished("warm", [1]))
    pair.run(3)
    stale = pair.p.request_finished("p-old", [4, 5])  # minted, then the process dies
    pair.restart_producer("P-0-restarted")
    # a request with fresh params finds the old connection dead, and the engine is handshaken again
    pair.d.load("d1", [10, 11], pair.p.request_finished("p1", [2, 3]))
    recv, _, failed = pair.run(4)
    pair.d.load("d2", [12, 13], pair.p.request_finished("p2", [2, 3]))
    recv, _, failed = pair.run(4)
    assert recv == ["d2"] and not failed
    # now the router's queued stale params reach the decode side, well inside their lease
    pair.d.load("d-stale", [20, 21], stale)
    recv, _, failed = pair.run(4)
    assert pair.cons.block(20) == bytes(64)  # nothing was read from the new process's block 4
    assert [f.request_id for f in failed] == ["d-stale"], (  # handed back failed: its blocks invalid
        "params of a dead producer incarnation were read from its successor and reported received")
    assert "incarnation" in failed[0].reason and failed[0].invalid_blocks == (20, 21)
    # the fresh engine still serves fresh params (evicted at most, and handshaken again)
    pair.d.load("d3", [30, 31], pair.p.request_finished("p3", [6, 7]))
    recv, _, failed = pair.run(6)
    assert recv == ["d3"] and not failed
    assert pair.cons.block(30) == pattern("P-0-restarted", 6, 64)


def test_a_stopped_request_whose_params_contradict_a_connected_stage_notifies_nobody() -> None:
    """The same stop, but stage 0's reply says PP 1 where the params say PP 2: the params may name
    the wrong ranks, so nothing is sent (docs/decisions.md, params checked against the handshake)."""
    core = make_core(read_timeout_ns=1_000)
    core.apply(read("r", remote_pp=2, remote_tp=2))
    handshake(core, pp_rank=0, tp_size=2)  # its reply says PP 1
    core.take_commands()
    core.apply(ev(HandshakeFailed, 10, engine_id="P", pp_rank=1, attempt=1, error="connection refused"))
    cmds = core.take_commands() + collect(core, 3_000)
    assert [c.outcome for c in cmds if isinstance(c, HandOff)] == ["failed"]
    assert notes(cmds) == []


def _pp_replies(core: Any, incarnations: tuple[str, str]) -> None:
    for pp, inc in enumerate(incarnations):
        ranks = tuple(RankInfo(pp_rank=pp, tp_rank=t, agent=f"P-{pp}-{t}", incarnation=inc) for t in range(2))
        core.apply(ev(HandshakeDone, 0, engine_id="P", pp_rank=pp, attempt=1,
                      reply=reply("P", tp_size=2, pp_size=2, ranks=ranks)))
        core.apply(ev(PeerAdded, 0, engine_id="P", pp_rank=pp, attempt=1))


@pytest.mark.parametrize(("minted_by", "stage", "reads"), [
    ("stage1", 1, True), ("stage0", 0, True), ("gone", 0, False), ("gone", 1, False), ("stage0", 1, False),
    ("", 0, True), ("stage1", None, True), ("gone", None, False)])
def test_pp_params_are_judged_by_the_minting_stage_incarnation(minted_by: str, stage: int | None, reads: bool) -> None:
    """A PP producer's params are minted by one stage's rank and say which stage: they are good
    when that stage's reply names their incarnation, stale when it does not (even if another stage
    happens to), and unchecked when they name none. Params that do not say the stage (an older
    producer's) are judged against every stage's reply at once."""
    core = make_core()
    core.apply(read("r", remote_pp=2, remote_tp=2, incarnation=minted_by, incarnation_pp=stage))
    _pp_replies(core, ("stage0", "stage1"))
    cmds = core.take_commands() + collect(core, 1_000)
    assert any(isinstance(c, PostRead) for c in cmds) is reads
    if not reads:
        (off,) = [c for c in cmds if isinstance(c, HandOff)]
        assert off.outcome == "failed" and "incarnation" in off.reason


def test_a_request_stopped_after_its_lease_is_over_notifies_nobody() -> None:
    """The same abort as above, but after the lease the params gave (less the margin) is over: the
    producer has released by itself, and a notification now would reach it as a late read (vLLM PR
    41269), so the connected stage is not told either."""
    core = make_core(read_timeout_ns=10**12, lease_margin_ns=100)
    core.apply(read("r", remote_pp=2, remote_tp=2, lease_ns=1_000))
    core.apply(ev(HandshakeDone, 0, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", tp_size=2, pp_size=2)))
    core.apply(ev(PeerAdded, 0, engine_id="P", pp_rank=0, attempt=1))
    core.take_commands()
    core.apply(ev(AbortRequested, 5_000, request_id="r"))
    cmds = core.take_commands() + collect(core, 6_000)
    assert [c.outcome for c in cmds if isinstance(c, HandOff)] == ["aborted"]
    assert notes(cmds) == []


def test_smg_2382_a_producer_restarted_with_fewer_pp_stages_is_not_wedged_by_its_old_stage() -> None:
    """https://github.com/smg-project/smg/issues/2382 with a PP change (vLLM PR 43366): the producer,
    connected as PP 2 (stages 0 and 1), restarts under the same engine id as PP 1. Expected: the
    first request with the new params contradicts stage 0's reply, so both old stages are evicted
    and that request handshakes stage 0 alone and reads (before the re-handshake, it was refused
    and the next request handshook). Before (found
    by review, real bytes over the torch transport): only stage 0 was evicted; stage 1 stayed
    connected, still claiming the layers the new stage 0 holds, and every later read was refused
    ("layer 4 is held by remote PP ranks 0 and 1") until it idled out, an hour by default."""
    core = make_core(strict=False)
    core.apply(read("warm", remote_pp=2))
    for pp in (0, 1):
        core.apply(ev(HandshakeDone, engine_id="P", pp_rank=pp, attempt=1,
                      reply=reply("P", pp_rank=pp, pp_size=2)))
        core.apply(ev(PeerAdded, engine_id="P", pp_rank=pp, attempt=1))
    for pp in (0, 1):
        core.apply(ev(HandleDone, request_id="warm", pp_rank=pp, tp_rank=0))
    collect(core)
    assert sorted(core.engines) == [("P", 0), ("P", 1)]
    core.take_commands()
    core.apply(read("d0", remote_pp=1, t=10))
    assert core.consumers["d0"].state.name == "HANDSHAKING" and list(core.engines) == [("P", 0)]
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert start.pp_rank == 0
    core.apply(ev(HandshakeDone, 20, engine_id="P", pp_rank=0, attempt=start.attempt, reply=reply("P", pp_size=1)))
    core.apply(ev(PeerAdded, 20, engine_id="P", pp_rank=0, attempt=start.attempt))
    assert core.consumers["d0"].state.name == "READING" and list(core.engines) == [("P", 0)]


def test_a_stage_of_the_old_pp_layout_whose_loss_went_unseen_is_evicted_when_the_new_layout_connects() -> None:
    """Scenario: a PP-2 producer; its stage-0 read fails DISCONNECTED (the process died) while stage
    1, idle, never sees the loss; the producer comes back as PP 1 and a PP-1 request handshakes
    stage 0 afresh. Expected: stage 1 (a PP-2 reply) is evicted when stage 0 connects with a PP-1
    reply, so the transports' layer check does not refuse every read ("layer x is held by remote
    PP ranks 0 and 1"). Before (found by review): nothing contradicted the params (stage 0 was new,
    the plan never looks at stage 1), and stage 1 stayed connected until it idled out (1 h)."""
    core = make_core(strict=False)
    core.apply(read("w", remote_pp=2))
    for pp in (0, 1):
        core.apply(ev(HandshakeDone, engine_id="P", pp_rank=pp, attempt=1, reply=reply("P", pp_rank=pp, pp_size=2)))
        core.apply(ev(PeerAdded, engine_id="P", pp_rank=pp, attempt=1))
    core.apply(ev(HandleDone, 10, request_id="w", pp_rank=1, tp_rank=0))
    core.apply(ev(HandleFailed, 11, request_id="w", pp_rank=0, tp_rank=0, why=HandleFailure.DISCONNECTED))
    core.apply(ev(PeerDisconnected, 11, engine_id="P", pp_rank=0, attempt=1))
    collect(core, 12)
    core.apply(read("d0", remote_pp=1, t=100))
    core.apply(ev(HandshakeDone, 100, engine_id="P", pp_rank=0, attempt=2, reply=reply("P", pp_size=1)))
    core.apply(ev(PeerAdded, 100, engine_id="P", pp_rank=0, attempt=2))
    assert ("P", 1) not in core.engines
    assert core.consumers["d0"].state.name == "READING"


def test_an_old_layout_stage_connecting_after_the_new_layout_is_refused_not_the_new_one_evicted() -> None:
    """Scenario: a PP-2 producer restarted as PP 1; a request with the old PP-2 params handshakes
    both stages: stage 1's reply comes from the old process (started at 100), stage 0's from the
    new one (PP 1, started at 200); stage 0 connects first, a PP-1 read uses it, then stage 1's
    peer is added. Expected: stage 1 is refused (failed: its reply is of a replaced process) and
    stage 0 stays connected for the reads. Before (found by review): stage 1, connecting last,
    evicted the right stage 0 and stayed, claiming layers stage 0 holds."""
    def rep(pp: int, pp_size: int, started: int) -> Any:
        rank = RankInfo(pp_rank=pp, tp_rank=0, agent=f"P-{started}-{pp}", started_wall_ns=started)
        return reply("P", pp_rank=pp, pp_size=pp_size, ranks=(rank,))

    core = make_core(strict=False)
    core.apply(read("r_old", remote_pp=2))
    core.apply(ev(HandshakeDone, 10, engine_id="P", pp_rank=1, attempt=1, reply=rep(1, 2, 100)))
    core.apply(ev(HandshakeDone, 11, engine_id="P", pp_rank=0, attempt=1, reply=rep(0, 1, 200)))
    core.apply(ev(PeerAdded, 12, engine_id="P", pp_rank=0, attempt=1))
    core.apply(read("d0", remote_pp=1, t=13))
    core.apply(ev(PeerAdded, 14, engine_id="P", pp_rank=1, attempt=1))
    assert core.engines[("P", 1)].state.name == "FAILED"
    e0 = core.engines[("P", 0)]
    assert e0.state.name == "CONNECTED" and not e0.evict_owed
    assert core.consumers["d0"].state.name == "READING"


def _staged_reply(pp: int, pp_size: int, started: int) -> Any:
    rank = RankInfo(pp_rank=pp, tp_rank=0, agent=f"P-{started}-{pp}", started_wall_ns=started)
    return reply("P", pp_rank=pp, pp_size=pp_size, ranks=(rank,))


@pytest.mark.parametrize("stale_first", [True, False])
def test_a_stage_of_a_replaced_process_neither_blocks_an_owed_notice_nor_delays_the_next_request(
        stale_first: bool) -> None:
    """Scenario: PP-2 params of a new process; the request is aborted while both stages handshake;
    stage 1's reply comes from the replaced PP-3 process (started 100), stage 0's from the new one
    (started 200); the stages connect in either order; a request comes right after. Expected: stage
    0's owed notice is sent (the stale stage, evicted or refused, does not count against the
    params), and the next request handshakes stage 1 again at once rather than failing for the
    retry pause. Before (found by review): with the stale stage connected first the notice was
    dropped; with it refused, requests failed for handshake_retry_ns."""
    core = make_core(strict=False)
    core.apply(read("r", remote_pp=2, lease_ns=10**12))
    core.apply(ev(AbortRequested, 5, request_id="r"))
    core.apply(ev(HandshakeDone, 10, engine_id="P", pp_rank=1, attempt=1, reply=_staged_reply(1, 3, 100)))
    core.apply(ev(HandshakeDone, 10, engine_id="P", pp_rank=0, attempt=1, reply=_staged_reply(0, 2, 200)))
    sent = []
    for pp in ((1, 0) if stale_first else (0, 1)):
        core.apply(ev(PeerAdded, 20, engine_id="P", pp_rank=pp, attempt=1))
        sent += [(c.pp_rank, c.notification.request_id) for c in core.take_commands()
                 if isinstance(c, SendNotification)]
    assert sent == [(0, "p-r")]
    core.apply(read("d", remote_pp=2, t=21))
    assert [c.pp_rank for c in core.take_commands() if isinstance(c, StartHandshake)] == [1]


# --- a TP above the model's KV heads (GQA heads replicated over ranks) ------------------------------


def test_vllm_tp_above_kv_heads_decode_rank_reads_its_replicated_head_once() -> None:
    """vLLM's NixlConnector (``is_kv_replicated``: a TP larger than the model's KV heads, e.g. 2 KV
    heads at decode TP 4): each decode rank holds one head, two ranks the same one. Told the
    heads (``kv_heads``), a decode rank reads its head as a slice of the producer's block (half of
    it, not a quarter) and is one of the four parts the producer rank expects."""
    core = make_core(tp_size=4, tp_rank=3, kv_heads=2)
    core.apply(read("r1", remote_tp=1))
    handshake(core)
    (post,) = [c for c in core.take_commands() if isinstance(c, PostRead)]
    src = post.source
    assert (src.tp_rank, src.remote_slice, src.remote_slices, src.local_slices) == (0, 1, 2, 1)
    assert (post.notification.part, post.notification.of) == (3, 4)


def test_vllm_tp_above_kv_heads_on_the_prefill_side_reads_each_head_once_and_tells_the_copies() -> None:
    """2 KV heads at prefill TP 4, decode TP 1 (SGLang maps the copies; vLLM reads one of each):
    the decode rank reads prefill ranks 0 and 2 (heads 0 and 1) into its two head slices and
    tells ranks 1 and 3, which hold copies, that they may release: every rank hears once."""
    core = make_core(kv_heads=2)
    core.apply(read("r1", remote_tp=4))
    handshake(core, tp_size=4)
    posts = [c for c in core.take_commands() if isinstance(c, PostRead)]
    assert [(c.source.tp_rank, c.source.local_slice, c.source.local_slices) for c in posts] == [(0, 0, 2), (2, 1, 2)]
    assert all(c.notification.of == 1 for c in posts)  # a read's notification follows its bytes
    for c in posts:
        core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=c.source.tp_rank))
    told = sorted(c.tp_rank for c in core.take_commands() if isinstance(c, SendNotification))
    assert told == [1, 3]  # the copies, once the request is received


@pytest.mark.parametrize(("local", "remote", "why"), [
    (2, 4, "KV heads differ: local 2, remote 4"),
    (2, 0, "KV heads differ: local 2, remote 0"),
    (0, 2, "KV heads differ: local 0, remote 2"),
    (8, 4, "KV heads differ: local 8, remote 4"),  # two counts: never alike, even if both plan so
])
def test_engines_saying_different_kv_heads_is_a_remote_layout_failure(local: int, remote: int, why: str) -> None:
    """Both engines must say the same heads (the plan of one would move wrong bytes for the other):
    a typed layout failure blamed on the remote side, the request failed with its policy."""
    core = make_core(strict=False, tp_size=4, kv_heads=local)
    core.apply(read("r1", remote_tp=1))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", kv_heads=remote)))
    engine = core.engines[("P", 0)]
    assert engine.state.name == "FAILED" and isinstance(engine.error, LayoutMismatch)
    assert why in str(engine.error)
    assert [r.fault for r in core.log.records() if r.fault is not None][-1] is Fault.REMOTE
    core.take_commands()
    (off,) = [c for c in collect(core) if isinstance(c, HandOff)]
    assert off.outcome == "failed" and off.request_id == "r1"


def test_a_producer_tp_its_heads_cannot_be_shared_over_fails_at_the_load_or_the_handshake() -> None:
    """16 prefill ranks over 8 heads are fine (two hold each); 6 over 4 cannot be: params naming
    that TP fail the request at once, and a reply saying it fails the handshake (remote)."""
    core = make_core(strict=False, kv_heads=8)
    core.apply(read("r1", remote_tp=16))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", tp_size=16, kv_heads=8)))
    assert core.engines[("P", 0)].state.name == "CONNECTING"  # accepted: the transport adds the peer next
    core = make_core(strict=False, kv_heads=4)
    core.apply(read("r1", remote_tp=6))
    assert core.consumers["r1"].state.name == "FAILED" and not core.engines
    core = make_core(strict=False, kv_heads=4)
    core.apply(read("r1", remote_tp=1))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", tp_size=6, kv_heads=4)))
    engine = core.engines[("P", 0)]
    assert engine.state.name == "FAILED" and isinstance(engine.error, LayoutMismatch)
    assert "remote TP 6: the model's 4 KV heads do not divide TP 6" in str(engine.error)


@pytest.mark.parametrize(("cfg", "why"), [
    ({"kv_heads": 3, "tp_size": 2}, "TP 2 does not divide the model's 3 KV heads"),
    ({"kv_heads": 2, "tp_size": 3}, "the model's 2 KV heads do not divide TP 3"),
    ({"kv_heads": 1, "mla": True}, "must be 0 with mla"),
    ({"kv_heads": -1}, "must be an int in 0.."),
    ({"kv_heads": MAX_KV_HEADS + 1}, "must be an int in 0.."),
    ({"kv_heads": True}, "must be an int in 0.."),
])
def test_a_config_whose_kv_heads_cannot_be_held_is_refused_naming_kv_heads(cfg: dict[str, Any], why: str) -> None:
    net = SimNetwork()
    transport = SimTransport(net, "D-0", num_blocks=4, block_bytes=8)
    with pytest.raises(InvalidInput, match=why) as got:
        Connector(CoreConfig(engine_id="D", **cfg), transport, SimHandshaker(net))
    assert got.value.field == "kv_heads"


def test_the_side_channel_bounds_a_replys_kv_heads() -> None:
    check_reply(reply("P", kv_heads=MAX_KV_HEADS))
    with pytest.raises(WireError, match="kv_heads"):
        check_reply(reply("P", kv_heads=MAX_KV_HEADS + 1))


@pytest.mark.parametrize(("local", "remote"), [(8, 0), (0, 8), (4, 0)])
def test_a_head_count_said_by_one_engine_only_is_accepted_where_it_changes_no_plan(local: int, remote: int) -> None:
    """A rolling upgrade: one engine says the model's heads, its peer (older) says nothing (0).
    Unsaid plans as heads enough for the larger TP, so where the said count is at least both TPs
    (here 4 and 1) both plan alike and the handshake is accepted (found by review: it failed every
    request). Where it is fewer (heads held by several ranks), it still fails, as above."""
    core = make_core(strict=False, tp_size=4, kv_heads=local)
    core.apply(read("r1", remote_tp=1))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", kv_heads=remote)))
    assert core.engines[("P", 0)].state.name == "CONNECTING"
