"""Topology under rank loss: heterogeneous TP, MLA, PP and per-rank failures, driven through Connectors
over the simulated network (deterministic: every step is a call, the clock a counter)."""

from __future__ import annotations

from helpers import RankedEngines, ev, handshake, make_core, read

from pdfsm.commands import DropPeer, SendNotification, StartHandshake
from pdfsm.connector import KVTransferParams
from pdfsm.events import HandleFailed, HandleFailure, PeerDisconnected, SendFailed
from pdfsm.topology import Layout, read_plan
from transports.sim import ReadScript

LEASE = 100_000_000_000  # 100 s: anything released by its lease in these tests waited 100 s


class World(RankedEngines):
    """Every producer and consumer worker as a Connector, with what each reported."""

    def __init__(self, p_tp: int, d_tp: int, *, mla: bool = False, p_pp: int = 1, d_pp: int = 1) -> None:
        super().__init__(p_tp, d_tp, mla=mla, p_pp=p_pp, d_pp=d_pp, block_bytes=64 * 8,
                         p_config={"lease_ns": LEASE, "strict": False}, d_config={"strict": False})
        self.p_tp, self.d_tp, self.mla, self.p_pp, self.d_pp = p_tp, d_tp, mla, p_pp, d_pp
        self.released: dict[tuple[int, int], list[tuple[str, bool]]] = {k: [] for k in self.p}
        self.recv: dict[tuple[int, int], list[str]] = {k: [] for k in self.d}
        self.failed: dict[tuple[int, int], dict[str, set[int]]] = {k: {} for k in self.d}
        self.invalid: dict[tuple[int, int], list[set[int]]] = {k: [] for k in self.d}

    def hold(self, rid: str, blocks: list[int]) -> KVTransferParams:
        """Every producer rank holds the request's blocks; rank (0, 0)'s params go to the router."""
        params = [c.request_finished(rid, blocks) for c in self.p.values()]
        return params[0]

    def sources(self, k: tuple[int, int]) -> list[tuple[int, int]]:
        plan = read_plan(Layout(self.d_tp, self.d_pp, k[1], k[0]), Layout(self.p_tp, self.p_pp), self.mla)
        return [(s.pp_rank, s.tp_rank) for s in plan.sources]

    def run(self, steps: int, dt: int = 1_000) -> None:
        for _ in range(steps):
            self.now += dt
            for k, c in self.d.items():
                got = c.get_finished()[1]
                self.recv[k] += sorted(got)
                for off in c.last.failed:
                    self.failed[k][off.request_id] = set(off.invalid_blocks)
                self.invalid[k].append(c.get_block_ids_with_load_errors())
            for k, c in self.p.items():
                for rid in sorted(c.get_finished()[0]):
                    self.released[k].append((rid, rid in c.last.expired))


# --- one producer TP rank lost while its siblings are alive -----------------------------------------


def test_a_stage_handshaken_again_under_a_live_ranks_read_lets_that_read_finish() -> None:
    """Decode TP 1 reads prefill TP 2. Prefill rank 0 dies while request B reads it: the stage's
    connection is lost (B fails). Request A had read rank 0 already and still reads the live rank
    1. A new request C then wants the stage: it is handshaken again, and the peer is dropped while
    A's read runs, uncancelled (a helper's hunt saw it; transports.md, the drop rule: a read over
    a dropped peer ends as it would have). A is received with the right bytes, C reads the
    revived rank, B's blocks are invalid."""
    w = World(p_tp=2, d_tp=1)
    d, dt = w.d[(0, 0)], w.dt[(0, 0)]
    pa, pb, pc = w.hold("pa", [1]), w.hold("pb", [2]), w.hold("pc", [3])
    w.net.script("ca", 0, 1, ReadScript(polls=30))  # A's read from the live rank: slow
    w.net.script("cb", 0, 0, ReadScript(polls=12))  # B's read from rank 0: in flight when it dies
    d.load("ca", [10], pa)
    d.load("cb", [11], pb)
    w.run(5)
    assert sorted(dt.reads) == [("ca", 0, 1), ("cb", 0, 0)]
    w.net.kill("P0.0")
    w.run(3)
    assert d.core.engines[("P", 0)].state.name == "DISCONNECTED" and d.core.consumers["ca"].state.name == "READING"
    w.net.revive("P0.0")
    d.load("cc", [12], pc)
    w.run(40)
    assert sorted(w.recv[(0, 0)]) == ["ca", "cb", "cc"] and set(w.failed[(0, 0)]) == {"cb"}
    assert w.failed[(0, 0)]["cb"] == {11}
    half = dt.block_bytes // 2
    for local, remote in ((10, 1), (12, 3)):
        got = dt.block(local)
        assert got[:half] == w.pt[(0, 0)].block(remote) and got[half:] == w.pt[(0, 1)].block(remote)
    assert not dt.reads


