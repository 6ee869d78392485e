"""Handshake scheduling: another engine's hung listener must never fail, nor hold up, a handshake
to a healthy engine (docs/side-channel.md, "Scheduling").

A stopped (SIGSTOPped, hung) prefill's listening socket still completes TCP connects (the
kernel's backlog), so each handshake to it holds a worker for the whole attempt timeout. The
field analogues: SGLang PR 34289 / 34692 (a bootstrap that stays reachable and never answers
stalls the decode's bootstraps to other prefills), google/tpu-sync PR 853 (one slow peer
starving a shared handshake pool). Real sockets on 127.0.0.1 only; a hung listener is a
listening socket nobody accepts from."""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
from helpers import eventually, reply

from pdfsm.commands import StartHandshake
from pdfsm.connector import Connector, KVTransferParams
from pdfsm.engine import EngineState
from pdfsm.events import CoreConfig, Event, HandshakeDone, HandshakeFailed, HandshakeReply
from pdfsm.sidechannel import SideChannelHandshaker, SideChannelServer
from transports.sim import SimNetwork, SimTransport


def healthy_reply(pp_rank: int) -> HandshakeReply:
    return reply("H", pp_rank=pp_rank)


@contextmanager
def hung_listeners(n: int) -> Iterator[list[int]]:
    """``n`` stopped processes: each socket listens (connects complete), nothing ever answers."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=16)) for _ in range(n)]
        yield [s.getsockname()[1] for s in socks]


@contextmanager
def handshaker(**kw: object) -> Iterator[tuple[SideChannelHandshaker, queue.Queue[Event]]]:
    hs = SideChannelHandshaker("D", **kw)  # type: ignore[arg-type]
    inbox: queue.Queue[Event] = queue.Queue()
    hs.bind(inbox.put, time.monotonic_ns)
    try:
        yield hs, inbox
    finally:
        hs.close()


def start(engine_id: str, port: int, *, attempt: int = 1, pp_rank: int = 0) -> StartHandshake:
    return StartHandshake(engine_id=engine_id, pp_rank=pp_rank, attempt=attempt, host="127.0.0.1", port=port)


def outcomes(inbox: queue.Queue[Event], n: int, timeout: float = 4.0) -> list[HandshakeDone | HandshakeFailed]:
    got = [inbox.get(timeout=timeout) for _ in range(n)]
    assert all(isinstance(e, HandshakeDone | HandshakeFailed) for e in got), got
    return got  # type: ignore[return-value]


def test_sglang_pr_34692_hung_listeners_do_not_fail_a_healthy_engines_handshake() -> None:
    """The reviewer's s4: eight hung prefills are handshaken, then a healthy H. H's reply comes at
    once, before any hung attempt ends; each hung attempt fails on its own timeout. Before the fix
    (4 shared workers, time queued counted against the deadline) H failed after the whole timeout
    with "deadline passed while queued behind other handshakes", blamed on H."""
    with SideChannelServer(healthy_reply) as srv, hung_listeners(8) as hung, handshaker(timeout=1.0) as (hs, inbox):
        for i, port in enumerate(hung):
            hs.start(start(f"P{i}", port))
        hs.start(start("H", srv.port))
        first = inbox.get(timeout=4)  # before any hung attempt's timeout: they are still running
        assert isinstance(first, HandshakeDone) and first.engine_id == "H", first
        rest = outcomes(inbox, 8)
        assert all(isinstance(e, HandshakeFailed) and "no answer within" in e.error for e in rest), rest
        assert sorted(e.engine_id for e in rest) == [f"P{i}" for i in range(8)]


def test_sglang_pr_34692_a_healthy_engine_connects_through_the_connector_while_eight_prefills_hang() -> None:
    """The same, end to end through the Connector and its core: H's request is received and H's
    engine CONNECTED (no HandshakeFailed, no retry pause) while the hung prefills' requests wait."""
    net = SimNetwork()
    ht = SimTransport(net, "H-0")
    ht.fill(range(64))
    with (SideChannelServer(lambda pp: reply("H", ranks=(ht.rank_info(),), num_blocks=64)) as srv,
          hung_listeners(8) as hung):
        d = Connector(CoreConfig(engine_id="D", compat_hash="h"), SimTransport(net, "D-0"),
                      SideChannelHandshaker("D", timeout=1.0))
        try:
            def params(engine: str, port: int, rid: str) -> KVTransferParams:
                return KVTransferParams(remote_engine_id=engine, remote_request_id=rid, remote_host="127.0.0.1",
                                        remote_port=port, remote_block_ids=(1, 2), remote_tp_size=1,
                                        lease_ns=120 * 10**9)

            for i, port in enumerate(hung):
                d.load(f"r{i}", [10 + 2 * i, 11 + 2 * i], params(f"P{i}", port, f"p{i}"))
            d.get_finished()
            d.load("rH", [40, 41], params("H", srv.port, "h1"))
            got: set[str] = set()
            failed: dict[str, str] = {}

            def received() -> bool:
                got.update(d.get_finished()[1])
                failed.update({f.request_id: f.reason for f in d.last.failed})
                return "rH" in got

            assert eventually(received, timeout=4.0)
            assert "rH" not in failed, failed["rH"]
            assert got == {"rH"}  # before the hung prefills' requests: their attempts still run
            assert d.core.engines[("H", 0)].state is EngineState.CONNECTED
        finally:
            d.shutdown()


