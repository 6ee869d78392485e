"""Review: more field scenarios from PD-disaggregation KV-transfer threads (third batch).

Each test is a real report (vLLM, SGLang, TensorRT-LLM, Ray; the URL and a summary in our own words
are in its docstring) not covered by the bug corpus or the earlier field-scenario files. Each drives
the real machines, through the core or through Connectors over the simulated transport, and asserts
what a correct implementation must do: never report bytes from the wrong producer as received, never
let two reads write one block, hold blocks until every read stopped, report once with the failure's
invalid blocks, release producer blocks exactly once, and expire every lease on time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from helpers import collect, connected, ev, make_core, read, reply, tick

from pdfsm.commands import (
    CancelRead,
    Command,
    DropPeer,
    HandOff,
    PostRead,
    SendNotification,
)
from pdfsm.connector import Connector
from pdfsm.core import Core
from pdfsm.errors import InvalidInput
from pdfsm.events import (
    AbortRequested,
    CoreConfig,
    EvictRequested,
    HandleDone,
    HandleFailed,
    HandleFailure,
)
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

S = 1_000_000_000  # one second in ns

# --- helpers -----------------------------------------------------------------------------------


def hand_offs(core: Core, t: int = 0, step: int = 1) -> list[HandOff]:
    return [c for c in collect(core, t, step) if isinstance(c, HandOff)]


class World:
    """A simulated network on one shared clock: producers (each its own agent, engine id and
    side-channel port) and one decode Connector."""

    def __init__(self, *, d_config: dict[str, Any] | None = None) -> None:
        self.net, self.now = SimNetwork(), 0
        self.producers: dict[str, tuple[Connector, SimTransport]] = {}
        self.cons = SimTransport(self.net, "D-0")
        self.d = Connector(CoreConfig(engine_id="D", compat_hash="h", **(d_config or {})), self.cons,
                           SimHandshaker(self.net), clock=self.clock, wall_clock=self.clock)
        self.received: list[str] = []
        self.failed: dict[str, HandOff] = {}
        self.released: list[str] = []
        self.expired: list[str] = []

    def clock(self) -> int:
        return self.now

    def producer(self, agent: str, engine_id: str, port: int, lease_ns: int = 120 * S) -> Connector:
        """Start a producer engine (TP 1) whose side channel answers at 127.0.0.1:``port``."""
        t = SimTransport(self.net, agent)
        t.fill(range(64))
        p = Connector(CoreConfig(engine_id=engine_id, compat_hash="h", lease_ns=lease_ns), t,
                      SimHandshaker(self.net), clock=self.clock, wall_clock=self.clock, port=port)
        self.net.serve("127.0.0.1", port, lambda pp: reply(engine_id, ranks=(t.rank_info(),)))
        self.producers[agent] = (p, t)
        return p

    def run(self, steps: int = 4) -> None:
        for _ in range(steps):
            got = self.d.get_finished()[1]
            for off in self.d.last.failed:
                self.failed[off.request_id] = off
            self.received += sorted(got - {off.request_id for off in self.d.last.failed} - self.d.last.aborted)
            for p, _ in self.producers.values():
                self.released += sorted(p.get_finished()[0])
                self.expired += sorted(p.last.expired)


# --- engine identity: one id, two engines; one address, two ids ------------------------------------


@pytest.mark.parametrize(("second_id", "second_arrives"), [
    ("P", "after the first connected"),
    ("P", "while the first handshakes"),
    ("P-dp1", "after the first connected"),  # control: distinct ids, as the fix made them
])
def test_dp_siblings_sharing_one_engine_id_never_read_each_others_blocks(second_id: str, second_arrives: str) -> None:
    """https://github.com/vllm-project/vllm/pull/18903 (and the review of
    https://github.com/ray-project/ray/pull/65756) -- data-parallel prefill ranks ended up with one
    and the same KV engine id (the id was made once per process, or a configured id was shared),
    each with its own side-channel port, so the decode side could not tell the engines apart during
    handshake and transfer. Here two prefill engines both call themselves "P" but listen on ports 9
    and 10; the router's params name the right port for each request. Whatever pdfsm does with the
    collision (refuse the request, or handshake the second listener), the request of the engine at
    port 10 must never be reported received with blocks read from the engine at port 9, and the
    engine at port 9 must never be told about a request it does not hold."""
    w = World()
    pa = w.producer("PA-0", "P", 9)
    pb = w.producer("PB-0", second_id, 10)
    params_a = pa.request_finished("pa1", [1, 2])
    params_b = pb.request_finished("pb1", [2, 3])
    assert (params_a.remote_engine_id, params_a.remote_port) == ("P", 9)
    assert (params_b.remote_engine_id, params_b.remote_port) == (second_id, 10)
    w.d.load("da", [5, 6], params_a)
    if second_arrives == "after the first connected":
        w.run(3)
        assert w.received == ["da"] and w.cons.block(5) == pattern("PA-0", 1, 64)
    w.d.load("db", [7, 8], params_b)
    w.run(5)
    if "db" in w.received:
        assert w.cons.block(7) == pattern("PB-0", 2, 64), (
            "db, loaded from the engine at port 10, was reported received with the blocks of the engine "
            "at port 9 (same engine id): cross-engine KV served as the request's prompt")
    else:
        assert "db" in w.failed and set(w.failed["db"].invalid_blocks) == {7, 8}
    assert "pb1" not in pa.core.producers, "the engine at port 9 was notified about the other engine's request"


def test_prefill_replaced_by_a_new_engine_id_at_the_same_address_is_handshaken_afresh() -> None:
    """https://github.com/vllm-project/vllm/pull/50047 -- a pull-mode prefill engine restarted with a
    new engine id at the same host and port, and the decode side kept the old peer's transfer state
    and cached metadata until a TTL (related: vLLM issue 58063, where that stale state blocked the
    replacement). pdfsm: params of the new id are handshaken anew at that address and read the new
    engine's bytes; stale params still naming the old id fail with the recompute policy (the old
    agent is gone), without touching the new engine; the old engine, left disconnected with nothing
    holding it, is forgotten (its peer dropped) once its idle time passed."""
    w = World(d_config={"tombstone_ns": 10 * S, "handshake_retry_ns": S})
    old = w.producer("P-old", "P", 9)
    w.d.load("d-warm", [1], old.request_finished("warm", [1]))
    stale = old.request_finished("p-stale", [2, 3])  # the router holds these when P dies
    w.run(3)
    assert w.received == ["d-warm"] and w.d.core.engines[("P", 0)].state.name == "CONNECTED"

    w.net.kill("P-old")
    new = w.producer("P-new", "P2", 9)  # the replacement: another engine id, the same listener
    w.d.load("d-new", [5, 6], new.request_finished("p-new", [2, 3]))
    w.d.load("d-stale", [7, 8], stale)
    w.run(5)
    assert "d-new" in w.received and w.cons.block(5) == pattern("P-new", 2, 64)
    assert w.cons.block(6) == pattern("P-new", 3, 64)
    assert "p-new" in w.released and "p-new" not in w.expired
    assert w.failed["d-stale"].policy == "recompute" and set(w.failed["d-stale"].invalid_blocks) == {7, 8}
    assert w.cons.block(7) == bytes(64)
    assert w.d.core.engines[("P2", 0)].state.name == "CONNECTED"
    assert w.d.core.engines[("P", 0)].state.name == "DISCONNECTED"
    starts = [r for r in w.d.core.log.records() if r.machine == "engine" and r.state == "HANDSHAKING"]
    assert len(starts) == 2  # the old id once (before the crash), the new id once

    w.now = 11 * S  # past max(tombstone_ns, handshake_retry_ns) since the old engine went idle
    w.run(2)
    assert ("P", 0) not in w.d.core.engines and ("P2", 0) in w.d.core.engines
    assert not w.failed.keys() - {"d-stale"}


# --- the scheduler reuses a block that a read still writes ----------------------------------------


def test_block_reallocated_while_a_read_still_writes_it_is_never_read_into_twice() -> None:
    """https://github.com/sgl-project/sglang/pull/35049 (the race also behind vLLM PR 32255) -- a
    decode request aborted mid-transfer had its KV pages freed at once, the next request was given
    the same pages, and the still-running transfer of the first one overwrote them: the second
    request silently decoded from another prompt's KV. pdfsm already refuses one request naming a
    block twice because two reads would race to write it; the same race across two live requests
    must not be accepted either. Here request d1's read into blocks 5 and 6 hangs (NIXL has no stall
    timeout) and the scheduler allocates block 6 again to request d2: pdfsm must refuse the load or
    at least never post d2's read into block 6 while d1's read may still write it, and must never
    report d2 received over it."""
    w = World()
    p = w.producer("P-0", "P", 9)
    params1 = p.request_finished("p1", [1, 2])
    params2 = p.request_finished("p2", [3, 4])
    w.net.script("d1", 0, 0, ReadScript(end="hang"))
    w.d.load("d1", [5, 6], params1)
    w.run(3)
    assert ("d1", 0, 0) in w.cons.reads and w.d.core.consumers["d1"].state.name == "READING"

    overlaps: list[str] = []
    original: Callable[[PostRead], None] = w.cons.post_read

    def post_read(cmd: PostRead) -> None:
        for (rid, _, _), live in w.cons.reads.items():
            shared = set(cmd.local_blocks) & set(live.cmd.local_blocks)
            if shared:
                overlaps.append(f"{cmd.request_id} posted into {sorted(shared)} while {rid} still reads into them")
        original(cmd)

    w.cons.post_read = post_read  # type: ignore[method-assign]
    try:
        w.d.load("d2", [6, 7], params2)  # block 6 handed out again while d1's read may still write it
    except InvalidInput as exc:
        assert "local_block_ids" in str(exc)
        return
    w.run(4)
    assert not overlaps, overlaps
    assert "d2" not in w.received, "d2 was reported received over a block another read still writes"


# --- failures, aborts and cancels that race the last sibling read ----------------------------------


def test_failure_then_abort_holds_blocks_until_the_sibling_that_outran_its_cancel_stops() -> None:
    """https://github.com/sgl-project/sglang/pull/38961 -- the deferred decode KV release was
    defeated when the failure did not start at the decode side: a failed transfer released the
    decode pages immediately, and an abort for a room whose chunk was still outstanding was never
    acknowledged, so pages were reused under a write. pdfsm (prefill TP 2, decode TP 1: two reads):
    one read fails, its sibling is cancelled, the scheduler then aborts the request; the sibling
    completes anyway (the cancel lost the race). Nothing is reported until it stopped; the request
    is then reported once, aborted, with its blocks invalid (it failed before the abort); the
    prefill rank whose read failed is told, the other was told by its completed read; a repeated
    abort changes nothing and no engine stays held."""
    core = connected(make_core(strict=False), remote_tp=2)
    core.apply(read("d1", remote="p1", remote_tp=2, blocks=(5, 6), remote_blocks=(1, 2)))
    assert [c.source.tp_rank for c in core.take_commands() if isinstance(c, PostRead)] == [0, 1]
    core.apply(ev(HandleFailed, request_id="d1", pp_rank=0, tp_rank=1, why=HandleFailure.ERR, detail="remote I/O"))
    assert [(c.pp_rank, c.tp_rank) for c in core.take_commands() if isinstance(c, CancelRead)] == [(0, 0)]
    core.apply(ev(AbortRequested, request_id="d1"))
    core.apply(ev(AbortRequested, request_id="d1"))
    assert core.consumers["d1"].state.name == "ABORTING"
    assert not hand_offs(core)  # the sibling may still write blocks 5 and 6
    assert core.engines[("P", 0)].readers == 1
    core.apply(ev(HandleDone, request_id="d1", pp_rank=0, tp_rank=0))  # completed despite the cancel
    notes = [(c.tp_rank, c.notification.request_id, c.notification.part, c.notification.of)
             for c in core.take_commands() if isinstance(c, SendNotification)]
    assert notes == [(1, "p1", 0, 1)]
    (off,) = hand_offs(core, step=2)
    assert off.outcome == "aborted" and off.invalid_blocks == (5, 6) and "err" in off.reason
    assert not hand_offs(core, step=3)
    assert core.engines[("P", 0)].readers == 0
    assert not any(core.rejections.values())


def test_deadline_cancel_the_transport_cannot_honour_reports_once_when_the_read_finally_stops() -> None:
    """https://github.com/NVIDIA/TensorRT-LLM/pull/15363 -- on a KV transfer timeout the generation
    side could not always cancel a transfer still mid-flight ("cancellation incomplete, retry next
    iteration"), and the timeout path deadlocked or tore down state under it. pdfsm: the read
    deadline passes, the read is cancelled once; the transport keeps it running through many later
    ticks and collects, during which nothing is re-cancelled, nothing is reported and the blocks stay
    held; when the read finally completes, the request (already given up) is reported failed once,
    with its blocks invalid and the recompute policy, and no extra notification is sent (the
    completed read carried its own)."""
    core = connected(make_core(read_timeout_ns=1_000))
    core.apply(read("d1", remote="p1", blocks=(5, 6), remote_blocks=(1, 2), lease_ns=1_000 * S, t=0))
    core.take_commands()
    tick(core, 1_000)
    assert [(c.pp_rank, c.tp_rank) for c in core.take_commands() if isinstance(c, CancelRead)] == [(0, 0)]
    for step, t in enumerate((2_000, 50_000, 3 * S), start=1):
        tick(core, t)
        cmds = collect(core, t, step)
        assert not [c for c in cmds if isinstance(c, (CancelRead, HandOff))]
        assert core.consumers["d1"].state.name == "FAILING"
    core.apply(ev(HandleDone, 4 * S, request_id="d1", pp_rank=0, tp_rank=0))
    assert not [c for c in core.take_commands() if isinstance(c, SendNotification)]
    (off,) = hand_offs(core, 4 * S, step=10)
    assert off.outcome == "failed" and off.invalid_blocks == (5, 6) and off.policy == "recompute"
    assert "deadline" in off.reason
    tick(core, 10 * S)
    assert not hand_offs(core, 10 * S, step=11)


def test_stalled_read_is_bounded_by_the_producer_lease_not_only_the_read_timeout() -> None:
    """https://github.com/vllm-project/vllm/issues/49238 (a comment there) -- after a decode restart
    a long transfer stalled on a stale endpoint; the prefill side released its blocks when its
    30 s lease ran out, and the decode request hung instead of failing. pdfsm, with a read timeout
    (60 s) longer than the producer's lease (5 s): the stalled read is given up at the lease less
    the margin, before the producer can reuse the blocks; the read is cancelled and the request is
    reported failed once, blocks invalid, recompute. The producer is not told (at the trust bound
    its lease may be over by its own clock: a notice then reads as a late read there) and releases
    by expiry, once."""
    w = World(d_config={"read_timeout_ns": 60 * S})
    p = w.producer("P-0", "P", 9, lease_ns=5 * S)
    params = p.request_finished("p1", [1, 2])
    assert params.lease_ns == 5 * S
    w.net.script("d1", 0, 0, ReadScript(end="hang"))
    w.d.load("d1", [5, 6], params)
    w.run(3)
    w.now = 4 * S - 1
    w.run(2)
    assert w.d.core.consumers["d1"].state.name == "READING" and not w.failed and not w.released
    w.now = 4 * S  # 5 s lease less the 1 s margin
    w.run(3)
    off = w.failed["d1"]
    assert "deadline" in off.reason and set(off.invalid_blocks) == {5, 6} and off.policy == "recompute"
    assert not w.cons.reads  # the stalled read was stopped before the blocks were handed back
    assert w.released == [] and w.expired == []
    w.now = 6 * S
    w.run(2)
    assert w.released == ["p1"] and w.expired == ["p1"]  # finished_sending carries expiries too


def test_failed_request_notifies_before_an_eviction_sweep_can_drop_the_peer() -> None:
    """https://github.com/sgl-project/sglang/pull/36108 -- when a transfer failed, its cleanup could
    race away the endpoints the failure had to be reported to (the fix snapshots them first), so the
    other side waited for a timeout. pdfsm (prefill TP 2, decode TP 1): one read fails and its
    sibling is being cancelled when an idle-eviction sweep asks to drop the engine; the engine is
    kept while the sibling may run; once it stopped, both prefill ranks are notified (with the
    prefill request id) before the peer is dropped, and the request is reported failed once."""
    core = connected(make_core(strict=False), remote_tp=2)
    core.apply(read("d1", remote="p1", remote_tp=2))
    core.take_commands()
    core.apply(ev(HandleFailed, request_id="d1", pp_rank=0, tp_rank=1, why=HandleFailure.ERR))
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))
    cmds = core.take_commands()
    assert not [c for c in cmds if isinstance(c, DropPeer)]
    assert core.engines[("P", 0)].state.name == "CONNECTED"
    core.apply(ev(HandleFailed, request_id="d1", pp_rank=0, tp_rank=0, why=HandleFailure.CANCELLED))
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))
    cmds = core.take_commands()
    kinds: list[Command] = [c for c in cmds if isinstance(c, (SendNotification, DropPeer))]
    notes = sorted((c.tp_rank, c.notification.request_id) for c in kinds if isinstance(c, SendNotification))
    assert notes == [(0, "p1"), (1, "p1")]
    assert isinstance(kinds[-1], DropPeer) and sum(isinstance(c, DropPeer) for c in kinds) == 1
    (off,) = hand_offs(core)
    assert off.outcome == "failed" and off.invalid_blocks == (1, 2)
    assert ("P", 0) not in core.engines


# --- producer leases of different lengths -----------------------------------------------------------


def test_short_lease_registered_behind_a_long_one_still_expires_on_time() -> None:
    """https://github.com/vllm-project/vllm/pull/50789 (its second cause; the corpus row covers the
    heartbeat one) -- two different TTLs shared one reaper map, so a 480 s entry inserted ahead of a
    30 s entry stopped the early-exit scan and the 30 s blocks were never released, with no
    heartbeat involved. pdfsm: a long per-request lease held first does not delay a default-lease
    request held after it; each is released exactly once, by expiry, at its own deadline."""
    w = World()
    p = w.producer("P-0", "P", 9, lease_ns=30 * S)
    long = p.request_finished("long", [1, 2], lease_ns=480 * S)
    short = p.request_finished("short", [3])
    assert (long.lease_ns, short.lease_ns) == (480 * S, 30 * S)
    w.run(1)
    w.now = 30 * S - 1
    w.run(1)
    assert w.released == []
    w.now = 30 * S
    w.run(1)
    assert w.released == ["short"] and w.expired == ["short"]
    assert p.core.producers["long"].state.name == "HOLDING"
    w.now = 480 * S
    w.run(2)
    assert w.released == ["short", "long"] and w.expired == ["short", "long"]
