"""Concurrency review: the thread boundaries hammered for real (threads, loopback sockets, no mocks).

Events enter a core's inbox from many threads while one owner pumps; transports' worker threads,
the side channel's handshake and listener threads and the file log's writer thread run alongside.
Every test checks that nothing is lost or duplicated without being accounted for, that nothing
hangs (every wait is bounded), that memory stays bounded, and that no exception escapes a
background thread unreported.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_sidechannel import FakeServer
from transport_helpers import random_kv, zero_kv

from pdfsm.commands import PostRead
from pdfsm.connector import Connector, KVTransferParams, StepOutput
from pdfsm.core import Core
from pdfsm.errors import OwnerError
from pdfsm.events import (
    AbortRequested,
    BadMessage,
    CoreConfig,
    Dropped,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    HandshakeReply,
    NotificationReceived,
    Tick,
)
from pdfsm.filelog import LogReader
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.fsm import Fault
from pdfsm.log import EventLog, MemorySink, Overflow, Record
from pdfsm.sidechannel import (
    HEADER,
    MAGIC,
    MAX_REQUEST_BYTES,
    ErrorCode,
    ErrorReply,
    HandshakeRequest,
    SideChannelHandshaker,
    SideChannelServer,
    fetch_reply,
    pack_frame,
    request_codec,
    response_codec,
    unpack_frame,
)
from pdfsm.topology import ReadSource
from pdfsm.wire import Notification, notify_codec
from transports.sim import SimHandshaker, SimNetwork, SimTransport, pattern
from transports.torch import TorchNetwork, TorchTransport

pytestmark = pytest.mark.filterwarnings(
    "error::pytest.PytestUnhandledThreadExceptionWarning",
    "error::pytest.PytestUnraisableExceptionWarning",
)

BOUND = 2.0  # seconds any close/shutdown/join may take before it counts as a hang


@pytest.fixture(autouse=True)
def no_escaped_thread_exceptions() -> Iterator[None]:
    """Any exception that escapes a background thread during a test fails it."""
    caught: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = caught.append
    try:
        yield
    finally:
        threading.excepthook = previous
    assert not caught, [f"{a.thread.name if a.thread else '?'}: {a.exc_type.__name__}: {a.exc_value}"
                        for a in caught]


class Bounded:
    """``fn`` running on a daemon thread, so that a hang is a failed assertion, not a hung test."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.out: list[Any] = []  # its result or exception, once it ends
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="review-bounded")
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            self.out.append(exc)

    def wait(self, timeout: float = BOUND) -> bool:
        """True if it ended within ``timeout``."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


def bounded(fn: Callable[[], Any], timeout: float = BOUND) -> tuple[bool, list[Any]]:
    """(``fn`` ended within ``timeout``, [its result or exception])."""
    b = Bounded(fn)
    return b.wait(timeout), b.out


def join_all(threads: list[threading.Thread], timeout: float = BOUND) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not [t.name for t in threads if t.is_alive()], "threads still running"


def abort(k: int, i: int) -> AbortRequested:
    return AbortRequested(source=f"t{k}", t_ns=i, request_id=f"{k}-{i}")


# --- the event log's inbox ----------------------------------------------------------------------


@pytest.mark.parametrize("overflow", [Overflow.COUNT, Overflow.BLOCK], ids=["count", "block"])
def test_every_submitted_event_is_applied_or_counted_dropped_exactly_once_by_source(overflow: Overflow) -> None:
    """Six threads flood a small inbox while the owner pumps: applied + dropped == submitted per source."""
    threads_n, each, limit = 6, 1500, 32
    sink = MemorySink()
    log = EventLog(window=1 << 16, sink=sink, inbox_limit=limit, overflow=overflow)
    core = Core(CoreConfig(engine_id="D"), log)
    start = threading.Barrier(threads_n + 1)

    def produce(k: int) -> None:
        start.wait()
        for i in range(each):
            core.submit(abort(k, i))

    threads = [threading.Thread(target=produce, args=(k,), name=f"producer-{k}") for k in range(threads_n)]
    for t in threads:
        t.start()
    start.wait()
    peak = 0
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in threads) or log.inbox:
        assert time.monotonic() < deadline, "owner never caught up"
        peak = max(peak, len(log.inbox))
        core.pump()
        time.sleep(0.0002)
    join_all(threads)
    core.pump()  # drops counted after the last pump are recorded now
    records = sink.records
    assert [r.seq for r in records] == list(range(len(records)))
    applied: Counter[str] = Counter()
    order: dict[str, list[int]] = {}
    dropped: Counter[str] = Counter()
    for r in records:
        if isinstance(r.event, AbortRequested):
            applied[r.event.source] += 1
            order.setdefault(r.event.source, []).append(r.event.t_ns)
        elif isinstance(r.event, Dropped):
            assert r.event.count == sum(r.event.by_source.values()) and r.fault is Fault.LOCAL
            dropped.update(r.event.by_source)
    for k in range(threads_n):
        assert applied[f"t{k}"] + dropped[f"t{k}"] == each, k
        mine = order.get(f"t{k}", [])
        assert mine == sorted(mine)  # each producer's own order kept
    assert not log.take_dropped()
    assert peak <= limit + threads_n  # bounded: at most one in flight per producer over the limit
    if overflow is Overflow.COUNT:
        assert sum(dropped.values()) > 0
    else:
        assert not dropped


def test_pumping_on_a_new_thread_hands_ownership_over_and_the_new_owner_is_never_refused() -> None:
    """The owner is whoever pumps: its submissions go over the limit, the old owner's are refused."""
    log = EventLog(inbox_limit=1, overflow=Overflow.COUNT)
    core = Core(CoreConfig(engine_id="D"), log)
    got: list[int] = []

    def new_owner() -> None:
        core.pump()
        for i in range(5):
            core.submit(AbortRequested(source="new-owner", t_ns=i, request_id=f"n{i}"))
        got.append(core.pump())

    finished, _ = bounded(new_owner)
    assert finished and got == [5]
    for i in range(3):  # the main thread no longer owns the log: the limit applies to it now
        core.submit(AbortRequested(source="old-owner", t_ns=i, request_id=f"o{i}"))
    assert core.pump() == 1  # the one event that fitted (after the Dropped record)
    (rec,) = [r for r in log.records() if isinstance(r.event, Dropped)]
    assert isinstance(rec.event, Dropped) and rec.event.by_source == {"old-owner": 2}


