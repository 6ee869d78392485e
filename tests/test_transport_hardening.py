"""Transports under peers that die, lie or send odd geometry (found by review; each asserts the fix)."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
from transport_helpers import random_kv, zero_kv

from pdfsm.commands import PostRead
from pdfsm.events import (
    Event,
    HandleDone,
    HandleFailed,
    HandshakeReply,
    PeerDisconnected,
    RankInfo,
)
from pdfsm.sidechannel import SideChannelServer
from pdfsm.topology import ReadSource
from pdfsm.wire import Notification
from transports.base import TransportError
from transports.sim import SimNetwork, SimTransport
from transports.torch import TorchNetwork, TorchTransport

try:
    from transports.nixl import NixlRankMetadata, NixlTransport, RegionInfo, decode_rank_metadata, nixl_available
    HAVE_NIXL = nixl_available()
except ImportError:  # pragma: no cover
    HAVE_NIXL = False

needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed")
if HAVE_NIXL:
    logging.getLogger("nixl").setLevel(logging.WARNING)

_names = itertools.count()


def name(prefix: str) -> str:
    return f"rv-{prefix}-{os.getpid()}-{next(_names)}"


def pump(ts: list[Any], until: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        for t in ts:
            t.progress()


# --- NIXL: prepared-list indices assume every remote region has region 0's block count ------------------


@needs_nixl
def test_nixl_prepped_read_with_uneven_remote_regions_moves_the_right_blocks() -> None:
    """A peer whose regions have different block counts (20, 10, 20 here; nothing in
    decode_rank_metadata refuses it) is read in "prepped" mode with indices ``k * 20 + b``,
    but its prepared list is laid out 20 + 10 + 20: block 0 of the third region is fetched
    from the third region's block 10. The read is reported DONE with the wrong bytes
    ("descs" mode, same commands, moves the right ones). Correct: refuse the peer / the
    read, or move the right block."""
    p = NixlTransport(name("p"), random_kv(1, 50, 256, seed=11))
    d = NixlTransport(name("d"), zero_kv(3, 20, 256), xfer_mode="prepped")
    events: list[Event] = []
    d.bind(events.append, time.monotonic_ns)
    p.bind(lambda ev: None, time.monotonic_ns)
    try:
        meta = decode_rank_metadata(p.rank_info().metadata)
        base = meta.regions[0].base
        # Three regions inside P's one registration: blocks 0-19, 20-29 and 30-49 of its tensor.
        regions = (RegionInfo(base, 256, 20, 0, "DRAM", 0), RegionInfo(base + 20 * 256, 256, 10, 0, "DRAM", 1),
                   RegionInfo(base + 30 * 256, 256, 20, 0, "DRAM", 2))
        info = RankInfo(pp_rank=0, tp_rank=0, agent=p.agent_name,
                        metadata=msgspec.msgpack.encode(NixlRankMetadata(meta.agent_metadata, regions)))
        try:
            d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(info,)))
            d.post_read(PostRead("r", "P", ReadSource(0, 0), (0, 1), (0, 1), Notification("p-r", 0, 1)))
        except TransportError:
            return  # refusing such a peer is a correct outcome
        pump([d, p], lambda: bool(events))
        assert isinstance(events[0], HandleDone)
        src = p.tensors[0]
        assert torch.equal(d.tensors[0][:2], src[0:2])
        assert torch.equal(d.tensors[1][:2], src[20:22])
        assert torch.equal(d.tensors[2][:2], src[30:32]), "region 2 got P blocks 40-41 instead of 30-31"
    finally:
        d.close()
        p.close()


# --- NIXL: a refused reply removes another engine's live agent -----------------------------------------


@needs_nixl
def test_nixl_refused_reply_does_not_tear_down_a_live_peer() -> None:
    """A reply (for engine Q) whose rank carries the NIXL metadata of an agent already connected
    for engine P, under another agent name, is refused ("NIXL metadata names agent ..."); the
    clean-up then calls remove_remote_agent on the name NIXL returned, i.e. P's live agent.
    D still lists P as a peer, but every later read to P fails with nixlNotFoundError. A
    misrouted or hostile reply must not break an unrelated connection."""
    p = NixlTransport(name("p"), random_kv(1, 16, 256, seed=3))
    d = NixlTransport(name("d"), zero_kv(1, 16, 256))
    events: list[Event] = []
    d.bind(events.append, time.monotonic_ns)
    p.bind(lambda ev: None, time.monotonic_ns)
    try:
        d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)))
        fake = RankInfo(pp_rank=0, tp_rank=0, agent="someone-else", metadata=p.rank_info().metadata)
        with pytest.raises(TransportError):
            d.add_peer(("Q", 0), HandshakeReply(engine_id="Q", compat_hash="", tp_size=1, ranks=(fake,)))
        assert ("P", 0) in d.peers
        d.post_read(PostRead("r", "P", ReadSource(0, 0), (0,), (5,), Notification("p-r", 0, 1)))
        pump([d, p], lambda: bool(events))
        assert isinstance(events[0], HandleDone)
        assert torch.equal(d.tensors[0][0], p.tensors[0][5])
    finally:
        d.close()
        p.close()


# --- a peer that died between reads is never reported gone ---------------------------------------------


def test_torch_read_to_a_peer_that_died_between_reads_reports_it_gone() -> None:
    """The sim transport, for PostRead to a killed peer, reports HandleFailed(DISCONNECTED) and
    one PeerDisconnected (the engine is then re-handshaken). The torch transport raises in
    post_read ("unreachable": the Connector reports SETUP, a *local* fault) and never emits
    PeerDisconnected when the peer died while no read was in flight, so the engine stays
    CONNECTED and every later read fails SETUP. Same commands, different events. Both reports
    name the handshake attempt the connection was added by."""
    def run(make: Any) -> tuple[list[str], bool]:
        d, kill = make()
        events: list[Event] = []
        d.bind(events.append, time.monotonic_ns)
        kill()
        raised = False
        try:
            d.post_read(PostRead("r", "P", ReadSource(0, 0), (0,), (1,), Notification("p-r", 0, 1)))
        except TransportError:
            raised = True
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not any(isinstance(e, PeerDisconnected) for e in events):
            d.progress()
            time.sleep(0.001)
        kinds = [type(e).__name__ + (f"({e.why.name})" if isinstance(e, HandleFailed) else "") for e in events]
        assert all(e.attempt == 7 for e in events if isinstance(e, PeerDisconnected)), events
        return kinds, raised

    def sim() -> tuple[SimTransport, Any]:
        net = SimNetwork()
        p, d = SimTransport(net, "p"), SimTransport(net, "d")
        d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)), 7)
        return d, lambda: net.kill("p")

    def torch_() -> tuple[TorchTransport, Any]:
        net = TorchNetwork()
        p = TorchTransport(net, "p", random_kv(1, 4, 64, seed=1))
        d = TorchTransport(net, "d", zero_kv(1, 4, 64))
        d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)), 7)
        return d, lambda: net.kill("p")

    sim_kinds, _ = run(sim)
    assert sim_kinds == ["HandleFailed(DISCONNECTED)", "PeerDisconnected"]
    torch_kinds, torch_raised = run(torch_)
    assert "PeerDisconnected" in torch_kinds, (torch_kinds, torch_raised)


@needs_nixl
def test_nixl_read_to_a_peer_that_died_between_reads_reports_it_gone() -> None:
    """Over real NIXL: the producer process is SIGKILLed while no read is in flight. The next
    post_read raises nixlRemoteDisconnectError from transfer() (SETUP at the Connector) and no
    PeerDisconnected is ever emitted (only a *polled* disconnect produces one), so the core keeps
    the engine CONNECTED and reuses the dead connection for every later request (a
    peer NIXL reports disconnected must be re-handshaken, not reused)."""
    import test_nixl_transport as nt

    peer = nt.Peer(8, 4096)
    d = NixlTransport(name("d"), zero_kv(2, 8, 4096))
    events: list[Event] = []
    d.bind(events.append, time.monotonic_ns)
    try:
        d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(peer.info,)), 3)
        d.post_read(PostRead("a", "P", ReadSource(0, 0), (0,), (1,), Notification("x", 0, 1)))
        pump([d], lambda: bool(events))
        assert isinstance(events[0], HandleDone)
        os.kill(peer.proc.pid, signal.SIGKILL)
        peer.proc.wait(10)
        time.sleep(0.3)
        d.post_read(PostRead("b", "P", ReadSource(0, 0), (0,), (1,), Notification("x", 0, 1)))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not any(isinstance(e, PeerDisconnected) for e in events):
            d.progress()
            time.sleep(0.005)
        assert [e.attempt for e in events if isinstance(e, PeerDisconnected)] == [3], events
    finally:
        d.close()
        peer.stop()


# --- the sim transport accepts commands the others refuse ---------------------------------------------


@pytest.fixture
def sim_pair() -> Iterator[tuple[SimNetwork, SimTransport, SimTransport, list[Event]]]:
    net = SimNetwork()
    p, d = SimTransport(net, "p"), SimTransport(net, "d")
    events: list[Event] = []
    d.bind(events.append, lambda: 0)
    p.bind(lambda ev: None, lambda: 0)
    p.fill(range(p.num_blocks))
    d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)))
    yield net, p, d, events


def test_sim_refuses_tables_of_different_lengths_at_post(sim_pair: Any) -> None:
    """NIXL and torch raise in post_read for 2 local blocks and 1 remote block. The sim accepts
    the read; its progress() then raises ValueError (zip strict) out of the owner thread (the
    Connector's step does not catch it), and the read vanishes with no outcome event."""
    _, _, d, _events = sim_pair
    with pytest.raises(TransportError):
        d.post_read(PostRead("r", "P", ReadSource(0, 0), (0, 1), (0,), Notification("p-r", 0, 1)))
    d.progress()  # must not raise


@pytest.mark.parametrize("source", [
    ReadSource(0, 0, remote_slice=0, remote_slices=2, local_slice=2, local_slices=2),  # slice 2 of 2
    ReadSource(0, 0, remote_slice=0, remote_slices=3, local_slice=0, local_slices=3),  # 64 B into 3
])
def test_sim_refuses_slices_the_others_refuse(sim_pair: Any, source: ReadSource) -> None:
    """coalesce.slice_span (NIXL, torch) refuses a slice index >= slices and a block that does
    not split into equal slices. The sim accepts both: slice 2 of 2 writes into the *next*
    local block (local block 1 is overwritten by a read of block 0), and 64 bytes in thirds
    moves 63 of them and reports DONE."""
    _, _, d, _events = sim_pair
    with pytest.raises(TransportError):
        d.post_read(PostRead("r", "P", source, (0,), (0,), Notification("p-r", 0, 1)))


# --- NIXL: close() leaves the agent (its progress thread, UCX workers and listener) running ------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@needs_nixl
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_nixl_close_releases_the_agent_threads() -> None:
    """close() says "Release everything", but it keeps ``self.agent``: NIXL's progress thread
    and UCX's threads (and its listening socket) run on until the transport object itself is
    garbage-collected. A Connector keeps its transport after shutdown(), so they live as long
    as the Connector does. Observed: +4 threads for 3 closed transports."""
    before = _threads()
    ts = []
    for _ in range(3):
        t = NixlTransport(name("c"), zero_kv(1, 4, 64))
        t.bind(lambda ev: None, time.monotonic_ns)
        ts.append(t)
    assert _threads() > before
    for t in ts:
        t.close()
    deadline = time.monotonic() + 2
    while _threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _threads() <= before, f"{_threads() - before} threads still running after close()"
    del ts


def test_torch_loss_of_a_replaced_connection_does_not_report_the_new_one_gone() -> None:
    """A read still running on an engine's old connection (the engine re-handshook to a new
    agent since) ends DISCONNECTED when the old agent dies, but the engine is not reported gone:
    its current connection is alive (a stale PeerDisconnected would drop it)."""
    net = TorchNetwork()
    old = TorchTransport(net, name("old"), random_kv(1, 16, 1 << 20, seed=2))
    new = TorchTransport(net, name("new"), random_kv(1, 16, 1 << 20, seed=3))
    d = TorchTransport(net, name("d"), zero_kv(1, 16, 1 << 20), latency_s=0.2)
    events: list[Event] = []
    for t in (old, new):
        t.bind(lambda ev: None, time.monotonic_ns)
    d.bind(events.append, time.monotonic_ns)
    d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(old.rank_info(),)))
    d.post_read(PostRead("r", "P", ReadSource(0, 0), (0,), (0,), Notification("r", 0, 1)))
    d.drop_peer(("P", 0))
    d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(new.rank_info(),)))
    net.kill(old.agent_name)
    deadline = time.monotonic() + 10
    while not events:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    time.sleep(0.05)
    assert isinstance(events[0], HandleFailed) and events[0].why.value == "disconnected"
    assert not any(isinstance(e, PeerDisconnected) for e in events), events
    for t in (d, old, new):
        t.close()


