"""The NIXL transport over real NIXL (UCX backend, host memory).

First several agents in this process (fast): Connector pairs moving blocks with the bytes
verified, heterogeneous TP both ways, MLA, PP 2 into PP 1 (regions paired by layer), and the
transport's rules one by one (layer ids in the metadata, no-PP refusals, a raising poll fails
the handle, the drop of a peer waits for its reads, the cancel rule, the thread guard). Then
producers in a second OS process (tests/nixl_peer.py): bytes verified, the producer released
only by the notification that rode on the READ, a cancelled read against a stopped peer, a
producer killed with SIGKILL while a READ is in flight, and a PP 2 x TP 2 producer engine
(four agents, a real side channel) read by a PP 1 consumer, then refused by a consumer whose
transport has no PP.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from transport_helpers import LOOPBACK, PeerProcess, StepRank, listening_addresses, random_kv, run_until, zero_kv

from pdfsm.commands import PostRead
from pdfsm.connector import Connector, KVTransferParams
from pdfsm.errors import InvalidInput
from pdfsm.events import (
    BadMessage,
    CoreConfig,
    Event,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeReply,
    Heartbeat,
    NotificationReceived,
    PeerDisconnected,
    RankInfo,
    SendFailed,
)
from pdfsm.sidechannel import SideChannelHandshaker
from pdfsm.topology import ReadSource
from pdfsm.wire import HeartbeatMessage, Notification
from transports.base import Handshaker, TransportError
from transports.layers import LayerError
from transports.nixl import (
    NixlRankMetadata,
    NixlRankMetadataV1,
    NixlTransport,
    RegionInfo,
    _make_agent,
    decode_rank_metadata,
    import_nixl,
    nixl_available,
)
from transports.sim import SimHandshaker, SimNetwork

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

if nixl_available():  # NIXL sets its "nixl" logger to INFO on stdout when imported
    logging.getLogger("nixl").setLevel(logging.WARNING)

ROOT = Path(__file__).resolve().parent.parent
_names = itertools.count()


def name(prefix: str) -> str:
    """Agent names unique in this process."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


class Rank(StepRank):
    """One worker: its KV tensors, NIXL transport and Connector."""

    def __init__(self, engine_id: str, net: SimNetwork, tp_rank: int, tp_size: int, kv: list[torch.Tensor],
                 *, mla: bool = False, host: str = "", pp_rank: int = 0, pp_size: int = 1,
                 handshaker: Handshaker | None = None, **kw: Any) -> None:
        super().__init__()
        self.kv = kv
        self.transport = NixlTransport(name(f"{engine_id}{pp_rank}.{tp_rank}"), kv, tp_rank=tp_rank, pp_rank=pp_rank,
                                       **kw)
        config = CoreConfig(engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                            mla=mla, strict=True)
        self.conn = Connector(config, self.transport, handshaker or SimHandshaker(net), host=host, port=1)


def engine(net: SimNetwork, engine_id: str, tp: int, blocks: int, block_bytes: int, *, fill: bool,
           mla: bool = False, regions: int = 2, **kw: Any) -> list[Rank]:
    host = f"{engine_id}-host"
    ranks = []
    for r in range(tp):
        seed = 100 * r + 7
        kv = random_kv(regions, blocks, block_bytes, seed) if fill else zero_kv(regions, blocks, block_bytes)
        ranks.append(Rank(engine_id, net, r, tp, kv, mla=mla, host=host, **kw))
    # Built when asked, from the list returned: a rank replaced in it is what the next handshake sees.
    net.serve(host, 1, lambda pp: HandshakeReply(engine_id=engine_id, compat_hash="", tp_size=tp, mla=mla,
                                                 num_blocks=blocks, ranks=tuple(rk.transport.rank_info()
                                                                                for rk in ranks)))
    return ranks


def close_all(ranks: list[Rank]) -> None:
    for rk in ranks:
        rk.conn.shutdown()


# --- Connector pairs in one process --------------------------------------------------------------


@pytest.mark.parametrize("xfer_mode", ["prepped", "descs"])
def test_connector_pair_moves_blocks(xfer_mode: str) -> None:
    net = SimNetwork()
    (p,) = engine(net, "P", 1, 48, 1024, fill=True, xfer_mode=xfer_mode)
    (d,) = engine(net, "D", 1, 48, 1024, fill=False, xfer_mode=xfer_mode)
    try:
        remote = [3, 4, 5, 6, 40, 41, 17, 2, 9]  # runs, a jump back, singles
        local = [10, 11, 12, 0, 1, 47, 30, 31]  # a partial prefix hit: the last 8 remote blocks
        params = p.conn.request_finished("req-p", remote)
        d.conn.load("req-d", local, params, computed_blocks=1)
        run_until([p, d], lambda: "req-d" in d.recving and "req-p" in p.sending)
        assert not d.conn.last.failed
        for k in range(2):
            assert torch.equal(d.kv[k][local], p.kv[k][remote[1:]])
        notes = p.events(NotificationReceived)
        assert [(n.request_id, n.part, n.of, n.sender) for n in notes] == [("req-p", 0, 1, d.transport.agent_name)]
        # A second request reuses the connection and the prepared lists.
        params = p.conn.request_finished("req-p2", [0, 1, 2, 3])
        d.conn.load("req-d2", [20, 21, 22, 23], params)
        run_until([p, d], lambda: "req-d2" in d.recving and "req-p2" in p.sending)
        assert torch.equal(d.kv[1][20:24], p.kv[1][0:4])
    finally:
        close_all([p, d])


def test_ucx_thread_pool_moves_blocks() -> None:
    """backend_params reach UCX: with a pool of 2 threads and split_batch_size 1, a read's
    descriptors are split across the threads (benchmarks/transport.py); the bytes still land."""
    net = SimNetwork()
    (p,) = engine(net, "P", 1, 32, 1024, fill=True, regions=4)
    (d,) = engine(net, "D", 1, 32, 1024, fill=False, regions=4, num_threads=2,
                  backend_params={"split_batch_size": "1"})
    try:
        remote, local = [*range(8, 20), 3, 30, 1], [*range(12), 31, 20, 21]
        params = p.conn.request_finished("rp", remote)
        d.conn.load("rd", local, params)
        run_until([p, d], lambda: "rd" in d.recving and "rp" in p.sending)
        assert not d.conn.last.failed
        for k in range(4):
            assert torch.equal(d.kv[k][local], p.kv[k][remote])
    finally:
        close_all([p, d])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the VRAM path needs one")
def test_vram_connector_pair_moves_blocks() -> None:
    """KV caches as CUDA tensors: registered as VRAM, read GPU to GPU, bytes verified."""
    net = SimNetwork()
    blocks, block_bytes = 32, 4096
    src = [t.cuda() for t in random_kv(2, blocks, block_bytes, seed=5)]
    dst = [t.cuda() for t in zero_kv(2, blocks, block_bytes)]
    p = Rank("P", net, 0, 1, src, host="P-host")
    d = Rank("D", net, 0, 1, dst, host="D-host")
    reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, num_blocks=blocks,
                           ranks=(p.transport.rank_info(),))
    net.serve("P-host", 1, lambda pp: reply)
    try:
        assert p.transport.capabilities.memory_kinds == frozenset({"DRAM", "VRAM"})
        remote, local = [4, 5, 6, 7, 30, 2], [0, 1, 2, 3, 9, 31]
        params = p.conn.request_finished("rp", remote)
        d.conn.load("rd", local, params)
        run_until([p, d], lambda: "rd" in d.recving and "rp" in p.sending)
        assert not d.conn.last.failed
        torch.cuda.synchronize()
        for k in range(2):
            assert torch.equal(d.kv[k][local].cpu(), p.kv[k][remote].cpu())
    finally:
        close_all([p, d])


