"""The NIXL transport (and the Connector over it) under real failure modes.

Every test runs real NIXL over UCX on host memory, with the producer in a second OS process
(tests/nixl_peer.py) that is killed (SIGKILL) or stopped (SIGSTOP) at the moment the scenario
needs. Each expected outcome is the one docs/transports.md gives (the protocol table, "Rules
every transport keeps", the cancel and drop rules).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import operator
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
import torch
from helpers import child_env
from transport_helpers import PeerProcess, StepRank, run_until, zero_kv

from pdfsm.commands import PostRead
from pdfsm.connector import Connector, KVTransferParams
from pdfsm.events import (
    BadMessage,
    CoreConfig,
    Event,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeReply,
    PeerDisconnected,
    RankInfo,
)
from pdfsm.sidechannel import SideChannelHandshaker
from pdfsm.topology import ReadSource
from pdfsm.wire import HeartbeatMessage, Notification
from transports.base import TransportError
from transports.nixl import NixlTransport, decode_rank_metadata, nixl_available

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

if nixl_available():
    logging.getLogger("nixl").setLevel(logging.WARNING)

ROOT = Path(__file__).resolve().parent.parent
_names = itertools.count()


def name(prefix: str) -> str:
    return f"rv{prefix}-{os.getpid()}-{next(_names)}"


def expected(seed: int, regions: int, blocks: int, block_bytes: int) -> list[torch.Tensor]:
    """What tests/nixl_peer.py wrote into each region (its fill_pattern, region_seed)."""
    out = []
    for k in range(regions):
        gen = torch.Generator().manual_seed(seed + k)
        out.append(torch.randint(0, 256, (blocks * block_bytes,), dtype=torch.uint8, generator=gen)
                   .view(blocks, block_bytes))
    return out


class Producer(PeerProcess):
    """tests/nixl_peer.py in its own process, under an agent name we choose (so that a restart
    can reuse it)."""

    def __init__(self, agent: str, blocks: int = 64, block_bytes: int = 4096, seed: int = 1,
                 sidechannel: bool = False) -> None:
        super().__init__(agent, blocks, block_bytes, *(["--sidechannel"] if sidechannel else []), seed=seed,
                         quiet=True)
        self.info = msgspec.msgpack.decode(bytes.fromhex(self.wait_for("RANK ").split()[1]), type=RankInfo)
        self.port = int(self.wait_for("SIDECHANNEL ").split()[1]) if sidechannel else 1

    def hold(self, rid: str, blocks: list[int]) -> KVTransferParams:
        self.send(f"HOLD {rid} {','.join(map(str, blocks))}")
        self.wait_for(f"HELD {rid}")
        return KVTransferParams(remote_tp_size=1, remote_engine_id="P", remote_request_id=rid, remote_host="127.0.0.1",
                                remote_port=self.port, remote_block_ids=tuple(blocks),
                                remote_incarnation=self.info.incarnation, lease_ns=120_000_000_000)

    def reply(self, engine: str = "P") -> HandshakeReply:
        return HandshakeReply(engine_id=engine, compat_hash="", tp_size=1, ranks=(self.info,))

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot read QUIT
        super().stop()


def sigstop(p: Producer) -> None:
    """SIGSTOP the producer and wait until the kernel says it is stopped (the signal is
    asynchronous: a READ posted right after could still complete)."""
    os.kill(p.proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while True:
        with open(f"/proc/{p.proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, "the producer did not stop"
        time.sleep(0.001)


@pytest.fixture
def producers() -> Iterator[list[Producer]]:
    """Producers a test starts; every one is killed at the end, whatever happened."""
    started: list[Producer] = []
    yield started
    for p in started:
        p.kill()


class Consumer:
    """A consumer NixlTransport driven directly: its events in a list."""

    def __init__(self, blocks: int = 64, block_bytes: int = 4096, regions: int = 2, **kw: Any) -> None:
        self.kv = zero_kv(regions, blocks, block_bytes)
        self.t = NixlTransport(name("d"), self.kv, **kw)
        self.events: list[Event] = []
        self.t.bind(self.events.append, time.monotonic_ns)

    def read(self, rid: str, local: tuple[int, ...] = (0, 1), remote: tuple[int, ...] = (4, 5),
             engine: str = "P") -> PostRead:
        cmd = PostRead(rid, engine, ReadSource(0, 0), local, remote, Notification(f"p-{rid}", 0, 1))
        self.t.post_read(cmd)
        return cmd

    def outcomes(self, rid: str | None = None) -> list[HandleDone | HandleFailed]:
        return [e for e in self.events if isinstance(e, (HandleDone, HandleFailed))
                and (rid is None or e.request_id == rid)]

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def pump(self, until: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out"
            self.t.progress()

    def close(self) -> None:
        self.t.close()


@pytest.fixture
def consumers() -> Iterator[list[Consumer]]:
    made: list[Consumer] = []
    yield made
    for c in made:
        if not c.t._closed:
            c.close()


def one_outcome_each(c: Consumer, rids: list[str]) -> dict[str, HandleDone | HandleFailed]:
    per: dict[str, list[Any]] = collections.defaultdict(list)
    for e in c.outcomes():
        per[e.request_id].append(e)
    assert {r: len(per[r]) for r in rids} == dict.fromkeys(rids, 1), "not exactly one outcome per posted read"
    return {r: per[r][0] for r in rids}


# --- the producer killed ------------------------------------------------------------------------------


def _connected(producers: list[Producer], consumers: list[Consumer], *, attempt: int) -> tuple[Producer, Consumer]:
    """A producer process and a consumer transport connected by ``attempt``, one read done."""
    p = Producer(name("p"))
    producers.append(p)
    c = Consumer()
    consumers.append(c)
    c.t.add_peer(("P", 0), p.reply(), attempt)
    c.read("warm")
    c.pump(lambda: bool(c.outcomes()))
    assert isinstance(c.outcomes()[0], HandleDone)
    return p, c


def test_killed_between_two_reads_every_later_read_ends_disconnected_once(
        producers: list[Producer], consumers: list[Consumer]) -> None:
    """Producer killed after a completed read, before the next ones (one of them zero-length,
    i.e. a bare notification). Expected (protocol table): post_read does not raise, each read
    ends HandleFailed(DISCONNECTED) exactly once, the engine is reported gone once
    (PeerDisconnected, carrying the connection's attempt), a send then raises, nothing is left
    in flight, and close() is clean."""
    p, c = _connected(producers, consumers, attempt=7)
    p.kill()
    time.sleep(0.1)
    rids = ["a", "b", "z", "c"]
    for rid in rids:
        if rid == "z":
            c.read(rid, (), ())
        else:
            c.read(rid)
    c.pump(lambda: not c.t.reads)
    out = one_outcome_each(c, rids)
    assert all(isinstance(e, HandleFailed) and e.why is HandleFailure.DISCONNECTED for e in out.values()), out
    (gone,) = c.of(PeerDisconnected)
    assert (gone.engine_id, gone.pp_rank, gone.attempt) == ("P", 0, 7)
    with pytest.raises(Exception):  # noqa: B017 - send raises on failure (SendFailed)
        c.t.send(("P", 0), 0, HeartbeatMessage("p-x", 1))
    assert len(c.of(PeerDisconnected)) == 1
    c.close()


def test_killed_before_add_peer_is_refused_then_restart_under_the_same_name_works(
        producers: list[Producer], consumers: list[Consumer]) -> None:
    """The producer dies between its handshake reply and add_peer (add_remote_agent meets a dead
    endpoint), then comes back under the same agent name with other memory. Expected: the first
    add_peer raises TransportError (HandshakeFailed) leaving no peer behind; the second one, with
    the new process's metadata, is accepted and a read moves the new process's bytes."""
    agent = name("p")
    p1 = Producer(agent, seed=1)
    producers.append(p1)
    c = Consumer()
    consumers.append(c)
    p1.kill()
    with pytest.raises(TransportError):
        c.t.add_peer(("P", 0), p1.reply())
    assert not c.t.peers and not c.t._agents
    p2 = Producer(agent, seed=9)
    producers.append(p2)
    c.t.add_peer(("P", 0), p2.reply())
    c.read("r", (0, 1), (4, 5))
    c.pump(lambda: bool(c.outcomes()))
    assert isinstance(c.outcomes()[0], HandleDone)
    want = expected(9, 2, 64, 4096)
    for k in range(2):
        assert torch.equal(c.kv[k][[0, 1]], want[k][[4, 5]])


@pytest.mark.parametrize("drop_first", [True, False])
def test_restart_under_the_same_agent_name_with_other_memory(
        producers: list[Producer], consumers: list[Consumer], drop_first: bool) -> None:
    """Producer killed under a READ, restarted with the same agent name and different memory
    (another seed, other addresses). Expected: the READ ends DISCONNECTED with one
    PeerDisconnected; the new reply is accepted (after drop_peer, or as a fresh reply replacing
    the connection) and a read returns the new process's bytes, never the old ones."""
    agent = name("p")
    p1 = Producer(agent, seed=1)
    producers.append(p1)
    c = Consumer()
    consumers.append(c)
    c.t.add_peer(("P", 0), p1.reply(), 1)
    c.read("a")
    c.pump(lambda: bool(c.outcomes()))
    p1.kill()
    c.read("b")
    c.pump(lambda: len(c.outcomes()) == 2)
    second = c.outcomes()[1]
    assert isinstance(second, HandleFailed) and second.why is HandleFailure.DISCONNECTED
    assert len(c.of(PeerDisconnected)) == 1
    p2 = Producer(agent, seed=9)
    producers.append(p2)
    assert p2.info.metadata != p1.info.metadata
    if drop_first:
        c.t.drop_peer(("P", 0))
        c.t.progress()
    c.t.add_peer(("P", 0), p2.reply(), 2)
    for t in c.kv:
        t.zero_()
    c.read("c", (0, 1), (4, 5))
    c.pump(lambda: len(c.outcomes()) == 3)
    assert isinstance(c.outcomes()[2], HandleDone)
    want = expected(9, 2, 64, 4096)
    for k in range(2):
        assert torch.equal(c.kv[k][[0, 1]], want[k][[4, 5]])


# --- the Connector over NIXL ----------------------------------------------------------------------------


class ConnRank(StepRank):
    """A consumer worker: a NIXL transport under a Connector that handshakes over the real side
    channel (the params name the producer's host and port)."""

    def __init__(self, blocks: int = 64, block_bytes: int = 4096, regions: int = 2, **kw: Any) -> None:
        super().__init__()
        self.kv = zero_kv(regions, blocks, block_bytes)
        self.transport = NixlTransport(name("D"), self.kv, **kw)
        config = CoreConfig(engine_id="D", tp_rank=0, tp_size=1)
        self.conn = Connector(config, self.transport, SideChannelHandshaker("D", timeout=3.0, connect_timeout=1.0))


def test_connector_producer_restarted_under_the_same_agent_name_while_idle(producers: list[Producer]) -> None:
    """The producer engine P is connected and idle (no read in flight: the consumer has not seen
    it die) when it is killed and restarted under the same engine id and agent name, with other
    memory and a new side-channel port. A request minted by the new process (its incarnation in
    the params) must either move the new process's bytes or fail; it must never be reported
    done with anything else, and a second request must then succeed."""
    agent = name("p")
    p1 = Producer(agent, seed=1, sidechannel=True)
    producers.append(p1)
    d = ConnRank()
    try:
        d.conn.load("d1", [0, 1], p1.hold("r1", [4, 5]))
        run_until([d], lambda: "d1" in d.recving)
        assert not d.conn.last.failed
        p1.kill()
        p2 = Producer(agent, seed=9, sidechannel=True)
        producers.append(p2)
        # each process's rank says when its transport started: what judges params of the first
        assert 0 < p1.info.started_wall_ns < p2.info.started_wall_ns <= time.time_ns()
        want = expected(9, 2, 64, 4096)
        for i in range(2):
            for t in d.kv:
                t.zero_()
            rid = f"d2-{i}"
            d.conn.load(rid, [2, 3], p2.hold(f"r2-{i}", [6, 7]))
            run_until([d], functools.partial(operator.contains, d.recving, rid), timeout=20)
            failed = [f.request_id for f in d.conn.last.failed]
            if rid not in failed:
                for k in range(2):
                    assert torch.equal(d.kv[k][[2, 3]], want[k][[6, 7]]), f"{rid} reported done with wrong bytes"
        assert not d.conn.last.failed, "the second request after the restart failed too"
    finally:
        d.conn.shutdown()


# --- notifications from a foreign agent -------------------------------------------------------------------

FOREIGN = r"""
import sys, time, logging
logging.getLogger("nixl").setLevel(logging.WARNING)
import torch
from transports.nixl import NixlTransport
name, target, meta_hex, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
t = NixlTransport(name, [torch.zeros(4, 64, dtype=torch.uint8)])
got = t.agent.add_remote_agent(bytes.fromhex(meta_hex))
payloads = [b"", b"\xc1", b"not a pdfsm message", b"\x93\xa1n\xa1x\x00", b"\xff" * 60000, bytes(range(256)) * 4]
if mode == "flood":
    end = time.monotonic() + float(sys.argv[5])
    n = 0
    while time.monotonic() < end:
        try:
            t.agent.send_notif(target, payloads[n % len(payloads)])
        except Exception:
            break
        n += 1
else:
    for p in payloads:
        t.agent.send_notif(target, p)
print("SENT", flush=True)
sys.stdin.read()
"""


def foreign(target: NixlTransport, mode: str = "once", seconds: float = 0.0) -> tuple[subprocess.Popen[str], str]:
    """A NIXL agent in another process that knows ``target`` (it added its metadata) but that
    ``target`` never added: it sends notification payloads that are not pdfsm messages."""
    agent = name("foreign")
    meta = decode_rank_metadata(target.rank_info().metadata).agent_metadata
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-c", FOREIGN, agent, target.agent_name, meta.hex(), mode, str(seconds)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, cwd=ROOT)
    return proc, agent


def wait_line(proc: subprocess.Popen[str], want: str) -> None:
    """Read the process's stdout until the line ``want`` (NIXL logs its own lines there)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == want:
            return
    raise AssertionError(f"the process ended without saying {want!r}")


def test_foreign_agent_garbage_notifications_become_bad_messages(consumers: list[Consumer]) -> None:
    """An agent this transport never added sends payloads that are not pdfsm messages (empty,
    one bad byte, text, a truncated msgpack array, 60 kB, 1 kB). Expected: progress() never
    raises; each becomes one BadMessage attributed to the foreign agent; nothing else is
    emitted."""
    c = Consumer()
    consumers.append(c)
    proc, agent = foreign(c.t)
    try:
        wait_line(proc, "SENT")
        c.pump(lambda: len(c.events) >= 6)
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            c.t.progress()
        assert len(c.events) == 6 and all(isinstance(e, BadMessage) and e.sender == agent for e in c.events), \
            c.events
    finally:
        proc.kill()
        proc.wait(10)


def test_close_while_a_foreign_agent_floods_notifications(consumers: list[Consumer]) -> None:
    """close() while notifications keep arriving, then close() again. Expected: close() returns
    promptly and raises nothing, the second close() is a no-op, progress() after close is a
    no-op, and this process survives the sender's later sends."""
    c = Consumer()
    proc, _ = foreign(c.t, "flood", 3.0)
    try:
        c.pump(lambda: len(c.events) >= 50)
        t0 = time.monotonic()
        c.t.close()
        c.t.close()
        c.t.progress()
        assert time.monotonic() - t0 < 5
        time.sleep(0.5)
        assert proc.poll() is None or proc.returncode == 0
    finally:
        proc.kill()
        proc.wait(10)


def test_connector_many_requests_to_one_producer_while_it_dies(producers: list[Producer]) -> None:
    """Eight requests to one producer engine are reading (the producer is stopped, so their
    READs stay in flight) when it is killed. Expected: every request is reported finished
    receiving exactly once, as failed with all its blocks invalid; the engine is reported gone
    once (one PeerDisconnected); nothing is left in flight in the transport; the dead agent
    is dropped; and a request to the producer restarted under the same agent name then
    succeeds with its bytes."""
    agent = name("p")
    p1 = Producer(agent, blocks=64, block_bytes=4096, seed=1, sidechannel=True)
    producers.append(p1)
    d = ConnRank()
    try:
        d.conn.load("warm", [63], p1.hold("w", [63]))
        run_until([d], lambda: "warm" in d.recving)
        params = [p1.hold(f"r{i}", [2 * i, 2 * i + 1]) for i in range(8)]
        sigstop(p1)
        for i, prm in enumerate(params):
            d.conn.load(f"d{i}", [2 * i, 2 * i + 1], prm)
        run_until([d], lambda: len(d.transport.reads) == 8)
        p1.kill()
        reported: collections.Counter[str] = collections.Counter()
        failed: dict[str, tuple[int, ...]] = {}

        def step() -> bool:
            _, r = d.conn.get_finished()
            reported.update(r)
            for f in d.conn.last.failed:
                failed[f.request_id] = tuple(sorted(f.invalid_blocks))
            return all(f"d{i}" in reported for i in range(8))

        deadline = time.monotonic() + 20
        while not step():
            assert time.monotonic() < deadline, f"timed out; reported {reported}"
        for _ in range(20):
            step()
        assert all(reported[f"d{i}"] == 1 for i in range(8)), reported
        assert failed == {f"d{i}": (2 * i, 2 * i + 1) for i in range(8)}
        assert len(d.events(PeerDisconnected)) == 1
        assert not d.transport.reads
        assert ("P", 0) not in d.transport.peers and agent not in d.transport._agents
        p2 = Producer(agent, seed=9, sidechannel=True)
        producers.append(p2)
        for t in d.kv:
            t.zero_()
        d.conn.load("after", [20, 21], p2.hold("a", [30, 31]))
        run_until([d], lambda: "after" in d.recving, timeout=20)
        assert not d.conn.last.failed, d.conn.last.failed
        want = expected(9, 2, 64, 4096)
        for k in range(2):
            assert torch.equal(d.kv[k][[20, 21]], want[k][[30, 31]])
    finally:
        d.conn.shutdown()


# --- drop, re-add and add_peer races with a dying producer ---------------------------------------------------


def test_drop_peer_under_a_read_then_the_producer_dies(producers: list[Producer], consumers: list[Consumer]) -> None:
    """drop_peer while a READ is in flight (the producer stopped), then the producer is killed.
    Expected (drop rule; "only for its current connection"): no new read can target it, a
    re-add of its agent is refused while it drains; the READ ends DISCONNECTED exactly once and
    no PeerDisconnected is reported for the dropped connection; the agent is then removed, and
    the producer restarted under the same agent name can be added and read."""
    agent = name("p")
    p1 = Producer(agent)
    producers.append(p1)
    c = Consumer()
    consumers.append(c)
    c.t.add_peer(("P", 0), p1.reply(), 1)
    c.read("w")
    c.pump(lambda: bool(c.outcomes()))
    sigstop(p1)
    c.read("a")
    c.t.progress()
    assert c.t.reads
    c.t.drop_peer(("P", 0))
    with pytest.raises(TransportError, match="no peer"):
        c.read("b")
    with pytest.raises(TransportError, match="draining"):
        c.t.add_peer(("P", 0), p1.reply(), 2)
    p1.kill()
    c.pump(lambda: not c.t.reads)
    c.t.progress()
    (a,) = c.outcomes("a")
    assert isinstance(a, HandleFailed) and a.why is HandleFailure.DISCONNECTED
    assert not c.of(PeerDisconnected)
    assert not c.t._draining and agent not in c.t._agents
    p2 = Producer(agent, seed=9)
    producers.append(p2)
    c.t.add_peer(("P", 0), p2.reply(), 3)
    c.read("c", (6, 7), (8, 9))
    c.pump(lambda: bool(c.outcomes("c")))
    assert isinstance(c.outcomes("c")[0], HandleDone)
    want = expected(9, 2, 64, 4096)
    for k in range(2):
        assert torch.equal(c.kv[k][[6, 7]], want[k][[8, 9]])


def test_add_peer_twice_for_one_key_while_its_read_is_in_flight(producers: list[Producer],
                                                                   consumers: list[Consumer]) -> None:
    """add_peer for a connected key, with the same agent, while a READ to it is in flight
    (producer stopped). Expected: refused (TransportError, the handshake is retried later),
    the live connection is untouched and its READ completes once the producer resumes; then
    the same add_peer is accepted and reads work."""
    p, c = _connected(producers, consumers, attempt=1)
    sigstop(p)
    try:
        c.read("a", (2, 3), (6, 7))
        c.t.progress()
        with pytest.raises(TransportError, match="still have reads"):
            c.t.add_peer(("P", 0), p.reply(), 2)
        live = c.t.peers[("P", 0)][0]
        assert live.attempt == 1 and live.reads == 1
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    c.pump(lambda: bool(c.outcomes("a")))
    assert isinstance(c.outcomes("a")[0], HandleDone)
    c.t.add_peer(("P", 0), p.reply(), 3)
    assert c.t.peers[("P", 0)][0].attempt == 3
    c.read("b", (4, 5), (10, 11))
    c.pump(lambda: bool(c.outcomes("b")))
    assert isinstance(c.outcomes("b")[0], HandleDone)
    want = expected(1, 2, 64, 4096)
    for k in range(2):
        assert torch.equal(c.kv[k][[2, 3, 4, 5]], want[k][[6, 7, 10, 11]])


@pytest.mark.parametrize("delay_ms", [0, 2, 10])
def test_producer_killed_during_add_peer(producers: list[Producer], consumers: list[Consumer], delay_ms: int) -> None:
    """SIGKILL races add_peer (add_remote_agent connects to the producer). Expected: add_peer
    returns within seconds, either raising TransportError (no peer left behind) or accepting;
    if accepted, the next read is accepted by post_read and ends DISCONNECTED with one
    PeerDisconnected."""
    p = Producer(name("p"))
    producers.append(p)
    c = Consumer()
    consumers.append(c)
    threading.Timer(delay_ms / 1000, p.proc.kill).start()
    t0 = time.monotonic()
    try:
        c.t.add_peer(("P", 0), p.reply())
    except TransportError:
        assert not c.t.peers and not c.t._agents
        return
    finally:
        assert time.monotonic() - t0 < 10
    p.proc.wait(10)
    time.sleep(0.1)
    c.read("a")
    c.pump(lambda: not c.t.reads)
    (a,) = c.outcomes()
    assert isinstance(a, HandleFailed) and a.why is HandleFailure.DISCONNECTED
    assert len(c.of(PeerDisconnected)) == 1


@pytest.mark.parametrize("xfer_mode", ["prepped", "descs"])
def test_blocks_at_the_edge_of_adjacent_registrations(xfer_mode: Literal["prepped", "descs"]) -> None:
    """Both ranks' two regions are views of one allocation (a layer's K and V side by side, as
    engines often allocate them), so region 0's last block is adjacent to region 1's first on
    both sides: NIXL's merge of adjacent prepared indices could make one descriptor span two
    registrations. Expected: reads of the whole table, of the last block, of the last two and
    of (last, first) are each HandleDone with exactly the paired bytes."""
    n, bb = 16, 256
    big_p = torch.randint(0, 256, (2, n, bb), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    big_d = torch.zeros(2, n, bb, dtype=torch.uint8)
    p = NixlTransport(name("p"), [big_p[0], big_p[1]])
    d = NixlTransport(name("d"), [big_d[0], big_d[1]], xfer_mode=xfer_mode)
    events: list[Event] = []
    p.bind(lambda ev: None, time.monotonic_ns)
    d.bind(events.append, time.monotonic_ns)
    try:
        d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)))
        tables = [tuple(range(n)), (n - 1,), (n - 2, n - 1), (n - 1, 0)]
        for i, table in enumerate(tables):
            big_d.zero_()
            d.post_read(PostRead(f"r{i}", "P", ReadSource(0, 0), table, table, Notification(f"p{i}", 0, 1)))
            deadline = time.monotonic() + 10
            while d.reads:
                assert time.monotonic() < deadline, "timed out"
                d.progress()
                p.progress()
            assert isinstance(events[-1], HandleDone), events[-1]
            for k in range(2):
                assert torch.equal(big_d[k][list(table)], big_p[k][list(table)]), (table, k)
    finally:
        d.close()
        p.close()