@needs_nixl
@pytest.mark.parametrize("devices", ["", "all", " ALL ", "lo,all", ","])
def test_nixl_never_listens_on_every_interface(devices: str) -> None:
    """UCX's default (and "all") opens a listener on every interface, 0.0.0.0: refused; the
    transport listens on the devices it is given, loopback by default."""
    with pytest.raises(ValueError, match="ucx_devices"):
        NixlTransport(name("wild"), zero_kv(1, 4, 64), ucx_devices=devices)


@needs_nixl
@pytest.mark.parametrize("devices", ["", "all", "lo, all"])
def test_nixl_refuses_an_inherited_wildcard_ucx_net_devices(devices: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX_NET_DEVICES from the environment wins over ucx_devices, but not to listen on every interface."""
    monkeypatch.setenv("UCX_NET_DEVICES", devices)
    with pytest.raises(ValueError, match="UCX_NET_DEVICES"):
        NixlTransport(name("wild-env"), zero_kv(1, 4, 64))


@pytest.mark.parametrize(("kind", "inherited", "seen"), [("VRAM", None, "y"), ("VRAM", "n", "n"), ("DRAM", None, None)])
def test_vram_backends_read_over_cuda_ipc(kind: str, inherited: str | None, seen: str | None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX turns reads over CUDA IPC off on GPUs without NVLink, and a VRAM READ then went over
    TCP on loopback (0.5 GiB/s on an H100, 320 with them on): while a VRAM transport's backends
    are created they are on, unless the environment says; afterwards the environment is as it was."""
    from transports.nixl import _ucx_env

    var = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    if inherited is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, inherited)
    with _ucx_env("lo", kind):  # type: ignore[arg-type]
        assert os.environ.get(var) == seen
    assert os.environ.get(var) == inherited