def test_sglang_pr_34289_time_queued_behind_a_hung_listener_does_not_count_against_a_healthy_attempt() -> None:
    """One worker, held by a hung listener for its whole 0.6 s timeout: H waits that long for the
    worker, then gets its own full timeout (the core bounds the total: handshake_timeout_ns).
    Before the fix the wait used H's deadline up and H failed unasked."""
    with (SideChannelServer(healthy_reply) as srv, hung_listeners(1) as hung,
          handshaker(timeout=0.6, max_workers=1) as (hs, inbox)):
        hs.start(start("P", hung[0]))
        hs.start(start("H", srv.port))
        first, second = outcomes(inbox, 2)
        assert isinstance(first, HandshakeFailed) and first.engine_id == "P", first
        assert isinstance(second, HandshakeDone) and second.engine_id == "H", second


def test_tpu_sync_pr_853_a_saturated_pool_gives_its_next_free_worker_to_the_healthy_engine() -> None:
    """More hung listeners than workers: H cannot start at once, but takes the first worker freed,
    before the hung listeners' attempts that waited longer (their last attempt timed out)."""
    with (SideChannelServer(healthy_reply) as srv, hung_listeners(4) as hung,
          handshaker(timeout=0.4, max_workers=2, max_per_destination=1) as (hs, inbox)):
        names = ["A", "B", "C", "D"]
        for name, port in zip(names, hung, strict=True):  # round 1: each times out, the pool learns it
            hs.start(start(name, port))
        assert all(isinstance(e, HandshakeFailed) for e in outcomes(inbox, 4))
        # A worker reports, then lets go of its attempt and thread: wait for that before round 2.
        assert eventually(lambda: hs.stats() == {"waiting": 0, "running": 0, "threads": 0})
        for name, port in zip(names, hung, strict=True):  # round 2: A and B run, C and D wait
            hs.start(start(name, port, attempt=2))
        assert hs.stats() == {"waiting": 2, "running": 2, "threads": 2}
        hs.start(start("H", srv.port))
        order = outcomes(inbox, 5)
        done = next(i for i, e in enumerate(order) if isinstance(e, HandshakeDone))
        assert order[done].engine_id == "H"
        assert {"C", "D"} <= {e.engine_id for e in order[done + 1:]}, order  # H went before them