def test_producer_tp2_consumer_tp1() -> None:
    # D rank 0 reads whole blocks from P ranks 0 and 1, each into its half of the local block.
    net = SimNetwork()
    ps = engine(net, "P", 2, 16, 512, fill=True)
    (d,) = engine(net, "D", 1, 16, 1024, fill=False)
    try:
        params = ps[0].conn.request_finished("r", [1, 2, 7])
        ps[1].conn.request_finished("r", [1, 2, 7])
        d.conn.load("rd", [4, 5, 6], params)
        run_until([*ps, d], lambda: "rd" in d.recving and all("r" in p.sending for p in ps))
        for k in range(2):
            assert torch.equal(d.kv[k][[4, 5, 6], :512], ps[0].kv[k][[1, 2, 7]])
            assert torch.equal(d.kv[k][[4, 5, 6], 512:], ps[1].kv[k][[1, 2, 7]])
    finally:
        close_all([*ps, d])


def test_producer_tp1_consumer_tp2() -> None:
    # Each D rank reads its half of every P block; P waits for both parts.
    net = SimNetwork()
    (p,) = engine(net, "P", 1, 16, 1024, fill=True)
    ds = engine(net, "D", 2, 16, 512, fill=False)
    try:
        params = p.conn.request_finished("r", [3, 8, 9])
        ds[0].conn.load("rd", [0, 1, 2], params)
        run_until([p, *ds], lambda: "rd" in ds[0].recving)
        assert "r" not in p.sending  # one part of two
        ds[1].conn.load("rd", [5, 6, 7], params)
        run_until([p, *ds], lambda: "rd" in ds[1].recving and "r" in p.sending)
        for k in range(2):
            assert torch.equal(ds[0].kv[k][[0, 1, 2]], p.kv[k][[3, 8, 9], :512])
            assert torch.equal(ds[1].kv[k][[5, 6, 7]], p.kv[k][[3, 8, 9], 512:])
        parts = sorted(n.part for n in p.events(NotificationReceived))
        assert parts == [0, 1]
    finally:
        close_all([p, *ds])


def test_producer_tp2_one_rank_gone_mid_read_the_live_rank_is_told_not_left_to_its_lease() -> None:
    """tests/test_topology_rank_loss.py's first case over real NIXL: decode TP 1 reads prefill
    TP 2. Prefill rank 1 shuts down (its agent is destroyed) after the connection is made; the
    next request's read from it ends DISCONNECTED, so the request fails and its read from the
    live rank 0 (32 MiB, still moving) is cancelled. Rank 0 must be released by a notification
    (its own read's, or the failed request's), not pinned for its 120 s lease: the stage's peer
    is dropped only after the failed request has notified."""
    net = SimNetwork()
    ps = engine(net, "P", 2, 64, 256 << 10, fill=True)
    (d,) = engine(net, "D", 1, 64, 512 << 10, fill=False)
    try:
        warm = ps[0].conn.request_finished("w", [0])
        ps[1].conn.request_finished("w", [0])
        d.conn.load("dw", [0], warm)
        run_until([*ps, d], lambda: "dw" in d.recving and all("w" in p.sending for p in ps))
        blocks = list(range(64))
        params = ps[0].conn.request_finished("r", blocks)
        ps[1].conn.request_finished("r", blocks)
        ps[1].conn.shutdown()
        time.sleep(0.2)  # the loss reaches the consumer's UCX endpoint
        d.conn.load("rd", blocks, params)
        run_until([ps[0], d], lambda: "rd" in d.recving, timeout=20)
        assert [h.request_id for h in d.conn.last.failed] == ["rd"], "rank 1's read cannot complete"
        run_until([ps[0], d], lambda: "r" in ps[0].sending, timeout=10)
        sends = [(e.tp_rank, e.error) for e in d.events(SendFailed) if e.tp_rank == 0]
        assert not sends, sends
    finally:
        close_all([ps[0], d])


def test_producer_tp2_rank_restarted_alone_fresh_params_read_it_stale_ones_fail_unread() -> None:
    """smg PR 2492 with one TP rank: prefill rank 1's agent is destroyed and a new one (another
    name, other bytes) takes its place at the same listener, rank 0 living on. Params minted
    before (the router held them 30 s: they were issued 30 s before the new rank started) name
    rank 0's unchanged incarnation; the new rank's handshake entry says when its transport
    started, so they fail before any read, and nothing of the successor's memory is loaded.
    The first fresh request meets the cached reply and fails (the old agent is gone); the next,
    handshaken again, reads the new rank's bytes."""
    net = SimNetwork()
    ps = engine(net, "P", 2, 16, 4096, fill=True)
    (d,) = engine(net, "D", 1, 16, 8192, fill=False)
    try:
        def hold(rid: str, blocks: list[int]) -> KVTransferParams:
            params = ps[0].conn.request_finished(rid, blocks)
            ps[1].conn.request_finished(rid, blocks)
            return params

        d.conn.load("dw", [0], hold("w", [0]))
        run_until([*ps, d], lambda: "dw" in d.recving and all("w" in p.sending for p in ps))
        stale = hold("old", [4, 5])
        stale = msgspec.structs.replace(stale, issued_wall_ns=stale.issued_wall_ns - 30_000_000_000)
        ps[1].conn.shutdown()
        ps[1] = Rank("P", net, 1, 2, random_kv(2, 16, 4096, 999), host="P-host")
        time.sleep(0.2)  # the loss reaches the consumer's UCX endpoint
        d.conn.load("d1", [2, 3], hold("new1", [2, 3]))
        run_until([*ps, d], lambda: "d1" in d.recving, timeout=20)
        d.conn.load("d2", [6, 7], hold("new2", [6, 7]))
        run_until([*ps, d], lambda: "d2" in d.recving, timeout=20)
        assert not d.conn.last.failed, d.conn.last.failed
        for k in range(2):
            assert torch.equal(d.kv[k][[6, 7], 4096:], ps[1].kv[k][[6, 7]])  # the new rank's bytes
        d.conn.load("d-stale", [8, 9], stale)
        run_until([*ps, d], lambda: "d-stale" in d.recving, timeout=20)
        (off,) = d.conn.last.failed
        assert off.request_id == "d-stale" and "started" in off.reason, off
        assert all(not d.kv[k][[8, 9]].any() for k in range(2)), "the successor's memory was loaded"
    finally:
        close_all([*ps, d])


def test_mla_reads_one_rank_and_notifies_the_other() -> None:
    net = SimNetwork()
    ps = engine(net, "P", 2, 16, 256, fill=True, mla=True)
    (d,) = engine(net, "D", 1, 16, 256, fill=False, mla=True)
    try:
        params = ps[0].conn.request_finished("r", [5, 6])
        ps[1].conn.request_finished("r", [5, 6])
        d.conn.load("rd", [0, 1], params)
        run_until([*ps, d], lambda: "rd" in d.recving and all("r" in p.sending for p in ps))
        for k in range(2):
            assert torch.equal(d.kv[k][[0, 1]], ps[0].kv[k][[5, 6]])
        # P1 was not read, but told with P's request id (vLLM PR 36958).
        assert [n.request_id for n in ps[1].events(NotificationReceived)] == ["r"]
    finally:
        close_all([*ps, d])