def _listening() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process has listening (/proc/net/tcp{,6})."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                mine.add(link[8:-1])
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in mine:  # 0A: LISTEN
                    continue
                addr, port = cols[1].split(":")
                # little-endian 32-bit words, as the kernel prints them
                raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, width, 8))
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


@needs_nixl
def test_no_listening_socket_binds_every_interface_by_default() -> None:
    """reliability.md: bind the configured interface (loopback by default), never 0.0.0.0. Two
    NIXL transports (UCX opens its listeners as each backend starts) and a side-channel server,
    all with their defaults: every listening socket they opened in this process is on loopback."""
    before = _listening()
    transports = [NixlTransport(name("bind"), zero_kv(1, 4, 64)) for _ in range(2)]
    server = SideChannelServer(lambda pp: HandshakeReply(engine_id="P", compat_hash="", tp_size=1)).start()
    try:
        opened = _listening() - before
        assert opened, "nothing listening: the check would prove nothing"
        assert all(ipaddress.ip_address(host).is_loopback for host, _ in opened), opened
    finally:
        server.close()
        for t in transports:
            t.close()


def test_kv_regions_of_zero_bytes_are_refused_as_the_transport_is_built() -> None:
    """2 KV heads over 4 TP ranks (``heads // tp`` = 0): a [num_blocks, 0, head_bytes] cache, or a
    simulated rank with 0-byte blocks, was accepted, and a transfer that moved nothing was
    reported received (found by a helper's hunt). The NIXL transport refused it already."""
    with pytest.raises(ValueError, match="0 bytes per block"):
        TorchTransport(TorchNetwork(), "x", [torch.zeros(4, 0, 16, dtype=torch.uint8)])
    for num_blocks, block_bytes in ((4, 0), (0, 64)):
        with pytest.raises(ValueError, match="must be >= 1"):
            SimTransport(SimNetwork(), "y", num_blocks=num_blocks, block_bytes=block_bytes)


def test_the_demo_engine_refuses_kv_heads_its_tp_ranks_cannot_share(capsys: pytest.CaptureFixture[str]) -> None:
    """``--heads 8 --tp 3``: each rank got 8 // 3 heads and the remainder was never moved; with
    ``--heads 2 --tp 4`` each got 0 heads and every transfer "moved" nothing (found by a helper's
    hunt). Refused before anything starts. (``--heads 2 --tp 4`` now runs: each rank holds one of
    the two heads, topology.heads_held; 3 heads over 4 ranks cannot be held alike.)"""
    from pdfsm import engines

    for heads, tp in ((8, 3), (3, 4), (0, 1)):
        assert engines.main(["--role", "decode", "--engine-id", "d", "--tp", str(tp), "--heads", str(heads)]) == 2
        assert f"--heads {heads}" in capsys.readouterr().err
