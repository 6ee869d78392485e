"""A producer that stops answering without an error (SIGSTOP, a node lost without a reset): its
reads hang and their cancels never land. The decode side must not keep sending new requests into
it, each pinning its blocks for as long as the hang lasts (SGLang PR 10222: a dead prefill's rooms
are failed by a heartbeat; TRT-LLM PR 12313: blocks leaked until the pool ran out; found by a
scenario review over real NIXL with a SIGSTOPped producer). Nor may a peer merely slow to
cancel lose its connection: it is only marked stalled, until a read of it stops."""

from __future__ import annotations

import pytest
from helpers import RankedEngines, SimPair, ev, make_core, read, reply, tick

from pdfsm.connector import KVTransferParams
from pdfsm.events import (
    AbortRequested,
    DeadlinePassed,
    HandleDone,
    HandshakeDone,
    HandshakeFailed,
    PeerAdded,
    PeerDisconnected,
    Source,
)
from transports.sim import ReadScript, SimTransport, pattern


class DeafToCancels(SimTransport):
    """NIXL with cancel_policy="wait" and a stopped peer: a cancelled READ runs on until the peer
    answers (here: until ``wake``)."""

    asleep = True

    def cancel_read(self, request_id: str, pp_rank: int, tp_rank: int) -> None:
        if not self.asleep:
            super().cancel_read(request_id, pp_rank, tp_rank)

    def wake(self) -> None:
        self.asleep = False
        for key in list(self.reads):
            super().cancel_read(*key)


US = 1_000  # SimPair.run advances the clock 1 us per step
CONFIG = {"read_timeout_ns": 20 * US, "cancel_grace_ns": 5 * US}


def test_a_peer_whose_cancelled_reads_never_stop_is_marked_stalled_and_later_requests_fail_fast() -> None:
    pair = SimPair(d_config=CONFIG, d_transport=DeafToCancels)
    cons = pair.cons
    assert isinstance(cons, DeafToCancels)
    pair.net.script("d1", 0, 0, ReadScript(end="hang"))  # the producer stops mid-read
    pair.d.load("d1", [5, 6], pair.p.request_finished("p1", [1, 2]))
    pair.run(3)
    recv, _, _ = pair.run(30)  # past the read deadline and the cancel's grace
    assert recv == [] and ("d1", 0, 0) in cons.reads  # still waiting for its own read to stop
    e = pair.d.core.engines[("P", 0)]
    attempt = e.attempt
    assert e.stalled and e.state.name == "CONNECTED"  # the connection is kept
    hung = [r for r in pair.d.core.log.records() if r.machine == "consumer" and isinstance(r.event, DeadlinePassed)]
    assert [r.state for r in hung] == ["FAILING", "FAILING"]  # the read deadline, then the cancel's grace

    # Later requests fail at once with their policy, reading nothing (no READ into the silence).
    pair.d.load("d2", [7, 8], pair.p.request_finished("p2", [3, 4]))
    recv, _, failed = pair.run(2)
    assert recv == ["d2"] and failed[0].policy == "recompute" and "cancel_grace_ns" in failed[0].reason
    assert ("d2", 0, 0) not in cons.reads and pair.invalid["d2"] == {7, 8}

    # The producer answers again: the hung read stops, d1 is reported once (its notice goes out
    # over the kept connection: the producer releases p1 now, not at its lease), and the next
    # request reads over the same connection.
    cons.wake()
    recv, sent, _ = pair.run(10)
    assert recv == ["d1"] and pair.invalid["d1"] == {5, 6} and "p1" in sent and not e.stalled
    pair.d.load("d4", [10], pair.p.request_finished("p4", [6]))
    recv, _, failed = pair.run(8)
    assert recv == ["d4"] and not failed and e.attempt == attempt


def test_a_cancel_that_lands_within_the_grace_leaves_the_connection_alone() -> None:
    """A read cancelled (its deadline, an abort) whose cancel lands: nothing says the peer is
    gone, so the connection stays and the next request reads over it without a handshake."""
    pair = SimPair(d_config=CONFIG)
    pair.net.script("d1", 0, 0, ReadScript(end="hang"))
    pair.d.load("d1", [5, 6], pair.p.request_finished("p1", [1, 2]))
    pair.run(3)
    pair.d.abort("d1")
    recv, _, _ = pair.run(30)
    assert recv == ["d1"]
    e = pair.d.core.engines[("P", 0)]
    assert not e.stalled
    attempt = e.attempt
    pair.d.load("d2", [7], pair.p.request_finished("p2", [3]))
    recv, _, failed = pair.run(6)
    assert recv == ["d2"] and not failed and e.attempt == attempt and e.state.name == "CONNECTED"