# --- pipeline parallelism in one process -----------------------------------------------------------


def pp_engine(net: SimNetwork, engine_id: str, *, pp: int, tp: int, layers: int, blocks: int, block_bytes: int,
              fill: bool, layer_order: Callable[[list[int]], list[int]] = list,
              **kw: Any) -> dict[tuple[int, int], Rank]:
    """``pp`` x ``tp`` ranks; PP rank ``p`` holds its contiguous share of ``layers`` layers (in
    the order ``layer_order`` gives), one region per layer, bytes unique to (rank, layer). The
    handshake for pp_rank ``p`` answers with PP rank ``p``'s TP ranks."""
    host, per = f"{engine_id}-host", layers // pp
    ranks: dict[tuple[int, int], Rank] = {}
    for p in range(pp):
        ids = layer_order(list(range(p * per, (p + 1) * per)))
        for t in range(tp):
            kv = ([random_kv(1, blocks, block_bytes, 1000 * p + 100 * t + x)[0] for x in ids] if fill
                  else zero_kv(len(ids), blocks, block_bytes))
            ranks[(p, t)] = Rank(engine_id, net, t, tp, kv, host=host, pp_rank=p, pp_size=pp, layers=ids, **kw)
    replies = {p: HandshakeReply(engine_id=engine_id, compat_hash="", tp_size=tp, pp_size=pp, num_blocks=blocks,
                                 ranks=tuple(ranks[(p, t)].transport.rank_info() for t in range(tp)))
               for p in range(pp)}
    net.serve(host, 1, lambda p: replies[p])
    return ranks


def layer_bytes(rank: Rank, layer: int) -> torch.Tensor:
    return rank.kv[rank.transport.layers.index(layer)]


