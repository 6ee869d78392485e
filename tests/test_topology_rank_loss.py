"""Topology under rank loss: heterogeneous TP, MLA, PP and per-rank failures, driven through Connectors
over the simulated network (deterministic: every step is a call, the clock a counter)."""

from __future__ import annotations

from helpers import RankedEngines

from pdfsm.connector import KVTransferParams
from pdfsm.events import SendFailed
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
