"""The torch transport: in-process copies by worker threads that submit their own outcomes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
from transport_helpers import StepRank, random_kv, run_until, zero_kv

from pdfsm.commands import PostRead
from pdfsm.connector import Connector, KVTransferParams
from pdfsm.events import (
    BadMessage,
    CoreConfig,
    EngineKey,
    Event,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeReply,
    Heartbeat,
    NotificationReceived,
    PeerDisconnected,
    RankInfo,
)
from pdfsm.topology import ReadSource
from pdfsm.wire import HeartbeatMessage, Notification, NotifyMessage
from transports.base import TransportError
from transports.layers import LayerError
from transports.sim import SimHandshaker, SimNetwork
from transports.torch import (
    TorchNetwork,
    TorchRankMetadata,
    TorchRankMetadataV1,
    TorchTransport,
    decode_torch_metadata,
)

PAUSE = 0.0005  # between stepping rounds: the reads finish on worker threads


class Rank(StepRank):
    def __init__(self, tnet: TorchNetwork, net: SimNetwork, engine_id: str, kv: list[torch.Tensor], *,
                 tp_rank: int, tp_size: int, mla: bool = False, pp_rank: int = 0, pp_size: int = 1,
                 **kw: Any) -> None:
        super().__init__()
        self.kv = kv
        self.transport = TorchTransport(tnet, f"{engine_id}{pp_rank}.{tp_rank}", kv, tp_rank=tp_rank,
                                        pp_rank=pp_rank, **kw)
        config = CoreConfig(engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                            pp_size=pp_size, mla=mla, strict=True)
        self.conn = Connector(config, self.transport, SimHandshaker(net), host=f"{engine_id}-host", port=1)


def engine(tnet: TorchNetwork, net: SimNetwork, engine_id: str, tp: int, *, blocks: int, block_bytes: int,
           fill: bool, mla: bool = False, **kw: Any) -> list[Rank]:
    ranks = []
    for r in range(tp):
        kv = random_kv(2, blocks, block_bytes, seed=10 * r + 1) if fill else zero_kv(2, blocks, block_bytes)
        ranks.append(Rank(tnet, net, engine_id, kv, tp_rank=r, tp_size=tp, mla=mla, **kw))
    reply = HandshakeReply(engine_id=engine_id, compat_hash="", tp_size=tp, mla=mla,
                           ranks=tuple(rk.transport.rank_info() for rk in ranks))
    net.serve(f"{engine_id}-host", 1, lambda pp: reply)
    return ranks


def test_connector_pair_moves_blocks() -> None:
    tnet, net = TorchNetwork(), SimNetwork()
    (p,) = engine(tnet, net, "P", 1, blocks=32, block_bytes=512, fill=True)
    (d,) = engine(tnet, net, "D", 1, blocks=32, block_bytes=512, fill=False)
    remote, local = [4, 5, 6, 7, 20, 2], [0, 1, 2, 3, 31, 9]
    params = p.conn.request_finished("rp", remote)
    d.conn.load("rd", local, params)
    run_until([p, d], lambda: "rd" in d.recving and "rp" in p.sending, pause=PAUSE)
    for k in range(2):
        assert torch.equal(d.kv[k][local], p.kv[k][remote])
    for rk in (p, d):
        rk.conn.shutdown()


def test_heterogeneous_tp_both_ways() -> None:
    tnet, net = TorchNetwork(), SimNetwork()
    ps = engine(tnet, net, "P", 2, blocks=8, block_bytes=256, fill=True)
    ds = engine(tnet, net, "D", 1, blocks=8, block_bytes=512, fill=False)
    params = ps[0].conn.request_finished("r", [1, 2])
    ps[1].conn.request_finished("r", [1, 2])
    ds[0].conn.load("rd", [6, 7], params)
    run_until([*ps, *ds], lambda: "rd" in ds[0].recving and all("r" in p.sending for p in ps), pause=PAUSE)
    for k in range(2):
        assert torch.equal(ds[0].kv[k][[6, 7], :256], ps[0].kv[k][[1, 2]])
        assert torch.equal(ds[0].kv[k][[6, 7], 256:], ps[1].kv[k][[1, 2]])
    (q,) = engine(tnet, net, "Q", 1, blocks=8, block_bytes=512, fill=True)
    es = engine(tnet, net, "E", 2, blocks=8, block_bytes=256, fill=False)
    params = q.conn.request_finished("s", [3, 4])
    for e in es:
        e.conn.load("sd", [0, 1], params)
    run_until([q, *es], lambda: all("sd" in e.recving for e in es) and "s" in q.sending, pause=PAUSE)
    for k in range(2):
        assert torch.equal(es[0].kv[k][[0, 1]], q.kv[k][[3, 4], :256])
        assert torch.equal(es[1].kv[k][[0, 1]], q.kv[k][[3, 4], 256:])
    for rk in (*ps, *ds, q, *es):
        rk.conn.shutdown()


def test_many_reads_complete_on_worker_threads() -> None:
    """Outcomes are submitted by the copier threads themselves, concurrently."""
    tnet = TorchNetwork()
    p = TorchTransport(tnet, "p", random_kv(2, 64, 4096, seed=5))
    d_kv = zero_kv(2, 64, 4096)
    d = TorchTransport(tnet, "d", d_kv, latency_s=0.02, workers=4)
    got: list[tuple[Event, int]] = []
    lock = threading.Lock()

    def submit(ev: Event) -> None:
        with lock:
            got.append((ev, threading.get_ident()))

    p.bind(lambda ev: None, time.monotonic_ns)
    d.bind(submit, time.monotonic_ns)
    d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)))
    t0 = time.monotonic()
    for i in range(32):
        cmd = PostRead(f"r{i}", "P", ReadSource(0, 0), (2 * i, 2 * i + 1), (63 - i, i), Notification(f"p{i}", 0, 1))
        d.post_read(cmd)
    deadline = time.monotonic() + 10
    while len(got) < 32:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    elapsed = time.monotonic() - t0
    assert all(isinstance(ev, HandleDone) for ev, _ in got)
    assert sorted(ev.request_id for ev, _ in got) == sorted(f"r{i}" for i in range(32))  # type: ignore[attr-defined]
    threads = {tid for _, tid in got}
    assert threading.get_ident() not in threads and len(threads) > 1
    assert elapsed < 32 * 0.02  # 4 workers overlap their latencies
    for i in range(32):
        for k in range(2):
            assert torch.equal(d_kv[k][2 * i], p.tensors[k][63 - i])
            assert torch.equal(d_kv[k][2 * i + 1], p.tensors[k][i])
    assert len(p.inbox) == 32  # every notification waits for the producer's own progress()
    d.close()
    p.close()


class Pair:
    def __init__(self, **kw: Any) -> None:
        self.net = TorchNetwork()
        self.p = TorchTransport(self.net, "p", random_kv(1, 16, 1 << 20, seed=2))
        self.d_kv = zero_kv(1, 16, 1 << 20)
        self.d = TorchTransport(self.net, "d", self.d_kv, **kw)
        self.p_events: list[Event] = []
        self.d_events: list[Event] = []
        self.p.bind(self.p_events.append, time.monotonic_ns)
        self.d.bind(self.d_events.append, time.monotonic_ns)
        self.d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(self.p.rank_info(),)))

    def read(self, rid: str, n: int = 4) -> None:
        blocks = tuple(range(n))
        self.d.post_read(PostRead(rid, "P", ReadSource(0, 0), blocks, blocks, Notification(rid, 0, 1)))

    def wait(self, count: int = 1, timeout: float = 10.0) -> list[Event]:
        deadline = time.monotonic() + timeout
        while len(self.d_events) < count:
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.001)
        return self.d_events

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture
def slow() -> Iterator[Pair]:
    pr = Pair(latency_s=0.2)
    yield pr
    pr.close()


def test_latency_is_applied(slow: Pair) -> None:
    t0 = time.monotonic()
    slow.read("r")
    (ev,) = slow.wait()
    assert isinstance(ev, HandleDone) and time.monotonic() - t0 >= 0.2
    assert torch.equal(slow.d_kv[0][:4], slow.p.tensors[0][:4])
    slow.p.progress()
    (note,) = slow.p_events
    assert isinstance(note, NotificationReceived) and note.sender == "d"


def test_cancel_before_the_copy(slow: Pair) -> None:
    t0 = time.monotonic()
    slow.read("r")
    slow.d.cancel_read("r", 0, 0)
    (ev,) = slow.wait()
    assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.CANCELLED
    assert time.monotonic() - t0 < 0.19  # the cancel woke the waiting worker (its copy waits 0.2 s)
    assert not slow.d_kv[0].any()  # nothing was copied
    slow.p.progress()
    assert slow.p_events == []  # and the producer was not told it was read
    slow.d.cancel_read("r", 0, 0)  # after the end: nothing
    assert len(slow.d_events) == 1


def test_cancel_during_the_copy_stops_between_chunks() -> None:
    pr = Pair(chunk_bytes=4096)
    started = threading.Event()
    real = pr.net.reachable

    def slow_reachable(name: str, incarnation: str | None = None) -> TorchTransport | None:
        started.set()
        time.sleep(0.0002)
        return real(name, incarnation)

    pr.net.reachable = slow_reachable  # type: ignore[method-assign]
    try:
        pr.read("r", n=16)  # 16 MiB in 4 KiB chunks: seconds at this pace
        assert started.wait(5)
        pr.d.cancel_read("r", 0, 0)
        (ev,) = pr.wait()
        assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.CANCELLED
        assert "copy stopped" in ev.detail
        assert not pr.d.reads
    finally:
        pr.close()


def test_abort_through_the_connector() -> None:
    tnet, net = TorchNetwork(), SimNetwork()
    (p,) = engine(tnet, net, "P", 1, blocks=8, block_bytes=256, fill=True)
    (d,) = engine(tnet, net, "D", 1, blocks=8, block_bytes=256, fill=False, latency_s=5.0)
    params = p.conn.request_finished("rp", [1, 2])
    d.conn.load("rd", [1, 2], params)
    run_until([d], lambda: bool(d.transport.reads), pause=PAUSE)
    d.conn.abort("rd")
    run_until([d], lambda: "rd" in d.recving, timeout=2.0, pause=PAUSE)
    assert d.conn.last.aborted == frozenset({"rd"})
    (ev,) = d.events(HandleFailed)
    assert ev.why is HandleFailure.CANCELLED
    for rk in (p, d):
        rk.conn.shutdown()


def test_killed_peer(slow: Pair) -> None:
    slow.read("r")
    slow.net.kill("p")
    ev, gone = slow.wait(2)
    assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.DISCONNECTED
    assert isinstance(gone, PeerDisconnected) and (gone.engine_id, gone.pp_rank) == ("P", 0)  # once, as NIXL
    with pytest.raises(TransportError, match="unreachable"):
        slow.d.send(("P", 0), 0, HeartbeatMessage("r", 1))
    slow.read("s")  # accepted, and ends DISCONNECTED: the engine was reported gone already
    (late,) = slow.wait(3)[2:]
    assert isinstance(late, HandleFailed) and late.why is HandleFailure.DISCONNECTED
    slow.net.revive("p")
    slow.read("t")
    assert isinstance(slow.wait(4)[3], HandleDone)


def test_a_read_posted_while_the_peer_was_down_ends_disconnected_even_if_it_comes_back(slow: Pair) -> None:
    """Nothing was planned for it: reporting it done after a revival would hand back untouched
    blocks as read and tell the producer to free its own (as the sim and NIXL end it)."""
    slow.net.kill(slow.p.agent_name)
    slow.read("r")
    slow.net.revive(slow.p.agent_name)  # back within the read's latency
    ev, lost = slow.wait(2)
    assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.DISCONNECTED
    assert isinstance(lost, PeerDisconnected) and not slow.d_kv[0].any()
    slow.p.progress()
    assert not slow.p_events  # the producer was told nothing


@pytest.mark.parametrize("when", ["before the post", "during the latency"])
def test_a_producer_restarted_under_the_same_name_is_not_read_through_the_old_connection(when: str) -> None:
    """A connection names the process it was made with: another one under the agent's name (a
    restart) is read from and told only after a new handshake (decisions.md, "Params name the
    producer process that minted them")."""
    pr = Pair(latency_s=0.2)
    try:
        if when == "during the latency":
            pr.read("r")
        name = pr.p.agent_name
        pr.p.close()
        successor = TorchTransport(pr.net, name, random_kv(1, 16, 1 << 20, seed=99))
        told: list[Event] = []
        successor.bind(told.append, time.monotonic_ns)
        if when == "before the post":
            pr.read("r")
        ev, lost = pr.wait(2)
        assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.DISCONNECTED
        assert isinstance(lost, PeerDisconnected) and not pr.d_kv[0].any()
        successor.progress()
        assert not told
        successor.close()
    finally:
        pr.close()


def test_send_and_bad_bytes(slow: Pair) -> None:
    slow.d.send(("P", 0), 0, HeartbeatMessage("r", 7))
    slow.net.deliver("d", "p", b"\xc1")
    slow.p.progress()
    beat, bad = slow.p_events
    assert isinstance(beat, Heartbeat) and beat.extend_ns == 7
    assert isinstance(bad, BadMessage) and bad.sender == "d"


def test_setup_failures_raise(slow: Pair) -> None:
    with pytest.raises(TransportError, match="no peer"):
        slow.d.post_read(PostRead("x", "Q", ReadSource(0, 0), (0,), (0,), Notification("x", 0, 1)))
    with pytest.raises(TransportError, match="outside"):
        slow.d.post_read(PostRead("x", "P", ReadSource(0, 0), (0,), (16,), Notification("x", 0, 1)))
    slow.read("r")
    with pytest.raises(TransportError, match="already in flight"):
        slow.read("r")
    with pytest.raises(TransportError, match="unreachable"):
        nobody = RankInfo(pp_rank=0, tp_rank=0, agent="nobody")
        slow.d.add_peer(("Q", 0), HandshakeReply(engine_id="Q", compat_hash="", tp_size=1, ranks=(nobody,)))


def test_close_reports_what_was_in_flight() -> None:
    pr = Pair(latency_s=10.0)
    pr.read("r")
    pr.d.close()
    (ev,) = pr.d_events
    assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.CANCELLED
    with pytest.raises(TransportError, match="closed"):
        pr.read("s")
    pr.p.close()


# --- pipeline parallelism: regions paired by layer -------------------------------------------------

LAYERS = 4  # each PP rank of two holds two


def pp_engine(tnet: TorchNetwork, net: SimNetwork, engine_id: str, *, pp: int, tp: int, blocks: int,
              block_bytes: int, fill: bool, layers: Callable[[int], list[int]] | None = None,
              **kw: Any) -> dict[tuple[int, int], Rank]:
    """An engine of ``pp`` x ``tp`` ranks; PP rank ``p`` holds layers ``layers(p)`` (by default its
    share of LAYERS, contiguous), one region per layer, each filled with bytes unique to its
    (engine, pp, tp, layer). Its side channel answers pp_rank ``p`` with PP rank ``p``'s TP ranks."""
    per = LAYERS // pp
    layers_of = layers or (lambda p: list(range(p * per, (p + 1) * per)))
    ranks: dict[tuple[int, int], Rank] = {}
    for p in range(pp):
        ids = layers_of(p)
        for t in range(tp):
            kv = ([random_kv(1, blocks, block_bytes, seed=1000 * p + 100 * t + x)[0] for x in ids] if fill
                  else zero_kv(len(ids), blocks, block_bytes))
            ranks[(p, t)] = Rank(tnet, net, engine_id, kv, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp,
                                 layers=ids, **kw)
    replies = {p: HandshakeReply(engine_id=engine_id, compat_hash="", tp_size=tp, pp_size=pp,
                                 ranks=tuple(ranks[(p, t)].transport.rank_info() for t in range(tp)))
               for p in range(pp)}
    net.serve(f"{engine_id}-host", 1, lambda p: replies[p])
    return ranks


def hold_all(ranks: dict[tuple[int, int], Rank], rid: str, blocks: list[int]) -> KVTransferParams:
    """``request_finished`` on every rank of a producer engine; the params of the first."""
    params = [rk.conn.request_finished(rid, blocks) for rk in ranks.values()]
    return params[0]


def layer_bytes(rank: Rank, layer: int) -> torch.Tensor:
    return rank.kv[rank.transport.layers.index(layer)]


@pytest.mark.parametrize("producer_tp", [1, 2])
def test_pp2_producer_into_pp1_consumer(producer_tp: int) -> None:
    """Each PP rank's layers land in the consumer's regions of those layers, whatever their
    positions: the consumer registers its layers out of order."""
    tnet, net = TorchNetwork(), SimNetwork()
    ps = pp_engine(tnet, net, "P", pp=2, tp=producer_tp, blocks=16, block_bytes=512 // producer_tp, fill=True)
    (d,) = pp_engine(tnet, net, "D", pp=1, tp=1, blocks=16, block_bytes=512, fill=False,
                     layers=lambda p: [2, 0, 3, 1]).values()
    remote, local = [3, 4, 5, 11], [0, 1, 9, 8]
    params = hold_all(ps, "rp", remote)
    assert params.remote_pp_size == 2
    d.conn.load("rd", local, params)
    run_until([*ps.values(), d], lambda: "rd" in d.recving and all("rp" in p.sending for p in ps.values()),
              pause=PAUSE)
    assert not d.conn.last.failed
    width = 512 // producer_tp
    for x in range(LAYERS):
        for t in range(producer_tp):  # TP rank t's whole blocks into slice t of ours
            src = layer_bytes(ps[(x // 2, t)], x)[remote]
            assert torch.equal(layer_bytes(d, x)[local, t * width:(t + 1) * width], src), (x, t)
    # Both PP engines handshaken, each reply keyed (pp_rank, tp_rank) of its own PP rank.
    assert {k for k in d.transport.peers} == {("P", 0), ("P", 1)}
    assert all(set(d.transport.peers[("P", p)]) == set(range(producer_tp)) for p in (0, 1))
    for p in ps.values():  # every producer rank was read and notified once
        assert [n.request_id for n in p.events(NotificationReceived)] == ["rp"]
    for rk in (*ps.values(), d):
        rk.conn.shutdown()


def test_equal_pp_sizes_read_the_matching_rank() -> None:
    tnet, net = TorchNetwork(), SimNetwork()
    ps = pp_engine(tnet, net, "P", pp=2, tp=1, blocks=8, block_bytes=256, fill=True)
    ds = pp_engine(tnet, net, "D", pp=2, tp=1, blocks=8, block_bytes=256, fill=False)
    params = hold_all(ps, "rp", [1, 2])
    for d in ds.values():
        d.conn.load("rd", [5, 6], params)
    run_until([*ps.values(), *ds.values()], lambda: all("rd" in d.recving for d in ds.values()), pause=PAUSE)
    for (p, _), d in ds.items():
        assert list(d.transport.peers) == [("P", p)]
        for x in d.transport.layers:
            assert torch.equal(layer_bytes(d, x)[[5, 6]], layer_bytes(ps[(p, 0)], x)[[1, 2]])
    for rk in (*ps.values(), *ds.values()):
        rk.conn.shutdown()


def test_layer_errors() -> None:
    tnet = TorchNetwork()
    with pytest.raises(LayerError, match="repeat"):
        TorchTransport(tnet, "x", zero_kv(2, 4, 64), layers=[1, 1])
    with pytest.raises(ValueError, match="2 layer ids for 3"):
        TorchTransport(tnet, "x", zero_kv(3, 4, 64), layers=[0, 1])
    with pytest.raises(ValueError, match="supports_pp=False"):
        TorchTransport(tnet, "x", zero_kv(1, 4, 64), pp_rank=1, supports_pp=False)
    p1 = TorchTransport(tnet, "p1", random_kv(2, 4, 64, seed=1), pp_rank=1, layers=[2, 3])
    d = TorchTransport(tnet, "d", zero_kv(2, 4, 64))  # layers 0 and 1
    d.bind(lambda ev: None, time.monotonic_ns)
    reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, pp_size=2, ranks=(p1.rank_info(),))
    with pytest.raises(LayerError, match="holds layers 2-3 that this rank does not"):
        d.add_peer(("P", 1), reply)
    assert not d.peers
    for t in (p1, d):
        t.close()


def test_layers_covered_exactly_once_or_the_read_fails_setup() -> None:
    """PP ranks that both hold a layer (here both left at the default, positions 0-1), or that
    leave a local layer unread (a PP-size-2 producer read as if it had PP size 1): the read
    fails SETUP, the request fails with the recompute policy, nothing is copied."""
    tnet, net = TorchNetwork(), SimNetwork()
    ps = pp_engine(tnet, net, "P", pp=2, tp=1, blocks=8, block_bytes=256, fill=True, layers=lambda p: [0, 1])
    (d,) = pp_engine(tnet, net, "D", pp=1, tp=1, blocks=8, block_bytes=256, fill=False,
                     layers=lambda p: [0, 1]).values()
    params = hold_all(ps, "rp", [1, 2])
    d.conn.load("rd", [5, 6], params)
    run_until([d], lambda: "rd" in d.recving, pause=PAUSE)
    (failed,) = d.conn.last.failed
    assert failed.policy == "recompute"
    assert {e.why for e in d.events(HandleFailed)} == {HandleFailure.SETUP}
    assert all("held by remote PP ranks 0 and 1" in e.detail for e in d.events(HandleFailed))
    assert not any(t.any() for t in d.kv)

    qs = pp_engine(tnet, net, "Q", pp=2, tp=1, blocks=8, block_bytes=256, fill=True)
    (e,) = pp_engine(tnet, net, "E", pp=1, tp=1, blocks=8, block_bytes=256, fill=False).values()
    params = qs[(0, 0)].conn.request_finished("rq", [1, 2])
    e.conn.load("re", [5, 6], msgspec.structs.replace(params, remote_pp_size=1))  # a wrong router
    run_until([e], lambda: "re" in e.recving, pause=PAUSE)
    # The core refuses it before any read: the handshake says PP 2 (the transport's own layer check,
    # "holds local layers 2-3: they would not be read", is the second line of defence).
    assert not e.events(HandleFailed)
    (failed,) = e.conn.last.failed
    assert "the params say Q has TP 1 and PP 1" in failed.reason and "says TP 1 and PP 2" in failed.reason
    assert not any(t.any() for t in e.kv)
    for rk in (*ps.values(), d, *qs.values(), e):
        rk.conn.shutdown()


class Spy(TorchTransport):
    """Records every call that names a remote PP rank."""

    calls: list[tuple[str, int]]

    def add_peer(self, key: EngineKey, reply: HandshakeReply, attempt: int = 0) -> None:
        self.calls.append(("add_peer", key[1]))
        super().add_peer(key, reply, attempt)

    def post_read(self, cmd: PostRead) -> None:
        self.calls.append(("post_read", cmd.source.pp_rank))
        super().post_read(cmd)

    def send(self, key: EngineKey, tp_rank: int, message: NotifyMessage) -> None:
        self.calls.append(("send", key[1]))
        super().send(key, tp_rank, message)


def test_transport_without_pp_refuses_and_the_connector_never_asks() -> None:
    tnet, net = TorchNetwork(), SimNetwork()
    ps = pp_engine(tnet, net, "P", pp=2, tp=1, blocks=8, block_bytes=256, fill=True)
    d_kv = zero_kv(LAYERS, 8, 256)
    spy = Spy(tnet, "d-nopp", d_kv, supports_pp=False)
    spy.calls = []
    conn = Connector(CoreConfig(engine_id="D", strict=True), spy, SimHandshaker(net))
    assert not conn.config.supports_pp  # the Connector took the transport's word
    params = hold_all(ps, "rp", [1, 2])
    conn.load("rd", [5, 6], params)
    _, recving = conn.get_finished()  # at once: the first step reports it
    assert recving == {"rd"}
    (failed,) = conn.last.failed
    assert failed.policy == "recompute" and "PP" in failed.reason and set(failed.invalid_blocks) == {5, 6}
    assert spy.calls == []  # not even PP rank 0 was asked for
    assert not any(t.any() for t in d_kv)
    # Defense in depth: the transport itself refuses anything at pp_rank > 0.
    reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, pp_size=2,
                           ranks=(ps[(1, 0)].transport.rank_info(),))
    with pytest.raises(TransportError, match="does not support pipeline parallelism"):
        spy.add_peer(("P", 1), reply)
    with pytest.raises(TransportError, match="does not support pipeline parallelism"):
        spy.post_read(PostRead("x", "P", ReadSource(1, 0), (0,), (0,), Notification("x", 0, 1)))
    with pytest.raises(TransportError, match="does not support pipeline parallelism"):
        spy.send(("P", 1), 0, HeartbeatMessage("x", 1))
    conn.shutdown()
    for rk in ps.values():
        rk.conn.shutdown()


def test_torch_v1_metadata_still_decodes() -> None:
    old = msgspec.msgpack.encode(TorchRankMetadataV1(((64, 4), (64, 4))))
    assert decode_torch_metadata(old) == TorchRankMetadata(((64, 4, 0), (64, 4, 1)))


def test_a_reply_of_a_process_replaced_before_add_peer_is_refused() -> None:
    """Producer process A answers the handshake, then restarts as B under the same agent name before
    the consumer's AddPeer (found by review; the class of vLLM PR 55471): the torch transport bound
    the reply to whatever process held the name then, read B's blocks and reported them done.
    add_peer checks the reply's incarnation: refused, nothing read from B (the simulated transport
    checks the same)."""
    net = TorchNetwork()
    a = TorchTransport(net, "p", random_kv(1, 16, 4096, seed=1))
    stale = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(a.rank_info(),))
    a.close()
    b = TorchTransport(net, "p", random_kv(1, 16, 4096, seed=2))
    d = TorchTransport(net, "d", zero_kv(1, 16, 4096))
    try:
        with pytest.raises(TransportError, match="restarted since its handshake reply"):
            d.add_peer(("P", 0), stale)
        d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(b.rank_info(),)))
        assert d.peers[("P", 0)][0].incarnation == b.incarnation
        sim_net = SimNetwork()
        from transports.sim import SimTransport

        q = SimTransport(sim_net, "q")  # a reply of an earlier process under q's name:
        earlier = msgspec.structs.replace(q.rank_info(), incarnation="sim-earlier")
        sim_stale = HandshakeReply(engine_id="Q", compat_hash="", tp_size=1, ranks=(earlier,))
        with pytest.raises(TransportError, match="restarted since its handshake reply"):
            SimTransport(sim_net, "r").add_peer(("Q", 0), sim_stale)
    finally:
        d.close()
        b.close()