@pytest.mark.parametrize("xfer_mode", ["prepped", "descs"])
def test_pp2_producer_into_pp1_consumer(xfer_mode: str) -> None:
    """Each PP rank's regions land in the consumer's regions of the same layers, though the
    consumer registered them in another order (the prepared path indexes that subset)."""
    net = SimNetwork()
    ps = pp_engine(net, "P", pp=2, tp=1, layers=4, blocks=16, block_bytes=512, fill=True, xfer_mode=xfer_mode)
    (d,) = pp_engine(net, "D", pp=1, tp=1, layers=4, blocks=16, block_bytes=512, fill=False,
                     layer_order=lambda ids: [2, 0, 3, 1], xfer_mode=xfer_mode).values()
    try:
        remote, local = [3, 4, 5, 11, 12], [0, 1, 2, 9, 8]
        params = [p.conn.request_finished("rp", remote) for p in ps.values()]
        d.conn.load("rd", local, params[0])
        run_until([*ps.values(), d], lambda: "rd" in d.recving and all("rp" in p.sending for p in ps.values()))
        assert not d.conn.last.failed
        for x in range(4):
            assert torch.equal(layer_bytes(d, x)[local], layer_bytes(ps[(x // 2, 0)], x)[remote]), x
        assert set(d.transport.peers) == {("P", 0), ("P", 1)}
    finally:
        close_all([*ps.values(), d])


def test_block_ids_past_the_cache_are_refused_up_front_and_a_read_setup_failure_is_reported() -> None:
    """The Connector knows its transport's block count: a block id past it is refused where it
    enters (InvalidInput naming it, nothing accepted). A transport that does not say its count
    leaves the id to the read, whose set-up failure is reported, not raised."""
    net = SimNetwork()
    (p,) = engine(net, "P", 1, 8, 256, fill=True)
    (d,) = engine(net, "D", 1, 8, 256, fill=False)
    try:
        assert d.transport.capabilities.num_blocks == 8
        with pytest.raises(InvalidInput, match=r"block_ids: block 99 is out of range: this worker's KV cache has 8"):
            p.conn.request_finished("r0", [1, 99])
        params = p.conn.request_finished("r", [1, 2])
        with pytest.raises(InvalidInput, match=r"local_block_ids: block 99 is out of range"):
            d.conn.load("rd", [0, 99], params)
        d.transport.capabilities = msgspec.structs.replace(d.transport.capabilities, num_blocks=0)
        d.conn.load("rd", [0, 99], params)  # nothing was accepted: the same id and params load again
        run_until([d], lambda: "rd" in d.recving)
        (failed,) = d.conn.last.failed
        assert failed.invalid_blocks == (0, 99)
        (ev,) = d.events(HandleFailed)
        assert ev.why is HandleFailure.SETUP and "99" in ev.detail
        # A remote block P does not have never reaches NIXL: P's handshake counted its blocks.
        forged = msgspec.structs.replace(p.conn.request_finished("r2", [1, 2]), remote_block_ids=(1, 99))
        d.conn.load("rd2", [0, 1], forged)
        run_until([d], lambda: "rd2" in d.recving)
        (failed,) = d.conn.last.failed
        assert "remote block 99 is out of range" in failed.reason and len(d.events(HandleFailed)) == 1
    finally:
        close_all([p, d])


def test_vllm_backport_issue_33_a_peer_nixl_forgot_is_handshaken_again_not_failed_for_ever() -> None:
    """https://github.com/wtdcode/vllm-backport/issues/33 -- after a UCX disconnect NIXL dropped the
    producer's agent ("metadata for remote agent ... not found", "genNotif: no specified or
    potential backend could send"), every later read raised NIXL_ERR_NOT_FOUND, the dead agent
    stayed registered, and only restarting both engines recovered. pdfsm treats NOT_FOUND from a
    post as the peer lost: that request fails with its policy (a remote fault), the engine is
    handshaken again, and the next requests read the right bytes."""
    net = SimNetwork()
    (p,) = engine(net, "P", 1, 8, 256, fill=True)
    (d,) = engine(net, "D", 1, 8, 256, fill=False)
    try:
        d.conn.load("a", [0], p.conn.request_finished("pa", [1]))
        run_until([p, d], lambda: "a" in d.recving)
        first = d.conn.core.engines[("P", 0)].attempt
        d.transport.agent.remove_remote_agent(d.transport.peers[("P", 0)][0].agent)  # NIXL forgets P
        d.conn.load("b", [1], p.conn.request_finished("pb", [2]))
        run_until([p, d], lambda: "b" in d.recving)
        (failed,) = d.conn.last.failed
        assert failed.policy == "recompute" and failed.invalid_blocks == (1,) and "NOT_FOUND" in failed.reason
        assert d.events(HandleFailed)[-1].why is HandleFailure.DISCONNECTED  # blamed on the peer
        for rid, blk in (("c", 2), ("e", 3)):
            d.conn.load(rid, [blk], p.conn.request_finished(f"p{rid}", [blk + 1]))
            run_until([p, d], lambda rid=rid: rid in d.recving and f"p{rid}" in p.sending)  # type: ignore[misc]
            assert not d.conn.last.failed and torch.equal(d.kv[0][blk], p.kv[0][blk + 1])
        assert d.conn.core.engines[("P", 0)].attempt > first  # handshaken again
    finally:
        close_all([p, d])


def test_a_notification_to_a_peer_nixl_forgot_reports_the_peer_lost(pair: Pair) -> None:
    """genNotif's NOT_FOUND (no backend knows the peer) is a lost peer, reported once, as a
    disconnect is; the send still raises, so the caller records the notification as not sent."""
    pair.d.agent.remove_remote_agent(pair.d.peers[("P", 0)][0].agent)
    for _ in range(2):
        with pytest.raises(Exception, match="NOT_FOUND"):
            pair.d.send(("P", 0), 0, Notification("p-x", 0, 1))
    (lost,) = [e for e in pair.d_events if isinstance(e, PeerDisconnected)]
    assert lost.engine_id == "P" and "NOT_FOUND" in lost.detail


# --- the transport's rules, driven directly ------------------------------------------------------


class Pair:
    """A producer and a consumer transport, the consumer connected to the producer."""

    def __init__(self, **kw: Any) -> None:
        self.p_kv = random_kv(2, 16, 256, seed=3)
        self.d_kv = zero_kv(2, 16, 256)
        self.p = NixlTransport(name("p"), self.p_kv)
        self.d = NixlTransport(name("d"), self.d_kv, **kw)
        self.p_events: list[Event] = []
        self.d_events: list[Event] = []
        self.p.bind(self.p_events.append, time.monotonic_ns)
        self.d.bind(self.d_events.append, time.monotonic_ns)
        self.reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(self.p.rank_info(),))
        self.d.add_peer(("P", 0), self.reply)

    def read(self, rid: str, local: tuple[int, ...] = (0, 1), remote: tuple[int, ...] = (4, 5)) -> PostRead:
        cmd = PostRead(rid, "P", ReadSource(0, 0), local, remote, Notification(f"p-{rid}", 0, 1))
        self.d.post_read(cmd)
        return cmd

    def outcomes(self) -> list[Event]:
        return [e for e in self.d_events if isinstance(e, (HandleDone, HandleFailed))]

    def pump(self, until: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out"
            self.d.progress()
            self.p.progress()

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    pr = Pair()
    yield pr
    pr.close()


def stuck(agent: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Make every poll of ``agent`` say PROC until the returned function is called."""
    real = agent.check_xfer_state
    monkeypatch.setattr(agent, "transfer", lambda h, *a: (agent.__class__.transfer(agent, h, *a), "PROC")[1])
    monkeypatch.setattr(agent, "check_xfer_state", lambda h: "PROC")

    def unstick() -> None:
        monkeypatch.setattr(agent, "check_xfer_state", real)

    return unstick


def test_a_reply_naming_one_agent_for_two_ranks_is_refused_and_adds_nothing(pair: Pair) -> None:
    """Two TP ranks on one agent: dropping the engine would remove the agent for the rank without
    reads while the other's read still ran (the rule of vLLM PR 54689)."""
    info = pair.p.rank_info()
    before = pair.d.peers[("P", 0)]
    reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=2,
                           ranks=(info, msgspec.structs.replace(info, tp_rank=1)))
    with pytest.raises(TransportError, match=r"names agent .* for two TP ranks"):
        pair.d.add_peer(("P", 0), reply)
    assert pair.d.peers[("P", 0)] is before  # all or nothing: the connection it had stays


def test_rank_metadata_must_register_the_blocks_its_reply_counts(pair: Pair) -> None:
    """The reply's count bounds what a consumer reads; metadata claiming another count is refused
    (a lying 2**24 made every read build a prepared list of gigabytes). 0 in the reply: not said."""
    before = pair.d.peers[("P", 0)]
    for said in (8, 1 << 24):
        with pytest.raises(TransportError, match=f"registers a region of 16 blocks; its engine's reply says {said}"):
            pair.d.add_peer(("P", 0), msgspec.structs.replace(pair.reply, num_blocks=said))
        assert pair.d.peers[("P", 0)] is before
    pair.d.add_peer(("P", 0), msgspec.structs.replace(pair.reply, num_blocks=16))


def test_a_raising_poll_whose_release_nixl_refuses_as_active_is_polled_until_it_ends(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """cancel_read's rule for a release NIXL refuses (REPOST_ACTIVE: still running, may still write)
    holds after a raising poll too: the read is not reported stopped until NIXL lets it go."""
    errors = import_nixl().nixlBind
    unstick = stuck(pair.d.agent, monkeypatch)
    pair.read("r")
    pair.d.cancel_read("r", 0, 0)
    handle = pair.d.reads[("r", 0, 0)].handle

    def backend_error(_: Any) -> str:
        raise errors.nixlBackendError("NIXL_ERR_BACKEND")

    def still_active(_: Any) -> None:
        raise errors.nixlRepostActiveError("NIXL_ERR_REPOST_ACTIVE")

    monkeypatch.setattr(pair.d.agent, "check_xfer_state", backend_error)
    monkeypatch.setattr(type(handle), "release", still_active)
    for _ in range(3):
        pair.d.progress()
    assert not pair.outcomes() and ("r", 0, 0) in pair.d.reads
    monkeypatch.undo()  # NIXL lets go: the next poll ends it
    unstick()
    pair.pump(lambda: bool(pair.outcomes()))
    assert [type(e) for e in pair.outcomes()] == [HandleDone] and not pair.d.reads


def test_a_read_ending_err_whose_release_nixl_refuses_as_active_is_kept_until_it_lets_go(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rule after a poll says ERR: a release refused as still active (GETs may still land)
    keeps the read, reported failed only once NIXL lets it go. It was reported at once, the refusal
    only logged, unlike the raising-poll and raising-transfer paths (found by review; NIXL 1.5.1
    refuses only while a request is in progress, so this is hardening)."""
    errors = import_nixl().nixlBind
    unstick = stuck(pair.d.agent, monkeypatch)
    pair.read("r")
    handle = pair.d.reads[("r", 0, 0)].handle

    def still_active(_: Any) -> None:
        raise errors.nixlRepostActiveError("NIXL_ERR_REPOST_ACTIVE")

    monkeypatch.setattr(pair.d.agent, "check_xfer_state", lambda h: "ERR")
    monkeypatch.setattr(type(handle), "release", still_active)
    for _ in range(3):
        pair.d.progress()
    assert not pair.outcomes() and pair.d.reads[("r", 0, 0)].held
    monkeypatch.undo()  # NIXL lets go: the next poll reports it
    unstick()
    pair.pump(lambda: bool(pair.outcomes()))
    (out,) = pair.outcomes()
    assert isinstance(out, HandleFailed) and out.why is HandleFailure.ERR and not pair.d.reads


def test_a_transfer_that_raises_while_nixl_refuses_its_release_as_active_is_polled_until_it_ends(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario: NIXL's `transfer()` raises part-way (UCX posts a READ's GETs one by one; a
    maintainer, ai-dynamo/nixl issue 2067: late writes are possible) and the release NIXL is asked
    for is refused as still active (REPOST_ACTIVE). Expected: the read is accepted and polled until
    NIXL lets it go, as for a cancel NIXL refuses; its blocks are never handed back while a GET may
    still write them (vLLM PRs 56104, 32255), and it then fails (RAISED) even if NIXL says DONE: some
    GETs may never have been posted. Before: post_read raised, the Connector reported a
    set-up failure at once and the local blocks went back to the scheduler for reuse."""
    errors = import_nixl().nixlBind
    agent = pair.d.agent

    def still_active(_: Any) -> None:
        raise errors.nixlRepostActiveError("NIXL_ERR_REPOST_ACTIVE")

    def raises_part_way(handle: Any, *args: Any) -> str:
        agent.__class__.transfer(agent, handle, *args)
        monkeypatch.setattr(type(handle), "release", still_active)
        raise errors.nixlBackendError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(agent, "transfer", raises_part_way)
    monkeypatch.setattr(agent, "check_xfer_state", lambda h: "PROC")
    pair.read("r")  # accepted: no TransportError
    for _ in range(3):
        pair.d.progress()
    assert not pair.outcomes() and pair.d.reads[("r", 0, 0)].held
    monkeypatch.undo()  # NIXL lets go: the next poll ends it, failed though NIXL says DONE (GETs may be missing)
    pair.pump(lambda: bool(pair.outcomes()))
    (out,) = pair.outcomes()
    assert isinstance(out, HandleFailed) and out.why is HandleFailure.RAISED and "NIXL_ERR_BACKEND" in out.detail
    assert not pair.d.reads


def test_a_producer_restarted_under_a_new_engine_id_keeping_its_agent_name_is_added(pair: Pair) -> None:
    """Scenario: engine P's rank (agent X) is gone while idle here; its process restarts as engine
    P2 with the same agent name X (agent names are often fixed per rank) and a later start time.
    Expected: P2 is added (NIXL knows one agent per name, so P's connection is let go and reported
    lost) and reads P2's bytes. Before: refused ("already serves ('P', 0)") until P was evicted as
    idle, an hour by default (found by review over two processes). Two live engines claiming one
    agent, with no later start time, stay refused."""
    agent = pair.p.agent_name
    p2_kv = random_kv(2, 16, 256, seed=11)
    p2 = NixlTransport(agent, p2_kv)
    try:
        info = p2.rank_info()
        stale = msgspec.structs.replace(info, started_wall_ns=pair.p.started_wall_ns)
        with pytest.raises(TransportError, match="already serves"):
            pair.d.add_peer(("P2", 0), HandshakeReply(engine_id="P2", compat_hash="", tp_size=1, ranks=(stale,)))
        pair.d.add_peer(("P2", 0), HandshakeReply(engine_id="P2", compat_hash="", tp_size=1, ranks=(info,)))
        (lost,) = [e for e in pair.d_events if isinstance(e, PeerDisconnected)]
        assert (lost.engine_id, lost.pp_rank) == ("P", 0) and ("P", 0) not in pair.d.peers
        cmd = PostRead("r", "P2", ReadSource(0, 0), (0, 1), (4, 5), Notification("p-r", 0, 1))
        pair.d.post_read(cmd)
        pair.pump(lambda: bool(pair.outcomes()))
        assert [type(e) for e in pair.outcomes()] == [HandleDone]
        assert all(torch.equal(pair.d_kv[k][0:2], p2_kv[k][4:6]) for k in range(2))
    finally:
        p2.close()


def test_rank_metadata_is_typed_msgpack(pair: Pair) -> None:
    info = pair.p.rank_info()
    meta = decode_rank_metadata(info.metadata)
    assert isinstance(meta, NixlRankMetadata) and meta.agent_metadata
    assert [(r.stride, r.num_blocks, r.kind) for r in meta.regions] == [(256, 16, "DRAM")] * 2
    assert meta.regions[0].base == pair.p_kv[0].data_ptr()
    assert b"pickle" not in info.metadata and not info.metadata.startswith(b"\x80")  # not a pickle stream
    with pytest.raises(TransportError, match="bad rank metadata"):
        decode_rank_metadata(b"\x80\x04garbage")
    with pytest.raises(TransportError, match="exceeds the cap"):
        decode_rank_metadata(b"\x00" * (2 << 20))
    bad = msgspec.msgpack.encode(NixlRankMetadata(b"x", (RegionInfo(0, 256, 16, 0, "DRAM"),)))
    with pytest.raises(TransportError, match="malformed"):
        decode_rank_metadata(bad)
    none = msgspec.msgpack.encode(NixlRankMetadata(b"x", ()))
    with pytest.raises(TransportError, match="no KV region"):
        decode_rank_metadata(none)


def test_layer_ids_in_metadata(pair: Pair) -> None:
    """nixl/2 carries a layer id per region; nixl/1 (none) still decodes, by position; an old
    reader refuses nixl/2 instead of silently dropping the layer ids."""
    meta = decode_rank_metadata(pair.p.rank_info().metadata)
    assert [r.layer for r in meta.regions] == [0, 1]
    agent = meta.agent_metadata
    old = msgspec.msgpack.encode(NixlRankMetadataV1(agent, tuple(
        msgspec.structs.replace(r, layer=None) for r in meta.regions)))
    assert b"nixl/1" in old
    assert decode_rank_metadata(old) == meta
    with pytest.raises(msgspec.ValidationError, match="nixl/2"):
        msgspec.msgpack.decode(pair.p.rank_info().metadata, type=NixlRankMetadataV1)
    r0, r1 = meta.regions
    for regions, match in (((r0, msgspec.structs.replace(r1, layer=0)), "repeat"),
                           ((r0, msgspec.structs.replace(r1, layer=None)), "some regions only"),
                           ((r0, msgspec.structs.replace(r1, layer=-3)), "ints in")):
        with pytest.raises(LayerError, match=match):
            decode_rank_metadata(msgspec.msgpack.encode(NixlRankMetadata(agent, regions)))
    with pytest.raises(LayerError, match="repeat"):
        NixlTransport(name("x"), zero_kv(2, 4, 64), layers=[5, 5])


def test_transport_without_pp_refuses_pp_ranks(pair: Pair) -> None:
    with pytest.raises(ValueError, match="supports_pp=False"):
        NixlTransport(name("x"), zero_kv(1, 4, 64), pp_rank=1, supports_pp=False)
    p1 = NixlTransport(name("p1"), random_kv(2, 16, 256, seed=4), pp_rank=1, layers=[0, 1])
    d = NixlTransport(name("d"), zero_kv(2, 16, 256), supports_pp=False)
    try:
        d.bind(lambda ev: None, time.monotonic_ns)
        reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, pp_size=2, ranks=(p1.rank_info(),))
        with pytest.raises(TransportError, match="does not support pipeline parallelism"):
            d.add_peer(("P", 1), reply)
        assert not d.peers
        with pytest.raises(TransportError, match="does not support pipeline parallelism"):
            d.post_read(PostRead("x", "P", ReadSource(1, 0), (0,), (0,), Notification("x", 0, 1)))
        with pytest.raises(TransportError, match="does not support pipeline parallelism"):
            d.send(("P", 1), 0, HeartbeatMessage("x", 1))
        d.add_peer(("P", 0), pair.reply)  # pp_rank 0 is fine
    finally:
        d.close()
        p1.close()


def test_add_peer_refuses_bad_replies(pair: Pair) -> None:
    info = pair.p.rank_info()
    other = NixlTransport(name("o"), zero_kv(2, 4, 64))
    short = NixlTransport(name("s"), zero_kv(1, 4, 64))  # holds layer 0 only
    try:
        with pytest.raises(LayerError, match="holds layers 1 that this rank does not"):
            short.add_peer(("P", 0), pair.reply)
        assert not short.peers
        with pytest.raises(TransportError, match="no rank at pp_rank"):
            other.add_peer(("P", 1), pair.reply)
        wrong = RankInfo(pp_rank=0, tp_rank=0, agent="someone-else", metadata=info.metadata)
        with pytest.raises(TransportError, match="names agent"):
            other.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(wrong,)))
        assert not other.peers
        garbage = RankInfo(pp_rank=0, tp_rank=0, agent="x", metadata=b"\x93\x01\x02")
        with pytest.raises(TransportError):
            other.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(garbage,)))
        other.add_peer(("P", 0), pair.reply)  # the failed attempts left nothing behind
    finally:
        other.close()
        short.close()


def test_read_and_notification(pair: Pair) -> None:
    pair.read("a", (0, 1, 2), (7, 8, 9))
    pair.pump(lambda: bool(pair.outcomes()) and bool(pair.p_events))
    assert pair.outcomes() == [HandleDone(source="transfer", t_ns=pair.outcomes()[0].t_ns, request_id="a",
                                          pp_rank=0, tp_rank=0)]
    for k in range(2):
        assert torch.equal(pair.d_kv[k][0:3], pair.p_kv[k][7:10])
    (note,) = pair.p_events
    assert isinstance(note, NotificationReceived) and note.request_id == "p-a"
    assert not pair.d.reads
    with pytest.raises(TransportError, match="outside"):
        pair.read("b", (0,), (16,))
    with pytest.raises(TransportError, match="no peer"):
        pair.d.post_read(PostRead("c", "Q", ReadSource(0, 0), (0,), (0,), Notification("x", 0, 1)))


def test_send_heartbeat_and_bad_bytes(pair: Pair) -> None:
    pair.d.send(("P", 0), 0, HeartbeatMessage("p-r", 5_000_000_000))
    pair.d.agent.send_notif(pair.p.agent_name, b"\xc1 not msgpack")
    pair.pump(lambda: len(pair.p_events) >= 2)
    beat, bad = pair.p_events
    assert isinstance(beat, Heartbeat) and beat.extend_ns == 5_000_000_000 and beat.sender == pair.d.agent_name
    assert isinstance(bad, BadMessage) and bad.sender == pair.d.agent_name
    with pytest.raises(TransportError, match="no peer"):
        pair.d.send(("P", 0), 1, HeartbeatMessage("p-r", 1))


def test_zero_blocks_is_a_notification(pair: Pair) -> None:
    pair.read("z", (), ())
    pair.pump(lambda: bool(pair.outcomes()) and bool(pair.p_events))
    assert isinstance(pair.outcomes()[0], HandleDone)
    assert isinstance(pair.p_events[0], NotificationReceived)


def test_a_raising_poll_fails_the_handle(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM PR 28120: an exception from polling fails the handle; it never escapes."""
    stuck(pair.d.agent, monkeypatch)

    def boom(handle: Any) -> str:
        raise RuntimeError("poll exploded")

    pair.read("r")
    monkeypatch.setattr(pair.d.agent, "check_xfer_state", boom)
    pair.d.progress()  # does not raise
    (ev,) = pair.outcomes()
    assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.RAISED and "poll exploded" in ev.detail
    assert not pair.d.reads


def test_err_state_fails_the_handle(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    stuck(pair.d.agent, monkeypatch)
    pair.read("r")
    monkeypatch.setattr(pair.d.agent, "check_xfer_state", lambda h: "ERR")
    pair.d.progress()
    (ev,) = pair.outcomes()
    assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.ERR


def test_drop_peer_waits_for_reads_in_flight(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM PR 54689: a peer is never torn down under a READ."""
    removed: list[str] = []
    real_remove = pair.d.agent.remove_remote_agent

    def spy(agent_name: str) -> None:
        removed.append(agent_name)
        real_remove(agent_name)

    monkeypatch.setattr(pair.d.agent, "remove_remote_agent", spy)
    unstick = stuck(pair.d.agent, monkeypatch)
    pair.read("r")
    pair.d.drop_peer(("P", 0))
    pair.d.progress()
    assert removed == [] and pair.d.reads  # draining: the read is alive
    with pytest.raises(TransportError, match="no peer"):
        pair.read("s")  # but nothing new may start
    with pytest.raises(TransportError, match="draining"):
        pair.d.add_peer(("P", 0), pair.reply)  # nor may it come back while draining
    unstick()
    pair.pump(lambda: bool(pair.outcomes()))
    assert isinstance(pair.outcomes()[0], HandleDone)
    assert removed == [pair.p.agent_name]
    pair.d.add_peer(("P", 0), pair.reply)  # drained: it may be added again
    pair.read("t")
    pair.pump(lambda: len(pair.outcomes()) == 2)
    assert isinstance(pair.outcomes()[1], HandleDone)


def test_cancel_waits_until_the_transfer_ended(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    unstick = stuck(pair.d.agent, monkeypatch)
    pair.read("r")
    pair.d.cancel_read("r", 0, 0)
    for _ in range(20):
        pair.d.progress()
    assert pair.outcomes() == []  # NIXL still says PROC: not surely stopped, not reported
    unstick()
    pair.pump(lambda: bool(pair.outcomes()))
    # It completed after all: the bytes are in place and the producer was notified.
    assert isinstance(pair.outcomes()[0], HandleDone)
    # One that ends in error after a cancel is reported CANCELLED.
    stuck(pair.d.agent, monkeypatch)
    pair.read("s")
    pair.d.cancel_read("s", 0, 0)
    pair.d.cancel_read("s", 0, 0)  # twice is harmless
    monkeypatch.setattr(pair.d.agent, "check_xfer_state", lambda h: "ERR")
    pair.d.progress()
    ev = pair.outcomes()[1]
    assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.CANCELLED
    pair.d.cancel_read("s", 0, 0)  # after the end: nothing
    pair.d.cancel_read("unknown", 0, 0)
    assert len(pair.outcomes()) == 2


def test_release_policy_is_refused_with_the_ucx_thread_pool() -> None:
    """NIXL's UCX thread pool splits a READ into chunks whose release does not stop them: the
    "release" cancel rule would report CANCELLED while the pool still writes the blocks. So
    it needs num_threads=0, and a bad thread count is named."""
    kv = zero_kv(1, 4, 256)
    with pytest.raises(ValueError, match="cancel_policy 'release' needs num_threads=0"):
        NixlTransport(name("r"), kv, cancel_policy="release", num_threads=4)
    with pytest.raises(ValueError, match="cancel_policy 'release' needs num_threads=0 \\(got 2\\)"):
        NixlTransport(name("r"), kv, cancel_policy="release", backend_params={"num_threads": "2"})
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="num_threads must be an int from 0 to 64"):
            NixlTransport(name("r"), kv, num_threads=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"backend_params\['num_threads'\] must be a count"):
        NixlTransport(name("r"), kv, backend_params={"num_threads": "four"})


def test_the_pool_splits_at_its_own_thread_count_unless_told() -> None:
    """NIXL's split_batch_size defaults to 1024 descriptors, which a coalesced read never has: the
    transport sets it to the thread count; backend_params say otherwise; no pool, no split."""
    made: list[dict[str, str]] = []

    class Agent:
        def create_backend(self, backend: str, init: dict[str, str]) -> None:
            made.append(dict(init))

    api = types.ModuleType("fake_nixl")  # what _make_agent uses of NIXL's Python API
    setattr(api, "nixl_agent_config", lambda **kw: None)  # noqa: B010 - a module's attribute, typed Any
    setattr(api, "nixl_agent", lambda name, conf: Agent())  # noqa: B010
    _make_agent(api, "a", progress_thread=False, delay_us=None, backends=["UCX"], num_threads=4, params={})
    _make_agent(api, "b", progress_thread=False, delay_us=None, backends=["UCX"], num_threads=4,
                params={"split_batch_size": "64"})
    _make_agent(api, "c", progress_thread=False, delay_us=None, backends=["UCX"], num_threads=0, params={})
    assert made == [{"num_threads": "4", "split_batch_size": "4"}, {"num_threads": "4", "split_batch_size": "64"},
                    {}]


def test_cancel_release_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    pr = Pair(cancel_policy="release")
    try:
        stuck(pr.d.agent, monkeypatch)
        pr.read("r")
        pr.d.cancel_read("r", 0, 0)
        (ev,) = pr.outcomes()  # NIXL accepted the release: reported at once
        assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.CANCELLED
        assert not pr.d.reads

        def refuse(handle: Any) -> None:
            raise RuntimeError("cannot cancel")

        pr.read("s")
        monkeypatch.setattr(pr.d.agent, "release_xfer_handle", refuse)
        pr.d.cancel_read("s", 0, 0)
        assert len(pr.outcomes()) == 1 and pr.d.reads  # NIXL refused: still polled
        monkeypatch.setattr(pr.d.agent, "check_xfer_state", lambda h: "DONE")
        pr.d.progress()
        assert isinstance(pr.outcomes()[1], HandleDone)
    finally:
        monkeypatch.undo()
        pr.close()


def test_calls_from_another_thread_are_refused(pair: Pair) -> None:
    """SGLang PR 28897: NIXL agent calls from two threads; here they cannot happen."""
    errors: list[BaseException] = []
    infos: list[RankInfo] = []

    def other() -> None:
        infos.append(pair.d.rank_info())  # no NIXL call: allowed
        for call in (pair.d.progress, lambda: pair.read("x"), lambda: pair.d.drop_peer(("P", 0))):
            try:
                call()
            except TransportError as exc:
                errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 3 and all("not thread-safe" in str(e) for e in errors)
    assert infos and infos[0].agent == pair.d.agent_name
    assert pair.d.peers  # nothing happened
    # It says so, and a Connector refuses other threads before any call reaches it
    # (tests/test_connector_adapter_faults.py).
    assert pair.d.capabilities.thread_bound


def test_close_reports_reads_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    pr = Pair()
    stuck(pr.d.agent, monkeypatch)
    pr.read("r")
    pr.d.close()
    (ev,) = pr.outcomes()
    assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.CANCELLED
    pr.d.progress()  # a no-op once closed
    pr.d.drop_peer(("P", 0))  # too: an eviction owed until Connector.shutdown's last step lands here
    with pytest.raises(TransportError, match="closed"):
        pr.read("s")
    pr.d.close()
    monkeypatch.undo()
    pr.p.close()


def test_progress_thread_does_not_spin() -> None:
    """NIXL's own default progress thread spins on a core; ours sleeps 100 us between rounds."""
    import resource

    t = NixlTransport(name("idle"), zero_kv(1, 4, 64))
    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.5)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        assert cpu < 0.25, f"{cpu:.2f} s of CPU in 0.5 s idle"
    finally:
        t.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux /proc")
def test_ucx_listens_on_loopback_only_by_default() -> None:
    """UCX opens a listening socket on every network device unless told; the transport limits
    it to loopback (the configured interface) by default, like the side channel."""
    before = listening_addresses()
    t = NixlTransport(name("lo"), zero_kv(1, 4, 64))
    try:
        opened = {addr for inode, addr in listening_addresses().items() if inode not in before}
        assert opened and opened <= LOOPBACK, opened
    finally:
        t.close()


def test_capabilities_and_bad_tensors() -> None:
    t = NixlTransport(name("c"), zero_kv(1, 4, 64), supports_pp=False)
    try:
        assert t.capabilities.name == "nixl" and not t.capabilities.supports_pp
        assert t.capabilities.memory_kinds == frozenset({"DRAM"})
    finally:
        t.close()
    with pytest.raises(ValueError, match="contiguous"):
        NixlTransport(name("c"), [torch.zeros(8, 4, dtype=torch.uint8).t()])
    with pytest.raises(ValueError, match="num_blocks"):
        NixlTransport(name("c"), [torch.zeros(4, 8), torch.zeros(5, 8)])
    with pytest.raises(ValueError, match="at least one"):
        NixlTransport(name("c"), [])


# --- a producer in another OS process --------------------------------------------------------------


class Peer(PeerProcess):
    """tests/nixl_peer.py in a subprocess, as the producer engine (every rank of it with --all-ranks)."""

    def __init__(self, blocks: int, block_bytes: int, regions: int = 2, seed: int = 1, *extra: str) -> None:
        super().__init__(name("peer"), blocks, block_bytes, *extra, regions=regions, seed=seed)
        with self._cv:
            self.infos = [msgspec.msgpack.decode(bytes.fromhex(line.split()[1]), type=RankInfo)
                          for line in self.lines if line.startswith("RANK ")]
        self.info = self.infos[0]
        self.port = int(self.wait_for("SIDECHANNEL ").split()[1]) if "--sidechannel" in extra else 1

    def hold(self, rid: str, blocks: list[int], *, host: str = "peer", tp_size: int = 1,
             pp_size: int = 1) -> KVTransferParams:
        self.send(f"HOLD {rid} {','.join(map(str, blocks))}")
        self.wait_for(f"HELD {rid}")
        return KVTransferParams(lease_ns=60_000_000_000, remote_engine_id="P", remote_request_id=rid, remote_host=host,
                                remote_port=self.port, remote_block_ids=tuple(blocks), remote_tp_size=tp_size,
                                remote_pp_size=pp_size)


def consumer_of(peer: Peer, blocks: int, block_bytes: int, regions: int = 2, **kw: Any) -> Rank:
    net = SimNetwork()
    net.serve("peer", 1, lambda pp: HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(peer.info,)))
    return Rank("D", net, 0, 1, zero_kv(regions, blocks, block_bytes), **kw)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    pr = Peer(64, 4096)
    yield pr
    pr.stop()