@pytest.mark.parametrize("overflow", [Overflow.COUNT, Overflow.BLOCK], ids=["count", "block"])
def test_submissions_after_close_never_grow_the_inbox_past_its_bound(overflow: Overflow) -> None:
    """A thread that keeps submitting after close neither hangs nor grows the closed inbox without bound."""
    limit = 8
    log = EventLog(inbox_limit=limit, overflow=overflow)
    core = Core(CoreConfig(engine_id="D"), log)
    log.close()

    def late() -> None:
        for i in range(500):
            core.submit(AbortRequested(source="late", t_ns=i, request_id=f"r{i}"))

    finished, out = bounded(late)
    assert finished and out == [None]
    assert len(log.inbox) <= limit, f"{len(log.inbox)} events queued in a closed log (bound {limit})"


# --- the torch transport: worker threads submit into the owner's log ---------------------------------


def _torch_pair(log: EventLog, *, reads: int, latency_s: float) -> tuple[Core, TorchTransport, TorchTransport]:
    tnet = TorchNetwork()
    p = TorchTransport(tnet, "p", random_kv(1, 16, 64, seed=1))
    d = TorchTransport(tnet, "d", zero_kv(1, 16, 64), latency_s=latency_s, workers=2)
    core = Core(CoreConfig(engine_id="D"), log)
    p.bind(lambda ev: None, time.monotonic_ns)
    d.bind(core.submit, time.monotonic_ns)
    d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)))
    for i in range(reads):
        d.post_read(PostRead(f"r{i}", "P", ReadSource(0, 0), (i,), (i,), Notification(f"p{i}", 0, 1)))
    return core, p, d