def test_a_read_the_pool_could_not_start_a_thread_for_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread pool queues a read, then fails to start a thread for it (a process thread
    limit): post_read raised (the Connector reports SETUP and hands the blocks back), yet the queued
    read ran a moment later on the busy worker, copying into those blocks and notifying the
    producer (found by a helper's hunt). A read post_read gives up is never run."""
    net = TorchNetwork()
    p = TorchTransport(net, "p", random_kv(1, 8, 256, seed=1))
    local = zero_kv(1, 8, 256)
    d = TorchTransport(net, "d", local, workers=2, latency_s=0.2)
    out: list[Event] = []
    p.bind(lambda e: None, time.monotonic_ns)
    d.bind(out.append, time.monotonic_ns)
    d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)))
    d.post_read(PostRead("r1", "P", ReadSource(0, 0), (1,), (1,), Notification("r1", 0, 1)))
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("torch-xfer-d"):
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(TransportError, match="cannot start the read"):
        d.post_read(PostRead("r2", "P", ReadSource(0, 0), (5,), (2,), Notification("r2", 0, 1)))
    monkeypatch.undo()
    d.stop_reads()
    time.sleep(0.4)  # the busy worker is free again: it would take r2's queued work now
    assert not local[0][5].any(), "a read given up wrote into its blocks"
    assert [getattr(e, "request_id", None) for e in out] == ["r1"]
    d.close()
    p.close()