def test_a_replacement_producer_under_the_same_engine_id_is_reached_while_the_old_one_stays_stalled() -> None:
    """The old producer process is stopped for good (its hung read never stops) and a new one
    comes up under the same engine id, host and port. Its params contradict the stalled
    connection, whose eviction would wait for readers that never let go: every request for the
    replacement was refused (found by review, also over real NIXL). A stalled stage asked to be
    evicted is taken as lost instead: the first contradicting request fails, as any does, and
    the next ones handshake the replacement and read from it."""
    pair = SimPair(d_config=CONFIG, d_transport=DeafToCancels)
    pair.net.script("d1", 0, 0, ReadScript(end="hang"))
    pair.d.load("d1", [5, 6], pair.p.request_finished("p1", [1, 2]))
    pair.run(40)
    assert pair.d.core.engines[("P", 0)].stalled
    pair.prod = SimTransport(pair.net, "P-new")  # the old agent is not killed: it stays hung
    pair.prod.fill(range(64))
    pair.p = pair._producer(pair.prod)
    outcomes = []
    for i in range(3):
        pair.d.load(f"n{i}", [10 + i], pair.p.request_finished(f"q{i}", [10 + i]))
        recv, _, failed = pair.run(30)
        outcomes.append("failed" if failed else "received" if f"n{i}" in recv else "pending")
    assert outcomes == ["failed", "received", "received"]
    assert pair.cons.block(11) == pattern("P-new", 11, 64)
    assert pair.d.core.consumers["d1"].state.name == "FAILING"  # still waiting for its own read


def test_with_pp_the_stall_clears_when_its_own_connection_answers_though_another_stage_reconnected() -> None:
    """Producer PP 2: A's read of stage 1 hangs (stage 1 stalled); stage 0 is lost and handshaken
    again meanwhile. When the peer answers and A lets go, stage 1 was left stalled (its clearing
    compared the attempts of every stage, summed): every request failed fast for an idle hour
    (found by review). Each held stage's own attempt is compared now."""
    e = RankedEngines(1, 1, p_pp=2, d_config=CONFIG)
    d, dt = e.d[(0, 0)], e.dt[(0, 0)]
    deaf = [True]

    def cancel(rid: str, pp: int, tp: int) -> None:
        if not deaf[0]:
            SimTransport.cancel_read(dt, rid, pp, tp)

    dt.cancel_read = cancel  # type: ignore[method-assign,assignment]

    def hold(rid: str, blocks: list[int]) -> KVTransferParams:
        stamp = e.wall_clock(0)
        minted = {k: c.request_finished(rid, blocks, issued_wall_ns=stamp) for k, c in e.p.items()}
        return minted[(0, 0)]

    failed: dict[str, str] = {}

    def steps(n: int) -> list[str]:
        out: list[str] = []
        for _ in range(n):
            e.now += US
            for c in e.p.values():
                c.get_finished()
            out += sorted(d.get_finished()[1])
            failed.update({f.request_id: f.reason for f in d.last.failed})
        return out

    e.now = 10**12
    e.net.script("A", 1, 0, ReadScript(end="hang"))
    d.load("A", [5, 6], hold("pa", [1, 2]))
    steps(40)
    s0, s1 = d.core.engines[("P", 0)], d.core.engines[("P", 1)]
    assert s1.stalled and not s0.stalled
    d.core.submit(PeerDisconnected(source=Source.TRANSFER, t_ns=e.now, engine_id="P", pp_rank=0,
                                   attempt=s0.attempt, detail="link flap"))
    d.load("B", [7, 8], hold("pb", [3, 4]))
    assert steps(10) == ["B"] and "does not answer" in failed["B"] and s0.attempt == 2
    deaf[0] = False
    dt.cancel_read("A", 1, 0)
    assert steps(10) == ["A"] and not s1.stalled
    d.load("C", [10], hold("pc", [10]))
    assert steps(10) == ["C"] and "C" not in failed


@pytest.mark.parametrize("how", ["abort", "handshake-failed"])
def test_a_request_that_only_held_a_stalled_stage_does_not_clear_it(how: str) -> None:
    """Producer PP 2: X's read of stage 0 hangs (stage 0 stalled); A holds stage 0 while stage 1
    handshakes, posting nothing, and stops. A's let-go cleared the stall (its hold-time attempt
    matched) while X's read still hung, and the next request read into the silence (found by
    review). Only a reader of that connection clears it now."""
    core = make_core(read_timeout_ns=50 * US, cancel_grace_ns=5 * US)
    t = 1_000
    core.apply(read("X", remote_pp=2, t=t))
    for pp in (0, 1):
        core.apply(ev(HandshakeDone, t, engine_id="P", pp_rank=pp, attempt=1,
                      reply=reply("P", pp_rank=pp, pp_size=2)))
        core.apply(ev(PeerAdded, t, engine_id="P", pp_rank=pp, attempt=1))
    core.apply(ev(HandleDone, t, request_id="X", pp_rank=1, tp_rank=0))
    core.apply(ev(PeerDisconnected, t + 1, engine_id="P", pp_rank=1, attempt=1, detail="flap"))
    core.apply(read("A", remote_pp=2, blocks=(3, 4), t=t + 2))  # holds stage 0, waits for stage 1
    core.apply(ev(AbortRequested, t + 3, request_id="X"))
    tick(core, t + 20 * US)
    stage0 = core.engines[("P", 0)]
    assert stage0.stalled and core.consumers["A"].state.name == "HANDSHAKING"
    if how == "abort":
        core.apply(ev(AbortRequested, t + 21 * US, request_id="A"))
    else:
        core.apply(ev(HandshakeFailed, t + 21 * US, engine_id="P", pp_rank=1,
                      attempt=core.engines[("P", 1)].attempt, error="refused"))
    assert stage0.stalled  # X's read still hangs
    core.apply(read("B", remote_pp=2, blocks=(5, 6), t=t + 22 * US))
    assert core.consumers["B"].state.name == "FAILED" and "does not answer" in core.consumers["B"].error