def test_connector_shutdown_with_a_read_in_flight_tells_the_producer(producers: list[Producer]) -> None:
    """A decode worker shuts down while its READ is in flight (the producer stopped: under the
    default cancel policy a cancel does not end it). The read ended only inside the transport's
    close(), so the aborted request's release notice came after it, when nothing could be sent:
    the producer kept the blocks a whole lease (120 s here) and then blamed the consumer (found by
    a helper's hunt). Now shutdown ends the reads first (``stop_reads``) and the notice goes out."""
    p = Producer(name("p"), sidechannel=True)
    producers.append(p)
    d = ConnRank()
    closed = False
    try:
        d.conn.load("w", [0, 1], p.hold("rw", [4, 5]))
        run_until([d], lambda: "w" in d.recving)
        params = p.hold("r1", [6, 7])
        sigstop(p)
        d.conn.load("d1", [2, 3], params)
        d.conn.get_finished()
        assert d.transport.reads, "the read is in flight"
        last = d.conn.shutdown()
        closed = True
        assert "d1" in last.aborted and {2, 3} <= set(last.invalid_block_ids)
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
        if not closed:
            d.conn.shutdown()
    note = p.wait_for(f"NOTE {d.transport.agent_name} r1 ").split()
    assert note[3:5] == ["0", "1"], note