def test_one_hung_listener_holds_at_most_max_per_destination_workers() -> None:
    """Six PP ranks of a hung prefill: two run, four wait behind their own listener, and the pool
    still has workers for anyone else."""
    with (SideChannelServer(healthy_reply) as srv, hung_listeners(1) as hung,
          handshaker(timeout=1.0, max_workers=4, max_per_destination=2) as (hs, inbox)):
        for pp in range(6):
            hs.start(start("P", hung[0], pp_rank=pp))
        assert hs.stats() == {"waiting": 4, "running": 2, "threads": 2}
        hs.start(start("H", srv.port))
        ev = inbox.get(timeout=4)
        assert isinstance(ev, HandshakeDone) and ev.engine_id == "H"  # while the hung attempts still run
        assert eventually(lambda: hs.stats() == {"waiting": 4, "running": 2, "threads": 2})


def test_a_full_queue_fails_the_attempt_at_once_as_a_local_overload_without_trying_the_remote() -> None:
    """The waiting attempts are bounded (max_queued). One more fails at once, saying the overload
    is here and the remote was not tried; the healthy listener sees no connection."""
    with (SideChannelServer(healthy_reply) as srv, hung_listeners(1) as hung,
          handshaker(timeout=1.0, max_workers=1, max_queued=2) as (hs, inbox)):
        for attempt in (1, 2, 3):  # one runs, two wait: the queue is full
            hs.start(start("P", hung[0], attempt=attempt, pp_rank=attempt))
        hs.start(start("H", srv.port))
        ev = inbox.get(timeout=1)  # at once: the running attempt's own timeout is still ahead
        assert isinstance(ev, HandshakeFailed) and ev.engine_id == "H", ev
        assert "overloaded here" in ev.error and "was not tried" in ev.error, ev.error
        assert srv.stats()["served"] == 0 and not srv.stats()["refused"]


def test_attempts_the_core_gave_up_on_do_not_fill_the_queue_behind_a_hung_listener() -> None:
    """The core times an unanswered attempt out (handshake_timeout_ns, shorter than the
    handshaker's own timeout) and starts the next: the superseded attempts still waiting were
    kept, ran for nothing, and filled the queue until a healthy engine's handshake was refused
    as "overloaded here" (found by review). A newer attempt of an engine and stage replaces its
    waiting older ones, which nobody waits for (their answers would be stale): each fails at once,
    not tried (an outcome per attempt, as ever)."""
    with (SideChannelServer(healthy_reply) as srv, hung_listeners(1) as hung,
          handshaker(timeout=1.0, max_workers=1, max_queued=2) as (hs, inbox)):
        for attempt in range(1, 8):
            hs.start(start("P", hung[0], attempt=attempt))
        assert hs.stats() == {"waiting": 1, "running": 1, "threads": 1}
        with hs._lock:
            assert [c.attempt for q in hs._waiting.values() for c in q] == [7]
        superseded = outcomes(inbox, 5)  # 2..6, at once, never run
        assert [e.attempt for e in superseded] == [2, 3, 4, 5, 6]
        assert all(isinstance(e, HandshakeFailed) and "superseded" in e.error for e in superseded)
        hs.start(start("H", srv.port))  # the queue has room: it waits its turn, it is not refused
        got = outcomes(inbox, 2)
        assert [e.engine_id for e in got] == ["P", "H"] and isinstance(got[1], HandshakeDone)
        assert got[0].attempt == 1  # the running attempt ends (timed out)


def test_worker_threads_stay_bounded_and_exit_when_idle() -> None:
    """Threads start on demand, never more than max_workers, and go once nothing can run."""
    seen: list[int] = []
    with hung_listeners(6) as hung, handshaker(timeout=0.3, max_workers=3) as (hs, inbox):
        for i, port in enumerate(hung):
            hs.start(start(f"P{i}", port))
            seen.append(hs.stats()["threads"])
        assert len(outcomes(inbox, 6)) == 6
        assert eventually(lambda: hs.stats() == {"waiting": 0, "running": 0, "threads": 0})
    assert max(seen) <= 3, seen


@pytest.mark.parametrize("bad", [{"max_workers": 0}, {"max_per_destination": 0}, {"max_queued": -1},
                                 {"max_workers": 2.5}])
def test_pool_bounds_must_be_positive_ints(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be a positive int"):
        SideChannelHandshaker("D", **bad)  # type: ignore[arg-type]