def expected_regions(seed: int, regions: int, blocks: int, block_bytes: int) -> list[torch.Tensor]:
    """What tests/nixl_peer.py's fill_pattern wrote (same generator, same seeds)."""
    out = []
    for k in range(regions):
        gen = torch.Generator().manual_seed(seed + k)
        out.append(torch.randint(0, 256, (blocks * block_bytes,), dtype=torch.uint8, generator=gen)
                   .view(blocks, block_bytes))
    return out


def test_two_processes_bytes_verified(peer: Peer) -> None:
    d = consumer_of(peer, 64, 4096)
    try:
        remote = [*range(10, 40), 3, 2, 1, 63]
        local = [*range(30), 50, 51, 52, 60]
        params = peer.hold("two-1", remote)
        assert not peer.has("RELEASED two-1")
        d.conn.load("rd", local, params)
        run_until([d], lambda: "rd" in d.recving)
        assert not d.conn.last.failed
        expected = expected_regions(1, 2, 64, 4096)
        for k in range(2):
            assert torch.equal(d.kv[k][local], expected[k][remote])
        # The notification rode on the READ: the producer released only now.
        assert peer.wait_for(f"NOTE {d.transport.agent_name} two-1").split()[3:5] == ["0", "1"]
        peer.wait_for("RELEASED two-1")
    finally:
        d.conn.shutdown()