def test_torch_close_with_a_full_blocking_inbox_returns_and_every_read_is_reported() -> None:
    """close() waits for the workers, which report into a full BLOCK inbox: inside owner_waiting()
    (as its docstring asks, and the Connector does) it must not deadlock."""
    log = EventLog(inbox_limit=2, overflow=Overflow.BLOCK)
    core, p, d = _torch_pair(log, reads=6, latency_s=10.0)

    def close() -> None:
        with log.owner_waiting():
            d.close()

    closing = Bounded(close)
    finished = closing.wait()
    if not finished:  # unblock the workers (a closed log stops BLOCK waits) so the test can end
        log.close()
        assert closing.wait(5)
    core.pump()
    core.pump()
    p.close()
    cancelled = sorted(r.event.request_id for r in log.records() if isinstance(r.event, HandleFailed)
                       and r.event.why is HandleFailure.CANCELLED)
    assert finished, "TorchTransport.close() deadlocked: its workers wait for room the owner never makes"
    assert cancelled == sorted(f"r{i}" for i in range(6))


def test_connector_shutdown_with_a_small_blocking_inbox_and_reads_in_flight_returns() -> None:
    """shutdown() with more reads in flight than inbox room ends, reporting each request aborted once."""
    tnet, net = TorchNetwork(), SimNetwork()
    pt = TorchTransport(tnet, "p", random_kv(1, 32, 64, seed=1))
    dt = TorchTransport(tnet, "d", zero_kv(1, 32, 64), latency_s=10.0, workers=2)
    prefill = Connector(CoreConfig(engine_id="P"), pt, SimHandshaker(net), host="p-host", port=1)
    reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, num_blocks=32, ranks=(pt.rank_info(),))
    net.serve("p-host", 1, lambda pp: reply)
    log = EventLog(inbox_limit=4, overflow=Overflow.BLOCK)
    decode = Connector(CoreConfig(engine_id="D"), dt, SimHandshaker(net), log=log)
    for i in range(8):
        decode.load(f"d{i}", [i], prefill.request_finished(f"p{i}", [i]))
    for _ in range(4):
        decode.get_finished()
    assert len(dt.reads) == 8
    stopping = Bounded(decode.shutdown)
    finished = stopping.wait()
    if not finished:  # unblock the workers (a closed log stops BLOCK waits) so the test can end
        log.close()
        assert stopping.wait(10)
    prefill.shutdown()
    (last,) = stopping.out
    assert isinstance(last, StepOutput)
    assert last.aborted == frozenset(f"d{i}" for i in range(8))
    assert finished, "Connector.shutdown() deadlocked in transport.close() against a full BLOCK inbox"