def test_decode_tp1_prefill_tp2_one_prefill_rank_lost_mid_read_the_live_rank_is_still_told() -> None:
    """Decode TP 1 reads prefill TP 2 (non-MLA: both ranks, each into its half of every block).
    Prefill rank 1's agent goes away mid-read (a NIC/UCX endpoint error or a crashed worker); its
    read ends DISCONNECTED, so the request fails and its read from the live rank 0 is cancelled.

    docs/decisions.md ("Failed and aborted consumer requests still notify the producer"): once
    every read has stopped, a failed request sends a notification to each producer rank it did not
    read, so the producer releases at once instead of waiting for its lease. Rank 0 is alive and
    its read was cancelled: it must be told. The connection is kept per (engine_id, pp_rank), and
    the loss of rank 1 ends it; it used to drop the peers of *every* TP rank of the stage at once,
    before the failed request notified, so the notification to rank 0 failed in the transport ("no
    peer") and rank 0 pinned the request's blocks for the whole lease (100 s here, 120 s by default).
    Now the drop waits for the stage's last reader to let go, after it has notified."""
    w = World(p_tp=2, d_tp=1)
    params = w.hold("p1", [3, 4])
    w.net.script("d1", 0, 0, ReadScript(polls=6))  # rank 0's read is still running when rank 1's fails
    w.net.script("d1", 0, 1, ReadScript(polls=3))
    w.d[(0, 0)].load("d1", [10, 11], params)
    w.run(3)  # handshake done, both reads posted
    assert sorted(k for k in w.dt[(0, 0)].reads) == [("d1", 0, 0), ("d1", 0, 1)]
    w.net.kill("P0.1")
    w.run(6)
    assert w.recv[(0, 0)] == ["d1"] and set(w.failed[(0, 0)]) == {"d1"}
    assert w.failed[(0, 0)]["d1"] == {10, 11}
    assert not w.dt[(0, 0)].reads  # nothing of ours reads prefill rank 0 any more
    sends = [r.event for r in w.d[(0, 0)].core.log.records() if isinstance(r.event, SendFailed)]
    assert w.released[(0, 0)] == [("p1", False)], (
        f"live prefill rank 0 was never told the failed request stopped reading (it waits for its lease); "
        f"send failures on the decode side: {[(s.tp_rank, s.error) for s in sends]}")


def test_mla_decode_tp1_prefill_tp4_read_rank_lost_the_skipped_live_ranks_are_still_told() -> None:
    """MLA, decode TP 1, prefill TP 4: the decode rank reads the replicated latent KV from prefill
    rank 0 only and owes ranks 1..3 a plain notification (vLLM PR 36958). Rank 0's agent goes away
    mid-read: the request fails (its blocks invalid), and ranks 1..3, alive and never read, are
    still told (docs/decisions.md: a failed request notifies each producer rank it did not read).
    Passes: the failed read is the request's last, so its notifications are emitted before the
    engine's peers are dropped (contrast the non-MLA test above, where a sibling read's cancel
    puts the notification after the drop)."""
    w = World(p_tp=4, d_tp=1, mla=True)
    params = w.hold("p1", [3, 4])
    w.net.script("d1", 0, 0, ReadScript(polls=4))
    w.d[(0, 0)].load("d1", [10, 11], params)
    w.run(3)
    assert sorted(w.dt[(0, 0)].reads) == [("d1", 0, 0)]
    w.net.kill("P0.0")
    w.run(6)
    assert w.recv[(0, 0)] == ["d1"] and w.failed[(0, 0)] == {"d1": {10, 11}}
    live = [(0, 1), (0, 2), (0, 3)]
    assert {k: w.released[k] for k in live} == {k: [("p1", False)] for k in live}, (
        "MLA's skipped prefill ranks, alive, were never told; they hold the blocks for their lease")