def test_two_processes_cancel_against_a_stopped_peer(peer: Peer) -> None:
    """A stopped producer leaves the READ in PROC: under the "wait" rule the aborted request
    keeps its blocks until the READ ended; under "release" NIXL cancels it at once."""
    wait = consumer_of(peer, 64, 4096)
    release = consumer_of(peer, 64, 4096, cancel_policy="release")
    try:
        p1, p2 = peer.hold("two-2", [1, 2, 3]), peer.hold("two-3", [4, 5, 6])
        os.kill(peer.proc.pid, signal.SIGSTOP)
        try:
            wait.conn.load("w", [0, 1, 2], p1)
            release.conn.load("r", [0, 1, 2], p2)
            run_until([wait, release], lambda: bool(wait.transport.reads) and bool(release.transport.reads))
            wait.conn.abort("w")
            release.conn.abort("r")
            run_until([release], lambda: "r" in release.recving)
            assert release.conn.last.aborted == frozenset({"r"})
            (ev,) = release.events(HandleFailed)
            assert ev.why is HandleFailure.CANCELLED
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                wait.step()
            assert "w" not in wait.recving and wait.transport.reads  # still in flight: blocks held
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        run_until([wait], lambda: "w" in wait.recving)
        assert wait.conn.last.aborted == frozenset({"w"})
        assert wait.events(HandleDone)  # it completed once the peer resumed
    finally:
        wait.conn.shutdown()
        release.conn.shutdown()