def test_aborts_racing_completing_reads_report_each_request_once_and_never_while_its_read_runs() -> None:
    """Aborts from the owner race reads finishing on worker threads: one report each, after the read."""
    tnet, net = TorchNetwork(), SimNetwork()
    p_kv = random_kv(2, 64, 256, seed=3)
    d_kv = zero_kv(2, 64, 256)
    pt = TorchTransport(tnet, "p", p_kv)
    dt = TorchTransport(tnet, "d", d_kv, latency_s=0.001, workers=4)
    prefill = Connector(CoreConfig(engine_id="P"), pt, SimHandshaker(net), host="p-host", port=1)
    decode = Connector(CoreConfig(engine_id="D"), dt, SimHandshaker(net))
    reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, num_blocks=64, ranks=(pt.rank_info(),))
    net.serve("p-host", 1, lambda pp: reply)
    rng = random.Random(11)
    n = 60
    free = list(range(64))
    tables: dict[str, tuple[list[int], list[int]]] = {}
    abort_at: dict[str, int] = {}
    reported: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    outcomes: dict[str, str] = {}
    started, step = 0, 0
    deadline = time.monotonic() + 10
    while len(reported) < n or len(sent) < n:
        assert time.monotonic() < deadline, (sorted(set(tables) - set(reported)), n - len(sent),
                                             {k: m.state.name for k, m in decode.core.consumers.items()},
                                             {k: m.state.name for k, m in prefill.core.producers.items()})
        # The first request connects the engine undisturbed: a request aborted while its handshake
        # runs notifies nobody (docs/decisions.md), so racing starts once the engine is connected.
        while started < n and len(free) >= 2 and started - len(reported) < 16 and (started == 0 or reported):
            rid = f"d{started}"
            local, remote = [free.pop(), free.pop()], rng.sample(range(64), 2)
            tables[rid] = (local, remote)
            decode.load(rid, local, prefill.request_finished(f"p{started}", remote))
            if started and rng.random() < 0.5:
                abort_at[rid] = step + rng.randrange(3)
            started += 1
        for rid, at in list(abort_at.items()):
            if at <= step and rid not in reported:
                decode.abort(rid)
                del abort_at[rid]
        _, recving = decode.get_finished()
        with dt._reads_lock:
            running = {key[0] for key in dt.reads}
        assert not recving & running, "reported while its read still runs"
        for h in decode.last.failed:
            outcomes[h.request_id] = "failed"
        for rid in recving:
            reported[rid] += 1
            outcomes.setdefault(rid, "aborted" if rid in decode.last.aborted else "received")
            local, remote = tables[rid]
            if outcomes[rid] == "received":
                for k in range(2):
                    assert torch.equal(d_kv[k][local], p_kv[k][remote]), rid
            free += local
        sent.update(prefill.get_finished()[0])
        step += 1
        time.sleep(0.0005)
    decode.shutdown()
    prefill.shutdown()
    assert set(reported) == set(tables) and set(reported.values()) == {1}
    assert set(sent) == {f"p{i}" for i in range(n)} and set(sent.values()) == {1}
    assert "aborted" in outcomes.values() and "received" in outcomes.values()
    for conn in (decode, prefill):
        assert conn.core.rejections == {Fault.LOCAL: 0, Fault.REMOTE: 0}
        assert not conn.core.consumers


def test_one_producer_takes_notifications_from_consumers_stepping_on_their_own_threads() -> None:
    """Four decode connectors, each owned by its own thread, handshake over TCP and read from one
    producer; the producer's inbox takes their notifications concurrently and releases each hold once."""
    consumers, each = 4, 10
    tnet = TorchNetwork()
    p_kv = random_kv(1, 64, 128, seed=9)
    pt = TorchTransport(tnet, "P0", p_kv)
    reply = HandshakeReply(engine_id="P", compat_hash="h", tp_size=1, num_blocks=64, ranks=(pt.rank_info(),))
    errors: list[BaseException] = []
    received: dict[int, Counter[str]] = {j: Counter() for j in range(consumers)}
    with SideChannelServer(lambda pp: reply) as server:
        prefill = Connector(CoreConfig(engine_id="P", compat_hash="h"), pt, SimHandshaker(SimNetwork()),
                            port=server.port)
        rng = random.Random(5)
        work: dict[int, list[tuple[str, list[int], KVTransferParams]]] = {}
        for j in range(consumers):
            work[j] = []
            for i in range(each):
                remote = rng.sample(range(64), 2)
                params = prefill.request_finished(f"p{j}-{i}", remote)
                work[j].append((f"d{j}-{i}", remote, params))
        transports = [TorchTransport(tnet, f"D{j}", zero_kv(1, 2 * each, 128), latency_s=0.001, workers=2)
                      for j in range(consumers)]

        def consumer(j: int) -> None:
            try:
                conn = Connector(CoreConfig(engine_id=f"D{j}", compat_hash="h"), transports[j],
                                 SideChannelHandshaker(f"D{j}", timeout=2.0))
                for i, (rid, _, params) in enumerate(work[j]):
                    conn.load(rid, [2 * i, 2 * i + 1], params)
                deadline = time.monotonic() + 8
                while sum(received[j].values()) < each and time.monotonic() < deadline:
                    received[j].update(conn.get_finished()[1])
                    assert not conn.last.failed, conn.last.failed
                    time.sleep(0.0005)
                conn.shutdown()
                for i, (_, remote, _) in enumerate(work[j]):
                    assert torch.equal(transports[j].tensors[0][[2 * i, 2 * i + 1]], p_kv[0][remote])
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                errors.append(exc)

        threads = [threading.Thread(target=consumer, args=(j,), name=f"consumer-{j}") for j in range(consumers)]
        for t in threads:
            t.start()
        sent: Counter[str] = Counter()
        expired: set[str] = set()
        deadline = time.monotonic() + 10
        while len(sent) < consumers * each and time.monotonic() < deadline and not errors:
            sent.update(prefill.get_finished()[0])
            expired |= prefill.last.expired
            time.sleep(0.0005)
        join_all(threads, 10)
        prefill.shutdown()
        assert server.stats()["served"] == consumers  # one handshake per consumer engine
    assert not errors, errors
    for j in range(consumers):
        assert received[j] == Counter({f"d{j}-{i}": 1 for i in range(each)})
    assert sent == Counter({f"p{j}-{i}": 1 for j in range(consumers) for i in range(each)}) and not expired
    notes = [r for r in prefill.core.log.records() if isinstance(r.event, NotificationReceived)]
    assert len(notes) == consumers * each
    assert not [r for r in prefill.core.log.records() if isinstance(r.event, BadMessage)]
    assert prefill.core.rejections == {Fault.LOCAL: 0, Fault.REMOTE: 0}