def test_a_stage_handshaken_again_for_a_newer_request_is_told_once_it_connects() -> None:
    """Decode TP 1 reads prefill TP 2. Prefill rank 1 is lost mid-read: the request d1 fails and
    waits for its cancelled read of the live rank 0 (NIXL's default cancel rule lets it run on).
    A newer request d2 for the same producer arrives meanwhile: its handshake of the stage pays the
    lost connection's owed drop, so when d1's last read ended, its release notice to rank 0 went to
    a transport with no peer ("no peer"), and rank 0 pinned the blocks until its lease (found by a
    helper's hunt, with MLA and PP too). Now the notice is owed to the stage while it handshakes,
    and sent once it connects (``send_owed``)."""
    core = make_core(strict=False)
    core.apply(read("d1", blocks=(10, 11), remote_blocks=(3, 4), remote_tp=2, lease_ns=LEASE, t=1))
    handshake(core, "P", tp_size=2, t=2)
    core.take_commands()
    core.apply(ev(HandleFailed, 3, request_id="d1", pp_rank=0, tp_rank=1, why=HandleFailure.DISCONNECTED))
    core.apply(ev(PeerDisconnected, 4, engine_id="P", pp_rank=0, attempt=1))
    core.apply(read("d2", blocks=(12, 13), remote_blocks=(5, 6), remote_tp=2, lease_ns=LEASE, t=5))
    cmds = core.take_commands()
    assert any(isinstance(c, DropPeer) for c in cmds) and any(isinstance(c, StartHandshake) for c in cmds)
    core.apply(ev(HandleFailed, 6, request_id="d1", pp_rank=0, tp_rank=0, why=HandleFailure.CANCELLED))
    assert core.consumers["d1"].state.name == "FAILED"
    notices = [c for c in core.take_commands() if isinstance(c, SendNotification)]
    assert notices == [], "a notice to a stage whose old peer is dropped and whose new one is not there yet"
    handshake(core, "P", tp_size=2, attempt=2, t=7)
    notices = [c for c in core.take_commands() if isinstance(c, SendNotification)]
    assert sorted((n.tp_rank, n.notification.request_id, n.notification.unread) for n in notices) == [
        (0, "p-d1", True), (1, "p-d1", True)]  # every rank it did not read, rank 1 (handshaken again) too


def test_a_heartbeat_one_decode_rank_failed_to_send_still_promises_its_part() -> None:
    """Decode TP 2 reads prefill TP 1: prefill rank 0 waits for a part from each decode rank. The
    scheduler heartbeats the queued request on every decode worker; rank 1's send raises once (a
    transient transport error), rank 0's reaches the producer, which extends the hold. Loaded past
    the params' lease, both ranks refuse the request; rank 1, holding no promise (one was kept only
    when every send went out), told the producer nothing, and prefill rank 0 held the blocks for
    the whole extension, then blamed the consumer (found by a helper's hunt). A send that raised
    counts as tried, like a heartbeat lost on the way: rank 1 tells it too, and it releases now."""
    w = World(p_tp=1, d_tp=2)
    warm = w.hold("warm", [1])
    for c in w.d.values():
        c.load("warm", [20], warm)
    w.run(6)
    assert all(w.recv[k] == ["warm"] for k in w.d)
    params = w.hold("p1", [3, 4])
    flaky = w.dt[(0, 1)]

    def refuse(*args: object) -> None:
        raise RuntimeError("transient: endpoint busy")

    real = flaky.send
    flaky.send = refuse  # type: ignore[method-assign,assignment]
    told = {k: c.heartbeat(params, extend_ns=6 * LEASE) for k, c in w.d.items()}
    flaky.send = real  # type: ignore[method-assign]
    assert told == {(0, 0): 1, (0, 1): 0}
    w.run(1)
    w.now += LEASE + LEASE // 2  # past the params' lease, well inside the extension
    for c in w.d.values():
        c.load("r", [10, 11], params)
    w.run(4)
    assert all("r" in w.failed[k] for k in w.d)  # refused: the lease the params gave is over
    assert ("p1", False) in w.released[(0, 0)], "prefill rank 0 waits out the extension for decode rank 1's part"