def test_two_processes_producer_killed_mid_transfer() -> None:
    killed = Peer(256, 65536, seed=5)  # 2 x 16 MiB
    d = consumer_of(killed, 256, 65536)
    try:
        params = killed.hold("k", list(range(256)))
        os.kill(killed.proc.pid, signal.SIGSTOP)  # the READ cannot complete while it is stopped
        d.conn.load("rd", list(range(256)), params)
        run_until([d], lambda: bool(d.transport.reads))
        d.step()
        assert next(iter(d.transport.reads.values())).state == "PROC"
        os.kill(killed.proc.pid, signal.SIGKILL)
        run_until([d], lambda: "rd" in d.recving)
        (failed,) = d.conn.last.failed
        assert set(failed.invalid_blocks) == set(range(256))
        (ev,) = d.events(HandleFailed)
        assert ev.why in (HandleFailure.DISCONNECTED, HandleFailure.RAISED)
        if ev.why is HandleFailure.DISCONNECTED:
            assert d.events(PeerDisconnected)
        assert not d.transport.reads
    finally:
        d.conn.shutdown()
        killed.proc.wait(10)
    assert killed.proc.returncode == -signal.SIGKILL


# --- pipeline parallelism across two OS processes ----------------------------------------------------

PP_LAYERS, PP_BLOCKS, PP_BLOCK_BYTES = 4, 32, 2048  # per producer rank; the consumer's blocks are 2x wider