def test_notifications_delivered_from_many_threads_are_each_submitted_once_in_sender_order() -> None:
    """Eight sender threads deliver into one agent's inbox while its owner drains it with progress()."""
    senders, each = 8, 300
    tnet = TorchNetwork()
    sink = MemorySink()
    core = Core(CoreConfig(engine_id="P", max_staged=1 << 16), EventLog(window=1 << 16, sink=sink))
    p = TorchTransport(tnet, "P0", zero_kv(1, 4, 16))
    p.bind(core.submit, time.monotonic_ns)
    start = threading.Barrier(senders + 1)

    def send(k: int) -> None:
        start.wait()
        for i in range(each):
            tnet.deliver(f"D{k}", "P0", notify_codec.encode(Notification(f"r{k}-{i}", 0, 2)))

    threads = [threading.Thread(target=send, args=(k,), name=f"sender-{k}") for k in range(senders)]
    for t in threads:
        t.start()
    start.wait()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) or p.inbox:
        assert time.monotonic() < deadline
        p.progress()
        core.pump()
    join_all(threads)
    p.progress()
    core.pump()
    p.close()
    by_sender: dict[str, list[str]] = {}
    for r in sink.records:
        if isinstance(r.event, NotificationReceived):
            by_sender.setdefault(r.event.sender, []).append(r.event.request_id)
    assert by_sender == {f"D{k}": [f"r{k}-{i}" for i in range(each)] for k in range(senders)}


# --- the side channel: listener threads and handshake threads -----------------------------------------


def _reply(pp_rank: int) -> HandshakeReply:
    if pp_rank > 0:
        raise LookupError(pp_rank)
    return HandshakeReply(engine_id="P", compat_hash="h", tp_size=1, num_blocks=64)


def _request(pp_rank: int = 0) -> bytes:
    body = request_codec.encode(HandshakeRequest(version=1, engine_id="D", pp_rank=pp_rank, nonce=b"N" * 16))
    return pack_frame(body, secret=None, kind="request")