def test_a_worker_whose_clock_raises_still_reports_and_stop_reads_returns() -> None:
    """A clock that raises in the worker, after the copy and before the report, left the read
    unreported and ``stop_reads``/``close`` waiting for it for ever (found by a helper's hunt); and
    once reported failed, the read's own notification had already gone, so the producer got it and
    then the consumer's release notice too, a duplicate blamed on the consumer (found by review).
    The read is reported failed (untimed, it cannot be trusted), sends no notification, and
    nothing waits."""

    def clock() -> int:
        raise OSError("clock source failed")

    net = TorchNetwork()
    p = TorchTransport(net, "p", random_kv(1, 8, 256, seed=1))
    d = TorchTransport(net, "d", zero_kv(1, 8, 256))
    out: list[Event] = []
    p.bind(lambda e: None, time.monotonic_ns)
    d.bind(out.append, clock)
    d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)))
    d.post_read(PostRead("r", "P", ReadSource(0, 0), (1,), (1,), Notification("r", 0, 1)))
    deadline = time.monotonic() + 5
    while not out and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [(type(e).__name__, getattr(e, "why", None)) for e in out] == [("HandleFailed", HandleFailure.RAISED)]
    assert not p.inbox, "the read's notification went although the read is reported failed"
    done = threading.Event()

    def stop() -> None:
        d.stop_reads()
        done.set()

    threading.Thread(target=stop, daemon=True).start()
    assert done.wait(5), "stop_reads waits for a read that will never report"
    d.close()
    p.close()