def region_bytes(seed: int, layer: int, pp_rank: int, tp_rank: int, blocks: int, block_bytes: int) -> torch.Tensor:
    """What tests/nixl_peer.py wrote into rank (pp_rank, tp_rank)'s region of ``layer``
    (its region_seed: bytes unique to rank and layer)."""
    return expected_regions(seed + 10000 * pp_rank + 1000 * tp_rank + layer, 1, blocks, block_bytes)[0]


@pytest.fixture(scope="module")
def pp_peer() -> Iterator[Peer]:
    """A producer engine with PP 2 and TP 2 in one other process: four NIXL agents, PP rank p
    holding layers 2p and 2p+1, handshakes answered on a real side channel."""
    pr = Peer(PP_BLOCKS, PP_BLOCK_BYTES, PP_LAYERS, 3, "--all-ranks", "--pp-size", "2", "--tp-size", "2",
              "--sidechannel")
    yield pr
    pr.stop()


def test_two_processes_pp2_tp2_into_pp1_tp1(pp_peer: Peer) -> None:
    """A PP-1 TP-1 consumer reads all four producer ranks: each layer from the PP rank that
    holds it, each TP rank's blocks into its half of the consumer's (wider) blocks; both PP
    engines handshaken over the side channel, each reply keyed (pp_rank, tp_rank) with the TP
    ranks of its own PP rank; every producer rank released by its notification."""
    d = Rank("D", SimNetwork(), 0, 1, zero_kv(PP_LAYERS, PP_BLOCKS, 2 * PP_BLOCK_BYTES), layers=[3, 1, 0, 2],
             handshaker=SideChannelHandshaker("D"))
    try:
        remote = [*range(4, 20), 31, 0, 2]
        local = [*range(10, 26), 1, 3, 30]
        params = pp_peer.hold("pp-1", remote, host="127.0.0.1", tp_size=2, pp_size=2)
        d.conn.load("rd", local, params)
        run_until([d], lambda: "rd" in d.recving, timeout=30)
        assert not d.conn.last.failed
        for x in range(PP_LAYERS):
            pp = x // 2  # the PP rank holding layer x
            for tp in range(2):
                want = region_bytes(3, x, pp, tp, PP_BLOCKS, PP_BLOCK_BYTES)[remote]
                got = layer_bytes(d, x)[local, tp * PP_BLOCK_BYTES:(tp + 1) * PP_BLOCK_BYTES]
                assert torch.equal(got, want), (x, pp, tp)
        agents = {(i.pp_rank, i.tp_rank): i.agent for i in pp_peer.infos}
        assert len(agents) == 4
        dones = d.events(HandshakeDone)
        assert sorted(ev.pp_rank for ev in dones) == [0, 1]
        for ev in dones:
            assert ev.reply.pp_size == 2 and ev.reply.tp_size == 2
            assert [(r.pp_rank, r.tp_rank, r.agent) for r in ev.reply.ranks] == [
                (ev.pp_rank, t, agents[(ev.pp_rank, t)]) for t in range(2)]
        assert {key: {t: peer.agent for t, peer in ranks.items()} for key, ranks in d.transport.peers.items()} == {
            ("P", pp): {t: agents[(pp, t)] for t in range(2)} for pp in range(2)}
        for pp in range(2):
            for tp in range(2):
                pp_peer.wait_for(f"RELEASED pp-1 {pp} {tp}")
                note = pp_peer.wait_for(f"NOTE {d.transport.agent_name} pp-1 0 1 {pp} {tp}")
                assert note
    finally:
        d.conn.shutdown()


def test_two_processes_pp_request_to_a_transport_without_pp(pp_peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same request against a consumer whose transport says supports_pp=False: it fails in
    the first step, with the recompute policy; the transport is never asked for anything (no
    handshake, no peer, no read); the producer is not told, and holds its blocks (its lease
    releases them)."""
    d = Rank("D", SimNetwork(), 0, 1, zero_kv(PP_LAYERS, PP_BLOCKS, 2 * PP_BLOCK_BYTES), supports_pp=False,
             handshaker=SideChannelHandshaker("D"))
    calls: list[str] = []
    for method in ("add_peer", "post_read", "send", "cancel_read", "drop_peer"):
        monkeypatch.setattr(d.transport, method, lambda *a, m=method: calls.append(m))
    try:
        assert not d.conn.config.supports_pp
        params = pp_peer.hold("pp-2", [1, 2, 3], host="127.0.0.1", tp_size=2, pp_size=2)
        d.conn.load("rd", [4, 5, 6], params)
        d.step()
        assert d.recving == {"rd"}
        (failed,) = d.conn.last.failed
        assert failed.policy == "recompute" and "PP" in failed.reason
        assert set(failed.invalid_blocks) == {4, 5, 6}
        assert calls == [] and not d.events(HandshakeDone)
        assert not any(t.any() for t in d.kv)
        time.sleep(0.2)
        assert not pp_peer.has("RELEASED pp-2") and not pp_peer.has(f"NOTE {d.transport.agent_name}")
    finally:
        monkeypatch.undo()
        d.conn.shutdown()