def _exchange(port: int, data: bytes, timeout: float = 3.0) -> str:
    """Send ``data``, half-close, and return the error code of the reply (or "" for none)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        raw = b""
        try:
            while chunk := s.recv(65536):
                raw += chunk
        except OSError:
            pass
    if not raw:
        return ""
    msg = response_codec.decode(unpack_frame(raw, secret=None, kind="reply", cap=1 << 20))
    return msg.code if isinstance(msg, ErrorReply) else "ok"


def test_listener_serves_honest_clients_promptly_while_slow_malformed_and_oversized_ones_hammer_it() -> None:
    """36 concurrent clients: slowloris ones hold their slot until io_timeout, oversized ones are refused
    from the header, malformed ones get an error reply, and every honest one is answered at once."""
    io_timeout = 1.2
    slow_n, big_n, bad_n, good_n = 8, 8, 4, 16
    with SideChannelServer(_reply, io_timeout=io_timeout, max_connections=64) as server:
        slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(slow_n)]
        try:
            for s in slow:
                s.sendall(_request()[:3])  # a few bytes of the header, then nothing
            t0 = time.monotonic()
            results: dict[str, list[Any]] = {"good": [], "big": [], "bad": []}
            lock = threading.Lock()

            def good() -> None:
                started = time.monotonic()
                r = fetch_reply("127.0.0.1", server.port, engine_id="D", pp_rank=0, timeout=3.0)
                with lock:
                    results["good"].append((r == _reply(0), time.monotonic() - started))

            def big(i: int) -> None:  # over the request cap by one byte, or absurdly
                length = MAX_REQUEST_BYTES + 1 if i % 2 else 1 << 31
                code = _exchange(server.port, HEADER.pack(MAGIC, 0, 0, length) + b"\0" * 4096)
                with lock:
                    results["big"].append(code)

            def bad() -> None:
                code = _exchange(server.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                with lock:
                    results["bad"].append(code)

            threads = ([threading.Thread(target=good) for _ in range(good_n)]
                       + [threading.Thread(target=big, args=(i,)) for i in range(big_n)]
                       + [threading.Thread(target=bad) for _ in range(bad_n)])
            for t in threads:
                t.start()
            join_all(threads, 3)
            honest_done = time.monotonic() - t0
            for s in slow:
                s.settimeout(3)
            slow_codes = []
            for s in slow:
                raw = s.recv(65536)
                msg = response_codec.decode(unpack_frame(raw, secret=None, kind="reply", cap=1 << 20))
                slow_codes.append(msg.code if isinstance(msg, ErrorReply) else "ok")
        finally:
            for s in slow:
                s.close()
        assert [ok for ok, _ in results["good"]] == [True] * good_n
        assert honest_done < io_timeout, f"honest clients waited {honest_done:.2f} s behind slow ones"
        assert results["big"] == [ErrorCode.TOO_LARGE] * big_n
        assert results["bad"] == [ErrorCode.MALFORMED] * bad_n
        assert slow_codes == [ErrorCode.TIMEOUT] * slow_n
        deadline = time.monotonic() + 2
        while server.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.005)
        stats = server.stats()
        assert stats["served"] == good_n and stats["crashes"] == 0 and stats["active"] == 0
        assert stats["refused"] == {ErrorCode.TIMEOUT: slow_n, ErrorCode.TOO_LARGE: big_n,
                                    ErrorCode.MALFORMED: bad_n}
        assert server.alive


def test_listener_close_with_slow_connections_stops_every_thread_promptly() -> None:
    """close() while many slowloris connections hold handler threads (io_timeout 30 s) ends at once."""
    server = SideChannelServer(_reply, io_timeout=30.0).start()
    port = server.port
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    try:
        for s in slow:
            s.sendall(_request()[:5])
        deadline = time.monotonic() + 2
        while server.stats()["active"] < 10 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server.stats()["active"] == 10
        t0 = time.monotonic()
        finished, _ = bounded(server.close)
        assert finished and time.monotonic() - t0 < 3.0  # returned, not hung on the silent peers
        assert not server.alive
        names = [t.name for t in threading.enumerate() if t.name.startswith("pdfsm-sidechannel")
                 and (t.name.endswith(f":{port}") or "-conn:" in t.name)]
        assert not names, names
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    finally:
        for s in slow:
            s.close()


def _dead_port() -> int:
    s = socket.create_server(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def test_concurrent_handshakes_to_many_engines_make_one_attempt_each_and_report_every_request_once() -> None:
    """Handshake threads answer while the owner steps: per engine one attempt, every request reported once."""
    net = SimNetwork()
    producers = {name: SimTransport(net, f"{name}_0") for name in ("P1", "P4")}
    for x in producers.values():
        x.fill(range(8))

    def reply_for(name: str, x: SimTransport) -> Callable[[int], HandshakeReply]:
        reply = HandshakeReply(engine_id=name, compat_hash="h", tp_size=1, num_blocks=64, ranks=(x.rank_info(),))
        return lambda pp: reply

    servers = {name: SideChannelServer(reply_for(name, x)).start() for name, x in producers.items()}
    silent = FakeServer(None)  # accepts and never answers
    ports = {"P1": servers["P1"].port, "P2": silent.port, "P3": _dead_port(), "P4": servers["P4"].port}
    d_xfer = SimTransport(net, "D0")
    sink = MemorySink()
    decode = Connector(CoreConfig(engine_id="D", compat_hash="h"), d_xfer,
                       SideChannelHandshaker("D", timeout=0.6, connect_timeout=0.6, max_workers=2),
                       log=EventLog(sink=sink))
    try:
        rids = {}
        block = 0
        for name, port in ports.items():
            for i in range(6):
                rid = f"{name}-{i}"
                rids[rid] = name
                decode.load(rid, [block], KVTransferParams(remote_tp_size=1, lease_ns=60_000_000_000,
                                                           remote_engine_id=name, remote_request_id=f"r{i}",
                                                           remote_port=port, remote_block_ids=(i,)))
                block += 1
        reported: Counter[str] = Counter()
        failed: set[str] = set()
        deadline = time.monotonic() + 3
        while len(reported) < len(rids) and time.monotonic() < deadline:
            reported.update(decode.get_finished()[1])
            failed |= {h.request_id for h in decode.last.failed if h.policy == "recompute"}
            time.sleep(0.002)
        decode.shutdown()
    finally:
        for s in servers.values():
            s.close()
        silent.close()
    assert reported == Counter(dict.fromkeys(rids, 1))
    assert failed == {rid for rid, name in rids.items() if name in ("P2", "P3")}
    outcomes = Counter(r.event.engine_id for r in sink.records if isinstance(r.event, HandshakeDone | HandshakeFailed))
    assert outcomes == Counter({"P1": 1, "P2": 1, "P3": 1, "P4": 1})
    assert all(s.stats()["served"] == 1 for s in servers.values())
    for rid, name in rids.items():
        if name in producers:
            assert d_xfer.block(list(rids).index(rid)) == pattern(f"{name}_0", int(rid.split("-")[1]), 64)
    assert decode.core.rejections[Fault.LOCAL] == 0


def test_shutdown_during_a_hanging_handshake_returns_promptly_and_reports_the_request_once() -> None:
    """A handshake stuck on a silent peer (30 s timeout) does not hold shutdown, nor submit afterwards."""
    silent = FakeServer(None)  # accepts and never answers
    log = EventLog()
    decode = Connector(CoreConfig(engine_id="D", compat_hash="h"), SimTransport(SimNetwork(), "D0"),
                       SideChannelHandshaker("D", timeout=30.0, connect_timeout=30.0), log=log)
    try:
        decode.load("r", [0], KVTransferParams(remote_tp_size=1, lease_ns=60_000_000_000,
                                               remote_engine_id="P", remote_request_id="p", remote_port=silent.port,
                                               remote_block_ids=(0,)))
        decode.get_finished()
        deadline = time.monotonic() + 2
        while not silent.conns and time.monotonic() < deadline:
            time.sleep(0.005)
        assert silent.conns  # the handshake thread is waiting on the silent peer
        t0 = time.monotonic()
        finished, out = bounded(decode.shutdown)
        assert finished and time.monotonic() - t0 < 4.0  # returned, not hung on the silent peer
        (last,) = out
        assert isinstance(last, StepOutput) and last.aborted == {"r"} and last.finished_recving == {"r"}
        seq = log.next_seq
        time.sleep(0.2)
        assert log.next_seq == seq and not log.inbox  # the abandoned attempt submits nothing later
    finally:
        silent.close()


# --- the file log's writer thread ------------------------------------------------------------------------


def test_count_inbox_and_count_writer_account_for_every_event_as_a_record_a_gap_or_a_drop(tmp_path: Path) -> None:
    """Bursts from four threads past a small COUNT inbox and a slow COUNT writer: each submitted event is
    in the file, inside a gap frame, or in a Dropped count, exactly once."""
    threads_n, each = 4, 800
    acks: list[int] = []

    def slow_ack(seq: int) -> None:  # on the writer thread: makes the writer slower than the owner
        acks.append(seq)
        time.sleep(0.003)

    sink = FileSink(tmp_path / "log", fsync=FsyncPolicy.always(), queue_rows=16, overflow=Overflow.COUNT,
                    on_ack=slow_ack)
    log = EventLog(window=1 << 16, sink=sink, inbox_limit=64, overflow=Overflow.COUNT)
    core = Core(CoreConfig(engine_id="D"), log)
    start = threading.Barrier(threads_n + 1)

    def produce(k: int) -> None:
        start.wait()
        for i in range(each):
            core.submit(abort(k, i))
            if i % 50 == 0:
                time.sleep(0.0005)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(threads_n)]
    for t in threads:
        t.start()
    start.wait()
    while any(t.is_alive() for t in threads) or log.inbox:
        core.pump()
        time.sleep(0.0003)
    join_all(threads)
    core.pump()
    finished, out = bounded(log.close, 5)
    assert finished and out == [None]
    reader = LogReader(tmp_path / "log")
    in_file = [r.seq for r in reader]
    in_gaps = [s for g in reader.gaps for s in range(g.first_seq, g.first_seq + g.count)]
    assert sorted(in_file + in_gaps) == list(range(log.next_seq))  # each seq exactly once
    assert len(in_gaps) == sink.lost > 0
    assert acks == sorted(acks) and acks[-1] == log.next_seq - 1
    applied: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for r in log.records():  # the whole run is in the window
        if isinstance(r.event, AbortRequested):
            applied[r.event.source] += 1
        elif isinstance(r.event, Dropped):
            dropped.update(r.event.by_source)
    assert {f"t{k}": applied[f"t{k}"] + dropped[f"t{k}"] for k in range(threads_n)} == dict.fromkeys(
        (f"t{k}" for k in range(threads_n)), each)
    assert sum(dropped.values()) > 0


def test_close_while_blocked_producers_and_a_slow_writer_push_back_neither_hangs_nor_loses_a_record(
        tmp_path: Path) -> None:
    """Producers wait for the owner, the owner waits for a slow writer (BLOCK both): close ends the
    chain within bound and every seq the core assigned is in the file, acknowledged in order."""
    acks: list[int] = []

    def slow_ack(seq: int) -> None:
        acks.append(seq)
        time.sleep(0.002)

    sink = FileSink(tmp_path / "log", fsync=FsyncPolicy.always(), queue_rows=8, on_ack=slow_ack)
    log = EventLog(window=1 << 16, sink=sink, inbox_limit=32, overflow=Overflow.BLOCK)
    core = Core(CoreConfig(engine_id="D"), log)
    stop = threading.Event()

    def produce(k: int) -> None:
        i = 0
        while not stop.is_set():
            core.submit(abort(k, i))
            i += 1

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(40):
            core.pump()
        finished, out = bounded(log.close)
        assert finished and out == [None]
    finally:
        stop.set()
        join_all(threads)
    records = list(LogReader(tmp_path / "log"))
    assert [r.seq for r in records] == list(range(log.next_seq)) and records == log.records()
    assert acks == sorted(set(acks)) and acks[-1] == log.next_seq - 1 and sink.lost == 0
    assert not [r for r in records if isinstance(r.event, Dropped)]


def test_a_pump_while_another_thread_pumps_is_refused_with_owner_error() -> None:
    """Two threads pumping one core would corrupt its seqs: the second raises OwnerError, nothing lost."""
    entered, release = threading.Event(), threading.Event()

    class SlowSink(MemorySink):
        def write(self, records: Sequence[Record]) -> None:
            entered.set()
            release.wait(5)
            super().write(records)

    sink = SlowSink()
    core = Core(CoreConfig(engine_id="D"), EventLog(sink=sink))
    core.submit(Tick(source="timer", t_ns=1))
    pumping = threading.Thread(target=core.pump)
    pumping.start()
    assert entered.wait(5)
    core.submit(Tick(source="timer", t_ns=2))
    with pytest.raises(OwnerError, match="one owner at a time"):
        core.pump()
    release.set()
    pumping.join(5)
    assert core.pump() == 1  # the refused pump took nothing: the second tick is applied now
    assert [r.seq for r in sink.records] == list(range(len(sink.records)))
